/**
 * Speculation.ts, the pure parts of speculative decoding: prompt lookup, predicted drafts, which drafts a step keeps,
 * how many to draft from measured acceptance and step costs, and the one-line refusals.
 */
import { assert, describe, it } from "@effect/vitest"
import {
  acceptedDrafts,
  DraftLength,
  draftVocabularyProblem,
  lookupDraft,
  predictedDraft,
  speculativeProblem
} from "../../src/services/Speculation.js"

describe("Speculation", () => {
  it("prompt lookup: what followed the latest earlier occurrence of the last tokens, the longest match first", () => {
    // ... 1 2 3 [9 9] ... 7 2 3 [5 6] ... 2 3: the 2-gram "2 3" last appeared before 5 6
    assert.deepStrictEqual(lookupDraft([1, 2, 3, 9, 9, 7, 2, 3, 5, 6, 8, 2, 3], 3), [5, 6, 8])
    // the 3-gram "7 2 3" beats the later 2-gram match: 1 2 3 4 ... 7 2 3 4' ... 7 2 3
    assert.deepStrictEqual(lookupDraft([7, 2, 3, 4, 0, 2, 3, 5, 7, 2, 3], 2), [4, 0])
    assert.deepStrictEqual(lookupDraft([1, 2, 3, 4], 4), [])
    assert.deepStrictEqual(lookupDraft([5, 5], 4), [])
    assert.deepStrictEqual(lookupDraft([1, 2, 1, 2], 0), [])
    // a draft never runs past the history
    assert.deepStrictEqual(lookupDraft([1, 2, 9, 1, 2], 8), [9, 1, 2])
  })

  it("predicted drafts go by position", () => {
    assert.deepStrictEqual(predictedDraft([10, 11, 12, 13], 1, 2), [11, 12])
    assert.deepStrictEqual(predictedDraft([10, 11, 12, 13], 3, 5), [13])
    assert.deepStrictEqual(predictedDraft([10], 4, 5), [])
  })

  it("a step keeps the leading drafts its sampler agreed with", () => {
    assert.strictEqual(acceptedDrafts([4, 5, 6], [4, 5, 6, 7]), 3)
    assert.strictEqual(acceptedDrafts([4, 5, 6], [4, 9]), 1)
    assert.strictEqual(acceptedDrafts([4, 5, 6], [1]), 0)
    assert.strictEqual(acceptedDrafts([], [3]), 0)
  })

  it("the draft count follows acceptance and step costs, and goes to 0 when drafts are not kept", () => {
    const kept = new DraftLength(6)
    for (let i = 0; i < 20; i++) kept.observe(6, 6, 7)
    kept.observe(0, 0, 5)
    // every draft kept, a 7-row step 1.4x a 1-row step: a long step (5 or 6: a 6-row step never measured is taken to
    // cost the 7-row one's less 15%)
    assert.isAtLeast(kept.choose(), 5)
    assert.isAbove(kept.rate, 0.9)
    const refused = new DraftLength(6)
    refused.observe(0, 0, 5)
    for (let i = 0; i < 20; i++) refused.observe(3, 0, 8)
    assert.strictEqual(refused.choose(), 0)
    assert.isBelow(refused.rate, 0.05)
    // nothing measured yet, drafts refused at every step: drafting stops within a few steps (before, an unmeasured
    // plain step was taken to cost what a long one did, and a chooser kept drafting in vain)
    const fresh = new DraftLength(6)
    let steps = 0
    while (fresh.choose() > 0 && steps < 50) {
      fresh.observe(fresh.choose(), 0, 10)
      steps++
    }
    assert.isAtMost(steps, 6)
    // half kept, but a 2-row step costs 3 times a 1-row one: not worth it
    const dear = new DraftLength(1)
    dear.observe(0, 0, 1)
    for (let i = 0; i < 20; i++) dear.observe(1, i % 2, 3)
    assert.strictEqual(dear.choose(), 0)
  })

  it("refuses bad options in one line", () => {
    assert.isUndefined(speculativeProblem(undefined, false, 10))
    assert.isUndefined(speculativeProblem({ mode: "auto" }, false, 10))
    assert.match(speculativeProblem({ mode: "ngram" }, false, 10)!, /cannot roll a sequence back/)
    assert.match(speculativeProblem({ mode: "ngram", maxDraft: 0 }, undefined, 10)!, /\[1, 255\]/)
    assert.match(speculativeProblem({ mode: "ngram", predicted: [3, 10] }, undefined, 10)!, /outside the vocabulary/)
    // draft: needs its model, refused where the stages cannot roll back; a draft model only with draft
    assert.isUndefined(speculativeProblem({ mode: "draft", draftModel: "d.gguf" }, undefined, 10))
    assert.match(speculativeProblem({ mode: "draft" }, undefined, 10)!, /^speculative draft: needs a draft model/)
    assert.match(
      speculativeProblem({ mode: "draft", draftModel: "d.gguf" }, false, 10)!,
      /^speculative draft: this model's stages cannot roll a sequence back/
    )
    assert.match(speculativeProblem({ mode: "ngram", draftModel: "d.gguf" }, undefined, 10)!, /only used by draft/)
  })

  it("a draft model's vocabulary must be the model's, token for token", () => {
    assert.isUndefined(draftVocabularyProblem(["a", "b", "c"], ["a", "b", "c"]))
    assert.strictEqual(
      draftVocabularyProblem(["a", "b", "c"], ["a", "b"]),
      "speculative draft: the draft model's vocabulary differs from the model's (2 tokens, not 3)"
    )
    assert.strictEqual(
      draftVocabularyProblem(["a", "b", "c"], ["a", "x", "c"]),
      'speculative draft: the draft model\'s vocabulary differs from the model\'s (token 1 is "x", not "b")'
    )
    assert.match(draftVocabularyProblem(["a"], undefined)!, /the draft model names no tokens/)
    assert.match(draftVocabularyProblem(undefined, ["a"])!, /the model names no tokens/)
  })
})
