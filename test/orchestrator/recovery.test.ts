// Pure parts of recovery (no processes): the next placement, which faults are recoverable, stragglers.
import { assert, describe, it } from "@effect/vitest"
import { NodeId } from "../../src/domain/ids.js"
import { type StageFaultReason, StageFaultReasons } from "../../src/domain/runEvents.js"
import { Either } from "effect"
import { absorbPlacement, isRecoverable, replan, type Survivor } from "../../src/layers/orchestrator/Recovery.js"
import { findStragglers } from "../../src/layers/orchestrator/RunReport.js"

const n = NodeId.make
const placement = [0, 1, 2].map((stageIndex) => ({ stageIndex, nodeId: n(stageIndex + 1) }))

const MiB = 2 ** 20
// 5 blocks of 1 MiB (KV 1 KiB per token per block), 2 MiB embeddings and output head; at 256 context tokens a stage
// needs its weights + 256 KiB KV per block + 33 MiB of compute reserve: [0, 3) 38.75 MiB, [3, 5) 37.5 MiB,
// [0, 2) 37.5 MiB, [2, 5) 38.75 MiB, the whole model 43.25 MiB.
const layout = {
  blockBytes: [1, 1, 1, 1, 1].map((b) => b * MiB),
  kvBytesPerToken: [1024, 1024, 1024, 1024, 1024],
  inputBytes: 2 * MiB,
  outputBytes: 2 * MiB,
  hiddenDim: 64
}
const survivor = (id: number, freeMiB: number): Survivor => ({
  nodeId: n(id),
  freeMemoryBytes: freeMiB * MiB,
  speedBytesPerSecond: 1e9,
  address: `node-${id}:7000`
})
const rangesOf = (result: ReturnType<typeof absorbPlacement>) =>
  Either.isRight(result) ? result.right.placement.map((p, i) => [p.nodeId, ...result.right.layerRanges[i]!]) : undefined

describe("recovery, pure parts", () => {
  // A lost node's stage goes to a spare (a node hosting nothing); survivors keep theirs.
  it("replan: a spare takes the lost node's stage", () => {
    assert.deepStrictEqual(
      replan(placement, [n(1), n(3), n(4)]).map((p) => p.nodeId),
      [n(1), n(4), n(3)]
    )
  })
  // A spare without the memory for the lost stage's blocks is passed over: another spare that has it takes the
  // stage, and with none the survivors absorb it.
  it("replan: only a spare that can host the lost stage takes it", () => {
    assert.deepStrictEqual(
      replan(placement, [n(1), n(3), n(4), n(5)], (node) => node !== n(4)).map((p) => p.nodeId),
      [n(1), n(5), n(3)]
    )
    assert.deepStrictEqual(
      replan(placement, [n(1), n(3), n(4)], (node) => node !== n(4)).map((p) => p.nodeId),
      [n(1), n(3)]
    )
  })
  // Without a spare the survivors absorb the layers in fewer stages; with nobody alive nothing is planned.
  it("replan: without a spare the survivors absorb the stage; nobody alive: empty", () => {
    assert.deepStrictEqual(replan(placement, [n(1), n(3)]), [
      { stageIndex: 0, nodeId: n(1) },
      { stageIndex: 1, nodeId: n(3) }
    ])
    assert.deepStrictEqual(replan(placement, []), [])
  })
  // Survivors absorbing a lost node's blocks: the even split when each survivor's reported memory holds its share
  // (what the planner did before the check); else a contiguous split that fits; else the figures for a typed fault.
  it("absorbPlacement: the even split when it fits, another split that fits, else the numbers", () => {
    assert.deepStrictEqual(rangesOf(absorbPlacement(layout, [survivor(1, 64), survivor(3, 64)], 256)), [
      [1, 0, 3],
      [3, 3, 5]
    ])
    // 38 MiB cannot hold [0, 3) (38.75 MiB) but holds [0, 2); the other survivor takes [2, 5).
    assert.deepStrictEqual(rangesOf(absorbPlacement(layout, [survivor(1, 38), survivor(3, 40)], 256)), [
      [1, 0, 2],
      [3, 2, 5]
    ])
    const refused = absorbPlacement(layout, [survivor(1, 38), survivor(3, 38)], 256)
    assert.isTrue(Either.isLeft(refused))
    if (Either.isLeft(refused)) {
      assert.deepStrictEqual(refused.left, {
        survivors: [
          { nodeId: 1, address: "node-1:7000", layers: [0, 3], requiredBytes: 38.75 * MiB, freeBytes: 38 * MiB },
          { nodeId: 3, address: "node-3:7000", layers: [3, 5], requiredBytes: 37.5 * MiB, freeBytes: 38 * MiB }
        ],
        modelBytes: 43.25 * MiB,
        survivorsFreeBytes: 76 * MiB
      })
    }
  })
  // A lost node or worker, a broken transport: recoverable. A bad model or execution error: not.
  it("isRecoverable: node and transport faults yes, model and execution faults no", () => {
    const stage = (reason: StageFaultReason) => ({ _tag: "StageFault", stageIndex: 1, reason }) as const
    assert.isTrue(isRecoverable(stage(StageFaultReasons.WorkerCrashed())))
    // a stage that failed unexpectedly on its agent (the agent says why) is a crashed worker too
    assert.isTrue(isRecoverable(stage(StageFaultReasons.WorkerCrashed({ message: "Error: boom" }))))
    assert.isTrue(isRecoverable(stage(StageFaultReasons.TransportFailed({ message: "PeerClosed" }))))
    assert.isTrue(isRecoverable({ _tag: "MembershipLost", nodeId: n(2) } as never))
    assert.isFalse(isRecoverable(stage(StageFaultReasons.ModelLoadFailed({ message: "bad file" }))))
    assert.isFalse(isRecoverable(stage(StageFaultReasons.ExecutionFailed({ message: "engine" }))))
    assert.isFalse(
      isRecoverable(stage(StageFaultReasons.ProtocolViolated({ message: "a middle stage produced logits" })))
    )
    assert.isFalse(isRecoverable(stage(StageFaultReasons.ProvisionFailed({ message: "already hosted" }))))
  })
  // A token over 4× the median of the 16 before it (and 5 ms slower) is a straggler; steady ones are not.
  it("findStragglers: reports a slow token against the recent median", () => {
    const latencies = Array.from({ length: 30 }, (_, i) => ({
      step: i + 1,
      latencyMillis: i === 20 ? 50 : 3 + (i % 3)
    }))
    assert.deepStrictEqual(findStragglers(latencies), [{ step: 21, latencyMillis: 50, medianMillis: 4 }])
    assert.deepStrictEqual(findStragglers(latencies.map((l) => ({ ...l, latencyMillis: 4 }))), [])
  })
})
