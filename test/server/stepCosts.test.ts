/**
 * `swactor serve` prints the stages' measured step costs and the decode micro-batch size chosen from them in /metrics:
 * each real agent probes its loaded block range at 1..8 rows while idle (StageBatcher's stepProbe, on for the live
 * engine), reports the costs in its heartbeat (NodeCapacity.stepCosts), and after concurrent requests the batcher's
 * last choice: rows per decode micro-batch, ceil(decoding / stages), and the sequences it was chosen for.
 */
import { afterAll, beforeAll, describe, expect, it } from "vitest"
import { requireModel } from "../support/models.js"
import { type ServeProcess, startServe, stopServe } from "../support/serve.js"

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms))

/** Every sample of `name` in /metrics: its labels (parsed) and value. */
const samples = (text: string, name: string) =>
  [...text.matchAll(new RegExp(`^${name}\\{([^}]*)\\} (\\S+)$`, "gm"))].map((m) => ({
    labels: Object.fromEntries([...m[1]!.matchAll(/(\w+)="([^"]*)"/g)].map((l) => [l[1]!, l[2]!])),
    value: Number(m[2])
  }))

describe("swactor serve: step costs by rows and the decode micro-batch size in /metrics", () => {
  let server: ServeProcess
  beforeAll(async () => {
    server = await startServe([
      "--model",
      requireModel("stories260K.gguf"),
      "--stages",
      "2",
      "--threads",
      "1",
      "--parallel",
      "4"
    ])
  }, 180_000)
  afterAll(() => stopServe(server))

  it("each agent's block range has probed costs for 1..8 rows; after 4 concurrent requests, the choice", async () => {
    let steps: ReturnType<typeof samples> = []
    const until = Date.now() + 30_000
    while (Date.now() < until) {
      steps = samples(await fetch(`${server.url}/metrics`).then((r) => r.text()), "swactor_agent_step_ms")
      if (new Set(steps.map((s) => s.labels["pid"])).size === 2 && steps.length >= 16) break
      await sleep(200)
    }
    const ranges = [...new Set(steps.map((s) => `${s.labels["pid"]} ${s.labels["layers"]}`))].sort()
    expect(ranges, "one block range per agent").toHaveLength(2)
    for (const range of ranges) {
      const rows = steps
        .filter((s) => `${s.labels["pid"]} ${s.labels["layers"]}` === range)
        .map((s) => Number(s.labels["rows"]))
      expect(rows.sort((a, b) => a - b)).toEqual([1, 2, 3, 4, 5, 6, 7, 8])
    }
    for (const s of steps) expect(s.value).toBeGreaterThan(0)

    await Promise.all(
      ["Once upon a time", "The little dog", "Lily went", "A big red ball"].map((prompt) =>
        fetch(`${server.url}/v1/completions`, {
          method: "POST",
          headers: { "content-type": "application/json" },
          body: JSON.stringify({ model: "m", prompt, max_tokens: 24, temperature: 0 })
        }).then((r) => expect(r.status).toBe(200))
      )
    )
    const text = await fetch(`${server.url}/metrics`).then((r) => r.text())
    const chosen = samples(text, "swactor_agent_decode_batch_rows")
    const defaults = samples(text, "swactor_agent_decode_batch_default_rows")
    const decoding = samples(text, "swactor_agent_decoding_sequences")
    expect(chosen).toHaveLength(2)
    for (const c of chosen) {
      const d = defaults.find((x) => x.labels["pid"] === c.labels["pid"])!
      const l = decoding.find((x) => x.labels["pid"] === c.labels["pid"])!
      expect(l.value).toBeGreaterThanOrEqual(1)
      expect(d.value).toBe(Math.ceil(Math.max(1, l.value) / 2))
      expect(c.value).toBeGreaterThanOrEqual(1)
      expect(c.value).toBeLessThanOrEqual(Math.max(1, l.value))
    }
  }, 120_000)
})
