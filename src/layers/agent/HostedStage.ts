/**
 * One hosted stage's life on a node agent (StageHost.ts provisions it): its weights from the host's model cache and a
 * session over them (a prompt-cache entry's positions adopted when the run names one), its sampler on the last stage,
 * its edges (inbound, outbound, and the token loop's), the StageReady report, the frames it steps through until it is
 * stopped or fails (StageStep.ts), then its fault or its last counters, keeping its session as a prompt-cache entry
 * when the run asked for one.
 */
import * as Fs from "node:fs"
import { Cause, Deferred, Effect, Either, Exit, type Mailbox, Option, Queue, RcMap, Scope } from "effect"
import type { TokenLoop } from "../../domain/controlRpc.js"
import { type DataFrame, describeFault, type EdgeFault, type TransportAddress } from "../../domain/frames.js"
import type { ModelLoadError } from "../../domain/gguf.js"
import type { DeviceBytes } from "../../domain/engine.js"
import type { SamplingPolicy } from "../../domain/plan.js"
import { StageFaultReasons } from "../../domain/runEvents.js"
import {
  type DataListener,
  type EdgeReceiver,
  type EdgeRef,
  type EdgeSender,
  type ProvisionRequest,
  type StageReport,
  StageStats
} from "../../services/AgentLinks.js"
import { kvBytesOfStage } from "../../services/KvSize.js"
import type { LoadedStage, StageExecutorService, StageSession } from "../../services/StageExecutor.js"
import { openStageSampler } from "../sampling/StageSampler.js"
import { activationPayloadOffset } from "../transport/Framing.js"
import { speculationState } from "./SpeculativeStep.js"
import { draftModelOf } from "./DraftModel.js"
import { keepArrivals } from "../transport/WireClock.js"
import type { PromptCacheHost } from "./PromptCacheHost.js"
import type { StageBatcher } from "./StageBatcher.js"
import type { StageHostOptions } from "./StageHostOptions.js"
import {
  freshStats,
  loadFailed,
  makeTimingBuffer,
  type StageCounters,
  StageFailure,
  stepOf,
  transportFailed
} from "./StageStep.js"

/** Loaded weights in the host's model cache, and the batcher that runs every hosted stage on them. */
export interface CachedModel {
  readonly loaded: LoadedStage
  readonly batcher: StageBatcher
}

/** The model cache key of a block range of a file (its role and the backend: another load each). */
export const modelCacheKey = (
  path: string,
  layerStart: number,
  layerEndExclusive: number,
  isFirst: boolean,
  isLast: boolean,
  backend: string
) => JSON.stringify([path, layerStart, layerEndExclusive, isFirst, isLast, backend])

/** What a hosted stage uses of its host. */
export interface HostParts {
  readonly options: StageHostOptions
  readonly executor: StageExecutorService
  readonly listener: DataListener
  readonly hostScope: Scope.Scope
  /** Load progress of each model cache key, to the stage waiting for it. */
  readonly progressSinks: Map<string, (loaded: number, total: number) => void>
  readonly models: RcMap.RcMap<string, CachedModel, ModelLoadError>
  readonly promptCache: PromptCacheHost
  /** A sender on `edge` at `address`, retried until the consumer registered it; `peer` names it in a fault. */
  readonly connectEdge: (
    address: TransportAddress,
    edge: EdgeRef,
    peer: string
  ) => Effect.Effect<EdgeSender, StageFailure, Scope.Scope>
}

/** One provisioned stage: its request, the file it loads, its report mailbox and stop signal. */
export interface StageRun {
  readonly request: ProvisionRequest
  readonly path: string
  /** The model cache key of its weights (file, blocks, role, backend). */
  readonly key: string
  readonly reports: Mailbox.Mailbox<StageReport>
  readonly stop: Deferred.Deferred<void>
  /** The session and its hold on the weights: freed when the stage ends (the caller's), unless kept. */
  readonly hold: { readonly scope: Scope.CloseableScope; kept: boolean }
}

/** What the stage learns as it goes, read when it ends. */
interface Progress {
  readonly stats: StageCounters
  /** KV positions the session holds (the next step's start on stage 0). */
  readonly state: { position: number }
  /** What the loaded stage holds, read when the stage stops (set once it is loaded). */
  measureStage: () => void
  /** Decode steps not reported yet go out before the stage's last report. */
  flushTimings: () => void
  kept: { readonly session: StageSession; readonly loaded: LoadedStage } | undefined
}

const greedy: SamplingPolicy = { temperatureMillis: 0, topK: 1 }

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

/** The most of each part of a GPU stage's device memory seen so far. */
const largestDeviceBytes = (seen: DeviceBytes | undefined, now: DeviceBytes): DeviceBytes =>
  seen === undefined
    ? now
    : {
        weightBytes: Math.max(seen.weightBytes, now.weightBytes),
        cacheBytes: Math.max(seen.cacheBytes, now.cacheBytes),
        computeBytes: Math.max(seen.computeBytes, now.computeBytes),
        splits: Math.max(seen.splits ?? 0, now.splits ?? 0)
      }

const contextOf = (request: ProvisionRequest, loaded: LoadedStage) =>
  Math.min(request.contextLength, loaded.info.contextLength)

/** The stage's weights (loaded, or shared from the model cache) and a session over them, both in the stage's hold. */
const acquireSession = (host: HostParts, run: StageRun, progress: Progress) =>
  Effect.gen(function* () {
    const { key, reports, request } = run
    const { runId, stageIndex } = request.provision
    progress.stats.cachedWeights = (yield* RcMap.keys(host.models)).includes(key)
    host.progressSinks.set(key, (loadedBytes, totalBytes) => {
      reports.unsafeOffer({ _tag: "StageLoading", runId, stageIndex, loadedBytes, totalBytes })
    })
    const { batcher, loaded } = yield* RcMap.get(host.models, key).pipe(
      Scope.extend(run.hold.scope),
      Effect.mapError((error) => loadFailed(`${error.reason}: ${error.message}`))
    )
    host.progressSinks.delete(key)
    const session = yield* host.executor
      .session(loaded, {
        contextLength: contextOf(request, loaded),
        threads: request.threads ?? host.options.threads,
        ...(request.prefillThreads === undefined ? {} : { prefillThreads: request.prefillThreads })
      })
      .pipe(
        Scope.extend(run.hold.scope),
        Effect.mapError((error) => loadFailed(`${error.reason}: ${error.message}`))
      )
    progress.kept = { session, loaded }
    return { batcher, loaded, session }
  })

/**
 * Stage 0 of a `draft` run: the draft model, whole (all its blocks, first and last: the output head), from the model
 * cache (weights shared by every run that drafts with it, released when unused for the cache's idle time), and a
 * session over it with the stage's threads; both held until the stage body ends (never kept with a prompt-cache entry).
 * The file is the path as given, or what weight delivery holds for it.
 */
const acquireDraft = (host: HostParts, run: StageRun) =>
  Effect.gen(function* () {
    const { request } = run
    const draft = request.speculative?.draft
    if (draft === undefined || request.provision.stageIndex !== 0) return undefined
    const weights = host.options.weights
    const path = weights === undefined ? draft.path : weights.resolve(draft.path, 0, draft.blocks)
    const failed = (message: string) => loadFailed(`draft model ${draft.path}: ${message}`)
    if (path === undefined) return yield* failed("not on this node (--slices-only)")
    const key = modelCacheKey(path, 0, draft.blocks, true, true, host.options.backend)
    const { batcher, loaded } = yield* RcMap.get(host.models, key).pipe(
      Effect.mapError((error) => failed(`${error.reason}: ${error.message}`))
    )
    const contextLength = contextOf(request, loaded)
    const session = yield* host.executor
      .session(loaded, { contextLength, threads: request.threads ?? host.options.threads })
      .pipe(Effect.mapError((error) => failed(`${error.reason}: ${error.message}`)))
    return draftModelOf(session, batcher, contextLength, request.provision.model.eosTokenId)
  })

/**
 * Prompt cache: the first positions of a held entry's KV (none when this agent lacks it: the orchestrator then starts
 * the prompt at the fewest positions any stage took, 0 at worst). A multiple of the batcher's prompt chunk: the rest of
 * the prompt then runs in the chunks a full prefill runs there, and the entry's positions came from those same chunks
 * of its own prompt (an entry holds prompt positions only, see `finish`), so the KV and logits are bit for bit those of
 * a run without the cache. (Resumed mid-chunk, a short last chunk takes other kernels than the full prefill: ggml's
 * CPU flash attention tiles batches of 64+ queries only; measured, greedy text differed on a random-weight model.)
 * Returns the positions adopted, undefined when the run adopts nothing.
 */
const adoptCached = (host: HostParts, run: StageRun, batcher: StageBatcher, session: StageSession) =>
  Effect.gen(function* () {
    const cacheUse = run.request.promptCache
    if (cacheUse?.adopt == null) return undefined
    const entry = host.promptCache.find(cacheUse.adopt.entry, run.request.provision.stageIndex, run.key)
    const held = Math.min(cacheUse.adopt.length, entry?.positions ?? 0, cacheUse.promptLength - 1)
    const length = held - (held % batcher.prefillChunk)
    if (entry === undefined || host.executor.copyPrefix === undefined || length <= 0) return 0
    const copied = yield* host.executor.copyPrefix(entry.session, session, length).pipe(
      Effect.as(true),
      Effect.orElseSucceed(() => false)
    )
    return copied ? length : 0
  })

/**
 * The stage's edges: its inbound edge (a stage after the first takes a prompt's activations piece by piece as they
 * come), and its outbound connection. The token loop (ProvisionRequest.tokenLoop): stage 0 takes decode tokens from
 * the last stage on an edge of their own, besides the orchestrator's; the last stage connects to it (both before they
 * report ready), its two connections made side by side (each costs a handshake and a ring: ~15 ms here).
 */
const openEdges = (host: HostParts, request: ProvisionRequest) =>
  Effect.gen(function* () {
    const p = request.provision
    const { runId } = p
    const isFirst = p.stageIndex === 0
    const isLast = p.stageIndex === p.stageCount - 1
    const inbound = yield* host.listener
      .accept({ runId, edgeId: p.inbound.edgeId, ring: p.inbound.ring, reassemble: isFirst })
      .pipe(Effect.mapError((fault) => transportFailed(`cannot open the inbound edge: ${describeFault(fault)}`)))
    const loop = request.tokenLoop
    const loopIn =
      isFirst && loop !== undefined
        ? yield* host.listener
            .accept({ runId, edgeId: loop.edgeId, ring: loop.ring, initialStep: 1 })
            .pipe(
              Effect.mapError((fault) => transportFailed(`cannot open the token loop's edge: ${describeFault(fault)}`))
            )
        : undefined
    const [outbound, loopOut]: [EdgeSender, { loop: TokenLoop; sender: EdgeSender } | undefined] = yield* Effect.all(
      [
        host.connectEdge(
          request.outboundAddress,
          { runId, edgeId: p.outbound.edgeId, ring: p.outbound.ring },
          "the next stage"
        ),
        isLast && loop?.stage0 !== undefined
          ? Effect.map(
              host.connectEdge(loop.stage0, { runId, edgeId: loop.edgeId, ring: loop.ring }, "stage 0 (token loop)"),
              (sender) => ({ loop, sender })
            )
          : Effect.succeed(undefined)
      ],
      { concurrency: "unbounded" }
    )
    const receive = loopIn === undefined ? inbound.receive : yield* mergeReceivers(inbound, loopIn)
    return { outbound, loopOut, receive }
  })

/**
 * Moving the mapped weights to huge pages (LoadedStage.settle; once per loaded weights): now for a long-lived
 * pipeline's warm-up (before the stage is ready, so no request runs from 4 KiB pages or waits behind the move), or
 * forked after the first token for long-lived weights or a long session (the weights outlive this stage, so does the
 * move).
 */
const settleWeights = (host: HostParts, run: StageRun, loaded: LoadedStage, warmWeights: boolean) => {
  const p = run.request.provision
  const settle = Effect.suspend(() => loaded.settle?.() ?? Effect.succeed(false)).pipe(
    Effect.tap((done) =>
      Effect.sync(() => {
        if (done)
          host.options.log?.(
            `blocks [${p.layerStart}, ${p.layerEndExclusive}) settled: weights moved out of the file mapping`
          )
      })
    )
  )
  const setting = host.options.settleWeights
  return {
    now: run.request.settleWeights === true && setting !== "never" && loaded.settle !== undefined,
    later: loaded.settle !== undefined && settles(setting, run.request.contextLength, warmWeights),
    settle,
    settleLater: Effect.sleep(settleDelay).pipe(Effect.zipRight(settle), Effect.forkIn(host.hostScope))
  }
}

/** From provision to the stage's last frame: load, adopt, open, report ready, then step through the frames. */
const stageBody = (host: HostParts, run: StageRun, progress: Progress) =>
  Effect.gen(function* () {
    const { reports, request } = run
    const p = request.provision
    const { runId, stageIndex } = p
    const { stats } = progress
    const started = performance.now()
    const { batcher, loaded, session } = yield* acquireSession(host, run, progress)
    const draft = yield* acquireDraft(host, run)
    const cachedPositions = yield* adoptCached(host, run, batcher, session)
    if (cachedPositions !== undefined) progress.state.position = cachedPositions
    // the last stage's sampler (llama.cpp's chain): a policy or grammar it cannot honour refuses the run here
    const sample =
      stageIndex === p.stageCount - 1
        ? yield* openStageSampler(
            p.runtime.sampling ?? greedy,
            run.path,
            loaded.info.vocabSize,
            contextOf(request, loaded)
          ).pipe(
            Effect.mapError((message) => new StageFailure({ reason: StageFaultReasons.ProvisionFailed({ message }) }))
          )
        : undefined
    // its prompt follows: the prompt of a request that arrived beside it waits for it (one prefill for both), and
    // for the requests the server announced behind this one
    yield* batcher.expect(session, request.arriving ?? 0)
    const { loopOut, outbound, receive } = yield* openEdges(host, request)
    const settling = settleWeights(host, run, loaded, stats.cachedWeights)
    if (settling.now) yield* settling.settle
    stats.loadMillis = performance.now() - started
    const kvBytes = kvBytesOfStage(loaded.info, contextOf(request, loaded))
    // the largest seen while the session lives (its own graph slot is freed with it)
    progress.measureStage = () => {
      const memory = loaded.memory?.()
      stats.computeBytes = Math.max(stats.computeBytes, memory?.computeBytes ?? 0)
      if (memory?.device !== undefined) stats.device = largestDeviceBytes(stats.device, memory.device)
      stats.kvBytes = kvBytes
    }
    yield* reports.offer({
      _tag: "StageReady",
      runId,
      stageIndex,
      loadMillis: stats.loadMillis,
      cachedWeights: stats.cachedWeights,
      backend: loaded.info.backend,
      ...(loaded.info.device === undefined ? {} : { device: loaded.info.device }),
      ...(cachedPositions === undefined ? {} : { cachedPositions }),
      ...(loopOut === undefined ? {} : { tokenLoop: true })
    })
    if (settling.later) yield* settling.settleLater
    if (request.timeline === true) keepArrivals()
    const timings = makeTimingBuffer(runId, stageIndex, (report) => reports.unsafeOffer(report), request.timeline)
    progress.flushTimings = timings.flush
    // the most rows of this stage's output one frame on the outbound window carries (its rows are never wider than
    // its input rows: gemma4's per-layer inputs only shrink along the pipeline)
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
      state: progress.state,
      windowRows,
      outbound,
      loopOut,
      sample,
      timings,
      measureStage: () => progress.measureStage(),
      speculation: request.speculative === undefined ? undefined : speculationState(request.speculative, draft)
    })
    const transport = (fault: EdgeFault) => transportFailed(describeFault(fault))
    return yield* Effect.forever(Effect.flatMap(receive.pipe(Effect.mapError(transport)), step))
  }).pipe(Effect.scoped)

/**
 * The stage ended (stopped, its edges closed, or failed). The fault goes out first: the orchestrator learns of it
 * before anything else is done here (its own endpoint sees the stage's edges close as well, and the stage's words
 * name the cause). A stage that stopped, or whose edges closed (the run's teardown may close them before its stop
 * arrives), keeps its session as the prompt-cache entry its run named (unless dropped): the prompt's positions only
 * (computed by its prefill; the generated tokens' KV, computed one decode step at a time, is not what a later prefill
 * of them computes, so a later turn prefills them again). After an engine or protocol fault it keeps nothing.
 * (Whether the entry is used is the server's call: only a run that completed on every stage is indexed, the others'
 * entries are dropped.)
 */
const finish = (host: HostParts, run: StageRun, progress: Progress, exit: Exit.Exit<unknown, unknown>) =>
  Effect.gen(function* () {
    const { hold, reports, request } = run
    const { runId, stageIndex } = request.provision
    const { stats } = progress
    host.progressSinks.delete(run.key)
    progress.flushTimings()
    if (Exit.isFailure(exit)) {
      const failure = Cause.failureOption(exit.cause)
      const fault =
        Option.isSome(failure) && failure.value instanceof StageFailure
          ? failure.value
          : new StageFailure({ reason: StageFaultReasons.WorkerCrashed({ message: Cause.pretty(exit.cause) }) })
      if (!Cause.isInterruptedOnly(exit.cause))
        yield* reports.offer({ _tag: "StageFault", runId, stageIndex, reason: fault.reason })
    }
    const keepAs = request.promptCache?.keep
    const edgeClosed =
      Exit.isFailure(exit) &&
      Option.exists(
        Cause.failureOption(exit.cause),
        (e) => e instanceof StageFailure && e.reason._tag === "TransportFailed"
      )
    const keptPositions = Math.min(progress.state.position, request.promptCache?.promptLength ?? 0)
    const kept = progress.kept
    if (keepAs != null && (Exit.isSuccess(exit) || edgeClosed) && kept !== undefined && keptPositions > 0) {
      const held = yield* host.promptCache.keep(keepAs, stageIndex, {
        session: kept.session,
        scope: hold.scope,
        positions: keptPositions,
        weightsKey: run.key
      })
      if (held) {
        stats.keptPositions = keptPositions
        hold.kept = true
      }
    }
    if (!hold.kept) yield* Scope.close(hold.scope, Exit.void)
    progress.measureStage()
    const memory = residentMemory()
    stats.residentBytes = memory.resident
    stats.peakResidentBytes = memory.peak
    yield* reports.offer({ _tag: "StageStopped", runId, stageIndex, stats: new StageStats(stats) })
  })

/** A hosted stage from provision to its last report. */
export const runStage = (host: HostParts, run: StageRun) =>
  Effect.gen(function* () {
    const progress: Progress = {
      stats: freshStats(),
      state: { position: 0 },
      measureStage: () => {},
      flushTimings: () => {},
      kept: undefined
    }
    const exit = yield* stageBody(host, run, progress).pipe(Effect.raceFirst(Deferred.await(run.stop)), Effect.exit)
    yield* finish(host, run, progress, exit)
  })
