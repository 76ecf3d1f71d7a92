/**
 * A lone call's hidden input is read where it lies (64-byte aligned rows, as an inbound shared-memory ring's payload
 * is) instead of being copied into the graph: one copy less per activation hop. The logits are the same bits either
 * way, and rows that are not aligned are copied as before. The executor's `zeroCopy: false` (SWACTOR_ZERO_COPY=0 for
 * `swactor node`) copies every time.
 */
import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import * as StageExecutorLive from "../../src/layers/engine/StageExecutorLive.js"
import { StageExecutor } from "../../src/services/StageExecutor.js"
import { requireModel } from "../support/models.js"

const sameBits = (a: Float32Array, b: Float32Array) =>
  a.length === b.length &&
  new Uint32Array(a.buffer, a.byteOffset, a.length).every(
    (x, i) => x === new Uint32Array(b.buffer, b.byteOffset, b.length)[i]
  )

describe("zero-copy hidden input", () => {
  it.live("hidden rows placed at 16 offsets: the same logits; aligned rows are borrowed, the others copied", () =>
    Effect.scoped(
      Effect.gen(function* () {
        const path = requireModel("stories260K.gguf")
        const executor = yield* StageExecutor
        const copying = StageExecutorLive.make({ zeroCopy: false })
        const first = yield* executor.load({ path, layerStart: 0, layerEndExclusive: 2, isFirst: true, isLast: false })
        const lastSpec = { path, layerStart: 2, layerEndExclusive: 5, isFirst: false, isLast: true }
        const last = { borrowing: yield* executor.load(lastSpec), copying: yield* copying.load(lastSpec) }
        const a = yield* executor.session(first, { threads: 1, contextLength: 64 })
        const out = yield* a.forward(0, { _tag: "Tokens", tokens: Int32Array.of(1, 9, 30, 4) })
        assert.strictEqual(out._tag, "Hidden")
        const hidden = (out as { hidden: Float32Array }).hidden
        // one backing store for every offset: its 16 first float offsets cover each address mod 64 once
        const backing = new Float32Array(hidden.length + 64)
        const logitsAt = (offsetFloats: number, zeroCopy: boolean) =>
          Effect.gen(function* () {
            backing.fill(0)
            const rows = backing.subarray(offsetFloats, offsetFloats + hidden.length)
            rows.set(hidden)
            const b = zeroCopy
              ? yield* executor.session(last.borrowing, { threads: 1, contextLength: 64 })
              : yield* copying.session(last.copying, { threads: 1, contextLength: 64 })
            const weights = (zeroCopy ? last.borrowing : last.copying) as StageExecutorLive.LiveLoadedStage
            const before = weights.weights.copiedInputBytes
            const result = yield* b.forward(0, { _tag: "Hidden", hidden: rows, nTokens: 4 })
            return {
              logits: (result as { logits: Float32Array }).logits,
              copied: weights.weights.copiedInputBytes - before
            }
          })
        const reference = yield* logitsAt(0, false)
        assert.strictEqual(reference.copied, hidden.byteLength, "the copy path counts its copy")
        let borrowed = 0
        for (let off = 0; off < 16; off++) {
          const r = yield* logitsAt(off, true)
          assert.isTrue(sameBits(r.logits, reference.logits), `offset ${off}`)
          if (r.copied === 0) borrowed++
          else assert.strictEqual(r.copied, hidden.byteLength)
        }
        assert.strictEqual(borrowed, 1, "exactly one of 16 float offsets is 64-byte aligned, and it is read in place")
      })
    ).pipe(Effect.provide(StageExecutorLive.layerWith({ zeroCopy: true })))
  )
})
