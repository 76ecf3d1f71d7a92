// Weight delivery end to end (issue 10): agents that do not read the orchestrator's model path (`--slices-only`,
// an empty `--cache-dir`) receive their stages' GGUF slices over the control plane and generate node-llama-cpp's
// greedy text; a later run sends nothing; a corrupted slice is detected and sent again; an interrupted transfer
// resumes where it stopped. stories260K over real agent processes on loopback.
import { spawn } from "node:child_process"
import * as Fs from "node:fs"
import * as Os from "node:os"
import * as Path from "node:path"
import { assert, describe, it } from "@effect/vitest"
import { Chunk, Effect, Stream } from "effect"
import { run } from "../../src/api/generate.js"
import { NodeId } from "../../src/domain/ids.js"
import * as AgentControlRpc from "../../src/layers/agent/AgentControlRpc.js"
import { swactorCommand } from "../../src/layers/agent/AgentProcesses.js"
import { deliverWeights } from "../../src/layers/orchestrator/WeightDelivery.js"
import { AgentControl, type AgentLink, AgentUnavailable } from "../../src/services/AgentLinks.js"
import type { RunUpdate } from "../../src/services/Orchestrator.js"
import { startAgents } from "../support/e2e.js"
import { referenceRun } from "../support/engine.js"
import { repoRoot, requireModel } from "../support/models.js"

const prompt = "Once upon a time"
const maxTokens = 16
const CHUNK = 64 << 10

const tempDir = (name: string) =>
  Effect.acquireRelease(
    Effect.sync(() => Fs.mkdtempSync(Path.join(Os.tmpdir(), `swactor-${name}-`))),
    (dir) => Effect.sync(() => Fs.rmSync(dir, { recursive: true, force: true }))
  )

/** Agents with their own empty slice caches that never read model paths. */
const slicesOnlyAgents = (count: number) =>
  Effect.gen(function* () {
    const root = yield* tempDir("delivery")
    const caches = Array.from({ length: count }, (_, i) => Path.join(root, `node-${i}`))
    const started = yield* startAgents(count, { extraArgs: (i) => ["--cache-dir", caches[i]!, "--slices-only"] })
    return { ...started, caches, outgoingDir: Path.join(root, "outgoing") }
  })

const slicesIn = (dir: string) => (Fs.existsSync(dir) ? Fs.readdirSync(dir).filter((f) => f.endsWith(".gguf")) : [])
const deliveries = (updates: ReadonlyArray<RunUpdate>) =>
  updates.flatMap((u) => (u._tag === "WeightsDelivery" ? [u] : []))
const tokensOf = (updates: ReadonlyArray<RunUpdate>) =>
  updates.flatMap((u) => (u._tag === "Token" ? [u.token.tokenId] : []))

describe("end to end: weight delivery to agents without the model file (stories260K)", () => {
  it.live(
    "agents with empty caches receive their slices, generate node-llama-cpp's text, reuse them, re-fetch a corrupted one",
    () =>
      Effect.gen(function* () {
        const model = requireModel("stories260K.gguf")
        const expected = (yield* Effect.promise(() =>
          referenceRun(model, prompt, maxTokens, { threads: 1, contextLength: 256 })
        )).tokens
        const { agents, caches, layer, outgoingDir } = yield* slicesOnlyAgents(2)
        const count = (text: string, pattern: RegExp) => text.split("\n").filter((line) => pattern.test(line)).length
        const received = (i: number) => count(agents[i]!.stderrTail(), /received the slice/)
        /** Weight loads agent `i` made from its own slice cache, as its log says. */
        const loadsFromCache = (i: number) =>
          count(
            agents[i]!.stderrTail(),
            new RegExp(`load from ${caches[i]!.replace(/[.*+?^${}()|[\]\\]/g, "\\$&")}/[0-9a-f]{64}\\.gguf$`)
          )
        const request = { model, prompt, stages: 2, maxTokens, threads: 1 }
        const collect = (deliver: boolean) =>
          Stream.runCollect(
            run({ ...request, ...(deliver ? { deliverWeights: { outgoingDir, chunkBytes: CHUNK } } : {}) })
          ).pipe(Effect.map(Chunk.toReadonlyArray), Effect.provide(layer))

        // Without delivery the agents have nothing to load: they do not read the orchestrator's path.
        const refused = yield* Effect.flip(collect(false))
        assert.match(refused.message, /were not delivered to this node/)

        const first = yield* collect(true)
        assert.deepStrictEqual(tokensOf(first), expected)
        const sent = deliveries(first)
        for (const stage of [0, 1]) {
          const last = sent.filter((d) => d.stageIndex === stage).at(-1)
          assert.isTrue(
            last !== undefined && last.sentBytes === last.totalBytes && last.totalBytes > CHUNK,
            `stage ${stage}`
          )
        }
        // The agents say they received one slice each and loaded their stage from it (not from the model path).
        assert.deepStrictEqual([received(0), received(1)], [1, 1])
        assert.deepStrictEqual([loadsFromCache(0), loadsFromCache(1)], [1, 1])
        const sliceFiles = caches.map(slicesIn)
        assert.deepStrictEqual(
          sliceFiles.map((f) => f.length),
          [1, 1]
        )
        // Each node holds only its stage's tensors: together less than twice the model, each less than the model.
        const sizes = caches.map((dir, i) => Fs.statSync(Path.join(dir, sliceFiles[i]![0]!)).size)
        for (const size of sizes) assert.isBelow(size, Fs.statSync(model).size)

        // A later run finds the verified slices: nothing is sent.
        const second = yield* collect(true)
        assert.deepStrictEqual(deliveries(second), [])
        assert.deepStrictEqual(tokensOf(second), expected)
        assert.deepStrictEqual([received(0), received(1)], [1, 1])
        // (the agents kept the weights loaded: no second load)
        assert.deepStrictEqual([loadsFromCache(0), loadsFromCache(1)], [1, 1])

        // A slice corrupted on disk is found out by its hash, dropped, and sent again (that stage only).
        const corrupted = Path.join(caches[1]!, sliceFiles[1]![0]!)
        const bytes = Fs.readFileSync(corrupted)
        bytes[bytes.length - 100] = bytes[bytes.length - 100]! ^ 0xff
        Fs.writeFileSync(corrupted, bytes)
        const third = yield* collect(true)
        assert.deepStrictEqual([...new Set(deliveries(third).map((d) => d.stageIndex))], [1])
        assert.deepStrictEqual(tokensOf(third), expected)
        assert.deepStrictEqual([received(0), received(1)], [1, 2])
        assert.deepStrictEqual(Fs.readFileSync(corrupted).length, sizes[1])
        assert.notDeepEqual(Fs.readFileSync(corrupted), bytes)
      }).pipe(Effect.scoped),
    240_000
  )

  // Links without a byte stream send control RPC chunks (the byte stream's own cut and resume: test/gguf/sliceStream.test.ts).
  it.live(
    "an interrupted transfer by control RPC chunks resumes from the agent's partial slice",
    () =>
      Effect.gen(function* () {
        const model = requireModel("stories260K.gguf")
        const { agents, caches, outgoingDir, token } = yield* slicesOnlyAgents(1)
        const control = yield* AgentControl.pipe(Effect.provide(AgentControlRpc.layer))
        const link = yield* control.connect({ nodeId: NodeId.make(1), address: agents[0]!.address }, token)
        // A link that only takes chunks, whose connection "drops" after three (the agent keeps what it received).
        const chunksOnly: AgentLink = {
          ...link,
          weights: { check: link.weights!.check, chunk: link.weights!.chunk, finish: link.weights!.finish }
        }
        let chunks = 0
        const cutting: AgentLink = {
          ...chunksOnly,
          weights: {
            ...chunksOnly.weights!,
            chunk: (hash, offset, bytes) =>
              ++chunks > 3
                ? Effect.fail(
                    new AgentUnavailable({ address: link.node.address, message: "connection cut by the test" })
                  )
                : link.weights!.chunk(hash, offset, bytes)
          }
        }
        const input = {
          modelPath: model,
          placement: [{ stageIndex: 0, nodeId: 1 }],
          layerRanges: [[0, 5] as const],
          outgoingDir,
          chunkBytes: CHUNK
        }
        const cut = yield* Effect.flip(deliverWeights({ ...input, linkOf: () => cutting }, () => Effect.void))
        assert.match(cut.message, /connection cut by the test/)
        const partial = Fs.readdirSync(caches[0]!).filter((f) => f.endsWith(".partial"))
        assert.strictEqual(partial.length, 1)
        assert.strictEqual(Fs.statSync(Path.join(caches[0]!, partial[0]!)).size, 3 * CHUNK)

        const [resumed] = yield* deliverWeights({ ...input, linkOf: () => chunksOnly }, () => Effect.void)
        assert.strictEqual(resumed!.via, "Sent")
        assert.strictEqual(resumed!.resumedFrom, 3 * CHUNK)
        assert.strictEqual(resumed!.sentBytes, resumed!.totalBytes - 3 * CHUNK)
        assert.deepStrictEqual(slicesIn(caches[0]!).length, 1)
        // The whole model as one stage's slice: its tensors hash the same, so the agent now holds it.
        const [again] = yield* deliverWeights({ ...input, linkOf: () => link }, () => Effect.void)
        assert.strictEqual(again!.via, "Slice")
      }).pipe(Effect.scoped),
    120_000
  )

  // `swactor run --agents` delivers by default (auto); `--deliver-weights never` leaves agents without the file stuck.
  it.live(
    "swactor run --agents delivers slices to nodes without the model file",
    () =>
      Effect.gen(function* () {
        const { agents, caches, token } = yield* slicesOnlyAgents(2)
        const xdg = yield* tempDir("delivery-xdg")
        const cli = (extra: ReadonlyArray<string>) =>
          Effect.async<{ code: number | null; stdout: string; stderr: string }>((resume) => {
            const { args, command } = swactorCommand([
              "run",
              "--model",
              requireModel("stories260K.gguf"),
              "--prompt",
              prompt,
              "--max-tokens",
              "16",
              "--threads",
              "1",
              "--agents",
              agents.map((a) => a.address).join(","),
              ...extra
            ])
            const child = spawn(command, args, {
              cwd: repoRoot,
              stdio: ["ignore", "pipe", "pipe"],
              env: { ...process.env, SWACTOR_CLUSTER_TOKEN: token, XDG_CACHE_HOME: xdg }
            })
            let stdout = ""
            let stderr = ""
            child.stdout.on("data", (chunk) => (stdout += chunk))
            child.stderr.on("data", (chunk) => (stderr += chunk))
            child.on("exit", (code) => resume(Effect.succeed({ code, stdout, stderr })))
          })
        const never = yield* cli(["--deliver-weights", "never"])
        assert.notStrictEqual(never.code, 0)
        assert.match(never.stderr, /were not delivered to this node/)
        const auto = yield* cli([])
        assert.strictEqual(auto.code, 0, auto.stderr)
        assert.include(auto.stdout, ", there was a little girl named Lily.")
        assert.match(auto.stderr, /weights for stage 1 to \S+ .* MiB/)
        assert.deepStrictEqual(
          caches.map((dir) => slicesIn(dir).length),
          [1, 1]
        )
      }).pipe(Effect.scoped),
    180_000
  )

  // `swactor serve --agents` delivers by default too, and serves the same greedy text; `--deliver-weights never` leaves
  // agents without the file unable to load: the command ends with exit code 1 and the reason.
  it.live(
    "swactor serve --agents delivers slices to nodes without the model file",
    () =>
      Effect.gen(function* () {
        const { agents, caches, token } = yield* slicesOnlyAgents(2)
        const xdg = yield* tempDir("delivery-serve-xdg")
        /** Starts `swactor serve`; ends at `ready` (with the URL) or at its exit. */
        const serve = (extra: ReadonlyArray<string>) =>
          Effect.acquireRelease(
            Effect.async<{ child: ReturnType<typeof spawn>; url?: string; code?: number | null; stderr: () => string }>(
              (resume) => {
                const { args, command } = swactorCommand([
                  "serve",
                  "--model",
                  requireModel("stories260K.gguf"),
                  "--port",
                  "0",
                  "--threads",
                  "1",
                  "--agents",
                  agents.map((a) => a.address).join(","),
                  ...extra
                ])
                const child = spawn(command, args, {
                  cwd: repoRoot,
                  stdio: ["ignore", "ignore", "pipe"],
                  env: { ...process.env, SWACTOR_CLUSTER_TOKEN: token, XDG_CACHE_HOME: xdg }
                })
                let stderr = ""
                let url: string | undefined
                child.stderr!.on("data", (chunk) => {
                  stderr += chunk
                  url ??= /listening on (http:\/\/\S+)/.exec(stderr)?.[1]
                  if (url !== undefined && /swactor serve: ready/.test(stderr))
                    resume(Effect.succeed({ child, url, stderr: () => stderr }))
                })
                child.on("exit", (code) => resume(Effect.succeed({ child, code, stderr: () => stderr })))
              }
            ),
            ({ child }) =>
              Effect.async<void>((resume) => {
                if (child.exitCode !== null || child.signalCode !== null) return resume(Effect.void)
                child.once("exit", () => resume(Effect.void))
                child.kill("SIGTERM")
              })
          )
        const never = yield* serve(["--deliver-weights", "never"])
        assert.strictEqual(never.code, 1, never.stderr())
        assert.match(never.stderr(), /were not delivered to this node/)
        assert.deepStrictEqual(
          caches.map((dir) => slicesIn(dir).length),
          [0, 0]
        )

        const auto = yield* serve([])
        assert.isDefined(auto.url, auto.stderr())
        assert.deepStrictEqual(
          caches.map((dir) => slicesIn(dir).length),
          [1, 1]
        )
        const answer = yield* Effect.promise(() =>
          fetch(`${auto.url}/v1/completions`, {
            method: "POST",
            headers: { "content-type": "application/json" },
            body: JSON.stringify({ model: "m", prompt, max_tokens: 16, temperature: 0 })
          }).then((r) => r.json() as Promise<{ choices: Array<{ text: string }> }>)
        )
        assert.include(answer.choices[0]!.text, ", there was a little girl named Lily.")
      }).pipe(Effect.scoped),
    180_000
  )
})
