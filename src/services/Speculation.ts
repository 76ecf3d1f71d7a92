/**
 * Speculative decoding's pure parts: where drafted tokens come from (prompt lookup over the tokens so far, or a given
 * prediction), how many to draft (from the measured acceptance and the measured cost of a step of that many rows),
 * and which of them the last stage keeps.
 *
 * The last stage keeps a draft only when the token it samples from the row before it is that draft, calling its
 * sampler on each row in order and stopping at the first other token. Its sampler therefore sees exactly the rows and
 * makes exactly the draws that decoding without drafts makes, so the output is the same text for every sampler (greedy,
 * seeded temperature, grammar), not only the same distribution: for a draft given with certainty, accepting when the
 * sample equals it is the standard speculative-sampling rule (accept with probability p(draft), else a sample from p
 * without the draft).
 */

/** How a run drafts (RunRequest.speculative). */
export interface SpeculativeOptions {
  /**
   * `ngram`: prompt lookup over the prompt and the text so far; `auto`: the same where the model allows it; `draft`: a
   * small model of the same vocabulary (`draftModel`), run whole on stage 0's node, decodes the drafts greedily.
   */
  readonly mode: "off" | "ngram" | "auto" | "draft"
  /** The most tokens drafted per step (default 6: with the step's token, 7 rows, the few-row route's reach). */
  readonly maxDraft?: number
  /** Expected output tokens (OpenAI's predicted outputs), drafted by position instead of by prompt lookup. */
  readonly predicted?: ReadonlyArray<number>
  /**
   * Always draft `maxDraft` where drafts are found, never fewer by measured acceptance and step costs (tests force the
   * path this way: the adaptive count follows timings). Default false.
   */
  readonly fixed?: boolean
  /** `draft`: the draft model's GGUF file (a path stage 0's node reads, or a hub name); only with `draft`. */
  readonly draftModel?: string
  /**
   * `draft`: the draft model's block count, set by the orchestrator when it checked the draft (DraftModelCheck.ts);
   * a caller's value is replaced.
   */
  readonly draftBlocks?: number
}

export const DEFAULT_MAX_DRAFT = 6

/** What is wrong with a run's speculative options, in one line (undefined: nothing). `rewind`: ModelLayout.rewind. */
export const speculativeProblem = (
  options: SpeculativeOptions | undefined,
  rewind: false | undefined,
  vocabSize: number
): string | undefined => {
  if (options === undefined) return undefined
  const max = options.maxDraft
  if (max !== undefined && (!Number.isSafeInteger(max) || max < 1 || max > 255)) {
    return `speculative: the most drafted tokens must be a whole number in [1, 255], got ${max}`
  }
  if (options.predicted?.some((t) => !Number.isSafeInteger(t) || t < 0 || t >= vocabSize)) {
    return `speculative: a predicted token id is outside the vocabulary [0, ${vocabSize})`
  }
  if (options.mode === "draft" && options.draftModel === undefined) {
    return "speculative draft: needs a draft model (a small GGUF file of the same vocabulary)"
  }
  if (options.mode !== "draft" && options.draftModel !== undefined) {
    return `speculative ${options.mode}: a draft model is only used by draft`
  }
  if ((options.mode === "ngram" || options.mode === "draft") && rewind === false) {
    return (
      `speculative ${options.mode}: this model's stages cannot roll a sequence back (deepseek4's compressed ` +
      "caches); use auto (drafts where a model can) or off"
    )
  }
  return undefined
}
/**
 * Why a draft model cannot draft for the target, in one line (undefined: it can): their vocabularies must be the same
 * token strings in the same order (`tokenizer.ggml.tokens`), else a draft's ids would name other tokens.
 */
export const draftVocabularyProblem = (
  target: ReadonlyArray<string> | undefined,
  draft: ReadonlyArray<string> | undefined
): string | undefined => {
  if (target === undefined || draft === undefined) {
    return `speculative draft: the ${target === undefined ? "model" : "draft model"} names no tokens (tokenizer.ggml.tokens) to compare`
  }
  if (target.length !== draft.length) {
    return `speculative draft: the draft model's vocabulary differs from the model's (${draft.length} tokens, not ${target.length})`
  }
  const i = target.findIndex((token, index) => draft[index] !== token)
  if (i >= 0) {
    return (
      `speculative draft: the draft model's vocabulary differs from the model's (token ${i} is ` +
      `${JSON.stringify(draft[i])}, not ${JSON.stringify(target[i])})`
    )
  }
  return undefined
}

/** The longest and shortest suffix prompt lookup matches. */
export const NGRAM_MAX = 4
export const NGRAM_MIN = 2

/**
 * Prompt lookup: the tokens that followed the latest earlier occurrence of the history's last n tokens (n from
 * NGRAM_MAX down to NGRAM_MIN, the longest match first), at most `max`. Empty when nothing matches.
 */
export const lookupDraft = (history: ReadonlyArray<number>, max: number): Array<number> => {
  const len = history.length
  if (max <= 0) return []
  for (let n = Math.min(NGRAM_MAX, len - 1); n >= NGRAM_MIN; n--) {
    // the latest start i < len - n whose n tokens equal the last n
    for (let i = len - n - 1; i >= 0; i--) {
      let same = true
      for (let j = 0; j < n && same; j++) same = history[i + j] === history[len - n + j]
      if (!same) continue
      const from = i + n
      return history.slice(from, Math.min(from + max, len))
    }
  }
  return []
}

/**
 * Drafts from a prediction of the output, by position: the `max` predicted tokens after the `generated` ones (a
 * prediction that lost its place drafts tokens that are not kept, and the chooser drafts fewer).
 */
export const predictedDraft = (predicted: ReadonlyArray<number>, generated: number, max: number): Array<number> =>
  predicted.slice(generated, generated + Math.max(0, max))

/**
 * The drafts a step keeps: the leading drafts each equal to the token sampled from the row before it. `sampled[i]`
 * is the token from row i (the step's token's row first); returns how many drafts were accepted, and so how many of
 * `sampled` are the step's tokens (that many + 1, fewer when `sampled` stopped early).
 */
export const acceptedDrafts = (drafts: ReadonlyArray<number>, sampled: ReadonlyArray<number>): number => {
  let m = 0
  while (m < drafts.length && m < sampled.length && sampled[m] === drafts[m]) m++
  return m
}

/** What one more row is taken to add to a step's cost until that row count is measured (a guess on the dear side). */
const UNMEASURED_ROW_COST = 0.15
/** Acceptance under which nothing is drafted (the shadow lookups still measure it: ample drafts come back). */
const MIN_ACCEPTANCE = 0.1

/**
 * How many tokens to draft: the count whose expected tokens per step, over the measured cost of a step of that many
 * rows, is best. Acceptance is each draft's chance of being kept once the ones before it were (a running mean over
 * recent steps); a step's cost is the time from sending it to its tokens coming back (the whole pipeline's round trip),
 * by row count. Until a count is measured it is assumed to cost the nearest measured count's plus 15% a row between
 * them, so drafting must be kept often enough to pay before it is tried, and stops soon when it is not.
 */
export class DraftLength {
  private acceptance = 0.5
  private readonly costs = new Map<number, number>()
  constructor(readonly maxDraft: number) {}

  /** A step of `drafted` drafts kept `accepted` of them and took `millis` from its send to its last token back. */
  observe(drafted: number, accepted: number, millis: number): void {
    if (drafted > 0) {
      // each draft offered a chance until the first refusal: accepted kept, one refused (unless all were kept)
      const tries = Math.min(drafted, accepted + 1)
      const rate = accepted / tries
      this.acceptance = 0.8 * this.acceptance + 0.2 * rate
    }
    const rows = drafted + 1
    const seen = this.costs.get(rows)
    if (millis > 0) this.costs.set(rows, seen === undefined ? millis : 0.8 * seen + 0.2 * millis)
  }

  /** The acceptance estimate now (for reports and tests). */
  get rate(): number {
    return this.acceptance
  }

  /**
   * A step of `rows` rows: its measured cost, else the nearest measured count's scaled by UNMEASURED_ROW_COST a row
   * between them (so a plain step never measured is not taken for as dear as a long one), else that scale from 1.
   */
  private costOf(rows: number): number {
    const seen = this.costs.get(rows)
    if (seen !== undefined) return seen
    for (let d = 1; d <= this.maxDraft + 1; d++) {
      const below = this.costs.get(rows - d)
      if (below !== undefined) return below * (1 + UNMEASURED_ROW_COST * d)
      const above = this.costs.get(rows + d)
      if (above !== undefined) return above / (1 + UNMEASURED_ROW_COST * d)
    }
    return 1 + UNMEASURED_ROW_COST * (rows - 1)
  }

  /** The draft count to ask for next (0: decode without drafts). */
  choose(): number {
    const a = Math.min(this.acceptance, 0.999)
    // under MIN_ACCEPTANCE a draft brings under that fraction of a token: within the noise of the measured costs
    if (a < MIN_ACCEPTANCE) return 0
    let best = 0
    let bestRate = 1 / this.costOf(1)
    for (let k = 1; k <= this.maxDraft; k++) {
      // expected tokens of a step of k drafts: 1 + a + a^2 + ... + a^k
      const tokens = (1 - a ** (k + 1)) / (1 - a)
      const rate = tokens / this.costOf(k + 1)
      if (rate > bestRate * 1.02) {
        best = k
        bestRate = rate
      }
    }
    return best
  }
}
