// `swactor run --timeline` through the real program (`node dist/main.js`, local agents over loopback, the live engine
// on stories260K, 2 stages): the JSON summary's timeline names every stage and link, its parts are never negative, and
// they add up to the token's wall time measured at the orchestrator, per stage and along the token's path (stages and
// links). That is what makes the timeline trustworthy: no time lost, none counted twice.
import { execFile } from "node:child_process"
import { describe, expect, it } from "vitest"
import { swactorMain } from "../../src/layers/agent/AgentProcesses.js"
import type { RunSummary } from "../../src/services/Orchestrator.js"
import { timelineComponents } from "../../src/services/Timeline.js"
import { repoRoot, requireModel } from "../support/models.js"
import { runJsonArgs, runJsonOutput } from "../support/runJson.js"

const swactor = (args: ReadonlyArray<string>) =>
  new Promise<{ readonly code: number; readonly stdout: string; readonly stderr: string }>((resolve) => {
    execFile(
      process.execPath,
      [swactorMain(), ...args],
      { cwd: repoRoot, env: { ...process.env, SWACTOR_CLUSTER_TOKEN: undefined }, timeout: 120_000 },
      (error, stdout, stderr) =>
        resolve({ code: error ? (typeof error.code === "number" ? error.code : 1) : 0, stdout, stderr })
    )
  })

/**
 * Within 10% of the wall time (and 0.1 ms). The parts leave a remainder unattributed: a clean-clone CI run on a quiet
 * machine had stage 0's parts at 2.27 ms against a 2.41 ms token (medians, 6%), and earlier runs under 1%. What that
 * remainder is (the moments between the measured parts) is not known yet; the bound keeps a part lost whole (a
 * compute or a frame's wait) red, not a send of a fraction of a millisecond.
 */
const within = (actual: number, wall: number) => Math.abs(actual - wall) <= 0.1 * wall + 0.1

describe("swactor run --timeline", () => {
  it("times every stage and link of a 2-stage run, and the parts add up to the token's wall time", async () => {
    const model = requireModel("stories260K.gguf")
    const ran = await swactor(runJsonArgs(model, "Once upon a time", 160, ["--stages", "2", "--timeline"]))
    expect(ran.code, ran.stderr).toBe(0)
    const summary = runJsonOutput<{ readonly summary: RunSummary }>(ran.stdout).summary
    const t = summary.timeline
    expect(t, "the summary's timeline").toBeDefined()
    if (t === undefined) return
    // every decode step after the first, unless the text ended early
    expect(t.tokens).toBe(summary.generatedTokens - 2)
    expect(t.tokens).toBeGreaterThan(20)
    expect(t.stages.map((s) => s.stageIndex)).toEqual([0, 1])
    expect(t.links.map((l) => `${l.from} → ${l.to}`)).toEqual([
      "stage 0 → stage 1",
      "stage 1 → stage 0",
      "stage 1 → orchestrator"
    ])
    const wall = t.wallMillis.mean
    expect(wall).toBeGreaterThan(0)
    for (const s of t.stages) {
      for (const c of timelineComponents) {
        const stat = s.components[c]
        expect(stat.mean, `stage ${s.stageIndex} ${c}`).toBeGreaterThanOrEqual(0)
        expect(stat.p50, `stage ${s.stageIndex} ${c}`).toBeGreaterThanOrEqual(0)
        expect(stat.p95, `stage ${s.stageIndex} ${c}`).toBeGreaterThanOrEqual(stat.p50)
      }
      // the engine ran on every stage; the frames' arrivals were stamped by the data plane (a wake-up measured)
      expect(s.components.compute.mean, `stage ${s.stageIndex} compute`).toBeGreaterThan(0)
      expect(s.components.wake.p50, `stage ${s.stageIndex} wake-up`).toBeGreaterThan(0)
      const sum = timelineComponents.reduce((a, c) => a + s.components[c].mean, 0)
      expect(sum).toBeCloseTo(s.totalMillis.mean, 6)
      // per token, its parts are the time between its steps, a token's wall time: medians, as a stall at the run's first
      // or last token (the off-path link to the orchestrator has a long tail on a loaded machine) moves a mean over the
      // run by the stall over the tokens
      const [parts, token] = [s.totalMillis.p50, t.wallMillis.p50]
      expect(within(parts, token), `stage ${s.stageIndex}: parts ${parts} ms against a token's ${token} ms`).toBe(true)
    }
    for (const l of t.links) {
      expect(l.millis.mean, `link ${l.from} → ${l.to}`).toBeGreaterThanOrEqual(0)
      expect(l.millis.p50, `link ${l.from} → ${l.to}`).toBeGreaterThanOrEqual(0)
    }
    // along the path: stage 0, its link, stage 1, the token loop back to stage 0
    expect(t.pathMillis, "every link on the path measured (one machine)").toBeDefined()
    const [path, token] = [t.pathMillis!.p50, t.wallMillis.p50]
    expect(within(path, token), `path ${path} ms against ${token} ms`).toBe(true)
    // the table under the summary on stderr, without --json
    const text = await swactor(
      runJsonArgs(model, "Once upon a time", 8, ["--stages", "2", "--timeline"]).filter((a) => a !== "--json")
    )
    expect(text.code, text.stderr).toBe(0)
    expect(text.stderr).toContain("timeline of one token (6 decode steps; ms per token):")
    expect(text.stderr).toMatch(/link stage 0 → stage 1 +\d/)
  }, 240_000)
})
