// Port of `mod run_plan` in spec/orchestration_guarantees.rs: black-box contract tests for RunPlan formation.
// They know only the public planning surface (`planRun`, `deriveStageProvision`) and assert the guarantees in
// specs/BEHAVIOR_GUARANTEES.md (G1–G10).
import { assert, describe, it } from "@effect/vitest"
import { Effect, Either, Schema } from "effect"
import { type NodeId, PortId, RoleId, RunId } from "../../src/domain/ids.js"
import {
  type EdgeEndpoint,
  type PlacementInput,
  type PlannerInput,
  ProvisionStage,
  type RingSpec,
  RunPlan,
  type StagePlacement
} from "../../src/domain/plan.js"
import { PlanRejection } from "../../src/domain/planErrors.js"
import { deriveStageProvision, planRun } from "../../src/services/Planner.js"

// Keep test node ids small and readable.
const node = (id: number) => id as NodeId

// The candidate pool is deliberately larger than some placements, to tell "known to the orchestrator" from
// "assigned to a stage".
const validNodes = (): Array<NodeId> => [node(10), node(11), node(12), node(13)]

// Fixed linear placement: stage i on node 10 + i.
const linearPlacement = (stageCount: number): PlacementInput => ({
  _tag: "FixedLinear",
  stages: Array.from({ length: stageCount }, (_, stageIndex) => ({ stageIndex, nodeId: node(10 + stageIndex) }))
})

const ring = (dataCapacity: number, alignment: number): RingSpec => ({
  dataCapacity,
  alignment,
  direction: "Egress",
  hostPinning: "Pageable",
  wakeCoalescing: "PendingBit"
})

// The canonical valid fixture. Each test tweaks only the fact it proves.
const validInput = (stageCount: number, numLayers: number): PlannerInput => ({
  runId: RunId.make(7),
  orchestratorNodeId: node(99),
  model: {
    modelId: "test-gguf",
    ggufSource: { _tag: "LocalPath", path: "/models/test-gguf.gguf" },
    numLayers,
    hiddenDim: 4096,
    dtypeFamily: "BFloat",
    dtypeWidthBytes: 2,
    maxSeqLen: 2048,
    eosTokenId: 2,
    tokenizer: { _tag: "LocalPath", path: "/tokenizers/test-gguf.json" }
  },
  runtime: { maxTokens: 4, sampling: { temperatureMillis: 125, topK: 7 } },
  candidatePool: validNodes(),
  stageCount,
  placement: linearPlacement(stageCount),
  activationRing: ring(1 << 20, 64),
  tokenRing: ring(4096, 8)
})

// Orchestrator endpoints stay outside the stage index space.
const edgeStageIndex = (endpoint: EdgeEndpoint): number | undefined =>
  endpoint._tag === "Orchestrator" ? undefined : endpoint.stageIndex

const withPlacement = (input: PlannerInput, stages: ReadonlyArray<StagePlacement>): PlannerInput => ({
  ...input,
  placement: { _tag: "FixedLinear", stages }
})

describe("run_plan", () => {
  // This proves RunPlan formation is a total public boundary for valid input: the caller observes one complete plan,
  // not hidden follow-up topology work or a partially initialized result.
  it.effect("valid_input_emits_one_complete_plan", () =>
    Effect.gen(function* () {
      const plan = yield* planRun(validInput(3, 36))

      assert.strictEqual(plan.runId, 7)
      assert.strictEqual(plan.stages.length, 3)
      assert.strictEqual(plan.edges.length, 4)
      assert.strictEqual(plan.maxTokens, 4)
      assert.strictEqual(plan.model.modelId, "test-gguf")
      assert.deepStrictEqual(plan.model.ggufSource, { _tag: "LocalPath", path: "/models/test-gguf.gguf" })
      assert.strictEqual(plan.model.numLayers, 36)
      assert.strictEqual(plan.model.hiddenDim, 4096)
      assert.strictEqual(plan.model.dtypeFamily, "BFloat")
      assert.strictEqual(plan.model.dtypeWidthBytes, 2)
      assert.strictEqual(plan.model.maxSeqLen, 2048)
      assert.strictEqual(plan.model.eosTokenId, 2)
      assert.deepStrictEqual(plan.model.tokenizer, { _tag: "LocalPath", path: "/tokenizers/test-gguf.json" })
      assert.deepStrictEqual(plan.sampling, { temperatureMillis: 125, topK: 7 })

      // Every stage is bound to this run and knows the run's stage count.
      for (const stage of plan.stages) {
        assert.strictEqual(stage.runId, plan.runId)
        assert.strictEqual(stage.stageCount, 3)
        assert.deepStrictEqual(stage.ggufSource, plan.model.ggufSource)
      }
      // Every edge is bound to this run; no edge is a loose fact.
      for (const edge of plan.edges) {
        assert.strictEqual(edge.runId, plan.runId)
      }
    })
  )

  // This proves layer assignment is a contiguous, non-overlapping partition of the intended GGUF block range, with
  // one non-empty range per stage.
  it.effect("stage_ranges_partition_the_model_layers", () =>
    Effect.gen(function* () {
      for (const [stageCount, numLayers] of [
        [1, 12],
        [2, 24],
        [3, 36],
        [4, 40]
      ] as const) {
        const plan = yield* planRun(validInput(stageCount, numLayers))
        const ranges = plan.stages
          .map((stage) => [stage.stageIndex, stage.layerStart, stage.layerEndExclusive] as const)
          .sort((a, b) => a[0] - b[0])

        let expectedStart = 0
        for (const [, start, end] of ranges) {
          assert.strictEqual(start, expectedStart, "range gap or overlap")
          assert.isTrue(end > start, "stage range must be non-empty")
          assert.isTrue(end <= numLayers, "stage range exceeds model layer range")
          expectedStart = end
        }
        // The final end covers the whole intended block range.
        assert.strictEqual(expectedStart, numLayers)
      }
    })
  )

  // This proves every edge has one public producer and one public consumer, and that the returned edge graph is
  // exactly the MVP linear pipeline.
  it.effect("edge_graph_is_exactly_the_linear_pipeline", () =>
    Effect.gen(function* () {
      const stageCount = 4
      const plan = yield* planRun(validInput(stageCount, 40))

      // Token-in is unique and enters stage 0 from the orchestrator.
      const tokenIn = plan.edges.filter((edge) => edge.kind === "TokenIn")
      assert.strictEqual(tokenIn.length, 1)
      assert.deepStrictEqual(tokenIn[0]!.producer, { _tag: "Orchestrator", nodeId: node(99) })
      assert.deepStrictEqual(tokenIn[0]!.consumer, { _tag: "Stage", nodeId: node(10), stageIndex: 0 })

      // Activation edges are the only stage-to-stage edges, one per adjacent stage pair.
      const activationEdges = plan.edges.filter((edge) => edge.kind === "Activation")
      assert.strictEqual(activationEdges.length, stageCount - 1)

      // Each activation edge produced by stage i is consumed by stage i + 1.
      for (let stageIndex = 0; stageIndex < stageCount - 1; stageIndex++) {
        const edge = activationEdges.find((edge) => edgeStageIndex(edge.producer) === stageIndex)
        assert.isDefined(edge, "activation edge produced by stage")
        assert.deepStrictEqual(edge!.consumer, {
          _tag: "Stage",
          nodeId: node(11 + stageIndex),
          stageIndex: stageIndex + 1
        })
        assert.notDeepEqual(edge!.producer, edge!.consumer, "self-edge is forbidden")
      }

      // Token-out is unique and leaves the final stage for the orchestrator.
      const tokenOut = plan.edges.filter((edge) => edge.kind === "TokenOut")
      assert.strictEqual(tokenOut.length, 1)
      assert.strictEqual(edgeStageIndex(tokenOut[0]!.producer), stageCount - 1)
      assert.deepStrictEqual(tokenOut[0]!.consumer, { _tag: "Orchestrator", nodeId: node(99) })
    })
  )

  // This proves edge ids are run-unique and that stage plans refer only to edge ids present in the returned RunPlan,
  // so stages receive assigned ids rather than deriving data-flow identity themselves.
  it.effect("edge_ids_are_unique_and_stage_references_resolve_to_plan_edges", () =>
    Effect.gen(function* () {
      const plan = yield* planRun(validInput(4, 40))
      const edgeIds = new Set(plan.edges.map((edge) => edge.edgeId))
      assert.strictEqual(edgeIds.size, plan.edges.length, "duplicate edge id")

      for (const stage of plan.stages) {
        assert.isTrue(edgeIds.has(stage.inboundEdge), "stage inbound edge id must come from RunPlan edges")
        assert.isTrue(edgeIds.has(stage.outboundEdge), "stage outbound edge id must come from RunPlan edges")
      }
    })
  )

  // This proves deriving ProvisionStage is deterministic and stage-local: repeated projection returns the same value,
  // and the projected layer range is exactly the range assigned to that stage in the RunPlan.
  it.effect("provision_stage_projection_is_deterministic_and_stage_local", () =>
    Effect.gen(function* () {
      const plan = yield* planRun(validInput(3, 36))

      for (let stageIndex = 0; stageIndex < 3; stageIndex++) {
        // Derive twice: projection depends on no hidden mutable state or call order.
        const first = yield* deriveStageProvision(plan, stageIndex)
        const second = yield* deriveStageProvision(plan, stageIndex)
        const stage = plan.stages.find((stage) => stage.stageIndex === stageIndex)!

        assert.deepStrictEqual(first, second)
        assert.strictEqual(first.stageIndex, stageIndex)
        assert.strictEqual(first.stageCount, 3)
        assert.strictEqual(first.layerStart, stage.layerStart)
        assert.strictEqual(first.layerEndExclusive, stage.layerEndExclusive)
        assert.deepStrictEqual(first.ggufSource, stage.ggufSource)
        assert.deepStrictEqual(first.tokenizer, plan.model.tokenizer)
        assert.strictEqual(first.model.modelId, plan.model.modelId)
        assert.strictEqual(first.model.hiddenDim, plan.model.hiddenDim)
        assert.strictEqual(first.model.dtypeFamily, plan.model.dtypeFamily)
        assert.strictEqual(first.model.dtypeWidthBytes, plan.model.dtypeWidthBytes)
        assert.strictEqual(first.model.maxSeqLen, plan.model.maxSeqLen)
        assert.strictEqual(first.runtime.roleId, RoleId.make(stageIndex))
        assert.strictEqual(first.runtime.inputPort, PortId.make("input"))
        assert.strictEqual(first.runtime.outputPort, PortId.make("output"))
        const expectedSampling = stageIndex + 1 === stage.stageCount ? plan.sampling : null
        assert.deepStrictEqual(first.runtime.sampling, expectedSampling)
      }
    })
  )

  // This proves each stage receives exactly one inbound and one outbound edge provision, and that the provisioned ids
  // are the ids assigned to that stage by the RunPlan.
  it.effect("provision_stage_contains_exactly_the_assigned_inbound_and_outbound_edges", () =>
    Effect.gen(function* () {
      const plan = yield* planRun(validInput(3, 36))
      for (const stage of plan.stages) {
        const provision = yield* deriveStageProvision(plan, stage.stageIndex)
        assert.strictEqual(provision.inbound.edgeId, stage.inboundEdge)
        assert.strictEqual(provision.outbound.edgeId, stage.outboundEdge)
      }
    })
  )

  // This proves typed rejection is the public behavior for invalid authority and topology inputs. No invalid case is
  // allowed to emit a partial plan.
  it.effect("invalid_authority_and_topology_inputs_reject_without_plan", () =>
    Effect.gen(function* () {
      const cases: ReadonlyArray<readonly [PlannerInput, PlanRejection["_tag"], string]> = [
        [invalidUnknownNode(), "UnknownNode", "unknown node id"],
        [invalidDuplicateStageAssignment(), "DuplicateStageAssignment", "duplicate stage assignment"],
        [invalidMissingStageAssignment(), "MissingStage", "missing stage"],
        [invalidZeroStageCount(), "InvalidStageCount", "invalid stage count"],
        [invalidModelStageLayout(), "ModelStageLayoutMismatch", "model/stage layout mismatch"]
      ]
      for (const [input, expected, label] of cases) {
        const result = yield* Effect.either(planRun(input))
        assert.isTrue(Either.isLeft(result), label)
        if (Either.isLeft(result)) assert.strictEqual(result.left._tag, expected, label)
      }
    })
  )
})

// Unknown node: the placement names a node outside the candidate pool.
const invalidUnknownNode = () =>
  withPlacement(validInput(3, 36), [
    { stageIndex: 0, nodeId: node(10) },
    { stageIndex: 1, nodeId: node(404) },
    { stageIndex: 2, nodeId: node(12) }
  ])

// Duplicate stage: two entries claim stage 1; the planner must not silently pick one.
const invalidDuplicateStageAssignment = () =>
  withPlacement(validInput(3, 36), [
    { stageIndex: 0, nodeId: node(10) },
    { stageIndex: 1, nodeId: node(11) },
    { stageIndex: 1, nodeId: node(12) }
  ])

// Missing stage: placement skips stage 1 inside 0..stageCount; the planner must not invent an owner.
const invalidMissingStageAssignment = () =>
  withPlacement(validInput(3, 36), [
    { stageIndex: 0, nodeId: node(10) },
    { stageIndex: 2, nodeId: node(12) }
  ])

// Zero stages cannot form a pipeline.
const invalidZeroStageCount = () => validInput(0, 36)

// Fewer layers than stages forces an empty range, so it rejects at the model/stage layout boundary.
const invalidModelStageLayout = () => ({ ...validInput(4, 3), placement: linearPlacement(4) })

// Rejections beyond the seed's five (G5). Each changes one fact of the valid fixture, and checks the tag, the fields
// and that the message names the offending value.
describe("planner rejections beyond the seed", () => {
  const rejects = (input: PlannerInput, tag: PlanRejection["_tag"], inMessage: string) =>
    Effect.gen(function* () {
      const error = yield* Effect.flip(planRun(input))
      assert.strictEqual(error._tag, tag)
      assert.include(error.message, inMessage)
      return error
    })

  it.effect("placement entry with a stage index outside 0..stageCount is rejected", () =>
    Effect.gen(function* () {
      const input = withPlacement(validInput(3, 36), [
        { stageIndex: 0, nodeId: node(10) },
        { stageIndex: 1, nodeId: node(11) },
        { stageIndex: 2, nodeId: node(12) },
        { stageIndex: 3, nodeId: node(13) }
      ])
      const error = yield* rejects(input, "StageIndexOutOfRange", "3")
      assert.deepInclude(error, { stageIndex: 3, stageCount: 3 })
    })
  )

  it.effect("ring specs with zero capacity or a non-power-of-two alignment are rejected", () =>
    Effect.gen(function* () {
      yield* rejects({ ...validInput(3, 36), activationRing: ring(0, 64) }, "InvalidRingSpec", "capacity 0")
      yield* rejects({ ...validInput(3, 36), tokenRing: ring(4096, 24) }, "InvalidRingSpec", "alignment 24")
      const zeroAlign = yield* rejects({ ...validInput(3, 36), tokenRing: ring(4096, 0) }, "InvalidRingSpec", "token")
      assert.deepInclude(zeroAlign, { ring: "token", field: "alignment", value: 0 })
    })
  )

  it.effect("an activation ring smaller than one aligned hidden-state frame is rejected", () =>
    Effect.gen(function* () {
      // 4096 x 2 bytes = 8192 fits exactly; one byte less does not.
      yield* planRun({ ...validInput(3, 36), activationRing: ring(8192, 64) })
      const error = yield* rejects(
        { ...validInput(3, 36), activationRing: ring(8191, 64) },
        "ActivationRingTooSmall",
        "8191"
      )
      assert.deepInclude(error, { requiredBytes: 8192, hiddenDim: 4096, dtypeWidthBytes: 2 })
      // Alignment rounds the frame up: 100 x 2 = 200 bytes aligned to 256 needs 256.
      const odd = { ...validInput(3, 36), model: { ...validInput(3, 36).model, hiddenDim: 100 } }
      yield* rejects({ ...odd, activationRing: ring(255, 256) }, "ActivationRingTooSmall", "256")
    })
  )

  it.effect("maxTokens of 0 or beyond maxSeqLen is rejected", () =>
    Effect.gen(function* () {
      const sampling = { temperatureMillis: 0, topK: 1 }
      yield* rejects({ ...validInput(3, 36), runtime: { maxTokens: 0, sampling } }, "InvalidMaxTokens", "0")
      yield* rejects({ ...validInput(3, 36), runtime: { maxTokens: 2049, sampling } }, "InvalidMaxTokens", "2049")
      const atLimit = yield* planRun({ ...validInput(3, 36), runtime: { maxTokens: 2048, sampling } })
      assert.strictEqual(atLimit.maxTokens, 2048)
    })
  )

  it.effect("a candidate pool with a duplicate node is rejected", () =>
    Effect.gen(function* () {
      const input = { ...validInput(3, 36), candidatePool: [node(10), node(11), node(12), node(11)] }
      const error = yield* rejects(input, "DuplicateCandidateNode", "node 11")
      assert.deepInclude(error, { nodeId: node(11) })
    })
  )

  it.effect("the orchestrator node may also host a stage", () =>
    Effect.gen(function* () {
      const plan = yield* planRun({ ...validInput(3, 36), orchestratorNodeId: node(10) })
      assert.deepStrictEqual(plan.edges[0]!.producer, { _tag: "Orchestrator", nodeId: node(10) })
      assert.strictEqual(plan.stages[0]!.nodeId, 10)
    })
  )

  it.effect("the seed's rejections name the offending value", () =>
    Effect.gen(function* () {
      yield* rejects(invalidUnknownNode(), "UnknownNode", "node 404")
      yield* rejects(invalidDuplicateStageAssignment(), "DuplicateStageAssignment", "stage 1")
      yield* rejects(invalidMissingStageAssignment(), "MissingStage", "stage 1")
      yield* rejects(invalidZeroStageCount(), "InvalidStageCount", "0")
      yield* rejects(invalidModelStageLayout(), "ModelStageLayoutMismatch", "3 layers")
    })
  )

  it.effect("FixedLinear placement is balanced and deterministic", () =>
    Effect.gen(function* () {
      const plan = yield* planRun(validInput(4, 10))
      const ranges = plan.stages.map((s) => [s.layerStart, s.layerEndExclusive])
      assert.deepStrictEqual(ranges, [
        [0, 3],
        [3, 6],
        [6, 8],
        [8, 10]
      ])
      assert.deepStrictEqual(yield* planRun(validInput(4, 10)), plan)
    })
  )

  it.effect("each edge carries its ring spec and projecting a stage outside the plan is a typed rejection", () =>
    Effect.gen(function* () {
      const input = validInput(3, 36)
      const plan = yield* planRun(input)
      for (const edge of plan.edges) {
        assert.deepStrictEqual(edge.ring, edge.kind === "Activation" ? input.activationRing : input.tokenRing)
      }
      const error = yield* Effect.flip(deriveStageProvision(plan, 3))
      assert.strictEqual(error._tag, "StageNotInPlan")
      assert.include(error.message, "3")
    })
  )
})

describe("plan messages cross process boundaries", () => {
  it.effect("RunPlan, ProvisionStage and every rejection survive a Schema encode/decode round trip", () =>
    Effect.gen(function* () {
      const plan = yield* planRun(validInput(3, 36))
      const planJson = JSON.parse(JSON.stringify(yield* Schema.encode(RunPlan)(plan)))
      assert.deepStrictEqual(yield* Schema.decodeUnknown(RunPlan)(planJson), plan)

      const provision = yield* deriveStageProvision(plan, 2)
      const provisionJson = JSON.parse(JSON.stringify(yield* Schema.encode(ProvisionStage)(provision)))
      assert.deepStrictEqual(yield* Schema.decodeUnknown(ProvisionStage)(provisionJson), provision)

      const rejection = yield* Effect.flip(planRun(invalidUnknownNode()))
      const rejectionJson = JSON.parse(JSON.stringify(yield* Schema.encode(PlanRejection)(rejection)))
      const decoded = yield* Schema.decodeUnknown(PlanRejection)(rejectionJson)
      assert.strictEqual(decoded._tag, "UnknownNode")
      assert.strictEqual(decoded.message, rejection.message)
    })
  )
})
