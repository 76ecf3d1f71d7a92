/**
 * One round of N concurrent streaming requests to a warm swactor `Server` (what `swactor serve` puts behind HTTP) and
 * the figures of rounds: aggregate decode tok/s (tokens after each stream's first / time from the first first token to
 * the last token), TTFT and inter-token latency percentiles. Shared by bench:serve and bench:moe.
 */
import { Effect, type ManagedRuntime, Stream } from "effect"
import { Server } from "../src/api/serve.js"

const shortPrompts = [
  "Once upon a time",
  "The little dog",
  "In a big forest",
  "One sunny day",
  "Tom and Sue",
  "A red ball",
  "The old man",
  "At the park"
]

/**
 * The prompts every contender gets: the short ones, or each repeated BENCH_PROMPT_REPEAT times (joined by spaces) for
 * the time to first token of a long prompt (a pipeline's prefill runs in pieces: services/PromptPieces.ts).
 */
const promptRepeat = Math.max(1, Number(process.env["BENCH_PROMPT_REPEAT"] ?? 1) || 1)
export const prompts = shortPrompts.map((p) => Array.from({ length: promptRepeat }, () => p).join(" "))

/** When each token of one stream arrived (ms), from the request's start. */
export interface StreamTimes {
  readonly start: number
  readonly arrivals: ReadonlyArray<number>
  readonly text: string
}

interface Figures {
  readonly aggregate: number
  readonly ttft: readonly [number, number]
  readonly itl: readonly [number, number]
}

export const percentile = (values: ReadonlyArray<number>, p: number) => {
  if (values.length === 0) return Number.NaN
  const sorted = [...values].sort((a, b) => a - b)
  return sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))]!
}

const figures = (streams: ReadonlyArray<StreamTimes>): Figures => {
  const firsts = streams.map((s) => s.arrivals[0] ?? Number.NaN)
  const lasts = streams.map((s) => s.arrivals.at(-1) ?? Number.NaN)
  const decoded = streams.reduce((n, s) => n + Math.max(0, s.arrivals.length - 1), 0)
  const span = (Math.max(...lasts) - Math.min(...firsts)) / 1000
  const gaps = streams.flatMap((s) => s.arrivals.slice(1).map((t, i) => t - s.arrivals[i]!))
  const ttfts = streams.map((s, i) => firsts[i]! - s.start)
  return {
    aggregate: span > 0 ? decoded / span : Number.NaN,
    ttft: [percentile(ttfts, 50), percentile(ttfts, 99)],
    itl: [percentile(gaps, 50), percentile(gaps, 99)]
  }
}

/** N greedy requests of `tokens` tokens at once (prompt i: prompts[i mod 8]); each stream's arrival times and text. */
export const swactorRound = (runtime: ManagedRuntime.ManagedRuntime<Server, never>, n: number, tokens: number) =>
  runtime.runPromise(
    Effect.flatMap(Server, (server) =>
      Effect.forEach(
        Array.from({ length: n }, (_, i) => prompts[i % prompts.length]!),
        (prompt) =>
          Effect.suspend(() => {
            const start = performance.now()
            const arrivals: Array<number> = []
            let text = ""
            return server.generate({ prompt, maxTokens: tokens, sampling: { temperature: 0 } }).pipe(
              Stream.runForEach((event) =>
                Effect.sync(() => {
                  if (event._tag === "Text") {
                    text += event.text
                    // One arrival per generated token (a piece may be held back for a multi-byte character).
                    while (arrivals.length < event.completionTokens) arrivals.push(performance.now())
                  }
                })
              ),
              Effect.map((): StreamTimes => ({ start, arrivals, text }))
            )
          }),
        { concurrency: "unbounded" }
      )
    )
  )

export const fmt = (x: number, digits = 1) => (Number.isFinite(x) ? x.toFixed(digits) : "-")

export const median = (values: ReadonlyArray<number>) => percentile(values, 50)

/** A contender's rounds at one N: the median round's aggregate (and the spread), latencies over every round's streams. */
export interface Summary {
  readonly aggregate: number
  readonly spread: string
  readonly ttft: readonly [number, number]
  readonly itl: readonly [number, number]
  /** Inter-token p99 of the median round (each round's own p99, the median of those). */
  readonly itlP99Round: number
}

export const summarize = (rounds: ReadonlyArray<ReadonlyArray<StreamTimes>>): Summary => {
  const perRound = rounds.map(figures)
  const aggregates = perRound.map((f) => f.aggregate)
  const pooled = figures(rounds.flat())
  // (the median of an even count of rounds is the upper middle: percentile's rule)
  return {
    aggregate: median(aggregates),
    spread: rounds.length > 1 ? `${fmt(Math.min(...aggregates))}–${fmt(Math.max(...aggregates))}` : "-",
    ttft: pooled.ttft,
    itl: pooled.itl,
    itlP99Round: median(perRound.map((f) => f.itl[1]))
  }
}
