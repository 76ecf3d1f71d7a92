/**
 * A hosted stage's part in speculative decoding (ProvisionRequest.speculative; services/Speculation.ts).
 *
 * Tokens keep flowing one per step number to stage 0 (from the last stage on the token loop, or from the orchestrator)
 * and to the orchestrator, as without drafts, so the run's state machine, the orchestrator and recovery see a run like
 * any other. What changes is inside the pipeline:
 * - stage 0 sends a token with the tokens it drafts after it as one step of 1 + k rows (its outbound steps are then
 *   numbered by message, not by token), and remembers the drafts;
 * - every stage runs such a step's rows on the few-row route (each row gets its lone bits) and passes the drafts on;
 * - the last stage samples row after row and stops at the first token that is not the next draft: the tokens it
 *   sampled are the step's tokens, each sent to stage 0 and to the orchestrator under its own step number;
 * - stage 0, given a token equal to its next pending draft, has already run it (its row was kept): it only notes it;
 *   given any other token, the drafts still pending were not kept, and its next step starts where the first of them
 *   was: every stage then writes over the positions of the rows that were not kept (a rollback without a copy).
 */
import { Effect } from "effect"
import type { SpeculativeProvision } from "../../domain/controlRpc.js"
import type { ForwardError, StageInput } from "../../domain/engine.js"
import type { SampledLogprob } from "../../domain/frames.js"
import { DraftLength, lookupDraft, predictedDraft } from "../../services/Speculation.js"
import type { SequenceSampler } from "../sampling/ChainSampler.js"
import { type DraftModel, draftTokens } from "./DraftModel.js"

/** What a stage of a speculative run keeps between its steps. */
export interface SpeculationState {
  readonly options: SpeculativeProvision
  readonly length: DraftLength
  /** Stage 0: the tokens it knows, the prompt's it ran and every token that came back. */
  readonly history: Array<number>
  /** Stage 0: how many of `history` are the prompt's. */
  promptTokens: number
  /** Stage 0: drafts of the step in flight not yet known to be kept. */
  pending: Array<number>
  /** Stage 0: the step in flight: when it was sent, its drafts and how many came back kept so far. */
  inFlight: { readonly sentAt: number; readonly drafted: number; accepted: number } | undefined
  /** Stage 0: the first token prompt lookup offered when the chooser drafted none (its acceptance is still measured). */
  shadow: number | undefined
  /** Stage 0: the next message number on its outbound edge. */
  nextMessage: number
  /** The last stage: the step number of the next token it samples. */
  nextToken: number
  /** Stage 0 of a `draft` run: the draft model that decodes its drafts (DraftModel.ts); absent: prompt lookup. */
  readonly draft: DraftModel | undefined
}

export const speculationState = (options: SpeculativeProvision, draft?: DraftModel): SpeculationState => ({
  options,
  draft,
  length: new DraftLength(options.maxDraft),
  history: [],
  promptTokens: 0,
  pending: [],
  inFlight: undefined,
  shadow: undefined,
  nextMessage: 0,
  nextToken: 0
})

/** Stage 0's step for a token that came back: nothing to run (a kept draft), or the step to run and where. */
export type FirstStageStep =
  | { readonly _tag: "Kept" }
  | {
      readonly _tag: "Run"
      readonly input: StageInput
      readonly startPos: number
      readonly drafts: ReadonlyArray<number>
    }

/**
 * The drafts on offer after the history: up to `k` the draft model decodes (one when the chooser asked for none and
 * tokens are left, to go on measuring its acceptance), else the prediction's or prompt lookup's, up to maxDraft.
 */
const candidatesOf = (
  spec: SpeculationState,
  k: number,
  left: number
): Effect.Effect<ReadonlyArray<number>, ForwardError> => {
  if (spec.draft !== undefined) return draftTokens(spec.draft, spec.history, k > 0 ? k : Math.min(1, left))
  const predicted = spec.options.predicted
  return Effect.succeed(
    predicted !== undefined
      ? predictedDraft(predicted, spec.history.length - spec.promptTokens, spec.options.maxDraft)
      : lookupDraft(spec.history, spec.options.maxDraft)
  )
}

/**
 * Stage 0, a decode token at token step `step` (the token sampled at step - 1). `position`: the positions its cache
 * holds (after the step in flight's rows); `roomRows`: the most rows its next step may have (its outbound window, the
 * context left). An effect: a draft model runs to draft (its time counts in the step's measured cost).
 */
export const firstStageStep = (
  spec: SpeculationState,
  tokenId: number,
  step: number,
  position: number,
  roomRows: number
): Effect.Effect<FirstStageStep, ForwardError> => {
  const now = performance.now()
  if (spec.pending.length > 0 && spec.pending[0] === tokenId) {
    spec.pending.shift()
    spec.history.push(tokenId)
    if (spec.inFlight !== undefined) spec.inFlight.accepted++
    return Effect.succeed({ _tag: "Kept" })
  }
  const rolledBack = spec.pending.length
  spec.pending = []
  if (spec.inFlight !== undefined) {
    spec.length.observe(spec.inFlight.drafted, spec.inFlight.accepted, now - spec.inFlight.sentAt)
  }
  if (spec.shadow !== undefined) spec.length.observe(1, spec.shadow === tokenId ? 1 : 0, 0)
  spec.history.push(tokenId)
  const left = spec.options.maxTokens - step - 1
  const wanted = spec.options.fixed === true ? spec.options.maxDraft : spec.length.choose()
  const k = Math.max(0, Math.min(wanted, spec.options.maxDraft, roomRows - 1, left))
  return Effect.map(candidatesOf(spec, k, left), (candidates): FirstStageStep => {
    const drafts = candidates.slice(0, k)
    spec.shadow = drafts.length === 0 && left > 0 ? candidates[0] : undefined
    spec.pending = [...drafts]
    spec.inFlight = { sentAt: now, drafted: drafts.length, accepted: 0 }
    const tokens = Int32Array.from([tokenId, ...drafts])
    return {
      _tag: "Run",
      input: drafts.length > 0 ? { _tag: "Tokens", tokens, verify: true } : { _tag: "Tokens", tokens },
      startPos: position - rolledBack,
      drafts
    }
  })
}

/** One token of a step as the last stage sampled it. */
export interface StepToken {
  readonly tokenId: number
  readonly eos: boolean
  readonly draws: number
  readonly logprob?: SampledLogprob
}

/**
 * The last stage: the tokens of a step from its rows' logits (`rows` × vocab), sampling row after row and stopping at
 * the end of sequence, at the run's last token, or at the first token that is not the next draft.
 */
export const verifiedTokens = (
  spec: SpeculationState,
  logits: Float32Array,
  rows: number,
  drafts: ReadonlyArray<number>,
  sample: SequenceSampler,
  eosTokenId: number
): Array<StepToken> => {
  const vocab = logits.length / rows
  const out: Array<StepToken> = []
  for (let i = 0; i < rows; i++) {
    const sampled = sample.sample(logits.subarray(i * vocab, (i + 1) * vocab))
    // nothing selectable (every token banned, or none the grammar allows): the generation ends
    const tokenId = sampled.tokenId < 0 ? Math.max(0, eosTokenId) : sampled.tokenId
    const eos = sampled.tokenId < 0 || tokenId === eosTokenId
    out.push({
      tokenId,
      eos,
      draws: sampled.draws,
      ...(sampled.logprob === undefined ? {} : { logprob: sampled.logprob })
    })
    if (eos || spec.nextToken + out.length >= spec.options.maxTokens) break
    if (i >= drafts.length || tokenId !== drafts[i]) break
  }
  return out
}
