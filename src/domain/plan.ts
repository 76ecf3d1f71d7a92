import { Schema } from "effect"
import { EdgeId, NodeId, PortId, RoleId, RunId } from "./ids.js"

/** Numeric family of the model's activations. */
export const DTypeFamily = Schema.Literal("Float", "Half", "BFloat")
export type DTypeFamily = typeof DTypeFamily.Type

export const GgufSource = Schema.Union(
  Schema.TaggedStruct("LocalPath", { path: Schema.String })
)
export type GgufSource = typeof GgufSource.Type

export const TokenizerSource = Schema.Union(
  Schema.TaggedStruct("LocalPath", { path: Schema.String }),
  Schema.TaggedStruct("EmbeddedInGguf", {})
)
export type TokenizerSource = typeof TokenizerSource.Type

export class ModelFacts extends Schema.Class<ModelFacts>("ModelFacts")({
  modelId: Schema.String,
  ggufSource: GgufSource,
  numLayers: Schema.Number,
  hiddenDim: Schema.Number,
  dtypeFamily: DTypeFamily,
  dtypeWidthBytes: Schema.Number,
  maxSeqLen: Schema.Number,
  eosTokenId: Schema.Number,
  tokenizer: TokenizerSource
}) {}

export class SamplingPolicy extends Schema.Class<SamplingPolicy>("SamplingPolicy")({
  temperatureMillis: Schema.Number,
  topK: Schema.Number,
  seed: Schema.optional(Schema.Number)
}) {}

export class RuntimeConfig extends Schema.Class<RuntimeConfig>("RuntimeConfig")({
  maxTokens: Schema.Number,
  sampling: SamplingPolicy
}) {}

export const RingDirection = Schema.Literal("Egress", "Ingress")
export type RingDirection = typeof RingDirection.Type
export const HostPinning = Schema.Literal("Pageable", "Pinned")
export type HostPinning = typeof HostPinning.Type
export const WakeCoalescing = Schema.Literal("PendingBit", "EveryFrame")
export type WakeCoalescing = typeof WakeCoalescing.Type

/** Flow-control and framing contract of one edge: capacity = window in bytes, alignment = frame alignment. */
export class RingSpec extends Schema.Class<RingSpec>("RingSpec")({
  dataCapacity: Schema.Number,
  alignment: Schema.Number,
  direction: RingDirection,
  hostPinning: HostPinning,
  wakeCoalescing: WakeCoalescing
}) {}

export class StagePlacement extends Schema.Class<StagePlacement>("StagePlacement")({
  stageIndex: Schema.Number,
  nodeId: NodeId
}) {}

export const PlacementInput = Schema.Union(
  Schema.TaggedStruct("FixedLinear", { stages: Schema.Array(StagePlacement) })
)
export type PlacementInput = typeof PlacementInput.Type

export class PlannerInput extends Schema.Class<PlannerInput>("PlannerInput")({
  runId: RunId,
  orchestratorNodeId: NodeId,
  model: ModelFacts,
  runtime: RuntimeConfig,
  candidatePool: Schema.Array(NodeId),
  stageCount: Schema.Number,
  placement: PlacementInput,
  activationRing: RingSpec,
  tokenRing: RingSpec
}) {}

export const EdgeKind = Schema.Literal("TokenIn", "Activation", "TokenOut")
export type EdgeKind = typeof EdgeKind.Type

export const EdgeEndpoint = Schema.Union(
  Schema.TaggedStruct("Orchestrator", { nodeId: NodeId }),
  Schema.TaggedStruct("Stage", { nodeId: NodeId, stageIndex: Schema.Number })
)
export type EdgeEndpoint = typeof EdgeEndpoint.Type

export class Edge extends Schema.Class<Edge>("Edge")({
  runId: RunId,
  edgeId: EdgeId,
  kind: EdgeKind,
  producer: EdgeEndpoint,
  consumer: EdgeEndpoint,
  ring: RingSpec
}) {}

export class StagePlan extends Schema.Class<StagePlan>("StagePlan")({
  runId: RunId,
  stageIndex: Schema.Number,
  stageCount: Schema.Number,
  nodeId: NodeId,
  layerStart: Schema.Number,
  layerEndExclusive: Schema.Number,
  ggufSource: GgufSource,
  inboundEdge: EdgeId,
  outboundEdge: EdgeId
}) {}

export class RunPlan extends Schema.Class<RunPlan>("RunPlan")({
  runId: RunId,
  orchestratorNodeId: NodeId,
  model: ModelFacts,
  sampling: SamplingPolicy,
  maxTokens: Schema.Number,
  stages: Schema.Array(StagePlan),
  edges: Schema.Array(Edge)
}) {}

export class EdgeProvision extends Schema.Class<EdgeProvision>("EdgeProvision")({
  edgeId: EdgeId,
  kind: EdgeKind,
  peer: EdgeEndpoint,
  ring: RingSpec
}) {}

export class StageRuntime extends Schema.Class<StageRuntime>("StageRuntime")({
  roleId: RoleId,
  inputPort: PortId,
  outputPort: PortId,
  sampling: Schema.NullOr(SamplingPolicy)
}) {}

/** The message that tells one node to host one stage of one run. */
export class ProvisionStage extends Schema.Class<ProvisionStage>("ProvisionStage")({
  runId: RunId,
  nodeId: NodeId,
  stageIndex: Schema.Number,
  stageCount: Schema.Number,
  layerStart: Schema.Number,
  layerEndExclusive: Schema.Number,
  ggufSource: GgufSource,
  tokenizer: TokenizerSource,
  model: ModelFacts,
  runtime: StageRuntime,
  inbound: EdgeProvision,
  outbound: EdgeProvision
}) {}
