/**
 * One validation of what `swactor run`, `swactor serve` and the library are asked to do: the same bounds and the same
 * words everywhere, each check pure (no I/O), so every caller can run it before anything is spawned.
 *
 * Each check returns `undefined` when the value is fine, or the problem as one line. `field` is how the caller names
 * the value (a flag such as `--max-tokens` on the command line, a JSON field such as `max_tokens` over HTTP).
 */
import { gbnfProblem } from "./Gbnf.js"

/** Engine threads per stage: the bounds the stage engine accepts (StageExecutorLive refuses others). */
export const minThreads = 1
export const maxThreads = 512

/** Threads outside [1, 512] (or not a whole number). */
export const threadsProblem = (threads: number, field = "threads"): string | undefined =>
  Number.isSafeInteger(threads) && threads >= minThreads && threads <= maxThreads
    ? undefined
    : `${field} must be a whole number from ${minThreads} to ${maxThreads}, got ${threads}`

/**
 * Spare agents: local agents started up front besides the stages, hosting nothing until a recovery needs one. Each is
 * a process (its memory: bench/README.md) from the start, so a typo such as 1000 must not start a thousand of them.
 */
export const maxSpares = 64

/** Spares outside [0, 64] (or not a whole number). */
export const sparesProblem = (spares: number, field = "spares"): string | undefined =>
  Number.isSafeInteger(spares) && spares >= 0 && spares <= maxSpares
    ? undefined
    : `${field} must be a whole number from 0 to ${maxSpares}, got ${spares}`

/**
 * Stages against the model's transformer blocks: every stage hosts at least one block, so a model of `numLayers`
 * blocks splits into at most `numLayers` stages.
 */
export const stagesProblem = (stages: number, numLayers: number, field = "stages"): string | undefined => {
  if (!Number.isSafeInteger(stages) || stages < 1) return `${field} must be a whole number of at least 1, got ${stages}`
  return stages > numLayers
    ? `${field} ${stages}: the model has ${numLayers} blocks, so it splits into at most ${numLayers} stages ` +
        `(each stage hosts at least one block)`
    : undefined
}

/** The words for an empty prompt, everywhere. */
export const emptyPromptMessage = "the prompt is empty"

/** A prompt with nothing in it: no token ids, or text that is empty or only white space. */
export const isEmptyPrompt = (prompt: string | ReadonlyArray<number>): boolean =>
  typeof prompt === "string" ? prompt.trim() === "" : prompt.length === 0

/** Token ids a model can take: whole numbers in [0, vocabSize). Names the first one that is not. */
export const tokenIdsProblem = (tokens: ReadonlyArray<number>, vocabSize: number): string | undefined => {
  for (let i = 0; i < tokens.length; i++) {
    const id = tokens[i]!
    if (!(Number.isSafeInteger(id) && id >= 0 && id < vocabSize)) {
      return `prompt token ${i} is ${id}: token ids are whole numbers from 0 to ${vocabSize - 1} (the model's vocabulary)`
    }
  }
  return undefined
}

/**
 * Does a generation of `maxTokens` after `promptTokens` fit a context of `contextLength` tokens?
 *
 * The rule: prompt + max tokens ≤ context. The whole sequence, prompt and every generated token, is at most the
 * model's context (what it was trained on; OpenAI's rule too). The KV cache then needs one position less than that:
 * it holds the prompt and every generated token fed back, and the last generated token is never fed back (the run
 * ends on it), so prompt + max tokens = context uses context − 1 positions.
 */
export const fitsContext = (promptTokens: number, maxTokens: number, contextLength: number): boolean =>
  promptTokens + maxTokens <= contextLength

/** `maxTokens` is a whole number of at least 1. */
export const maxTokensProblem = (maxTokens: number, field = "max tokens"): string | undefined =>
  Number.isSafeInteger(maxTokens) && maxTokens >= 1
    ? undefined
    : `${field} must be a whole number of at least 1, got ${maxTokens}`

/** The context rule's refusal in words (`field` names max tokens: `--max-tokens`, `max_tokens`). */
export const contextProblem = (
  promptTokens: number,
  maxTokens: number,
  contextLength: number,
  field = "max tokens"
): string | undefined => {
  if (fitsContext(promptTokens, maxTokens, contextLength)) return undefined
  const room = contextLength - promptTokens
  return (
    `context too long: the prompt (${promptTokens} tokens) and ${maxTokens} new tokens (${field} ${maxTokens}) ` +
    `do not fit the model's context of ${contextLength} tokens` +
    (room > 0 ? `; at most ${field} ${room}` : "; the prompt alone fills it")
  )
}

// ---------------------------------------------------------------------------------------------
// API keys
// ---------------------------------------------------------------------------------------------

/**
 * An API key of `swactor serve`, the `index`-th (from 1) of `source`: printable ASCII without spaces. A header carries
 * bytes, and clients turn a character beyond ASCII into different ones (curl sends UTF-8, a browser's fetch and the
 * openai package Latin-1, others refuse it), so such a key could never be matched reliably: it is refused at start.
 */
export const apiKeyProblem = (key: string, index: number, source: string): string | undefined => {
  if (/\s/.test(key)) return `${source}: key ${index} has a space inside; one key per line`
  const at = [...key].findIndex((ch) => ch < "!" || ch > "~")
  if (at < 0) return undefined
  return (
    `${source}: key ${index} has a character outside printable ASCII (at character ${at + 1}), which HTTP clients ` +
    `send as different bytes; use letters, digits and punctuation (${makeTokenHint})`
  )
}

// ---------------------------------------------------------------------------------------------
// The cluster token's strength
// ---------------------------------------------------------------------------------------------

/** The shortest cluster token accepted. */
export const minTokenLength = 16
/** The least estimated entropy of a cluster token accepted, in bits. */
export const minTokenBits = 64
/** How to make a good one, said in every refusal. */
export const makeTokenHint = "make one with: openssl rand -hex 32"

/** The size of the alphabet the token's characters were drawn from, judged by the classes it uses. */
const classAlphabet = (token: string): number => {
  let lower = false
  let upper = false
  let digit = false
  let symbol = false
  let other = false
  for (const ch of token) {
    if (ch >= "a" && ch <= "z") lower = true
    else if (ch >= "A" && ch <= "Z") upper = true
    else if (ch >= "0" && ch <= "9") digit = true
    else if (ch >= " " && ch <= "~") symbol = true
    else other = true
  }
  return (lower ? 26 : 0) + (upper ? 26 : 0) + (digit ? 10 : 0) + (symbol ? 33 : 0) + (other ? 100 : 0)
}

/** The shortest prefix the whole token repeats ("abcabcab" → 3); the token's length when it repeats none. */
const shortestPeriod = (codes: ReadonlyArray<number>): number => {
  for (let p = 1; p < codes.length; p++) {
    let periodic = true
    for (let i = p; i < codes.length && periodic; i++) periodic = codes[i] === codes[i - p]
    if (periodic) return p
  }
  return codes.length
}

/**
 * A conservative estimate of a token's entropy in bits: within its shortest repeating part, each character that is
 * not predictable from the ones before it (a repeat of the one before, or the next step of a run such as "abcd" or
 * "9876" after its first three characters) adds
 * log2 of the alphabet its character classes span. A repeated or sequential token scores near zero; random hex of
 * 32 characters scores over 128 (its true entropy is 128).
 */
export const estimateTokenBits = (token: string): number => {
  const codes = Array.from(token, (ch) => ch.codePointAt(0)!)
  const part = codes.slice(0, shortestPeriod(codes))
  let free = 0
  for (let i = 0; i < part.length; i++) {
    const repeat = i >= 1 && part[i] === part[i - 1]
    // a step seen twice before ("ab" then "c"? no: "abc" then "d") continues a run
    const step =
      i >= 3 &&
      part[i]! - part[i - 1]! === part[i - 1]! - part[i - 2]! &&
      part[i - 1]! - part[i - 2]! === part[i - 2]! - part[i - 3]!
    if (!repeat && !step) free++
  }
  const alphabet = classAlphabet(token)
  return alphabet <= 1 ? 0 : free * Math.log2(alphabet)
}

/** A cluster token too short or too predictable to keep strangers out; `source` says where it came from. */
export const clusterTokenProblem = (token: string, source: string): string | undefined => {
  const length = [...token].length
  if (length < minTokenLength) {
    return `the cluster token from ${source} is too short: ${length} characters, at least ${minTokenLength}; ${makeTokenHint}`
  }
  const bits = estimateTokenBits(token)
  if (bits < minTokenBits) {
    return (
      `the cluster token from ${source} is weak: about ${Math.floor(bits)} bits of entropy (repeated or sequential ` +
      `characters), at least ${minTokenBits}; ${makeTokenHint}`
    )
  }
  return undefined
}

/**
 * A generation request against its model, in the order a caller hears about it: an empty prompt, max tokens, token
 * ids outside the vocabulary, then prompt + max tokens against the context. `text` is the prompt as given (white
 * space only is empty), `tokens` the prompt's token ids (the text tokenized, or the ids as given).
 */
export const generationProblem = (request: {
  readonly text: string | ReadonlyArray<number>
  readonly tokens: ReadonlyArray<number>
  readonly maxTokens: number
  readonly contextLength: number
  readonly vocabSize: number
  /** How the caller names max tokens (`--max-tokens`, `max_tokens`, `maxTokens`). */
  readonly maxTokensField?: string
}): string | undefined => {
  const field = request.maxTokensField ?? "max tokens"
  if (isEmptyPrompt(request.text) || request.tokens.length === 0) return emptyPromptMessage
  return (
    maxTokensProblem(request.maxTokens, field) ??
    tokenIdsProblem(request.tokens, request.vocabSize) ??
    contextProblem(request.tokens.length, request.maxTokens, request.contextLength, field)
  )
}

/**
 * A served request (the Server's ServeRequest, OpenAI's field names): the generation checks (generationProblem, max
 * tokens named `max_tokens`), then its sampling fields: temperature in [0, 100], top_k a whole number ≥ 0, top_p in
 * [0, 1] (0 keeps the likeliest token), min_p in [0, 1], seed a whole number. The HTTP routes hold each field to its
 * API's narrower range first (layers/server/SamplingRanges.ts).
 */
export const serveRequestProblem = (
  request: {
    readonly text: string | ReadonlyArray<number>
    readonly tokens: ReadonlyArray<number>
    readonly maxTokens: number
    readonly sampling?:
      | {
          readonly temperature?: number | undefined
          readonly topK?: number | undefined
          readonly topP?: number | undefined
          readonly minP?: number | undefined
          readonly seed?: number | undefined
        }
      | undefined
  },
  model: { readonly contextLength: number; readonly vocabSize: number }
): string | undefined => {
  const s = request.sampling ?? {}
  const problem = generationProblem({
    text: request.text,
    tokens: request.tokens,
    maxTokens: request.maxTokens,
    contextLength: model.contextLength,
    vocabSize: model.vocabSize,
    maxTokensField: "max_tokens"
  })
  if (problem !== undefined) return problem
  if (s.temperature !== undefined && !(Number.isFinite(s.temperature) && s.temperature >= 0 && s.temperature <= 100)) {
    return `temperature must be between 0 and 100, got ${s.temperature}`
  }
  if (s.topK !== undefined && !(Number.isSafeInteger(s.topK) && s.topK >= 0))
    return `top_k must be a whole number ≥ 0, got ${s.topK}`
  if (s.topP !== undefined && !(s.topP >= 0 && s.topP <= 1)) return `top_p must be between 0 and 1, got ${s.topP}`
  if (s.minP !== undefined && !(s.minP >= 0 && s.minP <= 1)) return `min_p must be in [0, 1], got ${s.minP}`
  if (s.seed !== undefined && !Number.isSafeInteger(s.seed)) return `seed must be a whole number, got ${s.seed}`
  return undefined
}

/** The most log-probability alternatives a token may report (OpenAI's top_logprobs bound). */
export const maxLogprobs = 20
/** The longest grammar text a request may carry (its syntax, nesting and expansion: Gbnf.ts's checks). */
export const maxGrammarBytes = 256 * 1024

const finite = (x: unknown): x is number => typeof x === "number" && Number.isFinite(x)
const whole = (x: unknown): x is number => typeof x === "number" && Number.isSafeInteger(x)

/** The sampling settings samplingPolicyProblem checks (a SamplingPolicy's fields). */
interface SamplingPolicyFields {
  readonly temperatureMillis: number
  readonly topK: number
  readonly topP?: number | undefined
  readonly minP?: number | undefined
  readonly seed?: number | undefined
  readonly typicalP?: number | undefined
  readonly repeatPenalty?: number | undefined
  readonly presencePenalty?: number | undefined
  readonly frequencyPenalty?: number | undefined
  readonly penaltyLastN?: number | undefined
  readonly dry?: DryFields | undefined
  readonly xtc?: { readonly probability: number; readonly threshold: number } | undefined
  readonly logitBias?: ReadonlyArray<{ readonly tokenId: number; readonly bias: number }> | undefined
  readonly bannedTokens?: ReadonlyArray<number> | undefined
  readonly grammar?: { readonly text: string; readonly root: string } | undefined
  readonly logprobs?: number | undefined
  readonly resume?: { readonly tokens: ReadonlyArray<number>; readonly draws: number } | undefined
}

interface DryFields {
  readonly multiplier: number
  readonly base: number
  readonly allowedLength: number
  readonly penaltyLastN: number
  readonly sequenceBreakers: ReadonlyArray<string>
}

const inRange = (x: number | undefined, lo: number, hi: number, field: string, what = `between ${lo} and ${hi}`) =>
  x === undefined || (finite(x) && x >= lo && x <= hi) ? undefined : `${field} must be ${what}, got ${x}`

const tokenProblem = (id: number, field: string, vocabSize: number) =>
  whole(id) && id >= 0 && id < vocabSize
    ? undefined
    : `${field} ${id} is no token: token ids are whole numbers from 0 to ${vocabSize - 1} (the model's vocabulary)`

/** Temperature, top-k/p, min-p, typical-p, seed and the repetition penalties. */
const scalarSamplingProblem = (p: SamplingPolicyFields): string | undefined =>
  (!finite(p.temperatureMillis) || p.temperatureMillis < 0 || p.temperatureMillis > 100_000
    ? `temperature must be between 0 and 100, got ${p.temperatureMillis / 1000}`
    : undefined) ??
  (!whole(p.topK) || p.topK < 0 ? `topK must be a whole number ≥ 0, got ${p.topK}` : undefined) ??
  inRange(p.topP, 0, 1, "topP") ??
  inRange(p.minP, 0, 1, "minP") ??
  inRange(p.typicalP, 0, 1, "typicalP") ??
  (p.seed !== undefined && !whole(p.seed) ? `seed must be a whole number, got ${p.seed}` : undefined) ??
  (p.repeatPenalty !== undefined && !(finite(p.repeatPenalty) && p.repeatPenalty > 0 && p.repeatPenalty <= 100)
    ? `repeatPenalty must be above 0 and at most 100 (1 = off), got ${p.repeatPenalty}`
    : undefined) ??
  inRange(p.presencePenalty, -100, 100, "presencePenalty") ??
  inRange(p.frequencyPenalty, -100, 100, "frequencyPenalty") ??
  (p.penaltyLastN !== undefined && !(whole(p.penaltyLastN) && p.penaltyLastN >= -1)
    ? `penaltyLastN must be a whole number ≥ -1 (-1: the whole context), got ${p.penaltyLastN}`
    : undefined)

const dryProblem = (d: DryFields): string | undefined =>
  inRange(d.multiplier, 0, 100, "dry.multiplier") ??
  inRange(d.base, 1, 100, "dry.base") ??
  (!whole(d.allowedLength) || d.allowedLength < 1 || d.allowedLength > 1_000_000
    ? `dry.allowedLength must be a whole number ≥ 1, got ${d.allowedLength}`
    : undefined) ??
  (!whole(d.penaltyLastN) || d.penaltyLastN < -1
    ? `dry.penaltyLastN must be a whole number ≥ -1 (-1: the whole context), got ${d.penaltyLastN}`
    : undefined) ??
  (d.sequenceBreakers.length > 64
    ? `dry.sequenceBreakers holds at most 64 strings, got ${d.sequenceBreakers.length}`
    : undefined) ??
  d.sequenceBreakers
    .map((b, i) =>
      typeof b !== "string" || b.length === 0 || b.length > 256 || b.includes("\u0000")
        ? `dry.sequenceBreakers[${i}] must be a non-empty string of at most 256 characters without NUL`
        : undefined
    )
    .find((x) => x !== undefined)

/** Logit biases and banned tokens: no more than the vocabulary, each a token, each bias finite and bounded. */
const logitBiasProblem = (p: SamplingPolicyFields, vocabSize: number): string | undefined => {
  const biases = p.logitBias ?? []
  if (biases.length + (p.bannedTokens?.length ?? 0) > vocabSize) {
    return `logitBias holds more entries (${biases.length + (p.bannedTokens?.length ?? 0)}) than the vocabulary has tokens (${vocabSize})`
  }
  for (const b of biases) {
    const bad =
      tokenProblem(b.tokenId, "logitBias token", vocabSize) ??
      (finite(b.bias) && Math.abs(b.bias) <= 1e6
        ? undefined
        : `logitBias for token ${b.tokenId} must be a finite number of at most 1e6 in size, or -Infinity, got ${b.bias}`)
    if (bad !== undefined) return bad
  }
  for (const id of p.bannedTokens ?? []) {
    const bad = tokenProblem(id, "logitBias token", vocabSize)
    if (bad !== undefined) return bad
  }
  return undefined
}

const grammarProblem = ({ root, text }: { readonly text: string; readonly root: string }): string | undefined => {
  if (typeof text !== "string" || text.trim() === "") return "grammar must be a non-empty GBNF text"
  if (new TextEncoder().encode(text).length > maxGrammarBytes) return `grammar is over ${maxGrammarBytes} bytes`
  if (text.includes("\u0000")) return "grammar must not contain NUL characters"
  if (typeof root !== "string" || !/^[A-Za-z0-9_-]{1,128}$/.test(root)) {
    return `grammar root must be a rule name (letters, digits, - and _), got ${JSON.stringify(root)}`
  }
  // llama.cpp's parser aborts or allocates without end on some texts it should refuse ({3,1}): checked here first.
  const syntax = gbnfProblem(text, root)
  if (syntax !== undefined) return `grammar: ${syntax}`
  return undefined
}

const resumeProblem = (
  resume: { readonly tokens: ReadonlyArray<number>; readonly draws: number },
  vocabSize: number
): string | undefined => {
  if (!whole(resume.draws) || resume.draws < 0) return `resume.draws must be a whole number ≥ 0, got ${resume.draws}`
  for (const id of resume.tokens) {
    const bad = tokenProblem(id, "resumed token", vocabSize)
    if (bad !== undefined) return bad
  }
  return undefined
}

/**
 * The last stage's sampling settings (a SamplingPolicy, as the planner hands it to the stages) against the model's
 * vocabulary: every number finite and in range, token ids in [0, vocabSize), grammar text and DRY breakers plain
 * strings, so nothing out of range reaches llama.cpp's native sampler (whose failed assertions abort the process).
 * Names the field as SamplingOptions does.
 */
export const samplingPolicyProblem = (p: SamplingPolicyFields, vocabSize: number): string | undefined =>
  scalarSamplingProblem(p) ??
  (p.dry !== undefined ? dryProblem(p.dry) : undefined) ??
  (p.xtc !== undefined
    ? (inRange(p.xtc.probability, 0, 1, "xtc.probability") ?? inRange(p.xtc.threshold, 0, 1, "xtc.threshold"))
    : undefined) ??
  logitBiasProblem(p, vocabSize) ??
  (p.grammar !== undefined ? grammarProblem(p.grammar) : undefined) ??
  (p.logprobs !== undefined && !(whole(p.logprobs) && p.logprobs >= 0 && p.logprobs <= maxLogprobs)
    ? `logprobs must be a whole number from 0 to ${maxLogprobs}, got ${p.logprobs}`
    : undefined) ??
  (p.resume !== undefined ? resumeProblem(p.resume, vocabSize) : undefined)
