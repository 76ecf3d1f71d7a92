/**
 * The orchestrator's report, all pure: a run's fault in words, how a lifecycle turns into updates for the
 * caller, and the summary of a completed run.
 */
import type { EdgeFault, TransportAddress } from "../../domain/frames.js"
import {
  type LifecycleEvent,
  type RunFaultReason,
  type StageFaultReason,
  stageFaultMessage
} from "../../domain/runEvents.js"
import type { StageReport, StageStats } from "../../services/AgentLinks.js"
import type { StageDeviceSplit } from "../../domain/engine.js"
import type {
  RunSummary,
  RunUpdate,
  StageStragglers,
  StageSummary,
  Straggler,
  TokenLogprob
} from "../../services/Orchestrator.js"
import type { StageStepSummary } from "../../services/StageStragglers.js"

const describeStageReason = (reason: StageFaultReason): string => {
  switch (reason._tag) {
    case "WorkerCrashed":
      return reason.message === undefined
        ? "its agent crashed or became unreachable"
        : `its worker crashed: ${reason.message}`
    case "ProvisionFailed":
      return `provisioning failed: ${reason.message}`
    case "ModelLoadFailed":
      return `loading the model failed: ${reason.message}`
    case "ExecutionFailed":
      return `execution failed: ${reason.message}`
    case "TransportFailed":
      return `transport failed: ${reason.message}`
    case "ProtocolViolated":
      return `data protocol violated: ${reason.message}`
    case "StoppedUnexpectedly":
      return "it stopped unexpectedly"
  }
}

/** What the words about a fault may refer to: node addresses, the stage placement, the first detail seen per key. */
export interface FaultContext {
  readonly addressOf: (nodeId: number) => string
  readonly stageNode: (stageIndex: number) => number
  readonly detail: (key: string) => string | undefined
}

/** The run's fault in words, with whatever detail the orchestrator saw first for it. */
export const describeRunFault = (reason: RunFaultReason, context: FaultContext): string => {
  switch (reason._tag) {
    case "StageFault": {
      const node = context.addressOf(context.stageNode(reason.stageIndex))
      // Reasons with a message already carry the stage's words.
      const extra =
        stageFaultMessage(reason.reason) === undefined ? context.detail(`stage:${reason.stageIndex}`) : undefined
      return `stage ${reason.stageIndex} (agent ${node}) faulted: ${describeStageReason(reason.reason)}${extra === undefined ? "" : ` (${extra})`}`
    }
    case "EndpointFault": {
      const extra = context.detail(`endpoint:${reason.endpoint}`)
      return `the orchestrator's ${reason.endpoint} endpoint faulted${extra === undefined ? "" : `: ${extra}`}`
    }
    case "MembershipLost": {
      const extra = context.detail(`node:${reason.nodeId}`)
      return `lost node ${context.addressOf(reason.nodeId)}${extra === undefined ? "" : `: ${extra}`}`
    }
    case "ReadinessTimeout":
      return `not ready before the readiness deadline: ${[
        ...reason.missingStages.map((s) => `stage ${s} (agent ${context.addressOf(context.stageNode(s))})`),
        ...reason.missingEndpoints.map((e) => `${e} endpoint`)
      ].join(", ")}`
    case "TokenTimeout":
      return `no token came back for step ${reason.step} before the token deadline`
    case "EndpointsStoppedUnexpectedly":
      return "the token endpoints stopped unexpectedly"
  }
}

/** A transport fault in one line: its tag and fields. */
export const faultWords = (fault: EdgeFault): string => {
  const { _tag, ...rest } = fault
  const fields = Object.entries(rest).filter(([k]) => k !== "stack" && k !== "message")
  return `${_tag}${fields.length > 0 ? `(${fields.map(([k, v]) => `${k}=${String(v)}`).join(", ")})` : ""}`
}

/** The TornDown update for a run's RunTornDown event, given its terminal event. */
export const tornDownUpdate = (
  terminal: LifecycleEvent | undefined,
  event: Extract<LifecycleEvent, { _tag: "RunTornDown" }>
): RunUpdate => ({
  _tag: "TornDown",
  outcome:
    terminal?._tag === "RunCompleted" ? "Completed" : terminal?._tag === "RunFaulted" ? "Faulted" : "OperatorStopped",
  unconfirmedStages: event.unconfirmedStages,
  endpointsConfirmed: event.endpointsConfirmed
})

/** A Token update for a generated token (times in ms from performance.now()). */
export const tokenUpdate = (
  token: { readonly tokenId: number; readonly text: string; readonly step: number; readonly logprob?: TokenLogprob },
  at: { readonly received: number; readonly promptInjected: number; readonly injected: number },
  samplerDraws?: number
): RunUpdate => ({
  _tag: "Token",
  token: {
    ...token,
    timings: { sinceStartMillis: at.received - at.promptInjected, latencyMillis: at.received - at.injected }
  },
  ...(samplerDraws === undefined ? {} : { samplerDraws })
})

/** What a completed run saw, for its summary. */
export interface RunRecord {
  readonly runId: number
  readonly outcome: RunSummary["outcome"]
  readonly promptTokens: number
  readonly generated: number
  readonly text: string
  readonly requestStart: number
  readonly promptInjectedAt: number
  readonly firstTokenAt: number
  /** Send and receive times per step (step 0 is the prefill). */
  readonly injectedAt: ReadonlyMap<number, number>
  readonly receivedAt: ReadonlyMap<number, number>
  readonly stages: ReadonlyArray<{
    readonly stageIndex: number
    readonly address: string
    readonly layers: readonly [number, number]
    readonly dataAddress: TransportAddress
    readonly ready:
      | {
          readonly loadMillis: number
          readonly cachedWeights: boolean
          readonly backend?: string
          readonly device?: StageDeviceSplit
        }
      | undefined
    readonly stats: StageStats | undefined
  }>
  /** Per-stage decode steps and straggling stages, from the stages' timing reports (see services/StageStragglers.ts). */
  readonly stageSteps?: ReadonlyArray<StageStepSummary>
  readonly stageStragglers?: ReadonlyArray<StageStragglers>
}

const median = (values: ReadonlyArray<number>): number => {
  const sorted = [...values].sort((a, b) => a - b)
  const mid = sorted.length >> 1
  return sorted.length % 2 === 1 ? sorted[mid]! : (sorted[mid - 1]! + sorted[mid]!) / 2
}

/**
 * Decoded tokens slower than `factor` × the median of the `window` before them (and slower by at least
 * `minExcessMillis`): the straggling steps of a run, in order.
 */
export const findStragglers = (
  latencies: ReadonlyArray<{ readonly step: number; readonly latencyMillis: number }>,
  factor = 4,
  window = 16,
  minExcessMillis = 5
): ReadonlyArray<Straggler> => {
  const out: Array<Straggler> = []
  for (let i = 4; i < latencies.length; i++) {
    const recent = latencies.slice(Math.max(0, i - window), i).map((l) => l.latencyMillis)
    const m = median(recent)
    const { latencyMillis, step } = latencies[i]!
    if (latencyMillis > factor * m && latencyMillis - m >= minExcessMillis)
      out.push({ step, latencyMillis, medianMillis: m })
  }
  return out
}

/** The summary of a completed run: time to first token, decode rate, per-stage compute vs transfer. */
export const summarize = (record: RunRecord): RunSummary => {
  // Decode steps: 1..n-1 (step 0 is the prefill).
  const decodeLatencies: Array<number> = []
  const timed: Array<{ step: number; latencyMillis: number }> = []
  for (let step = 1; step < record.generated + 1; step++) {
    const sent = record.injectedAt.get(step)
    const got = record.receivedAt.get(step)
    if (sent !== undefined && got !== undefined) {
      decodeLatencies.push(got - sent)
      timed.push({ step, latencyMillis: got - sent })
    }
  }
  const decodeMillis = decodeLatencies.reduce((a, b) => a + b, 0)
  const decodeMillisPerToken = decodeLatencies.length > 0 ? decodeMillis / decodeLatencies.length : 0
  const stages: Array<StageSummary> = [...record.stages]
    .sort((a, b) => a.stageIndex - b.stageIndex)
    .map((s) => ({
      stageIndex: s.stageIndex,
      address: s.address,
      layers: s.layers,
      dataAddress: s.dataAddress,
      loadMillis: s.ready?.loadMillis ?? 0,
      cachedWeights: s.ready?.cachedWeights ?? false,
      ...(s.ready?.backend === undefined ? {} : { backend: s.ready.backend }),
      ...(s.ready?.device === undefined
        ? {}
        : {
            device: {
              ...s.ready.device,
              allocated: s.stats?.device ?? { weightBytes: 0, cacheBytes: 0, computeBytes: 0 }
            }
          }),
      prefillComputeMillis: s.stats?.prefillComputeMillis ?? 0,
      prefillWaitMillis: s.stats?.prefillWaitMillis ?? 0,
      firstSampleMillis: s.stats?.firstSampleMillis ?? 0,
      computeMillisPerToken:
        s.stats !== undefined && s.stats.decodeFrames > 0 ? s.stats.decodeComputeMillis / s.stats.decodeFrames : 0,
      microBatches: s.stats?.microBatches ?? 0,
      batchRows: s.stats?.batchRows ?? 0,
      maxBatchSequences: s.stats?.maxBatchSequences ?? 0,
      medianTokenMillis: record.stageSteps?.find((t) => t.stageIndex === s.stageIndex)?.medianMillis ?? 0,
      sendMillisPerToken: record.stageSteps?.find((t) => t.stageIndex === s.stageIndex)?.sendMillisPerStep ?? 0,
      computeBytes: s.stats?.computeBytes ?? 0,
      kvBytes: s.stats?.kvBytes ?? 0,
      residentBytes: s.stats?.residentBytes ?? 0,
      peakResidentBytes: s.stats?.peakResidentBytes ?? 0
    }))
  const computePerToken = stages.reduce((sum, s) => sum + s.computeMillisPerToken, 0)
  return {
    runId: record.runId,
    outcome: record.outcome,
    promptTokens: record.promptTokens,
    generatedTokens: record.generated,
    text: record.text,
    timeToFirstTokenMillis: record.firstTokenAt - record.requestStart,
    prefillMillis: record.firstTokenAt - record.promptInjectedAt,
    decodeTokensPerSecond: decodeMillis > 0 ? (decodeLatencies.length * 1000) / decodeMillis : 0,
    decodeMillisPerToken,
    stages,
    transferMillisPerToken: Math.max(0, decodeMillisPerToken - computePerToken),
    recoveries: [],
    stragglers: findStragglers(timed),
    stageStragglers: record.stageStragglers ?? []
  }
}
