/**
 * DeepSeek-V4 (issue 40): deepseek4 as llama.cpp's converter writes it (test/support/convertedModels.py, gguf-py):
 * hyper-connections 4 streams wide, the window, the compressed blocks (ratio 4) with their lightning indexer's top-k
 * (3) below the compressed rows the prompt makes, a heavily compressed block (ratio 128) read past 128 positions, hash
 * routing on block 0, sqrtsoftplus routing and the clamped
 * SwiGLU elsewhere. The oracle is node-llama-cpp's greedy tokens at 1, 2 and 3 stages; what crosses a stage boundary
 * is the whole residual stream, n_embd x 4 floats a token.
 */
import { assert, describe, it } from "@effect/vitest"
import { Effect, Either } from "effect"
import { join } from "node:path"
import type { ModelLoadError } from "../../src/domain/gguf.js"
import { NodeId } from "../../src/domain/ids.js"
import { blockMemory } from "../../src/layers/engine/BlockMemory.js"
import { activationWidth } from "../../src/layers/engine/PerLayerInputs.js"
import { readModelHParams } from "../../src/layers/engine/StageLayout.js"
import { layerWith } from "../../src/layers/engine/StageExecutorLive.js"
import { getU32, readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { readModelFacts, readModelLayout } from "../../src/layers/gguf/ModelCatalogLive.js"
import { choosePlacement } from "../../src/services/Placement.js"
import { activationFrameBytes } from "../../src/services/Planner.js"
import { makeRng } from "../../src/services/Sampler.js"
import * as Batch from "../support/batch.js"
import type { SeqPlan } from "../support/batch.js"
import { writeConverted } from "../support/convertedModels.js"
import { greedyRun, nodeLlamaReference, splitsMatchReference } from "../support/engine.js"
import { killedStageResumes } from "../support/resume.js"
import { modelFolder, REFERENCE_OPTIONS, STORY_PROMPT } from "../support/synthFiles.js"

const dir = modelFolder("swactor-engine-deepseek4-")
const N_TOKENS = 16

describe("deepseek4 (gguf-py file): node-llama-cpp's greedy tokens at 1, 2 and 3 stages", () => {
  it.effect(
    "hyper-connections, window and compressed blocks, top-k 3 of the compressed rows, hash routing on block 0",
    () =>
      Effect.gen(function* () {
        const path = writeConverted("deepseek4", join(dir, "deepseek4.gguf"), 7)
        const file = yield* readGgufFile(path)
        assert.strictEqual(yield* getU32(file, "deepseek4.hyper_connection.count"), 4)
        assert.strictEqual(yield* getU32(file, "deepseek4.attention.indexer.top_k"), 3)
        const ref = yield* nodeLlamaReference(path, STORY_PROMPT, N_TOKENS, REFERENCE_OPTIONS)
        assert.isAbove(Math.floor(ref.prompt.length / 4), 3, "the prompt makes more compressed rows than the top-k")
        assert.isAbove(new Set(ref.tokens).size, 2, "the reference is not one repeated token")
        yield* splitsMatchReference(
          path,
          ref,
          [
            [0, 4],
            [0, 1, 4],
            [0, 2, 4],
            [0, 1, 3, 4],
            [0, 2, 3, 4]
          ],
          REFERENCE_OPTIONS
        )
      }),
    240_000
  )

  it.effect(
    "a prompt past 128 positions: the heavily compressed block (ratio 128) reads its compressed row",
    () =>
      Effect.gen(function* () {
        const path = writeConverted("deepseek4", join(dir, "deepseek4-long.gguf"), 7)
        const prompt = Array.from({ length: 150 }, (_, i) => 3 + ((i * 37) % 397))
        const ref = yield* nodeLlamaReference(path, prompt, N_TOKENS, REFERENCE_OPTIONS)
        assert.isAbove(ref.prompt.length, 128)
        assert.isAbove(new Set(ref.tokens).size, 2, "the reference is not one repeated token")
        yield* splitsMatchReference(
          path,
          ref,
          [
            [0, 4],
            [0, 2, 4],
            [0, 1, 3, 4]
          ],
          REFERENCE_OPTIONS
        )
      }),
    240_000
  )

  it.effect("what crosses a stage boundary is n_embd x hc_mult floats a token: frames, planner and layout", () =>
    Effect.gen(function* () {
      const path = writeConverted("deepseek4", join(dir, "deepseek4-layout.gguf"), 7)
      const { hp } = yield* readModelHParams(yield* readGgufFile(path))
      for (const layer of [1, 2, 3, 4]) assert.strictEqual(activationWidth(hp, layer), 64 * 4)
      const facts = yield* readModelFacts(path)
      assert.strictEqual(facts.hiddenDim, 64 * 4)
      assert.strictEqual(activationFrameBytes(facts, 64), 64 * 4 * 4)
      assert.strictEqual((yield* readModelLayout(path)).hiddenDim, 64 * 4)
      // a window block's cache is its K=V row; a compressed block's K row adds the compressed row and its indexer key,
      // its V row (F32) the compressor's rows
      assert.deepStrictEqual(blockMemory(hp, 0), { kind: "kv", kRow: 32, vRow: 0, window: undefined })
      assert.deepStrictEqual(blockMemory(hp, 1), {
        kind: "kv",
        kRow: 32 + 32 + 64,
        vRow: 2 * (4 * 32 + 4 * 64),
        window: undefined,
        vF32: true
      })
      // a heavily compressed block: the window's row and its compressed row; the compressor's K and score, F32
      assert.deepStrictEqual(blockMemory(hp, 2), {
        kind: "kv",
        kRow: 32 + 32,
        vRow: 2 * (2 * 32),
        window: undefined,
        vF32: true
      })
    })
  )
})

describe("deepseek4 with V4's 3 hash-routed blocks: the first stage holds them", () => {
  const node = (id: number) => ({ nodeId: NodeId.make(id), freeMemoryBytes: 2 ** 40, speedBytesPerSecond: 1e9 })
  const pool = [node(1), node(2), node(3)]
  it.effect(
    "node-llama-cpp's tokens at [0, 4] and [0, 3, 4]; a stage starting at block 1 or 2 is refused; placement never cuts there",
    () =>
      Effect.gen(function* () {
        const path = writeConverted("deepseek4-hash3", join(dir, "deepseek4-hash3.gguf"), 7)
        const layout = yield* readModelLayout(path)
        assert.deepStrictEqual(layout.tokenSources, [0, 0, 0, 3])
        const ref = yield* nodeLlamaReference(path, STORY_PROMPT, N_TOKENS, REFERENCE_OPTIONS)
        assert.isAbove(new Set(ref.tokens).size, 2, "the reference is not one repeated token")
        yield* splitsMatchReference(
          path,
          ref,
          [
            [0, 4],
            [0, 3, 4]
          ],
          REFERENCE_OPTIONS
        )
        for (const split of [
          [0, 1, 4],
          [0, 2, 4]
        ]) {
          const error = (yield* Effect.flip(greedyRun(path, split, ref.prompt, 2, REFERENCE_OPTIONS))) as ModelLoadError
          assert.strictEqual(error._tag, "ModelLoadError")
          assert.match(error.message, /routes by token id .*deepseek4\.hash_layer_count/)
        }
        for (let stageCount = 1; stageCount <= 2; stageCount++) {
          const choice = choosePlacement({ _tag: "Balanced", stageCount }, layout, pool, { contextTokens: 256 })
          assert.isTrue(Either.isRight(choice), `${stageCount} stages`)
          const starts = Either.getOrThrow(choice).stages.map((s) => s.layerStart)
          assert.strictEqual(starts.length, stageCount)
          assert.notInclude(starts, 1)
          assert.notInclude(starts, 2)
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
        assert.match(JSON.stringify(fixed), /routes by token id/)
      }),
    240_000
  )
})

describe("deepseek4: sequences batched equal their lone runs", () => {
  const schedule = (): ReadonlyArray<SeqPlan> => {
    const r = makeRng(43)
    const prompt = (n: number) => Array.from({ length: n }, () => 3 + Math.floor(r() * 397))
    return [
      { prompt: prompt(5), start: 0, steps: 20 },
      { prompt: prompt(20), start: 0, steps: 20 },
      { prompt: prompt(1), start: 2, steps: 16 },
      { prompt: prompt(30), start: 1, steps: 20, chunk: 12 },
      // past 128 positions in a chunked prompt and in decode: the heavily compressed block's rows
      { prompt: prompt(120), start: 0, steps: 20, chunk: 50 }
    ]
  }
  for (const rows of [0, 8]) {
    it.live(
      `route ${rows}, 1 and 2 stages: every sequence's tokens equal its lone run's`,
      () =>
        Effect.gen(function* () {
          const path = writeConverted("deepseek4", join(dir, "deepseek4-batch.gguf"), 9)
          const maxDiff = yield* Batch.batchedEqualsAlone(
            path,
            [
              [0, 4],
              [0, 2, 4]
            ],
            schedule(),
            256
          )
          console.log(`deepseek4 route ${rows}: batched vs alone max logit difference ${maxDiff.toExponential(2)}`)
        }).pipe(Effect.provide(layerWith({ smallBatchRows: rows }))),
      300_000
    )
  }
})

describe("deepseek4: a stage killed mid-generation resumes", () => {
  // the second case runs past 128 positions, the stage killed after the heavily compressed block's first row
  for (const { maxTokens, atToken } of [
    { maxTokens: 40, atToken: 12 },
    { maxTokens: 150, atToken: 135 }
  ]) {
    it.live(
      `3 local agents, ${maxTokens} tokens: node-llama-cpp's tokens; the middle agent killed at token ${atToken} resumes to the same tokens`,
      () =>
        Effect.gen(function* () {
          const path = writeConverted("deepseek4", join(dir, `deepseek4-resume-${maxTokens}.gguf`), 7)
          const { reference } = yield* killedStageResumes(
            { model: path, prompt: "Once upon a time", maxTokens, threads: 1, stages: 3 },
            { atToken }
          )
          const ref = yield* nodeLlamaReference(path, "Once upon a time", maxTokens, REFERENCE_OPTIONS)
          assert.deepStrictEqual(reference.tokens, ref.tokens)
        }),
      240_000
    )
  }
})
