/**
 * A split GGUF set (issue 38) named by its first part, through real agent processes and `swactor serve`: each agent
 * maps only the parts that hold its blocks, and the server answers the official `openai` client with what `run`
 * generates.
 */
import { assert, describe, it } from "@effect/vitest"
import { Effect, Stream } from "effect"
import { mkdtempSync, readdirSync, readFileSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import OpenAI from "openai"
import { tensorFilePath } from "../../src/domain/gguf.js"
import { layerLocal, run } from "../../src/api/generate.js"
import type { LocalAgent } from "../../src/layers/agent/AgentProcesses.js"
import { readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { sliceTensors } from "../../src/layers/gguf/GgufSlice.js"
import type { RunUpdate } from "../../src/services/Orchestrator.js"
import { writeConverted } from "../support/convertedModels.js"
import { nodeLlamaReference } from "../support/engine.js"
import { startAgents } from "../support/e2e.js"
import { startServe, stopServe } from "../support/serve.js"
import { modelFolder, REFERENCE_OPTIONS } from "../support/synthFiles.js"

const dir = modelFolder("swactor-e2e-split-set-")
const PROMPT = "Once upon a time"
const MAX_TOKENS = 32

/** qwen3moe (4 blocks) in 3 parts: token_embd + blk.0, blk.1, then blk.2.. with the output. */
const qwen3moeSet = () =>
  writeConverted("qwen3moe", join(dir, "q3.gguf"), 2, {
    cuts: ["blk.1.attn_norm.weight", "blk.2.attn_norm.weight"]
  })

/** The parts, among `paths`, that process `pid` has mapped now. */
const mappedBy = (pid: number, paths: ReadonlyArray<string>): ReadonlyArray<string> => {
  const maps = readFileSync(`/proc/${pid}/maps`, "utf8").split("\n")
  return paths.filter((p) => maps.some((line) => line.endsWith(` ${p}`)))
}

describe("a split set end to end", () => {
  it.live(
    "3 local agents: node-llama-cpp's tokens, each agent mapping only its blocks' parts; serve answers the openai client with the same text",
    () =>
      Effect.gen(function* () {
        const parts = qwen3moeSet()
        const file = yield* readGgufFile(parts[0]!)
        let agents: ReadonlyArray<LocalAgent> = []
        const updates: Array<RunUpdate> = []
        let maps: ReadonlyArray<{ readonly address: string; readonly parts: ReadonlyArray<string> }> | undefined
        yield* run({ model: parts[0]!, prompt: PROMPT, maxTokens: MAX_TOKENS, threads: 1, stages: 3 }).pipe(
          Stream.provideLayer(layerLocal({ threads: 1, onStarted: (a) => (agents = a) })),
          Stream.runForEach((u) =>
            Effect.sync(() => {
              updates.push(u)
              // while the stages are loaded: what each agent process maps
              if (maps === undefined && u._tag === "Token")
                maps = agents.map((a) => ({ address: a.address, parts: mappedBy(a.pid, parts) }))
            })
          )
        )
        const tokens = updates.flatMap((u) => (u._tag === "Token" && u.token.tokenId >= 0 ? [u.token.tokenId] : []))
        const ref = yield* nodeLlamaReference(parts[0]!, PROMPT, MAX_TOKENS, REFERENCE_OPTIONS)
        assert.deepStrictEqual(tokens, ref.tokens)
        assert.isAtLeast(new Set(tokens).size, 4, "the stream is not trivial")

        const planned = updates.find((u) => u._tag === "Planned")
        assert.isDefined(maps)
        assert.strictEqual(planned?._tag, "Planned")
        if (planned?._tag !== "Planned" || maps === undefined) return
        assert.strictEqual(planned.stages.length, 3)
        const numLayers = 4
        for (const stage of planned.stages) {
          const [layerStart, layerEndExclusive] = stage.layers
          const expected = [
            ...new Set(
              sliceTensors(file, { layerStart, layerEndExclusive, numLayers }).map((t) => tensorFilePath(file, t))
            )
          ].sort()
          const mine: { readonly parts: ReadonlyArray<string> } | undefined = maps.find(
            (m) => m.address === stage.address
          )
          assert.isDefined(mine, `an agent at ${stage.address}`)
          assert.deepStrictEqual([...mine!.parts].sort(), expected, `stage ${layerStart}..${layerEndExclusive}`)
          assert.isBelow(mine!.parts.length, parts.length, "no stage maps the whole set")
        }
        const finished = updates.find((u) => u._tag === "Finished")
        const text = finished?._tag === "Finished" ? finished.summary.text : undefined
        assert.isDefined(text)

        const server = yield* Effect.promise(() =>
          startServe(["--model", parts[0]!, "--stages", "3", "--threads", "1"])
        )
        try {
          const client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: "none", maxRetries: 0, timeout: 60_000 })
          const answer = yield* Effect.promise(() =>
            client.completions.create({ model: "q3", prompt: PROMPT, max_tokens: MAX_TOKENS, temperature: 0 })
          )
          assert.strictEqual(answer.choices[0]!.text, text)
          assert.strictEqual(answer.usage?.completion_tokens, MAX_TOKENS)
        } finally {
          yield* Effect.promise(() => stopServe(server))
        }
      }),
    240_000
  )

  it.live(
    "nodes without the set (--slices-only, empty caches) receive one-file slices cut from its parts and give node-llama-cpp's tokens",
    () =>
      Effect.scoped(
        Effect.gen(function* () {
          const parts = qwen3moeSet()
          const root = yield* Effect.acquireRelease(
            Effect.sync(() => mkdtempSync(join(tmpdir(), "swactor-split-delivery-"))),
            (d) => Effect.sync(() => rmSync(d, { recursive: true, force: true }))
          )
          const caches = [0, 1, 2].map((i) => join(root, `node-${i}`))
          const { layer } = yield* startAgents(3, { extraArgs: (i) => ["--cache-dir", caches[i]!, "--slices-only"] })
          const updates = yield* Stream.runCollect(
            run({
              model: parts[0]!,
              prompt: PROMPT,
              stages: 3,
              maxTokens: 16,
              threads: 1,
              deliverWeights: { outgoingDir: join(root, "outgoing"), chunkBytes: 64 << 10 }
            })
          ).pipe(Effect.provide(layer))
          const list = [...updates]
          const tokens = list.flatMap((u) => (u._tag === "Token" && u.token.tokenId >= 0 ? [u.token.tokenId] : []))
          const ref = yield* nodeLlamaReference(parts[0]!, PROMPT, 16, REFERENCE_OPTIONS)
          assert.deepStrictEqual(tokens, ref.tokens)
          assert.isAbove(
            list.filter((u) => u._tag === "WeightsDelivery").length,
            0,
            "slices were sent, not read from the parts"
          )
          for (const cache of caches) {
            const slices = readdirSync(cache).filter((f) => f.endsWith(".gguf"))
            assert.strictEqual(slices.length, 1, cache)
            const slice = yield* readGgufFile(join(cache, slices[0]!))
            assert.isUndefined(slice.parts, "a slice is one file")
            assert.isFalse(slice.metadata.has("split.count"))
          }
        })
      ),
    240_000
  )
})
