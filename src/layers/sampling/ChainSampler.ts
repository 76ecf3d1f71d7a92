/**
 * The last stage's sampler for one sequence: llama.cpp's sampler chain from the shipped libllama, built in exactly
 * the order and with exactly the parameters node-llama-cpp 3.21.1 uses (llama/addon/AddonSampler.cpp), so the same
 * settings and seed give node-llama-cpp's tokens:
 *
 *   logit bias, penalties (repeat / frequency / presence), DRY, then
 *   greedy (temperature 0): XTC, greedy
 *   otherwise: top-k, [typical], top-p, min-p, XTC, temperature, dist(seed)
 *
 * A grammar is applied as node-llama-cpp does: the chain picks from the whole distribution; when the grammar rejects
 * that token the candidates are filled again, the grammar masks them and the chain picks again (a second draw).
 * After each pick, the penalties, DRY and the grammar (not for an end-of-generation token) accept the token.
 *
 * Resuming a generation after n tokens (`policy.resume`): the penalties, DRY and grammar accept those n tokens
 * again, and the random generators skip the draws the lost sampler had made, so the next draw is the one it would
 * have made. Plain greedy without penalties, bias or grammar is an argmax, with no native call.
 *
 * Values are not checked here: `samplingPolicyProblem` (services/RequestChecks.ts) has checked them first.
 */
import koffi from "koffi"
import type { SamplingPolicy } from "../../domain/plan.js"
import { defaultPenaltyLastN, greedy } from "../../services/Sampler.js"
import {
  capturingLog,
  getLlama,
  lastLines,
  type LlamaRaw,
  type LlamaVocab,
  TokenDataArrayLayout,
  TokenDataLayout
} from "./LlamaLib.js"

/** Log-probabilities at one step: log-softmax of the raw logits (before bias, penalties and temperature). */
export interface StepLogprob {
  readonly logprob: number
  readonly top: ReadonlyArray<{ readonly tokenId: number; readonly logprob: number }>
}

export interface SampleResult {
  readonly tokenId: number
  /** When the policy asks for log-probabilities. */
  readonly logprob?: StepLogprob
  /** The random draws the sampler has made so far in this generation (resume skips them). */
  readonly draws: number
}

export interface SequenceSampler {
  readonly sample: (logits: Float32Array) => SampleResult
  /** Frees the native chain (idempotent). */
  readonly free: () => void
}

/** Whether the policy needs the chain (anything but a plain argmax). */
export const needsChain = (policy: SamplingPolicy): boolean =>
  policy.temperatureMillis > 0 ||
  (policy.repeatPenalty !== undefined && policy.repeatPenalty !== 1) ||
  (policy.presencePenalty ?? 0) !== 0 ||
  (policy.frequencyPenalty ?? 0) !== 0 ||
  (policy.dry !== undefined && policy.dry.multiplier !== 0) ||
  (policy.xtc !== undefined && policy.xtc.probability > 0) ||
  (policy.logitBias?.length ?? 0) > 0 ||
  (policy.bannedTokens?.length ?? 0) > 0 ||
  policy.grammar !== undefined

/** Whether the chain needs the model's vocabulary (a vocab-only load): grammar and DRY work on token text. */
export const needsVocab = (policy: SamplingPolicy): boolean =>
  policy.grammar !== undefined || (policy.dry !== undefined && policy.dry.multiplier !== 0)

/** A grammar that does not parse (libllama returned no sampler). */
export class GrammarRejected extends Error {
  override readonly name = "GrammarRejected"
}

/** log-softmax of the raw logits: the `token`'s log-probability and the `n` most likely (ties: lower id first). */
export const stepLogprob = (logits: Float32Array, token: number, n: number): StepLogprob => {
  const v = logits.length
  let max = -Infinity
  for (let i = 0; i < v; i++) {
    const x = logits[i]!
    if (x > max) max = x
  }
  let sum = 0
  for (let i = 0; i < v; i++) sum += Math.exp(logits[i]! - max)
  const lse = max + Math.log(sum)
  const ids: Array<number> = []
  const vals: Array<number> = []
  if (n > 0) {
    for (let i = 0; i < v; i++) {
      const x = logits[i]!
      if (ids.length === n && !(x > vals[n - 1]!)) continue
      let j = ids.length === n ? n - 1 : ids.length
      while (j > 0 && vals[j - 1]! < x) {
        if (j < n) {
          ids[j] = ids[j - 1]!
          vals[j] = vals[j - 1]!
        }
        j--
      }
      if (j < n) {
        ids[j] = i
        vals[j] = x
      }
    }
  }
  return {
    logprob: logits[token]! - lse,
    top: ids.map((tokenId, k) => ({ tokenId, logprob: vals[k]! - lse }))
  }
}

const argmaxSampler = (policy: SamplingPolicy): SequenceSampler => ({
  sample: (logits) => {
    const tokenId = greedy(logits)
    return {
      tokenId,
      draws: 0,
      ...(policy.logprobs === undefined ? {} : { logprob: stepLogprob(logits, tokenId, policy.logprobs) })
    }
  },
  free: () => {}
})

/** A fresh seed when the policy has none (the run is then not reproducible). */
const seedOf = (policy: SamplingPolicy): number =>
  policy.seed === undefined ? Math.floor(Math.random() * 2 ** 32) : Math.max(0, Math.floor(policy.seed)) >>> 0

/** The grammar's sampler, built first (a grammar that does not parse frees nothing else); null without a grammar. */
const grammarOf = (raw: LlamaRaw, policy: SamplingPolicy, vocab: LlamaVocab | undefined): unknown => {
  if (policy.grammar === undefined) return null
  if (vocab === undefined) throw new GrammarRejected("a grammar needs the model's vocabulary")
  const { text, root } = policy.grammar
  const { log, result } = capturingLog(() => raw.llama_sampler_init_grammar(vocab.vocab, text, root))
  if (result === null) {
    // llama.cpp prints a syntax error's position on stderr itself; other refusals come through its log
    const why = lastLines(log).replace(/;?\s*failed to parse grammar$/, "")
    throw new GrammarRejected(
      `the grammar does not parse${why === "" ? " (llama.cpp's GBNF parser refused it; the agent's stderr says where)" : `: ${why}`}`
    )
  }
  return result
}

/** The chain's samplers that are accepted tokens or draw random numbers (null: not in the chain). */
interface ChainParts {
  readonly chain: unknown
  readonly penalties: unknown
  readonly dry: unknown
  readonly xtc: unknown
  readonly dist: unknown
}

/** The chain in node-llama-cpp's order: logit bias, penalties, DRY, then greedy or the sampling samplers. */
const buildChain = (
  raw: LlamaRaw,
  policy: SamplingPolicy,
  options: { readonly vocabSize: number; readonly contextLength: number; readonly vocab?: LlamaVocab }
): ChainParts => {
  const nVocab = options.vocabSize
  const vocab = options.vocab
  const chain = raw.llama_sampler_chain_init(raw.llama_sampler_chain_default_params())
  const add = (smpl: unknown) => raw.llama_sampler_chain_add(chain, smpl)
  const seed = seedOf(policy)
  const window = (n: number) => (n < 0 ? options.contextLength : n)

  const biases = [
    ...(policy.logitBias ?? []).map((b) => ({ token: b.tokenId, bias: b.bias })),
    ...(policy.bannedTokens ?? []).map((token) => ({ token, bias: -Infinity }))
  ]
  if (biases.length > 0) add(raw.llama_sampler_init_logit_bias(nVocab, biases.length, biases))

  let penalties: unknown = null
  const repeat = policy.repeatPenalty ?? 1
  const presence = policy.presencePenalty ?? 0
  const frequency = policy.frequencyPenalty ?? 0
  const lastN = window(policy.penaltyLastN ?? defaultPenaltyLastN)
  if (lastN > 0 && (repeat !== 1 || presence !== 0 || frequency !== 0)) {
    penalties = raw.llama_sampler_init_penalties(nVocab, lastN, repeat, frequency, presence)
    add(penalties)
  }
  let dry: unknown = null
  if (policy.dry !== undefined && policy.dry.multiplier > 0 && vocab !== undefined) {
    const d = policy.dry
    dry = raw.llama_sampler_init_dry(
      vocab.vocab,
      d.multiplier,
      d.base,
      Math.max(1, d.allowedLength),
      window(d.penaltyLastN),
      d.sequenceBreakers,
      d.sequenceBreakers.length
    )
    add(dry)
  }
  const xtc =
    policy.xtc !== undefined && policy.xtc.probability > 0
      ? raw.llama_sampler_init_xtc(policy.xtc.probability, policy.xtc.threshold, 0, seed)
      : null
  return { chain, penalties, dry, xtc, dist: addPicker(raw, policy, nVocab, add, xtc, seed) }
}

/** Greedy (temperature 0: XTC, greedy), or top-k, [typical], top-p, min-p, XTC, temperature and dist (returned). */
const addPicker = (
  raw: LlamaRaw,
  policy: SamplingPolicy,
  nVocab: number,
  add: (smpl: unknown) => void,
  xtc: unknown,
  seed: number
): unknown => {
  if (policy.temperatureMillis <= 0) {
    if (xtc !== null) add(xtc)
    add(raw.llama_sampler_init_greedy())
    return null
  }
  add(raw.llama_sampler_init_top_k(policy.topK <= 0 ? nVocab : Math.min(policy.topK, nVocab)))
  if (policy.typicalP !== undefined && policy.typicalP < 1) add(raw.llama_sampler_init_typical(policy.typicalP, 1))
  if (policy.topP !== undefined && policy.topP >= 0 && policy.topP <= 1)
    add(raw.llama_sampler_init_top_p(policy.topP, 1))
  if (policy.minP !== undefined && policy.minP > 0) add(raw.llama_sampler_init_min_p(policy.minP, 1))
  if (xtc !== null) add(xtc)
  add(raw.llama_sampler_init_temp(policy.temperatureMillis / 1000))
  const dist = raw.llama_sampler_init_dist(seed)
  add(dist)
  return dist
}

/** One native candidates buffer for the sequence's life, and one array header (plus a two-token probe). */
const allocBuffers = (nVocab: number) => {
  const candidates = koffi.alloc("uint8_t", nVocab * TokenDataLayout.bytes)
  const candidatesBytes = koffi.view(candidates, nVocab * TokenDataLayout.bytes)
  const header = koffi.alloc("uint8_t", TokenDataArrayLayout.bytes)
  const probe = koffi.alloc("uint8_t", 2 * TokenDataLayout.bytes)
  const probeHeader = koffi.alloc("uint8_t", TokenDataArrayLayout.bytes)
  return {
    candidates,
    candidatesAddr: BigInt(koffi.address(candidates)),
    ids: new Int32Array(candidatesBytes),
    floats: new Float32Array(candidatesBytes),
    header,
    headerView: new DataView(koffi.view(header, TokenDataArrayLayout.bytes)),
    probe,
    probeView: new DataView(koffi.view(probe, 2 * TokenDataLayout.bytes)),
    probeHeader,
    probeHeaderView: new DataView(koffi.view(probeHeader, TokenDataArrayLayout.bytes)),
    probeAddr: BigInt(koffi.address(probe))
  }
}

/** A sequence's chain as it samples: its samplers, its buffers and the draws made so far. */
interface ChainSampler extends ChainParts {
  readonly raw: LlamaRaw
  readonly policy: SamplingPolicy
  readonly vocab: LlamaVocab | undefined
  readonly nVocab: number
  readonly grammar: unknown
  readonly owned: ReadonlyArray<unknown>
  readonly buffers: ReturnType<typeof allocBuffers>
  draws: number
  freed: boolean
}

const setHeader = (view: DataView, data: bigint, size: number) => {
  view.setBigUint64(TokenDataArrayLayout.data, data, true)
  view.setBigUint64(TokenDataArrayLayout.size, BigInt(size), true)
  view.setBigInt64(TokenDataArrayLayout.selected, -1n, true)
  view.setUint8(TokenDataArrayLayout.sorted, 0)
}

// samplers sort and shrink the candidates in place: every step writes all of them again
const fill = ({ buffers, nVocab }: ChainSampler, logits: Float32Array) => {
  const { floats, ids } = buffers
  for (let i = 0, o = 0; i < nVocab; i++, o += 3) {
    ids[o] = i
    floats[o + 1] = logits[i]!
    floats[o + 2] = 0
  }
  setHeader(buffers.headerView, buffers.candidatesAddr, nVocab)
}

/** The token the last apply selected, or -1 (samplers such as XTC move `data` forward). */
const selected = ({ buffers }: ChainSampler): number => {
  const { headerView } = buffers
  const sel = Number(headerView.getBigInt64(TokenDataArrayLayout.selected, true))
  const size = Number(headerView.getBigUint64(TokenDataArrayLayout.size, true))
  if (!(sel >= 0 && sel < size)) return -1
  const data = headerView.getBigUint64(TokenDataArrayLayout.data, true)
  const at = (Number(data - buffers.candidatesAddr) + sel * TokenDataLayout.bytes) / 4
  // a pick among tokens that are all banned (-inf) is no pick
  return buffers.floats[at + 1] === -Infinity ? -1 : buffers.ids[at]!
}

const grammarAllows = ({ buffers, grammar, raw }: ChainSampler, token: number): boolean => {
  const { probeView } = buffers
  probeView.setInt32(TokenDataLayout.id, token, true)
  probeView.setFloat32(TokenDataLayout.logit, 1, true)
  probeView.setFloat32(TokenDataLayout.p, 0, true)
  setHeader(buffers.probeHeaderView, buffers.probeAddr, 1)
  raw.llama_sampler_apply(grammar, buffers.probeHeader)
  return probeView.getFloat32(TokenDataLayout.logit, true) !== -Infinity
}

const accept = ({ dry, grammar, penalties, raw, vocab }: ChainSampler, token: number) => {
  if (penalties !== null) raw.llama_sampler_accept(penalties, token)
  if (dry !== null) raw.llama_sampler_accept(dry, token)
  if (grammar !== null && !(vocab?.isEndOfGeneration(token) ?? false)) raw.llama_sampler_accept(grammar, token)
}

const skipDraws = ({ buffers, dist, raw, xtc }: ChainSampler, n: number) => {
  // dist draws once per apply whatever the candidates (one candidate: the draw is made and discarded); XTC draws
  // once per apply of two or more candidates (assumed for every step: exact unless a step left it fewer)
  for (const rng of [dist, xtc]) {
    if (rng === null) continue
    for (let i = 0; i < n; i++) {
      for (let k = 0; k < 2; k++) {
        buffers.probeView.setInt32(k * TokenDataLayout.bytes + TokenDataLayout.id, k, true)
        buffers.probeView.setFloat32(k * TokenDataLayout.bytes + TokenDataLayout.logit, 0, true)
      }
      setHeader(buffers.probeHeaderView, buffers.probeAddr, rng === xtc ? 2 : 1)
      raw.llama_sampler_apply(rng, buffers.probeHeader)
    }
  }
}

const applyChain = (s: ChainSampler) => {
  s.raw.llama_sampler_apply(s.chain, s.buffers.header)
  if (s.dist !== null) s.draws++
}

/** One step: the chain picks; a token the grammar rejects is picked again from the grammar's candidates. */
const sample = (s: ChainSampler, logits: Float32Array): SampleResult => {
  const { grammar, policy, vocab } = s
  fill(s, logits)
  applyChain(s)
  let token = selected(s)
  if (grammar !== null && token >= 0 && !grammarAllows(s, token)) {
    fill(s, logits)
    s.raw.llama_sampler_apply(grammar, s.buffers.header)
    applyChain(s)
    token = selected(s)
  }
  // nothing selectable (every token banned or outside the grammar): the generation ends here
  if (token < 0 || (grammar !== null && !(vocab?.isEndOfGeneration(token) ?? false) && !grammarAllows(s, token))) {
    token = -1
  } else accept(s, token)
  return {
    tokenId: token,
    draws: s.draws,
    ...(policy.logprobs === undefined || token < 0 ? {} : { logprob: stepLogprob(logits, token, policy.logprobs) })
  }
}

const free = (s: ChainSampler) => {
  if (s.freed) return
  s.freed = true
  for (const smpl of s.owned) s.raw.llama_sampler_free(smpl)
  koffi.free(s.buffers.candidates)
  koffi.free(s.buffers.header)
  koffi.free(s.buffers.probe)
  koffi.free(s.buffers.probeHeader)
}

/**
 * The sampler of one sequence. `vocab` is required when `needsVocab(policy)`; `contextLength` resolves a penalty
 * window of -1 (the whole context). Throws GrammarRejected when the grammar does not parse.
 */
export const makeSequenceSampler = (
  policy: SamplingPolicy,
  options: { readonly vocabSize: number; readonly contextLength: number; readonly vocab?: LlamaVocab }
): SequenceSampler => {
  if (!needsChain(policy)) return argmaxSampler(policy)
  const raw: LlamaRaw = getLlama()
  // The grammar is built first: a grammar that does not parse frees nothing else.
  const grammar = grammarOf(raw, policy, options.vocab)
  const parts = buildChain(raw, policy, options)
  const s: ChainSampler = {
    ...parts,
    raw,
    policy,
    vocab: options.vocab,
    nVocab: options.vocabSize,
    grammar,
    owned: grammar !== null ? [parts.chain, grammar] : [parts.chain],
    buffers: allocBuffers(options.vocabSize),
    draws: 0,
    freed: false
  }
  if (policy.resume !== undefined) {
    for (const token of policy.resume.tokens) accept(s, token)
    skipDraws(s, policy.resume.draws)
    s.draws = policy.resume.draws
  }
  return { sample: (logits) => sample(s, logits), free: () => free(s) }
}
