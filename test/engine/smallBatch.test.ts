/**
 * SmallBatch: which CPU kernel a product of a few rows takes is measured per weight type on the running machine.
 * The choice may only trade speed when it cannot change bits: a type whose two kernels give other bits (F32) keeps
 * the one-row kernel (a batched row gets its lone bits); a type whose kernels agree (Q8_0) takes the faster one, and
 * then a batched decode step still gets exactly its lone logits, whichever kernel runs.
 */
import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { afterAll } from "vitest"
import { GgmlType } from "../../src/layers/ggml/Bindings.js"
import { loadWeights, type NativeWeights } from "../../src/layers/engine/Weights.js"
import { chooseMaxRows, exactRowsDefault, measureSmallBatch } from "../../src/layers/engine/SmallBatch.js"
import { layoutStage } from "../../src/layers/engine/StageLayout.js"
import * as StageExecutorLive from "../../src/layers/engine/StageExecutorLive.js"
import { readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { writeSyntheticModel } from "../../src/layers/gguf/Synthetic.js"
import { StageExecutor } from "../../src/services/StageExecutor.js"
import { decodeBatchGetsLoneBits } from "../support/engine.js"
import { requireModel } from "../support/models.js"

const dir = mkdtempSync(join(tmpdir(), "swactor-small-batch-"))
afterAll(() => rmSync(dir, { recursive: true, force: true }))

const q8Model = Effect.promise(async () => {
  const path = join(dir, "llama-q8_0.gguf")
  await Effect.runPromise(
    writeSyntheticModel({
      path,
      arch: "llama",
      layers: 2,
      hidden: 256,
      ffn: 1024,
      heads: 4,
      kvHeads: 2,
      vocab: 400,
      contextLength: 256,
      type: "q8_0",
      seed: 11
    })
  )
  return path
})

const withWeights = <A>(path: string, blocks: number, f: (w: NativeWeights) => Promise<A>) =>
  Effect.gen(function* () {
    const file = yield* readGgufFile(path)
    const layout = yield* layoutStage(file, {
      path,
      layerStart: 0,
      layerEndExclusive: blocks,
      isFirst: true,
      isLast: true
    })
    return yield* Effect.promise(async () => {
      const w = await loadWeights(layout, { mmap: false })
      try {
        return await f(w)
      } finally {
        w.free()
      }
    })
  })

const measure = (w: NativeWeights) =>
  measureSmallBatch(w.ggml, w.backend, w.ggml.raw.ggml_backend_dev_buffer_type(w.dev), w.tensors, 1)

describe("SmallBatch: the kernel of a few-row product", () => {
  it("the rule: other bits keep the one-row kernel up to 7 rows; same bits take it only while it is faster", () => {
    assert.strictEqual(
      chooseMaxRows(false, [
        [2, 9, 1],
        [4, 9, 1],
        [7, 9, 1]
      ]),
      exactRowsDefault
    )
    assert.strictEqual(
      chooseMaxRows(true, [
        [2, 1, 2],
        [4, 1, 2],
        [7, 1, 2]
      ]),
      7
    )
    assert.strictEqual(
      chooseMaxRows(true, [
        [2, 1, 2],
        [4, 3, 2],
        [7, 1, 2]
      ]),
      2
    )
    assert.strictEqual(
      chooseMaxRows(true, [
        [2, 2, 1],
        [4, 1, 2],
        [7, 1, 2]
      ]),
      0
    )
    assert.strictEqual(
      chooseMaxRows(true, [
        [2, 1, 1],
        [4, 1, 2],
        [7, 1, 2]
      ]),
      0
    )
  })

  it.live("stories260K (F32): tinyBLAS gives other bits, so the one-row kernel stays up to 7 rows", () =>
    Effect.gen(function* () {
      const trials = yield* withWeights(requireModel("stories260K.gguf"), 5, measure)
      const f32 = trials.find((t) => t.type === GgmlType.F32)
      assert.isDefined(f32, `measured types: ${trials.map((t) => t.type).join(",")}`)
      assert.isFalse(f32!.sameBits)
      assert.strictEqual(f32!.maxRows, exactRowsDefault)
      assert.deepStrictEqual(
        f32!.millis.map(([rows]) => rows),
        [2, 4, 7]
      )
    })
  )

  it.live("synthetic Q8_0: both kernels give the same bits, the timed rule decides, on the largest matrix", () =>
    Effect.gen(function* () {
      const trials = yield* withWeights(yield* q8Model, 2, measure)
      const q8 = trials.find((t) => t.type === GgmlType.Q8_0)
      assert.isDefined(q8)
      assert.isTrue(q8!.sameBits)
      assert.strictEqual(q8!.maxRows, chooseMaxRows(true, q8!.millis))
      // ffn 1024 x hidden 256 matrices and the 400 x 256 output: the largest Q8_0 one is an FFN matrix
      assert.match(q8!.tensor, /ffn_(up|gate|down)/)
      for (const [, gemv, tiny] of q8!.millis) assert.isTrue(gemv > 0 && tiny > 0)
    })
  )

  // Whichever kernel the measurement picks on a machine, Q8_0 decode steps of 2..7 sequences in one batch get the
  // bits of their lone steps: both settings are forced here (the executor's smallBatchRows, SWACTOR_GEMV_MAX_ROWS's
  // option).
  for (const rows of [0, 7]) {
    it.live(
      `synthetic Q8_0, one-row kernel up to ${rows} rows: 2..7 sequences in one decode batch get their lone bits`,
      () =>
        Effect.gen(function* () {
          const path = yield* q8Model
          const executor = yield* StageExecutor
          const whole = yield* executor.load({ path, layerStart: 0, layerEndExclusive: 2, isFirst: true, isLast: true })
          yield* decodeBatchGetsLoneBits(whole, [2, 3, 5, 7], 390, 9)
        }).pipe(Effect.scoped, Effect.provide(StageExecutorLive.layerWith({ smallBatchRows: rows })))
    )
  }
})
