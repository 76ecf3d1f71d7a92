/**
 * The server's revival (PipelineLifecycle.ts): every agent of the pipeline was lost, so the server is Reviving and
 * keeps trying, with backoff, until a run succeeds again: on the agents that answer again, or (local agents all
 * exited, or given up on after `freshAgentsAfter`) on fresh local agents. Requests meanwhile are told how it goes.
 */
import { Duration, Effect, Either, Exit, Ref, Schedule, Scope } from "effect"
import type { Pipeline, PipelineMember } from "../../services/Orchestrator.js"
import { type RevivalAgent, type ServeOptions, ServerReviving, type ServerStatus } from "../../services/Server.js"
import type { Admission } from "./Admission.js"

/** A pipeline of its own scope: a revival may close it (its local agents stopped) and open another. */
export interface Generation {
  readonly pipeline: Pipeline
  readonly scope: Scope.CloseableScope
}

/** What a revival works with: the lifecycle's status, admission and counters, and its ways to open and warm pipelines. */
export interface RevivalContext {
  readonly options: ServeOptions["revive"]
  readonly status: Ref.Ref<ServerStatus>
  readonly admission: Admission
  readonly counts: { revivals: number; revivalAttempts: number }
  readonly log: (line: string) => void
  readonly openGeneration: (parent: Scope.Scope) => Effect.Effect<Generation, { readonly _tag: string }>
  readonly warmUp: (pipeline: Pipeline) => Effect.Effect<void, { readonly _tag: string }>
  readonly observePipeline: (pipeline: Pipeline) => Effect.Effect<void>
  /** No pipeline serves now (requests are told the server revives). */
  readonly stopServing: () => void
  /** The pipeline whose agents the revival waits for (/health lists them), or none. */
  readonly waitOn: (pipeline: Pipeline | undefined) => void
}

/** An error of the orchestrator in words: its message, else its tag and fields. */
export const errorWords = (error: { readonly _tag: string }): string => {
  const message = "message" in error && typeof error.message === "string" ? error.message : ""
  return message !== "" ? message : `${error._tag}: ${JSON.stringify(error)}`
}

interface Times {
  readonly firstMillis: number
  readonly maxMillis: number
  readonly freshAfterMillis: number
}

const timesOf = (options: ServeOptions["revive"]): Times => ({
  firstMillis: Duration.toMillis(Duration.decode(options?.firstDelay ?? "500 millis")),
  maxMillis: Duration.toMillis(Duration.decode(options?.maxDelay ?? "10 seconds")),
  freshAfterMillis: Duration.toMillis(Duration.decode(options?.freshAgentsAfter ?? "30 seconds"))
})

/** The wait before attempt n (1, 2, ...): first, doubling, capped. */
const reviveDelay = (times: Times, attempt: number) =>
  Math.min(times.maxMillis, times.firstMillis * 2 ** Math.min(attempt - 1, 30))

const seconds = (millis: number) => `${(millis / 1000).toFixed(millis < 10_000 ? 1 : 0)} s`

/** An agent of a pipeline as /health shows it while the server revives. */
export const revivalAgentOf = (member: PipelineMember): RevivalAgent => ({
  address: member.agent.node.address,
  pid: member.agent.pid,
  state: member.exited ? "exited" : member.state,
  detail: member.state === "up" ? "" : member.detail
})

const agentWords = (agent: RevivalAgent) =>
  `${agent.address} (pid ${agent.pid}) ${agent.state}${agent.detail === "" ? "" : `: ${agent.detail}`}`

/** What a request is told while the server revives. */
export const revivingError = (s: Extract<ServerStatus, { _tag: "Reviving" }>) => {
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

const notYet = (generation: Generation | undefined, words: string, waiting = false): Attempt => ({
  _tag: "NotYet",
  generation,
  words,
  waiting
})

/** A run on the agents of `generation` that answer again, or undefined when none does. */
const onAnswering = (ctx: RevivalContext, generation: Generation, members: ReadonlyArray<PipelineMember>) =>
  Effect.gen(function* () {
    const answering = members.filter((m) => m.state === "up")
    if (answering.length === 0) return undefined
    const names = answering.map((m) => `${m.agent.node.address} (pid ${m.agent.pid})`).join(", ")
    const run = yield* Effect.either(ctx.warmUp(generation.pipeline))
    return Either.isRight(run)
      ? ({ _tag: "Revived", generation, words: `a run succeeded on the agents that answer again: ${names}` } as const)
      : notYet(generation, `a run on the agents that answer again (${names}) failed: ${errorWords(run.left)}`)
  })

/** A fresh pipeline on fresh local agents, and a run on it. */
const onFreshAgents = (ctx: RevivalContext, parent: Scope.Scope): Effect.Effect<Attempt> =>
  Effect.gen(function* () {
    const opened = yield* Effect.either(ctx.openGeneration(parent))
    if (Either.isLeft(opened))
      return notYet(undefined, `setting up fresh local agents failed: ${errorWords(opened.left)}`)
    const fresh = opened.right
    yield* ctx.observePipeline(fresh.pipeline)
    const run = yield* Effect.either(ctx.warmUp(fresh.pipeline))
    if (Either.isLeft(run)) {
      yield* Scope.close(fresh.scope, Exit.void)
      return notYet(undefined, `a run on fresh local agents failed: ${errorWords(run.left)}`)
    }
    const pids = fresh.pipeline.agents.map((a) => a.pid).join(", ")
    return {
      _tag: "Revived",
      generation: fresh,
      words: `a run succeeded on ${fresh.pipeline.agents.length} fresh local agents (pids ${pids}); the old ones were stopped`
    } as const
  })

/**
 * One attempt: on the agents that answer again (a run must succeed on them); else, local agents that all exited
 * or that have been given up on are stopped and a fresh pipeline is set up; else (remote nodes, or local ones
 * still within `freshAgentsAfter`) nothing to do but wait for them.
 */
const attemptRevival = (
  ctx: RevivalContext,
  times: Times,
  parent: Scope.Scope,
  generation: Generation | undefined,
  sinceMillis: number
): Effect.Effect<Attempt> =>
  Effect.gen(function* () {
    if (generation !== undefined) {
      const members = yield* generation.pipeline.members
      const answered = yield* onAnswering(ctx, generation, members)
      if (answered !== undefined) return answered
      const waited = Date.now() - sinceMillis
      const allExited = members.every((m) => m.exited)
      if (!generation.pipeline.localAgents || (!allExited && waited < times.freshAfterMillis)) {
        const words = `no agent answers yet: ${members.map((m) => agentWords(revivalAgentOf(m))).join("; ")}`
        return notYet(generation, words, true)
      }
      // Given up on (or gone): stopped (SIGTERM, then SIGKILL: a stopped process too) before fresh ones start.
      yield* Scope.close(generation.scope, Exit.void)
    }
    return yield* onFreshAgents(ctx, parent)
  })

/** The Reviving status as a revival sets it (each agent's state read now). */
const revivingStatus = (
  ctx: RevivalContext,
  times: Times,
  r: {
    readonly message: string
    readonly sinceMillis: number
    readonly attempts: number
    readonly lastAttempt?: string
  },
  generation: Generation | undefined,
  nextAttemptAtMillis: number | null
) =>
  Effect.flatMap(
    generation === undefined
      ? Effect.succeed([] as ReadonlyArray<RevivalAgent>)
      : Effect.map(generation.pipeline.members, (members) => members.map(revivalAgentOf)),
    (agents) =>
      Ref.set(ctx.status, {
        _tag: "Reviving",
        message: r.message,
        sinceMillis: r.sinceMillis,
        attempts: r.attempts,
        nextAttemptAtMillis,
        waitingFor: agents,
        ...(generation === undefined || generation.pipeline.localAgents
          ? { freshAgentsAtMillis: r.sinceMillis + times.freshAfterMillis }
          : {}),
        ...(r.lastAttempt === undefined ? {} : { lastAttempt: r.lastAttempt })
      })
  )

/** Completes once an agent of `generation`'s pipeline answers again (never without a pipeline). */
const someoneAnswers = (generation: Generation | undefined) =>
  generation === undefined
    ? Effect.never
    : generation.pipeline.members.pipe(
        Effect.repeat({
          schedule: Schedule.spaced("100 millis"),
          until: (members) => members.some((m) => m.state === "up")
        }),
        Effect.asVoid
      )

/** The requests waiting for admission cannot run now: told so, as new ones are; the operator is told as well. */
const announce = (ctx: RevivalContext, times: Times, generation: Generation, message: string) =>
  Effect.gen(function* () {
    const now = yield* Ref.get(ctx.status)
    if (now._tag === "Reviving") yield* ctx.admission.failAll(revivingError(now))
    const agents = (yield* generation.pipeline.members).map(revivalAgentOf)
    ctx.log(
      `swactor serve: ${message}: ${agents.map(agentWords).join("; ")}; reviving the pipeline ` +
        `(attempts every ${seconds(times.firstMillis)}, doubling to ${seconds(times.maxMillis)})`
    )
  })

/**
 * Every agent of `lost`'s pipeline was lost: Reviving until an attempt succeeds; returns the generation serving again.
 * Until an attempt has found agents answering, one that answers again (rejoined: PipelineSetup) starts the next attempt
 * early (never sooner than `firstDelay` after the last); after a failed run on them, the backoff alone paces the
 * attempts. Local agents are given up on at `freshAgentsAfter`, not at the next backoff step.
 */
export const reviveFrom = (ctx: RevivalContext, parent: Scope.Scope, lost: Generation, message: string) =>
  Effect.gen(function* () {
    const times = timesOf(ctx.options)
    const r: { message: string; sinceMillis: number; attempts: number; lastAttempt?: string } = {
      message,
      sinceMillis: Date.now(),
      attempts: 0
    }
    let generation: Generation | undefined = lost
    ctx.waitOn(lost.pipeline)
    yield* revivingStatus(ctx, times, r, generation, Date.now() + reviveDelay(times, 1))
    ctx.stopServing()
    yield* announce(ctx, times, lost, message)
    let wakeOnAnswer = true
    while (true) {
      const untilFresh = r.sinceMillis + times.freshAfterMillis - Date.now()
      const delay =
        generation !== undefined && generation.pipeline.localAgents && untilFresh > 0
          ? Math.min(reviveDelay(times, r.attempts + 1), Math.max(times.firstMillis, untilFresh))
          : reviveDelay(times, r.attempts + 1)
      yield* revivingStatus(ctx, times, r, generation, Date.now() + delay)
      const waitFor = generation
      yield* wakeOnAnswer && delay > times.firstMillis
        ? Effect.race(Effect.sleep(delay), Effect.zipRight(Effect.sleep(times.firstMillis), someoneAnswers(waitFor)))
        : Effect.sleep(delay)
      yield* revivingStatus(ctx, times, r, generation, null)
      r.attempts++
      ctx.counts.revivalAttempts++
      const attempt: Attempt = yield* attemptRevival(ctx, times, parent, generation, r.sinceMillis)
      generation = attempt.generation
      ctx.waitOn(generation?.pipeline)
      wakeOnAnswer = attempt._tag === "NotYet" && attempt.waiting
      r.lastAttempt = attempt.words
      if (attempt._tag === "Revived") {
        ctx.counts.revivals++
        ctx.waitOn(undefined)
        ctx.log(
          `swactor serve: reviving the pipeline: attempt ${r.attempts}: ${attempt.words}; serving again ` +
            `${seconds(Date.now() - r.sinceMillis)} after every agent was lost`
        )
        return attempt.generation
      }
      ctx.log(
        `swactor serve: reviving the pipeline: attempt ${r.attempts}: ${attempt.words}; next attempt in at most ` +
          `${seconds(reviveDelay(times, r.attempts + 1))}`
      )
    }
  })
