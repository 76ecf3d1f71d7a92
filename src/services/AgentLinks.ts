/**
 * What the orchestrator and the node agents need from the transports, as two small services:
 *
 * - `DataPlane`: activation and token frames. A consumer registers an edge on its listener; the
 *   producer connects to that listener and sends (RingSpec flow control lives in the transport).
 * - `AgentControl`: the orchestrator's control link to one agent. `provision` is a stream of the
 *   stage's reports (loading progress, ready, then fault or stopped) that ends when the stage is
 *   stopped, and fails when the agent becomes unreachable.
 *
 * Live layers sit over the binary framing, authenticated sockets (src/layers/transport) and the
 * control-plane RPC group (src/domain/controlRpc.ts); the in-memory layers here make the whole
 * distributed path testable in one process.
 */
import { Context, type Effect, Schedule, Schema, type Scope, type Stream } from "effect"
import type {
  AgentHello,
  ProvisionRequest,
  StageReport,
  StageWeights,
  WeightDeliveryError,
  WeightsHeld
} from "../domain/controlRpc.js"
import type { DataFrame, EdgeFault, TransportAddress } from "../domain/frames.js"
import type { EdgeId, RunId } from "../domain/ids.js"
import type { RingSpec } from "../domain/plan.js"
import type { NodeCapacity, NodeEndpoint } from "./Membership.js"

/** The identity of one edge of one run, and its ring. */
export interface EdgeRef {
  readonly runId: RunId
  readonly edgeId: EdgeId
  readonly ring: RingSpec
  /**
   * A consumer's choice (`accept`): join a message's chunks before delivering it (default true), or deliver each chunk
   * as it arrives (a prompt's pieces, PromptPieces.ts).
   */
  readonly reassemble?: boolean
  /** A consumer's choice (`accept`): the step of the edge's first message (default 0; a token loop's is 1). */
  readonly initialStep?: number
}

export interface EdgeReceiver {
  /**
   * The next whole frame, in order. An activation's payload may be a view of the edge's shared-memory ring, valid
   * until the next `receive`: read it (or copy it) before asking for the next frame.
   */
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

// The messages that cross the control link live with its RPC group in the domain.
export { AgentHello, ProvisionRequest, StageReport, StageStats } from "../domain/controlRpc.js"

/** The control link to an agent broke (connection refused or closed, bad token, RPC failure). */
export class AgentUnavailable extends Schema.TaggedError<AgentUnavailable>()("AgentUnavailable", {
  address: Schema.String,
  message: Schema.String
}) {}

/** A node agent process could not be started, or did not announce itself ready. */
export class AgentSpawnError extends Schema.TaggedError<AgentSpawnError>()("AgentSpawnError", {
  index: Schema.Number,
  message: Schema.String
}) {}

/**
 * What a node agent offers the control plane: host a stage (a stream of its reports that ends after
 * StageStopped), stop it, and report capacity. `makeStageHost` (src/layers/agent/NodeAgent.ts) builds one; the control
 * RPC server (src/layers/agent/AgentControlRpc.ts) serves one.
 */
export interface StageHost {
  readonly provision: (request: ProvisionRequest) => Stream.Stream<StageReport>
  readonly stop: (runId: RunId, stageIndex: number) => Effect.Effect<void>
  readonly capacity: Effect.Effect<NodeCapacity>
  /** Weight sets currently cached (for tests and capacity reports). */
  readonly cachedRanges: Effect.Effect<ReadonlyArray<string>>
  /** Drops held prompt-cache entries (every one when `all`); absent: the host holds none. */
  readonly dropCached?: (entries: ReadonlyArray<number>, all: boolean) => Effect.Effect<void>
}

export interface AgentLink {
  readonly node: NodeEndpoint
  readonly hello: AgentHello
  readonly capacity: Effect.Effect<NodeCapacity, AgentUnavailable>
  /** Hosts a stage; the stream ends after StageStopped. */
  readonly provision: (request: ProvisionRequest) => Stream.Stream<StageReport, AgentUnavailable>
  /** Asks the stage to stop (its provision stream then reports StageStopped). Idempotent. */
  readonly stop: (runId: RunId, stageIndex: number) => Effect.Effect<void, AgentUnavailable>
  /** Drops held prompt-cache entries (every one when `all`); absent: the link cannot (its agent keeps none). */
  readonly dropCached?: (entries: ReadonlyArray<number>, all: boolean) => Effect.Effect<void, AgentUnavailable>
  /** Weight delivery (src/layers/orchestrator/WeightDelivery.ts); absent on links that cannot take slices. */
  readonly weights?: WeightLink
}

/** The control plane's weight delivery calls (see src/domain/controlRpc.ts). */
export interface WeightLink {
  readonly check: (weights: StageWeights) => Effect.Effect<WeightsHeld, AgentUnavailable | WeightDeliveryError>
  readonly chunk: (
    hash: string,
    offset: number,
    bytes: Uint8Array
  ) => Effect.Effect<number, AgentUnavailable | WeightDeliveryError>
  readonly finish: (weights: StageWeights) => Effect.Effect<string, AgentUnavailable | WeightDeliveryError>
  /**
   * Pipes a slice file on a connection of its own (src/layers/gguf/SliceStream.ts) instead of `chunk` messages;
   * succeeds with the slice's size once the agent checked its SHA-256. Absent: the link only takes chunks.
   */
  readonly stream?: (transfer: SliceTransfer) => Effect.Effect<number, AgentUnavailable | WeightDeliveryError>
}

/** One slice transfer by byte stream. */
export interface SliceTransfer {
  readonly hash: string
  /** The slice file. */
  readonly path: string
  /** Where the agent's partial file ends. */
  readonly offset: number
  /** Hex SHA-256 of the whole slice file. */
  readonly sha256: string
  /** Read size (default 1 MiB). */
  readonly chunkBytes?: number | undefined
  /** Told the offset reached after each chunk is handed to the socket. */
  readonly onBytes?: ((offset: number) => void) | undefined
  /** Aborting it stops the transfer mid-way (the agent keeps what arrived). */
  readonly signal?: AbortSignal | undefined
  /** The transfer fails after this long without a word or a drained write (default 60 s). */
  readonly silenceMillis?: number | undefined
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
 * How a producer retries a connect the consumer refused as not yet registered (`isNotYetRegistered`): quickly at
 * first, then every 250 ms at most. Every refused attempt costs both ends a connection, a handshake and a log line,
 * and the consumer may load its weights for minutes.
 */
export const notYetRegisteredRetry = Schedule.exponential("10 millis").pipe(
  Schedule.either(Schedule.spaced("250 millis"))
)

/** Frames are built with the domain's builders; re-exported here for the stage and orchestrator loops. */
export { dataFrame } from "../domain/frames.js"
