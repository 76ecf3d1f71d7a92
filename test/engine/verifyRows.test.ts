/**
 * A speculative step's rows (StageInput.verify): a token and the tokens drafted after it, run as one call, must give
 * every row exactly the logits (and on a stage before the last, the hidden rows) that decoding them one by one gives,
 * or a speculative run's text could differ from the text without drafts. The few-row route is forced each way (the
 * executor's smallBatchRows: 7, the one-row kernel; 0, ggml's own multi-row kernel) so no measurement picks the path.
 */
import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { afterAll } from "vitest"
import type { StageOutput } from "../../src/domain/engine.js"
import * as StageExecutorLive from "../../src/layers/engine/StageExecutorLive.js"
import { writeSyntheticModel } from "../../src/layers/gguf/Synthetic.js"
import { type LoadedStage, StageExecutor } from "../../src/services/StageExecutor.js"
import { requireModel } from "../support/models.js"

const dir = mkdtempSync(join(tmpdir(), "swactor-verify-rows-"))
afterAll(() => rmSync(dir, { recursive: true, force: true }))

const q8Model = synthetic("q8_0")
const q4kModel = synthetic("q4_k")

function synthetic(type: "q8_0" | "q4_k") {
  return Effect.promise(async () => {
    const path = join(dir, `llama-${type}.gguf`)
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
        type,
        seed: 5
      })
    )
    return path
  })
}

const prompt = Int32Array.from([1, 303, 261, 378, 300, 270, 271, 307, 329, 282])
const drafted = [309, 267, 272, 314, 285, 301, 290, 277, 266]

/** Rows of a verify output as separate logits (or hidden rows). */
const rowsOf = (out: StageOutput, width: number): Array<Float32Array> => {
  const flat = out._tag === "Logits" ? out.logits : out.hidden
  return Array.from({ length: flat.length / width }, (_, i) => flat.slice(i * width, (i + 1) * width))
}

/**
 * On `stages` (one session each, threads 1): the prompt, then the token and its drafts as one verify call, against a
 * second set of sessions that decodes the same rows one by one. Every row of every stage must be bitwise equal.
 */
const verifyEqualsOneByOne = (stages: ReadonlyArray<LoadedStage>, vocab: number, nRows = 6) =>
  Effect.gen(function* () {
    const executor = yield* StageExecutor
    const open = (s: LoadedStage) => executor.session(s, { threads: 1, contextLength: 128 })
    const verifying = yield* Effect.forEach(stages, open)
    const stepping = yield* Effect.forEach(stages, open)
    const run = (sessions: typeof verifying, start: number, tokens: Int32Array, verify: boolean) =>
      Effect.gen(function* () {
        let out = yield* sessions[0]!.forward(start, { _tag: "Tokens", tokens, verify })
        for (const s of sessions.slice(1)) {
          if (out._tag !== "Hidden") return assert.fail("a stage before the last gave logits")
          out = yield* s.forward(start, { _tag: "Hidden", hidden: out.hidden, nTokens: out.nTokens, verify })
        }
        return out
      })
    yield* run(verifying, 0, prompt, false)
    yield* run(stepping, 0, prompt, false)
    const rows = Int32Array.from(drafted.slice(0, nRows), (t) => t % vocab)
    const together = yield* run(verifying, prompt.length, rows, true)
    assert.strictEqual(together._tag, "Logits")
    assert.strictEqual(together._tag === "Logits" ? together.rows : 0, rows.length)
    const lone = rowsOf(together, vocab)
    for (let i = 0; i < rows.length; i++) {
      const alone = yield* run(stepping, prompt.length + i, rows.subarray(i, i + 1), false)
      assert.strictEqual(alone._tag, "Logits")
      assert.deepStrictEqual(lone[i], rowsOf(alone, vocab)[0], `row ${i} of ${rows.length}`)
    }
    // a rejected tail is rolled back by starting again after the accepted rows: the cache then gives the lone bits
    const again = yield* run(verifying, prompt.length + 2, Int32Array.of(7), false)
    const stepped = yield* run(stepping, prompt.length + 2, Int32Array.of(7), false)
    assert.deepStrictEqual(again, stepped)
  })

const split = (path: string, blocks: number, cut: number) =>
  Effect.gen(function* () {
    const executor = yield* StageExecutor
    const first = yield* executor.load({ path, layerStart: 0, layerEndExclusive: cut, isFirst: true, isLast: false })
    const last = yield* executor.load({
      path,
      layerStart: cut,
      layerEndExclusive: blocks,
      isFirst: false,
      isLast: true
    })
    return [first, last] as const
  })

describe("a speculative step's rows get the bits of one-by-one decoding", () => {
  // F32: ggml's multi-row kernel sums in another order (forced to 0 rows this test is red at row 0), so the
  // measurement always keeps the one-row kernel for it (SmallBatch.ts); that is the route forced here
  it.live("stories260K (F32), 2 stages, one-row kernel up to 7 rows", () =>
    Effect.gen(function* () {
      const path = requireModel("stories260K.gguf")
      yield* verifyEqualsOneByOne(yield* split(path, 5, 2), 512)
    }).pipe(Effect.scoped, Effect.provide(StageExecutorLive.layerWith({ smallBatchRows: 7 })))
  )
  // 9 rows, past the route's reach of 7: in groups of 7 and 2, each on the route
  it.live("stories260K (F32), 2 stages, 9 rows (8 drafts): the rows past the route's reach in groups", () =>
    Effect.gen(function* () {
      const path = requireModel("stories260K.gguf")
      yield* verifyEqualsOneByOne(yield* split(path, 5, 2), 512, 9)
    }).pipe(Effect.scoped, Effect.provide(StageExecutorLive.layerWith({ smallBatchRows: 7 })))
  )
  // Q4_K is repacked on x86 (an extra buffer type the route never takes): one row at a time (red with the rows
  // given to the repacked multi-row kernel: tokens differ at 1 stage, test/e2e/speculativeArchs)
  it.live("synthetic Q4_K (repacked weights), 1 stage: each row alone", () =>
    Effect.gen(function* () {
      const path = yield* q4kModel
      const executor = yield* StageExecutor
      const whole = yield* executor.load({ path, layerStart: 0, layerEndExclusive: 2, isFirst: true, isLast: true })
      yield* verifyEqualsOneByOne([whole], 400)
    }).pipe(Effect.scoped, Effect.provide(StageExecutorLive.layerWith({ smallBatchRows: 7 })))
  )
  for (const rows of [0, 7]) {
    it.live(`synthetic Q8_0, 1 stage, one-row kernel up to ${rows} rows`, () =>
      Effect.gen(function* () {
        const path = yield* q8Model
        const executor = yield* StageExecutor
        const whole = yield* executor.load({ path, layerStart: 0, layerEndExclusive: 2, isFirst: true, isLast: true })
        yield* verifyEqualsOneByOne([whole], 400)
      }).pipe(Effect.scoped, Effect.provide(StageExecutorLive.layerWith({ smallBatchRows: rows })))
    )
  }
})
