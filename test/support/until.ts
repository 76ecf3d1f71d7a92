/**
 * Waiting on an event in a test: read a state (a metric, a log, a process table, a pipeline's membership) until it
 * holds. One generous outer limit stands for "never happened", so a loaded machine only makes the wait longer, never
 * the test red; the limit is not a latency claim (figures are measured by benchmark scripts, not by timed tests).
 */
import { Duration, Effect } from "effect"

/** The outer limit of a wait: long enough that only an event that never comes reaches it. */
export const eventLimitMillis = 60_000

const pollMillis = 20

const shown = (value: unknown) => {
  try {
    const text = JSON.stringify(value)
    return text === undefined ? String(value) : text.length > 300 ? `${text.slice(0, 300)}…` : text
  } catch {
    return String(value)
  }
}

/** Fails with this error when the state never holds; it names what was awaited and the last state read. */
export class NeverHappened extends Error {
  constructor(what: string, limitMillis: number, last: unknown) {
    super(`waited ${limitMillis} ms for ${what}; last seen: ${shown(last)}`)
    this.name = "NeverHappened"
  }
}

/** Reads `read` until `holds` accepts its value, and returns that value; fails with NeverHappened after the limit. */
export const until = <A, E, R>(
  what: string,
  read: Effect.Effect<A, E, R>,
  holds: (value: A) => boolean,
  limitMillis = eventLimitMillis
): Effect.Effect<A, E | NeverHappened, R> =>
  Effect.gen(function* () {
    const deadline = Date.now() + limitMillis
    for (;;) {
      const value = yield* read
      if (holds(value)) return value
      if (Date.now() >= deadline) return yield* Effect.fail(new NeverHappened(what, limitMillis, value))
      yield* Effect.sleep(Duration.millis(pollMillis))
    }
  })

/** `until` for a plain condition. */
export const untilTrue = (what: string, check: () => boolean, limitMillis = eventLimitMillis) =>
  until(what, Effect.sync(check), (held) => held, limitMillis).pipe(Effect.asVoid)

/** `until` for promise-based tests. */
export const untilAsync = async <A>(
  what: string,
  read: () => Promise<A> | A,
  holds: (value: A) => boolean,
  limitMillis = eventLimitMillis
): Promise<A> => {
  const deadline = Date.now() + limitMillis
  for (;;) {
    const value = await read()
    if (holds(value)) return value
    if (Date.now() >= deadline) throw new NeverHappened(what, limitMillis, value)
    await new Promise((resolve) => setTimeout(resolve, pollMillis))
  }
}
