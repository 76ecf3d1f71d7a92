/**
 * Token sampling on the last stage, pure and reproducible: greedy at temperature 0, otherwise
 * temperature (temperatureMillis / 1000) then top-k, drawn from a generator seeded once per sequence.
 */

export interface SamplingParams {
  readonly temperatureMillis: number
  /** Keep the k most likely tokens; 0 or less keeps all. */
  readonly topK: number
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
export const makeRng = (seed: number): () => number => {
  const whole = Number.isFinite(seed) ? Math.trunc(seed) : 0
  const hi = Math.floor(whole / 4294967296) >>> 0
  const sm = splitmix32((whole >>> 0) ^ Math.imul(hi, 0x27d4eb2d))
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

/** One draw: temperature, then top-k, then the softmax over what is left. */
export const sampleToken = (logits: Float32Array, params: SamplingParams, random: () => number): number => {
  const temperature = params.temperatureMillis / 1000
  if (!(temperature > 0) || params.topK === 1 || logits.length <= 1) return greedy(logits)
  const n = logits.length
  const k = params.topK > 0 ? Math.min(Math.floor(params.topK), n) : n
  const order = Array.from({ length: n }, (_, i) => i)
  order.sort((x, y) => value(logits, y) - value(logits, x) || x - y)
  const top = order.slice(0, k)
  const scaled = top.map((i) => value(logits, i) / temperature)
  const max = scaled[0]!
  if (max === -Infinity) return top[0]!
  const weights = scaled.map((s) => Math.exp(s - max))
  const total = weights.reduce((s, w) => s + w, 0)
  let r = random() * total
  for (let j = 0; j < top.length; j++) {
    r -= weights[j]!
    if (r < 0) return top[j]!
  }
  return top[top.length - 1]!
}

/**
 * A sampler for one sequence: same params and seed give the same tokens for the same logits.
 * Without a seed, one is drawn from Math.random (the run is then not reproducible).
 */
export const makeSampler = (params: SamplingParams): (logits: Float32Array) => number => {
  const temperature = params.temperatureMillis / 1000
  if (!(temperature > 0) || params.topK === 1) return greedy
  const random = makeRng(params.seed ?? Math.floor(Math.random() * 2 ** 32))
  return (logits) => sampleToken(logits, params, random)
}

/** Whether a sampled token ends generation. */
export const isEndOfSequence = (token: number, eosTokenId: number): boolean => eosTokenId >= 0 && token === eosTokenId
