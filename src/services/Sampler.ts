/**
 * Pure sampling functions (the library's own, exported for callers). The last stage itself samples with llama.cpp's
 * chain (src/layers/sampling/ChainSampler.ts) and uses `greedy` from here for a plain argmax. These: greedy at
 * temperature 0, otherwise
 * temperature (temperatureMillis / 1000), then top-k, top-p and min-p, one draw per position from a
 * generator seeded by (seed, position): the n-th token of a generation depends only on the seed, n and
 * its logits, so a generation resumed at position n draws what it would have drawn.
 */

/** Recent tokens the repeat, presence and frequency penalties look at when a request does not say (llama.cpp's). */
export const defaultPenaltyLastN = 64

export interface SamplingParams {
  readonly temperatureMillis: number
  /** Keep the k most likely tokens; 0 or less keeps all. */
  readonly topK: number
  /** Keep the most likely tokens whose probabilities add up to at least this (1 or more, or absent: off). */
  readonly topP?: number | undefined
  /** Drop tokens whose probability is below this fraction of the most likely one's (0 or absent: off). */
  readonly minP?: number | undefined
  readonly seed?: number | undefined
}

/** splitmix32: spreads a numeric seed over the generator's state. */
const splitmix32 = (seed: number) => {
  let s = seed >>> 0
  return () => {
    s = (s + 0x9e3779b9) >>> 0
    let z = s
    z = Math.imul(z ^ (z >>> 16), 0x85ebca6b)
    z = Math.imul(z ^ (z >>> 13), 0xc2b2ae35)
    return (z ^ (z >>> 16)) >>> 0
  }
}

/**
 * xoshiro128** seeded through splitmix32 from any finite number (its integer part, mixed with the
 * high bits so seeds above 2^32 differ). Returns floats in [0, 1).
 */
export const makeRng = (seed: number): (() => number) => xoshiro(splitmix32(seed32(seed)))

/** A finite number's integer part folded to 32 bits (high bits mixed in, so seeds above 2^32 differ). */
const seed32 = (seed: number): number => {
  const whole = Number.isFinite(seed) ? Math.trunc(seed) : 0
  const hi = Math.floor(whole / 4294967296) >>> 0
  return ((whole >>> 0) ^ Math.imul(hi, 0x27d4eb2d)) >>> 0
}

const xoshiro = (sm: () => number): (() => number) => {
  let a = sm()
  let b = sm()
  let c = sm()
  let d = sm()
  if ((a | b | c | d) === 0) a = 1
  return () => {
    const r = Math.imul(rotl(Math.imul(b, 5), 7), 9) >>> 0
    const t = b << 9
    c ^= a
    d ^= b
    b ^= c
    a ^= d
    c ^= t
    d = rotl(d, 11)
    return r / 4294967296
  }
}

const rotl = (x: number, k: number) => (x << k) | (x >>> (32 - k))

const value = (logits: Float32Array, i: number) => {
  const v = logits[i]!
  return Number.isNaN(v) ? -Infinity : v
}

/** Index of the largest logit (lowest index on ties; NaN counts as -inf). */
export const greedy = (logits: Float32Array): number => {
  let best = 0
  let bestValue = -Infinity
  for (let i = 0; i < logits.length; i++) {
    const v = value(logits, i)
    if (v > bestValue) {
      bestValue = v
      best = i
    }
  }
  return best
}

/** log-softmax in float64 (for comparisons and tests). */
export const logSoftmax = (logits: Float32Array): Float64Array => {
  let max = -Infinity
  for (let i = 0; i < logits.length; i++) max = Math.max(max, value(logits, i))
  let sum = 0
  for (let i = 0; i < logits.length; i++) sum += Math.exp(value(logits, i) - max)
  const lse = max + Math.log(sum)
  const out = new Float64Array(logits.length)
  for (let i = 0; i < logits.length; i++) out[i] = value(logits, i) - lse
  return out
}

/** One draw: temperature, then top-k, top-p and min-p, then the softmax over what is left. */
export const sampleToken = (logits: Float32Array, params: SamplingParams, random: () => number): number => {
  const temperature = params.temperatureMillis / 1000
  if (!(temperature > 0) || params.topK === 1 || logits.length <= 1) return greedy(logits)
  const n = logits.length
  const k = params.topK > 0 ? Math.min(Math.floor(params.topK), n) : n
  const order = Array.from({ length: n }, (_, i) => i)
  order.sort((x, y) => value(logits, y) - value(logits, x) || x - y)
  let top = order.slice(0, k)
  let scaled = top.map((i) => value(logits, i) / temperature)
  const max = scaled[0]!
  if (max === -Infinity) return top[0]!
  let weights = scaled.map((s) => Math.exp(s - max))
  const minP = params.minP ?? 0
  if (minP > 0) {
    // weights[0] = 1 is the most likely token's: keep those at least minP of it (the first always).
    const keep = Math.max(
      1,
      weights.findIndex((w) => w < minP) === -1 ? weights.length : weights.findIndex((w) => w < minP)
    )
    top = top.slice(0, keep)
    scaled = scaled.slice(0, keep)
    weights = weights.slice(0, keep)
  }
  const topP = params.topP ?? 1
  if (topP < 1) {
    const sum = weights.reduce((s, w) => s + w, 0)
    let mass = 0
    let keep = 0
    while (keep < weights.length && mass < topP * sum) mass += weights[keep++]!
    keep = Math.max(1, keep)
    top = top.slice(0, keep)
    weights = weights.slice(0, keep)
  }
  const total = weights.reduce((s, w) => s + w, 0)
  let r = random() * total
  for (let j = 0; j < top.length; j++) {
    r -= weights[j]!
    if (r < 0) return top[j]!
  }
  return top[top.length - 1]!
}

/** The generator of the draw at `position` of a generation seeded with `seed`. */
export const positionRng = (seed: number, position: number): (() => number) => {
  const base = splitmix32(seed32(seed))()
  return xoshiro(splitmix32((base ^ Math.imul((position >>> 0) + 1, 0x85ebca6b)) >>> 0))
}

/**
 * A sampler for one sequence: same params and seed give the same tokens for the same logits. Draw n uses
 * the generator of (seed, startPosition + n). Without a seed, one is drawn from Math.random (the run is then
 * not reproducible).
 */
export const makeSampler = (params: SamplingParams, startPosition = 0): ((logits: Float32Array) => number) => {
  const temperature = params.temperatureMillis / 1000
  if (!(temperature > 0) || params.topK === 1) return greedy
  const seed = params.seed ?? Math.floor(Math.random() * 2 ** 32)
  let position = startPosition
  return (logits) => sampleToken(logits, params, positionRng(seed, position++))
}

/** Whether a sampled token ends generation. */
export const isEndOfSequence = (token: number, eosTokenId: number): boolean => eosTokenId >= 0 && token === eosTokenId
