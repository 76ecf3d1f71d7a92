/**
 * The orchestrator's run state machine.
 *
 * - `transition(state, event, now)` is pure: it returns the next state, the commands to execute and the lifecycle
 *   events to publish. `expire(state, now)` applies a passed deadline (readiness, token, teardown); `transition`
 *   calls it first, so a late event never beats its deadline.
 * - `RunActor.make(config)` wraps it in a fiber that takes events from a `Queue`, reads time from `Clock`, sleeps
 *   until the next deadline, and publishes commands and lifecycle events on two `PubSub`s.
 */
import { Clock, Data, Deferred, Duration, Effect, Either, Option, PubSub, Queue, Ref, type Scope } from "effect"
import type { NodeId } from "../domain/ids.js"
import type { RunPlan } from "../domain/plan.js"
import {
  type CompletionReason,
  DEFAULT_READINESS_TIMEOUT,
  DEFAULT_TEARDOWN_TIMEOUT,
  DEFAULT_TOKEN_TIMEOUT,
  type EndpointKind,
  isTerminalEvent,
  type LifecycleEvent,
  LifecycleEvents,
  type RejectionReason,
  type RunCommand,
  RunCommands,
  type RunConfig,
  type RunEvent,
  type RunFaultReason,
  RunFaultReasons,
  type RunTornDown,
  StageFaultReasons,
  type TerminalEvent,
  type TokenObjectPayload
} from "../domain/runEvents.js"
import { deriveStageProvisionEither } from "./Planner.js"

// ---------------------------------------------------------------------------------------------------------------
// State

/** How a run ended. */
export type RunOutcome =
  | { readonly _tag: "Completed"; readonly reason: CompletionReason; readonly tokens: ReadonlyArray<number> }
  | { readonly _tag: "Faulted"; readonly reason: RunFaultReason }
  | { readonly _tag: "OperatorStopped" }

export type RunPhase =
  /** Waiting for a plan and a pool that covers its nodes. */
  | "Waiting"
  /** Provisioning commands issued; waiting for every stage and both endpoints to be ready. */
  | "Provisioning"
  /** Prompt injected; feeding tokens back. */
  | "Executing"
  /** Terminal outcome reached; waiting for stops to be confirmed. */
  | "TearingDown"
  | "TornDown"

export type Deadline =
  | { readonly _tag: "Readiness"; readonly at: number }
  | { readonly _tag: "Token"; readonly at: number; readonly step: number }
  | { readonly _tag: "Teardown"; readonly at: number }

/** `RunConfig` with its deadlines resolved to milliseconds. */
export interface ResolvedRunConfig {
  readonly runId: RunConfig["runId"]
  readonly maxTokens: number
  readonly prompt: ReadonlyArray<number>
  readonly eosTokenId: number | undefined
  readonly readinessTimeoutMs: number
  readonly tokenTimeoutMs: number
  readonly promptTimeoutMs: number
  readonly teardownTimeoutMs: number
}

export interface RunState {
  readonly config: ResolvedRunConfig
  readonly phase: RunPhase
  readonly plan: RunPlan | undefined
  /** Nodes reported ready by PoolReady (accumulated), less nodes lost before a plan arrived. */
  readonly pool: ReadonlyArray<NodeId>
  /** Stages a ProvisionStage command was issued for, in stage order. */
  readonly provisioned: ReadonlyArray<{ readonly stageIndex: number; readonly nodeId: NodeId }>
  readonly endpointsCreated: boolean
  readonly readyStages: ReadonlyArray<number>
  readonly tokenInReady: boolean
  readonly tokenOutReady: boolean
  /** The step injected and not yet consumed. */
  readonly inFlight: number | undefined
  /** Every step injected, in order. */
  readonly injected: ReadonlyArray<number>
  /** Generated tokens (EOS excluded). */
  readonly tokens: ReadonlyArray<number>
  readonly outcome: RunOutcome | undefined
  readonly stoppedStages: ReadonlyArray<number>
  readonly endpointsStopped: boolean
  readonly deadline: Deadline | undefined
  /** How many events were rejected (each also published as EventRejected). */
  readonly rejected: number
}

/** A config the FSM cannot run. */
export class InvalidRunConfig extends Data.TaggedError("InvalidRunConfig")<{ readonly message: string }> {}

export const resolveConfig = (config: RunConfig): Either.Either<ResolvedRunConfig, InvalidRunConfig> => {
  if (!Number.isSafeInteger(config.maxTokens) || config.maxTokens < 1) {
    return Either.left(new InvalidRunConfig({ message: `maxTokens ${config.maxTokens} must be a whole number >= 1` }))
  }
  if (config.prompt.length === 0) {
    return Either.left(new InvalidRunConfig({ message: "the prompt must have at least one token" }))
  }
  return Either.right({
    runId: config.runId,
    maxTokens: config.maxTokens,
    prompt: config.prompt,
    eosTokenId: config.eosTokenId,
    readinessTimeoutMs: Duration.toMillis(config.readinessTimeout ?? DEFAULT_READINESS_TIMEOUT),
    tokenTimeoutMs: Duration.toMillis(config.tokenTimeout ?? DEFAULT_TOKEN_TIMEOUT),
    promptTimeoutMs: Duration.toMillis(config.promptTimeout ?? config.tokenTimeout ?? DEFAULT_TOKEN_TIMEOUT),
    teardownTimeoutMs: Duration.toMillis(config.teardownTimeout ?? DEFAULT_TEARDOWN_TIMEOUT)
  })
}

export const initialState = (config: ResolvedRunConfig): RunState => ({
  config,
  phase: "Waiting",
  plan: undefined,
  pool: [],
  provisioned: [],
  endpointsCreated: false,
  readyStages: [],
  tokenInReady: false,
  tokenOutReady: false,
  inFlight: undefined,
  injected: [],
  tokens: [],
  outcome: undefined,
  stoppedStages: [],
  endpointsStopped: false,
  deadline: undefined,
  rejected: 0
})

/** The result of one step: the next state and what it emitted, in order. */
export interface Step {
  readonly state: RunState
  readonly commands: ReadonlyArray<RunCommand>
  readonly events: ReadonlyArray<LifecycleEvent>
}

// ---------------------------------------------------------------------------------------------------------------
// Transition

/** Accumulates one step's output. */
class Emitter {
  readonly commands: Array<RunCommand> = []
  readonly events: Array<LifecycleEvent> = []
  constructor(public state: RunState) {}
  set(patch: Partial<RunState>) {
    this.state = { ...this.state, ...patch }
  }
  step(): Step {
    return { state: this.state, commands: this.commands, events: this.events }
  }
}

const reject = (em: Emitter, event: RunEvent, reason: RejectionReason) => {
  em.set({ rejected: em.state.rejected + 1 })
  em.events.push(LifecycleEvents.EventRejected({ runId: em.state.config.runId, event, reason }))
}

const eventRunId = (event: RunEvent): number | undefined => {
  switch (event._tag) {
    case "PlanAvailable":
      return event.plan.runId
    case "StageReady":
    case "StageFault":
    case "EndpointFault":
    case "MembershipLost":
    case "OperatorStop":
    case "StageStopped":
      return event.runId
    default:
      return undefined
  }
}

const planHasStage = (plan: RunPlan | undefined, stageIndex: number) =>
  plan !== undefined && plan.stages.some((s) => s.stageIndex === stageIndex)

/** At least one stage, stage indices 0..n-1 each once, each knowing n, and every stage projects (its edges exist). */
const isCoherentPlan = (plan: RunPlan) => {
  const n = plan.stages.length
  const indices = plan.stages.map((s) => s.stageIndex).sort((a, b) => a - b)
  return (
    n > 0 &&
    indices.every((index, i) => index === i) &&
    plan.stages.every((s) => s.stageCount === n) &&
    plan.stages.every((s) => Either.isRight(deriveStageProvisionEither(plan, s.stageIndex)))
  )
}

const isProvisioned = (state: RunState, stageIndex: number) =>
  state.provisioned.some((s) => s.stageIndex === stageIndex)

const maybeProvision = (em: Emitter, now: number) => {
  const { plan, pool, phase, config } = em.state
  if (phase !== "Waiting" || plan === undefined) return
  if (!plan.stages.every((s) => pool.includes(s.nodeId))) return
  // PlanAvailable only accepts plans whose every stage projects, so this drops nothing.
  const provisions = [...plan.stages]
    .sort((a, b) => a.stageIndex - b.stageIndex)
    .flatMap((stage) => Either.getRight(deriveStageProvisionEither(plan, stage.stageIndex)).pipe(Option.toArray))
  for (const provision of provisions) em.commands.push(RunCommands.ProvisionStage({ provision }))
  const tokenIn = plan.edges.find((e) => e.kind === "TokenIn")
  const tokenOut = plan.edges.find((e) => e.kind === "TokenOut")
  if (tokenIn !== undefined) em.commands.push(RunCommands.CreateTokenInEndpoint({ runId: config.runId, edge: tokenIn }))
  if (tokenOut !== undefined) {
    em.commands.push(RunCommands.CreateTokenOutEndpoint({ runId: config.runId, edge: tokenOut }))
  }
  em.set({
    phase: "Provisioning",
    provisioned: provisions.map((p) => ({ stageIndex: p.stageIndex, nodeId: p.nodeId })),
    endpointsCreated: true,
    deadline: { _tag: "Readiness", at: now + config.readinessTimeoutMs }
  })
  em.events.push(LifecycleEvents.RunProvisioning({ runId: config.runId, stageCount: plan.stages.length }))
}

const inject = (em: Emitter, now: number, step: number, payload: TokenObjectPayload) => {
  em.commands.push(RunCommands.InjectTokenObject({ runId: em.state.config.runId, object: { step, payload } }))
  em.set({
    inFlight: step,
    injected: [...em.state.injected, step],
    deadline: {
      _tag: "Token",
      at: now + (step === 0 ? em.state.config.promptTimeoutMs : em.state.config.tokenTimeoutMs),
      step
    }
  })
}

const maybeStart = (em: Emitter, now: number) => {
  const s = em.state
  if (s.phase !== "Provisioning" || !s.tokenInReady || !s.tokenOutReady) return
  if (!s.provisioned.every((p) => s.readyStages.includes(p.stageIndex))) return
  em.set({ phase: "Executing" })
  em.events.push(LifecycleEvents.RunStarted({ runId: s.config.runId }))
  inject(em, now, 0, { _tag: "Prompt", tokens: s.config.prompt })
}

const maybeTornDown = (em: Emitter, force: boolean) => {
  const s = em.state
  if (s.phase !== "TearingDown") return
  const unconfirmedStages = s.provisioned.map((p) => p.stageIndex).filter((i) => !s.stoppedStages.includes(i))
  const endpointsConfirmed = !s.endpointsCreated || s.endpointsStopped
  if (!force && (unconfirmedStages.length > 0 || !endpointsConfirmed)) return
  em.set({ phase: "TornDown", deadline: undefined })
  em.events.push(LifecycleEvents.RunTornDown({ runId: s.config.runId, unconfirmedStages, endpointsConfirmed }))
}

/** Records the terminal outcome (only the first one counts) and starts teardown. */
const terminate = (em: Emitter, now: number, outcome: RunOutcome) => {
  const s = em.state
  if (s.outcome !== undefined) return
  const runId = s.config.runId
  em.set({ outcome, phase: "TearingDown", inFlight: undefined, deadline: undefined })
  em.events.push(terminalEvent(runId, outcome))
  for (const p of s.provisioned) {
    em.commands.push(RunCommands.StopRun({ runId, stageIndex: p.stageIndex, nodeId: p.nodeId }))
  }
  if (s.endpointsCreated) em.commands.push(RunCommands.TearDownTokenEndpoints({ runId }))
  em.set({ deadline: { _tag: "Teardown", at: now + s.config.teardownTimeoutMs } })
  maybeTornDown(em, false)
}

const terminalEvent = (runId: RunState["config"]["runId"], outcome: RunOutcome): TerminalEvent => {
  switch (outcome._tag) {
    case "Completed":
      return LifecycleEvents.RunCompleted({ runId, reason: outcome.reason, tokens: outcome.tokens })
    case "Faulted":
      return LifecycleEvents.RunFaulted({ runId, reason: outcome.reason })
    case "OperatorStopped":
      return LifecycleEvents.RunOperatorStopped({ runId })
  }
}

const fault = (em: Emitter, now: number, reason: RunFaultReason) => terminate(em, now, { _tag: "Faulted", reason })

const fireDeadline = (em: Emitter, deadline: Deadline) => {
  const s = em.state
  const at = deadline.at
  switch (deadline._tag) {
    case "Readiness": {
      const missingStages = s.provisioned.map((p) => p.stageIndex).filter((i) => !s.readyStages.includes(i))
      const missingEndpoints: Array<EndpointKind> = []
      if (!s.tokenInReady) missingEndpoints.push("TokenIn")
      if (!s.tokenOutReady) missingEndpoints.push("TokenOut")
      return fault(em, at, RunFaultReasons.ReadinessTimeout({ missingStages, missingEndpoints }))
    }
    case "Token":
      return fault(em, at, RunFaultReasons.TokenTimeout({ step: deadline.step }))
    case "Teardown":
      return maybeTornDown(em, true)
  }
}

// Fires every deadline at or before `now`, each at its own time (a readiness fault at t starts the teardown deadline
// at t, not at `now`), exactly as the actor, which sleeps until each deadline, does.
const applyExpiry = (em: Emitter, now: number) => {
  let deadline = em.state.deadline
  while (deadline !== undefined && deadline.at <= now) {
    fireDeadline(em, deadline)
    const next = em.state.deadline
    if (next === deadline) break
    deadline = next
  }
}

/** Applies every deadline that has passed at `now`, each at its own time. Pure. */
export const expire = (state: RunState, now: number): Step => {
  const em = new Emitter(state)
  applyExpiry(em, now)
  return em.step()
}

type EventOf<T extends RunEvent["_tag"]> = Extract<RunEvent, { readonly _tag: T }>

const onStageReady = (em: Emitter, event: EventOf<"StageReady">, now: number) => {
  const s = em.state
  if (!planHasStage(s.plan, event.stageIndex)) return reject(em, event, "UnknownStage")
  if (!isProvisioned(s, event.stageIndex)) return reject(em, event, "NotProvisioned")
  if (s.readyStages.includes(event.stageIndex)) return reject(em, event, "Duplicate")
  em.set({ readyStages: [...s.readyStages, event.stageIndex] })
  return maybeStart(em, now)
}

const onEndpointReady = (
  em: Emitter,
  event: EventOf<"TokenInEndpointReady" | "TokenOutEndpointReady">,
  now: number
) => {
  const s = em.state
  if (!s.endpointsCreated) return reject(em, event, "NotProvisioned")
  const field = event._tag === "TokenInEndpointReady" ? "tokenInReady" : "tokenOutReady"
  if (s[field]) return reject(em, event, "Duplicate")
  em.set({ [field]: true })
  return maybeStart(em, now)
}

const onTokenReceived = (em: Emitter, event: EventOf<"TokenReceived">, now: number) => {
  const s = em.state
  if (s.phase !== "Executing" || s.inFlight !== event.step) return reject(em, event, "StepNotInFlight")
  const isEos = event.eos || (s.config.eosTokenId !== undefined && event.tokenId === s.config.eosTokenId)
  if (isEos) return terminate(em, now, { _tag: "Completed", reason: "Eos", tokens: s.tokens })
  const tokens = [...s.tokens, event.tokenId]
  em.set({ tokens, inFlight: undefined })
  em.events.push(LifecycleEvents.TokenAccepted({ runId: s.config.runId, step: event.step, tokenId: event.tokenId }))
  if (tokens.length >= s.config.maxTokens) {
    return terminate(em, now, { _tag: "Completed", reason: "MaxTokens", tokens })
  }
  return inject(em, now, event.step + 1, {
    _tag: "Decode",
    tokenId: event.tokenId,
    sampling: { sourceStep: event.step }
  })
}

const onMembershipLost = (em: Emitter, event: EventOf<"MembershipLost">, now: number) => {
  const s = em.state
  if (s.plan !== undefined && s.plan.stages.some((st) => st.nodeId === event.nodeId)) {
    return fault(em, now, RunFaultReasons.MembershipLost({ nodeId: event.nodeId }))
  }
  if (!s.pool.includes(event.nodeId)) return reject(em, event, "NodeNotInRun")
  // A pool node the plan does not use (or no plan yet): it simply leaves the pool.
  return em.set({ pool: s.pool.filter((n) => n !== event.nodeId) })
}

const onStageStopped = (em: Emitter, event: EventOf<"StageStopped">, now: number, terminal: boolean) => {
  const s = em.state
  if (!planHasStage(s.plan, event.stageIndex)) return reject(em, event, "UnknownStage")
  if (!isProvisioned(s, event.stageIndex)) return reject(em, event, "NotProvisioned")
  if (s.stoppedStages.includes(event.stageIndex)) return reject(em, event, "Duplicate")
  em.set({ stoppedStages: [...s.stoppedStages, event.stageIndex] })
  if (!terminal) {
    return fault(
      em,
      now,
      RunFaultReasons.StageFault({ stageIndex: event.stageIndex, reason: StageFaultReasons.StoppedUnexpectedly() })
    )
  }
  return maybeTornDown(em, false)
}

const onTokenEndpointsStopped = (
  em: Emitter,
  event: EventOf<"TokenEndpointsStopped">,
  now: number,
  terminal: boolean
) => {
  const s = em.state
  if (!s.endpointsCreated) return reject(em, event, "NotProvisioned")
  if (s.endpointsStopped) return reject(em, event, "Duplicate")
  em.set({ endpointsStopped: true })
  if (!terminal) return fault(em, now, RunFaultReasons.EndpointsStoppedUnexpectedly())
  return maybeTornDown(em, false)
}

/** Applies one event: a foreign or torn-down run's, or (but for stop confirmations) a terminal run's, is rejected. */
const applyEvent = (em: Emitter, event: RunEvent, now: number) => {
  const s = em.state
  const runId = eventRunId(event)
  if (runId !== undefined && runId !== s.config.runId) return reject(em, event, "ForeignRun")
  if (s.phase === "TornDown") return reject(em, event, "TornDown")
  const terminal = s.outcome !== undefined
  // stop confirmations are what a terminal run waits for
  if (event._tag === "StageStopped") return onStageStopped(em, event, now, terminal)
  if (event._tag === "TokenEndpointsStopped") return onTokenEndpointsStopped(em, event, now, terminal)
  if (terminal) return reject(em, event, "AlreadyTerminal")
  switch (event._tag) {
    case "PoolReady": {
      em.set({ pool: [...s.pool, ...event.nodes.filter((n) => !s.pool.includes(n))] })
      return maybeProvision(em, now)
    }
    case "PlanAvailable": {
      if (s.plan !== undefined) return reject(em, event, "PlanAlreadyCommitted")
      if (!isCoherentPlan(event.plan)) return reject(em, event, "InvalidPlan")
      em.set({ plan: event.plan })
      return maybeProvision(em, now)
    }
    case "StageReady":
      return onStageReady(em, event, now)
    case "TokenInEndpointReady":
    case "TokenOutEndpointReady":
      return onEndpointReady(em, event, now)
    case "TokenReceived":
      return onTokenReceived(em, event, now)
    case "StageFault": {
      if (!planHasStage(s.plan, event.stageIndex)) return reject(em, event, "UnknownStage")
      return fault(em, now, RunFaultReasons.StageFault({ stageIndex: event.stageIndex, reason: event.reason }))
    }
    case "EndpointFault": {
      if (!s.endpointsCreated) return reject(em, event, "NotProvisioned")
      return fault(em, now, RunFaultReasons.EndpointFault({ endpoint: event.endpoint }))
    }
    case "MembershipLost":
      return onMembershipLost(em, event, now)
    case "OperatorStop":
      return terminate(em, now, { _tag: "OperatorStopped" })
  }
}

/**
 * The run FSM's transition function. Pure: `(state, event, now)` → next state, commands, lifecycle events. A deadline
 * that has passed at `now` is applied before the event.
 */
export const transition = (state: RunState, event: RunEvent, now: number): Step => {
  const em = new Emitter(state)
  applyExpiry(em, now)
  applyEvent(em, event, now)
  return em.step()
}

// ---------------------------------------------------------------------------------------------------------------
// Actor

type Inbox =
  | { readonly _tag: "Event"; readonly event: RunEvent; readonly done: Deferred.Deferred<void> | undefined }
  | { readonly _tag: "Sync"; readonly done: Deferred.Deferred<void> }

/** A running run FSM: a fiber fed by a queue. */
export interface RunActor {
  readonly runId: RunConfig["runId"]
  /** Enqueues an event; returns at once. */
  readonly offer: (event: RunEvent) => Effect.Effect<void>
  /** Enqueues an event and waits until it has been applied and its output published. */
  readonly send: (event: RunEvent) => Effect.Effect<void>
  /** Waits until everything enqueued before has been applied, and any deadline passed by now has fired. */
  readonly sync: Effect.Effect<void>
  /** Commands from now on (subscribe before offering events you care about). */
  readonly subscribeCommands: Effect.Effect<Queue.Dequeue<RunCommand>, never, Scope.Scope>
  /** Lifecycle events from now on. */
  readonly subscribeLifecycle: Effect.Effect<Queue.Dequeue<LifecycleEvent>, never, Scope.Scope>
  /** The current state. */
  readonly state: Effect.Effect<RunState>
  /** Waits for the terminal outcome. */
  readonly outcome: Effect.Effect<RunOutcome>
  /** Waits for RunTornDown. */
  readonly tornDown: Effect.Effect<RunTornDown>
}

const makeActor = (config: RunConfig): Effect.Effect<RunActor, InvalidRunConfig, Scope.Scope> =>
  Effect.gen(function* () {
    const resolved = yield* resolveConfig(config)
    const stateRef = yield* Ref.make(initialState(resolved))
    const inbox = yield* Effect.acquireRelease(Queue.unbounded<Inbox>(), Queue.shutdown)
    const commands = yield* Effect.acquireRelease(PubSub.unbounded<RunCommand>(), PubSub.shutdown)
    const lifecycle = yield* Effect.acquireRelease(PubSub.unbounded<LifecycleEvent>(), PubSub.shutdown)
    const outcome = yield* Deferred.make<RunOutcome>()
    const tornDown = yield* Deferred.make<RunTornDown>()

    const publish = (step: Step) =>
      Effect.gen(function* () {
        yield* Ref.set(stateRef, step.state)
        yield* PubSub.publishAll(commands, step.commands)
        yield* PubSub.publishAll(lifecycle, step.events)
        if (step.state.outcome !== undefined && step.events.some(isTerminalEvent)) {
          yield* Deferred.succeed(outcome, step.state.outcome)
        }
        const done = step.events.find((e): e is RunTornDown => e._tag === "RunTornDown")
        if (done !== undefined) yield* Deferred.succeed(tornDown, done)
      })

    const nextItem = Effect.gen(function* () {
      const { deadline } = yield* Ref.get(stateRef)
      if (deadline === undefined) return yield* Queue.take(inbox)
      const now = yield* Clock.currentTimeMillis
      if (deadline.at <= now) return undefined
      return yield* Queue.take(inbox).pipe(
        Effect.timeoutTo({
          duration: Duration.millis(deadline.at - now),
          onTimeout: () => undefined,
          onSuccess: (item): Inbox | undefined => item
        })
      )
    })

    const loop = Effect.gen(function* () {
      while (true) {
        const item = yield* nextItem
        const now = yield* Clock.currentTimeMillis
        const state = yield* Ref.get(stateRef)
        if (item === undefined || item._tag === "Sync") {
          yield* publish(expire(state, now))
        } else {
          yield* publish(transition(state, item.event, now))
        }
        if (item !== undefined && item.done !== undefined) yield* Deferred.succeed(item.done, undefined)
      }
    })
    yield* Effect.forkScoped(loop)

    const actor: RunActor = {
      runId: resolved.runId,
      offer: (event) => Queue.offer(inbox, { _tag: "Event", event, done: undefined }),
      send: (event) =>
        Effect.flatMap(Deferred.make<void>(), (done) =>
          Effect.zipRight(Queue.offer(inbox, { _tag: "Event", event, done }), Deferred.await(done))
        ),
      sync: Effect.flatMap(Deferred.make<void>(), (done) =>
        Effect.zipRight(Queue.offer(inbox, { _tag: "Sync", done }), Deferred.await(done))
      ),
      subscribeCommands: PubSub.subscribe(commands),
      subscribeLifecycle: PubSub.subscribe(lifecycle),
      state: Ref.get(stateRef),
      outcome: Deferred.await(outcome),
      tornDown: Deferred.await(tornDown)
    }
    return actor
  })

export const RunActor = {
  /**
   * Starts a run FSM fiber in the current scope (interrupted when the scope closes). Fails with `InvalidRunConfig`
   * for a config it cannot run (maxTokens < 1, empty prompt).
   */
  make: makeActor
}
