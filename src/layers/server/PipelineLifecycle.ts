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

/** An error of the orchestrator in words: its message, else its tag and fields. */
export const errorWords = (error: { readonly _tag: string }): string => {
  const message = "message" in error && typeof error.message === "string" ? error.message : ""
  return message !== "" ? message : `${error._tag}: ${JSON.stringify(error)}`
}

/** The pipeline requests run on, and what /v1/models and ready report of it. */
export interface LivePipeline {
  readonly pipeline: Pipeline
  readonly info: ServerInfo
}

export const make = (deps: {
  readonly options: ServeOptions
  readonly orchestrator: OrchestratorService
  readonly parallel: number
  readonly kv: ReturnType<typeof KvSizing.make>
  readonly admission: Admission
  /** Every run's updates pass here (the KV sizing follows the plans). */
  readonly observePlan: (update: RunUpdate) => Effect.Effect<void>
  /** The refusal of a context that no longer fits (the pipeline changed shape). */
  readonly tooLong: (contextLength: number) => ServeError
  /** Another pipeline serves now: what the agents held for the prompt cache is gone. */
  readonly forgetCache: () => void
  /** The server's counters: revivals are counted here, and keep-warm runs only with nothing in flight. */
  readonly counts: { revivals: number; revivalAttempts: number; readonly inFlight: number }
  readonly log: (line: string) => void
}) =>
  Effect.gen(function* () {
    const { admission, counts, forgetCache, kv, log, observePlan, options, orchestrator, parallel, tooLong } = deps
    const status = yield* Ref.make<ServerStatus>({ _tag: "Loading" })
    const started = yield* Deferred.make<{ pipeline: Pipeline; info: ServerInfo }, PipelineFaulted>()
    // The pipeline requests run on: set once it is Ready; a revival may put another in its place (fresh local agents).
    let live: LivePipeline | undefined
    // While Reviving: the pipeline whose agents it waits for (undefined while fresh local agents start).
    let revivingOn: Pipeline | undefined
    // When a run last started or ended (keep-warm runs only after a quiet half period).
    let lastRunAt = performance.now()

    const fault = (message: string) =>
      Effect.gen(function* () {
        const current = yield* Ref.get(status)
        if (current._tag === "Faulted") return
        yield* Ref.set(status, { _tag: "Faulted", message })
        yield* Deferred.fail(started, new PipelineFaulted({ message }))
        yield* admission.failAll(new PipelineFaulted({ message }))
      })

    // the pipeline is long-lived: its stages move their weights out of the file mapping now, before any request
    const warmUp = (pipeline: Pipeline) =>
      pipeline
        .run({ prompt: [pipeline.vocabulary.bosTokenId ?? 1], maxTokens: 1, settleWeights: true })
        .pipe(Stream.runForEach(observePlan))

    const infoOf = (pipeline: Pipeline): ServerInfo => ({
      modelId: pipeline.model.modelId,
      model: pipeline.model,
      stageCount: pipeline.stageCount,
      parallel
    })
    /** A pipeline of its own scope (a child of `parent`): a revival may close it (its local agents stopped) and open another. */
    interface Generation {
      readonly pipeline: Pipeline
      readonly scope: Scope.CloseableScope
    }
    const openGeneration = (parent: Scope.Scope) =>
      Effect.gen(function* () {
        const scope = yield* Scope.fork(parent, ExecutionStrategy.sequential)
        return yield* orchestrator.pipeline(options).pipe(
          Scope.extend(scope),
          Effect.map((pipeline): Generation => ({ pipeline, scope })),
          Effect.onExit((exit) => (Exit.isSuccess(exit) ? Effect.void : Scope.close(scope, Exit.void)))
        )
      })
    /** The pipeline's shape before its first run is planned (the warm-up's plan refines it). */
    const observePipeline = (pipeline: Pipeline) => Effect.sync(() => kv.pipeline(pipeline.model, pipeline.stageCount))
    const serveOn = (pipeline: Pipeline) =>
      Effect.gen(function* () {
        if (live !== undefined && live.pipeline !== pipeline) forgetCache()
        live = { pipeline, info: infoOf(pipeline) }
        yield* Ref.set(status, { _tag: "Ready" })
        yield* admission.reshaped(tooLong)
      })

    // --- revival: every agent lost; keep trying, with backoff, until a run succeeds again ---
    const revive = {
      firstMillis: Duration.toMillis(Duration.decode(options.revive?.firstDelay ?? "500 millis")),
      maxMillis: Duration.toMillis(Duration.decode(options.revive?.maxDelay ?? "10 seconds")),
      freshAfterMillis: Duration.toMillis(Duration.decode(options.revive?.freshAgentsAfter ?? "30 seconds"))
    }
    /** The wait before attempt n (1, 2, ...): first, doubling, capped. */
    const reviveDelay = (attempt: number) =>
      Math.min(revive.maxMillis, revive.firstMillis * 2 ** Math.min(attempt - 1, 30))
    const seconds = (millis: number) => `${(millis / 1000).toFixed(millis < 10_000 ? 1 : 0)} s`
    const revivalAgentOf = (member: PipelineMember): RevivalAgent => ({
      address: member.agent.node.address,
      pid: member.agent.pid,
      state: member.exited ? "exited" : member.state,
      detail: member.state === "up" ? "" : member.detail
    })
    const agentWords = (agent: RevivalAgent) =>
      `${agent.address} (pid ${agent.pid}) ${agent.state}${agent.detail === "" ? "" : `: ${agent.detail}`}`
    /** What a request is told while the server revives. */
    const revivingError = (s: Extract<ServerStatus, { _tag: "Reviving" }>) => {
      const next = s.nextAttemptAtMillis === null ? 0 : Math.max(0, s.nextAttemptAtMillis - Date.now())
      const waiting = s.waitingFor.filter((agent) => agent.state !== "up")
      return new ServerReviving({
        retryAfterSeconds: Math.max(1, Math.ceil(next / 1000)),
        message:
          `the pipeline is being revived: ${s.message} ${seconds(Date.now() - s.sinceMillis)} ago; ` +
          (s.nextAttemptAtMillis === null
            ? `attempt ${s.attempts + 1} is running`
            : `attempt ${s.attempts + 1} in ${seconds(next)}`) +
          (s.waitingFor.length === 0
            ? ", on fresh local agents"
            : waiting.length === 0
              ? ""
              : `, waiting for ${waiting.length} agent(s) to answer again (/health names them)`)
      })
    }

    type Attempt =
      | { readonly _tag: "Revived"; readonly generation: Generation; readonly words: string }
      | {
          readonly _tag: "NotYet"
          readonly generation: Generation | undefined
          readonly words: string
          /** Nothing was tried: no agent answers yet. */
          readonly waiting: boolean
        }

    /**
     * One attempt: on the agents that answer again (a run must succeed on them); else, local agents that all exited
     * or that have been given up on are stopped and a fresh pipeline is set up; else (remote nodes, or local ones
     * still within `freshAgentsAfter`) nothing to do but wait for them.
     */
    const attemptRevival = (
      parent: Scope.Scope,
      generation: Generation | undefined,
      sinceMillis: number
    ): Effect.Effect<Attempt> =>
      Effect.gen(function* () {
        if (generation !== undefined) {
          const members = yield* generation.pipeline.members
          const answering = members.filter((m) => m.state === "up")
          if (answering.length > 0) {
            const names = answering.map((m) => `${m.agent.node.address} (pid ${m.agent.pid})`).join(", ")
            const run = yield* Effect.either(warmUp(generation.pipeline))
            return Either.isRight(run)
              ? ({
                  _tag: "Revived",
                  generation,
                  words: `a run succeeded on the agents that answer again: ${names}`
                } as const)
              : ({
                  _tag: "NotYet",
                  generation,
                  words: `a run on the agents that answer again (${names}) failed: ${errorWords(run.left)}`,
                  waiting: false
                } as const)
          }
          const waited = Date.now() - sinceMillis
          const allExited = members.every((m) => m.exited)
          if (!generation.pipeline.localAgents || (!allExited && waited < revive.freshAfterMillis)) {
            return {
              _tag: "NotYet",
              generation,
              words: `no agent answers yet: ${members.map((m) => agentWords(revivalAgentOf(m))).join("; ")}`,
              waiting: true
            } as const
          }
          // Given up on (or gone): stopped (SIGTERM, then SIGKILL: a stopped process too) before fresh ones start.
          yield* Scope.close(generation.scope, Exit.void)
        }
        const opened = yield* Effect.either(openGeneration(parent))
        if (Either.isLeft(opened)) {
          return {
            _tag: "NotYet",
            generation: undefined,
            words: `setting up fresh local agents failed: ${errorWords(opened.left)}`,
            waiting: false
          } as const
        }
        const fresh = opened.right
        yield* observePipeline(fresh.pipeline)
        const run = yield* Effect.either(warmUp(fresh.pipeline))
        if (Either.isLeft(run)) {
          yield* Scope.close(fresh.scope, Exit.void)
          return {
            _tag: "NotYet",
            generation: undefined,
            words: `a run on fresh local agents failed: ${errorWords(run.left)}`,
            waiting: false
          } as const
        }
        const pids = fresh.pipeline.agents.map((a) => a.pid).join(", ")
        return {
          _tag: "Revived",
          generation: fresh,
          words: `a run succeeded on ${fresh.pipeline.agents.length} fresh local agents (pids ${pids}); the old ones were stopped`
        } as const
      })

    /** Every agent of `lost`'s pipeline was lost: Reviving until an attempt succeeds; returns the generation serving again. */
    const reviveFrom = (parent: Scope.Scope, lost: Generation, message: string) =>
      Effect.gen(function* () {
        const sinceMillis = Date.now()
        let generation: Generation | undefined = lost
        revivingOn = lost.pipeline
        let attempts = 0
        let lastAttempt: string | undefined
        const waitingFor = () =>
          generation === undefined
            ? Effect.succeed([] as ReadonlyArray<RevivalAgent>)
            : Effect.map(generation.pipeline.members, (members) => members.map(revivalAgentOf))
        const setReviving = (nextAttemptAtMillis: number | null) =>
          Effect.flatMap(waitingFor(), (agents) =>
            Ref.set(status, {
              _tag: "Reviving",
              message,
              sinceMillis,
              attempts,
              nextAttemptAtMillis,
              waitingFor: agents,
              ...(generation === undefined || generation.pipeline.localAgents
                ? { freshAgentsAtMillis: sinceMillis + revive.freshAfterMillis }
                : {}),
              ...(lastAttempt === undefined ? {} : { lastAttempt })
            })
          )
        yield* setReviving(Date.now() + reviveDelay(1))
        live = undefined
        // Requests waiting for admission cannot run now: told so, as new ones are.
        const now = yield* Ref.get(status)
        if (now._tag === "Reviving") yield* admission.failAll(revivingError(now))
        log(
          `swactor serve: ${message}: ${(yield* waitingFor()).map(agentWords).join("; ")}; reviving the pipeline ` +
            `(attempts every ${seconds(revive.firstMillis)}, doubling to ${seconds(revive.maxMillis)})`
        )
        // Until an attempt has found agents answering, one that answers again (rejoined: PipelineSetup) starts the
        // next attempt early (never sooner than `firstDelay` after the last); after a failed run on them, the backoff
        // alone paces the attempts. Local agents are given up on at `freshAgentsAfter`, not at the next backoff step.
        let wakeOnAnswer = true
        const someoneAnswers = Effect.suspend(() =>
          generation === undefined
            ? Effect.never
            : generation.pipeline.members.pipe(
                Effect.repeat({
                  schedule: Schedule.spaced("100 millis"),
                  until: (members) => members.some((m) => m.state === "up")
                }),
                Effect.asVoid
              )
        )
        while (true) {
          const untilFresh = sinceMillis + revive.freshAfterMillis - Date.now()
          const delay =
            generation !== undefined && generation.pipeline.localAgents && untilFresh > 0
              ? Math.min(reviveDelay(attempts + 1), Math.max(revive.firstMillis, untilFresh))
              : reviveDelay(attempts + 1)
          yield* setReviving(Date.now() + delay)
          yield* wakeOnAnswer && delay > revive.firstMillis
            ? Effect.race(Effect.sleep(delay), Effect.zipRight(Effect.sleep(revive.firstMillis), someoneAnswers))
            : Effect.sleep(delay)
          yield* setReviving(null)
          attempts++
          counts.revivalAttempts++
          const attempt: Attempt = yield* attemptRevival(parent, generation, sinceMillis)
          generation = attempt.generation
          revivingOn = generation?.pipeline
          wakeOnAnswer = attempt._tag === "NotYet" && attempt.waiting
          lastAttempt = attempt.words
          if (attempt._tag === "Revived") {
            counts.revivals++
            revivingOn = undefined
            log(
              `swactor serve: reviving the pipeline: attempt ${attempts}: ${attempt.words}; serving again ` +
                `${seconds(Date.now() - sinceMillis)} after every agent was lost`
            )
            return attempt.generation
          }
          log(
            `swactor serve: reviving the pipeline: attempt ${attempts}: ${attempt.words}; next attempt in at most ${seconds(reviveDelay(attempts + 1))}`
          )
        }
      })

    /** Completes once every agent of the pipeline is lost (runs recover on the others until then). */
    const everyAgentLost = (pipeline: Pipeline) =>
      pipeline.alive.pipe(
        Effect.repeat({ schedule: Schedule.spaced("250 millis"), until: (alive) => alive.length === 0 }),
        Effect.asVoid
      )

    // --- setup, in the background: /health answers Loading meanwhile ---
    yield* Effect.gen(function* () {
      const parent = yield* Effect.scope
      let generation = yield* openGeneration(parent)
      const pipeline = generation.pipeline
      kv.model(yield* readModelLayout(options.model))
      yield* observePipeline(pipeline)
      // Loads every stage's weights now, so the first request starts on a warm pipeline.
      yield* warmUp(pipeline)
      // While idle, keep the agents' weights from expiring out of their model caches.
      const keepWarm = Duration.decode(options.keepWarmEvery ?? "4 minutes")
      yield* Effect.suspend(() =>
        live !== undefined && counts.inFlight === 0 && performance.now() - lastRunAt >= Duration.toMillis(keepWarm) / 2
          ? warmUp(live.pipeline).pipe(
              Effect.tap(() => Effect.sync(() => (lastRunAt = performance.now()))),
              Effect.ignore
            )
          : Effect.void
      ).pipe(Effect.repeat(Schedule.spaced(Duration.toMillis(keepWarm) / 2)), Effect.forkScoped)
      yield* serveOn(pipeline)
      yield* Deferred.succeed(started, { pipeline, info: infoOf(pipeline) })
      // Without recovery, the first lost agent faults the server for good.
      if (options.recovery?.maxAttempts === 0) {
        const lost = yield* pipeline.lost
        yield* fault(`lost agent ${lost.node.address}: ${lost.reason}`)
        return yield* Effect.never
      }
      // A lost agent leaves the pipeline (its runs recover on the others); with none left, the server revives it.
      while (true) {
        yield* everyAgentLost(generation.pipeline)
        generation = yield* reviveFrom(parent, generation, "every agent of the pipeline was lost")
        yield* serveOn(generation.pipeline)
      }
    }).pipe(
      Effect.catchAllCause((cause) =>
        Cause.isInterruptedOnly(cause)
          ? Effect.void
          : fault(
              `setting up the pipeline for ${options.model} failed: ${Option.match(Cause.failureOption(cause), {
                onNone: () => Cause.pretty(cause),
                onSome: (error) => errorWords(error as { _tag: string })
              })}`
            )
      ),
      Effect.scoped,
      Effect.forkScoped
    )

    const current = Effect.gen(function* () {
      const s = yield* Ref.get(status)
      if (s._tag === "Loading") return yield* new ServerLoading({ message: "the model is still loading" })
      if (s._tag === "Faulted") return yield* new PipelineFaulted({ message: s.message })
      if (s._tag === "Reviving") return yield* revivingError(s)
      if (live === undefined) return yield* new ServerLoading({ message: "the model is still loading" })
      return live
    })

    // Ready, with the agents lost so far (the pipeline goes on without them).
    const currentStatus = Effect.gen(function* () {
      const s = yield* Ref.get(status)
      // Reviving: each agent's state as membership sees it now.
      if (s._tag === "Reviving" && revivingOn !== undefined) {
        return { ...s, waitingFor: (yield* revivingOn.members).map(revivalAgentOf) }
      }
      if (s._tag !== "Ready" || live === undefined) return s
      const alive = new Set((yield* live.pipeline.alive).map((a) => a.node.address))
      const lost = live.pipeline.agents.map((a) => a.node.address).filter((address) => !alive.has(address))
      return lost.length === 0 ? s : { _tag: "Ready" as const, lostAgents: lost }
    })

    return {
      /** Loading, Ready (with the agents lost so far), Reviving (each agent's state now) or Faulted. */
      status: currentStatus,
      /** The pipeline's facts once it is first Ready; fails if setting it up failed. */
      ready: Deferred.await(started).pipe(Effect.map((s) => s.info)),
      /** The pipeline to run a request on now, or why there is none (loading, reviving, faulted). */
      current,
      /** The live pipeline, if any, without waiting. */
      live: (): LivePipeline | undefined => live,
      /** A run started or ended (keep-warm runs wait for a quiet half period). */
      touch: () => {
        lastRunAt = performance.now()
      }
    }
  })
