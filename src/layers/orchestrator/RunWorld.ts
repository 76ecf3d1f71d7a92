/**
 * The world of one run on a warm pipeline: plans it (its own RunId), starts its run FSM actor, executes
 * every command the actor emits (provision a stage through its agent's control link, open the token
 * endpoints, inject token objects, stop stages, tear the endpoints down), feeds back the events the world
 * produces, and turns the lifecycle into updates (RunReport). First fault sticky, teardown exactly once:
 * the FSM's job; this module only executes.
 *
 * `driveRun` is its steps in order: check the request, plan the attempt, start the actor, open the run's ledger
 * (RunContext), start the event sources (RunEventSources: commands executed by StageHosting and TokenEndpoints, lost
 * nodes, the operator's stop), then follow the lifecycle to the run's end (RunLifecycle).
 */
import { Deferred, Duration, Effect, ExecutionStrategy, Scope } from "effect"
import { type NodeId, RunId } from "../../domain/ids.js"
import type { LayerRange, RunPlan } from "../../domain/plan.js"
import { RunEvents } from "../../domain/runEvents.js"
import type { PromptCacheUse } from "../../domain/controlRpc.js"
import { DataPlane } from "../../services/AgentLinks.js"
import { InvalidRequest, type RunRequest } from "../../services/Orchestrator.js"
import { alignUp } from "../../domain/plan.js"
import { planRun } from "../../services/Planner.js"
import { RunActor } from "../../services/RunFsm.js"
import { makeStageStragglerDetector } from "../../services/StageStragglers.js"
import { keepArrivals } from "../transport/WireClock.js"
import { plannerInput, type SamplerResume, type WarmPipeline } from "./PipelineSetup.js"
import type { RunContext, RunLedger, UpdateSink } from "./RunContext.js"
import { executeCommands, forwardOperatorStop, watchRunNodes } from "./RunEventSources.js"
import { finishRun, followLifecycle } from "./RunLifecycle.js"

const randomRunId = () => RunId.make(1 + Math.floor(Math.random() * 0x7ffffffe))

/** The KV context a run's sessions allocate: prompt + generated tokens + one, in steps of 256, at most the model's. */
export const runContextLength = (maxSeqLen: number, promptTokens: number, maxTokens: number): number =>
  Math.min(maxSeqLen, alignUp(promptTokens + maxTokens + 1, 256))

/**
 * What a run asks of the agents' prompt cache (see RunRequest.promptCache): at most prompt length - 1 positions
 * adopted (the last prompt token is always prefilled, so the last stage has logits to sample).
 */
const promptCacheUse = (request: RunRequest, promptLength: number): PromptCacheUse | undefined => {
  const asked = request.promptCache
  if (asked === undefined) return undefined
  const length = Math.min(asked.adopt?.length ?? 0, promptLength - 1)
  return {
    adopt:
      asked.adopt !== undefined && Number.isSafeInteger(length) && length > 0
        ? { entry: asked.adopt.entry, length }
        : null,
    keep: asked.keep ?? null,
    promptLength
  }
}

/** One run of a generation that may be resumed: its placement and where its sampler starts drawing. */
export interface RunAttempt {
  /** Stage → node (default: the pipeline's). */
  readonly placement?: ReadonlyArray<{ readonly stageIndex: number; readonly nodeId: NodeId }>
  /** Tokens the generation produced before this run (the prompt ends with them): the first draw's position. */
  readonly startPosition?: number
  /** Those tokens and the random draws the sampler made for them: the new last stage's sampler resumes from them. */
  readonly resume?: SamplerResume
  /** Each stage's blocks (default: the pipeline's while the stage count holds, else an even split). */
  readonly layerRanges?: ReadonlyArray<LayerRange>
}

/** Step 1: the request's max tokens and prompt tokens, or InvalidRequest. */
const checkRunRequest = (warm: WarmPipeline, request: RunRequest) =>
  Effect.gen(function* () {
    const maxTokens = request.maxTokens ?? 128
    if (!Number.isSafeInteger(maxTokens) || maxTokens < 1) {
      return yield* new InvalidRequest({ message: `max tokens must be a positive whole number, got ${maxTokens}` })
    }
    const prompt = typeof request.prompt === "string" ? warm.vocabulary.tokenize(request.prompt) : request.prompt
    if (prompt.length === 0) return yield* new InvalidRequest({ message: "the prompt is empty" })
    return { maxTokens, prompt }
  })

/** Step 2: the attempt's plan under a new RunId, offered as the Planned update. */
const planAttempt = (
  warm: WarmPipeline,
  request: RunRequest,
  attempt: RunAttempt,
  maxTokens: number,
  updates: UpdateSink
) =>
  Effect.gen(function* () {
    const runId = randomRunId()
    const placement = attempt.placement ?? warm.placement
    // The pipeline's block ranges while its stage count holds (a spare took a stage); fewer stages after a
    // recovery: the planner splits the blocks again.
    const layerRanges =
      attempt.layerRanges !== undefined && attempt.layerRanges.length === placement.length
        ? attempt.layerRanges
        : placement.length === warm.placement.length
          ? warm.layerRanges
          : undefined
    const plan: RunPlan = yield* planRun(
      plannerInput(
        warm.facts,
        runId,
        warm.agents.nodes.map((n) => n.nodeId),
        placement,
        {
          maxTokens,
          sampling: request.sampling,
          ...(attempt.startPosition === undefined ? {} : { startPosition: attempt.startPosition }),
          ...(attempt.resume === undefined ? {} : { resume: attempt.resume })
        },
        layerRanges
      )
    )
    yield* updates.offer({
      _tag: "Planned",
      runId,
      stages: plan.stages.map((s) => ({
        stageIndex: s.stageIndex,
        address: warm.addressOf(s.nodeId),
        layers: [s.layerStart, s.layerEndExclusive] as const
      })),
      placement: warm.placementExplanation
    })
    return { runId, placement, plan }
  })

/** Step 3: the run's FSM actor, with the request's deadlines. */
const startRunActor = (
  warm: WarmPipeline,
  request: RunRequest,
  runId: RunId,
  plan: RunPlan,
  prompt: ReadonlyArray<number>,
  maxTokens: number
) =>
  RunActor.make({
    runId,
    maxTokens,
    prompt,
    eosTokenId: warm.facts.eosTokenId,
    readinessTimeout: request.readinessTimeout ?? warm.options.readinessTimeout ?? "120 seconds",
    tokenTimeout: request.tokenTimeout ?? "60 seconds",
    // a resumed prompt replays its produced tokens one decode step each (plan.replayTail): a token's time for each
    ...(plan.replayTail === undefined || plan.replayTail <= 0
      ? {}
      : { promptTimeout: Duration.times(Duration.decode(request.tokenTimeout ?? "60 seconds"), 1 + plan.replayTail) }),
    teardownTimeout: "10 seconds"
  }).pipe(Effect.mapError((e) => new InvalidRequest({ message: e.message })))

/** Step 4: the run's ledger, empty; its endpoint scope a child of the run's scope. */
const openLedger = (request: RunRequest, warm: WarmPipeline) =>
  Effect.gen(function* () {
    const stragglerDetector = makeStageStragglerDetector(request.stragglers ?? warm.options.stragglers)
    // a timeline: the token-out edge keeps each token's arrival
    if (request.timeline === true) keepArrivals()
    const firstStageReady = yield* Deferred.make<void>()
    const endpointScope = yield* Scope.fork(yield* Effect.scope, ExecutionStrategy.sequential)
    const ledger: RunLedger = {
      details: new Map(),
      stageStats: new Map(),
      stragglerDetector,
      stageReady: new Map(),
      stageCachedPositions: new Map(),
      cachedTokens: 0,
      firstStageReady,
      injectedAt: new Map(),
      receivedAt: new Map(),
      timeline: request.timeline === true ? { stages: new Map(), tokenArrivedAt: new Map() } : undefined,
      sampledExtras: new Map(),
      endpointScope,
      tornDown: false,
      tokenIn: undefined,
      tokenLoop: false
    }
    return ledger
  })

/**
 * Runs one request on `warm` to its end, offering updates as they happen. Completing `stopRequested` is an
 * operator stop. Succeeds after a completed run's Finished update; fails with RunFaulted (after the teardown).
 */
export const driveRun = (
  warm: WarmPipeline,
  request: RunRequest,
  updates: UpdateSink,
  stopRequested: Deferred.Deferred<void>,
  requestStart: number = performance.now(),
  attempt: RunAttempt = {}
) =>
  Effect.gen(function* () {
    const dataPlane = yield* DataPlane
    const { maxTokens, prompt } = yield* checkRunRequest(warm, request)
    const { placement, plan, runId } = yield* planAttempt(warm, request, attempt, maxTokens, updates)
    if (request.dryRun === true) return

    // the runs on the pipeline before this one
    const others = yield* Effect.acquireRelease(
      Effect.sync(() => warm.activeRuns.count++),
      () => Effect.sync(() => warm.activeRuns.count--)
    )
    const actor = yield* startRunActor(warm, request, runId, plan, prompt, maxTokens)
    const commands = yield* actor.subscribeCommands
    const lifecycle = yield* actor.subscribeLifecycle
    const context: RunContext = {
      runId,
      warm,
      request,
      plan,
      prompt,
      alone: others === 0 && !(request.arriving !== undefined && request.arriving > 0),
      contextLength: runContextLength(warm.facts.maxSeqLen, prompt.length, maxTokens),
      cacheUse: promptCacheUse(request, prompt.length),
      dataPlane,
      updates,
      offer: (event) => actor.offer(event),
      ledger: yield* openLedger(request, warm)
    }

    yield* executeCommands(context, commands, yield* Effect.scope)
    yield* watchRunNodes(context)
    yield* forwardOperatorStop(context, stopRequested)

    yield* context.offer(RunEvents.PoolReady({ nodes: [...new Set(placement.map((p) => p.nodeId))] }))
    yield* context.offer(RunEvents.PlanAvailable({ plan }))
    const outcome = yield* followLifecycle(context, lifecycle, requestStart)
    return yield* finishRun(context, outcome, requestStart)
  }).pipe(Effect.scoped)
