import { assert, describe, it } from "@effect/vitest"
import { greedy, isEndOfSequence, logSoftmax, makeRng, makeSampler, sampleToken } from "../../src/services/Sampler.js"

const logits = Float32Array.from([0.5, 2, 1.5, -1, 2, 0.9, 0.1, 1.8])

describe("Sampler", () => {
  // Temperature 0 is greedy: the first largest logit, whatever the seed.
  it("temperature 0 picks the argmax (first on ties)", () => {
    assert.strictEqual(greedy(logits), 1)
    assert.strictEqual(makeSampler({ temperatureMillis: 0, topK: 40, seed: 1 })(logits), 1)
    assert.strictEqual(makeSampler({ temperatureMillis: 800, topK: 1, seed: 1 })(logits), 1)
  })

  it("NaN logits never win", () => {
    assert.strictEqual(greedy(Float32Array.from([NaN, -5, NaN])), 1)
  })

  // Same seed, same logits: the same tokens (a run is reproducible); another seed draws differently.
  it("a seeded sampler is reproducible", () => {
    const draw = (seed: number) => {
      const s = makeSampler({ temperatureMillis: 1000, topK: 0, seed })
      return Array.from({ length: 64 }, () => s(logits))
    }
    assert.deepStrictEqual(draw(42), draw(42))
    assert.notDeepEqual(draw(42), draw(43))
  })

  // top-k keeps only the k most likely tokens.
  it("top-k restricts draws to the k largest logits", () => {
    const s = makeSampler({ temperatureMillis: 5000, topK: 3, seed: 7 })
    const seen = new Set(Array.from({ length: 500 }, () => s(logits)))
    assert.deepStrictEqual([...seen].sort(), [1, 4, 7])
  })

  // Draw frequencies follow softmax(logits / T): checked on two tokens at T = 1 and T = 0.5.
  it("temperature scales the distribution", () => {
    const two = Float32Array.from([0, Math.log(3)])
    const freq = (t: number) => {
      const rng = makeRng(99)
      let ones = 0
      const n = 20000
      for (let i = 0; i < n; i++) ones += sampleToken(two, { temperatureMillis: t, topK: 0 }, rng)
      return ones / n
    }
    assert.approximately(freq(1000), 0.75, 0.015)
    assert.approximately(freq(500), 0.9, 0.01)
  })

  it("the generator is uniform enough and seeds above 2^32 differ", () => {
    const r = makeRng(123)
    let sum = 0
    for (let i = 0; i < 10000; i++) {
      const x = r()
      assert.isTrue(x >= 0 && x < 1)
      sum += x
    }
    assert.approximately(sum / 10000, 0.5, 0.02)
    assert.notStrictEqual(makeRng(5)(), makeRng(5 + 2 ** 32)())
  })

  it("log-softmax sums to one and EOS ends generation", () => {
    const lp = logSoftmax(logits)
    assert.approximately(
      lp.reduce((s, x) => s + Math.exp(x), 0),
      1,
      1e-12
    )
    assert.isTrue(isEndOfSequence(2, 2))
    assert.isFalse(isEndOfSequence(3, 2))
    assert.isFalse(isEndOfSequence(3, -1))
  })
})
