/**
 * Per-token log-probabilities kept aligned with the text a request actually returns: the stop-string matcher
 * (StopText.ts) holds text back and cuts it at a stop string, so a token's entry goes out with the text its first
 * character goes out with, and the entries of tokens that begin in or after a stop string are dropped with it.
 */
import type { TextLogprob } from "./Server.js"

export interface LogprobAligner {
  /** A generated token whose text (`length` characters, as the matcher is given it) follows what came before. */
  readonly add: (entry: TextLogprob, length: number) => void
  /** The matcher released `length` more characters: the entries of the tokens that begin in them. */
  readonly release: (length: number) => ReadonlyArray<TextLogprob>
  /** The matcher stopped after releasing `length` more characters: those entries; every later one is dropped. */
  readonly stop: (length: number) => ReadonlyArray<TextLogprob>
  /** The text ended without a stop string: every entry not yet released. */
  readonly flush: () => ReadonlyArray<TextLogprob>
}

export const makeLogprobAligner = (): LogprobAligner => {
  let pending: Array<{ readonly entry: TextLogprob; readonly start: number }> = []
  let pushed = 0
  let released = 0
  const take = () => {
    const cut = pending.findIndex((p) => p.start >= released)
    const out = (cut < 0 ? pending : pending.slice(0, cut)).map((p) => p.entry)
    pending = cut < 0 ? [] : pending.slice(cut)
    return out
  }
  return {
    add: (entry, length) => {
      pending.push({ entry, start: pushed })
      pushed += length
    },
    release: (length) => {
      released += length
      return take()
    },
    stop: (length) => {
      released += length
      const out = take()
      pending = []
      return out
    },
    flush: () => {
      const out = pending.map((p) => p.entry)
      pending = []
      released = pushed
      return out
    }
  }
}
