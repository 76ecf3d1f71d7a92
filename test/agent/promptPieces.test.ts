/**
 * A prompt travels between stages in pieces (src/services/PromptPieces.ts): stage 0 sends each piece on as soon as it
 * ran, so the next stage works while it runs the next one. The pieces must not change a bit of what is computed.
 */
import { assert, describe, it } from "@effect/vitest"
import { Effect, Stream } from "effect"
import { join } from "node:path"
import { run } from "../../src/api/generate.js"
import type { RunSummary } from "../../src/services/Orchestrator.js"
import * as StageExecutorLive from "../../src/layers/engine/StageExecutorLive.js"
import { writeSyntheticModel } from "../../src/layers/gguf/Synthetic.js"
import { MIN_PIECE_ROWS, promptPieces } from "../../src/services/PromptPieces.js"
import { greedy } from "../../src/services/Sampler.js"
import { sameBits } from "../support/batch.js"
import { startAgents } from "../support/e2e.js"
import { openPipeline, referenceRun } from "../support/engine.js"
import { requireModel } from "../support/models.js"
import { modelFolder } from "../support/synthFiles.js"

const sum = (xs: ReadonlyArray<number>) => xs.reduce((a, b) => a + b, 0)

describe("promptPieces: the cut", () => {
  it("a prompt under two pieces' rows travels whole; a 128-row chunk goes as two 64-row pieces", () => {
    assert.deepStrictEqual(promptPieces(5, 128), [5])
    assert.deepStrictEqual(promptPieces(127, 128), [127])
    assert.deepStrictEqual(promptPieces(128, 128), [64, 64])
    assert.deepStrictEqual(promptPieces(200, 128), [64, 64, 72])
    assert.deepStrictEqual(promptPieces(300, 128), [64, 64, 64, 64, 44])
    // a chunk of 256 (SWACTOR_PREFILL_CHUNK) cuts into 4; 200 of it into 3 of 66-67
    assert.deepStrictEqual(promptPieces(456, 256), [64, 64, 64, 64, 67, 67, 66])
  })

  it("pieces follow the batcher's chunks from the prompt's start, so a cached prefix leaves the same cuts", () => {
    // a prompt resumed after 128 cached positions sends the rows the full prompt's pieces after 128 hold
    const full = promptPieces(300, 128)
    const rest = promptPieces(300 - 128, 128)
    assert.deepStrictEqual(full.slice(2), rest)
  })

  it("replayed tokens travel one per piece; the window caps a piece; the pieces always sum to the prompt", () => {
    assert.deepStrictEqual(promptPieces(10, 128, 3), [7, 1, 1, 1])
    assert.deepStrictEqual(promptPieces(140, 128, 12), [64, 64, ...Array(12).fill(1)])
    // a tail as long as the prompt keeps one row of prompt first
    assert.deepStrictEqual(promptPieces(3, 128, 3), [1, 1, 1])
    assert.deepStrictEqual(promptPieces(128, 128, 0, 50), [50, 14, 50, 14])
    for (const [rows, chunk, tail, window] of [
      [1, 128, 0, 64],
      [1000, 128, 7, 64],
      [513, 512, 0, 1000],
      [129, 1, 0, 5]
    ] as const) {
      const pieces = promptPieces(rows, chunk, tail, window)
      assert.strictEqual(sum(pieces), rows)
      assert.isTrue(pieces.every((p) => p >= 1 && p <= window))
    }
  })
})

/** Logits after `prompt` fed as `pieces` (each one call through the whole in-process split), then greedy steps. */
const runInPieces = (path: string, prompt: ReadonlyArray<number>, pieces: ReadonlyArray<number>, steps: number) =>
  Effect.scoped(
    Effect.gen(function* () {
      const { run } = yield* openPipeline(path, [0, 2, 4], { threads: 1, contextLength: 512 })
      let at = 0
      let last: Float32Array | undefined
      for (const n of pieces) {
        last = yield* run(at, Int32Array.from(prompt.slice(at, at + n)))
        at += n
      }
      const logits = [last!]
      for (let i = 0; i < steps; i++) {
        last = yield* run(at++, Int32Array.of(greedy(last!)))
        logits.push(last)
      }
      return logits
    })
  ).pipe(Effect.provide(StageExecutorLive.layer))

/** The batcher's own cut of a prompt: chunks of `chunk` rows from its start. */
const chunksOf = (rows: number, chunk: number) =>
  Array.from({ length: Math.ceil(rows / chunk) }, (_, i) => Math.min(chunk, rows - i * chunk))

describe("promptPieces: the pieces compute the chunks' very bits (ggml CPU)", () => {
  const dir = modelFolder("swactor-pieces-")
  for (const type of ["f32", "q8_0", "q4_k"] as const) {
    it.live(
      `${type}: a 200-token prompt in pieces ${JSON.stringify(promptPieces(200, 128))} gives the logits of chunks [128, 72] bit for bit, and 8 steps after`,
      () =>
        Effect.gen(function* () {
          const path = join(dir, `llama-${type}.gguf`)
          yield* writeSyntheticModel({
            path,
            arch: "llama",
            layers: 4,
            hidden: 256,
            ffn: 512,
            heads: 4,
            kvHeads: 2,
            vocab: 400,
            contextLength: 512,
            type,
            seed: 7
          })
          const prompt = Array.from({ length: 200 }, (_, i) => 1 + ((i * 37) % 390))
          const chunks = yield* runInPieces(path, prompt, chunksOf(200, 128), 8)
          const pieces = yield* runInPieces(path, prompt, promptPieces(200, 128), 8)
          pieces.forEach((l, i) => assert.isTrue(sameBits(l, chunks[i]!), `${type}: position ${i} differs`))
          // the rule is needed here: pieces below 64 rows take ggml's other attention kernel and change the bits
          const small = yield* runInPieces(path, prompt, [MIN_PIECE_ROWS / 2, MIN_PIECE_ROWS / 2, 64, 72], 0)
          assert.isFalse(sameBits(small[0]!, chunks[0]!), `${type}: 32-row pieces left the bits as they were`)
        }),
      120_000
    )
  }
})

describe("promptPieces: through agent processes", () => {
  // about 270 tokens of story (BOS included): two full batcher chunks and a rest
  const story = "Once upon a time there was a little girl named Lily. She loved to play outside in the park. "
  const prompt = story.repeat(9)
  const maxTokens = 16

  it.live(
    "a 2- and 3-stage run of a prompt over 128 tokens gives the 1-stage run's text and node-llama-cpp's tokens; each later stage ran the prompt as its pieces",
    () =>
      Effect.gen(function* () {
        const model = requireModel("stories260K.gguf")
        const { layer } = yield* startAgents(3)
        const runs = []
        for (const stages of [1, 2, 3]) {
          const updates = yield* Stream.runCollect(
            run({ model, prompt, stages, maxTokens, threads: 1 }).pipe(Stream.provideLayer(layer))
          )
          const ids: Array<number> = []
          let summary: RunSummary | undefined
          for (const update of updates) {
            if (update._tag === "Token" && update.token.tokenId >= 0) ids.push(update.token.tokenId)
            if (update._tag === "Finished") summary = update.summary
          }
          runs.push({ stages, ids, summary: summary! })
        }
        const promptTokens = runs[0]!.summary.promptTokens
        assert.isAtLeast(promptTokens, 2 * 128, "the prompt spans two full chunks")
        const pieces = promptPieces(promptTokens, 128)
        for (const { ids, stages, summary } of runs.slice(1)) {
          assert.deepStrictEqual(ids, runs[0]!.ids, `stages=${stages}`)
          assert.strictEqual(summary.text, runs[0]!.summary.text, `stages=${stages}`)
          // stage 0 ran the prompt as pieces and so did every later stage: one micro-batch per piece, then one per
          // decode step (the last token is sampled, never run)
          for (const stage of summary.stages) {
            assert.strictEqual(
              stage.microBatches,
              pieces.length + summary.generatedTokens - 1,
              `stages=${stages}, stage ${stage.stageIndex}: micro-batches`
            )
          }
        }
        // node-llama-cpp, the whole prompt in one batch: the same greedy tokens
        const reference = yield* Effect.promise(() =>
          referenceRun(model, prompt, maxTokens, { threads: 1, contextLength: 512 })
        )
        assert.deepStrictEqual(runs[0]!.ids, reference.tokens)
      }).pipe(Effect.scoped),
    240_000
  )
})
