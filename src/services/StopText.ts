/**
 * Stop strings over streamed text, pure: text is released only once no stop string can still begin in it,
 * so a stop string split across tokens ("The e" + "nd") is found and never shown.
 */
export interface StopMatch {
  /** Text safe to show now. */
  readonly text: string
  /** A stop string was found: `text` is everything before it, and nothing follows. */
  readonly stopped: boolean
  /** Which stop string was found (the one that begins first; when stopped). */
  readonly stop?: string
}

export interface StopMatcher {
  readonly push: (piece: string) => StopMatch
  /** What is still held back (the generation ended without a stop string). */
  readonly flush: () => string
}

export const makeStopMatcher = (stops: ReadonlyArray<string>): StopMatcher => {
  const patterns = stops.filter((s) => s.length > 0)
  let held = ""
  let done = false
  // The longest tail of `text` that is a proper prefix of some stop string.
  const pendingTail = (text: string) => {
    let keep = 0
    for (const stop of patterns) {
      for (let n = Math.min(stop.length - 1, text.length); n > keep; n--) {
        if (text.endsWith(stop.slice(0, n))) {
          keep = n
          break
        }
      }
    }
    return keep
  }
  return {
    push: (piece) => {
      if (done) return { text: "", stopped: true }
      held += piece
      let first = -1
      let found = ""
      for (const stop of patterns) {
        const at = held.indexOf(stop)
        if (at >= 0 && (first < 0 || at < first)) {
          first = at
          found = stop
        }
      }
      if (first >= 0) {
        done = true
        const text = held.slice(0, first)
        held = ""
        return { text, stopped: true, stop: found }
      }
      const keep = pendingTail(held)
      const text = held.slice(0, held.length - keep)
      held = held.slice(held.length - keep)
      return { text, stopped: false }
    },
    flush: () => {
      const text = done ? "" : held
      held = ""
      return text
    }
  }
}
