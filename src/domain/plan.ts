import { Schema } from "effect"
import { EdgeId, NodeId, PortId, RoleId, RunId } from "./ids.js"

/** Numeric family of the model's activations. */
/** Rounds `n` up to a multiple of `alignment` (a power of two). */
export const alignUp = (n: number, alignment: number): number => Math.ceil(n / alignment) * alignment

export const DTypeFamily = Schema.Literal("Float", "Half", "BFloat")
export type DTypeFamily = typeof DTypeFamily.Type

export const GgufSource = Schema.Union(Schema.TaggedStruct("LocalPath", { path: Schema.String }))
export type GgufSource = typeof GgufSource.Type

export const TokenizerSource = Schema.Union(
  Schema.TaggedStruct("LocalPath", { path: Schema.String }),
  Schema.TaggedStruct("EmbeddedInGguf", {})
)
export type TokenizerSource = typeof TokenizerSource.Type

export const ModelFacts = Schema.Struct({
  modelId: Schema.String,
  ggufSource: GgufSource,
  numLayers: Schema.Number,
  hiddenDim: Schema.Number,
  dtypeFamily: DTypeFamily,
  dtypeWidthBytes: Schema.Number,
  maxSeqLen: Schema.Number,
  eosTokenId: Schema.Number,
  tokenizer: TokenizerSource
}).annotations({ identifier: "ModelFacts" })
export type ModelFacts = typeof ModelFacts.Type

export const SamplingPolicy = Schema.Struct({
  temperatureMillis: Schema.Number,
  topK: Schema.Number,
  /** Nucleus sampling threshold (absent or ≥ 1: off). */
  topP: Schema.optional(Schema.Number),
  /** Minimum probability relative to the most likely token (absent or 0: off). */
  minP: Schema.optional(Schema.Number),
  seed: Schema.optional(Schema.Number),
  /** The position of the first draw (a generation resumed after n tokens draws from n on; absent: 0). */
  startPosition: Schema.optional(Schema.Number),
  /** llama.cpp's sampler chain settings (see SamplingOptions in services/Orchestrator.ts); absent: off. */
  typicalP: Schema.optional(Schema.Number),
  repeatPenalty: Schema.optional(Schema.Number),
  presencePenalty: Schema.optional(Schema.Number),
  frequencyPenalty: Schema.optional(Schema.Number),
  /** Recent tokens the penalties look at (absent: 64; -1: the whole context). */
  penaltyLastN: Schema.optional(Schema.Number),
  dry: Schema.optional(
    Schema.Struct({
      multiplier: Schema.Number,
      base: Schema.Number,
      allowedLength: Schema.Number,
      penaltyLastN: Schema.Number,
      sequenceBreakers: Schema.Array(Schema.String)
    })
  ),
  xtc: Schema.optional(Schema.Struct({ probability: Schema.Number, threshold: Schema.Number })),
  /** Finite biases added to token logits. */
  logitBias: Schema.optional(Schema.Array(Schema.Struct({ tokenId: Schema.Number, bias: Schema.Number }))),
  /** Tokens never sampled (a bias of -Infinity, which JSON cannot carry). */
  bannedTokens: Schema.optional(Schema.Array(Schema.Number)),
  grammar: Schema.optional(Schema.Struct({ text: Schema.String, root: Schema.String })),
  /** Report log-probabilities with each token: the sampled one's and this many top alternatives (0-20). */
  logprobs: Schema.optional(Schema.Number),
  /**
   * A generation resumed after a loss: the tokens it produced so far (accepted again by the grammar and penalties)
   * and the draws its sampler's random generator had made (the new one skips them).
   */
  resume: Schema.optional(Schema.Struct({ tokens: Schema.Array(Schema.Number), draws: Schema.Number }))
}).annotations({ identifier: "SamplingPolicy" })
export type SamplingPolicy = typeof SamplingPolicy.Type

export const RuntimeConfig = Schema.Struct({
  maxTokens: Schema.Number,
  sampling: SamplingPolicy,
  /**
   * A resumed generation's prompt ends with the tokens it already produced: its last `replayTail` rows. Every stage
   * runs those rows one per forward, as the decode steps that produced them ran, so the replay computes the very
   * bits the interrupted run did (a prefill of them takes other kernels, and a near tie may then pick another token).
   * Absent: 0.
   */
  replayTail: Schema.optional(Schema.Number)
}).annotations({ identifier: "RuntimeConfig" })
export type RuntimeConfig = typeof RuntimeConfig.Type

export const RingDirection = Schema.Literal("Egress", "Ingress")
export type RingDirection = typeof RingDirection.Type
export const HostPinning = Schema.Literal("Pageable", "Pinned")
export type HostPinning = typeof HostPinning.Type
export const WakeCoalescing = Schema.Literal("PendingBit", "EveryFrame")
export type WakeCoalescing = typeof WakeCoalescing.Type

/** Flow-control and framing contract of one edge: capacity = window in bytes, alignment = frame alignment. */
export const RingSpec = Schema.Struct({
  dataCapacity: Schema.Number,
  alignment: Schema.Number,
  direction: RingDirection,
  hostPinning: HostPinning,
  wakeCoalescing: WakeCoalescing
}).annotations({ identifier: "RingSpec" })
export type RingSpec = typeof RingSpec.Type

export const StagePlacement = Schema.Struct({
  stageIndex: Schema.Number,
  nodeId: NodeId
}).annotations({ identifier: "StagePlacement" })
export type StagePlacement = typeof StagePlacement.Type

export const PlacementInput = Schema.Union(Schema.TaggedStruct("FixedLinear", { stages: Schema.Array(StagePlacement) }))
export type PlacementInput = typeof PlacementInput.Type

/** A stage's block range `[start, endExclusive)`. */
export const LayerRange = Schema.Tuple(Schema.Number, Schema.Number)
export type LayerRange = typeof LayerRange.Type

export const PlannerInput = Schema.Struct({
  runId: RunId,
  orchestratorNodeId: NodeId,
  model: ModelFacts,
  runtime: RuntimeConfig,
  candidatePool: Schema.Array(NodeId),
  stageCount: Schema.Number,
  placement: PlacementInput,
  /**
   * Each stage's block range, in stage order (from a placement intent: `capacity` or `fixed`). Absent: the balanced
   * split (`partitionLayers`). Present: must be non-empty, contiguous from 0 and complete, one range per stage.
   */
  layerRanges: Schema.optional(Schema.Array(LayerRange)),
  activationRing: RingSpec,
  tokenRing: RingSpec
}).annotations({ identifier: "PlannerInput" })
export type PlannerInput = typeof PlannerInput.Type

export const EdgeKind = Schema.Literal("TokenIn", "Activation", "TokenOut")
export type EdgeKind = typeof EdgeKind.Type

export const EdgeEndpoint = Schema.Union(
  Schema.TaggedStruct("Orchestrator", { nodeId: NodeId }),
  Schema.TaggedStruct("Stage", { nodeId: NodeId, stageIndex: Schema.Number })
)
export type EdgeEndpoint = typeof EdgeEndpoint.Type

export const Edge = Schema.Struct({
  runId: RunId,
  edgeId: EdgeId,
  kind: EdgeKind,
  producer: EdgeEndpoint,
  consumer: EdgeEndpoint,
  ring: RingSpec
}).annotations({ identifier: "Edge" })
export type Edge = typeof Edge.Type

export const StagePlan = Schema.Struct({
  runId: RunId,
  stageIndex: Schema.Number,
  stageCount: Schema.Number,
  nodeId: NodeId,
  layerStart: Schema.Number,
  layerEndExclusive: Schema.Number,
  ggufSource: GgufSource,
  inboundEdge: EdgeId,
  outboundEdge: EdgeId
}).annotations({ identifier: "StagePlan" })
export type StagePlan = typeof StagePlan.Type

export class RunPlan extends Schema.Class<RunPlan>("RunPlan")({
  runId: RunId,
  orchestratorNodeId: NodeId,
  model: ModelFacts,
  sampling: SamplingPolicy,
  maxTokens: Schema.Number,
  /** See RuntimeConfig.replayTail. */
  replayTail: Schema.optional(Schema.Number),
  stages: Schema.Array(StagePlan),
  edges: Schema.Array(Edge)
}) {}

export const EdgeProvision = Schema.Struct({
  edgeId: EdgeId,
  kind: EdgeKind,
  peer: EdgeEndpoint,
  ring: RingSpec
}).annotations({ identifier: "EdgeProvision" })
export type EdgeProvision = typeof EdgeProvision.Type

export const StageRuntime = Schema.Struct({
  roleId: RoleId,
  inputPort: PortId,
  outputPort: PortId,
  sampling: Schema.NullOr(SamplingPolicy),
  /** See RuntimeConfig.replayTail: this stage runs the last `replayTail` rows of its prompt one per forward. */
  replayTail: Schema.optional(Schema.Number)
}).annotations({ identifier: "StageRuntime" })
export type StageRuntime = typeof StageRuntime.Type

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

/**
 * What placement needs to know about a model's memory and work, per block, from its GGUF tensor table: weight bytes
 * of each block, the input embedding (stage 0) and the output head (last stage: `output_norm` + `output`, or the
 * tied `token_embd`), and KV-cache bytes per token of context for each block (F16 K and V).
 */
export const ModelLayout = Schema.Struct({
  blockBytes: Schema.Array(Schema.Number),
  /**
   * Weight bytes each block reads per token: a mixture of experts' stacked expert tensors count
   * `expert_used_count / expert_count` of their bytes, everything else whole. Absent: equal to `blockBytes` (dense).
   */
  activeBlockBytes: Schema.optional(Schema.Array(Schema.Number)),
  kvBytesPerToken: Schema.Array(Schema.Number),
  /**
   * Sliding-window attention (gemma3): the window and, per block, whether the block slides; a sliding block's cache is
   * capped near the window (services/KvSize.ts swaCacheSize) whatever the context. Absent: every block holds the context.
   */
  slidingWindow: Schema.optional(Schema.Struct({ window: Schema.Number, blocks: Schema.Array(Schema.Boolean) })),
  /**
   * Recurrent-state bytes one sequence holds in each block, whatever the context (qwen35's DeltaNet blocks: conv +
   * SSM state, F32; their kvBytesPerToken is 0). Absent: none.
   */
  stateBytes: Schema.optional(Schema.Array(Schema.Number)),
  /**
   * false: the model's stages cannot roll a sequence back by starting its next step earlier (deepseek4's compressed
   * rows are not checked for it), so speculative decoding is off for it. Absent: they can (recurrent states roll back
   * through a verify step's per-row snapshots, DSA's indexer keys are written over by position like KV cells).
   */
  rewind: Schema.optional(Schema.Literal(false)),
  /**
   * Per block, the block whose KV cache it reads (gemma4's shared KV layers, services/KvShare.ts): itself, or an
   * earlier block it must share a stage with (its kvBytesPerToken is 0). Absent: every block reads its own.
   */
  kvSources: Schema.optional(Schema.Array(Schema.Number)),
  /**
   * Per block, the block whose sparse-attention top-k it reuses (glm-dsa's shared indexers, services/KvShare.ts):
   * itself, or an earlier block it must share a stage with. Absent: every block picks its own.
   */
  topKSources: Schema.optional(Schema.Array(Schema.Number)),
  /**
   * Per block, 0 when it reads the token ids (deepseek4's hash-routed blocks, which only the first stage has), else
   * itself. Absent: no block reads them.
   */
  tokenSources: Schema.optional(Schema.Array(Schema.Number)),
  inputBytes: Schema.Number,
  outputBytes: Schema.Number,
  hiddenDim: Schema.Number
}).annotations({ identifier: "ModelLayout" })
export type ModelLayout = typeof ModelLayout.Type

/**
 * How blocks are assigned to nodes. `Balanced`: today's equal split over `stageCount` stages on the pool in order.
 * `Speed`: the same `stageCount` stages on the same nodes in the same order, each node's share of the blocks by its
 * measured speed within its memory (a node 10 times slower gets fewer blocks); the equal split when that is about as
 * fast. `Capacity`: blocks in proportion to measured speed within each node's memory, possibly on fewer nodes.
 * `Fixed`: the user's ranges (`--layers 0-9,10-15`), stage i on the i-th node of the pool (cycling).
 */
export const PlacementIntent = Schema.Union(
  Schema.TaggedStruct("Balanced", { stageCount: Schema.Number }),
  Schema.TaggedStruct("Speed", { stageCount: Schema.Number }),
  Schema.TaggedStruct("Capacity", {}),
  Schema.TaggedStruct("Fixed", { ranges: Schema.Array(LayerRange) })
)
export type PlacementIntent = typeof PlacementIntent.Type

/** One candidate node as placement sees it: free memory for this run and weight bytes it processes per second. */
export const PoolNode = Schema.Struct({
  nodeId: NodeId,
  freeMemoryBytes: Schema.Number,
  speedBytesPerSecond: Schema.Number
}).annotations({ identifier: "PoolNode" })
export type PoolNode = typeof PoolNode.Type

/** One stage of a chosen placement, with the figures that explain it. */
export const PlacedStage = Schema.Struct({
  stageIndex: Schema.Number,
  nodeId: NodeId,
  layerStart: Schema.Number,
  layerEndExclusive: Schema.Number,
  /** Weight bytes this stage loads (blocks, plus embeddings / output head where its role needs them). */
  weightBytes: Schema.Number,
  /** Weight bytes it reads per token (a mixture of experts reads only the routed experts; the output head whole). */
  activeBytes: Schema.Number,
  /** Weights + KV cache + compute buffers. */
  memoryBytes: Schema.Number,
  /** Expected milliseconds per token in the planner's cost model (active bytes / speed + one hop). */
  expectedMillis: Schema.Number
}).annotations({ identifier: "PlacedStage" })
export type PlacedStage = typeof PlacedStage.Type

export const PlacementChoice = Schema.Struct({
  intent: Schema.Literal("Balanced", "Speed", "Capacity", "Fixed"),
  stages: Schema.Array(PlacedStage),
  /**
   * `Speed`: the slowest stage's ms per token had the blocks been split equally over the same stages (the speed split
   * replaces it only when clearly faster: `SPEED_SPLIT_MIN_GAIN`); absent when the equal split does not fit.
   */
  equalSplitMillis: Schema.optional(Schema.Number),
  /** The slowest stage's ms per token: the pipeline's throughput limit when every stage is kept busy. */
  bottleneckMillis: Schema.Number,
  /** Sum of the stages' ms: one token's trip through the pipeline (a single sequence's decode time). */
  latencyMillis: Schema.Number
}).annotations({ identifier: "PlacementChoice" })
export type PlacementChoice = typeof PlacementChoice.Type
