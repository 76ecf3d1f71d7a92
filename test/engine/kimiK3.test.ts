/**
 * Kimi K3 (issue 40): kimi-k3 as llama.cpp's converter writes it (test/support/convertedModels.py, gguf-py): KDA blocks
 * with an MLA block every 4th, a dense leading block, the latent MoE, situ, the MLA output gate, and the attention
 * residuals banked every 3 blocks (blocks 0, 3 and 6). The oracle is node-llama-cpp's greedy tokens at 1, 2 and 3
 * stages; what crosses a stage boundary is the residual stream plus every checkpoint banked before it.
 */
import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import { join } from "node:path"
import { blockMemory } from "../../src/layers/engine/BlockMemory.js"
import { NativeSession } from "../../src/layers/engine/KvCache.js"
import { layerWith, LiveLoadedStage } from "../../src/layers/engine/StageExecutorLive.js"
import { kvBytesOfStage, kvBytesPerTokenOfBlock, kvCacheSize } from "../../src/services/KvSize.js"
import { stageMemoryBytes } from "../../src/services/Placement.js"
import { makeRng } from "../../src/services/Sampler.js"
import * as Batch from "../support/batch.js"
import type { SeqPlan } from "../support/batch.js"
import { activationWidth } from "../../src/layers/engine/PerLayerInputs.js"
import { readModelHParams } from "../../src/layers/engine/StageLayout.js"
import { readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { readModelFacts, readModelLayout } from "../../src/layers/gguf/ModelCatalogLive.js"
import { activationFrameBytes } from "../../src/services/Planner.js"
import { writeConverted } from "../support/convertedModels.js"
import { nodeLlamaReference, splitsMatchReference } from "../support/engine.js"
import { killedStageResumes } from "../support/resume.js"
import { modelFolder, REFERENCE_OPTIONS, STORY_PROMPT } from "../support/synthFiles.js"

const dir = modelFolder("swactor-engine-kimi-k3-")
const N_TOKENS = 16

describe("kimi-k3 (gguf-py file): node-llama-cpp's greedy tokens at 1, 2 and 3 stages", () => {
  it.effect(
    "KDA and MLA blocks, attention residuals, latent MoE with situ: splits around the checkpoint blocks",
    () =>
      Effect.gen(function* () {
        const path = writeConverted("kimi-k3", join(dir, "kimi-k3.gguf"), 7)
        const ref = yield* nodeLlamaReference(path, STORY_PROMPT, N_TOKENS, REFERENCE_OPTIONS)
        assert.isAbove(new Set(ref.tokens).size, 2, "the reference is not one repeated token")
        yield* splitsMatchReference(
          path,
          ref,
          [
            [0, 8],
            // right after the dense leading block (1 checkpoint crosses), on either side of checkpoint block 3
            // (1 and 2 checkpoints cross), after the last checkpoint block (3 cross)
            [0, 1, 8],
            [0, 3, 8],
            [0, 4, 8],
            [0, 7, 8],
            [0, 1, 4, 8],
            [0, 3, 4, 8],
            [0, 2, 6, 8]
          ],
          REFERENCE_OPTIONS
        )
      }),
    240_000
  )

  it.effect(
    "what crosses a stage boundary is n_embd x (1 + checkpoints banked before it): frames, planner, layout",
    () =>
      Effect.gen(function* () {
        const path = writeConverted("kimi-k3", join(dir, "kimi-k3-layout.gguf"), 7)
        const { hp } = yield* readModelHParams(yield* readGgufFile(path))
        // blocks 0, 3 and 6 bank: 1 checkpoint before blocks 1-3, 2 before 4-6, 3 before 7
        assert.deepStrictEqual(
          [1, 2, 3, 4, 5, 6, 7].map((layer) => activationWidth(hp, layer)),
          [2, 2, 2, 3, 3, 3, 4].map((streams) => 64 * streams)
        )
        // the planner's frame holds the widest boundary's rows
        const facts = yield* readModelFacts(path)
        assert.strictEqual(facts.hiddenDim, 64 * 4)
        assert.strictEqual(activationFrameBytes(facts, 64), 64 * 4 * 4)
        assert.strictEqual((yield* readModelLayout(path)).hiddenDim, 64 * 4)
      })
  )
})

describe("kimi-k3's memory: KDA state as qwen35's DeltaNet state, MLA's latent rows", () => {
  it.live(
    "KDA blocks keep qwen35's constant state, MLA blocks their latent row: allocated, StageInfo, layout and placement agree",
    () =>
      Effect.gen(function* () {
        const path = writeConverted("kimi-k3", join(dir, "kimi-k3-state.gguf"), 7)
        const { hp } = yield* readModelHParams(yield* readGgufFile(path))
        // conv: 3 (q, k, v) x (kernel 4 - 1) x 64 inner; ssm: head_dim 16 squared x 4 heads
        const state = 4 * (3 * 3 * 64 + 16 * 16 * 4)
        // the latent (32) then the shared part of K (8), F16, no V row
        const row = kvBytesPerTokenOfBlock(40, 0)
        assert.deepStrictEqual(blockMemory(hp, 0), { kind: "state", conv: 3 * 3 * 64, ssm: 16 * 16 * 4 })
        assert.deepStrictEqual(blockMemory(hp, 3), { kind: "kv", kRow: 40, vRow: 0, window: undefined })
        const layout = yield* readModelLayout(path)
        const mlaBlocks = [3, 7]
        const isMla = (il: number) => mlaBlocks.includes(il)
        assert.deepStrictEqual(
          layout.stateBytes,
          Array.from({ length: 8 }, (_, il) => (isMla(il) ? 0 : state))
        )
        assert.deepStrictEqual(
          layout.kvBytesPerToken,
          Array.from({ length: 8 }, (_, il) => (isMla(il) ? row : 0))
        )
        const stages = yield* Batch.loadSplit(path, [0, 3, 8])
        for (const context of [64, 512]) {
          // [0, 3): three KDA blocks; [3, 8): MLA, KDA x 3, MLA
          const expected = [3 * state, 3 * state + 2 * kvCacheSize(context) * row]
          stages.forEach((stage, i) => {
            assert.instanceOf(stage, LiveLoadedStage)
            const s = new NativeSession((stage as LiveLoadedStage).weights, context, 1)
            try {
              assert.strictEqual(s.kvBytes, expected[i], `stage ${i}, context ${context}: allocated`)
              assert.strictEqual(kvBytesOfStage(stage.info, context), expected[i], `stage ${i}: StageInfo`)
            } finally {
              s.free()
            }
          })
          // what placement and --dry-run count for each stage
          const opts = { contextTokens: context, computeBytes: 0 }
          const weights = (a: number, b: number) => layout.blockBytes.slice(a, b).reduce((x, y) => x + y, 0)
          assert.strictEqual(stageMemoryBytes(layout, 0, 3, opts), layout.inputBytes + weights(0, 3) + expected[0]!)
          assert.strictEqual(stageMemoryBytes(layout, 3, 8, opts), weights(3, 8) + layout.outputBytes + expected[1]!)
        }
      }).pipe(Effect.scoped, Effect.provide(layerWith({ smallBatchRows: 0 }))),
    120_000
  )
})

describe("kimi-k3: sequences batched equal their lone runs; a killed stage resumes", () => {
  const schedule = (): ReadonlyArray<SeqPlan> => {
    const r = makeRng(47)
    const prompt = (n: number) => Array.from({ length: n }, () => 3 + Math.floor(r() * 397))
    return [
      { prompt: prompt(5), start: 0, steps: 16 },
      { prompt: prompt(20), start: 0, steps: 16 },
      { prompt: prompt(1), start: 2, steps: 12 },
      { prompt: prompt(30), start: 1, steps: 16, chunk: 12 }
    ]
  }
  for (const rows of [0, 8]) {
    it.live(
      `route ${rows}, 1, 2 and 3 stages, Q8_0: every sequence's logits (KDA states, checkpoints) are its lone run's bits`,
      () =>
        Effect.gen(function* () {
          const path = writeConverted("kimi-k3+q8_0", join(dir, "kimi-k3-batch.gguf"), 9)
          const maxDiff = yield* Batch.batchedEqualsAlone(
            path,
            [
              [0, 8],
              [0, 4, 8],
              [0, 1, 7, 8]
            ],
            schedule(),
            256,
            { bitIdentical: true }
          )
          console.log(`kimi-k3 route ${rows}: batched vs alone max logit difference ${maxDiff.toExponential(2)}`)
        }).pipe(Effect.provide(layerWith({ smallBatchRows: rows }))),
      300_000
    )
  }

  it.live(
    "3 local agents, 40 tokens: node-llama-cpp's tokens; the middle agent killed at token 12 resumes to the same tokens",
    () =>
      Effect.gen(function* () {
        const path = writeConverted("kimi-k3", join(dir, "kimi-k3-resume.gguf"), 7)
        const { reference } = yield* killedStageResumes(
          { model: path, prompt: "Once upon a time", maxTokens: 40, threads: 1, stages: 3 },
          { atToken: 12 }
        )
        const ref = yield* nodeLlamaReference(path, "Once upon a time", 40, REFERENCE_OPTIONS)
        assert.deepStrictEqual(reference.tokens, ref.tokens)
      }),
    240_000
  )
})

describe("kimi-k3: bad metadata is a typed error naming the key, never an abort", () => {
  const kv = [0, 0, 0, 1, 0, 0, 0, 1]
  const cases: ReadonlyArray<readonly [string, string, number | ReadonlyArray<number> | null]> = [
    ["no attn_res.block_size", "kimi-k3.attn_res.block_size", null],
    ["situ beta 0", "kimi-k3.activation.situ_beta", 0],
    ["no situ linear beta", "kimi-k3.activation.situ_linear_beta", null],
    ["a 1-tap convolution", "kimi-k3.ssm.conv_kernel", 1],
    ["KDA head size 0", "kimi-k3.kda.head_dim", 0],
    ["the KV head pattern one block short", "kimi-k3.attention.head_count_kv", kv.slice(1)],
    ["two attention blocks with different KV heads", "kimi-k3.attention.head_count_kv", [2, ...kv.slice(1)]]
  ]
  for (const [what, key, value] of cases) {
    it.effect(`${what}: a ModelLoadError naming "${key}"`, () =>
      Effect.gen(function* () {
        const file = yield* readGgufFile(writeConverted("kimi-k3", join(dir, "kimi-k3-metadata.gguf"), 7))
        assert.isTrue(file.metadata.has(key))
        const metadata = new Map(file.metadata)
        const metadataTypes = new Map(file.metadataTypes)
        if (value === null) {
          metadata.delete(key)
          metadataTypes.delete(key)
        } else metadata.set(key, value)
        const error = yield* Effect.flip(readModelHParams({ ...file, metadata, metadataTypes }))
        assert.strictEqual(error._tag, "ModelLoadError")
        assert.include(error.message, key)
      })
    )
  }
})
