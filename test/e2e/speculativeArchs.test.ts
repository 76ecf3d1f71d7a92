/**
 * Speculative decoding on more than stories260K: synthetic llama Q8_0 and Q4_K, qwen3moe (experts, Q8_0), gemma3
 * (sliding-window blocks whose capped ring cache is rolled back within its slack, generated past the window), qwen35
 * and kimi-k3 (recurrent states rolled back through the verify steps' snapshots), at 1 to
 * 4 stages on real agent processes: the greedy tokens with drafts equal the tokens without. Random weights repeat
 * little, so the drafts come from a prediction: the output itself with every third token changed, so steps keep some
 * drafts and refuse the rest (the summary says both happened).
 */
import { assert, describe, it } from "@effect/vitest"
import { Chunk, Effect, Stream } from "effect"
import { join } from "node:path"
import { layerRemote, run } from "../../src/api/generate.js"
import { generateToken, spawnLocalAgents } from "../../src/layers/agent/AgentProcesses.js"
import { type SyntheticModelOptions, writeSyntheticModel } from "../../src/layers/gguf/Synthetic.js"
import type { GenerateRequest, RunSummary } from "../../src/services/Orchestrator.js"
import { writeConverted } from "../support/convertedModels.js"
import { modelFolder } from "../support/synthFiles.js"

const dir = modelFolder("swactor-speculative-archs-")
const maxTokens = 48

const shape = (name: string, extra: Partial<SyntheticModelOptions>): SyntheticModelOptions => ({
  path: join(dir, `${name}.gguf`),
  arch: "llama",
  layers: 4,
  hidden: 256,
  ffn: 512,
  heads: 4,
  kvHeads: 2,
  vocab: 400,
  contextLength: 256,
  type: "q8_0",
  seed: 31,
  ...extra
})

const models: ReadonlyArray<SyntheticModelOptions> = [
  shape("llama-q8_0", {}),
  shape("llama-q4_k", { type: "q4_k" }),
  shape("qwen3moe-q8_0", { arch: "qwen3moe", experts: 8, expertsUsed: 2, expertFfn: 128 }),
  shape("gemma3-f32", { arch: "gemma3", hidden: 128, ffn: 256, type: "f32", slidingWindow: 16, swaPattern: 3 }),
  // DeltaNet blocks 0-2 and 4-6, attention 3 and 7: their states roll back through the verify steps' snapshots
  shape("qwen35-q8_0", { arch: "qwen35", layers: 8, headDim: 64 })
]

const generate = (agents: ReadonlyArray<string>, token: string, request: GenerateRequest) =>
  Effect.gen(function* () {
    const updates = Chunk.toReadonlyArray(
      yield* Stream.runCollect(run(request)).pipe(
        Effect.provide(layerRemote({ agents, token, listenHost: "127.0.0.1" }))
      )
    )
    const finished = updates.find((u) => u._tag === "Finished")
    if (finished?._tag !== "Finished") return assert.fail("the run did not finish")
    return {
      tokens: updates.flatMap((u) => (u._tag === "Token" && u.token.tokenId >= 0 ? [u.token.tokenId] : [])),
      summary: finished.summary as RunSummary
    }
  })

/** At 1 to 4 stages: the tokens with drafts (some kept, some refused) equal the tokens without. */
const sameTokensWithDrafts = (path: string, vocab: number, stageCounts = [1, 2, 3, 4]) =>
  Effect.gen(function* () {
    const token = generateToken()
    const agents = (yield* spawnLocalAgents({ count: 4, token, threads: 1 })).map((a) => a.address)
    let kept = 0
    let refused = 0
    for (const stages of stageCounts) {
      const base = { model: path, prompt: "Once upon a time", maxTokens, threads: 1, stages }
      const off = yield* generate(agents, token, base)
      assert.strictEqual(off.tokens.length, maxTokens)
      const predicted = off.tokens.map((t, i) => (i % 3 === 2 ? (t + 1) % vocab : t))
      const on = yield* generate(agents, token, {
        ...base,
        speculative: { mode: "ngram", fixed: true, predicted }
      })
      // a recovery replays tokens, after which the prediction (by position) is off: say so if a run went through one
      for (const r of [off, on]) {
        for (const rec of r.summary.recoveries) console.error(`${stages} stages: a run recovered: ${rec.reason}`)
      }
      assert.deepStrictEqual(on.tokens, off.tokens, `${stages} stages`)
      const spec = on.summary.speculative!
      console.log(`${path}: ${stages} stages: ${JSON.stringify(spec)}`)
      kept += spec.accepted
      refused += spec.drafted - spec.accepted
    }
    // drafts kept and refused over the stage counts (one run under load once kept none of 99 drafts with the tokens
    // equal: a prediction by position that lost its place, not explained yet)
    assert.isAbove(kept, 0, "drafts kept")
    assert.isAbove(refused, 0, "drafts refused")
  }).pipe(Effect.scoped)

describe("speculative decoding: the same greedy tokens on synthetic families, 1-4 stages", () => {
  for (const o of models) {
    it.live(
      `${o.arch} ${o.type}: tokens with drafts equal the tokens without, drafts kept and refused`,
      () => Effect.flatMap(writeSyntheticModel(o), () => sameTokensWithDrafts(o.path, o.vocab)),
      240_000
    )
  }
  // KDA blocks (recurrent, rolled back through the snapshots) among MLA blocks; DSA's indexer keys by position (its
  // top-k smaller than the prompt and the output), glm-dsa's blocks reusing an earlier block's top-k: as llama.cpp's
  // converter writes them
  // (glm-dsa-shared's 4 blocks have 2 boundaries that keep a shared block with its source: 3 stages at most)
  for (const [family, most] of [
    ["kimi-k3", 4],
    ["deepseek32", 4],
    ["glm-dsa-shared", 3]
  ] as const) {
    it.live(
      `${family} (gguf-py file): tokens with drafts equal the tokens without, drafts kept and refused`,
      () =>
        sameTokensWithDrafts(
          writeConverted(family, join(dir, `${family}.gguf`), 7),
          512,
          Array.from({ length: most }, (_, i) => i + 1)
        ),
      240_000
    )
  }
})
