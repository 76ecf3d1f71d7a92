/**
 * The agent control plane as an @effect/rpc group: what the orchestrator asks a node agent, and
 * what the agent reports back. Messages are Schema-encoded; the transport (an authenticated
 * socket) is `src/layers/transport/ControlPlane.ts`.
 *
 * - `Provision` — host one stage of one run: the `ProvisionStage` from the planner plus the
 *   data-plane addresses (`StageDataPlane`). Answers `StageReady` once the stage's model slice is
 *   loaded and its inbound edge is registered, or fails with `ProvisionRejected`.
 * - `StopRun` — stop one stage of a run (idempotent for a stage already stopped: `StageStopped`),
 *   fails with `UnknownStage` when the node never hosted it.
 * - `Heartbeat` — liveness + capacity (`NodeCapacity`).
 * - `Events` — a stream of `StageEvent`s for one run (`StageReady`, `StageFault{reason, edgeFault?}`,
 *   `StageStopped`), so the orchestrator learns about asynchronous faults.
 *
 * Data-plane wiring: each agent runs one data-plane listener (`NodeCapacity.dataPlane`). A stage
 * registers its inbound edge there and connects its outbound edge to `dataPlane.outbound`, the
 * listener of the outbound edge's consumer (the next stage's agent, or the orchestrator for
 * TokenOut). Provisioning from the last stage to the first lets every stage connect at once.
 */
import { Schema } from "effect"
import { EdgeFault, TransportAddress } from "./frames.js"
import { EdgeId, NodeId, RunId } from "./ids.js"
import { ProvisionStage } from "./plan.js"
import { StageFaultReason } from "./runFsm.js"
import { Rpc, RpcGroup } from "@effect/rpc"

/** Where a provisioned stage's edges meet the data plane. */
export class StageDataPlane extends Schema.Class<StageDataPlane>("StageDataPlane")({
  /** The listener this stage's inbound edge is registered on (its own agent's). */
  inbound: TransportAddress,
  /** The listener of the consumer of this stage's outbound edge, to connect to. */
  outbound: TransportAddress
}) {}

/** The stage is loaded, its inbound edge registered at `inbound`, its outbound edge connected. */
export class StageReady extends Schema.TaggedClass<StageReady>()("StageReady", {
  runId: RunId,
  stageIndex: Schema.Number,
  nodeId: NodeId,
  inbound: TransportAddress
}) {}

/**
 * A running stage faulted. `reason` is the run FSM's own `StageFaultReason` (so the orchestrator
 * feeds it to the FSM as is); a fault that came from the data plane also carries the edge and its
 * typed `EdgeFault` (with reason `TransportFailed`).
 */
export class StageFault extends Schema.TaggedClass<StageFault>()("StageFault", {
  runId: RunId,
  stageIndex: Schema.Number,
  reason: StageFaultReason,
  edgeFault: Schema.optional(Schema.Struct({ edgeId: EdgeId, fault: EdgeFault }))
}) {}

export class StageStopped extends Schema.TaggedClass<StageStopped>()("StageStopped", {
  runId: RunId,
  stageIndex: Schema.Number
}) {}

export const StageEvent = Schema.Union(StageReady, StageFault, StageStopped)
export type StageEvent = typeof StageEvent.Type

/** A node refused or failed to provision a stage. */
export class ProvisionRejected extends Schema.TaggedError<ProvisionRejected>()("ProvisionRejected", {
  runId: RunId,
  stageIndex: Schema.Number,
  reason: Schema.Literal("AlreadyHosted", "InsufficientResources", "ModelLoadFailed", "EdgeSetupFailed", "Invalid"),
  detail: Schema.String
}) {}

/** The node does not host (and never hosted) that stage. */
export class UnknownStage extends Schema.TaggedError<UnknownStage>()("UnknownStage", {
  runId: RunId,
  stageIndex: Schema.Number
}) {}

export class HostedStage extends Schema.Class<HostedStage>("HostedStage")({
  runId: RunId,
  stageIndex: Schema.Number
}) {}

/** What a node can take on, and what it hosts now. */
export class NodeCapacity extends Schema.Class<NodeCapacity>("NodeCapacity")({
  nodeId: NodeId,
  freeMemoryBytes: Schema.Number,
  totalMemoryBytes: Schema.Number,
  threads: Schema.Number,
  /** Compute backend the agent runs stages on, e.g. "cpu", "cuda". */
  backend: Schema.String,
  /** The agent's data-plane listener. */
  dataPlane: TransportAddress,
  hostedRuns: Schema.Array(HostedStage)
}) {}

export const Provision = Rpc.make("Provision", {
  payload: { stage: ProvisionStage, dataPlane: StageDataPlane },
  success: StageReady,
  error: ProvisionRejected
})

export const StopRun = Rpc.make("StopRun", {
  payload: { runId: RunId, stageIndex: Schema.Number },
  success: StageStopped,
  error: UnknownStage
})

export const Heartbeat = Rpc.make("Heartbeat", {
  success: NodeCapacity
})

export const Events = Rpc.make("Events", {
  payload: { runId: RunId },
  success: StageEvent,
  stream: true
})

/** The agent control plane. Handlers: `ControlRpcs.toLayer({ Provision, StopRun, Heartbeat, Events })`. */
export class ControlRpcs extends RpcGroup.make(Provision, StopRun, Heartbeat, Events) {}
