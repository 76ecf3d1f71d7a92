/**
 * DraftModel.ts: the draft model's cache follows the tokens stage 0 knows. A stand-in batcher (each forward's logits
 * favour the token after the input's last, mod the vocabulary, and every submit is recorded): the first draft feeds
 * the whole history; after drafts that were all kept only the tokens not seen yet are fed; after a refusal it writes
 * over the positions from the first token that differs; it stops after the end of sequence and drafts nothing past its
 * context.
 */
import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import type { StageInfo, StageInput } from "../../src/domain/engine.js"
import type { StageSession } from "../../src/services/StageExecutor.js"
import { argmax, draftModelOf, draftTokens } from "../../src/layers/agent/DraftModel.js"
import type { StageBatcher } from "../../src/layers/agent/StageBatcher.js"

const vocab = 16
const eos = 2

/** A draft model whose greedy token follows the last one fed (t -> t + 1 mod vocab), and its recorded submits. */
const standIn = (contextLength = 64) => {
  const submits: Array<{ readonly startPos: number; readonly tokens: ReadonlyArray<number> }> = []
  const session = { info: { vocabSize: vocab } as StageInfo } as StageSession
  const batcher = {
    submit: (_session: StageSession, startPos: number, input: StageInput) =>
      Effect.sync(() => {
        const tokens = input._tag === "Tokens" ? [...input.tokens] : []
        submits.push({ startPos, tokens })
        const logits = new Float32Array(vocab)
        logits[(tokens.at(-1)! + 1) % vocab] = 1
        return { _tag: "Logits" as const, logits }
      })
  } as unknown as StageBatcher
  return { draft: draftModelOf(session, batcher, contextLength, eos), submits }
}

describe("DraftModel", () => {
  it("greedy: the first largest logit", () => {
    assert.strictEqual(argmax(Float32Array.from([0, 3, 1, 3])), 1)
    assert.strictEqual(argmax(Float32Array.from([-1])), 0)
  })

  it.effect("feeds the tokens it has not seen, and writes over the positions of drafts that were not kept", () =>
    Effect.gen(function* () {
      const { draft, submits } = standIn()
      // the prompt 5 6, its first token 7: the whole history, then one token at a time
      assert.deepStrictEqual(yield* draftTokens(draft, [5, 6, 7], 3), [8, 9, 10])
      assert.deepStrictEqual(submits.splice(0), [
        { startPos: 0, tokens: [5, 6, 7] },
        { startPos: 3, tokens: [8] },
        { startPos: 4, tokens: [9] }
      ])
      // all three kept, then the step's own token 11: the last draft and 11 are new to it
      assert.deepStrictEqual(yield* draftTokens(draft, [5, 6, 7, 8, 9, 10, 11], 1), [12])
      assert.deepStrictEqual(submits.splice(0), [{ startPos: 5, tokens: [10, 11] }])
      // 12 refused, 4 sampled instead: nothing to write over yet (12 was never fed), 4 goes at position 7
      assert.deepStrictEqual(yield* draftTokens(draft, [5, 6, 7, 8, 9, 10, 11, 4], 2), [5, 6])
      assert.deepStrictEqual(submits.splice(0), [
        { startPos: 7, tokens: [4] },
        { startPos: 8, tokens: [5] }
      ])
      // 5 refused at once, 3 sampled instead: position 8, where 5 was fed, is written over
      assert.deepStrictEqual(yield* draftTokens(draft, [5, 6, 7, 8, 9, 10, 11, 4, 3], 1), [4])
      assert.deepStrictEqual(submits.splice(0), [{ startPos: 8, tokens: [3] }])
      // a history that differs earlier (not a speculative step's: a defence): rewound to the first difference
      assert.deepStrictEqual(yield* draftTokens(draft, [5, 1, 2], 1), [3])
      assert.deepStrictEqual(submits.splice(0), [{ startPos: 1, tokens: [1, 2] }])
      assert.deepStrictEqual(draft.seen, [5, 1, 2])
    })
  )

  it.effect("stops after the end of sequence, and drafts nothing past its context", () =>
    Effect.gen(function* () {
      const { draft } = standIn(8)
      // 0 -> 1 -> 2 (the end of sequence): two drafts of the four asked for
      assert.deepStrictEqual(yield* draftTokens(draft, [9, 0], 4), [1, eos])
      assert.deepStrictEqual(yield* draftTokens(draft, [1, 2, 3, 4, 5, 6], 3), [])
      assert.deepStrictEqual(yield* draftTokens(draft, [1, 2, 3, 4, 5, 6], 2), [7, 8])
    })
  )
})
