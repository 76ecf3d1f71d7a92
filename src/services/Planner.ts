/**
 * Run planning: turns a planner input (model facts, runtime config, candidate nodes, placement intent, ring specs)
 * into one complete, validated `RunPlan`, or a typed `PlanRejection`. Pure and deterministic.
 */
import { Effect, Either } from "effect"
import { type EdgeId, type NodeId, PortId, RoleId, type RunId } from "../domain/ids.js"
import {
  alignUp,
  type Edge,
  type EdgeEndpoint,
  type LayerRange,
  type ModelFacts,
  type PlannerInput,
  ProvisionStage,
  type RingSpec,
  RunPlan,
  type SamplingPolicy,
  type StagePlan
} from "../domain/plan.js"
import {
  ActivationRingTooSmall,
  DuplicateCandidateNode,
  DuplicateStageAssignment,
  InvalidMaxTokens,
  InvalidLayerRanges,
  InvalidModelFacts,
  InvalidNodeId,
  InvalidRingSpec,
  InvalidStageCount,
  MissingStage,
  ModelStageLayoutMismatch,
  type PlanRejection,
  type ProjectionRejection,
  type RingName,
  StageIndexOutOfRange,
  StageNotInPlan,
  UnknownNode
} from "../domain/planErrors.js"

// Edge ids are minted here from validated indices; a cast avoids re-validating each brand.
const asEdgeId = (n: number) => n as EdgeId

/** Port names every stage exposes. */
export const INPUT_PORT = PortId.make("input")
export const OUTPUT_PORT = PortId.make("output")

const isPositiveInt = (n: number) => Number.isSafeInteger(n) && n > 0
const isNodeId = (n: number) => Number.isSafeInteger(n) && n >= 0
const isPowerOfTwo = (n: number) => isPositiveInt(n) && 2 ** Math.round(Math.log2(n)) === n

/** Bytes of one frame holding one token's hidden state: hiddenDim x dtype width, rounded up to the alignment. */
export const activationFrameBytes = (model: Pick<ModelFacts, "hiddenDim" | "dtypeWidthBytes">, alignment: number) =>
  alignUp(model.hiddenDim * model.dtypeWidthBytes, alignment)

/**
 * Balanced contiguous partition of `[0, numLayers)` into `stageCount` non-empty ranges: the first
 * `numLayers % stageCount` stages get one extra layer. Requires `1 <= stageCount <= numLayers`.
 */
export const partitionLayers = (
  numLayers: number,
  stageCount: number
): ReadonlyArray<readonly [start: number, endExclusive: number]> => {
  const base = Math.floor(numLayers / stageCount)
  const extra = numLayers % stageCount
  const ranges: Array<readonly [number, number]> = []
  let start = 0
  for (let i = 0; i < stageCount; i++) {
    const end = start + base + (i < extra ? 1 : 0)
    ranges.push([start, end])
    start = end
  }
  return ranges
}

/** `[0,5) [5,9)` for messages. */
export const formatLayerRanges = (ranges: ReadonlyArray<LayerRange>): string =>
  ranges.map(([start, end]) => `[${start}, ${end})`).join(" ")

/**
 * Why explicit layer ranges are not a valid split of `numLayers` blocks into `stageCount` stages (one non-empty
 * range per stage, contiguous from 0, complete), or undefined when they are.
 */
export const layerRangesProblem = (
  ranges: ReadonlyArray<LayerRange>,
  numLayers: number,
  stageCount: number
): string | undefined => {
  if (ranges.length !== stageCount) return `${ranges.length} ranges for ${stageCount} stages`
  let expectedStart = 0
  for (const [start, end] of ranges) {
    if (!Number.isSafeInteger(start) || !Number.isSafeInteger(end))
      return `range [${start}, ${end}) is not whole blocks`
    if (start !== expectedStart) {
      return start > expectedStart
        ? `blocks ${expectedStart}..${start - 1} are in no range`
        : `block ${start} is in two ranges`
    }
    if (end <= start) return `range [${start}, ${end}) is empty`
    expectedStart = end
  }
  if (expectedStart !== numLayers) {
    return expectedStart < numLayers
      ? `blocks ${expectedStart}..${numLayers - 1} are in no range`
      : `the ranges end at block ${expectedStart - 1} but the model has ${numLayers} blocks`
  }
  return undefined
}

const checkRing = (ring: RingSpec, name: RingName): InvalidRingSpec | undefined => {
  if (!isPositiveInt(ring.dataCapacity)) {
    return new InvalidRingSpec({ ring: name, field: "dataCapacity", value: ring.dataCapacity })
  }
  if (!isPowerOfTwo(ring.alignment)) {
    return new InvalidRingSpec({ ring: name, field: "alignment", value: ring.alignment })
  }
  return undefined
}

const validate = (input: PlannerInput): PlanRejection | ReadonlyArray<NodeId> => {
  const { model, stageCount } = input
  if (!isPositiveInt(stageCount)) return new InvalidStageCount({ stageCount })
  for (const field of ["numLayers", "hiddenDim", "dtypeWidthBytes", "maxSeqLen"] as const) {
    if (!isPositiveInt(model[field])) return new InvalidModelFacts({ field, value: model[field] })
  }
  if (model.numLayers < stageCount) {
    return new ModelStageLayoutMismatch({ numLayers: model.numLayers, stageCount })
  }
  const maxTokens = input.runtime.maxTokens
  if (!isPositiveInt(maxTokens) || maxTokens > model.maxSeqLen) {
    return new InvalidMaxTokens({ maxTokens, maxSeqLen: model.maxSeqLen })
  }
  const ringError = checkRing(input.activationRing, "activation") ?? checkRing(input.tokenRing, "token")
  if (ringError !== undefined) return ringError
  const requiredBytes = activationFrameBytes(model, input.activationRing.alignment)
  if (input.activationRing.dataCapacity < requiredBytes) {
    return new ActivationRingTooSmall({
      dataCapacity: input.activationRing.dataCapacity,
      requiredBytes,
      hiddenDim: model.hiddenDim,
      dtypeWidthBytes: model.dtypeWidthBytes,
      alignment: input.activationRing.alignment
    })
  }
  if (!isNodeId(input.orchestratorNodeId)) {
    return new InvalidNodeId({ role: "orchestrator", value: input.orchestratorNodeId })
  }
  const invalidNode = input.candidatePool.find((nodeId) => !isNodeId(nodeId))
  if (invalidNode !== undefined) return new InvalidNodeId({ role: "candidate", value: invalidNode })
  const pool = new Set<number>()
  for (const nodeId of input.candidatePool) {
    if (pool.has(nodeId)) return new DuplicateCandidateNode({ nodeId })
    pool.add(nodeId)
  }
  // The placement is checked one rule at a time over all its entries, in the order of the table in G5, so an
  // input with several faults is refused for the first rule it breaks, whatever the order of its entries.
  const entries = input.placement.stages
  const outOfRange = entries.find(
    ({ stageIndex }) => !Number.isSafeInteger(stageIndex) || stageIndex < 0 || stageIndex >= stageCount
  )
  if (outOfRange !== undefined) return new StageIndexOutOfRange({ stageIndex: outOfRange.stageIndex, stageCount })
  const unknown = entries.find(({ nodeId }) => !pool.has(nodeId))
  if (unknown !== undefined) return new UnknownNode({ stageIndex: unknown.stageIndex, nodeId: unknown.nodeId })
  const assigned = new Map<number, NodeId>()
  for (const { nodeId, stageIndex } of entries) {
    const first = assigned.get(stageIndex)
    if (first !== undefined) {
      return new DuplicateStageAssignment({ stageIndex, firstNodeId: first, secondNodeId: nodeId })
    }
    assigned.set(stageIndex, nodeId)
  }
  const nodes: Array<NodeId> = []
  for (let stageIndex = 0; stageIndex < stageCount; stageIndex++) {
    const nodeId = assigned.get(stageIndex)
    if (nodeId === undefined) return new MissingStage({ stageIndex, stageCount })
    nodes.push(nodeId)
  }
  if (input.layerRanges !== undefined) {
    const problem = layerRangesProblem(input.layerRanges, model.numLayers, stageCount)
    if (problem !== undefined) {
      return new InvalidLayerRanges({ ranges: formatLayerRanges(input.layerRanges), reason: problem })
    }
  }
  return nodes
}

const build = (input: PlannerInput, nodes: ReadonlyArray<NodeId>): RunPlan => {
  const { runId, stageCount } = input
  const model = input.model
  const ranges = input.layerRanges ?? partitionLayers(model.numLayers, stageCount)
  const orchestrator: EdgeEndpoint = { _tag: "Orchestrator", nodeId: input.orchestratorNodeId }
  const stageEndpoint = (stageIndex: number): EdgeEndpoint => ({
    _tag: "Stage",
    nodeId: nodes[stageIndex]!,
    stageIndex
  })
  // Edge ids: TokenIn = 0, the activation edge out of stage i = i + 1, TokenOut = stageCount. So stage i reads edge
  // i and writes edge i + 1.
  const edge = (edgeId: number, kind: Edge["kind"], producer: EdgeEndpoint, consumer: EdgeEndpoint): Edge => ({
    runId,
    edgeId: asEdgeId(edgeId),
    kind,
    producer,
    consumer,
    ring: kind === "Activation" ? input.activationRing : input.tokenRing
  })
  const edges: Array<Edge> = [edge(0, "TokenIn", orchestrator, stageEndpoint(0))]
  for (let i = 0; i + 1 < stageCount; i++) {
    edges.push(edge(i + 1, "Activation", stageEndpoint(i), stageEndpoint(i + 1)))
  }
  edges.push(edge(stageCount, "TokenOut", stageEndpoint(stageCount - 1), orchestrator))
  const stages = ranges.map(([layerStart, layerEndExclusive], stageIndex): StagePlan => ({
    runId,
    stageIndex,
    stageCount,
    nodeId: nodes[stageIndex]!,
    layerStart,
    layerEndExclusive,
    ggufSource: model.ggufSource,
    inboundEdge: asEdgeId(stageIndex),
    outboundEdge: asEdgeId(stageIndex + 1)
  }))
  // Every field was validated above; skipping the constructor's re-validation keeps 512-stage plans cheap.
  return new RunPlan(
    {
      runId,
      orchestratorNodeId: input.orchestratorNodeId,
      model,
      sampling: input.runtime.sampling,
      maxTokens: input.runtime.maxTokens,
      ...(input.runtime.replayTail === undefined ? {} : { replayTail: input.runtime.replayTail }),
      stages,
      edges
    },
    { disableValidation: true }
  )
}

/** `planRun` as a plain `Either`, for pure callers (the run FSM, tests). */
export const planRunEither = (input: PlannerInput): Either.Either<RunPlan, PlanRejection> => {
  const checked = validate(input)
  return "_tag" in checked ? Either.left(checked) : Either.right(build(input, checked))
}

/**
 * Forms one complete `RunPlan` from a planner input, or fails with the first `PlanRejection` found. Never a partial
 * plan. Deterministic: the same input gives the same plan.
 */
export const planRun = (input: PlannerInput): Effect.Effect<RunPlan, PlanRejection> =>
  Effect.suspend(() => planRunEither(input))

/** `deriveStageProvision` as a plain `Either`. */
export const deriveStageProvisionEither = (
  plan: RunPlan,
  stageIndex: number
): Either.Either<ProvisionStage, ProjectionRejection> => {
  const stage = plan.stages.find((s) => s.stageIndex === stageIndex)
  const inbound = stage && plan.edges.find((e) => e.edgeId === stage.inboundEdge)
  const outbound = stage && plan.edges.find((e) => e.edgeId === stage.outboundEdge)
  if (stage === undefined || inbound === undefined || outbound === undefined) {
    return Either.left(new StageNotInPlan({ stageIndex, stageCount: plan.stages.length }))
  }
  const isLast = stage.stageIndex + 1 === stage.stageCount
  const sampling: SamplingPolicy | null = isLast ? plan.sampling : null
  return Either.right(
    new ProvisionStage({
      runId: plan.runId,
      nodeId: stage.nodeId,
      stageIndex: stage.stageIndex,
      stageCount: stage.stageCount,
      layerStart: stage.layerStart,
      layerEndExclusive: stage.layerEndExclusive,
      ggufSource: stage.ggufSource,
      tokenizer: plan.model.tokenizer,
      model: plan.model,
      runtime: {
        roleId: RoleId.make(stage.stageIndex),
        inputPort: INPUT_PORT,
        outputPort: OUTPUT_PORT,
        sampling,
        ...(plan.replayTail === undefined ? {} : { replayTail: plan.replayTail })
      },
      inbound: { edgeId: inbound.edgeId, kind: inbound.kind, peer: inbound.producer, ring: inbound.ring },
      outbound: { edgeId: outbound.edgeId, kind: outbound.kind, peer: outbound.consumer, ring: outbound.ring }
    })
  )
}

/**
 * The message that tells the node hosting `stageIndex` what to load and run: its layer range, model facts, tokenizer,
 * role id (= stage index), ports "input"/"output", its inbound and outbound edges, and sampling on the last stage only.
 */
export const deriveStageProvision = (
  plan: RunPlan,
  stageIndex: number
): Effect.Effect<ProvisionStage, ProjectionRejection> =>
  Effect.suspend(() => deriveStageProvisionEither(plan, stageIndex))

/** The nodes hosting a plan's stages, in stage order. */
export const stageNodes = (plan: RunPlan): ReadonlyArray<NodeId> =>
  [...plan.stages].sort((a, b) => a.stageIndex - b.stageIndex).map((s) => s.nodeId)

/** A stage's position and host, for building test plans. */
export interface StageRef {
  readonly stageIndex: number
  readonly nodeId: NodeId
}

/**
 * A valid linear plan over the given stages for tests (the seed's `RunPlan::test_linear`): a small model with
 * two layers per stage, orchestrator node 0, four max tokens.
 */
export const testLinearPlan = (runId: RunId, stages: ReadonlyArray<StageRef>): RunPlan =>
  Either.getOrThrowWith(
    planRunEither({
      runId,
      orchestratorNodeId: 0 as NodeId,
      model: {
        modelId: "test-linear",
        ggufSource: { _tag: "LocalPath", path: "/models/test-linear.gguf" },
        numLayers: Math.max(1, stages.length) * 2,
        hiddenDim: 64,
        dtypeFamily: "Float",
        dtypeWidthBytes: 4,
        maxSeqLen: 2048,
        eosTokenId: 2,
        tokenizer: { _tag: "EmbeddedInGguf" }
      },
      runtime: { maxTokens: 4, sampling: { temperatureMillis: 0, topK: 1 } },
      candidatePool: [...new Set(stages.map((s) => s.nodeId))],
      stageCount: stages.length,
      placement: { _tag: "FixedLinear", stages },
      activationRing: {
        dataCapacity: 1 << 16,
        alignment: 64,
        direction: "Egress",
        hostPinning: "Pageable",
        wakeCoalescing: "PendingBit"
      },
      tokenRing: {
        dataCapacity: 4096,
        alignment: 8,
        direction: "Egress",
        hostPinning: "Pageable",
        wakeCoalescing: "PendingBit"
      }
    }),
    (rejection) => new Error(`testLinearPlan: ${rejection.message}`)
  )
