/**
 * What the orchestrator and the node agents need from the transports, as two small services:
 *
 * - `DataPlane`: activation and token frames. A consumer registers an edge on its listener; the
 *   producer connects to that listener and sends (RingSpec flow control lives in the transport).
 * - `AgentControl`: the orchestrator's control link to one agent. `provision` is a stream of the
 *   stage's reports (loading progress, ready, then fault or stopped) that ends when the stage is
 *   stopped, and fails when the agent becomes unreachable.
 *
 * Live layers sit over the binary framing, authenticated sockets and the control-plane RPC group
 * (src/layers/transport); the in-memory layers here make the whole distributed path testable in
 * one process.
 */
import { Context, type Effect, Schema, type Scope, type Stream } from "effect"
import { type DataFrame, type EdgeFault, TransportAddress } from "../domain/frames.js"
import { EdgeId, RunId } from "../domain/ids.js"
import { ProvisionStage, type RingSpec } from "../domain/plan.js"
import type { NodeCapacity, NodeEndpoint } from "./Membership.js"

/** The identity of one edge of one run, and its ring. */
export interface EdgeRef {
  readonly runId: RunId
  readonly edgeId: EdgeId
  readonly ring: RingSpec
}

export interface EdgeReceiver {
  /** The next whole frame, in order. */
  readonly receive: Effect.Effect<DataFrame, EdgeFault>
}

export interface EdgeSender {
  /** Waits for window credit, then puts the frame on the wire. */
  readonly send: (frame: DataFrame) => Effect.Effect<void, EdgeFault>
}

export interface DataListener {
  /** Where producers reach it (the bound port, not 0). */
  readonly address: TransportAddress
  /** Registers an edge this process consumes; the edge closes with the scope. */
  readonly accept: (edge: EdgeRef) => Effect.Effect<EdgeReceiver, EdgeFault, Scope.Scope>
}

export interface DataPlaneService {
  /** Listens for producers that prove the cluster token. */
  readonly listen: (address: TransportAddress, token: string) => Effect.Effect<DataListener, EdgeFault, Scope.Scope>
  /** Connects to the consumer's listener and attaches to the edge (fails if it is not registered there yet). */
  readonly connect: (
    address: TransportAddress,
    edge: EdgeRef,
    token: string
  ) => Effect.Effect<EdgeSender, EdgeFault, Scope.Scope>
}

export class DataPlane extends Context.Tag("swactor/DataPlane")<DataPlane, DataPlaneService>() {}

/** Why a stage faulted, in words the orchestrator can act on. */
export const StageFaultKind = Schema.Literal(
  "LoadError",
  "WorkerCrashed",
  "TransportError",
  "EngineError",
  "ProtocolError",
  "Rejected"
)
export type StageFaultKind = typeof StageFaultKind.Type

/** Per-stage counters, reported when the stage stops. */
export class StageStats extends Schema.Class<StageStats>("StageStats")({
  frames: Schema.Number,
  tokens: Schema.Number,
  loadMillis: Schema.Number,
  cachedWeights: Schema.Boolean,
  prefillComputeMillis: Schema.Number,
  decodeFrames: Schema.Number,
  decodeComputeMillis: Schema.Number
}) {}

export const StageReport = Schema.Union(
  Schema.TaggedStruct("StageLoading", {
    runId: RunId,
    stageIndex: Schema.Number,
    loadedBytes: Schema.Number,
    totalBytes: Schema.Number
  }),
  Schema.TaggedStruct("StageReady", {
    runId: RunId,
    stageIndex: Schema.Number,
    loadMillis: Schema.Number,
    cachedWeights: Schema.Boolean
  }),
  Schema.TaggedStruct("StageFault", {
    runId: RunId,
    stageIndex: Schema.Number,
    kind: StageFaultKind,
    detail: Schema.String
  }),
  Schema.TaggedStruct("StageStopped", { runId: RunId, stageIndex: Schema.Number, stats: StageStats })
)
export type StageReport = typeof StageReport.Type

/** Everything an agent needs to host one stage: the plan's message plus where its output goes. */
export class ProvisionRequest extends Schema.Class<ProvisionRequest>("ProvisionRequest")({
  provision: ProvisionStage,
  /** The data listener of the next stage's agent (or the orchestrator's, for the last stage). */
  outboundAddress: TransportAddress,
  /** Engine threads for this stage (default: the agent's). */
  threads: Schema.NullOr(Schema.Number),
  /** KV cache length for this stage's session. */
  contextLength: Schema.Number
}) {}

/** The control link to an agent broke (connection refused or closed, bad token, RPC failure). */
export class AgentUnavailable extends Schema.TaggedError<AgentUnavailable>()("AgentUnavailable", {
  address: Schema.String,
  message: Schema.String
}) {}

/** What an agent says about itself when the orchestrator connects. */
export class AgentHello extends Schema.Class<AgentHello>("AgentHello")({
  dataAddress: TransportAddress,
  pid: Schema.Number
}) {}

export interface AgentLink {
  readonly node: NodeEndpoint
  readonly hello: AgentHello
  readonly capacity: Effect.Effect<NodeCapacity, AgentUnavailable>
  /** Hosts a stage; the stream ends after StageStopped. */
  readonly provision: (request: ProvisionRequest) => Stream.Stream<StageReport, AgentUnavailable>
  /** Asks the stage to stop (its provision stream then reports StageStopped). Idempotent. */
  readonly stop: (runId: RunId, stageIndex: number) => Effect.Effect<void, AgentUnavailable>
}

export interface AgentControlService {
  /** Opens an authenticated control link (the cluster token proves the orchestrator may use the agent). */
  readonly connect: (node: NodeEndpoint, token: string) => Effect.Effect<AgentLink, AgentUnavailable, Scope.Scope>
}

export class AgentControl extends Context.Tag("swactor/AgentControl")<AgentControl, AgentControlService>() {}

/** A connect refused because the consumer has not registered the edge yet (or is not listening yet): retry. */
export const isNotYetRegistered = (fault: EdgeFault): boolean =>
  fault._tag === "UnknownEdge" ||
  fault._tag === "UnknownRun" ||
  fault._tag === "ConnectFailed" ||
  (fault._tag === "PeerFaulted" && (fault.reason === "UnknownRun" || fault.reason === "UnknownEdge"))

/**
 * A data frame as plain data with every field given (the wire encoder validates): works whether the
 * transport's frame types are Schema classes or plain structs.
 */
export const dataFrame = (frame: DistributiveOmitTag<DataFrame> & { readonly _tag: DataFrame["_tag"] }): DataFrame =>
  frame as unknown as DataFrame

type DistributiveOmitTag<A> = A extends unknown ? { readonly [K in keyof A]: A[K] } : never
