/**
 * What one run's steps share (RunWorld): the run's inputs (its plan, request, prompt, the warm pipeline), where its
 * events and updates go, and the ledger of what it saw and holds while it goes (stage reports, token times, the
 * token endpoints), read at its end for the summary and for fault messages.
 */
import { type Deferred, Effect, type Scope } from "effect"
import type { EdgeFault } from "../../domain/frames.js"
import type { PromptCacheUse, StepTimeline } from "../../domain/controlRpc.js"
import type { RunId } from "../../domain/ids.js"
import type { RunPlan } from "../../domain/plan.js"
import type { RunEvent } from "../../domain/runEvents.js"
import type { DataPlaneService, EdgeSender, StageStats } from "../../services/AgentLinks.js"
import type { StageDeviceSplit } from "../../domain/engine.js"
import type { RunRequest, RunUpdate, TokenLogprob } from "../../services/Orchestrator.js"
import type { StageStragglerDetector } from "../../services/StageStragglers.js"
import type { WarmPipeline } from "./PipelineSetup.js"

/** Where a run's updates go (a mailbox, or a recovering generation's filter). */
export interface UpdateSink {
  readonly offer: (update: RunUpdate) => Effect.Effect<unknown>
}

/** What the run saw and holds while it goes. */
export interface RunLedger {
  /** The first words seen per key (`stage:N`, `endpoint:TokenIn`, `node:N`), for fault messages. */
  readonly details: Map<string, string>
  readonly stageStats: Map<number, StageStats>
  readonly stragglerDetector: StageStragglerDetector
  readonly stageReady: Map<
    number,
    { loadMillis: number; cachedWeights: boolean; backend?: string; device?: StageDeviceSplit }
  >
  /** Prompt cache: what each stage took over of the adopted entry; the prompt starts after the fewest (cachedTokens). */
  readonly stageCachedPositions: Map<number, number>
  cachedTokens: number
  /** Stage 0 registers its inbound (token-in) edge before it reports ready: the orchestrator connects after that. */
  readonly firstStageReady: Deferred.Deferred<void>
  readonly injectedAt: Map<number, number>
  readonly receivedAt: Map<number, number>
  /** A run with a timeline (RunRequest.timeline): each stage's reported steps and clock, each token's arrival. */
  readonly timeline:
    | {
        readonly stages: Map<number, { clock: string | undefined; readonly steps: Array<StepTimeline> }>
        readonly tokenArrivedAt: Map<number, number>
      }
    | undefined
  /** What the last stage sent beside each token: its log-probs (when asked) and its sampler's draws so far. */
  readonly sampledExtras: Map<number, { readonly logprob?: TokenLogprob; readonly draws?: number }>
  /** The token endpoints live in this scope; closed once, by the teardown command. */
  readonly endpointScope: Scope.CloseableScope
  tornDown: boolean
  tokenIn: EdgeSender | undefined
  /** The last stage said its token loop to stage 0 is connected: decode steps' tokens are not sent through token-in. */
  tokenLoop: boolean
}

/** One run's inputs, sinks and ledger: what each of its steps is given. */
export interface RunContext {
  readonly runId: RunId
  readonly warm: WarmPipeline
  readonly request: RunRequest
  readonly plan: RunPlan
  readonly prompt: ReadonlyArray<number>
  /** No other run was on the pipeline when this one started, and none was arriving (RunRequest.arriving). */
  readonly alone: boolean
  readonly contextLength: number
  readonly cacheUse: PromptCacheUse | undefined
  readonly dataPlane: DataPlaneService
  readonly updates: UpdateSink
  /** An event for the run's actor. */
  readonly offer: (event: RunEvent) => Effect.Effect<void>
  readonly ledger: RunLedger
}

const consequenceGrace = "300 millis"

/**
 * A broken connection is usually the echo of a fault elsewhere (the peer crashed or stopped): offered after a short
 * grace period, so the run's first reason is the root cause when that arrives in time.
 */
export const offerConsequence = (context: RunContext, event: RunEvent) =>
  Effect.sleep(consequenceGrace).pipe(Effect.zipRight(context.offer(event)))

/** Whether an edge fault is such an echo. */
export const isEcho = (fault: EdgeFault) =>
  fault._tag === "PeerClosed" || fault._tag === "PeerFaulted" || fault._tag === "EdgeClosed"

/** Records the first words seen for `key`. */
export const noteDetail = (context: RunContext, key: string, text: string) => {
  const details = context.ledger.details
  if (!details.has(key)) details.set(key, text)
}

/** The node hosting a stage of the plan (-1: none). */
export const stageNode = (context: RunContext, stageIndex: number) =>
  context.plan.stages.find((s) => s.stageIndex === stageIndex)?.nodeId ?? -1
