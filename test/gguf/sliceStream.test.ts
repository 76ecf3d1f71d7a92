// Weight delivery's byte stream (issue 10; W4–W7 in specs/BEHAVIOR_GUARANTEES.md): a slice travels on a connection of
// its own to the agent's control port, piped from the file and checked by SHA-256 as it arrives; it resumes after a
// cut, a partial file that is not a prefix of the slice is found out and replaced, and across hosts (TLS) an
// observer sees none of its bytes. In process: the agent's control server with a weight store, the orchestrator's
// control link, stories260K as one stage.
import { createHash } from "node:crypto"
import * as Fs from "node:fs"
import * as Net from "node:net"
import * as Os from "node:os"
import * as Path from "node:path"
import { assert, describe, it } from "@effect/vitest"
import { Effect, type Scope, Stream } from "effect"
import { AgentHello, type NodeCapacity, StageWeights } from "../../src/domain/controlRpc.js"
import { tcpAddress } from "../../src/domain/frames.js"
import { NodeId } from "../../src/domain/ids.js"
import * as AgentControlRpc from "../../src/layers/agent/AgentControlRpc.js"
import { Settings } from "../../src/layers/config/Settings.js"
import { readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { sliceHash } from "../../src/layers/gguf/GgufSlice.js"
import { makeWeightStore } from "../../src/layers/gguf/SliceStore.js"
import { sendSlice } from "../../src/layers/gguf/SliceStream.js"
import { deliverWeights } from "../../src/layers/orchestrator/WeightDelivery.js"
import * as Tls from "../../src/layers/transport/Tls.js"
import { AgentControl, type AgentLink, type StageHost } from "../../src/services/AgentLinks.js"
import type { RunUpdate } from "../../src/services/Orchestrator.js"
import { requireModel } from "../support/models.js"

const token = "slice-stream-test-token"
const CHUNK = 16 << 10

const capacity: NodeCapacity = {
  freeMemoryBytes: 1e9,
  totalMemoryBytes: 2e9,
  threads: 1,
  backend: "cpu",
  hostname: "slice-stream-agent",
  activeStages: 0
}
const host: StageHost = {
  provision: () => Stream.empty,
  stop: () => Effect.void,
  capacity: Effect.succeed(capacity),
  cachedRanges: Effect.succeed([])
}

const tempDir = Effect.acquireRelease(
  Effect.sync(() => Fs.mkdtempSync(Path.join(Os.tmpdir(), "swactor-slice-stream-"))),
  (dir) => Effect.sync(() => Fs.rmSync(dir, { recursive: true, force: true }))
)

/** An agent's control server with an empty slice cache, and the orchestrator's link to it (through `via`, if given). */
const world = (via?: (port: number) => Effect.Effect<number, never, Scope.Scope>) =>
  Effect.gen(function* () {
    const dir = yield* tempDir
    const cacheDir = Path.join(dir, "cache")
    const store = makeWeightStore({ cacheDir, slicesOnly: true })
    const bound = yield* AgentControlRpc.serveControlRpc({
      address: tcpAddress(0, "127.0.0.1"),
      token,
      host,
      weights: store,
      hello: new AgentHello({ dataAddress: tcpAddress(1), pid: 1 })
    })
    const port = bound._tag === "Tcp" ? bound.port : 0
    const target = via === undefined ? port : yield* via(port)
    const control = yield* AgentControl.pipe(Effect.provide(AgentControlRpc.layer))
    const link = yield* control.connect({ nodeId: NodeId.make(1), address: `127.0.0.1:${target}` }, token)
    const model = requireModel("stories260K.gguf")
    const file = yield* readGgufFile(model)
    const numLayers = file.tensors.reduce((n, t) => Math.max(n, Number(/^blk\.(\d+)\./.exec(t.name)?.[1] ?? -1) + 1), 0)
    const hash = yield* sliceHash(file, { layerStart: 0, layerEndExclusive: numLayers, numLayers })
    const weights = new StageWeights({ modelPath: model, layerStart: 0, layerEndExclusive: numLayers, numLayers, hash })
    const input = {
      modelPath: model,
      placement: [{ stageIndex: 0, nodeId: 1 }],
      layerRanges: [[0, numLayers] as const],
      outgoingDir: Path.join(dir, "outgoing"),
      chunkBytes: CHUNK
    }
    const deliver = (l: AgentLink, updates: Array<RunUpdate> = []) =>
      deliverWeights({ ...input, linkOf: () => l }, (u) => Effect.sync(() => void updates.push(u))).pipe(
        Effect.map((r) => r[0]!)
      )
    return {
      store,
      link,
      cacheDir,
      weights,
      deliver,
      outgoingDir: input.outgoingDir,
      partial: Path.join(cacheDir, `${hash}.gguf.partial`)
    }
  })

/** The link with its chunk RPC refused: a delivery that still succeeds went by the byte stream. */
const streamOnly = (link: AgentLink): AgentLink => ({
  ...link,
  weights: { ...link.weights!, chunk: () => Effect.die("a chunk RPC was used") }
})

/** The link whose byte stream is cut once `cutAfter` bytes of this transfer were handed to the socket. */
const cutting = (link: AgentLink, cutAfter: number): AgentLink => ({
  ...link,
  weights: {
    ...link.weights!,
    stream: (transfer) => {
      const abort = new AbortController()
      return link.weights!.stream!({
        ...transfer,
        signal: abort.signal,
        onBytes: (offset) => {
          transfer.onBytes?.(offset)
          if (offset - transfer.offset >= cutAfter) abort.abort("connection cut by the test")
        }
      })
    }
  }
})

/** A TCP proxy to `target` that records every byte it forwards, both ways. */
const recordingProxy = (captured: Array<Buffer>) => (target: number) =>
  Effect.acquireRelease(
    Effect.async<Net.Server>((resume) => {
      const server = Net.createServer((client) => {
        const upstream = Net.createConnection({ host: "127.0.0.1", port: target })
        client.on("data", (chunk: Buffer) => void (captured.push(chunk), upstream.write(chunk)))
        upstream.on("data", (chunk: Buffer) => void (captured.push(chunk), client.write(chunk)))
        client.on("error", () => upstream.destroy())
        upstream.on("error", () => client.destroy())
        client.on("close", () => upstream.destroy())
        upstream.on("close", () => client.destroy())
      })
      server.listen(0, "127.0.0.1", () => resume(Effect.succeed(server)))
    }),
    (server) => Effect.sync(() => server.close())
  ).pipe(Effect.map((server) => (server.address() as Net.AddressInfo).port))

describe("weight delivery's byte stream", () => {
  // W4: the slice goes by the byte stream (no chunk RPC), is verified and held; progress rises to the total.
  it.scopedLive(
    "delivers a slice over the byte stream with progress, and the agent then holds it",
    () =>
      Effect.gen(function* () {
        const { cacheDir, deliver, link, outgoingDir, store, weights } = yield* world()
        const updates: Array<RunUpdate> = []
        const sent = yield* deliver(streamOnly(link), updates)
        assert.strictEqual(sent.via, "Sent")
        assert.strictEqual(sent.sentBytes, sent.totalBytes)
        assert.isAbove(sent.totalBytes, 10 * CHUNK)
        const slice = Path.join(cacheDir, `${sent.hash}.gguf`)
        assert.strictEqual(Fs.statSync(slice).size, sent.totalBytes)
        assert.strictEqual(store.received(), 1)
        const progress = updates.flatMap((u) => (u._tag === "WeightsDelivery" ? [u.sentBytes] : []))
        assert.deepStrictEqual(
          [...progress].sort((a, b) => a - b),
          progress
        )
        assert.strictEqual(progress.at(-1), sent.totalBytes)
        // The agent's check (a full tensor-hash verification) accepts what it received.
        assert.deepStrictEqual(yield* link.weights!.check(weights), { _tag: "Held", via: "Slice", path: slice })
        assert.strictEqual((yield* deliver(link)).via, "Slice")
        // The orchestrator keeps the slice's SHA-256 beside it and the model's stage hash for later runs.
        const outgoing = Path.join(outgoingDir, `${sent.hash}.gguf`)
        const digest = createHash("sha256").update(Fs.readFileSync(outgoing)).digest("hex")
        assert.strictEqual(Fs.readFileSync(`${outgoing}.sha256`, "utf8"), digest)
        const memos = Fs.readdirSync(Path.join(outgoingDir, "hashes"))
        assert.deepStrictEqual(
          memos.map((m) => Fs.readFileSync(Path.join(outgoingDir, "hashes", m), "utf8")),
          [sent.hash]
        )
      }),
    60_000
  )

  // W5: a cut transfer leaves the agent a partial file; the next one resumes from its end and only sends the rest.
  it.scopedLive(
    "a cut byte stream resumes from the agent's partial file",
    () =>
      Effect.gen(function* () {
        const { deliver, link, partial, weights } = yield* world()
        const cut = yield* Effect.flip(deliver(cutting(link, 3 * CHUNK)))
        assert.match(cut.message, /connection cut by the test/)
        const missing = yield* link.weights!.check(weights)
        assert.strictEqual(missing._tag, "Missing")
        const have = missing._tag === "Missing" ? missing.have : -1
        assert.isAbove(have, 0)
        assert.isAtMost(have, 3 * CHUNK)
        assert.strictEqual(Fs.statSync(partial).size, have)
        const resumed = yield* deliver(streamOnly(link))
        assert.strictEqual(resumed.resumedFrom, have)
        assert.strictEqual(resumed.sentBytes, resumed.totalBytes - have)
        assert.strictEqual((yield* link.weights!.check(weights))._tag, "Held")
      }),
    60_000
  )

  // W6: a partial file whose bytes are not the slice's (flipped on disk) fails the stream's SHA-256: the agent drops
  // it and the orchestrator sends the slice whole once more.
  it.scopedLive(
    "a corrupted partial file is found out by the stream's SHA-256 and the slice is sent whole",
    () =>
      Effect.gen(function* () {
        const { deliver, link, partial, weights } = yield* world()
        yield* Effect.flip(deliver(cutting(link, 4 * CHUNK)))
        const bytes = Fs.readFileSync(partial)
        bytes[bytes.length >> 1] = bytes[bytes.length >> 1]! ^ 0xff
        Fs.writeFileSync(partial, bytes)
        const again = yield* deliver(streamOnly(link))
        assert.strictEqual(again.resumedFrom, 0)
        assert.strictEqual(again.sentBytes, again.totalBytes)
        assert.deepStrictEqual((yield* link.weights!.check(weights))._tag, "Held")
        // A partial file longer than the slice cannot be a prefix of it either.
        const longer = yield* world()
        Fs.mkdirSync(Path.dirname(longer.partial), { recursive: true })
        Fs.writeFileSync(longer.partial, Buffer.alloc(8 << 20, 7))
        const whole = yield* longer.deliver(streamOnly(longer.link))
        assert.isBelow(whole.totalBytes, 8 << 20)
        assert.strictEqual(whole.resumedFrom, 0)
        assert.strictEqual(whole.sentBytes, whole.totalBytes)
        assert.deepStrictEqual((yield* longer.link.weights!.check(longer.weights))._tag, "Held")
      }),
    60_000
  )

  // W6: the orchestrator's own outgoing slice corrupted on its disk is not passed on: the agent refuses bytes that do
  // not match the SHA-256 it was promised, and the orchestrator checks the slice's tensors, writes it again and resends.
  it.scopedLive(
    "an outgoing slice corrupted on the orchestrator's disk is written again, not passed on",
    () =>
      Effect.gen(function* () {
        const { cacheDir, deliver, link, outgoingDir, weights } = yield* world()
        const sent = yield* deliver(streamOnly(link))
        const outgoing = Path.join(outgoingDir, `${sent.hash}.gguf`)
        const good = Fs.readFileSync(outgoing)
        const bad = Buffer.from(good)
        bad[bad.length - 200] = bad[bad.length - 200]! ^ 0xff
        Fs.writeFileSync(outgoing, bad)
        Fs.rmSync(cacheDir, { recursive: true, force: true })
        const again = yield* deliver(streamOnly(link))
        assert.strictEqual(again.sentBytes, again.totalBytes)
        assert.deepStrictEqual(Fs.readFileSync(outgoing), good)
        // The agent's full tensor-hash check accepts what it now holds.
        assert.strictEqual((yield* link.weights!.check(weights))._tag, "Held")
      }),
    60_000
  )

  // W5: an agent that never answers the stream's request (one that does not know it, a link gone silent) fails the
  // transfer after the silence limit instead of hanging it.
  it.scopedLive(
    "a byte stream that gets no answer fails after the silence limit",
    () =>
      Effect.gen(function* () {
        const mute = yield* Effect.acquireRelease(
          Effect.async<Net.Server>((resume) => {
            const server = Net.createServer((socket) => socket.on("error", () => {}))
            server.listen(0, "127.0.0.1", () => resume(Effect.succeed(server)))
          }),
          (server) => Effect.sync(() => server.close())
        )
        const socket = yield* Effect.async<Net.Socket>((resume) => {
          const s = Net.createConnection({ host: "127.0.0.1", port: (mute.address() as Net.AddressInfo).port }, () =>
            resume(Effect.succeed(s))
          )
        })
        const model = requireModel("stories260K.gguf")
        const started = performance.now()
        const broken = yield* Effect.flip(
          sendSlice(socket, {
            hash: "0".repeat(64),
            path: model,
            offset: 0,
            sha256: "0".repeat(64),
            silenceMillis: 300
          })
        )
        assert.match(broken.message, /no answer from the agent for 0.3 s/)
        assert.isBelow(performance.now() - started, 5_000)
      }),
    20_000
  )

  // W7: across hosts (TLS) an observer of the link sees no slice bytes and no stream header; the same capture with
  // TLS off shows both (so the check can see plaintext).
  it.live(
    "an observer of the byte stream sees no slice bytes under TLS",
    () =>
      Effect.gen(function* () {
        const model = requireModel("stories260K.gguf")
        const file = yield* readGgufFile(model)
        const tensor = file.tensors.find((t) => t.name === "blk.0.ffn_up.weight") ?? file.tensors.at(-1)!
        const fd = Fs.openSync(model, "r")
        const sample = Buffer.alloc(64)
        Fs.readSync(fd, sample, 0, 64, tensor.offset + 1024)
        Fs.closeSync(fd)
        const capture = (mode: Tls.TlsMode) =>
          Effect.gen(function* () {
            const captured: Array<Buffer> = []
            const { deliver, link } = yield* world(recordingProxy(captured))
            const sent = yield* deliver(streamOnly(link))
            assert.strictEqual(sent.sentBytes, sent.totalBytes)
            return Buffer.concat(captured)
          }).pipe(Effect.scoped, Effect.provide(Settings.layer({ tls: mode })))
        const plain = yield* capture("off")
        assert.isTrue(
          plain.includes(sample) && plain.includes(Buffer.from("SWSL")),
          "the plain capture shows the slice"
        )
        const encrypted = yield* capture("always")
        assert.isAbove(encrypted.length, Fs.statSync(model).size / 2)
        assert.isFalse(encrypted.includes(sample), "slice bytes in the clear")
        assert.isFalse(encrypted.includes(Buffer.from("SWSL")), "stream header in the clear")
        assert.isFalse(encrypted.includes(Buffer.from("GGUF")), "GGUF magic in the clear")
      }),
    60_000
  )
})
