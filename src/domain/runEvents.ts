/**
 * Vocabulary of the orchestrator's run state machine: the events it consumes (`RunEvent`), the commands it asks the
 * world to execute (`RunCommand`), and the lifecycle events it publishes (`LifecycleEvent`). All are Schema tagged
 * unions of plain values, so they can be encoded across process boundaries and compared by structure.
 *
 * Each union `X` has a constructor object `Xs` (`RunEvents.StageReady({ runId, stageIndex })`).
 */
import { Duration, Schema } from "effect"
import { NodeId, RunId } from "./ids.js"
import { Edge, ProvisionStage, RunPlan } from "./plan.js"

type Tagged = { readonly _tag: string }
type Constructors<A extends Tagged> = {
  readonly [K in A["_tag"]]: keyof Omit<Extract<A, { _tag: K }>, "_tag"> extends never
    ? () => Extract<A, { _tag: K }>
    : // only optional fields: the argument may be left out
      {} extends Omit<Extract<A, { _tag: K }>, "_tag">
      ? (args?: Omit<Extract<A, { _tag: K }>, "_tag">) => Extract<A, { _tag: K }>
      : (args: Omit<Extract<A, { _tag: K }>, "_tag">) => Extract<A, { _tag: K }>
}
/** Builds plain-object constructors for every tag of a union; the record makes the compiler check it lists all. */
const constructors = <A extends Tagged>(tags: Record<A["_tag"], true>): Constructors<A> =>
  Object.fromEntries(
    Object.keys(tags).map((tag) => [tag, (args?: object) => ({ _tag: tag, ...args })])
  ) as unknown as Constructors<A>

const NonNegativeInt = Schema.Number.pipe(Schema.int(), Schema.nonNegative())

// ---------------------------------------------------------------------------------------------------------------
// Faults

/** The two token endpoints the orchestrator hosts locally. */
export const EndpointKind = Schema.Literal("TokenIn", "TokenOut")
export type EndpointKind = typeof EndpointKind.Type

/**
 * Why a stage failed: the one vocabulary from the node agent (its `StageFault` report carries it over the control
 * link, src/domain/controlRpc.ts) through the run FSM to the caller's `RunFaulted`. The orchestrator infers some
 * itself (a link that broke: `WorkerCrashed` without a message; `StoppedUnexpectedly`).
 */
export const StageFaultReason = Schema.Union(
  /** The stage's worker died: its agent went away (no message), or the stage itself failed unexpectedly (its cause). */
  Schema.TaggedStruct("WorkerCrashed", { message: Schema.optional(Schema.String) }),
  /** The agent refused the stage (e.g. it already hosts that stage of that run). */
  Schema.TaggedStruct("ProvisionFailed", { message: Schema.String }),
  /** The stage's weights or its engine session could not be loaded. */
  Schema.TaggedStruct("ModelLoadFailed", { message: Schema.String }),
  /** The engine failed on a frame (e.g. the context overflowed). */
  Schema.TaggedStruct("ExecutionFailed", { message: Schema.String }),
  /** An edge of the stage broke (the next stage unreachable, a peer closed or faulted, a malformed frame). */
  Schema.TaggedStruct("TransportFailed", { message: Schema.String }),
  /** A frame or an output the stage's place in the pipeline does not allow (a peer broke the data protocol). */
  Schema.TaggedStruct("ProtocolViolated", { message: Schema.String }),
  /** The stage reported StageStopped before the run reached a terminal outcome. */
  Schema.TaggedStruct("StoppedUnexpectedly", {})
)
export type StageFaultReason = typeof StageFaultReason.Type
export const StageFaultReasons = constructors<StageFaultReason>({
  WorkerCrashed: true,
  ProvisionFailed: true,
  ModelLoadFailed: true,
  ExecutionFailed: true,
  TransportFailed: true,
  ProtocolViolated: true,
  StoppedUnexpectedly: true
})
/** The words a stage fault reason carries, if any (the orchestrator's own inferences may have none). */
export const stageFaultMessage = (reason: StageFaultReason): string | undefined =>
  "message" in reason ? reason.message : undefined

/** Why a run faulted. The first one observed is the run's reason; later ones never replace it. */
export const RunFaultReason = Schema.Union(
  Schema.TaggedStruct("StageFault", { stageIndex: NonNegativeInt, reason: StageFaultReason }),
  Schema.TaggedStruct("EndpointFault", { endpoint: EndpointKind }),
  Schema.TaggedStruct("MembershipLost", { nodeId: NodeId }),
  /** Stages or token endpoints were not ready before the readiness deadline. */
  Schema.TaggedStruct("ReadinessTimeout", {
    missingStages: Schema.Array(NonNegativeInt),
    missingEndpoints: Schema.Array(EndpointKind)
  }),
  /** No token came back for the step in flight before the token deadline. */
  Schema.TaggedStruct("TokenTimeout", { step: NonNegativeInt }),
  /** The token endpoints reported stopped before the run reached a terminal outcome. */
  Schema.TaggedStruct("EndpointsStoppedUnexpectedly", {})
)
export type RunFaultReason = typeof RunFaultReason.Type
export const RunFaultReasons = constructors<RunFaultReason>({
  StageFault: true,
  EndpointFault: true,
  MembershipLost: true,
  ReadinessTimeout: true,
  TokenTimeout: true,
  EndpointsStoppedUnexpectedly: true
})

// ---------------------------------------------------------------------------------------------------------------
// Token objects

/** Provenance of a decode token: the step whose output it was. */
export const SamplingData = Schema.Struct({ sourceStep: NonNegativeInt })
export type SamplingData = typeof SamplingData.Type

export const TokenObjectPayload = Schema.Union(
  /** Step 0: the whole prompt. */
  Schema.TaggedStruct("Prompt", { tokens: Schema.Array(Schema.Number) }),
  /** Step k + 1: the token sampled at step k. */
  Schema.TaggedStruct("Decode", { tokenId: Schema.Number, sampling: SamplingData })
)
export type TokenObjectPayload = typeof TokenObjectPayload.Type
export const TokenObjectPayloads = constructors<TokenObjectPayload>({
  Prompt: true,
  Decode: true
})

/** One object the orchestrator writes to the TokenIn edge. */
export const TokenObjectInjection = Schema.Struct({ step: NonNegativeInt, payload: TokenObjectPayload })
export type TokenObjectInjection = typeof TokenObjectInjection.Type

// ---------------------------------------------------------------------------------------------------------------
// Events in

export const RunEvent = Schema.Union(
  /** Membership reports these nodes reachable and ready to host stages (accumulates across events). */
  Schema.TaggedStruct("PoolReady", { nodes: Schema.Array(NodeId) }),
  /** The committed plan for this run. */
  Schema.TaggedStruct("PlanAvailable", { plan: RunPlan }),
  Schema.TaggedStruct("StageReady", { runId: RunId, stageIndex: Schema.Number }),
  Schema.TaggedStruct("TokenInEndpointReady", {}),
  Schema.TaggedStruct("TokenOutEndpointReady", {}),
  /** The last stage's output for `step`; `eos` when the sampler produced end-of-sequence. */
  Schema.TaggedStruct("TokenReceived", { step: Schema.Number, tokenId: Schema.Number, eos: Schema.Boolean }),
  Schema.TaggedStruct("StageFault", { runId: RunId, stageIndex: Schema.Number, reason: StageFaultReason }),
  Schema.TaggedStruct("EndpointFault", { runId: RunId, endpoint: EndpointKind }),
  Schema.TaggedStruct("MembershipLost", { runId: RunId, nodeId: NodeId }),
  Schema.TaggedStruct("OperatorStop", { runId: RunId }),
  Schema.TaggedStruct("StageStopped", { runId: RunId, stageIndex: Schema.Number }),
  Schema.TaggedStruct("TokenEndpointsStopped", {})
)
export type RunEvent = typeof RunEvent.Type
export const RunEvents = constructors<RunEvent>({
  PoolReady: true,
  PlanAvailable: true,
  StageReady: true,
  TokenInEndpointReady: true,
  TokenOutEndpointReady: true,
  TokenReceived: true,
  StageFault: true,
  EndpointFault: true,
  MembershipLost: true,
  OperatorStop: true,
  StageStopped: true,
  TokenEndpointsStopped: true
})

// ---------------------------------------------------------------------------------------------------------------
// Commands out

export const RunCommand = Schema.Union(
  /** Tell `provision.nodeId` to load and host one stage. */
  Schema.TaggedStruct("ProvisionStage", { provision: ProvisionStage }),
  /** Create the local endpoint that writes the TokenIn edge. */
  Schema.TaggedStruct("CreateTokenInEndpoint", { runId: RunId, edge: Edge }),
  /** Create the local endpoint that reads the TokenOut edge. */
  Schema.TaggedStruct("CreateTokenOutEndpoint", { runId: RunId, edge: Edge }),
  Schema.TaggedStruct("InjectTokenObject", { runId: RunId, object: TokenObjectInjection }),
  Schema.TaggedStruct("StopRun", { runId: RunId, stageIndex: NonNegativeInt, nodeId: NodeId }),
  Schema.TaggedStruct("TearDownTokenEndpoints", { runId: RunId })
)
export type RunCommand = typeof RunCommand.Type
export const RunCommands = constructors<RunCommand>({
  ProvisionStage: true,
  CreateTokenInEndpoint: true,
  CreateTokenOutEndpoint: true,
  InjectTokenObject: true,
  StopRun: true,
  TearDownTokenEndpoints: true
})

// ---------------------------------------------------------------------------------------------------------------
// Lifecycle events out

export const CompletionReason = Schema.Literal("Eos", "MaxTokens")
export type CompletionReason = typeof CompletionReason.Type

/** Why an event was refused without changing the run's state. */
export const RejectionReason = Schema.Literal(
  /** The event names another run. */
  "ForeignRun",
  /** The run already has a terminal outcome and the event would be new work or a later fault. */
  "AlreadyTerminal",
  /** The run is torn down; it accepts nothing. */
  "TornDown",
  /** The event is about a stage or endpoint that has not been provisioned / created. */
  "NotProvisioned",
  /** The stage index is not in the plan. */
  "UnknownStage",
  /** The node is neither in the plan nor in the pool. */
  "NodeNotInRun",
  /** The same fact was already observed (duplicate readiness or stop). */
  "Duplicate",
  /** A token for a step that is not the one in flight. */
  "StepNotInFlight",
  /** A second plan after one was committed. */
  "PlanAlreadyCommitted",
  /** A plan that is not a coherent linear pipeline (no stages, stage indices not 0..n-1, an edge missing). */
  "InvalidPlan"
)
export type RejectionReason = typeof RejectionReason.Type

export const LifecycleEvent = Schema.Union(
  /** Plan and pool are both present; provisioning commands were issued. */
  Schema.TaggedStruct("RunProvisioning", { runId: RunId, stageCount: NonNegativeInt }),
  /** The readiness barrier passed and the prompt (step 0) was injected. */
  Schema.TaggedStruct("RunStarted", { runId: RunId }),
  /** A generated (non-EOS) token was consumed; useful for streaming. */
  Schema.TaggedStruct("TokenAccepted", { runId: RunId, step: NonNegativeInt, tokenId: Schema.Number }),
  /** Terminal: generation ended at EOS or at maxTokens. `tokens` are the generated tokens, EOS excluded. */
  Schema.TaggedStruct("RunCompleted", { runId: RunId, reason: CompletionReason, tokens: Schema.Array(Schema.Number) }),
  /** Terminal: the first fault observed. */
  Schema.TaggedStruct("RunFaulted", { runId: RunId, reason: RunFaultReason }),
  /** Terminal: an operator stopped the run. */
  Schema.TaggedStruct("RunOperatorStopped", { runId: RunId }),
  /**
   * Final event, exactly once, after the terminal outcome: every provisioned stage confirmed StageStopped and the
   * endpoints confirmed stopped, or the teardown deadline passed (the unconfirmed parts are listed).
   */
  Schema.TaggedStruct("RunTornDown", {
    runId: RunId,
    unconfirmedStages: Schema.Array(NonNegativeInt),
    endpointsConfirmed: Schema.Boolean
  }),
  /** An event was refused without changing state. */
  Schema.TaggedStruct("EventRejected", { runId: RunId, event: RunEvent, reason: RejectionReason })
)
export type LifecycleEvent = typeof LifecycleEvent.Type
export const LifecycleEvents = constructors<LifecycleEvent>({
  RunProvisioning: true,
  RunStarted: true,
  TokenAccepted: true,
  RunCompleted: true,
  RunFaulted: true,
  RunOperatorStopped: true,
  RunTornDown: true,
  EventRejected: true
})

/** The terminal lifecycle events: exactly one per run. */
export type TerminalEvent = Extract<LifecycleEvent, { _tag: "RunCompleted" | "RunFaulted" | "RunOperatorStopped" }>
export const isTerminalEvent = (event: LifecycleEvent): event is TerminalEvent =>
  event._tag === "RunCompleted" || event._tag === "RunFaulted" || event._tag === "RunOperatorStopped"

export type RunTornDown = Extract<LifecycleEvent, { _tag: "RunTornDown" }>

// ---------------------------------------------------------------------------------------------------------------
// Configuration

export const DEFAULT_READINESS_TIMEOUT: Duration.Duration = Duration.seconds(120)
export const DEFAULT_TOKEN_TIMEOUT: Duration.Duration = Duration.seconds(60)
export const DEFAULT_TEARDOWN_TIMEOUT: Duration.Duration = Duration.seconds(10)

/** What the orchestrator knows about a run before it has a plan. */
export interface RunConfig {
  readonly runId: RunId
  /** Tokens to generate at most (steps 0..maxTokens-1 are injected at most). */
  readonly maxTokens: number
  /** Prompt tokens, injected as step 0. */
  readonly prompt: ReadonlyArray<number>
  /** A received token with this id ends the run like `eos: true`. */
  readonly eosTokenId?: number
  /** Stages and both endpoints must be ready this long after provisioning starts (default 120 s). */
  readonly readinessTimeout?: Duration.DurationInput
  /** The token for each injected step must arrive within this (default 60 s). */
  readonly tokenTimeout?: Duration.DurationInput
  /**
   * ...except the prompt's (step 0): within this (default tokenTimeout). A resumed generation's prompt replays its
   * produced tokens one decode step each, so it gets a token's time for each of them.
   */
  readonly promptTimeout?: Duration.DurationInput
  /** Stops must be confirmed within this after the terminal outcome (default 10 s). */
  readonly teardownTimeout?: Duration.DurationInput
}
