import { assert, describe, it } from "@effect/vitest"
import { spawn } from "node:child_process"
import { existsSync, readFileSync } from "node:fs"
import { dirname, join } from "node:path"
import { Chunk, Effect, Stream } from "effect"
import { createClient, generate, layerLocal, run } from "../../src/api/generate.js"
import type { GeneratedToken, RunUpdate } from "../../src/services/Orchestrator.js"
import { childPids, isAlive, startAgents } from "../support/e2e.js"
import { referenceRun } from "../support/engine.js"
import { repoRoot, requireModel } from "../support/models.js"
import { type LocalAgent, swactorCommand } from "../../src/layers/agent/AgentProcesses.js"
import * as ShmRing from "../../src/layers/transport/ShmRing.js"
import { until } from "../support/until.js"

/** Distinct shared-memory rings a process has mapped now. */
const shmRingsMappedBy = (pid: number): number =>
  new Set(
    readFileSync(`/proc/${pid}/maps`, "utf8")
      .split("\n")
      .flatMap((line) => {
        const at = line.indexOf(ShmRing.SHM_PREFIX)
        return at < 0 ? [] : [line.slice(at).replace(/ \(deleted\)$/, "")]
      })
  ).size

const prompt = "Once upon a time"
const maxTokens = 32

const idsOf = (tokens: Chunk.Chunk<GeneratedToken>) =>
  Chunk.toReadonlyArray(tokens)
    .filter((t) => t.tokenId >= 0)
    .map((t) => t.tokenId)
const textOf = (tokens: Chunk.Chunk<GeneratedToken>) =>
  Chunk.toReadonlyArray(tokens)
    .map((t) => t.text)
    .join("")

describe("end to end: real agent processes on loopback, stories260K", () => {
  // The reference: node-llama-cpp in one process, greedy, one thread.
  const reference = Effect.promise(() =>
    referenceRun(requireModel("stories260K.gguf"), prompt, maxTokens, { threads: 1, contextLength: 256 })
  )

  // A model split 1..4 ways across agent processes generates exactly node-llama-cpp's greedy tokens.
  it.live(
    "1..4 stages over 4 agents give node-llama-cpp's 32 greedy tokens",
    () =>
      Effect.gen(function* () {
        const expected = (yield* reference).tokens
        const { layer } = yield* startAgents(4)
        for (const stages of [1, 2, 3, 4]) {
          const tokens = yield* Stream.runCollect(
            generate({ model: requireModel("stories260K.gguf"), prompt, stages, maxTokens, threads: 1 })
          ).pipe(Effect.provide(layer))
          assert.deepStrictEqual(idsOf(tokens), expected, `stages=${stages}`)
          assert.strictEqual(
            textOf(tokens),
            ", there was a little girl named Lily. She loved to play outside in the park. One day, she saw",
            `stages=${stages}`
          )
        }
      }).pipe(Effect.scoped),
    180_000
  )

  // Long-lived weights settle: mapped weights move to huge-page memory after the first token of a run that found them
  // already loaded (a warm pipeline: a server, a node pool), or always with SWACTOR_MMAP_MOVE=1, never with =0; a
  // first short run keeps the fast-start mapping. The text is the same before and after the move.
  it.live(
    "agents move mapped weights out of the file mapping once they serve a second run (or always / never by setting); the text is the same",
    () =>
      Effect.gen(function* () {
        const expected = (yield* reference).tokens
        const settled = (text: string) => /settled: weights moved out of the file mapping/.test(text)
        const cases = [
          [{ SWACTOR_MMAP_MOVE: "1" }, [true, true]],
          [{}, [false, true]],
          [{ SWACTOR_MMAP_MOVE: "0" }, [false, false]]
        ] as const
        for (const [env, [afterFirst, afterSecond]] of cases) {
          const { agents, layer } = yield* startAgents(2, { env })
          const run = Stream.runCollect(
            generate({ model: requireModel("stories260K.gguf"), prompt, stages: 2, maxTokens, threads: 1 })
          ).pipe(Effect.map(idsOf), Effect.provide(layer))
          // A settle comes 1.5 s after a run's first token (StageHost's settleDelay): a settle expected is awaited (the
          // event), one not expected is looked for once that delay has passed with a margin (a non-event has no signal).
          const settlesAre = (want: boolean) =>
            Effect.gen(function* () {
              yield* Effect.sleep("2500 millis")
              const read = Effect.sync(() => agents.map((a) => settled(a.stderrTail())))
              const seen = want
                ? yield* until(`both agents to settle (${JSON.stringify(env)})`, read, (all) => all.every(Boolean))
                : yield* read
              assert.deepStrictEqual(seen, [want, want], JSON.stringify(env))
            })
          assert.deepStrictEqual(yield* run, expected)
          yield* settlesAre(afterFirst)
          // the second run finds the weights loaded
          assert.deepStrictEqual(yield* run, expected)
          yield* settlesAre(afterSecond)
          // a run after the move computes the same tokens from the moved weights
          assert.deepStrictEqual(yield* run, expected)
        }
      }).pipe(Effect.scoped),
    180_000
  )

  // Sampling happens on the last stage from a seeded generator: the same seed reproduces the text,
  // whatever the split; runs in flight at the same time on the same agents do not disturb each other.
  it.live(
    "seeded sampling reproduces, also with two runs in flight through the same agents",
    () =>
      Effect.gen(function* () {
        const { agents, layer } = yield* startAgents(3)
        const sampled = (stages: number, seed: number) =>
          Stream.runCollect(
            generate({
              model: requireModel("stories260K.gguf"),
              prompt,
              stages,
              maxTokens,
              threads: 1,
              sampling: { temperature: 0.9, topK: 40, seed }
            })
          ).pipe(Effect.map(idsOf), Effect.provide(layer))
        const [a, b] = yield* Effect.all([sampled(3, 42), sampled(3, 42)], { concurrency: 2 })
        const c = yield* sampled(2, 42)
        const d = yield* sampled(3, 7)
        assert.deepStrictEqual(a, b)
        assert.deepStrictEqual(a, c)
        assert.notDeepEqual(a, d)
        const expected = (yield* reference).tokens
        assert.notDeepEqual(a, expected)
        for (const agent of agents) assert.isTrue(isAlive(agent.pid))
      }).pipe(Effect.scoped),
    180_000
  )

  // The second run on the same agents finds the weights of its block ranges already loaded.
  it.live(
    "a second run on the same agents reuses the cached weights; the summary reports the split",
    () =>
      Effect.gen(function* () {
        const { layer } = yield* startAgents(2)
        const once = () =>
          Stream.runCollect(
            run({ model: requireModel("stories260K.gguf"), prompt, stages: 2, maxTokens: 8, threads: 1 })
          ).pipe(Effect.map(Chunk.toReadonlyArray), Effect.provide(layer))
        yield* once()
        const updates = yield* once()
        const ready = updates.filter((u) => u._tag === "StageReady")
        assert.isTrue(ready.length === 2 && ready.every((u) => u._tag === "StageReady" && u.cachedWeights))
        const finished = updates.find((u) => u._tag === "Finished")
        assert.isTrue(finished?._tag === "Finished" && finished.summary.stages.length === 2)
        const tornDown = updates.filter((u) => u._tag === "TornDown")
        assert.deepStrictEqual(
          tornDown.map((u) => u._tag === "TornDown" && u.outcome),
          ["Completed"]
        )
      }).pipe(Effect.scoped),
    120_000
  )

  // The Promise facade runs the same pipeline.
  it.live(
    "the Promise client completes the same text",
    () =>
      Effect.gen(function* () {
        const { agents, token } = yield* startAgents(2)
        const client = createClient({ agents: agents.map((a) => a.address), token })
        const result = yield* Effect.promise(() =>
          client.complete({ model: requireModel("stories260K.gguf"), prompt, stages: 2, maxTokens, threads: 1 })
        ).pipe(Effect.ensuring(Effect.promise(() => client.close())))
        assert.strictEqual(
          result.text,
          ", there was a little girl named Lily. She loved to play outside in the park. One day, she saw"
        )
        assert.strictEqual(result.summary.generatedTokens, maxTokens)
      }).pipe(Effect.scoped),
    120_000
  )

  // A local run (no --nodes) keeps every data edge on this machine: Unix sockets in a private
  // directory that is gone once the run ends, with the frames in shared-memory rings where /dev/shm
  // works (seen mid-run in the orchestrator's and each agent's memory maps). The summary names each
  // stage's data listener.
  it.live(
    "a local run's data plane uses Unix sockets (and shared memory) in a private directory, removed after",
    () =>
      Effect.gen(function* () {
        let started: ReadonlyArray<LocalAgent> = []
        let ringsMapped: ReadonlyArray<number> | undefined
        const updates: Array<RunUpdate> = []
        yield* run({ model: requireModel("stories260K.gguf"), prompt, stages: 2, maxTokens, threads: 1 }).pipe(
          Stream.runForEach((update) =>
            Effect.sync(() => {
              if (update._tag === "Token" && ringsMapped === undefined) {
                ringsMapped = [process.pid, ...started.map((a) => a.pid)].map(shmRingsMappedBy)
              }
              updates.push(update)
            })
          ),
          Effect.provide(layerLocal({ threads: 1, onStarted: (agents) => (started = agents) }))
        )
        const finished = updates.find((u) => u._tag === "Finished")
        assert.isTrue(finished?._tag === "Finished")
        const summary = (finished as Extract<RunUpdate, { _tag: "Finished" }>).summary
        assert.strictEqual(
          summary.text,
          ", there was a little girl named Lily. She loved to play outside in the park. One day, she saw"
        )
        const paths = summary.stages.map((s) => (s.dataAddress._tag === "Unix" ? s.dataAddress.path : ""))
        assert.deepStrictEqual(
          started.map((a) => a.dataAddress),
          summary.stages.map((s) => s.dataAddress)
        )
        assert.strictEqual(paths.length, 2)
        const dir = dirname(paths[0]!)
        assert.match(dir, /swactor-/)
        assert.deepStrictEqual(paths, [join(dir, "agent-0.sock"), join(dir, "agent-1.sock")])
        assert.isFalse(existsSync(dir))
        // Orchestrator: TokenIn (its ring) and TokenOut (stage 1's); each agent: its inbound and outbound edges, and the
        // token loop's edge from stage 1 to stage 0 (B4e)
        if (ShmRing.isSupported()) assert.deepStrictEqual(ringsMapped, [2, 3, 3])
      }),
    120_000
  )

  // `swactor run` with no --nodes starts its own agents, streams the text, and leaves no process behind.
  it.live(
    "swactor run (local default) prints the text and leaves no agent running",
    () =>
      Effect.gen(function* () {
        const { args, command } = swactorCommand([
          "run",
          "--model",
          requireModel("stories260K.gguf"),
          "--prompt",
          prompt,
          "--stages",
          "2",
          "--max-tokens",
          String(maxTokens),
          "--threads",
          "1",
          "--quiet"
        ])
        let agentPids: ReadonlyArray<number> = []
        const result = yield* Effect.async<{ code: number | null; stdout: string; stderr: string }>((resume) => {
          const child = spawn(command, args, { cwd: repoRoot, stdio: ["ignore", "pipe", "pipe"] })
          let stdout = ""
          let stderr = ""
          child.stdout.on("data", (chunk) => {
            // Text flows only once the agents are up: this is when they are the CLI's children.
            if (stdout === "") agentPids = childPids(child.pid!)
            stdout += chunk
          })
          child.stderr.on("data", (chunk) => (stderr += chunk))
          child.on("exit", (code) => resume(Effect.succeed({ code, stdout, stderr })))
        })
        assert.strictEqual(result.code, 0, result.stderr)
        assert.strictEqual(
          result.stdout.trim(),
          "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, she saw"
        )
        assert.strictEqual(agentPids.length, 2)
        assert.deepStrictEqual(agentPids.filter(isAlive), [])
      }),
    120_000
  )

  // `swactor run --dry-run` asks the agents for their capacity and previews the placement, provisioning nothing.
  it.live(
    "swactor run --dry-run prints the nodes' capacity and the placement",
    () =>
      Effect.gen(function* () {
        const { args, command } = swactorCommand([
          "run",
          "--model",
          requireModel("stories260K.gguf"),
          "--stages",
          "2",
          "--threads",
          "1",
          "--dry-run"
        ])
        const result = yield* Effect.async<{ code: number | null; stdout: string }>((resume) => {
          const child = spawn(command, args, { cwd: repoRoot, stdio: ["ignore", "pipe", "ignore"] })
          let stdout = ""
          child.stdout.on("data", (chunk) => (stdout += chunk))
          child.on("exit", (code) => resume(Effect.succeed({ code, stdout })))
        })
        assert.strictEqual(result.code, 0)
        assert.match(result.stdout, /node 1 127\.0\.0\.1:\d+: .*cpu, 1 threads, .* GiB free of .* GiB, 0 stages hosted/)
        assert.match(result.stdout, /stage 0: blocks \[0, 3\) on 127\.0\.0\.1:\d+/)
        assert.match(result.stdout, /stage 1: blocks \[3, 5\) on 127\.0\.0\.1:\d+/)
        assert.include(result.stdout, "nothing was provisioned")
      }),
    60_000
  )
})
