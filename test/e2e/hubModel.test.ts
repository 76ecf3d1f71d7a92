/**
 * `--model hf:…` end to end (issue 38 part 3) against the test hub (test/support/testHub.ts: real HTTP servers on
 * loopback playing the hub and its CDN, never the internet). Every agent is a real `swactor node` process with its own
 * door to the hub (its own hub and CDN ports) and its own cache, so the bytes each node downloads are counted apart:
 * - on 2 and 3 nodes the tokens are node-llama-cpp's on the same file read locally;
 * - each node downloads at most 1.05× its own stage's tensor bytes, the orchestrator at most 1% of the model;
 * - a second start with warm caches asks the hub for nothing but the manifest;
 * - a node that cannot reach the hub is sent its slice by the orchestrator (which fetches that slice only);
 * - `swactor serve --model hf:…` answers the official `openai` client with the same text.
 */
import { afterAll, assert, beforeAll, describe, it } from "@effect/vitest"
import { Effect, Stream } from "effect"
import { spawn } from "node:child_process"
import { mkdtempSync, rmSync, statSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import OpenAI from "openai"
import { layerRemote, run } from "../../src/api/generate.js"
import { generateToken, spawnLocalAgents, swactorCommand } from "../../src/layers/agent/AgentProcesses.js"
import { Settings } from "../../src/layers/config/Settings.js"
import { readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { sliceTensors } from "../../src/layers/gguf/GgufSlice.js"
import { writeSyntheticModel } from "../../src/layers/gguf/Synthetic.js"
import type { RunUpdate } from "../../src/services/Orchestrator.js"
import { nodeLlamaReference } from "../support/engine.js"
import { startServe, stopServe } from "../support/serve.js"
import { REFERENCE_OPTIONS } from "../support/synthFiles.js"
import { startTestHub, type TestHub } from "../support/testHub.js"

const dir = mkdtempSync(join(tmpdir(), "swactor-e2e-hub-"))
const PROMPT = "Once upon a time"
const MAX_TOKENS = 16
const NAME = "hf:test/synth-GGUF:F32"
let hub: TestHub
let local: string

beforeAll(async () => {
  local = join(dir, "synth.F32.gguf")
  // ~13 MB: big enough that a header read is a small share of it
  await Effect.runPromise(
    writeSyntheticModel({
      path: local,
      arch: "llama",
      layers: 4,
      hidden: 256,
      ffn: 768,
      heads: 4,
      kvHeads: 2,
      vocab: 512,
      contextLength: 1024,
      type: "f32",
      seed: 11
    })
  )
  hub = await startTestHub({
    doors: 4,
    repos: { "test/synth-GGUF": { files: { "synth.F32.gguf": local }, manifests: { F32: "synth.F32.gguf" } } }
  })
}, 120_000)
afterAll(async () => {
  await hub?.close()
  rmSync(dir, { recursive: true, force: true })
})

/** Runs `body` with the orchestrator's hub settings read from `env` over this process's (the Settings service). */
const withHubEnv = <A, E, R>(env: Record<string, string>, body: Effect.Effect<A, E, R>) =>
  Effect.provide(body, Settings.fromEnvironment({ ...process.env, ...env }))

/**
 * Starts one `swactor node` per stage, node i with door i + 1 (or `endpoints[i]` when given) and caches of its own
 * under `root`; returns the orchestrator's layer over them and their addresses.
 */
const startNodes = (root: string, count: number, endpoints: ReadonlyArray<string | undefined> = []) =>
  Effect.gen(function* () {
    const token = generateToken()
    const addresses: Array<string> = []
    const pids: Array<number> = []
    for (let i = 0; i < count; i++) {
      const [agent] = yield* spawnLocalAgents({
        count: 1,
        token,
        threads: 1,
        env: { HF_ENDPOINT: endpoints[i] ?? hub.endpoint(i + 1), XDG_CACHE_HOME: join(root, `node-${i}`) }
      })
      addresses.push(agent!.address)
      pids.push(agent!.pid)
    }
    return { layer: layerRemote({ agents: addresses, token, listenHost: "127.0.0.1" }), addresses, pids }
  })

const tokensOf = (updates: ReadonlyArray<RunUpdate>) =>
  updates.flatMap((u) => (u._tag === "Token" && u.token.tokenId >= 0 ? [u.token.tokenId] : []))

/** The tensor bytes of the stage each address hosts (from the Planned update). */
const stageBytes = (updates: ReadonlyArray<RunUpdate>) =>
  Effect.gen(function* () {
    const file = yield* readGgufFile(local)
    const planned = updates.find((u) => u._tag === "Planned")
    assert.strictEqual(planned?._tag, "Planned")
    if (planned?._tag !== "Planned") return new Map<string, number>()
    return new Map(
      planned.stages.map((s) => [
        s.address,
        sliceTensors(file, { layerStart: s.layers[0], layerEndExclusive: s.layers[1], numLayers: 4 }).reduce(
          (n, t) => n + t.byteSize,
          0
        )
      ])
    )
  })

const runHub = (root: string, stages: number, layer: ReturnType<typeof layerRemote>) =>
  withHubEnv(
    { HF_ENDPOINT: hub.endpoint(0), XDG_CACHE_HOME: join(root, "orchestrator") },
    Stream.runCollect(run({ model: NAME, prompt: PROMPT, maxTokens: MAX_TOKENS, threads: 1, stages })).pipe(
      Effect.provide(layer),
      Effect.map((c) => [...c])
    )
  )

describe("a hub model end to end", () => {
  for (const stages of [2, 3]) {
    it.live(
      `${stages} nodes, each with its own link to the hub: node-llama-cpp's tokens; each node downloads ≤ 1.05× its slice, the orchestrator ≤ 1% of the model; a warm start asks for the manifest only`,
      () =>
        Effect.scoped(
          Effect.gen(function* () {
            const root = mkdtempSync(join(dir, `n${stages}-`))
            const ref = yield* nodeLlamaReference(local, PROMPT, MAX_TOKENS, REFERENCE_OPTIONS)
            const modelBytes = statSync(local).size

            hub.reset()
            const { layer, addresses } = yield* startNodes(root, stages)
            const updates = yield* runHub(root, stages, layer)
            assert.deepStrictEqual(tokensOf(updates), ref.tokens)
            assert.isAtLeast(new Set(ref.tokens).size, 3, "the stream is not trivial")
            const bytes = yield* stageBytes(updates)
            assert.strictEqual(bytes.size, stages)
            addresses.forEach((address, i) => {
              const slice = bytes.get(address)
              assert.isDefined(slice, address)
              const got = hub.bytesServed(i + 1)
              assert.isAtLeast(got, slice!, `node ${i} fetched its slice`)
              assert.isAtMost(got, slice! * 1.05, `node ${i}: ${got} bytes for a ${slice}-byte slice`)
            })
            assert.isAtMost(hub.bytesServed(0), modelBytes / 100, "the orchestrator reads headers only")
            assert.isTrue(
              updates.some((u) => u._tag === "WeightsDelivery" && u.source === "Hub"),
              "progress from the hub"
            )

            // Again, with the caches warm (new node processes, the same caches): the manifest and nothing else.
            hub.reset()
            const again = yield* startNodes(root, stages)
            const warm = yield* runHub(root, stages, again.layer)
            assert.deepStrictEqual(tokensOf(warm), ref.tokens)
            const asked = hub.requests().filter((r) => !r.path.includes("/manifests/"))
            assert.deepStrictEqual(
              asked.map((r) => `${r.door} ${r.host} ${r.path}`),
              [],
              "a warm start asks for the manifest only"
            )
            assert.strictEqual(hub.bytesServed(), 0)
          })
        ),
      300_000
    )
  }

  it.live(
    "a node that cannot reach the hub is sent its slice: the orchestrator fetches that slice only",
    () =>
      Effect.scoped(
        Effect.gen(function* () {
          const root = mkdtempSync(join(dir, "fallback-"))
          const ref = yield* nodeLlamaReference(local, PROMPT, MAX_TOKENS, REFERENCE_OPTIONS)
          hub.reset()
          // node 1's hub is a port nothing listens on
          const { layer, addresses } = yield* startNodes(root, 2, [undefined, "http://127.0.0.1:9/"])
          const updates = yield* runHub(root, 2, layer)
          assert.deepStrictEqual(tokensOf(updates), ref.tokens)
          const bytes = yield* stageBytes(updates)
          const cutOff = bytes.get(addresses[1]!)!
          assert.strictEqual(hub.bytesServed(2), 0, "node 1 reached nothing")
          assert.isAtMost(hub.bytesServed(1), bytes.get(addresses[0]!)! * 1.05)
          // the orchestrator fetched node 1's slice (and the headers), then sent it
          assert.isAtLeast(hub.bytesServed(0), cutOff)
          assert.isAtMost(hub.bytesServed(0), cutOff * 1.05 + statSync(local).size / 100)
          assert.isTrue(updates.some((u) => u._tag === "WeightsDelivery" && u.source === undefined && u.sentBytes > 0))
        })
      ),
    300_000
  )

  it.live(
    "swactor run --model hf:… --json: each node's fetch is a stream of weights events on stderr, ending at its total",
    () =>
      Effect.gen(function* () {
        const root = mkdtempSync(join(dir, "json-"))
        const { args, command } = swactorCommand([
          "run",
          "--model",
          NAME,
          "--stages",
          "2",
          "--threads",
          "1",
          "--max-tokens",
          "4",
          "--prompt",
          PROMPT,
          "--json"
        ])
        // spawned, not spawnSync: the hub answers from this process's event loop
        const result = yield* Effect.promise(
          () =>
            new Promise<{ status: number | null; stdout: string; stderr: string }>((resolve) => {
              const child = spawn(command, args, {
                env: { ...process.env, HF_ENDPOINT: hub.endpoint(0), XDG_CACHE_HOME: root },
                stdio: ["ignore", "pipe", "pipe"]
              })
              let stdout = ""
              let stderr = ""
              child.stdout.on("data", (c: Buffer) => (stdout += c.toString()))
              child.stderr.on("data", (c: Buffer) => (stderr += c.toString()))
              child.on("exit", (status) => resolve({ status, stdout, stderr }))
            })
        )
        assert.strictEqual(result.status, 0, result.stderr)
        const report = JSON.parse(result.stdout) as { readonly ok: boolean }
        assert.isTrue(report.ok)
        const events = result.stderr
          .split("\n")
          .filter((line) => line.startsWith("{"))
          .map(
            (line) =>
              JSON.parse(line) as { event: string; stage: number; source: string; bytes: number; totalBytes: number }
          )
          .filter((e) => e.event === "weights")
        for (const stage of [0, 1]) {
          const mine = events.filter((e) => e.stage === stage)
          assert.isAbove(mine.length, 0, `events of stage ${stage}`)
          assert.isTrue(mine.every((e) => e.source === "hub"))
          assert.strictEqual(mine.at(-1)!.bytes, mine.at(-1)!.totalBytes)
          assert.isAbove(mine.at(-1)!.totalBytes, 0)
        }
      }),
    300_000
  )

  it.live(
    "kill -9 of a stage mid-generation: the spare fetches that stage's slice from the hub and the tokens are node-llama-cpp's",
    () =>
      Effect.scoped(
        Effect.gen(function* () {
          const root = mkdtempSync(join(dir, "resume-"))
          const tokens = 48
          const ref = yield* nodeLlamaReference(local, PROMPT, tokens, REFERENCE_OPTIONS)
          hub.reset()
          const { layer, addresses, pids } = yield* startNodes(root, 3)
          const updates: Array<RunUpdate> = []
          let victim: number | undefined
          yield* withHubEnv(
            { HF_ENDPOINT: hub.endpoint(0), XDG_CACHE_HOME: join(root, "orchestrator") },
            run({ model: NAME, prompt: PROMPT, maxTokens: tokens, threads: 1, stages: 2, spares: 1 }).pipe(
              Stream.runForEach((u) =>
                Effect.sync(() => {
                  updates.push(u)
                  // at token 12, the second stage's node dies
                  if (victim === undefined && u._tag === "Token" && u.token.step === 12) {
                    const planned = updates.find((p) => p._tag === "Planned")
                    if (planned?._tag !== "Planned") return
                    victim = addresses.indexOf(planned.stages[1]!.address)
                    process.kill(pids[victim]!, "SIGKILL")
                  }
                })
              ),
              Effect.provide(layer)
            )
          )
          assert.isDefined(victim)
          assert.deepStrictEqual(tokensOf(updates), ref.tokens)
          const recovered = updates.filter((u) => u._tag === "Recovered")
          assert.strictEqual(recovered.length, 1)
          // the spare (the one node not planned at first) fetched from its own door
          const first = updates.find((u) => u._tag === "Planned")
          const spare = [0, 1, 2].find(
            (i) => first?._tag === "Planned" && !first.stages.some((st) => st.address === addresses[i])
          )
          assert.isDefined(spare)
          assert.isAbove(hub.bytesServed(spare! + 1), 0, "the spare fetched its slice from the hub")
        })
      ),
    300_000
  )

  it.live(
    "swactor serve --model hf:… on 2 nodes answers the openai client with run's text",
    () =>
      Effect.gen(function* () {
        const root = mkdtempSync(join(dir, "serve-"))
        const { layer } = yield* startNodes(root, 2)
        const updates = yield* runHub(root, 2, layer)
        const finished = updates.find((u) => u._tag === "Finished")
        const text = finished?._tag === "Finished" ? finished.summary.text : undefined
        assert.isDefined(text)
        const server = yield* Effect.promise(() =>
          startServe(["--model", NAME, "--stages", "2", "--threads", "1"], {
            HF_ENDPOINT: hub.endpoint(3),
            XDG_CACHE_HOME: join(root, "serve")
          })
        )
        try {
          const client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: "none", maxRetries: 0, timeout: 60_000 })
          const answer = yield* Effect.promise(() =>
            client.completions.create({ model: "synth", prompt: PROMPT, max_tokens: MAX_TOKENS, temperature: 0 })
          )
          assert.strictEqual(answer.choices[0]!.text, text)
          assert.isAbove(hub.bytesServed(3), 0, "serve's nodes fetched from the hub")
          // /metrics shows what each stage's node fetched: all of it, from the hub
          const metrics = yield* Effect.promise(() => fetch(`${server.url}/metrics`).then((r) => r.text()))
          const gauge = (name: string) =>
            [...metrics.matchAll(new RegExp(`^${name}\\{stage="(\\d)",address="[^"]+",source="hub"\\} (\\d+)$`, "gm"))]
              .map((m) => [Number(m[1]), Number(m[2])] as const)
              .sort()
          const fetched = gauge("swactor_weights_bytes")
          assert.strictEqual(fetched.length, 2, metrics.slice(0, 2000))
          assert.deepStrictEqual(fetched, gauge("swactor_weights_total_bytes"))
          assert.isTrue(fetched.every(([, n]) => n > 0))
        } finally {
          yield* Effect.promise(() => stopServe(server))
        }
      }).pipe(Effect.scoped),
    300_000
  )
})
