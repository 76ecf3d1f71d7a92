/**
 * What `swactor serve`'s console shows (`GET /api/status`, and each event of `GET /api/events`): the nodes and their
 * state, the plan (stages → block ranges → nodes, with each stage's weights and KV), the live figures and the models.
 * Derived from what the server already counts (its status, its metrics and the updates of its pipeline's runs):
 * src/layers/server/ConsoleStatus.ts.
 */
import { Schema } from "effect"

/** ready: serves; loading: its stages' weights are on their way (`progress` 0..1 when known); reviving: the pipeline waits for it to answer again; lost: given up on. */
export const ConsoleNodeState = Schema.Literal("ready", "loading", "reviving", "lost")
export type ConsoleNodeState = typeof ConsoleNodeState.Type

export const ConsoleNode = Schema.Struct({
  address: Schema.String,
  state: ConsoleNodeState,
  /** Loading: the share of its stages' weight bytes loaded so far (null: not reported yet). */
  progress: Schema.NullOr(Schema.Number),
  /** Why it is reviving or lost, in words ("" otherwise). */
  detail: Schema.String,
  /** As the node last reported them (null: it has not answered). */
  memoryUsedBytes: Schema.NullOr(Schema.Number),
  memoryTotalBytes: Schema.NullOr(Schema.Number),
  cores: Schema.NullOr(Schema.Number),
  backend: Schema.NullOr(Schema.String)
}).annotations({ identifier: "ConsoleNode" })
export type ConsoleNode = typeof ConsoleNode.Type

export const ConsoleStage = Schema.Struct({
  stageIndex: Schema.Number,
  /** The node hosting it. */
  address: Schema.String,
  /** Blocks [start, end). */
  layers: Schema.Tuple(Schema.Number, Schema.Number),
  /** Weight bytes it loads (its blocks, and the embeddings / output head where its role needs them). */
  weightBytes: Schema.Number,
  /** KV cache bytes of one sequence of `plan.contextTokens` tokens on it. */
  kvBytes: Schema.Number
}).annotations({ identifier: "ConsoleStage" })
export type ConsoleStage = typeof ConsoleStage.Type

export const ConsoleStatus = Schema.Struct({
  /** The server: loading, ready, reviving or faulted. */
  status: Schema.Literal("loading", "ready", "reviving", "faulted"),
  /** Why it is reviving or faulted, in words ("" otherwise). */
  detail: Schema.String,
  nodes: Schema.Array(ConsoleNode),
  /** As the pipeline's runs were last planned (empty stages: not planned yet). */
  plan: Schema.Struct({ contextTokens: Schema.Number, stages: Schema.Array(ConsoleStage) }),
  live: Schema.Struct({
    /** Generated tokens per second over the last seconds, all requests together. */
    tokensPerSecond: Schema.Number,
    /** Mean time to first token of the completed requests (null: none yet). */
    timeToFirstTokenSeconds: Schema.NullOr(Schema.Number),
    inFlight: Schema.Number,
    queued: Schema.Number,
    /** Generations resumed after a fault of their run; revivals of the whole pipeline. */
    recoveries: Schema.Number,
    revivals: Schema.Number,
    completed: Schema.Number,
    completionTokens: Schema.Number,
    /** Console event streams open now. */
    eventStreams: Schema.Number
  }),
  models: Schema.Array(
    Schema.Struct({
      /** The name requests give (`model`). */
      id: Schema.String,
      layers: Schema.NullOr(Schema.Number),
      contextLength: Schema.NullOr(Schema.Number)
    })
  )
}).annotations({ identifier: "ConsoleStatus" })
export type ConsoleStatus = typeof ConsoleStatus.Type
