import * as Net from "node:net"
import { assert, describe, it } from "@effect/vitest"
import { Chunk, Context, Effect, Either, Layer, Redacted, Stream } from "effect"
import {
  ControlRpcs,
  HostedStage,
  NodeCapacity,
  ProvisionRejected,
  StageDataPlane,
  StageFault,
  StageReady,
  StageStopped,
  UnknownStage
} from "../src/domain/controlRpc.js"
import { PeerClosed, tcpAddress, type TransportAddress } from "../src/domain/frames.js"
import type { EdgeId, NodeId, PortId, RoleId, RunId } from "../src/domain/ids.js"
import { ProvisionStage, type RingSpec } from "../src/domain/plan.js"
import * as ControlPlane from "../src/layers/transport/ControlPlane.js"

const token = Redacted.make("control-plane-test-token")
const runId = 3 as RunId
const nodeId = 1 as NodeId
const ring: RingSpec = {
  dataCapacity: 1 << 20,
  alignment: 64,
  direction: "Egress",
  hostPinning: "Pageable",
  wakeCoalescing: "PendingBit"
}

const stage = (stageIndex: number) =>
  new ProvisionStage({
    runId,
    nodeId,
    stageIndex,
    stageCount: 2,
    layerStart: 0,
    layerEndExclusive: 3,
    ggufSource: { _tag: "LocalPath", path: "/models/tiny.gguf" },
    tokenizer: { _tag: "EmbeddedInGguf" },
    model: {
      modelId: "tiny",
      ggufSource: { _tag: "LocalPath", path: "/models/tiny.gguf" },
      numLayers: 6,
      hiddenDim: 64,
      dtypeFamily: "Float",
      dtypeWidthBytes: 4,
      maxSeqLen: 256,
      eosTokenId: 2,
      tokenizer: { _tag: "EmbeddedInGguf" }
    },
    runtime: { roleId: stageIndex as RoleId, inputPort: "in" as PortId, outputPort: "out" as PortId, sampling: null },
    inbound: { edgeId: 1 as EdgeId, kind: "TokenIn", peer: { _tag: "Orchestrator", nodeId: 0 as NodeId }, ring },
    outbound: { edgeId: 2 as EdgeId, kind: "Activation", peer: { _tag: "Stage", nodeId: 2 as NodeId, stageIndex: 1 }, ring }
  })

const dataPlane = new StageDataPlane({ inbound: tcpAddress(7001), outbound: tcpAddress(7002, "10.0.0.2") })

/** A fake agent: hosts stage 0 only, reports a fault on its edge in the event stream. */
const fakeHandlers = ControlRpcs.toLayer({
  Provision: ({ dataPlane, stage }) =>
    stage.stageIndex === 0
      ? Effect.succeed(new StageReady({ runId: stage.runId, stageIndex: 0, nodeId: stage.nodeId, inbound: dataPlane.inbound }))
      : Effect.fail(
        new ProvisionRejected({ runId: stage.runId, stageIndex: stage.stageIndex, reason: "InsufficientResources", detail: "no memory" })
      ),
  StopRun: ({ runId, stageIndex }) =>
    stageIndex === 0 ? Effect.succeed(new StageStopped({ runId, stageIndex })) : Effect.fail(new UnknownStage({ runId, stageIndex })),
  Heartbeat: () =>
    Effect.succeed(
      new NodeCapacity({
        nodeId,
        freeMemoryBytes: 1e9,
        totalMemoryBytes: 2e9,
        threads: 2,
        backend: "cpu",
        dataPlane: tcpAddress(7001),
        hostedRuns: [new HostedStage({ runId, stageIndex: 0 })]
      })
    ),
  Events: ({ runId }) =>
    Stream.make(
      new StageReady({ runId, stageIndex: 0, nodeId, inbound: tcpAddress(7001) }),
      new StageFault({
        runId,
        stageIndex: 0,
        reason: { _tag: "TransportFailed", message: "outbound edge closed" },
        edgeFault: { edgeId: 2 as EdgeId, fault: new PeerClosed({ detail: "peer ended the stream" }) }
      }),
      new StageStopped({ runId, stageIndex: 0 })
    )
})

const server = (address?: TransportAddress) =>
  Layer.build(ControlPlane.layer({ token, address, handshakeTimeout: "500 millis" }).pipe(Layer.provide(fakeHandlers))).pipe(
    Effect.map((ctx) => Context.get(ctx, ControlPlane.ControlPlaneServer))
  )

describe("ControlPlane", () => {
  // Every RPC of the group round-trips through a real authenticated socket, typed errors included.
  it.scopedLive("round-trips Provision, StopRun, Heartbeat and Events over a real socket", () =>
    Effect.gen(function*() {
      const { address } = yield* server()
      assert.strictEqual(address._tag === "Tcp" && address.host, "127.0.0.1")
      const client = yield* ControlPlane.connect(address, token)

      const ready = yield* client.Provision({ stage: stage(0), dataPlane })
      assert.deepStrictEqual(ready, new StageReady({ runId, stageIndex: 0, nodeId, inbound: tcpAddress(7001) }))
      const rejected = yield* Effect.either(client.Provision({ stage: stage(1), dataPlane }))
      assert.isTrue(Either.isLeft(rejected) && rejected.left._tag === "ProvisionRejected" && rejected.left.reason === "InsufficientResources")

      assert.deepStrictEqual(yield* client.StopRun({ runId, stageIndex: 0 }), new StageStopped({ runId, stageIndex: 0 }))
      const unknown = yield* Effect.either(client.StopRun({ runId, stageIndex: 5 }))
      assert.isTrue(Either.isLeft(unknown) && unknown.left._tag === "UnknownStage")

      const capacity = yield* client.Heartbeat()
      assert.strictEqual(capacity.threads, 2)
      assert.deepStrictEqual(capacity.hostedRuns.map((h) => h.stageIndex), [0])

      const events = Chunk.toReadonlyArray(yield* Stream.runCollect(client.Events({ runId })))
      assert.deepStrictEqual(events.map((e) => e._tag), ["StageReady", "StageFault", "StageStopped"])
      const fault = events[1]!
      assert.isTrue(fault._tag === "StageFault" && fault.reason._tag === "TransportFailed" && fault.edgeFault?.fault._tag === "PeerClosed")
    }))

  it.scopedLive("works over a Unix socket", () =>
    Effect.gen(function*() {
      const path = `/tmp/swactor-cp-${process.pid}-${Date.now()}.sock`
      const { address } = yield* server({ _tag: "Unix", path })
      const client = yield* ControlPlane.connect(address, token)
      assert.strictEqual((yield* client.Heartbeat()).backend, "cpu")
    }))

  // A client without the cluster token is refused before any RPC is read.
  it.scopedLive("refuses a client with a wrong token", () =>
    Effect.gen(function*() {
      const { address } = yield* server()
      const result = yield* Effect.either(ControlPlane.connect(address, Redacted.make("wrong"), { timeout: "2 seconds" }))
      assert.isTrue(Either.isLeft(result) && result.left._tag === "AuthFailed")
    }))

  // A raw client that skips the handshake and speaks RPC straight away gets nothing back and is closed.
  it.scopedLive("never answers RPC sent without the handshake", () =>
    Effect.gen(function*() {
      const { address } = yield* server()
      const port = (address as { port: number }).port
      const received = yield* Effect.async<Buffer>((resume) => {
        const chunks: Array<Buffer> = []
        const s = Net.createConnection({ port, host: "127.0.0.1" })
        s.on("error", () => {})
        s.on("data", (c) => chunks.push(c))
        s.on("close", () => resume(Effect.succeed(Buffer.concat(chunks))))
        s.once("connect", () =>
          s.write(JSON.stringify({ _tag: "Request", id: "1", tag: "Heartbeat", payload: {}, headers: [] }) + "\n"))
      })
      // At most the server's handshake challenge came back — no RPC reply.
      assert.isFalse(received.toString("latin1").includes("Exit"))
      assert.isFalse(received.toString("latin1").includes("cpu"))
    }))

  it.scopedLive("fails to connect to a closed port with ConnectFailed", () =>
    Effect.gen(function*() {
      const result = yield* Effect.either(ControlPlane.connect(tcpAddress(1), token, { timeout: "2 seconds" }))
      assert.isTrue(Either.isLeft(result) && result.left._tag === "ConnectFailed")
    }))
})
