/**
 * One stage of a run hosted on its node (the run FSM's ProvisionStage command): the provision request sent through
 * the node's control link, and each report the agent streams back (loading, ready, fault, timings, stopped) turned
 * into the run's events and the caller's updates. A link that fails marks the node lost and faults the stage.
 */
import { availableParallelism } from "node:os"
import { Deferred, Effect, Stream } from "effect"
import type { SpeculativeProvision, TokenLoop } from "../../domain/controlRpc.js"
import type { TransportAddress } from "../../domain/frames.js"
import { EdgeId } from "../../domain/ids.js"
import type { ProvisionStage } from "../../domain/plan.js"
import { RunEvents, stageFaultMessage, StageFaultReasons } from "../../domain/runEvents.js"
import { ProvisionRequest, type StageReport } from "../../services/AgentLinks.js"
import { MIN_PIECE_ROWS } from "../../services/PromptPieces.js"
import { DEFAULT_MAX_DRAFT } from "../../services/Speculation.js"
import { stepsOf } from "../../services/StageStragglers.js"
import { noteDetail, offerConsequence, type RunContext, stageNode } from "./RunContext.js"

/** Where a stage sends what it computes: the next stage's data address, or the orchestrator's for the last stage. */
const outboundAddress = (context: RunContext, provision: ProvisionStage): TransportAddress =>
  provision.stageIndex === provision.stageCount - 1
    ? (context.warm.agents.dataAdvertise ?? context.warm.listener.address)
    : context.warm.dataAddressOf(stageNode(context, provision.stageIndex + 1))

/**
 * The token loop's part of a stage's provision (PipelineOptions.tokenLoop): stage 0 and the last stage of a run of
 * two stages or more, on an edge id after the plan's, with the plan's token ring; the last stage learns stage 0's
 * data address.
 */
const tokenLoopOf = (context: RunContext, provision: ProvisionStage): TokenLoop | undefined => {
  const { plan, warm } = context
  if (warm.options.tokenLoop === false || provision.stageCount < 2) return undefined
  const isFirst = provision.stageIndex === 0
  const isLast = provision.stageIndex === provision.stageCount - 1
  const tokenIn = plan.edges.find((e) => e.kind === "TokenIn")
  if ((!isFirst && !isLast) || tokenIn === undefined) return undefined
  return {
    edgeId: EdgeId.make(Math.max(...plan.edges.map((e) => e.edgeId)) + 1),
    ring: tokenIn.ring,
    maxTokens: plan.maxTokens,
    ...(isLast ? { stage0: warm.dataAddressOf(stageNode(context, 0)) } : {})
  }
}

/**
 * The threads a stage may take for its prompt (ProvisionRequest.prefillThreads): only for a run alone on the pipeline
 * whose prompt runs in one piece and replays nothing, so every other stage waits while this one computes it (a prompt
 * of 2 × MIN_PIECE_ROWS rows or more travels in pieces that overlap across stages, PromptPieces.ts). The number is
 * PipelineOptions.prefillThreads, else, with local agents, the cores the pipeline's stages have together on this
 * machine (at most its cores); else none (the stage's own threads).
 */
export const prefillThreadsOf = (run: {
  readonly alone: boolean
  readonly promptTokens: number
  readonly replayTail: number | undefined
  readonly stageCount: number
  /** The stage's threads (undefined: the agent's own). */
  readonly threads: number | undefined
  /** PipelineOptions.prefillThreads. */
  readonly option: number | undefined
  /** The agents are this process's children, on this machine. */
  readonly localAgents: boolean
  readonly cores: number
}): number | undefined => {
  if (!run.alone || run.promptTokens >= 2 * MIN_PIECE_ROWS || (run.replayTail ?? 0) > 0) return undefined
  const wanted =
    run.option ??
    (!run.localAgents || run.threads === undefined ? undefined : Math.min(run.cores, run.threads * run.stageCount))
  return wanted === undefined || wanted === run.threads ? undefined : wanted
}

/**
 * A run's speculative decoding (RunRequest.speculative) as its stages take it: off without a request, with a timeline
 * (its steps are a token's), for a run that starts beside others (a server's batch), and for a model whose stages cannot roll back (ModelLayout.rewind; `ngram`
 * and `draft` refused it before the run, checkGeneration). A `draft` run's draft model goes to stage 0 only.
 */
const speculativeOf = (context: RunContext, stageIndex: number): SpeculativeProvision | undefined => {
  const asked = context.request.speculative
  if (asked === undefined || asked.mode === "off" || context.request.timeline === true) return undefined
  // a run beside others (a server's batch): its rows are better spent on the other sequences' steps
  if (!context.alone) return undefined
  if (context.warm.layout.rewind === false) return undefined
  return {
    maxDraft: asked.maxDraft ?? DEFAULT_MAX_DRAFT,
    maxTokens: context.plan.maxTokens,
    ...(asked.predicted === undefined ? {} : { predicted: asked.predicted }),
    ...(asked.fixed === true ? { fixed: true } : {}),
    ...(asked.mode === "draft" && stageIndex === 0 && asked.draftModel !== undefined && asked.draftBlocks !== undefined
      ? { draft: { path: asked.draftModel, blocks: asked.draftBlocks } }
      : {})
  }
}

/** The provision request of a stage: where it sends, its threads, its prompt cache use and its part of the token loop. */
const provisionRequestOf = (context: RunContext, provision: ProvisionStage) => {
  const { contextLength, cacheUse, request, warm } = context
  const threads = request.threads ?? warm.options.threads
  const tokenLoop = tokenLoopOf(context, provision)
  const speculative = speculativeOf(context, provision.stageIndex)
  const prefillThreads = prefillThreadsOf({
    alone: context.alone,
    promptTokens: context.prompt.length,
    replayTail: provision.runtime.replayTail,
    stageCount: provision.stageCount,
    threads,
    option: warm.options.prefillThreads,
    localAgents: warm.agents.processRunning !== undefined,
    cores: availableParallelism()
  })
  return new ProvisionRequest({
    provision,
    outboundAddress: outboundAddress(context, provision),
    threads: threads ?? null,
    ...(prefillThreads === undefined ? {} : { prefillThreads }),
    contextLength,
    ...(cacheUse === undefined ? {} : { promptCache: cacheUse }),
    ...(request.arriving === undefined || request.arriving <= 0 ? {} : { arriving: request.arriving }),
    ...(request.settleWeights === true ? { settleWeights: true } : {}),
    ...(tokenLoop === undefined ? {} : { tokenLoop }),
    ...(request.timeline === true ? { timeline: true } : {}),
    ...(speculative === undefined ? {} : { speculative })
  })
}

/** A stage is ready: noted in the run's ledger, told the caller and the run. */
const onStageReady = (
  context: RunContext,
  provision: ProvisionStage,
  report: Extract<StageReport, { _tag: "StageReady" }>
) => {
  const { ledger, offer, runId, updates } = context
  const stageIndex = provision.stageIndex
  ledger.stageReady.set(stageIndex, {
    loadMillis: report.loadMillis,
    cachedWeights: report.cachedWeights,
    ...(report.backend === undefined ? {} : { backend: report.backend }),
    ...(report.device === undefined ? {} : { device: report.device })
  })
  ledger.stageCachedPositions.set(stageIndex, report.cachedPositions ?? 0)
  if (report.tokenLoop === true && stageIndex === provision.stageCount - 1) ledger.tokenLoop = true
  if (stageIndex === 0) Deferred.unsafeDone(ledger.firstStageReady, Effect.void)
  return Effect.zipRight(
    updates.offer({
      _tag: "StageReady",
      stageIndex,
      loadMillis: report.loadMillis,
      cachedWeights: report.cachedWeights
    }),
    offer(RunEvents.StageReady({ runId, stageIndex }))
  )
}

/** One report of the stage's agent, as the run's events and the caller's updates. */
const onStageReport = (
  context: RunContext,
  provision: ProvisionStage,
  stopReport: Effect.Effect<void>,
  report: StageReport
) => {
  const { ledger, offer, runId, updates, warm } = context
  const stageIndex = provision.stageIndex
  switch (report._tag) {
    case "StageLoading":
      return updates.offer({
        _tag: "StageLoading",
        stageIndex,
        loadedBytes: report.loadedBytes,
        totalBytes: report.totalBytes
      })
    case "StageReady":
      return onStageReady(context, provision, report)
    case "StageFault": {
      // The stage's words, for a reason the FSM may record first without any (StoppedUnexpectedly).
      const words = stageFaultMessage(report.reason)
      if (words !== undefined) noteDetail(context, `stage:${stageIndex}`, words)
      const event = RunEvents.StageFault({ runId, stageIndex, reason: report.reason })
      return report.reason._tag === "TransportFailed" ? offerConsequence(context, event) : offer(event)
    }
    case "StageStopped":
      ledger.stageStats.set(stageIndex, report.stats)
      return stopReport
    case "StageTimings":
      if (report.timeline !== undefined) noteTimeline(context, stageIndex, report)
      return Effect.forEach(
        ledger.stragglerDetector.add(stageIndex, warm.addressOf(provision.nodeId), stepsOf(report)),
        (straggler) => updates.offer({ _tag: "StageStraggler", straggler }),
        { discard: true }
      )
  }
}

/** A run with a timeline: the stage's reported steps into the ledger. */
const noteTimeline = (
  context: RunContext,
  stageIndex: number,
  report: Extract<StageReport, { _tag: "StageTimings" }>
) => {
  const stages = context.ledger.timeline?.stages
  if (stages === undefined) return
  const entry = stages.get(stageIndex) ?? { clock: report.clock, steps: [] }
  entry.clock = report.clock
  entry.steps.push(...(report.timeline ?? []))
  stages.set(stageIndex, entry)
}

/** Provisions a stage and follows its reports until its stream ends; the stage is stopped then, either way. */
export const hostStage = (context: RunContext, provision: ProvisionStage) => {
  const { offer, runId, warm } = context
  const stageIndex = provision.stageIndex
  let stopped = false
  const stopReport = Effect.suspend(() => {
    if (stopped) return Effect.void
    stopped = true
    return offer(RunEvents.StageStopped({ runId, stageIndex }))
  })
  const request = provisionRequestOf(context, provision)
  return warm
    .linkOf(provision.nodeId)
    .provision(request)
    .pipe(
      Stream.runForEach((report) => onStageReport(context, provision, stopReport, report)),
      Effect.catchAll((unavailable) =>
        Effect.gen(function* () {
          noteDetail(context, `stage:${stageIndex}`, unavailable.message)
          yield* warm.pool.markLost(provision.nodeId, unavailable.message)
          yield* offer(RunEvents.StageFault({ runId, stageIndex, reason: StageFaultReasons.WorkerCrashed() }))
        })
      ),
      // The stage is gone either way once its report stream has ended.
      Effect.zipRight(stopReport)
    )
}
