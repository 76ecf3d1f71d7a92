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
import * as Fs from "node:fs"
import * as Os from "node:os"
import { Cause, Deferred, Duration, Effect, Either, Exit, Mailbox, Option, Queue, RcMap, Scope, Stream } from "effect"
import type { TokenLoop } from "../../domain/controlRpc.js"
import { type DataFrame, describeFault, type EdgeFault, type TransportAddress } from "../../domain/frames.js"
import type { RunId } from "../../domain/ids.js"
import { StageFaultReasons } from "../../domain/runEvents.js"
import { threadsProblem } from "../../services/RequestChecks.js"
import type { SamplingPolicy } from "../../domain/plan.js"
import {
  type DataListener,
  DataPlane,
  type EdgeReceiver,
  type EdgeRef,
  type EdgeSender,
  isNotYetRegistered,
  notYetRegisteredRetry,
  type ProvisionRequest,
  type StageHost,
  type StageReport,
  StageStats
} from "../../services/AgentLinks.js"
import { kvBytesOfStage } from "../../services/KvSize.js"
import { NodeCapacity } from "../../services/Membership.js"
import { type LoadedStage, StageExecutor, type StageSession } from "../../services/StageExecutor.js"
import { openStageSampler } from "../sampling/StageSampler.js"
import type { WeightStore } from "../gguf/SliceStore.js"
import { type BatcherSettings, makeStageBatcher, type StageBatcher } from "./StageBatcher.js"
import { makePromptCacheHost } from "./PromptCacheHost.js"
import { heldSessionBytes } from "../engine/KvCache.js"
import { activationPayloadOffset } from "../transport/Framing.js"
import { freshStats, loadFailed, makeTimingBuffer, StageFailure, stepOf, transportFailed } from "./StageStep.js"

export interface StageHostOptions {
  /** The cluster token (data connections to the next stage prove it). */
  readonly token: string
  /** Default engine threads per stage. */
  readonly threads: number
  readonly backend: "cpu" | "cuda" | "auto"
  /** How long unused weights stay loaded. */
  readonly modelIdleTimeToLive?: Duration.DurationInput
  /** How long a stage keeps retrying to reach its outbound peer. */
  readonly connectTimeout?: Duration.DurationInput
  /** Micro-batch size and prompt chunk of the per-weights stage batcher. */
  readonly batch?: BatcherSettings
  /**
   * When a stage moves its mapped weights to allocated memory (LoadedStage.settle): always, never, or auto (default:
   * warm weights or a long context; `swactor node` passes SWACTOR_MMAP_MOVE, config/Settings.ts).
   */
  readonly settleWeights?: "always" | "never" | "auto"
  /** Cap on the free memory this agent reports (`--memory-limit`): placement never gives it more. */
  readonly memoryLimitBytes?: number
  /** Weight bytes per second of this agent's engine (`--speed`, or measured at start), reported to placement. */
  readonly speedBytesPerSecond?: number
  readonly speedSource?: "declared" | "measured"
  /** Delivered slices: a stage loads the held or received file for its model path and blocks (weight delivery). */
  readonly weights?: WeightStore
  /** Operator-facing lines (which file a stage's weights load from). */
  readonly log?: (line: string) => void
  /** A speed measured after start (`--speed-probe after-ready`): reported once set, when none is declared. */
  readonly laterSpeed?: { current: number | undefined }
  /**
   * Measure each loaded stage's decode step at 1..N rows while it is idle (BatcherSettings.stepProbe), so the batcher
   * sizes decode micro-batches from measured costs from the first request on. 0 or absent: off (costs are then learnt
   * from the micro-batches served only).
   */
  readonly stepProbeRows?: number
}

// The contract lives in services (AgentControlRpc serves it); re-exported for existing imports.
export type { StageHost }

interface CachedModel {
  readonly loaded: LoadedStage
  readonly batcher: StageBatcher
}

/**
 * Whether a stage asks its engine to settle (LoadedStage.settle): `always`, `never`, else (auto) when
 * its weights were already loaded for an earlier run (a warm pipeline: `swactor serve`, a long-lived node pool) or
 * from 1024 tokens of context on (a long generation). A first short `swactor run` keeps the fast-start mapping: the
 * move costs more than it saves in a few dozen tokens. (A server's requests mostly have short contexts, so the
 * context alone never moved a server's weights.)
 */
const settles = (setting: StageHostOptions["settleWeights"], contextLength: number, warmWeights: boolean): boolean =>
  setting === "always" || (setting !== "never" && (warmWeights || contextLength >= 1024))
const settleDelay = "1500 millis"

/** This process's resident set now and at its peak (Linux /proc; elsewhere Node's rss for both). */
const residentMemory = (): { readonly resident: number; readonly peak: number } => {
  try {
    const status = Fs.readFileSync("/proc/self/status", "utf8")
    const kib = (key: string) => Number(new RegExp(`^${key}:\\s+(\\d+) kB`, "m").exec(status)?.[1] ?? NaN) * 1024
    const resident = kib("VmRSS")
    const peak = kib("VmHWM")
    if (Number.isFinite(resident) && Number.isFinite(peak)) return { resident, peak }
  } catch {
    // not Linux
  }
  const rss = process.memoryUsage().rss
  return { resident: rss, peak: rss }
}

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
          "cpu" | "cuda" | "auto"
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

    const runStage = (
      request: ProvisionRequest,
      path: string,
      reports: Mailbox.Mailbox<StageReport>,
      stop: Deferred.Deferred<void>,
      /** The session and its hold on the weights: freed when the stage ends (the caller's), unless kept. */
      hold: { readonly scope: Scope.CloseableScope; kept: boolean }
    ) =>
      Effect.gen(function* () {
        const p = request.provision
        const runId = p.runId
        const stageIndex = p.stageIndex
        const isFirst = stageIndex === 0
        const isLast = stageIndex === p.stageCount - 1
        const key = cacheKey(request, options.backend, path)
        const stats = freshStats()
        // what the loaded stage holds, read when the stage stops (set once it is loaded)
        let measureStage = () => {}
        // Decode steps not reported yet go out before the stage's last report.
        let flushTimings = () => {}
        const sessionScope = hold.scope
        let kept: { session: StageSession; loaded: LoadedStage } | undefined
        // KV positions the session holds (the next step's start on stage 0)
        const state = { position: 0 }

        const body = Effect.gen(function* () {
          const started = performance.now()
          stats.cachedWeights = (yield* RcMap.keys(models)).includes(key)
          progressSinks.set(key, (loadedBytes, totalBytes) => {
            reports.unsafeOffer({ _tag: "StageLoading", runId, stageIndex, loadedBytes, totalBytes })
          })
          const { batcher, loaded } = yield* RcMap.get(models, key).pipe(
            Scope.extend(sessionScope),
            Effect.mapError((error) => loadFailed(`${error.reason}: ${error.message}`))
          )
          progressSinks.delete(key)
          const session = yield* executor
            .session(loaded, {
              contextLength: Math.min(request.contextLength, loaded.info.contextLength),
              threads: request.threads ?? options.threads,
              ...(request.prefillThreads === undefined ? {} : { prefillThreads: request.prefillThreads })
            })
            .pipe(
              Scope.extend(sessionScope),
              Effect.mapError((error) => loadFailed(`${error.reason}: ${error.message}`))
            )
          kept = { session, loaded }
          // Prompt cache: the first positions of a held entry's KV (none when this agent lacks it: the orchestrator
          // then starts the prompt at the fewest positions any stage took, 0 at worst). A multiple of the batcher's
          // prompt chunk: the rest of the prompt then runs in the chunks a full prefill runs there, and the entry's
          // positions came from those same chunks of its own prompt (an entry holds prompt positions only, see the
          // keep below), so the KV and logits are bit for bit those of a run without the cache. (Resumed mid-chunk,
          // a short last chunk takes other kernels than the full prefill: ggml's CPU flash attention tiles batches
          // of 64+ queries only; measured, greedy text differed on a random-weight model.)
          const cacheUse = request.promptCache
          let cachedPositions: number | undefined
          if (cacheUse?.adopt != null) {
            cachedPositions = 0
            const entry = promptCache.find(cacheUse.adopt.entry, stageIndex, key)
            const held = Math.min(cacheUse.adopt.length, entry?.positions ?? 0, cacheUse.promptLength - 1)
            const length = held - (held % batcher.prefillChunk)
            if (entry !== undefined && executor.copyPrefix !== undefined && length > 0) {
              const copied = yield* executor.copyPrefix(entry.session, session, length).pipe(
                Effect.as(true),
                Effect.orElseSucceed(() => false)
              )
              if (copied) cachedPositions = length
            }
            state.position = cachedPositions
          }
          // the last stage's sampler (llama.cpp's chain): a policy or grammar it cannot honour refuses the run here
          const sample = isLast
            ? yield* openStageSampler(
                p.runtime.sampling ?? greedy,
                path,
                loaded.info.vocabSize,
                Math.min(request.contextLength, loaded.info.contextLength)
              ).pipe(
                Effect.mapError(
                  (message) => new StageFailure({ reason: StageFaultReasons.ProvisionFailed({ message }) })
                )
              )
            : undefined
          // its prompt follows: the prompt of a request that arrived beside it waits for it (one prefill for both), and
          // for the requests the server announced behind this one
          yield* batcher.expect(session, request.arriving ?? 0)
          // a stage after the first takes a prompt's activations piece by piece as they come (PromptPieces.ts)
          const inbound = yield* listener
            .accept({ runId, edgeId: p.inbound.edgeId, ring: p.inbound.ring, reassemble: isFirst })
            .pipe(Effect.mapError((fault) => transportFailed(`cannot open the inbound edge: ${describeFault(fault)}`)))
          // The token loop (ProvisionRequest.tokenLoop): stage 0 takes decode tokens from the last stage on an edge of
          // their own, besides the orchestrator's; the last stage connects to it (both before they report ready).
          const loop = request.tokenLoop
          const loopIn =
            isFirst && loop !== undefined
              ? yield* listener
                  .accept({ runId, edgeId: loop.edgeId, ring: loop.ring, initialStep: 1 })
                  .pipe(
                    Effect.mapError((fault) =>
                      transportFailed(`cannot open the token loop's edge: ${describeFault(fault)}`)
                    )
                  )
              : undefined
          // the last stage's two connections are made side by side (each costs a handshake and a ring: ~15 ms here)
          const [outbound, loopOut]: [EdgeSender, { loop: TokenLoop; sender: EdgeSender } | undefined] =
            yield* Effect.all(
              [
                connectEdge(
                  request.outboundAddress,
                  { runId, edgeId: p.outbound.edgeId, ring: p.outbound.ring },
                  "the next stage"
                ),
                isLast && loop?.stage0 !== undefined
                  ? Effect.map(
                      connectEdge(loop.stage0, { runId, edgeId: loop.edgeId, ring: loop.ring }, "stage 0 (token loop)"),
                      (sender) => ({ loop, sender })
                    )
                  : Effect.succeed(undefined)
              ],
              { concurrency: "unbounded" }
            )
          const receive = loopIn === undefined ? inbound.receive : yield* mergeReceivers(inbound, loopIn)
          // moves the mapped weights to huge pages (LoadedStage.settle; once per loaded weights), saying so when it did
          const settle = Effect.suspend(() => loaded.settle?.() ?? Effect.succeed(false)).pipe(
            Effect.tap((done) =>
              Effect.sync(() => {
                if (done)
                  options.log?.(
                    `blocks [${p.layerStart}, ${p.layerEndExclusive}) settled: weights moved out of the file mapping`
                  )
              })
            )
          )
          // a long-lived pipeline's warm-up: the weights leave the file mapping now, before the stage is ready, so no
          // request runs from 4 KiB pages or waits behind the move
          if (request.settleWeights === true && options.settleWeights !== "never" && loaded.settle !== undefined) {
            yield* settle
          }
          stats.loadMillis = performance.now() - started
          const kvBytes = kvBytesOfStage(loaded.info, Math.min(request.contextLength, loaded.info.contextLength))
          // the largest seen while the session lives (its own graph slot is freed with it)
          measureStage = () => {
            stats.computeBytes = Math.max(stats.computeBytes, loaded.memory?.().computeBytes ?? 0)
            stats.kvBytes = kvBytes
          }
          yield* reports.offer({
            _tag: "StageReady",
            runId,
            stageIndex,
            loadMillis: stats.loadMillis,
            cachedWeights: stats.cachedWeights,
            ...(cachedPositions === undefined ? {} : { cachedPositions }),
            ...(loopOut === undefined ? {} : { tokenLoop: true })
          })
          if (
            loaded.settle !== undefined &&
            settles(options.settleWeights, request.contextLength, stats.cachedWeights)
          ) {
            // long-lived weights or a long session: after the first token, let the engine trade a one-time
            // cost for faster steps (mapped weights to huge pages); the weights outlive this stage, so does the move
            yield* Effect.sleep(settleDelay).pipe(Effect.zipRight(settle), Effect.forkIn(hostScope))
          }

          const timings = makeTimingBuffer(runId, stageIndex, (report) => reports.unsafeOffer(report))
          flushTimings = timings.flush

          // the most rows of this stage's output one frame on the outbound window carries (its rows are never wider
          // than its input rows: gemma4's per-layer inputs only shrink along the pipeline)
          const windowRows = Math.max(
            1,
            Math.floor(
              (p.outbound.ring.dataCapacity - activationPayloadOffset(p.outbound.ring.alignment)) /
                (loaded.info.hiddenDim * 4)
            )
          )

          const step = stepOf({
            request,
            batcher,
            session,
            stats,
            state,
            windowRows,
            outbound,
            loopOut,
            sample,
            timings,
            measureStage
          })
          const transport = (fault: EdgeFault) => transportFailed(describeFault(fault))
          yield* Effect.forever(Effect.flatMap(receive.pipe(Effect.mapError(transport)), step))
        }).pipe(Effect.scoped)

        const exit = yield* body.pipe(Effect.raceFirst(Deferred.await(stop)), Effect.exit)
        progressSinks.delete(key)
        flushTimings()
        // The fault goes out first: the orchestrator learns of it before anything else is done here (its own endpoint
        // sees the stage's edges close as well, and the stage's words name the cause).
        if (Exit.isFailure(exit)) {
          const failure = Cause.failureOption(exit.cause)
          const fault =
            Option.isSome(failure) && failure.value instanceof StageFailure
              ? failure.value
              : new StageFailure({ reason: StageFaultReasons.WorkerCrashed({ message: Cause.pretty(exit.cause) }) })
          if (!Cause.isInterruptedOnly(exit.cause)) {
            yield* reports.offer({ _tag: "StageFault", runId, stageIndex, reason: fault.reason })
          }
        }
        // A stage that stopped, or whose edges closed (the run's teardown may close them before its stop arrives), keeps
        // its session as the prompt-cache entry its run named (unless dropped): the prompt's positions only (computed
        // by its prefill; the generated tokens' KV, computed one decode step at a time, is not what a later prefill of
        // them computes, so a later turn prefills them again). After an engine or protocol fault it keeps nothing.
        // (Whether the entry is used is the server's call: only a run that completed on every stage is indexed, the
        // others' entries are dropped.)
        const keepAs = request.promptCache?.keep
        const edgeClosed =
          Exit.isFailure(exit) &&
          Option.exists(
            Cause.failureOption(exit.cause),
            (e) => e instanceof StageFailure && e.reason._tag === "TransportFailed"
          )
        const keptPositions = Math.min(state.position, request.promptCache?.promptLength ?? 0)
        if (keepAs != null && (Exit.isSuccess(exit) || edgeClosed) && kept !== undefined && keptPositions > 0) {
          const held = yield* promptCache.keep(keepAs, stageIndex, {
            session: kept.session,
            scope: sessionScope,
            positions: keptPositions,
            weightsKey: key
          })
          if (held) {
            stats.keptPositions = keptPositions
            hold.kept = true
          }
        }
        if (!hold.kept) yield* Scope.close(sessionScope, Exit.void)
        measureStage()
        const memory = residentMemory()
        stats.residentBytes = memory.resident
        stats.peakResidentBytes = memory.peak
        yield* reports.offer({ _tag: "StageStopped", runId, stageIndex, stats: new StageStats(stats) })
      })

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
          // A request this agent cannot honour whatever the attempt (threads the engine refuses): refused before
          // anything loads, as ProvisionFailed, which no recovery retries (not a worker crash).
          const badThreads =
            threadsProblem(request.threads ?? options.threads) ??
            (request.prefillThreads === undefined ? undefined : threadsProblem(request.prefillThreads))
          if (badThreads !== undefined) {
            yield* reports.offer({
              _tag: "StageFault",
              runId: p.runId,
              stageIndex: p.stageIndex,
              reason: StageFaultReasons.ProvisionFailed({ message: `stage ${p.stageIndex} refused: ${badThreads}` })
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
                  "to this node, and it does not read model paths (--slices-only)"
              })
            })
            yield* reports.end
            return Mailbox.toStream(reports)
          }
          const stop = yield* Deferred.make<void>()
          active.set(key, stop)
          // The stage lives in the host's scope; closing the report stream (the orchestrator went away) stops it.
          const hold = { scope: yield* Scope.make(), kept: false }
          yield* runStage(request, path, reports, stop, hold).pipe(
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

const greedy: SamplingPolicy = { temperatureMillis: 0, topK: 1 }

/**
 * Stage 0 of a run with a token loop reads two edges: the orchestrator's (the prompt) and the last stage's (each
 * decode step's token). One receive of both, in arrival order; the first fault (an edge closed) ends it. Token frames
 * are copies (never views of a ring), so each edge is read ahead of the stage.
 */
const mergeReceivers = (a: EdgeReceiver, b: EdgeReceiver) =>
  Effect.gen(function* () {
    const frames = yield* Queue.unbounded<Either.Either<DataFrame, EdgeFault>>()
    const pump = (receiver: EdgeReceiver) =>
      receiver.receive.pipe(
        Effect.flatMap((frame) => Queue.offer(frames, Either.right(frame))),
        Effect.forever,
        Effect.catchAll((fault) => Queue.offer(frames, Either.left(fault))),
        Effect.forkScoped
      )
    yield* pump(a)
    yield* pump(b)
    return Queue.take(frames).pipe(
      Effect.flatMap((item) => (Either.isRight(item) ? Effect.succeed(item.right) : Effect.fail(item.left)))
    )
  })
