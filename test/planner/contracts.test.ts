// Contract tests of planning beyond the seed (G1, G5, G8 in specs/BEHAVIOR_GUARANTEES.md): every field of each
// stage's edges, inputs that are not whole numbers, every rejection across a process boundary, and the order of the
// checks when one input breaks several rules.
import { assert, describe, it } from "@effect/vitest"
import { Either, FastCheck as fc, Schema } from "effect"
import { type NodeId, RunId } from "../../src/domain/ids.js"
import type { EdgeEndpoint, EdgeProvision, PlannerInput, RingSpec, StagePlacement } from "../../src/domain/plan.js"
import { PlanRejection } from "../../src/domain/planErrors.js"
import { deriveStageProvisionEither, planRunEither } from "../../src/services/Planner.js"

const node = (id: number) => id as NodeId
const ring = (dataCapacity: number, alignment: number): RingSpec => ({
  dataCapacity,
  alignment,
  direction: "Egress",
  hostPinning: "Pageable",
  wakeCoalescing: "PendingBit"
})
const activationRing = ring(1 << 20, 64)
const tokenRing = ring(4096, 8)
const placement = (stageCount: number): Array<StagePlacement> =>
  Array.from({ length: stageCount }, (_, stageIndex) => ({ stageIndex, nodeId: node(10 + stageIndex) }))

// The canonical valid fixture: three stages on nodes 10, 11, 12 (pool 10..13), orchestrator on node 99.
const valid = (): PlannerInput => ({
  runId: RunId.make(7),
  orchestratorNodeId: node(99),
  model: {
    modelId: "m",
    ggufSource: { _tag: "LocalPath", path: "/models/m.gguf" },
    numLayers: 36,
    hiddenDim: 4096,
    dtypeFamily: "BFloat",
    dtypeWidthBytes: 2,
    maxSeqLen: 2048,
    eosTokenId: 2,
    tokenizer: { _tag: "EmbeddedInGguf" }
  },
  runtime: { maxTokens: 4, sampling: { temperatureMillis: 0, topK: 1 } },
  candidatePool: [node(10), node(11), node(12), node(13)],
  stageCount: 3,
  placement: { _tag: "FixedLinear", stages: placement(3) },
  activationRing,
  tokenRing
})
const withModel = (patch: Partial<PlannerInput["model"]>): PlannerInput => ({
  ...valid(),
  model: { ...valid().model, ...patch }
})
const withStages = (stages: ReadonlyArray<StagePlacement>): PlannerInput => ({
  ...valid(),
  placement: { _tag: "FixedLinear", stages }
})
const rejectionOf = (input: PlannerInput) => {
  const result = planRunEither(input)
  if (Either.isRight(result)) return assert.fail("expected a rejection, got a plan")
  return result.left
}

describe("each stage's edges (G8)", () => {
  it("every EdgeProvision field: id, kind, the peer at the other end and the ring", () => {
    const plan = Either.getOrThrow(planRunEither(valid()))
    const orchestrator: EdgeEndpoint = { _tag: "Orchestrator", nodeId: node(99) }
    const stage = (stageIndex: number): EdgeEndpoint => ({ _tag: "Stage", nodeId: node(10 + stageIndex), stageIndex })
    const expected: ReadonlyArray<Record<"inbound" | "outbound", Omit<EdgeProvision, "edgeId"> & { edgeId: number }>> =
      [
        {
          inbound: { edgeId: 0, kind: "TokenIn", peer: orchestrator, ring: tokenRing },
          outbound: { edgeId: 1, kind: "Activation", peer: stage(1), ring: activationRing }
        },
        {
          inbound: { edgeId: 1, kind: "Activation", peer: stage(0), ring: activationRing },
          outbound: { edgeId: 2, kind: "Activation", peer: stage(2), ring: activationRing }
        },
        {
          inbound: { edgeId: 2, kind: "Activation", peer: stage(1), ring: activationRing },
          outbound: { edgeId: 3, kind: "TokenOut", peer: orchestrator, ring: tokenRing }
        }
      ]
    for (const [stageIndex, edges] of expected.entries()) {
      const provision = Either.getOrThrow(deriveStageProvisionEither(plan, stageIndex))
      assert.deepStrictEqual({ inbound: provision.inbound, outbound: provision.outbound }, edges)
    }
  })
})

// Inputs that are not whole numbers: NaN, infinities, fractions and negatives, each in one field of the valid
// fixture. Each is refused with the rejection for that field, never a throw and never a plan.
const badNumbers = [Number.NaN, Number.POSITIVE_INFINITY, Number.NEGATIVE_INFINITY, 1.5, -1]
const numericCases: ReadonlyArray<readonly [string, (n: number) => PlannerInput, PlanRejection["_tag"]]> = [
  ["stageCount", (n) => ({ ...valid(), stageCount: n }), "InvalidStageCount"],
  ["numLayers", (n) => withModel({ numLayers: n }), "InvalidModelFacts"],
  ["hiddenDim", (n) => withModel({ hiddenDim: n }), "InvalidModelFacts"],
  ["dtypeWidthBytes", (n) => withModel({ dtypeWidthBytes: n }), "InvalidModelFacts"],
  ["maxSeqLen", (n) => withModel({ maxSeqLen: n }), "InvalidModelFacts"],
  ["maxTokens", (n) => ({ ...valid(), runtime: { ...valid().runtime, maxTokens: n } }), "InvalidMaxTokens"],
  ["activation dataCapacity", (n) => ({ ...valid(), activationRing: ring(n, 64) }), "InvalidRingSpec"],
  ["token alignment", (n) => ({ ...valid(), tokenRing: ring(4096, n) }), "InvalidRingSpec"],
  ["orchestrator node", (n) => ({ ...valid(), orchestratorNodeId: node(n) }), "InvalidNodeId"],
  ["candidate node", (n) => ({ ...valid(), candidatePool: [...valid().candidatePool, node(n)] }), "InvalidNodeId"],
  [
    "placement stage index",
    (n) => withStages([...placement(3), { stageIndex: n, nodeId: node(10) }]),
    "StageIndexOutOfRange"
  ],
  ["placement node", (n) => withStages([...placement(2), { stageIndex: 2, nodeId: node(n) }]), "UnknownNode"]
]

/** Encodes a rejection, sends it through JSON as a process boundary would, and decodes it. */
const acrossProcesses = (rejection: PlanRejection) =>
  Schema.decodeUnknownSync(PlanRejection)(JSON.parse(JSON.stringify(Schema.encodeSync(PlanRejection)(rejection))))

const fieldsOf = (rejection: PlanRejection) => ({ ...rejection })

describe("planner inputs that are not whole numbers (G5)", () => {
  it("NaN, infinite, fractional and negative values are refused for the field they are in", () => {
    for (const [field, make, tag] of numericCases) {
      for (const n of badNumbers) {
        // -1 and 1.5 in the alignment are caught too (not a power of two); a negative node id in the placement is
        // simply not in the pool.
        const rejection = rejectionOf(make(n))
        assert.strictEqual(rejection._tag, tag, `${field} = ${n}`)
        assert.include(rejection.message, String(n), `${field} = ${n}: ${rejection.message}`)
        // The offending value survives the trip across a process boundary, NaN and infinities included.
        const decoded = acrossProcesses(rejection)
        assert.deepStrictEqual(fieldsOf(decoded), fieldsOf(rejection), `${field} = ${n}`)
        assert.strictEqual(decoded.message, rejection.message)
      }
    }
  })
})

// One input per rejection kind, in the order of G5's table.
const oneOfEach: ReadonlyArray<readonly [PlanRejection["_tag"], PlannerInput]> = [
  ["InvalidStageCount", { ...valid(), stageCount: 0 }],
  ["InvalidModelFacts", withModel({ hiddenDim: 0 })],
  ["ModelStageLayoutMismatch", withModel({ numLayers: 2 })],
  ["InvalidMaxTokens", { ...valid(), runtime: { ...valid().runtime, maxTokens: 0 } }],
  ["InvalidRingSpec", { ...valid(), tokenRing: ring(4096, 24) }],
  ["ActivationRingTooSmall", { ...valid(), activationRing: ring(64, 64) }],
  ["InvalidNodeId", { ...valid(), orchestratorNodeId: node(-3) }],
  ["DuplicateCandidateNode", { ...valid(), candidatePool: [...valid().candidatePool, node(11)] }],
  ["StageIndexOutOfRange", withStages([...placement(3), { stageIndex: 7, nodeId: node(10) }])],
  ["UnknownNode", withStages([...placement(2), { stageIndex: 2, nodeId: node(404) }])],
  ["DuplicateStageAssignment", withStages([{ stageIndex: 0, nodeId: node(13) }, ...placement(3)])],
  ["MissingStage", withStages(placement(2))],
  ["InvalidLayerRanges", { ...valid(), layerRanges: [[0, 1]] }]
]

describe("every rejection across a process boundary (G1)", () => {
  it("each kind of rejection survives a Schema encode, JSON and decode round trip with all its fields", () => {
    const tags = new Set<string>()
    for (const [tag, input] of oneOfEach) {
      const rejection = rejectionOf(input)
      assert.strictEqual(rejection._tag, tag)
      tags.add(tag)
      const decoded = acrossProcesses(rejection)
      assert.deepStrictEqual(fieldsOf(decoded), fieldsOf(rejection))
      assert.strictEqual(decoded.message, rejection.message)
    }
    // Every member of the union is covered.
    assert.strictEqual(tags.size, PlanRejection.members.length)
  })
})

describe("the order of the checks (G5)", () => {
  // Several faults in one input, each from a different row of the table and arranged so that the placement entry
  // that breaks a later rule comes first: the rejection is always the earliest row among the faults present.
  const faults: ReadonlyArray<readonly [PlanRejection["_tag"], (input: PlannerInput) => PlannerInput]> = [
    ["InvalidStageCount", (i) => ({ ...i, stageCount: 2.5 })],
    ["InvalidModelFacts", (i) => ({ ...i, model: { ...i.model, maxSeqLen: Number.NaN } })],
    ["ModelStageLayoutMismatch", (i) => ({ ...i, model: { ...i.model, numLayers: 2 } })],
    ["InvalidMaxTokens", (i) => ({ ...i, runtime: { ...i.runtime, maxTokens: 1e9 } })],
    ["InvalidRingSpec", (i) => ({ ...i, tokenRing: ring(4096, 3) })],
    ["ActivationRingTooSmall", (i) => ({ ...i, activationRing: ring(64, 64) })],
    ["InvalidNodeId", (i) => ({ ...i, candidatePool: [...i.candidatePool, node(0.5)] })],
    ["DuplicateCandidateNode", (i) => ({ ...i, candidatePool: [node(13), ...i.candidatePool] })],
    // Placement faults: a missing stage 2, a duplicate of stage 0 first, an unknown node next, an out-of-range
    // index last.
    [
      "MissingStage",
      (i) =>
        withPlacement(
          i,
          stagesOf(i).filter((e) => e.stageIndex !== 2)
        )
    ],
    ["DuplicateStageAssignment", (i) => withPlacement(i, [{ stageIndex: 0, nodeId: node(12) }, ...stagesOf(i)])],
    [
      "UnknownNode",
      (i) =>
        withPlacement(
          i,
          stagesOf(i).map((e) => (e.stageIndex === 1 ? { ...e, nodeId: node(404) } : e))
        )
    ],
    ["StageIndexOutOfRange", (i) => withPlacement(i, [...stagesOf(i), { stageIndex: 9, nodeId: node(10) }])],
    [
      "InvalidLayerRanges",
      (i) => ({
        ...i,
        layerRanges: [
          [0, 2],
          [3, 4]
        ]
      })
    ]
  ]
  const table: ReadonlyArray<PlanRejection["_tag"]> = oneOfEach.map(([tag]) => tag)
  const stagesOf = (i: PlannerInput) => i.placement.stages
  const withPlacement = (i: PlannerInput, stages: ReadonlyArray<StagePlacement>): PlannerInput => ({
    ...i,
    placement: { _tag: "FixedLinear", stages }
  })

  it("with several faults in one input the first rule of the table decides", () =>
    fc.assert(
      fc.property(fc.subarray([...faults.keys()], { minLength: 1 }), (picked) => {
        const input = picked.reduce((i, k) => faults[k]![1](i), valid())
        const expected = picked.map((k) => faults[k]![0]).sort((a, b) => table.indexOf(a) - table.indexOf(b))[0]
        assert.strictEqual(rejectionOf(input)._tag, expected, `faults: ${picked.map((k) => faults[k]![0])}`)
      }),
      { numRuns: 300, seed: 0x5eed11 }
    ))

  it("an unknown node in an early entry does not hide an out-of-range index in a later one", () => {
    const input = withStages([
      { stageIndex: 0, nodeId: node(404) },
      ...placement(3).slice(1),
      {
        stageIndex: 5,
        nodeId: node(10)
      }
    ])
    assert.strictEqual(rejectionOf(input)._tag, "StageIndexOutOfRange")
  })
})
