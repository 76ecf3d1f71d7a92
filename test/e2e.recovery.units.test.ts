// Pure parts of recovery (no processes): the next placement, which faults are recoverable, stragglers.
import { assert, describe, it } from "@effect/vitest"
import { NodeId } from "../src/domain/ids.js"
import { type StageFaultReason, StageFaultReasons } from "../src/domain/runEvents.js"
import { isRecoverable, replan } from "../src/layers/orchestrator/Recovery.js"
import { findStragglers } from "../src/layers/orchestrator/RunReport.js"

const n = NodeId.make
const placement = [0, 1, 2].map((stageIndex) => ({ stageIndex, nodeId: n(stageIndex + 1) }))

describe("recovery, pure parts", () => {
  // A lost node's stage goes to a spare (a node hosting nothing); survivors keep theirs.
  it("replan: a spare takes the lost node's stage", () => {
    assert.deepStrictEqual(replan(placement, [n(1), n(3), n(4)]).map((p) => p.nodeId), [n(1), n(4), n(3)])
  })
  // Without a spare the survivors absorb the layers in fewer stages; with nobody alive nothing is planned.
  it("replan: without a spare the survivors absorb the stage; nobody alive: empty", () => {
    assert.deepStrictEqual(replan(placement, [n(1), n(3)]), [{ stageIndex: 0, nodeId: n(1) }, { stageIndex: 1, nodeId: n(3) }])
    assert.deepStrictEqual(replan(placement, []), [])
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
    assert.isFalse(isRecoverable(stage(StageFaultReasons.ProtocolViolated({ message: "a middle stage produced logits" }))))
    assert.isFalse(isRecoverable(stage(StageFaultReasons.ProvisionFailed({ message: "already hosted" }))))
  })
  // A token over 4× the median of the 16 before it (and 5 ms slower) is a straggler; steady ones are not.
  it("findStragglers: reports a slow token against the recent median", () => {
    const latencies = Array.from({ length: 30 }, (_, i) => ({ sequence: i + 1, latencyMillis: i === 20 ? 50 : 3 + (i % 3) }))
    assert.deepStrictEqual(findStragglers(latencies), [{ sequence: 21, latencyMillis: 50, medianMillis: 4 }])
    assert.deepStrictEqual(findStragglers(latencies.map((l) => ({ ...l, latencyMillis: 4 }))), [])
  })
})
