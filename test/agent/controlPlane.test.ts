import * as Net from "node:net"
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { assert, describe, it } from "@effect/vitest"
import { Chunk, Effect, Either, Fiber, Ref, Stream } from "effect"
import {
  AgentHello,
  type NodeCapacity,
  ProvisionRequest,
  StageReport,
  StageStats
} from "../../src/domain/controlRpc.js"
import { tcpAddress, type TransportAddress } from "../../src/domain/frames.js"
import type { EdgeId, NodeId, PortId, RoleId, RunId } from "../../src/domain/ids.js"
import { ProvisionStage, type RingSpec } from "../../src/domain/plan.js"
import { type StageFaultReason, StageFaultReasons } from "../../src/domain/runEvents.js"
import * as AgentControlRpc from "../../src/layers/agent/AgentControlRpc.js"
import type { StageHost } from "../../src/layers/agent/NodeAgent.js"
import { AgentControl } from "../../src/services/AgentLinks.js"

const token = "control-plane-test-token"
const runId = 3 as RunId
const nodeId = 1 as NodeId
const ring: RingSpec = {
  dataCapacity: 1 << 20,
  alignment: 64,
  direction: "Egress",
  hostPinning: "Pageable",
  wakeCoalescing: "PendingBit"
}

const request = (stageIndex: number) =>
  new ProvisionRequest({
    provision: new ProvisionStage({
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
      outbound: {
        edgeId: 2 as EdgeId,
        kind: "Activation",
        peer: { _tag: "Stage", nodeId: 2 as NodeId, stageIndex: 1 },
        ring
      }
    }),
    outboundAddress: tcpAddress(7002, "10.0.0.2"),
    threads: 2,
    contextLength: 256
  })

const stats = new StageStats({
  frames: 4,
  tokens: 3,
  loadMillis: 12,
  cachedWeights: false,
  prefillComputeMillis: 5,
  decodeFrames: 3,
  decodeComputeMillis: 7
})

const capacity: NodeCapacity = {
  freeMemoryBytes: 1e9,
  totalMemoryBytes: 2e9,
  threads: 2,
  backend: "cpu",
  hostname: "fake-agent",
  activeStages: 1
}

const hello = new AgentHello({ dataAddress: tcpAddress(7001), pid: 4242 })

/** Every stage fault reason, with and without the optional words; stage 20 + i of the fake host reports the i-th. */
const everyReason: ReadonlyArray<StageFaultReason> = [
  StageFaultReasons.WorkerCrashed(),
  StageFaultReasons.WorkerCrashed({ message: "Error: boom\n    at stage" }),
  StageFaultReasons.ProvisionFailed({ message: "already hosted" }),
  StageFaultReasons.ModelLoadFailed({ message: "no memory" }),
  StageFaultReasons.ExecutionFailed({ message: "ContextOverflow: 300 > 256" }),
  StageFaultReasons.TransportFailed({ message: "PeerClosed: gone" }),
  StageFaultReasons.ProtocolViolated({ message: "a middle stage produced logits" }),
  StageFaultReasons.StoppedUnexpectedly()
]

/**
 * A fake agent's stage host: stage 0 loads, gets ready and stops with its counters; stage 1 faults
 * while loading; stage 9 loads and then hangs (to watch a dropped connection). `stops` records Stop calls.
 */
const fakeHost = (stops: Ref.Ref<ReadonlyArray<number>>): StageHost => ({
  provision: (req) => {
    const { stageIndex } = req.provision
    const loading = StageReport.members[0].make({ runId, stageIndex, loadedBytes: 10, totalBytes: 20 })
    if (stageIndex === 9) return Stream.concat(Stream.make(loading), Stream.never)
    if (stageIndex >= 20)
      return Stream.make(StageReport.members[2].make({ runId, stageIndex, reason: everyReason[stageIndex - 20]! }))
    if (stageIndex === 1) {
      return Stream.make(
        loading,
        StageReport.members[2].make({
          runId,
          stageIndex,
          reason: StageFaultReasons.ModelLoadFailed({ message: `no memory for ${req.contextLength}` })
        })
      )
    }
    return Stream.make(
      loading,
      StageReport.members[1].make({ runId, stageIndex, loadMillis: 12, cachedWeights: false }),
      StageReport.members[3].make({ runId, stageIndex, stats })
    )
  },
  stop: (_runId, stageIndex) => Ref.update(stops, (s) => [...s, stageIndex]),
  capacity: Effect.succeed(capacity),
  cachedRanges: Effect.succeed([])
})

const serve = (address: TransportAddress = tcpAddress(0), host?: StageHost) =>
  Effect.gen(function* () {
    const stops = yield* Ref.make<ReadonlyArray<number>>([])
    const bound = yield* AgentControlRpc.serveControlRpc({ address, token, host: host ?? fakeHost(stops), hello })
    return { bound, stops }
  })

const connect = (address: string, withToken = token) =>
  Effect.flatMap(AgentControl, (control) => control.connect({ nodeId, address }, withToken)).pipe(
    Effect.provide(AgentControlRpc.layer)
  )

/** A TCP proxy to `port` whose `cut()` destroys every connection through it (and refuses new ones). */
const cutProxy = (port: number) =>
  Effect.acquireRelease(
    Effect.async<{ readonly port: number; readonly cut: () => void; readonly server: Net.Server }>((resume) => {
      const sockets = new Set<Net.Socket>()
      let cut = false
      const track = (s: Net.Socket) => {
        sockets.add(s)
        s.on("error", () => {})
        s.on("close", () => sockets.delete(s))
      }
      const server = Net.createServer((client) => {
        track(client)
        if (cut) return void client.destroy()
        const upstream = Net.createConnection({ host: "127.0.0.1", port })
        track(upstream)
        client.pipe(upstream)
        upstream.pipe(client)
        client.on("close", () => upstream.destroy())
        upstream.on("close", () => client.destroy())
      })
      server.listen(0, "127.0.0.1", () =>
        resume(
          Effect.succeed({
            port: (server.address() as Net.AddressInfo).port,
            server,
            cut: () => {
              cut = true
              for (const s of sockets) s.destroy()
            }
          })
        )
      )
    }),
    ({ cut, server }) =>
      Effect.async<void>((resume) => {
        cut()
        server.close(() => resume(Effect.void))
      })
  )

const tempDir = Effect.acquireRelease(
  Effect.sync(() => mkdtempSync(join(tmpdir(), "swactor-cp-"))),
  (dir) => Effect.sync(() => rmSync(dir, { recursive: true, force: true }))
)

describe("control plane (AgentRpcs over the authenticated socket)", () => {
  // A stage's fault reason is the run FSM's own vocabulary on the wire: every reason (an optional message
  // present or absent) reaches the orchestrator's side of the link exactly as the agent reported it.
  it.scopedLive("every stage fault reason crosses the control link unchanged", () =>
    Effect.gen(function* () {
      const { bound } = yield* serve()
      const link = yield* connect(AgentControlRpc.formatAddress(bound))
      for (const [i, reason] of everyReason.entries()) {
        const reports = Chunk.toReadonlyArray(yield* Stream.runCollect(link.provision(request(20 + i))))
        assert.deepStrictEqual(reports, [StageReport.members[2].make({ runId, stageIndex: 20 + i, reason })])
      }
    })
  )

  // Every RPC of the group round-trips through a real authenticated TCP socket: Hello, Capacity, the
  // Provision report stream (ending after StageStopped, a fault report included) and Stop.
  it.scopedLive("round-trips Hello, Capacity, Provision and Stop over a real socket", () =>
    Effect.gen(function* () {
      const { bound, stops } = yield* serve()
      assert.strictEqual(bound._tag === "Tcp" && bound.host, "127.0.0.1")
      const link = yield* connect(AgentControlRpc.formatAddress(bound))

      assert.deepStrictEqual(link.hello, hello)
      assert.deepStrictEqual(yield* link.capacity, capacity)

      const reports = Chunk.toReadonlyArray(yield* Stream.runCollect(link.provision(request(0))))
      assert.deepStrictEqual(
        reports.map((r) => r._tag),
        ["StageLoading", "StageReady", "StageStopped"]
      )
      const stopped = reports[2]!
      assert.isTrue(stopped._tag === "StageStopped" && stopped.stats.decodeComputeMillis === 7)

      const faulted = Chunk.toReadonlyArray(yield* Stream.runCollect(link.provision(request(1))))
      assert.deepStrictEqual(
        faulted[1],
        StageReport.members[2].make({
          runId,
          stageIndex: 1,
          reason: StageFaultReasons.ModelLoadFailed({ message: "no memory for 256" })
        })
      )

      yield* link.stop(runId, 0)
      yield* link.stop(runId, 0)
      assert.deepStrictEqual(yield* Ref.get(stops), [0, 0])
    })
  )

  it.scopedLive("works over a Unix socket address", () =>
    Effect.gen(function* () {
      const path = join(yield* tempDir, "control.sock")
      const { bound } = yield* serve({ _tag: "Unix", path })
      assert.deepStrictEqual(bound, { _tag: "Unix", path })
      const link = yield* connect(path)
      assert.strictEqual((yield* link.capacity).hostname, "fake-agent")
      assert.strictEqual(link.hello.pid, 4242)
    })
  )

  // A client without the cluster token is refused before any RPC is read.
  it.scopedLive("refuses a client with a wrong token", () =>
    Effect.gen(function* () {
      const { bound } = yield* serve()
      const result = yield* Effect.either(connect(AgentControlRpc.formatAddress(bound), "wrong-token"))
      assert.isTrue(Either.isLeft(result) && result.left._tag === "AgentUnavailable")
      assert.include((result as Either.Left<{ message: string }, unknown>).left.message, "cannot connect")
    })
  )

  // A raw client that skips the handshake and speaks RPC straight away gets nothing back and is closed.
  it.scopedLive("never answers RPC sent without the handshake", () =>
    Effect.gen(function* () {
      const { bound } = yield* serve()
      const port = (bound as { port: number }).port
      const received = yield* Effect.async<Buffer>((resume) => {
        const chunks: Array<Buffer> = []
        const s = Net.createConnection({ port, host: "127.0.0.1" })
        s.on("error", () => {})
        s.on("data", (c) => chunks.push(c))
        s.on("close", () => resume(Effect.succeed(Buffer.concat(chunks))))
        s.once("connect", () =>
          s.write(JSON.stringify({ _tag: "Request", id: "1", tag: "Capacity", payload: {}, headers: [] }) + "\n")
        )
      }).pipe(Effect.timeoutFail({ duration: "10 seconds", onTimeout: () => new Error("the server never closed") }))
      // At most the server's handshake challenge came back — no RPC reply.
      const text = received.toString("latin1")
      assert.isFalse(text.includes("Exit"))
      assert.isFalse(text.includes("fake-agent"))
    })
  )

  it.scopedLive("fails to connect to a closed port with AgentUnavailable", () =>
    Effect.gen(function* () {
      const result = yield* Effect.either(connect("127.0.0.1:1"))
      assert.isTrue(Either.isLeft(result) && result.left._tag === "AgentUnavailable")
      assert.include((result as Either.Left<{ message: string }, unknown>).left.message, "cannot connect")
    })
  )

  // A control connection that drops mid-provision (the agent crashed, the network cut it) fails the
  // provision stream at once: a fault, never a hang.
  it.scopedLive(
    "a dropped connection fails an open provision stream with AgentUnavailable",
    () =>
      Effect.gen(function* () {
        const { bound } = yield* serve()
        const proxy = yield* cutProxy((bound as { port: number }).port)
        const link = yield* connect(`127.0.0.1:${proxy.port}`)
        const loading = yield* Effect.makeLatch(false)
        const fiber = yield* link.provision(request(9)).pipe(
          Stream.runForEach(() => loading.open),
          Effect.either,
          Effect.fork
        )
        yield* loading.await
        proxy.cut()
        const result = yield* Fiber.join(fiber).pipe(
          Effect.timeoutFail({ duration: "5 seconds", onTimeout: () => new Error("the stream hung") })
        )
        assert.isTrue(Either.isLeft(result) && result.left._tag === "AgentUnavailable")
      }),
    15_000
  )
})
