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
import { StageExecutor } from "../../services/StageExecutor.js"
import { makeStageBatcher, type StageBatcher } from "./StageBatcher.js"
import { makePromptCacheHost } from "./PromptCacheHost.js"
import { heldSessionBytes } from "../engine/KvCache.js"
import { freshStats, StageFailure, transportFailed } from "./StageStep.js"
import { type CachedModel, type HostParts, runStage } from "./HostedStage.js"

import type { StageHostOptions } from "./StageHostOptions.js"
import type { Backend } from "../../domain/engine.js"
export type { StageHostOptions }

// The contract lives in services (AgentControlRpc serves it); re-exported for existing imports.
export type { StageHost }

const cacheKey = (request: ProvisionRequest, backend: string, path: string) => {
  const p = request.provision
  return JSON.stringify([
    path,
    p.layerStart,
    p.layerEndExclusive,
    p.stageIndex === 0,
    p.stageIndex === p.stageCount - 1,
    backend
  ])
}

/**
 * Why this agent refuses `request` whatever the attempt, in one line: a big-endian host (its activations would be
 * misread by little-endian peers; `options.endianness`, default `os.endianness()`), or threads the engine refuses.
 */
const provisionRefusal = (request: ProvisionRequest, options: StageHostOptions): string | undefined =>
  hostByteOrderProblem(options.endianness ?? Os.endianness())?.message ??
  threadsProblem(request.threads ?? options.threads) ??
  (request.prefillThreads === undefined ? undefined : threadsProblem(request.prefillThreads))

export const makeStageHost = (
  listener: DataListener,
  options: StageHostOptions
): Effect.Effect<StageHost, never, Scope.Scope | StageExecutor | DataPlane> =>
  Effect.gen(function* () {
    const executor = yield* StageExecutor
    const dataPlane = yield* DataPlane
    const hostScope = yield* Effect.scope
    const progressSinks = new Map<string, (loaded: number, total: number) => void>()
    /** The batcher of each loaded weights (for its step costs in the capacity report). */
    const batchers = new Map<string, { readonly layers: readonly [number, number]; readonly batcher: StageBatcher }>()
    const models = yield* RcMap.make({
      lookup: (key: string) => {
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
          const loaded = yield* executor.load(
            { path, layerStart, layerEndExclusive, isFirst, isLast, backend },
            (progress) => progressSinks.get(key)?.(progress.loadedBytes, progress.totalBytes)
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
      },
      idleTimeToLive: options.modelIdleTimeToLive ?? "10 minutes"
    })
    // finished stages' sessions kept for later runs' prompts (after `models`: freed before the weights they are on)
    const promptCache = yield* makePromptCacheHost()
    const active = new Map<string, Deferred.Deferred<void>>()
    const stageKey = (runId: number, stageIndex: number) => `${runId}/${stageIndex}`
    /**
     * Stops that came before their stage's Provision (the orchestrator's commands run concurrently, so a run torn
     * down while it provisions may send Stop first): that Provision then stops at once instead of running until the
     * orchestrator's teardown deadline. Kept 5 minutes, at most 4096.
     */
    const stoppedEarly = new Map<string, number>()
    const STOPPED_EARLY_MS = 5 * 60_000
    const rememberStop = (key: string) => {
      const now = performance.now()
      for (const [k, at] of stoppedEarly)
        if (now - at > STOPPED_EARLY_MS || stoppedEarly.size >= 4096) stoppedEarly.delete(k)
      stoppedEarly.set(key, now)
    }

    /**
     * A stage's sender on `edge` at `address` (its next stage's, the orchestrator's, or stage 0's for the token loop).
     * The consumer may not have registered the edge yet (it may still be loading): retried until the connect deadline.
     * `peer` names the other end in the stage's fault.
     */
    const connectEdge = (address: TransportAddress, edge: EdgeRef, peer: string) =>
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

    const host: HostParts = {
      options,
      executor,
      listener,
      hostScope,
      progressSinks,
      models,
      promptCache,
      connectEdge
    }

    const provision = (request: ProvisionRequest): Stream.Stream<StageReport> =>
      Stream.unwrapScoped(
        Effect.gen(function* () {
          const p = request.provision
          const reports = yield* Mailbox.make<StageReport>()
          const key = stageKey(p.runId, p.stageIndex)
          if (stoppedEarly.delete(key)) {
            // stopped before it started: nothing loaded, nothing to report but the stop
            yield* reports.offer({
              _tag: "StageStopped",
              runId: p.runId,
              stageIndex: p.stageIndex,
              stats: new StageStats(freshStats())
            })
            yield* reports.end
            return Mailbox.toStream(reports)
          }
          if (active.has(key)) {
            yield* reports.offer({
              _tag: "StageFault",
              runId: p.runId,
              stageIndex: p.stageIndex,
              reason: StageFaultReasons.ProvisionFailed({
                message: `stage ${p.stageIndex} of run ${p.runId} is already hosted here`
              })
            })
            yield* reports.end
            return Mailbox.toStream(reports)
          }
          // A request this agent cannot honour whatever the attempt (a big-endian host, threads the engine refuses):
          // refused before anything loads, as ProvisionFailed, which no recovery retries (not a worker crash).
          const refused = provisionRefusal(request, options)
          if (refused !== undefined) {
            yield* reports.offer({
              _tag: "StageFault",
              runId: p.runId,
              stageIndex: p.stageIndex,
              reason: StageFaultReasons.ProvisionFailed({ message: `stage ${p.stageIndex} refused: ${refused}` })
            })
            yield* reports.end
            return Mailbox.toStream(reports)
          }
          // The file to load: the model path, or the slice delivered for it (weight delivery).
          const path =
            options.weights === undefined
              ? p.ggufSource.path
              : options.weights.resolve(p.ggufSource.path, p.layerStart, p.layerEndExclusive)
          if (path === undefined) {
            yield* reports.offer({
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
            yield* reports.end
            return Mailbox.toStream(reports)
          }
          const stop = yield* Deferred.make<void>()
          active.set(key, stop)
          // The stage lives in the host's scope; closing the report stream (the orchestrator went away) stops it.
          const hold = { scope: yield* Scope.make(), kept: false }
          yield* runStage(host, {
            request,
            path,
            key: cacheKey(request, options.backend, path),
            reports,
            stop,
            hold
          }).pipe(
            Effect.ensuring(Effect.suspend(() => (hold.kept ? Effect.void : Scope.close(hold.scope, Exit.void)))),
            Effect.ensuring(Effect.sync(() => active.delete(key))),
            Effect.ensuring(reports.end),
            Effect.forkIn(hostScope)
          )
          yield* Effect.addFinalizer(() => Deferred.succeed(stop, undefined))
          return Mailbox.toStream(reports)
        })
      )

    const stop = (runId: RunId, stageIndex: number) =>
      Effect.suspend(() => {
        const key = stageKey(runId, stageIndex)
        const deferred = active.get(key)
        if (deferred === undefined) return Effect.sync(() => rememberStop(key))
        return Deferred.succeed(deferred, undefined).pipe(Effect.asVoid)
      })

    const capacity = Effect.sync(() =>
      NodeCapacity.make({
        freeMemoryBytes: Math.min(Os.freemem(), options.memoryLimitBytes ?? Number.POSITIVE_INFINITY),
        totalMemoryBytes: Os.totalmem(),
        threads: options.threads,
        backend: options.backend,
        hostname: Os.hostname(),
        activeStages: active.size,
        ...(options.devices === undefined ? {} : { devices: options.devices() }),
        openSessions: heldSessionBytes(),
        stepCosts: [...batchers.values()].map(({ batcher, layers }) => {
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
        }),
        ...(options.speedBytesPerSecond !== undefined
          ? { speedBytesPerSecond: options.speedBytesPerSecond, speedSource: options.speedSource ?? "declared" }
          : options.laterSpeed?.current !== undefined
            ? { speedBytesPerSecond: options.laterSpeed.current, speedSource: "measured" as const }
            : {}),
        ...(options.memoryLimitBytes === undefined ? {} : { memoryLimitBytes: options.memoryLimitBytes })
      })
    )

    return {
      provision,
      stop,
      capacity,
      cachedRanges: RcMap.keys(models),
      dropCached: promptCache.drop
    } satisfies StageHost
  })
