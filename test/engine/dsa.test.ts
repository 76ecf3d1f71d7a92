/**
 * DeepSeek sparse attention (issue 40): deepseek32 (DeepSeek-V3.2) and glm-dsa (GLM-5, and GLM-5.2's shared indexers)
 * as llama.cpp's converter writes them (test/support/convertedModels.py, gguf-py), their indexer's top-k (6) below the
 * prompt's length. The oracle is node-llama-cpp's greedy tokens at 1, 2 and 3 stages, splits right after the dense
 * leading block included; the same file with the top-k past the context gives other tokens, so the top-k is what the
 * match rests on.
 */
import { assert, describe, it } from "@effect/vitest"
import { Effect, Either } from "effect"
import { join } from "node:path"
import type { ModelLoadError } from "../../src/domain/gguf.js"
import { NodeId } from "../../src/domain/ids.js"
import { blockMemory } from "../../src/layers/engine/BlockMemory.js"
import { readModelHParams } from "../../src/layers/engine/StageLayout.js"
import { layerWith } from "../../src/layers/engine/StageExecutorLive.js"
import { getU32, readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { readModelFacts, readModelLayout } from "../../src/layers/gguf/ModelCatalogLive.js"
import { kvBytesPerTokenOfBlock } from "../../src/services/KvSize.js"
import { choosePlacement } from "../../src/services/Placement.js"
import { makeRng } from "../../src/services/Sampler.js"
import * as Batch from "../support/batch.js"
import type { SeqPlan } from "../support/batch.js"
import { writeConverted } from "../support/convertedModels.js"
import { greedyRun, nodeLlamaReference, splitsMatchReference } from "../support/engine.js"
import { killedStageResumes } from "../support/resume.js"
import { modelFolder, REFERENCE_OPTIONS, STORY_PROMPT } from "../support/synthFiles.js"

const dir = modelFolder("swactor-engine-dsa-")
const N_TOKENS = 16
const SPLITS = [
  [0, 4],
  [0, 1, 4],
  [0, 1, 3, 4]
]

describe("DSA families (gguf-py files): node-llama-cpp's greedy tokens at 1, 2 and 3 stages", () => {
  for (const family of ["deepseek32", "glm-dsa"] as const) {
    it.effect(
      `${family}: a dense leading block, the MTP block left out, top-k 6 under a longer prompt`,
      () =>
        Effect.gen(function* () {
          const path = writeConverted(family, join(dir, `${family}.gguf`), 7)
          const file = yield* readGgufFile(path)
          assert.strictEqual(yield* getU32(file, `${family}.attention.indexer.top_k`), 6)
          assert.strictEqual(yield* getU32(file, `${family}.block_count`), 5)
          assert.strictEqual((yield* readModelFacts(path)).numLayers, 4)
          const ref = yield* nodeLlamaReference(path, STORY_PROMPT, N_TOKENS, REFERENCE_OPTIONS)
          assert.isAbove(ref.prompt.length, 6, "the prompt is longer than the top-k")
          assert.isAbove(new Set(ref.tokens).size, 1, "the reference is not one repeated token")
          yield* splitsMatchReference(path, ref, SPLITS, REFERENCE_OPTIONS)
        }),
      240_000
    )
  }

  it.effect(
    "deepseek32 with the top-k past the context (dense): other tokens than top-k 6, and node-llama-cpp's again",
    () =>
      Effect.gen(function* () {
        const sparse = writeConverted("deepseek32", join(dir, "deepseek32-sparse.gguf"), 7)
        const wide = writeConverted("deepseek32-wide", join(dir, "deepseek32-wide.gguf"), 7)
        const refSparse = yield* nodeLlamaReference(sparse, STORY_PROMPT, N_TOKENS, REFERENCE_OPTIONS)
        const refWide = yield* nodeLlamaReference(wide, STORY_PROMPT, N_TOKENS, REFERENCE_OPTIONS)
        assert.notDeepEqual(refSparse.tokens, refWide.tokens, "the top-k changes what attention reads")
        yield* splitsMatchReference(
          wide,
          refWide,
          [
            [0, 4],
            [0, 2, 4]
          ],
          REFERENCE_OPTIONS
        )
      }),
    240_000
  )

  it.effect(
    "the indexer's key cache is each block's V cache: 2 bytes x key_length per token on top of the latent row",
    () =>
      Effect.gen(function* () {
        const path = writeConverted("deepseek32", join(dir, "deepseek32-layout.gguf"), 7)
        const { hp } = yield* readModelHParams(yield* readGgufFile(path))
        assert.deepStrictEqual(blockMemory(hp, 2), { kind: "kv", kRow: 40, vRow: 64, window: undefined })
        const layout = yield* readModelLayout(path)
        assert.deepStrictEqual(layout.kvBytesPerToken, Array(4).fill(kvBytesPerTokenOfBlock(40, 64)))
        assert.isUndefined(layout.topKSources)
      })
  )
})

describe("glm-dsa with shared indexers (GLM-5.2's indexer.types): block 2 reuses block 1's top-k", () => {
  const node = (id: number) => ({ nodeId: NodeId.make(id), freeMemoryBytes: 2 ** 40, speedBytesPerSecond: 1e9 })
  const pool = [node(1), node(2), node(3)]
  it.effect(
    "node-llama-cpp's tokens at splits that keep blocks 1 and 2 together; a stage starting at block 2 is refused; placement never cuts there",
    () =>
      Effect.gen(function* () {
        const path = writeConverted("glm-dsa-shared", join(dir, "glm-dsa-shared.gguf"), 7)
        const file = yield* readGgufFile(path)
        assert.isFalse(file.tensorsByName.has("blk.2.indexer.proj.weight"), "block 2 has no indexer")
        const { hp } = yield* readModelHParams(file)
        assert.deepStrictEqual(hp.dsa?.full, [true, true, false, true])
        // block 2 keeps its latent cache but no indexer cache
        assert.deepStrictEqual(blockMemory(hp, 2), { kind: "kv", kRow: 40, vRow: 0, window: undefined })
        const layout = yield* readModelLayout(path)
        assert.deepStrictEqual(layout.topKSources, [0, 1, 1, 3])
        const ref = yield* nodeLlamaReference(path, STORY_PROMPT, N_TOKENS, REFERENCE_OPTIONS)
        assert.isAbove(new Set(ref.tokens).size, 1, "the reference is not one repeated token")
        yield* splitsMatchReference(path, ref, SPLITS, REFERENCE_OPTIONS)
        const error = (yield* Effect.flip(
          greedyRun(path, [0, 2, 4], ref.prompt, 2, REFERENCE_OPTIONS)
        )) as ModelLoadError
        assert.strictEqual(error._tag, "ModelLoadError")
        assert.match(error.message, /block 2 reuses block 1's indexer top-k .*glm-dsa\.attention\.indexer\.types/)
        for (let stageCount = 1; stageCount <= 3; stageCount++) {
          const choice = choosePlacement({ _tag: "Balanced", stageCount }, layout, pool, { contextTokens: 256 })
          assert.isTrue(Either.isRight(choice), `${stageCount} stages`)
          const starts = Either.getOrThrow(choice).stages.map((s) => s.layerStart)
          assert.strictEqual(starts.length, stageCount)
          assert.notInclude(starts, 2, `${stageCount} stages: ${starts}`)
        }
        const fixed = choosePlacement(
          {
            _tag: "Fixed",
            ranges: [
              [0, 2],
              [2, 4]
            ]
          },
          layout,
          pool,
          { contextTokens: 256 }
        )
        assert.isTrue(Either.isLeft(fixed))
        assert.match(JSON.stringify(fixed), /block 2 reuses block 1's indexer top-k/)
      }),
    240_000
  )
})

describe("DSA: sequences batched equal their lone runs (each sequence's own top-k)", () => {
  const schedule = (): ReadonlyArray<SeqPlan> => {
    const r = makeRng(41)
    const prompt = (n: number) => Array.from({ length: n }, () => 3 + Math.floor(r() * 397))
    return [
      { prompt: prompt(5), start: 0, steps: 20 },
      { prompt: prompt(20), start: 0, steps: 20 },
      { prompt: prompt(1), start: 2, steps: 16 },
      { prompt: prompt(30), start: 1, steps: 20, chunk: 12 }
    ]
  }
  // F16 weights (as the converter writes them) are not on an exact route in a batch, for deepseek2's latent attention
  // alike (its gguf-py file's logits differ by ~1e-2 batched, seen): the tokens are compared, as deepseek2's f32 cases
  for (const family of ["deepseek32", "glm-dsa-shared"] as const) {
    for (const rows of [0, 8]) {
      it.live(
        `${family}, route ${rows}, 1 and 2 stages: every sequence's tokens equal its lone run's`,
        () =>
          Effect.gen(function* () {
            const path = writeConverted(family, join(dir, `${family}-batch.gguf`), 9)
            const maxDiff = yield* Batch.batchedEqualsAlone(
              path,
              [
                [0, 4],
                [0, 1, 4]
              ],
              schedule(),
              256
            )
            console.log(`${family} route ${rows}: batched vs alone max logit difference ${maxDiff.toExponential(2)}`)
          }).pipe(Effect.provide(layerWith({ smallBatchRows: rows }))),
        300_000
      )
    }
  }
})

describe("DSA: a stage killed mid-generation resumes", () => {
  for (const family of ["deepseek32", "glm-dsa"] as const) {
    it.live(
      `${family} on 3 local agents: node-llama-cpp's tokens; the middle agent killed at token 12 resumes to the same tokens`,
      () =>
        Effect.gen(function* () {
          const path = writeConverted(family, join(dir, `${family}-resume.gguf`), 7)
          const { reference } = yield* killedStageResumes(
            { model: path, prompt: "Once upon a time", maxTokens: 40, threads: 1, stages: 3 },
            { atToken: 12 }
          )
          const ref = yield* nodeLlamaReference(path, "Once upon a time", 40, REFERENCE_OPTIONS)
          assert.deepStrictEqual(reference.tokens, ref.tokens)
        }),
      240_000
    )
  }
})
