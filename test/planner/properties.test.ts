// Property tests of the planner over random model sizes and placements (G2–G5 in specs/BEHAVIOR_GUARANTEES.md).
import { assert, describe, it } from "@effect/vitest"
import { Either, FastCheck as fc } from "effect"
import { isDeepStrictEqual } from "node:util"
import { type NodeId, RunId } from "../../src/domain/ids.js"
import type { PlannerInput, RingSpec, StagePlacement } from "../../src/domain/plan.js"
import { deriveStageProvisionEither, planRunEither } from "../../src/services/Planner.js"

const ring = (dataCapacity: number, alignment: number): RingSpec => ({
  dataCapacity,
  alignment,
  direction: "Egress",
  hostPinning: "Pageable",
  wakeCoalescing: "PendingBit"
})

const input = (
  numLayers: number,
  placement: ReadonlyArray<StagePlacement>,
  pool: ReadonlyArray<NodeId>
): PlannerInput => ({
  runId: RunId.make(1),
  orchestratorNodeId: 0 as NodeId,
  model: {
    modelId: "m",
    ggufSource: { _tag: "LocalPath", path: "/m.gguf" },
    numLayers,
    hiddenDim: 64,
    dtypeFamily: "Float",
    dtypeWidthBytes: 4,
    maxSeqLen: 2048,
    eosTokenId: 2,
    tokenizer: { _tag: "EmbeddedInGguf" }
  },
  runtime: { maxTokens: 8, sampling: { temperatureMillis: 0, topK: 1 } },
  candidatePool: pool,
  stageCount: placement.length,
  placement: { _tag: "FixedLinear", stages: placement },
  activationRing: ring(1 << 16, 64),
  tokenRing: ring(4096, 8)
})

// 1 <= stages <= layers <= 512, each stage on a random node of a pool of up to 8, placement entries in random order.
const validCase = fc.integer({ min: 1, max: 512 }).chain((numLayers) =>
  fc.integer({ min: 1, max: numLayers }).chain((stageCount) =>
    fc.record({
      numLayers: fc.constant(numLayers),
      nodes: fc.array(fc.integer({ min: 1, max: 8 }), { minLength: stageCount, maxLength: stageCount }),
      order: fc.shuffledSubarray(
        Array.from({ length: stageCount }, (_, i) => i),
        {
          minLength: stageCount,
          maxLength: stageCount
        }
      )
    })
  )
)

const placementOf = (nodes: ReadonlyArray<number>, order: ReadonlyArray<number>): Array<StagePlacement> =>
  order.map((stageIndex) => ({ stageIndex, nodeId: nodes[stageIndex]! as NodeId }))

const pool = Array.from({ length: 8 }, (_, i) => (i + 1) as NodeId)

describe("planner properties", () => {
  const partitionTitle =
    "any 1 <= stages <= layers <= 512 gives a contiguous, balanced, covering partition and the linear edge graph"
  it(partitionTitle, () =>
    fc.assert(
      fc.property(validCase, ({ nodes, numLayers, order }) => {
        const placement = placementOf(nodes, order)
        const result = planRunEither(input(numLayers, placement, pool))
        assert.isTrue(Either.isRight(result))
        if (Either.isLeft(result)) return
        const plan = result.right
        const stageCount = nodes.length
        const stages = [...plan.stages].sort((a, b) => a.stageIndex - b.stageIndex)

        // Partition: contiguous, non-overlapping, non-empty, covering [0, numLayers), balanced.
        assert.strictEqual(stages.length, stageCount)
        let start = 0
        for (const [i, stage] of stages.entries()) {
          assert.strictEqual(stage.stageIndex, i)
          assert.strictEqual(stage.layerStart, start)
          assert.isAbove(stage.layerEndExclusive, stage.layerStart)
          start = stage.layerEndExclusive
        }
        assert.strictEqual(start, numLayers)
        const sizes = stages.map((s) => s.layerEndExclusive - s.layerStart)
        assert.isAtMost(Math.max(...sizes) - Math.min(...sizes), 1)

        // Each stage sits on the node its placement entry named.
        for (const stage of stages) assert.strictEqual(stage.nodeId, nodes[stage.stageIndex])

        // Edges: TokenIn, one Activation per adjacent pair, TokenOut; ids unique; stage references resolve and chain.
        const kinds = plan.edges.map((e) => e.kind)
        assert.strictEqual(kinds.filter((k) => k === "TokenIn").length, 1)
        assert.strictEqual(kinds.filter((k) => k === "Activation").length, stageCount - 1)
        assert.strictEqual(kinds.filter((k) => k === "TokenOut").length, 1)
        const byId = new Map(plan.edges.map((e) => [e.edgeId as number, e]))
        assert.strictEqual(byId.size, plan.edges.length)
        for (const stage of stages) {
          const inbound = byId.get(stage.inboundEdge)!
          const outbound = byId.get(stage.outboundEdge)!
          const self = { _tag: "Stage" as const, nodeId: stage.nodeId, stageIndex: stage.stageIndex }
          assert.deepStrictEqual(inbound.consumer, self)
          assert.deepStrictEqual(outbound.producer, self)
          assert.strictEqual(inbound.kind, stage.stageIndex === 0 ? "TokenIn" : "Activation")
          assert.strictEqual(outbound.kind, stage.stageIndex === stageCount - 1 ? "TokenOut" : "Activation")
          if (stage.stageIndex > 0) assert.strictEqual(stage.inboundEdge, stages[stage.stageIndex - 1]!.outboundEdge)
        }

        // Deterministic and independent of the order of placement entries.
        const sorted = planRunEither(
          input(
            numLayers,
            placementOf(
              nodes,
              [...order].sort((a, b) => a - b)
            ),
            pool
          )
        )
        assert.isTrue(Either.isRight(sorted) && isDeepStrictEqual(sorted.right, plan))
      }),
      { numRuns: 100, seed: 0x5eed22 }
    )
  )

  it("every stage of any valid plan projects, with sampling on the last stage only; other indices are rejected", () =>
    fc.assert(
      fc.property(validCase, fc.integer({ min: -3, max: 600 }), ({ nodes, numLayers, order }, probe) => {
        const plan = Either.getOrThrow(planRunEither(input(numLayers, placementOf(nodes, order), pool)))
        for (const stage of plan.stages) {
          const provision = Either.getOrThrow(deriveStageProvisionEither(plan, stage.stageIndex))
          assert.strictEqual(provision.runtime.roleId, stage.stageIndex)
          assert.strictEqual(provision.runtime.sampling !== null, stage.stageIndex === nodes.length - 1)
          assert.strictEqual(provision.inbound.edgeId, stage.inboundEdge)
          assert.strictEqual(provision.outbound.edgeId, stage.outboundEdge)
        }
        const projected = deriveStageProvisionEither(plan, probe)
        assert.strictEqual(Either.isRight(projected), probe >= 0 && probe < nodes.length)
      }),
      { numRuns: 50, seed: 0x5eed23 }
    ))

  it("more stages than layers is always ModelStageLayoutMismatch, never a partial plan", () =>
    fc.assert(
      fc.property(fc.integer({ min: 1, max: 64 }), fc.integer({ min: 1, max: 64 }), (numLayers, extra) => {
        const stageCount = numLayers + extra
        const placement = Array.from({ length: stageCount }, (_, stageIndex) => ({ stageIndex, nodeId: 1 as NodeId }))
        const result = planRunEither(input(numLayers, placement, pool))
        assert.isTrue(Either.isLeft(result) && result.left._tag === "ModelStageLayoutMismatch")
      }),
      { seed: 0x5eed25 }
    ))

  it("a placement that drops, duplicates or misplaces any one entry is rejected with the matching kind", () =>
    fc.assert(
      fc.property(
        validCase.filter(({ nodes }) => nodes.length >= 2),
        fc.constantFrom("drop", "duplicate", "outOfRange", "unknownNode"),
        fc.nat(),
        ({ nodes, numLayers, order }, mutation, pick) => {
          const placement = placementOf(nodes, order)
          const victim = pick % placement.length
          const entry = placement[victim]!
          const mutated =
            mutation === "drop"
              ? placement.filter((_, i) => i !== victim)
              : mutation === "duplicate"
                ? [...placement, { stageIndex: entry.stageIndex, nodeId: 1 as NodeId }]
                : mutation === "outOfRange"
                  ? placement.map((e, i) => (i === victim ? { ...e, stageIndex: nodes.length } : e))
                  : placement.map((e, i) => (i === victim ? { ...e, nodeId: 404 as NodeId } : e))
          const result = planRunEither({ ...input(numLayers, mutated, pool), stageCount: nodes.length })
          const expected = {
            drop: "MissingStage",
            duplicate: "DuplicateStageAssignment",
            outOfRange: "StageIndexOutOfRange",
            unknownNode: "UnknownNode"
          }[mutation]
          assert.isTrue(Either.isLeft(result))
          if (Either.isLeft(result)) assert.strictEqual(result.left._tag, expected)
        }
      ),
      { numRuns: 200, seed: 0x5eed24 }
    ))
})
