import { Context, type Duration, type Effect, Schema, type Scope } from "effect"
import type { NodeCapacity } from "../domain/controlRpc.js"
import { NodeId } from "../domain/ids.js"

/** A node agent the orchestrator may use: its id in plans and its control address (host:port, or a Unix socket path). */
export const NodeEndpoint = Schema.Struct({
  nodeId: NodeId,
  address: Schema.String
}).annotations({ identifier: "NodeEndpoint" })
export type NodeEndpoint = typeof NodeEndpoint.Type

/** What a node agent reports about itself in answer to a heartbeat (a control-plane message). */
export { NodeCapacity } from "../domain/controlRpc.js"

/** One heartbeat could not be answered (connection refused, closed, bad token, …). */
export class NodeUnreachable extends Schema.TaggedError<NodeUnreachable>()("NodeUnreachable", {
  nodeId: NodeId,
  address: Schema.String,
  message: Schema.String
}) {}

/** The nodes a plan needs did not all answer before the deadline. */
export class PoolNotReady extends Schema.TaggedError<PoolNotReady>()("PoolNotReady", {
  missing: Schema.Array(NodeEndpoint),
  waitedMillis: Schema.Number,
  lastError: Schema.String
}) {}

/** A node stopped answering heartbeats past the deadline (or its control connection dropped). */
export class NodeLost extends Schema.TaggedClass<NodeLost>()("NodeLost", {
  node: NodeEndpoint,
  lastSeenMillis: Schema.NullOr(Schema.Number),
  reason: Schema.String
}) {}

export type NodeStatus =
  | { readonly _tag: "Unknown"; readonly lastError: string }
  | { readonly _tag: "Up"; readonly capacity: NodeCapacity; readonly lastSeenMillis: number }
  | { readonly _tag: "Lost"; readonly lost: NodeLost }

/** Answers one heartbeat of one node (the transport: control-plane RPC live, in-memory in tests). */
export interface NodeProbeService {
  readonly probe: (node: NodeEndpoint) => Effect.Effect<NodeCapacity, NodeUnreachable>
}

export interface HeartbeatOptions {
  /** Time between heartbeats to one node. */
  readonly interval: Duration.DurationInput
  /** A node that has not answered for this long is lost. */
  readonly deadline: Duration.DurationInput
}

/** A watched pool of nodes: heartbeats run while the scope is open. */
export interface Pool {
  readonly nodes: ReadonlyArray<NodeEndpoint>
  readonly status: Effect.Effect<ReadonlyMap<NodeId, NodeStatus>>
  /** Waits until every `needed` node has answered; fails with PoolNotReady after `timeout`. */
  readonly awaitReady: (
    needed: ReadonlyArray<NodeId>,
    timeout: Duration.DurationInput
  ) => Effect.Effect<ReadonlyMap<NodeId, NodeCapacity>, PoolNotReady>
  /** Completes with the first node lost (never, while all answer). */
  readonly firstLost: Effect.Effect<NodeLost>
  /** Declares a node lost now (e.g. its control connection closed); the first reason sticks. */
  readonly markLost: (nodeId: NodeId, reason: string) => Effect.Effect<void>
  /**
   * A lost node is back (e.g. restarted at the same address and reconnected): its heartbeats resume and it is
   * Unknown until it answers (then Up). Nothing for a node not lost.
   */
  readonly rejoin: (nodeId: NodeId) => Effect.Effect<void>
}

export interface MembershipService {
  /** Heartbeats `nodes` through `probe` while the scope is open. */
  readonly watch: (
    nodes: ReadonlyArray<NodeEndpoint>,
    probe: NodeProbeService,
    options: HeartbeatOptions
  ) => Effect.Effect<Pool, never, Scope.Scope>
}

export class Membership extends Context.Tag("swactor/Membership")<Membership, MembershipService>() {}
