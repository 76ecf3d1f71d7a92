/**
 * The stage host: a node agent's business logic, hosting stages of any number of runs on one machine (NodeAgent.ts
 * puts it behind a data listener and the control RPC).
 *
 * - Weights are shared through a model cache keyed by file + block range (+ first/last role): a
 *   second run on the same range does not reload; an idle range is released after a while.
 * - Every hosted stage has its own KV cache (an engine session), its own inbound edge registered
 *   on the agent's data listener and its own outbound connection.
 * - A stage reports StageLoading → StageReady, then StageFault (with its StageFaultReason) or, once
 *   stopped, StageStopped with its counters; its report stream ends there.
 */
import { isRemoteModel } from "../../domain/modelName.js"
import * as Os from "node:os"
import { Deferred, Effect, Exit, Mailbox, RcMap, Scope, Stream } from "effect"
import { describeFault, type TransportAddress } from "../../domain/frames.js"
import type { RunId } from "../../domain/ids.js"
import { StageFaultReasons } from "../../domain/runEvents.js"
import { threadsProblem } from "../../services/RequestChecks.js"
import { hostByteOrderProblem } from "../../domain/wireFormats.js"
import {
  type DataListener,
  DataPlane,
  type EdgeRef,
  isNotYetRegistered,
  notYetRegisteredRetry,
  type ProvisionRequest,
  type StageHost,
  type StageReport,
  StageStats
} from "../../services/AgentLinks.js"
import { NodeCapacity } from "../../services/Membership.js"
import { StageExecutor, type StageExecutorService } from "../../services/StageExecutor.js"
import { makeStageBatcher, type StageBatcher } from "./StageBatcher.js"
import { makePromptCacheHost } from "./PromptCacheHost.js"
import { heldSessionBytes } from "../engine/KvCache.js"
import { freshStats, StageFailure, transportFailed } from "./StageStep.js"
import { type CachedModel, type HostParts, modelCacheKey, runStage } from "./HostedStage.js"

import type { StageHostOptions } from "./StageHostOptions.js"
import type { Backend } from "../../domain/engine.js"
export type { StageHostOptions }

// The contract lives in services (AgentControlRpc serves it); re-exported for existing imports.
export type { StageHost }

const cacheKey = (request: ProvisionRequest, backend: string, path: string) => {
  const p = request.provision
  return modelCacheKey(
    path,
    p.layerStart,
    p.layerEndExclusive,
    p.stageIndex === 0,
    p.stageIndex === p.stageCount - 1,
    backend
  )
}

/**
 * Why this agent refuses `request` whatever the attempt, in one line: a big-endian host (its activations would be
 * misread by little-endian peers; `options.endianness`, default `os.endianness()`), or threads the engine refuses.
 */
const provisionRefusal = (request: ProvisionRequest, options: StageHostOptions): string | undefined =>
  hostByteOrderProblem(options.endianness ?? Os.endianness())?.message ??
  threadsProblem(request.threads ?? options.threads) ??
  (request.prefillThreads === undefined ? undefined : threadsProblem(request.prefillThreads))

/** The batcher of each loaded weights (for its step costs in the capacity report), by model cache key. */
type Batchers = Map<string, { readonly layers: readonly [number, number]; readonly batcher: StageBatcher }>

/** The weights of a model cache key, and one batcher that runs every hosted stage on them (any run) as micro-batches. */
const loadCachedModel = (
  executor: StageExecutorService,
  options: StageHostOptions,
  progressSinks: HostParts["progressSinks"],
  batchers: Batchers,
  key: string
) => {
  const [path, layerStart, layerEndExclusive, isFirst, isLast, backend] = JSON.parse(key) as [
    string,
    number,
    number,
    boolean,
    boolean,
    Backend
  ]
  // the weights, and one batcher that runs every hosted stage on them (any run) as micro-batches
  return Effect.gen(function* () {
    options.log?.(`blocks [${layerStart}, ${layerEndExclusive}) load from ${path}`)
    const loaded = yield* executor.load({ path, layerStart, layerEndExclusive, isFirst, isLast, backend }, (progress) =>
      progressSinks.get(key)?.(progress.loadedBytes, progress.totalBytes)
    )
    const probeRows = options.stepProbeRows ?? 0
    const batcher = yield* makeStageBatcher({
      ...options.batch,
      ...(probeRows > 0
        ? {
            stepProbe: {
              maxRows: probeRows,
              session: executor.session(loaded, { contextLength: 16, threads: options.threads, scratch: true })
            }
          }
        : {})
    }).pipe(Effect.provideService(StageExecutor, executor))
    batchers.set(key, { layers: [layerStart, layerEndExclusive], batcher })
    yield* Effect.addFinalizer(() => Effect.sync(() => batchers.delete(key)))
    return { loaded, batcher } satisfies CachedModel
  })
}

/**
 * A stage's sender on `edge` at `address` (its next stage's, the orchestrator's, or stage 0's for the token loop).
 * The consumer may not have registered the edge yet (it may still be loading): retried until the connect deadline.
 * `peer` names the other end in the stage's fault.
 */
const edgeConnector =
  (dataPlane: DataPlane["Type"], options: StageHostOptions): HostParts["connectEdge"] =>
  (address, edge, peer) =>
    dataPlane.connect(address, edge, options.token).pipe(
      Effect.retry({ schedule: notYetRegisteredRetry, while: isNotYetRegistered }),
      Effect.timeoutFail({
        duration: options.connectTimeout ?? "10 minutes",
        onTimeout: () => transportFailed(`timed out connecting to ${peer}`)
      }),
      Effect.mapError((fault) =>
        fault instanceof StageFailure ? fault : transportFailed(`cannot reach ${peer}: ${describeFault(fault)}`)
      )
    )

/** What the host's provision, stop and capacity share. */
interface HostState {
  readonly host: HostParts
  readonly batchers: Batchers
  /** The stop signal of each hosted stage, by stageKey. */
  readonly active: Map<string, Deferred.Deferred<void>>
  /**
   * Stops that came before their stage's Provision (the orchestrator's commands run concurrently, so a run torn
   * down while it provisions may send Stop first): that Provision then stops at once instead of running until the
   * orchestrator's teardown deadline. Kept 5 minutes, at most 4096.
   */
  readonly stoppedEarly: Map<string, number>
}

const stageKey = (runId: number, stageIndex: number) => `${runId}/${stageIndex}`

const STOPPED_EARLY_MS = 5 * 60_000

const rememberStop = (stoppedEarly: HostState["stoppedEarly"], key: string) => {
  const now = performance.now()
  for (const [k, at] of stoppedEarly)
    if (now - at > STOPPED_EARLY_MS || stoppedEarly.size >= 4096) stoppedEarly.delete(k)
  stoppedEarly.set(key, now)
}

/**
 * The one report of a Provision that does not start its stage, if so: stopped before it started, already hosted
 * here, or a request this agent cannot honour whatever the attempt.
 */
const reportInsteadOfStart = (state: HostState, request: ProvisionRequest, key: string): StageReport | undefined => {
  const p = request.provision
  if (state.stoppedEarly.delete(key)) {
    // stopped before it started: nothing loaded, nothing to report but the stop
    return { _tag: "StageStopped", runId: p.runId, stageIndex: p.stageIndex, stats: new StageStats(freshStats()) }
  }
  if (state.active.has(key)) {
    return {
      _tag: "StageFault",
      runId: p.runId,
      stageIndex: p.stageIndex,
      reason: StageFaultReasons.ProvisionFailed({
        message: `stage ${p.stageIndex} of run ${p.runId} is already hosted here`
      })
    }
  }
  // A request this agent cannot honour whatever the attempt (a big-endian host, threads the engine refuses):
  // refused before anything loads, as ProvisionFailed, which no recovery retries (not a worker crash).
  const refused = provisionRefusal(request, state.host.options)
  if (refused !== undefined) {
    return {
      _tag: "StageFault",
      runId: p.runId,
      stageIndex: p.stageIndex,
      reason: StageFaultReasons.ProvisionFailed({ message: `stage ${p.stageIndex} refused: ${refused}` })
    }
  }
  return undefined
}

/** The fault of a stage whose blocks this node has no file for. */
const notDelivered = (p: ProvisionRequest["provision"]): StageReport => ({
  _tag: "StageFault",
  runId: p.runId,
  stageIndex: p.stageIndex,
  reason: StageFaultReasons.ModelLoadFailed({
    message:
      `blocks [${p.layerStart}, ${p.layerEndExclusive}) of ${p.ggufSource.path} were not delivered ` +
      (isRemoteModel(p.ggufSource.path)
        ? "to this node, nor fetched by it from the hub"
        : "to this node, and it does not read model paths (--slices-only)")
  })
})

/** A report stream of just `report`. */
const onlyReport = (reports: Mailbox.Mailbox<StageReport>, report: StageReport) =>
  Effect.gen(function* () {
    yield* reports.offer(report)
    yield* reports.end
    return Mailbox.toStream(reports)
  })

/** Starts the stage in the host's scope; closing the report stream (the orchestrator went away) stops it. */
const startStage = (
  state: HostState,
  request: ProvisionRequest,
  path: string,
  key: string,
  reports: Mailbox.Mailbox<StageReport>
) =>
  Effect.gen(function* () {
    const { host, active } = state
    const stop = yield* Deferred.make<void>()
    active.set(key, stop)
    // The stage lives in the host's scope; closing the report stream (the orchestrator went away) stops it.
    const hold = { scope: yield* Scope.make(), kept: false }
    yield* runStage(host, {
      request,
      path,
      key: cacheKey(request, host.options.backend, path),
      reports,
      stop,
      hold
    }).pipe(
      Effect.ensuring(Effect.suspend(() => (hold.kept ? Effect.void : Scope.close(hold.scope, Exit.void)))),
      Effect.ensuring(Effect.sync(() => active.delete(key))),
      Effect.ensuring(reports.end),
      Effect.forkIn(host.hostScope)
    )
    yield* Effect.addFinalizer(() => Deferred.succeed(stop, undefined))
    return Mailbox.toStream(reports)
  })

const provisionStage = (state: HostState, request: ProvisionRequest): Stream.Stream<StageReport> =>
  Stream.unwrapScoped(
    Effect.gen(function* () {
      const p = request.provision
      const { options } = state.host
      const reports = yield* Mailbox.make<StageReport>()
      const key = stageKey(p.runId, p.stageIndex)
      const instead = reportInsteadOfStart(state, request, key)
      if (instead !== undefined) return yield* onlyReport(reports, instead)
      // The file to load: the model path, or the slice delivered for it (weight delivery).
      const path =
        options.weights === undefined
          ? p.ggufSource.path
          : options.weights.resolve(p.ggufSource.path, p.layerStart, p.layerEndExclusive)
      if (path === undefined) return yield* onlyReport(reports, notDelivered(p))
      return yield* startStage(state, request, path, key, reports)
    })
  )

const stopStage = (state: HostState, runId: RunId, stageIndex: number) =>
  Effect.suspend(() => {
    const key = stageKey(runId, stageIndex)
    const deferred = state.active.get(key)
    if (deferred === undefined) return Effect.sync(() => rememberStop(state.stoppedEarly, key))
    return Deferred.succeed(deferred, undefined).pipe(Effect.asVoid)
  })

/** Each loaded weights' step costs and decode micro-batch choice, for the capacity report. */
const stepCostsOf = (batchers: Batchers) =>
  [...batchers.values()].map(({ batcher, layers }) => {
    const report = batcher.stepCosts()
    return {
      layers,
      costs: report.costs,
      probe: report.probe,
      ...(report.choice === undefined
        ? {}
        : {
            choice: {
              decoders: report.choice.decoders,
              stages: report.choice.stages,
              rows: report.choice.rows,
              defaultRows: report.choice.defaultRows
            }
          })
    }
  })

const capacityOf = (state: HostState) =>
  Effect.sync(() => {
    const { options } = state.host
    return NodeCapacity.make({
      freeMemoryBytes: Math.min(Os.freemem(), options.memoryLimitBytes ?? Number.POSITIVE_INFINITY),
      totalMemoryBytes: Os.totalmem(),
      threads: options.threads,
      backend: options.backend,
      hostname: Os.hostname(),
      activeStages: state.active.size,
      ...(options.devices === undefined ? {} : { devices: options.devices() }),
      openSessions: heldSessionBytes(),
      stepCosts: stepCostsOf(state.batchers),
      ...(options.speedBytesPerSecond !== undefined
        ? { speedBytesPerSecond: options.speedBytesPerSecond, speedSource: options.speedSource ?? "declared" }
        : options.laterSpeed?.current !== undefined
          ? { speedBytesPerSecond: options.laterSpeed.current, speedSource: "measured" as const }
          : {}),
      ...(options.memoryLimitBytes === undefined ? {} : { memoryLimitBytes: options.memoryLimitBytes })
    })
  })

export const makeStageHost = (
  listener: DataListener,
  options: StageHostOptions
): Effect.Effect<StageHost, never, Scope.Scope | StageExecutor | DataPlane> =>
  Effect.gen(function* () {
    const executor = yield* StageExecutor
    const dataPlane = yield* DataPlane
    const hostScope = yield* Effect.scope
    const progressSinks: HostParts["progressSinks"] = new Map()
    const batchers: Batchers = new Map()
    const models = yield* RcMap.make({
      lookup: (key: string) => loadCachedModel(executor, options, progressSinks, batchers, key),
      idleTimeToLive: options.modelIdleTimeToLive ?? "10 minutes"
    })
    // finished stages' sessions kept for later runs' prompts (after `models`: freed before the weights they are on)
    const promptCache = yield* makePromptCacheHost()
    const host: HostParts = {
      options,
      executor,
      listener,
      hostScope,
      progressSinks,
      models,
      promptCache,
      connectEdge: edgeConnector(dataPlane, options)
    }
    const state: HostState = { host, batchers, active: new Map(), stoppedEarly: new Map() }
    return {
      provision: (request) => provisionStage(state, request),
      stop: (runId, stageIndex) => stopStage(state, runId, stageIndex),
      capacity: capacityOf(state),
      cachedRanges: RcMap.keys(models),
      dropCached: promptCache.drop
    } satisfies StageHost
  })
