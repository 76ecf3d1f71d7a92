/**
 * The server's pipeline lifecycle: set up in the background (status Loading, then Ready, or Faulted with the reason
 * in words), warmed up by one run so the first request does not pay the load, kept warm while idle, and revived when
 * every agent is lost (Reviving, with backoff, on the agents that answer again or on fresh local agents). `current`
 * is the pipeline requests run on, or the error that says why there is none now.
 */
import {
  Cause,
  Deferred,
  Duration,
  Effect,
  Either,
  ExecutionStrategy,
  Exit,
  Option,
  Ref,
  Schedule,
  Scope,
  Stream
} from "effect"
import type { OrchestratorService, Pipeline, PipelineMember, RunUpdate } from "../../services/Orchestrator.js"
import {
  PipelineFaulted,
  type RevivalAgent,
  type ServeError,
  type ServeOptions,
  type ServerInfo,
  ServerLoading,
  ServerReviving,
  type ServerStatus
} from "../../services/Server.js"
import type { Admission } from "./Admission.js"
import { readModelLayout } from "../gguf/ModelCatalogLive.js"
import type * as KvSizing from "./KvSizing.js"
import {
  errorWords,
  type Generation,
  reviveFrom,
  revivalAgentOf,
  type RevivalContext,
  revivingError
} from "./Revival.js"
import { betterPlan, makeReplanMemory, openWhenItFits, type ReplanContext, replanOnto } from "./Replan.js"

/** The pipeline requests run on, and what /v1/models and ready report of it. */
export interface LivePipeline {
  readonly pipeline: Pipeline
  readonly info: ServerInfo
}

/** What the lifecycle needs from the server. */
export interface LifecycleDeps {
  readonly options: ServeOptions
  readonly orchestrator: OrchestratorService
  readonly parallel: number
  readonly kv: ReturnType<typeof KvSizing.make>
  readonly admission: Admission
  /** A pipeline's start-up updates (weights on their way) pass here. */
  readonly observeSetup?: (update: RunUpdate) => Effect.Effect<void>
  /** Every run's updates pass here (the KV sizing follows the plans). */
  readonly observePlan: (update: RunUpdate) => Effect.Effect<void>
  /** The refusal of a context that no longer fits (the pipeline changed shape). */
  readonly tooLong: (contextLength: number) => ServeError
  /** Another pipeline serves now: what the agents held for the prompt cache is gone. */
  readonly forgetCache: () => void
  /** The server's counters: revivals are counted here, and keep-warm runs only with nothing in flight. */
  readonly counts: { revivals: number; revivalAttempts: number; readonly inFlight: number }
  readonly log: (line: string) => void
}

/** The lifecycle's state, shared by its steps. */
interface Lifecycle {
  readonly deps: LifecycleDeps
  readonly status: Ref.Ref<ServerStatus>
  readonly started: Deferred.Deferred<LivePipeline, PipelineFaulted>
  /** The pipeline requests run on: set once it is Ready; a revival may put another in its place (fresh local agents). */
  live: LivePipeline | undefined
  /** While Reviving: the pipeline whose agents it waits for (undefined while fresh local agents start). */
  revivingOn: Pipeline | undefined
  /** When a run last started or ended (keep-warm runs only after a quiet half period). */
  lastRunAt: number
}

const fault = (lc: Lifecycle, message: string) =>
  Effect.gen(function* () {
    const current = yield* Ref.get(lc.status)
    if (current._tag === "Faulted") return
    yield* Ref.set(lc.status, { _tag: "Faulted", message })
    yield* Deferred.fail(lc.started, new PipelineFaulted({ message }))
    yield* lc.deps.admission.failAll(new PipelineFaulted({ message }))
  })

// the pipeline is long-lived: its stages move their weights out of the file mapping now, before any request
const warmUp = (lc: Lifecycle) => (pipeline: Pipeline) =>
  pipeline
    .run({ prompt: [pipeline.vocabulary.bosTokenId ?? 1], maxTokens: 1, settleWeights: true })
    .pipe(Stream.runForEach(lc.deps.observePlan))

const infoOf = (lc: Lifecycle, pipeline: Pipeline): ServerInfo => ({
  modelId: pipeline.model.modelId,
  model: pipeline.model,
  stageCount: pipeline.stageCount,
  parallel: lc.deps.parallel
})

const openGeneration = (lc: Lifecycle) => (parent: Scope.Scope) =>
  Effect.gen(function* () {
    const scope = yield* Scope.fork(parent, ExecutionStrategy.sequential)
    return yield* lc.deps.orchestrator.pipeline(lc.deps.options, lc.deps.observeSetup).pipe(
      Scope.extend(scope),
      Effect.map((pipeline): Generation => ({ pipeline, scope })),
      Effect.onExit((exit) => (Exit.isSuccess(exit) ? Effect.void : Scope.close(scope, Exit.void)))
    )
  })

/** The pipeline's shape before its first run is planned (the warm-up's plan refines it). */
const observePipeline = (lc: Lifecycle) => (pipeline: Pipeline) =>
  Effect.sync(() => lc.deps.kv.pipeline(pipeline.model, pipeline.stageCount))

const serveOn = (lc: Lifecycle, pipeline: Pipeline) =>
  Effect.gen(function* () {
    if (lc.live !== undefined && lc.live.pipeline !== pipeline) lc.deps.forgetCache()
    lc.live = { pipeline, info: infoOf(lc, pipeline) }
    yield* Ref.set(lc.status, { _tag: "Ready" })
    yield* lc.deps.admission.reshaped(lc.deps.tooLong)
  })

// --- revival: every agent lost; keep trying, with backoff, until a run succeeds again (Revival.ts) ---
const revivalOf = (lc: Lifecycle): RevivalContext => ({
  options: lc.deps.options.revive,
  status: lc.status,
  admission: lc.deps.admission,
  counts: lc.deps.counts,
  log: lc.deps.log,
  openGeneration: openGeneration(lc),
  warmUp: warmUp(lc),
  observePipeline: observePipeline(lc),
  stopServing: () => {
    lc.live = undefined
  },
  waitOn: (pipeline) => {
    lc.revivingOn = pipeline
  }
})

/** What a re-plan works with (src/layers/server/Replan.ts): only with a discovered pool. */
const replanOf = (lc: Lifecycle): ReplanContext | undefined => {
  const { options } = lc.deps
  return options.discovered === undefined
    ? undefined
    : {
        discovered: options.discovered,
        margin: options.replanMargin,
        placement: options.placement,
        stages: options.stages,
        log: lc.deps.log,
        openGeneration: openGeneration(lc),
        warmUp: warmUp(lc),
        observePipeline: observePipeline(lc)
      }
}

/** Completes once every agent of the pipeline is lost (runs recover on the others until then). */
const everyAgentLost = (pipeline: Pipeline) =>
  pipeline.alive.pipe(
    Effect.repeat({ schedule: Schedule.spaced("250 millis"), until: (alive) => alive.length === 0 }),
    Effect.asVoid
  )

/** While idle, keep the agents' weights from expiring out of their model caches. */
const keepWarm = (lc: Lifecycle) => {
  const every = Duration.decode(lc.deps.options.keepWarmEvery ?? "4 minutes")
  return Effect.suspend(() =>
    lc.live !== undefined &&
    lc.deps.counts.inFlight === 0 &&
    performance.now() - lc.lastRunAt >= Duration.toMillis(every) / 2
      ? warmUp(lc)(lc.live.pipeline).pipe(
          Effect.tap(() => Effect.sync(() => (lc.lastRunAt = performance.now()))),
          Effect.ignore
        )
      : Effect.void
  ).pipe(Effect.repeat(Schedule.spaced(Duration.toMillis(every) / 2)), Effect.forkScoped)
}

// --- setup, in the background: /health answers Loading meanwhile ---
const setUp = (lc: Lifecycle) =>
  Effect.gen(function* () {
    const { options } = lc.deps
    const parent = yield* Effect.scope
    const replan = replanOf(lc)
    // With a discovered pool, a model that does not fit on its nodes waits for more (Replan.ts).
    let generation = yield* replan === undefined ? openGeneration(lc)(parent) : openWhenItFits(replan, parent)
    const pipeline = generation.pipeline
    lc.deps.kv.model(yield* readModelLayout(options.model))
    yield* observePipeline(lc)(pipeline)
    // Loads every stage's weights now, so the first request starts on a warm pipeline.
    yield* warmUp(lc)(pipeline)
    yield* keepWarm(lc)
    yield* serveOn(lc, pipeline)
    yield* Deferred.succeed(lc.started, { pipeline, info: infoOf(lc, pipeline) })
    // Without recovery, the first lost agent faults the server for good.
    if (options.recovery?.maxAttempts === 0) {
      const lost = yield* pipeline.lost
      yield* fault(lc, `lost agent ${lost.node.address}: ${lost.reason}`)
      return yield* Effect.never
    }
    // A lost agent leaves the pipeline (its runs recover on the others); with none left, the server revives it.
    // With a discovered pool, nodes that appear are judged and the pipeline re-planned onto them when better.
    const revival = revivalOf(lc)
    const memory = makeReplanMemory()
    while (true) {
      const current = generation
      const joined = yield* Effect.raceFirst(
        Effect.as(everyAgentLost(current.pipeline), false),
        replan === undefined ? Effect.never : Effect.as(betterPlan(replan, memory, current), true)
      )
      if (joined && replan !== undefined) {
        generation = yield* replanOnto(replan, parent, current, (pipeline) => serveOn(lc, pipeline))
        continue
      }
      generation = yield* reviveFrom(revival, parent, current, "every agent of the pipeline was lost")
      yield* serveOn(lc, generation.pipeline)
    }
  }).pipe(
    Effect.catchAllCause((cause) =>
      Cause.isInterruptedOnly(cause)
        ? Effect.void
        : fault(
            lc,
            `setting up the pipeline for ${lc.deps.options.model} failed: ${Option.match(Cause.failureOption(cause), {
              onNone: () => Cause.pretty(cause),
              onSome: (error) => errorWords(error as { _tag: string })
            })}`
          )
    ),
    Effect.scoped,
    Effect.forkScoped
  )

const currentOf = (lc: Lifecycle) =>
  Effect.gen(function* () {
    const s = yield* Ref.get(lc.status)
    if (s._tag === "Loading") return yield* new ServerLoading({ message: "the model is still loading" })
    if (s._tag === "Faulted") return yield* new PipelineFaulted({ message: s.message })
    if (s._tag === "Reviving") return yield* revivingError(s)
    if (lc.live === undefined) return yield* new ServerLoading({ message: "the model is still loading" })
    return lc.live
  })

// Ready, with the agents lost so far (the pipeline goes on without them).
const statusOf = (lc: Lifecycle) =>
  Effect.gen(function* () {
    const s = yield* Ref.get(lc.status)
    // Reviving: each agent's state as membership sees it now.
    if (s._tag === "Reviving" && lc.revivingOn !== undefined) {
      return { ...s, waitingFor: (yield* lc.revivingOn.members).map(revivalAgentOf) }
    }
    if (s._tag !== "Ready" || lc.live === undefined) return s
    const alive = new Set((yield* lc.live.pipeline.alive).map((a) => a.node.address))
    const lost = lc.live.pipeline.agents.map((a) => a.node.address).filter((address) => !alive.has(address))
    return lost.length === 0 ? s : { _tag: "Ready" as const, lostAgents: lost }
  })

export const make = (deps: LifecycleDeps) =>
  Effect.gen(function* () {
    const lc: Lifecycle = {
      deps,
      status: yield* Ref.make<ServerStatus>({ _tag: "Loading" }),
      started: yield* Deferred.make<{ pipeline: Pipeline; info: ServerInfo }, PipelineFaulted>(),
      live: undefined,
      revivingOn: undefined,
      lastRunAt: performance.now()
    }
    yield* setUp(lc)
    return {
      /** Loading, Ready (with the agents lost so far), Reviving (each agent's state now) or Faulted. */
      status: statusOf(lc),
      /** The pipeline's facts once it is first Ready; fails if setting it up failed. */
      ready: Deferred.await(lc.started).pipe(Effect.map((s) => s.info)),
      /** The pipeline to run a request on now, or why there is none (loading, reviving, faulted). */
      current: currentOf(lc),
      /** The live pipeline, if any, without waiting. */
      live: (): LivePipeline | undefined => lc.live,
      /** A run started or ended (keep-warm runs wait for a quiet half period). */
      touch: () => {
        lc.lastRunAt = performance.now()
      }
    }
  })
