/**
 * A Stop that overtakes its stage's Provision (the orchestrator runs a run's commands concurrently, so a run torn
 * down while it provisions can send Stop first): the real agent remembers it, and the Provision that follows answers
 * StageStopped at once instead of loading and hosting the stage until the orchestrator's teardown deadline (chaos
 * runs saw a kill during loading take 10 s to recover through this race).
 */
import { assert, describe, it } from "@effect/vitest"
import { Chunk, Duration, Effect, Stream } from "effect"
import { ProvisionRequest } from "../src/domain/controlRpc.js"
import { tcpAddress } from "../src/domain/frames.js"
import type { EdgeId, NodeId, PortId, RoleId, RunId } from "../src/domain/ids.js"
import { ProvisionStage, type RingSpec } from "../src/domain/plan.js"
import * as AgentControlRpc from "../src/layers/agent/AgentControlRpc.js"
import { AgentControl } from "../src/services/AgentLinks.js"
import { startAgents } from "./support/e2e.js"
import { requireModel } from "./support/models.js"

const ring: RingSpec = { dataCapacity: 1 << 20, alignment: 64, direction: "Egress", hostPinning: "Pageable", wakeCoalescing: "PendingBit" }

const request = (runId: RunId, path: string) =>
  new ProvisionRequest({
    provision: new ProvisionStage({
      runId,
      nodeId: 1 as NodeId,
      stageIndex: 0,
      stageCount: 1,
      layerStart: 0,
      layerEndExclusive: 5,
      ggufSource: { _tag: "LocalPath", path },
      tokenizer: { _tag: "EmbeddedInGguf" },
      model: {
        modelId: "stories260K",
        ggufSource: { _tag: "LocalPath", path },
        numLayers: 5,
        hiddenDim: 64,
        dtypeFamily: "Float",
        dtypeWidthBytes: 4,
        maxSeqLen: 512,
        eosTokenId: 2,
        tokenizer: { _tag: "EmbeddedInGguf" }
      },
      runtime: { roleId: 0 as RoleId, inputPort: "in" as PortId, outputPort: "out" as PortId, sampling: null },
      inbound: { edgeId: 0 as EdgeId, kind: "TokenIn", peer: { _tag: "Orchestrator", nodeId: 0 as NodeId }, ring },
      outbound: { edgeId: 1 as EdgeId, kind: "TokenOut", peer: { _tag: "Orchestrator", nodeId: 0 as NodeId }, ring }
    }),
    // nobody listens here: a stage that really started would retry this connection until stopped
    outboundAddress: tcpAddress(9, "127.0.0.1"),
    threads: 1,
    contextLength: 256
  })

describe("agent: a Stop before its Provision", () => {
  it.live("the Provision that follows reports StageStopped at once and hosts nothing", () =>
    Effect.gen(function*() {
      const { agents, token } = yield* startAgents(1)
      const control = yield* AgentControl
      const link = yield* control.connect({ nodeId: 1 as NodeId, address: agents[0]!.address }, token)
      const path = requireModel("stories260K.gguf")
      yield* link.stop(77 as RunId, 0)
      const reports = yield* Stream.runCollect(link.provision(request(77 as RunId, path))).pipe(
        Effect.timeoutFail({ duration: Duration.seconds(5), onTimeout: () => new Error("the stage was hosted anyway") })
      )
      assert.deepStrictEqual(Chunk.toReadonlyArray(reports).map((r) => r._tag), ["StageStopped"])
      assert.strictEqual((yield* link.capacity).activeStages, 0)
    }).pipe(Effect.scoped, Effect.provide(AgentControlRpc.layer)), 60_000)
})
