/**
 * A run's lifecycle, as its actor publishes it, turned into the caller's updates: each accepted token decoded into
 * text with its timings, the decoder's rest at the end, the teardown; then the run's end: RunFaulted with the fault
 * in words, or the Finished update with the summary of a completed run.
 */
import { Effect, Queue } from "effect"
import type { LifecycleEvent } from "../../domain/runEvents.js"
import { RunFaulted } from "../../services/Orchestrator.js"
import { buildTimeline } from "../../services/Timeline.js"
import { clockId, monoOf } from "../transport/WireClock.js"
import { type RunContext, stageNode } from "./RunContext.js"
import { describeRunFault, summarize, tokenUpdate, tornDownUpdate } from "./RunReport.js"

/** What the lifecycle left once the run was torn down. */
interface LifecycleOutcome {
  /** The run's end (completed, faulted, operator stopped); none when torn down without one. */
  readonly terminal: LifecycleEvent | undefined
  readonly generated: number
  readonly text: string
  readonly firstTokenAt: number | undefined
}

/** When the prompt went in (the request's start if it never did). */
const promptInjectedAt = (context: RunContext, requestStart: number) => context.ledger.injectedAt.get(0) ?? requestStart

/** A run with a timeline: its decode steps' timeline from what the stages reported (services/Timeline.ts). */
const timelineOf = (context: RunContext) => {
  const { ledger, plan } = context
  const recorded = ledger.timeline
  if (recorded === undefined) return undefined
  return buildTimeline({
    stages: plan.stages.map((s) => ({
      stageIndex: s.stageIndex,
      clock: recorded.stages.get(s.stageIndex)?.clock,
      steps: recorded.stages.get(s.stageIndex)?.steps ?? []
    })),
    orchestrator: {
      clock: clockId(),
      tokenArrivedAt: recorded.tokenArrivedAt,
      injectedAt: new Map([...ledger.injectedAt].map(([step, at]) => [step, monoOf(at)]))
    },
    tokenLoop: ledger.tokenLoop
  })
}

/** Offers the updates of the lifecycle as it goes, until the run is torn down. */
export const followLifecycle = (
  context: RunContext,
  lifecycle: Queue.Dequeue<LifecycleEvent>,
  requestStart: number
): Effect.Effect<LifecycleOutcome> =>
  Effect.gen(function* () {
    const { ledger, updates } = context
    const decoder = context.warm.vocabulary.decoder(context.prompt)
    const generated: Array<number> = []
    let text = ""
    let firstTokenAt: number | undefined
    let terminal: LifecycleEvent | undefined
    while (true) {
      const event = yield* Queue.take(lifecycle)
      if (event._tag === "TokenAccepted") {
        const now = ledger.receivedAt.get(event.step) ?? performance.now()
        firstTokenAt ??= now
        generated.push(event.tokenId)
        const piece = decoder.push(event.tokenId)
        text += piece
        const extras = ledger.sampledExtras.get(event.step)
        ledger.sampledExtras.delete(event.step)
        yield* updates.offer(
          tokenUpdate(
            {
              tokenId: event.tokenId,
              text: piece,
              step: event.step,
              ...(extras?.logprob === undefined ? {} : { logprob: extras.logprob })
            },
            {
              received: now,
              promptInjected: promptInjectedAt(context, requestStart),
              injected: ledger.injectedAt.get(event.step) ?? now
            },
            extras?.draws
          )
        )
      } else if (event._tag === "RunCompleted" || event._tag === "RunFaulted" || event._tag === "RunOperatorStopped") {
        terminal = event
        const rest = decoder.flush()
        if (rest !== "") {
          text += rest
          yield* updates.offer({
            _tag: "Token",
            token: {
              tokenId: -1,
              text: rest,
              step: generated.length,
              timings: { sinceStartMillis: 0, latencyMillis: 0 }
            }
          })
        }
      } else if (event._tag === "RunTornDown") {
        yield* updates.offer(tornDownUpdate(terminal, event))
        break
      }
    }
    return { terminal, generated: generated.length, text, firstTokenAt }
  })

/**
 * The run's end: fails with RunFaulted (the fault in words, with the first details seen), or offers the Finished
 * update with the summary of a completed run; nothing for an operator stop.
 */
export const finishRun = (context: RunContext, outcome: LifecycleOutcome, requestStart: number) =>
  Effect.gen(function* () {
    const { cacheUse, ledger, plan, runId, warm } = context
    const { terminal } = outcome
    if (terminal?._tag === "RunFaulted") {
      return yield* new RunFaulted({
        runId,
        reason: terminal.reason,
        message: describeRunFault(terminal.reason, {
          addressOf: warm.addressOf,
          stageNode: (stageIndex) => stageNode(context, stageIndex),
          detail: (key) => ledger.details.get(key)
        })
      })
    }
    if (terminal?._tag !== "RunCompleted") return

    const end = performance.now()
    const summary = summarize({
      runId,
      outcome: terminal.reason,
      promptTokens: context.prompt.length,
      generated: outcome.generated,
      text: outcome.text,
      requestStart,
      promptInjectedAt: promptInjectedAt(context, requestStart),
      firstTokenAt: outcome.firstTokenAt ?? end,
      injectedAt: ledger.injectedAt,
      receivedAt: ledger.receivedAt,
      stages: plan.stages.map((s) => ({
        stageIndex: s.stageIndex,
        address: warm.addressOf(s.nodeId),
        layers: [s.layerStart, s.layerEndExclusive] as const,
        dataAddress: warm.dataAddressOf(s.nodeId),
        ready: ledger.stageReady.get(s.stageIndex),
        stats: ledger.stageStats.get(s.stageIndex)
      })),
      stageSteps: ledger.stragglerDetector.stages(),
      stageStragglers: ledger.stragglerDetector.stragglers()
    })
    const timeline = timelineOf(context)
    const lastStats = ledger.stageStats.get(plan.stages.length - 1)
    const speculative =
      context.request.speculative === undefined || lastStats === undefined
        ? undefined
        : { steps: lastStats.verifySteps, drafted: lastStats.draftedTokens, accepted: lastStats.acceptedTokens }
    const extras = {
      ...(timeline === undefined ? {} : { timeline }),
      ...(speculative === undefined ? {} : { speculative })
    }
    yield* context.updates.offer({
      _tag: "Finished",
      summary:
        cacheUse === undefined
          ? { ...summary, ...extras }
          : {
              ...summary,
              ...extras,
              promptCache: {
                cachedTokens: ledger.cachedTokens,
                keptTokens:
                  cacheUse.keep === null
                    ? 0
                    : Math.min(...plan.stages.map((s) => ledger.stageStats.get(s.stageIndex)?.keptPositions ?? 0))
              }
            }
    })
  })
