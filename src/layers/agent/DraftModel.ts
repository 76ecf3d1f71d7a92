/**
 * Draft-model speculation (SpeculativeOptions mode `draft`) on stage 0's node: a small model of the target's
 * vocabulary, loaded whole (one stage over all its blocks, with the output head) in a session of its own, decodes the
 * drafts greedily. Its cache follows the tokens stage 0 knows (SpeculationState.history): before drafting it is fed the
 * tokens it has not seen; after drafts that were not kept it writes over their positions from the first token that
 * differs (a rollback without a copy, as the stages do). Its weights come from the agent's model cache (HostedStage.ts),
 * and its forwards go through those weights' batcher like any stage's.
 */
import { Effect } from "effect"
import type { ForwardError } from "../../domain/engine.js"
import type { StageSession } from "../../services/StageExecutor.js"
import { type BatchCounters, emptyBatchCounters, type StageBatcher } from "./StageBatcher.js"

/** A draft model's session on stage 0's node and what its cache holds. */
export interface DraftModel {
  readonly session: StageSession
  readonly batcher: StageBatcher
  /** The positions its session holds at most. */
  readonly contextLength: number
  /** Drafting stops at this token (the target's end of sequence; the vocabularies are the same). */
  readonly eosTokenId: number
  /** The tokens its cache holds, position by position. */
  readonly seen: Array<number>
  readonly counters: BatchCounters
}

export const draftModelOf = (
  session: StageSession,
  batcher: StageBatcher,
  contextLength: number,
  eosTokenId: number
): DraftModel => ({ session, batcher, contextLength, eosTokenId, seen: [], counters: emptyBatchCounters() })

/** The index of a row's largest logit (the first of equals): greedy decoding. */
export const argmax = (row: Float32Array): number => {
  let best = 0
  for (let i = 1; i < row.length; i++) if (row[i]! > row[best]!) best = i
  return best
}

/** How many leading tokens the draft's cache holds as `history` has them, leaving at least one token to feed. */
const keptPrefix = (seen: ReadonlyArray<number>, history: ReadonlyArray<number>): number => {
  const limit = Math.min(seen.length, history.length - 1)
  let same = 0
  while (same < limit && seen[same] === history[same]) same++
  return same
}

/**
 * Up to `count` tokens the draft model decodes greedily after `history`, stopping after the end of sequence; none when
 * its context cannot hold them. Its cache then holds `history` and every draft but the last.
 */
export const draftTokens = (
  draft: DraftModel,
  history: ReadonlyArray<number>,
  count: number
): Effect.Effect<Array<number>, ForwardError> =>
  Effect.gen(function* () {
    const out: Array<number> = []
    if (count <= 0 || history.length === 0 || history.length + count > draft.contextLength) return out
    const from = keptPrefix(draft.seen, history)
    draft.seen.length = from
    let input = history.slice(from)
    while (out.length < count) {
      const output = yield* draft.batcher.submit(
        draft.session,
        draft.seen.length,
        { _tag: "Tokens", tokens: Int32Array.from(input) },
        draft.counters
      )
      draft.seen.push(...input)
      if (output._tag !== "Logits") return out
      const vocab = draft.session.info.vocabSize
      const next = argmax(output.logits.subarray(output.logits.length - vocab))
      out.push(next)
      if (next === draft.eosTokenId) break
      input = [next]
    }
    return out
  })
