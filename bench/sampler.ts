/**
 * `npm run bench:sampler`: the last stage's per-token sampling cost at vocab 32,000 (the llama 2 vocabulary), for the
 * plain argmax and for llama.cpp's chain in a few settings (seeded temperature with top-k; + penalties; + min-p and
 * top-p; + log-probs with 5 alternatives). Logits are fixed random numbers; each setting samples 2,000 tokens after
 * 200 warm-up ones, one sequence, one thread. Prints the median and mean per token.
 */
import type { SamplingPolicy } from "../src/domain/plan.js"
import { makeSequenceSampler } from "../src/layers/sampling/ChainSampler.js"

const VOCAB = 32_000
const STEPS = 2_000
const WARMUP = 200

let state = 12345
const random = () => (state = (Math.imul(state, 1103515245) + 12345) >>> 0) / 2 ** 32
const logits = Array.from({ length: 8 }, () => Float32Array.from({ length: VOCAB }, () => (random() - 0.5) * 20))

const settings: ReadonlyArray<readonly [string, SamplingPolicy]> = [
  ["greedy (argmax, no native call)", { temperatureMillis: 0, topK: 1 }],
  ["greedy + repeat penalty (chain)", { temperatureMillis: 0, topK: 1, repeatPenalty: 1.1 }],
  ["temperature 0.8, top-k 40, seed", { temperatureMillis: 800, topK: 40, seed: 1 }],
  [
    "+ repeat/presence/frequency penalties",
    { temperatureMillis: 800, topK: 40, seed: 1, repeatPenalty: 1.1, presencePenalty: 0.2, frequencyPenalty: 0.2 }
  ],
  [
    "+ top-p 0.95, min-p 0.05",
    { temperatureMillis: 800, topK: 40, seed: 1, repeatPenalty: 1.1, topP: 0.95, minP: 0.05 }
  ],
  ["temperature 0.8, top-k 0 (whole vocab), top-p 0.95", { temperatureMillis: 800, topK: 0, seed: 1, topP: 0.95 }],
  ["temperature 0.8, top-k 40 + log-probs (5)", { temperatureMillis: 800, topK: 40, seed: 1, logprobs: 5 }]
]

console.log(`sampling one token at vocab ${VOCAB} (${STEPS} tokens per setting)`)
for (const [name, policy] of settings) {
  const sampler = makeSequenceSampler(policy, { vocabSize: VOCAB, contextLength: 4096 })
  for (let i = 0; i < WARMUP; i++) sampler.sample(logits[i % logits.length]!)
  const times: Array<number> = []
  for (let i = 0; i < STEPS; i++) {
    const t0 = performance.now()
    sampler.sample(logits[i % logits.length]!)
    times.push(performance.now() - t0)
  }
  sampler.free()
  times.sort((a, b) => a - b)
  const mean = times.reduce((s, t) => s + t, 0) / times.length
  console.log(`${name.padEnd(52)} median ${times[times.length >> 1]!.toFixed(3)} ms  mean ${mean.toFixed(3)} ms`)
}
