import { Schema } from "effect"

/**
 * A number exactly as the planner was given it. Rejections carry the offending value, which may be NaN or infinite;
 * JSON has no such numbers, so these encode as the strings "NaN", "Infinity" and "-Infinity" and decode back.
 */
export const InputNumber = Schema.transform(
  Schema.Union(Schema.Number, Schema.Literal("NaN", "Infinity", "-Infinity")),
  Schema.Number,
  {
    strict: true,
    decode: (encoded) => (typeof encoded === "string" ? Number(encoded) : encoded),
    encode: (n) =>
      Number.isFinite(n) ? n : n > 0 ? ("Infinity" as const) : n < 0 ? ("-Infinity" as const) : ("NaN" as const)
  }
).annotations({ identifier: "InputNumber" })

/** Which of the planner input's two ring specs a rejection is about. */
export const RingName = Schema.Literal("activation", "token")
export type RingName = typeof RingName.Type

/** A placement entry names a node that is not in the orchestrator's candidate pool. */
export class UnknownNode extends Schema.TaggedError<UnknownNode>()("UnknownNode", {
  stageIndex: InputNumber,
  nodeId: InputNumber
}) {
  override get message() {
    return `stage ${this.stageIndex} is placed on node ${this.nodeId}, which is not in the candidate pool`
  }
}

/** Two placement entries claim the same stage index. */
export class DuplicateStageAssignment extends Schema.TaggedError<DuplicateStageAssignment>()(
  "DuplicateStageAssignment",
  { stageIndex: InputNumber, firstNodeId: InputNumber, secondNodeId: InputNumber }
) {
  override get message() {
    return `stage ${this.stageIndex} is assigned twice (to node ${this.firstNodeId} and to node ${this.secondNodeId})`
  }
}

/** A stage index inside `0..stageCount` has no placement entry. */
export class MissingStage extends Schema.TaggedError<MissingStage>()("MissingStage", {
  stageIndex: InputNumber,
  stageCount: InputNumber
}) {
  override get message() {
    return `stage ${this.stageIndex} of ${this.stageCount} has no placement entry`
  }
}

/** The stage count is not a positive integer. */
export class InvalidStageCount extends Schema.TaggedError<InvalidStageCount>()("InvalidStageCount", {
  stageCount: InputNumber
}) {
  override get message() {
    return `stage count ${this.stageCount} is invalid: a pipeline needs a whole number of stages, at least 1`
  }
}

/** The model has fewer layers than there are stages, so some stage would get an empty block range. */
export class ModelStageLayoutMismatch extends Schema.TaggedError<ModelStageLayoutMismatch>()(
  "ModelStageLayoutMismatch",
  { numLayers: InputNumber, stageCount: InputNumber }
) {
  override get message() {
    return `a model with ${this.numLayers} layers cannot be split into ${this.stageCount} non-empty stages`
  }
}

/** A placement entry names a stage index outside `0..stageCount`. */
export class StageIndexOutOfRange extends Schema.TaggedError<StageIndexOutOfRange>()("StageIndexOutOfRange", {
  stageIndex: InputNumber,
  stageCount: InputNumber
}) {
  override get message() {
    return `placement names stage index ${this.stageIndex}, outside 0..${this.stageCount}`
  }
}

/** A ring spec with zero (or non-integer) capacity or an alignment that is not a power of two. */
export class InvalidRingSpec extends Schema.TaggedError<InvalidRingSpec>()("InvalidRingSpec", {
  ring: RingName,
  field: Schema.Literal("dataCapacity", "alignment"),
  value: InputNumber
}) {
  override get message() {
    return this.field === "dataCapacity"
      ? `${this.ring} ring data capacity ${this.value} is invalid: it must be a positive whole number of bytes`
      : `${this.ring} ring alignment ${this.value} is invalid: it must be a power of two`
  }
}

/** The activation ring cannot hold one frame of one token's hidden state. */
export class ActivationRingTooSmall extends Schema.TaggedError<ActivationRingTooSmall>()("ActivationRingTooSmall", {
  dataCapacity: InputNumber,
  requiredBytes: InputNumber,
  hiddenDim: InputNumber,
  dtypeWidthBytes: InputNumber,
  alignment: InputNumber
}) {
  override get message() {
    return (
      `activation ring capacity ${this.dataCapacity} bytes cannot hold one token's hidden state: ` +
      `${this.hiddenDim} x ${this.dtypeWidthBytes} bytes aligned to ${this.alignment} = ${this.requiredBytes} bytes`
    )
  }
}

/** `maxTokens` is 0, not a whole number, or beyond the model's `maxSeqLen`. */
export class InvalidMaxTokens extends Schema.TaggedError<InvalidMaxTokens>()("InvalidMaxTokens", {
  maxTokens: InputNumber,
  maxSeqLen: InputNumber
}) {
  override get message() {
    return (
      `max tokens ${this.maxTokens} is invalid: ` +
      `it must be between 1 and the model's max sequence length ${this.maxSeqLen}`
    )
  }
}

/** The candidate pool lists the same node twice. */
export class DuplicateCandidateNode extends Schema.TaggedError<DuplicateCandidateNode>()("DuplicateCandidateNode", {
  nodeId: InputNumber
}) {
  override get message() {
    return `node ${this.nodeId} appears more than once in the candidate pool`
  }
}

/** A node id in the candidate pool, or the orchestrator's node id, is not a whole number >= 0. */
export class InvalidNodeId extends Schema.TaggedError<InvalidNodeId>()("InvalidNodeId", {
  role: Schema.Literal("orchestrator", "candidate"),
  value: InputNumber
}) {
  override get message() {
    return (
      `${this.role === "orchestrator" ? "orchestrator" : "candidate pool"} node id ${this.value} is invalid: ` +
      "it must be a whole number >= 0"
    )
  }
}

/** A model fact the plan relies on is not a positive whole number. */
export class InvalidModelFacts extends Schema.TaggedError<InvalidModelFacts>()("InvalidModelFacts", {
  field: Schema.Literal("numLayers", "hiddenDim", "dtypeWidthBytes", "maxSeqLen"),
  value: InputNumber
}) {
  override get message() {
    return `model ${this.field} ${this.value} is invalid: it must be a positive whole number`
  }
}

/** Explicit layer ranges that are not one non-empty, contiguous, complete range per stage. */
export class InvalidLayerRanges extends Schema.TaggedError<InvalidLayerRanges>()("InvalidLayerRanges", {
  ranges: Schema.String,
  reason: Schema.String
}) {
  override get message() {
    return `layer ranges ${this.ranges} are invalid: ${this.reason}`
  }
}

/** Every way planning can refuse an input. No rejection ever comes with a partial plan. */
export const PlanRejection = Schema.Union(
  UnknownNode,
  DuplicateStageAssignment,
  MissingStage,
  InvalidStageCount,
  ModelStageLayoutMismatch,
  StageIndexOutOfRange,
  InvalidRingSpec,
  ActivationRingTooSmall,
  InvalidMaxTokens,
  DuplicateCandidateNode,
  InvalidModelFacts,
  InvalidNodeId,
  InvalidLayerRanges
)
export type PlanRejection = typeof PlanRejection.Type

/** Projection of a stage that the plan does not contain. */
export class StageNotInPlan extends Schema.TaggedError<StageNotInPlan>()("StageNotInPlan", {
  stageIndex: InputNumber,
  stageCount: InputNumber
}) {
  override get message() {
    return `stage index ${this.stageIndex} is not in the plan (it has stages 0..${this.stageCount})`
  }
}

/** Every way projecting a stage can fail (one way today). */
export type ProjectionRejection = StageNotInPlan

/** A `--layers` text that is not a list of block ranges such as `0-9,10-15` (inclusive ends). */
export class InvalidLayerSpec extends Schema.TaggedError<InvalidLayerSpec>()("InvalidLayerSpec", {
  text: Schema.String,
  reason: Schema.String
}) {
  override get message() {
    return `--layers "${this.text}" is invalid: ${this.reason} (expected ranges like 0-9,10-15)`
  }
}

/** No split of the model over the pool keeps every node within its free memory. */
export class PoolMemoryTooSmall extends Schema.TaggedError<PoolMemoryTooSmall>()("PoolMemoryTooSmall", {
  /** Weights + KV + compute of the whole model on one stage. */
  requiredBytes: InputNumber,
  poolFreeBytes: InputNumber,
  largestNodeFreeBytes: InputNumber,
  nodes: InputNumber
}) {
  override get message() {
    const mib = (n: number) => `${(n / 2 ** 20).toFixed(1)} MiB`
    return (
      `the model does not fit in the pool's memory: it needs about ${mib(this.requiredBytes)} ` +
      `(weights + KV cache + compute buffers), the pool's ${this.nodes} node(s) have ${mib(this.poolFreeBytes)} free ` +
      `(largest ${mib(this.largestNodeFreeBytes)}), and no contiguous split fits every node`
    )
  }
}

/** A balanced or fixed placement puts more on one node than its free memory. */
export class StageOverMemory extends Schema.TaggedError<StageOverMemory>()("StageOverMemory", {
  nodeId: InputNumber,
  stageIndices: Schema.Array(InputNumber),
  requiredBytes: InputNumber,
  freeBytes: InputNumber
}) {
  override get message() {
    const mib = (n: number) => `${(n / 2 ** 20).toFixed(1)} MiB`
    return (
      `stage(s) ${this.stageIndices.join(", ")} on node ${this.nodeId} need about ${mib(this.requiredBytes)} ` +
      `(weights + KV cache + compute buffers) but the node has ${mib(this.freeBytes)} free; ` +
      "try --placement capacity or fewer blocks there"
    )
  }
}

/** The pool is empty, or a placement intent is malformed (stage count, ranges). */
export class InvalidPlacement extends Schema.TaggedError<InvalidPlacement>()("InvalidPlacement", {
  reason: Schema.String
}) {
  override get message() {
    return `invalid placement: ${this.reason}`
  }
}

/** Every way choosing a placement can fail. */
export const PlacementRejection = Schema.Union(
  InvalidLayerSpec,
  PoolMemoryTooSmall,
  StageOverMemory,
  InvalidPlacement,
  InvalidLayerRanges
)
export type PlacementRejection = typeof PlacementRejection.Type
