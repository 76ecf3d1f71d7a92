import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import { logSoftmax } from "../../src/services/Sampler.js"
import { allSplits, greedyRun, maxLogProbDiff, referenceRun, type ReferenceRun } from "../support/engine.js"
import { requireModel } from "../support/models.js"

const N_TOKENS = 32
const options = { threads: 1, contextLength: 512 } as const

describe("stories260K: every split matches node-llama-cpp", () => {
  const path = requireModel("stories260K.gguf")
  let reference: ReferenceRun | undefined
  const ref = () =>
    Effect.promise(async () => (reference ??= await referenceRun(path, "Once upon a time", N_TOKENS, options)))

  // The reference stream is itself meaningful: not empty, not one token repeated.
  it.live("node-llama-cpp's greedy stream is non-trivial", () =>
    Effect.gen(function* () {
      const r = yield* ref()
      assert.strictEqual(r.tokens.length, N_TOKENS)
      assert.isAtLeast(new Set(r.tokens).size, 8)
    })
  )

  for (const split of allSplits(5, 4)) {
    // A stage split changes where blocks run, never what the model says.
    const name = `split ${JSON.stringify(split)}: ${N_TOKENS} greedy tokens equal node-llama-cpp's, log-probs within 1e-4`
    it.live(name, () =>
      Effect.gen(function* () {
        const r = yield* ref()
        const ours = yield* greedyRun(path, split, r.prompt, N_TOKENS, options)
        assert.deepStrictEqual(ours.tokens, r.tokens)
        const diff = maxLogProbDiff(logSoftmax(ours.logits[0]!), r.firstProbabilities)
        console.log(
          `stories260K split ${JSON.stringify(split)}: first-position log-prob max diff ${diff.toExponential(2)} ` +
            `over ${r.firstProbabilities.size} tokens`
        )
        assert.isBelow(diff, 1e-4, `first-position log-prob max diff ${diff}`)
      })
    )
  }
})

describe("stories260K: a long prompt whose generation crosses the 256-cell attention window", () => {
  const path = requireModel("stories260K.gguf")
  const text = "Once upon a time, there was a little cat who liked to nap in the sun. ".repeat(10)
  // n_kv grows from 256 to 512 cells mid-generation; the mask and cache views must follow llama.cpp's.
  it.live("1 and 3 stages match node-llama-cpp's 32 greedy tokens after a ~250-token prompt", () =>
    Effect.gen(function* () {
      const r = yield* Effect.promise(() => referenceRun(path, text, N_TOKENS, options))
      assert.isAtLeast(r.prompt.length, 230)
      assert.isAtMost(r.prompt.length, 255)
      for (const split of [
        [0, 5],
        [0, 1, 3, 5]
      ]) {
        const ours = yield* greedyRun(path, split, r.prompt, N_TOKENS, options)
        assert.deepStrictEqual(ours.tokens, r.tokens)
        assert.isBelow(maxLogProbDiff(logSoftmax(ours.logits[0]!), r.firstProbabilities), 1e-4)
      }
    })
  )
})
