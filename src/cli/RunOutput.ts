/**
 * What `swactor run` writes while a run goes: the text on stdout (after the prompt), progress and the summary on
 * stderr, or with --json one JSON document on stdout when the run ends (tokens, text, summary or fault), and weights
 * on their way as JSON lines on stderr (`{"event":"weights",…}`).
 */
import { Effect } from "effect"
import type { RunSummary, RunUpdate, TokenLogprob } from "../services/Orchestrator.js"
import { makeProgress, transferRate, type Transfers } from "./RunProgress.js"
import { renderSummary } from "./RunSummaryText.js"
import { type makePhaseClock, renderPhases, type StartupPhases } from "./StartupPhases.js"

/** What `--json` prints: one JSON document on stdout when the run ends (tokens, text, summary or fault). */
export interface JsonReport {
  ok: boolean
  text: string
  tokens: Array<{ readonly id: number; readonly text: string; readonly logprob?: TokenLogprob }>
  summary?: RunSummary
  phases?: StartupPhases
  fault?: { readonly _tag: string; readonly message: string; readonly reason?: unknown }
  stopped?: string
}

/**
 * Writes a run's updates as they come, records them in `json`, and marks the start-up phases on `clock`: tokens
 * (stdout, after the prompt), the summary and phases when it finishes, progress otherwise. `endLine` closes the
 * text's line when the run fails after some of it was written.
 */
export const makeRunPrinter = (
  options: { readonly json: boolean; readonly quiet: boolean },
  prompt: string,
  json: JsonReport,
  clock: ReturnType<typeof makePhaseClock>
) => {
  const quiet = options.quiet || options.json
  const progress = makeProgress(quiet)
  const transfers: Transfers = new Map()
  let wroteText = false
  const update = (update: RunUpdate): Effect.Effect<void> => {
    if (update._tag === "AgentsStarted") clock.mark("spawned")
    if (update._tag === "PoolReady") clock.mark("pooled")
    if (update._tag === "Token") {
      return Effect.sync(() => {
        clock.mark("ready") // a single-stage run: every stage was ready before its token
        clock.mark("firstToken")
        const last = json.tokens[json.tokens.length - 1]
        if (update.token.tokenId < 0 && last !== undefined) {
          // the run's end flushed an incomplete character (U+FFFD): text of the last token, not a token
          json.tokens[json.tokens.length - 1] = { ...last, text: last.text + update.token.text }
        } else {
          json.tokens.push({
            id: update.token.tokenId,
            text: update.token.text,
            ...(update.token.logprob === undefined ? {} : { logprob: update.token.logprob })
          })
        }
        json.text += update.token.text
        if (options.json) return
        if (!wroteText) process.stdout.write(prompt)
        wroteText = true
        process.stdout.write(update.token.text)
      })
    }
    if (update._tag === "Finished") {
      return Effect.sync(() => {
        json.ok = true
        json.summary = update.summary
        const phases = clock.phases()
        if (phases !== undefined) json.phases = phases
        if (options.json) return
        process.stdout.write("\n")
        if (!quiet) {
          process.stderr.write(
            `${renderSummary(update.summary)}\n${phases === undefined ? "" : `${renderPhases(phases)}\n`}`
          )
        }
      })
    }
    if (options.json && update._tag === "WeightsDelivery") {
      // with --json, weights on their way are events: one JSON line each on stderr
      const { bytesPerSecond, secondsLeft } = transferRate(update, transfers)
      process.stderr.write(
        `${JSON.stringify({
          event: "weights",
          stage: update.stageIndex,
          address: update.address,
          source: update.source === "Hub" ? "hub" : "orchestrator",
          bytes: update.sentBytes,
          totalBytes: update.totalBytes,
          bytesPerSecond: Math.round(bytesPerSecond),
          ...(secondsLeft === undefined ? {} : { secondsLeft: Math.round(secondsLeft * 10) / 10 })
        })}\n`
      )
    }
    return progress.update(update).pipe(
      Effect.tap(() => {
        if (update._tag === "StageReady" && progress.allReady()) clock.mark("ready")
      })
    )
  }
  return { update, endLine: Effect.sync(() => wroteText && process.stdout.write("\n")) }
}

/** With --json, the report as one line on stdout. */
export const printJsonReport = (enabled: boolean, json: JsonReport) =>
  Effect.sync(() => {
    if (enabled) process.stdout.write(`${JSON.stringify(json)}\n`)
  })

/** An operator's signal stopped the run: noted in the report and on stderr. */
export const reportOperatorStop = (json: JsonReport, signal: string) =>
  Effect.sync(() => {
    json.stopped = signal
    process.stderr.write(`\nswactor run: stopped by the operator (${signal}); every stage was stopped\n`)
  })

const describeError = (error: { readonly _tag: string }): string => {
  const message = "message" in error && typeof error.message === "string" && error.message !== "" ? error.message : ""
  return message !== "" ? `${error._tag}: ${message}` : `${error._tag}: ${JSON.stringify(error)}`
}

const describeFailure = (error: { readonly _tag: string; readonly message?: unknown }): string =>
  error._tag === "UsageError" ? String(error.message) : `failed: ${describeError(error)}`

/** The run failed (a usage error or a fault): noted in the report and on stderr. */
export const reportFailure = (json: JsonReport, error: { readonly _tag: string; readonly message?: unknown }) =>
  Effect.sync(() => {
    json.fault = {
      _tag: error._tag,
      message: "message" in error && typeof error.message === "string" ? error.message : describeError(error),
      ...("reason" in error ? { reason: error.reason } : {})
    }
    process.stderr.write(`swactor run${error._tag === "UsageError" ? ":" : ""} ${describeFailure(error)}\n`)
  })
