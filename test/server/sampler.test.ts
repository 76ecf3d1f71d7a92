import { assert, describe, it } from "@effect/vitest"
import { makeSampler, sampleToken, positionRng } from "../../src/services/Sampler.js"

// Probabilities at temperature 1: softmax of these logits ≈ [0.64, 0.24, 0.09, 0.03].
const logits = Float32Array.from([3, 2, 1, 0])
const draws = (params: Parameters<typeof makeSampler>[0], n = 400) => {
  const s = makeSampler(params)
  return new Set(Array.from({ length: n }, () => s(logits)))
}

describe("Sampler: top-p, min-p, (seed, position)", () => {
  // top-p keeps the smallest set of most likely tokens whose mass reaches p: 0.7 → tokens 0 and 1 only.
  it("top-p restricts draws to the nucleus", () => {
    assert.deepStrictEqual([...draws({ temperatureMillis: 1000, topK: 0, topP: 0.7, seed: 3 })].sort(), [0, 1])
    assert.deepStrictEqual([...draws({ temperatureMillis: 1000, topK: 0, topP: 0.5, seed: 3 })], [0])
    assert.strictEqual(draws({ temperatureMillis: 1000, topK: 0, seed: 3 }).size, 4)
  })

  // min-p drops tokens below p × the top probability: 0.3 keeps 0 (1.0) and 1 (0.37), drops 2 (0.14) and 3.
  it("min-p drops tokens far less likely than the best", () => {
    assert.deepStrictEqual([...draws({ temperatureMillis: 1000, topK: 0, minP: 0.3, seed: 5 })].sort(), [0, 1])
    assert.deepStrictEqual([...draws({ temperatureMillis: 1000, topK: 0, minP: 0.1, seed: 5 })].sort(), [0, 1, 2])
  })

  // The n-th draw depends only on (seed, n): a sampler started at position 5 draws what draws 5.. were.
  it("draws are reproducible from (seed, position)", () => {
    const params = { temperatureMillis: 1500, topK: 0, seed: 11 }
    const from0 = makeSampler(params)
    const all = Array.from({ length: 40 }, () => from0(logits))
    const from5 = makeSampler(params, 5)
    assert.deepStrictEqual(
      Array.from({ length: 35 }, () => from5(logits)),
      all.slice(5)
    )
    assert.strictEqual(sampleToken(logits, params, positionRng(11, 7)), all[7])
    assert.notDeepEqual(
      all,
      Array.from({ length: 40 }, (_, i) => sampleToken(logits, params, positionRng(12, i)))
    )
  })
})
