/**
 * A big-endian host refuses to start a stage, in one line (issue 42: swactor runs stages on little-endian hosts only,
 * so no peer misreads its activations). The byte order is forced through StageHostOptions.endianness (the machine
 * running the test does not choose); the refusal reaches the orchestrator over a real control connection.
 */
import { assert, describe, it } from "@effect/vitest"
import { Chunk, Effect, Stream } from "effect"
import { AgentHello } from "../../src/domain/controlRpc.js"
import { tcpAddress } from "../../src/domain/frames.js"
import type { NodeId, RunId } from "../../src/domain/ids.js"
import type { Endianness } from "../../src/domain/wireFormats.js"
import * as AgentControlRpc from "../../src/layers/agent/AgentControlRpc.js"
import { dataPlane, layerDataPlane } from "../../src/layers/agent/AgentLinksLive.js"
import { makeStageHost } from "../../src/layers/agent/StageHost.js"
import * as StageExecutorTest from "../../src/layers/engine/StageExecutorTest.js"
import { AgentControl } from "../../src/services/AgentLinks.js"
import { stories260KProvision } from "../support/e2e.js"

const token = "host-byte-order-test-token"

/** A stage host on a host of `endianness` (a test engine of stories260K's 5 blocks), served on a real control port; the orchestrator's link to it. */
const agentOn = (endianness: Endianness) =>
  Effect.gen(function* () {
    const listener = yield* dataPlane.listen(tcpAddress(0), token)
    const host = yield* makeStageHost(listener, { token, threads: 1, backend: "cpu", endianness })
    const bound = yield* AgentControlRpc.serveControlRpc({
      address: tcpAddress(0),
      token,
      host,
      hello: new AgentHello({ dataAddress: listener.address, pid: process.pid })
    })
    const control = yield* AgentControl
    return yield* control.connect({ nodeId: 1 as NodeId, address: AgentControlRpc.formatAddress(bound) }, token)
  }).pipe(
    Effect.provide([
      StageExecutorTest.layerWith({ ...StageExecutorTest.defaultTestModel, numLayers: 5 }),
      layerDataPlane,
      AgentControlRpc.layer
    ])
  )

describe("a big-endian host", () => {
  it.scopedLive("refuses to start a stage, in one line the orchestrator receives", () =>
    Effect.gen(function* () {
      const link = yield* agentOn("BE")
      const reports = Chunk.toReadonlyArray(
        yield* Stream.runCollect(
          // A stage that started would go on reporting (loading, ready): two reports are enough to tell.
          link.provision(stories260KProvision(41 as RunId, "/models/stories260K.gguf", 1)).pipe(Stream.take(2))
        ).pipe(Effect.timeout("20 seconds"))
      )
      assert.deepStrictEqual(
        reports.map((r) => r._tag),
        ["StageFault"]
      )
      const fault = reports[0]!
      assert.isTrue(fault._tag === "StageFault" && fault.reason._tag === "ProvisionFailed")
      const message = fault._tag === "StageFault" && fault.reason._tag === "ProvisionFailed" ? fault.reason.message : ""
      assert.strictEqual(
        message,
        "stage 0 refused: this host is big-endian (os.endianness() BE): swactor runs stages on little-endian hosts " +
          "only (x86-64, arm64), so it does not start one here"
      )
      assert.strictEqual((yield* link.capacity).activeStages, 0)
    })
  )

  // The same request on a little-endian host goes on to load the stage.
  it.scopedLive("a little-endian host starts the same stage", () =>
    Effect.gen(function* () {
      const link = yield* agentOn("LE")
      const first = yield* Stream.runHead(
        link.provision(stories260KProvision(42 as RunId, "/models/stories260K.gguf", 1))
      )
      assert.strictEqual(first._tag, "Some")
      assert.strictEqual(first._tag === "Some" ? first.value._tag : undefined, "StageLoading")
    })
  )
})
