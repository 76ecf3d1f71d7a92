import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import { allSplits, type EngineRun, greedyRun } from "../support/engine.js"
import { requireModel } from "../support/models.js"

const N_TOKENS = 32
const options = { threads: 1, contextLength: 512 } as const
const PROMPT = [1, 403, 407, 261, 378] // BOS + "Once upon a time" in stories260K's vocabulary

const sameBits = (a: Float32Array, b: Float32Array) => {
  if (a.length !== b.length) return false
  const x = new Uint32Array(a.buffer, a.byteOffset, a.length)
  const y = new Uint32Array(b.buffer, b.byteOffset, b.length)
  for (let i = 0; i < x.length; i++) if (x[i] !== y[i]) return false
  return true
}

describe("stories260K: splits are bit-identical to one stage", () => {
  const path = requireModel("stories260K.gguf")
  let single: EngineRun | undefined
  const one = () =>
    Effect.suspend(() =>
      single !== undefined
        ? Effect.succeed(single)
        : greedyRun(path, [0, 5], PROMPT, N_TOKENS, options).pipe(
            Effect.tap((r) => {
              single = r
            })
          )
    )

  for (const split of allSplits(5, 4).filter((s) => s.length > 2)) {
    // f32 hidden states between stages: a split run computes exactly what the one-stage run computes.
    it.live(
      `split ${JSON.stringify(split)}: logits at all ${N_TOKENS} positions equal the 1-stage run bit for bit`,
      () =>
        Effect.gen(function* () {
          const base = yield* one()
          const run = yield* greedyRun(path, split, PROMPT, N_TOKENS, options)
          assert.deepStrictEqual(run.tokens, base.tokens)
          assert.strictEqual(run.logits.length, N_TOKENS)
          run.logits.forEach((l, i) => assert.isTrue(sameBits(l, base.logits[i]!), `position ${i} differs`))
        })
    )
  }
})
