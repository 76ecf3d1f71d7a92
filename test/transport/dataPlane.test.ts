import * as Net from "node:net"
import * as Os from "node:os"
import * as Path from "node:path"
import { assert, describe, it } from "@effect/vitest"
import { Effect, Either, Fiber, Option, Redacted } from "effect"
import {
  ActivationFrame,
  AttachFrame,
  DoorbellFrame,
  type DataFrame,
  type TransportAddress,
  TokenFrame
} from "../../src/domain/frames.js"
import type { EdgeId, RunId } from "../../src/domain/ids.js"
import type { RingSpec } from "../../src/domain/plan.js"
import * as Auth from "../../src/layers/transport/Auth.js"
import * as EdgeTransport from "../../src/layers/transport/EdgeTransport.js"
import * as Framing from "../../src/layers/transport/Framing.js"
import * as ShmRing from "../../src/layers/transport/ShmRing.js"
import { until } from "../support/until.js"

const token = Redacted.make("dataplane-test-token")
const runId = 11 as RunId
const edgeId = 4 as EdgeId

const ringOf = (
  dataCapacity: number,
  alignment = 64,
  wakeCoalescing: RingSpec["wakeCoalescing"] = "PendingBit"
): RingSpec => ({
  dataCapacity,
  alignment,
  direction: "Egress",
  hostPinning: "Pageable",
  wakeCoalescing
})

let socketCounter = 0
const unixAddress = (): TransportAddress => ({
  _tag: "Unix",
  path: Path.join(Os.tmpdir(), `swactor-dp-${process.pid}-${socketCounter++}.sock`)
})
const transports: ReadonlyArray<{ name: string; address: () => TransportAddress; sharedMemory: boolean }> = [
  { name: "TCP", address: () => ({ _tag: "Tcp", host: "127.0.0.1", port: 0 }), sharedMemory: false },
  { name: "Unix", address: unixAddress, sharedMemory: false },
  ...(ShmRing.isSupported() ? [{ name: "shared memory", address: unixAddress, sharedMemory: true }] : [])
]

const activation = (step: number, nTokens: number, hiddenDim: number, startPos = 0) =>
  ActivationFrame({
    runId,
    edgeId,
    step,
    startPos,
    nTokens,
    hiddenDim,
    payload: Float32Array.from({ length: nTokens * hiddenDim }, (_, i) => Math.sin(i + step))
  })

const decode = (step: number, tokenId: number) =>
  TokenFrame({ runId, edgeId, step, payload: { _tag: "Decode", tokenId } })

const sleep = (ms: number) => Effect.promise(() => new Promise((r) => setTimeout(r, ms)))

/** Waits (real time) until `f` holds, with the suite's generous outer limit (support/until.ts). */
const eventually = <A>(get: Effect.Effect<A>, f: (a: A) => boolean) =>
  until("a transport state", get, f).pipe(Effect.orDie)

/** Set up a listener with one registered edge, and a connected sender. */
const edge = (address: TransportAddress, ring: RingSpec, sharedMemory = false) =>
  Effect.gen(function* () {
    const listener = yield* EdgeTransport.listen({ address, token })
    const receiver = yield* listener.register({ runId, edgeId, ring })
    const sender = yield* EdgeTransport.connect({ address: listener.address, token, runId, edgeId, ring, sharedMemory })
    yield* receiver.attached
    return { listener, receiver, sender }
  })

/**
 * An authenticated, attached raw sender, for writing hand-made bytes at a receiver: on the socket,
 * or into a shared-memory ring followed by a doorbell.
 */
const rawSender = (address: TransportAddress, ring: RingSpec, sharedMemory = false) =>
  Effect.gen(function* () {
    const shm = sharedMemory
      ? yield* Effect.acquireRelease(
          Effect.sync(() => ShmRing.ShmRing.create(ring.dataCapacity, ring.alignment)),
          (r) =>
            Effect.sync(() => {
              r.unlink()
              r.close()
            })
        )
      : undefined
    const socket = yield* Effect.acquireRelease(
      Effect.async<Net.Socket>((resume) => {
        const s = Net.createConnection(
          address._tag === "Tcp" ? { port: address.port, host: address.host } : { path: address.path }
        )
        s.on("error", () => {})
        s.once("connect", () => resume(Effect.succeed(s)))
      }),
      (s) => Effect.sync(() => s.destroy())
    )
    yield* Auth.clientHandshake(socket, { token })
    const received: Array<Buffer> = []
    socket.on("data", (c) => received.push(c))
    socket.resume()
    socket.write(
      Framing.unsafeEncode(
        AttachFrame({
          runId,
          edgeId,
          dataCapacity: ring.dataCapacity,
          alignment: ring.alignment,
          wakeCoalescing: ring.wakeCoalescing,
          sharedMemory: shm?.path ?? ""
        }),
        8
      )
    )
    yield* eventually(
      Effect.sync(() => Buffer.concat(received).length),
      (n) => n >= Framing.HEADER_BYTES
    )
    const doorbell = Framing.unsafeEncode(DoorbellFrame({ runId, edgeId }), ring.alignment)
    return {
      write: (bytes: Uint8Array) => {
        if (shm === undefined) return void socket.write(bytes)
        shm.write(bytes)
        socket.write(doorbell)
      },
      end: () => socket.end()
    }
  })

const sameActivation = (a: DataFrame, b: ActivationFrame) => {
  assert.strictEqual(a._tag, "ActivationFrame")
  if (a._tag !== "ActivationFrame") return
  assert.strictEqual(a.step, b.step)
  assert.strictEqual(a.startPos, b.startPos)
  assert.strictEqual(a.nTokens, b.nTokens)
  assert.strictEqual(a.hiddenDim, b.hiddenDim)
  assert.strictEqual(a.payload.length, b.payload.length)
  assert.isTrue(
    a.payload.every((x, i) => x === b.payload[i]),
    "payload differs"
  )
}

for (const transport of transports) {
  describe(`DataPlane over ${transport.name}`, () => {
    it.scopedLive("delivers token and activation frames in order", () =>
      Effect.gen(function* () {
        const { receiver, sender } = yield* edge(transport.address(), ringOf(64 * 1024), transport.sharedMemory)
        const sent = [activation(0, 3, 16, 0), activation(1, 1, 16, 3), activation(2, 1, 16, 4)]
        for (const f of sent) yield* sender.send(f)
        const got: Array<DataFrame> = []
        while (got.length < sent.length) got.push(...(yield* receiver.receive))
        sent.forEach((f, i) => sameActivation(got[i]!, f))
        const { receiver: r2, sender: s2 } = yield* edge(transport.address(), ringOf(4096), transport.sharedMemory)
        yield* s2.send(TokenFrame({ runId, edgeId, step: 0, payload: { _tag: "Prompt", tokens: [1, 2, 3] } }))
        yield* s2.send(TokenFrame({ runId, edgeId, step: 1, payload: { _tag: "Sampled", tokenId: 9, eos: true } }))
        const a = yield* r2.take
        const b = yield* r2.take
        assert.deepStrictEqual(a._tag === "TokenFrame" && a.payload, { _tag: "Prompt", tokens: [1, 2, 3] })
        assert.deepStrictEqual(b._tag === "TokenFrame" && b.payload, { _tag: "Sampled", tokenId: 9, eos: true })
      })
    )

    // Capacity is the window: a producer waits when the consumer is a full window behind.
    it.scopedLive("blocks the producer when the consumer is a full window behind", () =>
      Effect.gen(function* () {
        const ring = ringOf(16 * 1024)
        const { receiver, sender } = yield* edge(transport.address(), ring, transport.sharedMemory)
        const frames = Array.from({ length: 10 }, (_, i) => activation(i, 1, 1000, i))
        const frameBytes = Framing.encodedLength(frames[0]!, ring.alignment)
        assert.strictEqual(frameBytes, 4096)
        const producer = yield* Effect.fork(Effect.forEach(frames, (f) => sender.send(f), { discard: true }))
        const full = yield* eventually(sender.stats, (s) => s.frames === 4)
        yield* sleep(50)
        const stalled = yield* sender.stats
        assert.strictEqual(stalled.frames, 4)
        assert.strictEqual(stalled.outstandingBytes, ring.dataCapacity)
        assert.strictEqual(full.outstandingBytes, ring.dataCapacity)
        assert.isNull(producer.unsafePoll())
        assert.strictEqual((yield* receiver.stats).unconsumedBytes, ring.dataCapacity)
        // Taking one frame frees exactly one frame of window: at once on a socket; on shared memory, whose payloads
        // are views of the ring, once the consumer asks for the next frame.
        const got = [yield* receiver.take]
        if (transport.sharedMemory) {
          yield* sleep(50)
          assert.strictEqual((yield* sender.stats).frames, 4)
          got.push(yield* receiver.take)
        }
        yield* eventually(sender.stats, (s) => s.frames === 5)
        while (got.length < frames.length) got.push(...(yield* receiver.receive))
        yield* Fiber.join(producer)
        got.forEach((f, i) => assert.strictEqual(f.step, i))
        const done = yield* sender.stats
        assert.isAtMost(done.maxOutstandingBytes, ring.dataCapacity)
        assert.isAbove(done.windowWaits, 0)
      })
    )

    // A prefill larger than one window travels in chunks that fit and arrives whole.
    it.scopedLive("sends a prefill larger than the window in chunks and delivers it intact", () =>
      Effect.gen(function* () {
        const ring = ringOf(64 * 1024)
        const { receiver, sender } = yield* edge(transport.address(), ring, transport.sharedMemory)
        const prefill = activation(0, 100, 2048, 0)
        const consumer = yield* Effect.fork(receiver.take)
        yield* sender.send(prefill)
        const got = yield* Fiber.join(consumer)
        sameActivation(got, prefill)
        const stats = yield* sender.stats
        assert.isAtLeast(stats.frames, 13)
        assert.isAtMost(stats.maxOutstandingBytes, ring.dataCapacity)
        // The next message follows in sequence.
        yield* sender.send(activation(1, 1, 2048, 100))
        sameActivation(yield* receiver.take, activation(1, 1, 2048, 100))
      })
    )

    // PendingBit: a burst of N frames costs the consumer one wake and the sender one credit frame.
    it.scopedLive("PendingBit coalesces a burst into one wake", () =>
      Effect.gen(function* () {
        const { receiver, sender } = yield* edge(
          transport.address(),
          ringOf(64 * 1024, 64, "PendingBit"),
          transport.sharedMemory
        )
        const burst = Array.from({ length: 16 }, (_, i) => decode(i, 100 + i))
        yield* sender.sendAll(burst)
        yield* eventually(receiver.stats, (s) => s.messages === 16)
        const got = yield* receiver.receive
        assert.strictEqual(got.length, 16)
        // Shared memory credits what it lent when the consumer asks again.
        if (transport.sharedMemory) yield* Effect.fork(receiver.receive)
        yield* eventually(sender.stats, (s) => s.outstandingBytes === 0)
        const stats = yield* receiver.stats
        assert.strictEqual(stats.signals, 1)
        assert.strictEqual(stats.wakes, 1)
        assert.strictEqual(stats.creditFrames, 1)
      })
    )

    // EveryFrame: the same burst costs one wake and one credit per frame.
    it.scopedLive("EveryFrame wakes once per frame", () =>
      Effect.gen(function* () {
        const { receiver, sender } = yield* edge(
          transport.address(),
          ringOf(64 * 1024, 64, "EveryFrame"),
          transport.sharedMemory
        )
        yield* sender.sendAll(Array.from({ length: 16 }, (_, i) => decode(i, i)))
        yield* eventually(receiver.stats, (s) => s.messages === 16)
        for (let i = 0; i < 16; i++) assert.strictEqual((yield* receiver.receive).length, 1)
        const stats = yield* receiver.stats
        assert.strictEqual(stats.signals, 16)
        assert.strictEqual(stats.wakes, 16)
        // Shared memory credits each frame when the consumer asks for the next: the last one is still lent.
        assert.strictEqual(stats.creditFrames, transport.sharedMemory ? 15 : 16)
      })
    )

    // Faults are typed, reach both ends, and leave the listener serving other edges.
    it.scopedLive("faults the edge on an out-of-order frame and tells the sender", () =>
      Effect.gen(function* () {
        const { receiver, sender } = yield* edge(transport.address(), ringOf(64 * 1024), transport.sharedMemory)
        yield* sender.send(decode(0, 1))
        yield* sender.send(decode(2, 1))
        assert.strictEqual((yield* receiver.take)._tag, "TokenFrame")
        const fault = yield* Effect.flip(receiver.receive)
        assert.strictEqual(fault._tag, "OutOfOrder")
        const senderFault = yield* sender.fault
        assert.isTrue(senderFault._tag === "PeerFaulted" && senderFault.reason === "OutOfOrder")
        const again = yield* Effect.either(sender.send(decode(3, 1)))
        assert.isTrue(Either.isLeft(again))
      })
    )

    const hostile: ReadonlyArray<{ name: string; tag: string; bytes: (ring: RingSpec) => Uint8Array; end?: boolean }> =
      [
        { name: "malformed bytes", tag: "Malformed", bytes: () => new Uint8Array(64).fill(0xab) },
        {
          name: "a header with a bad body",
          tag: "Malformed",
          bytes: (ring) => {
            const b = Framing.unsafeEncode(decode(0, 5), ring.alignment).slice()
            b[Framing.HEADER_BYTES] = 9
            return b
          }
        },
        {
          name: "an oversized frame",
          tag: "Oversized",
          // Only the header: the announced length alone must fault, before any body is buffered.
          bytes: (ring) => Framing.unsafeEncode(activation(0, 10, 2048), ring.alignment).subarray(0, 64)
        },
        {
          name: "an out-of-order frame",
          tag: "OutOfOrder",
          bytes: (ring) => Framing.unsafeEncode(decode(5, 1), ring.alignment)
        },
        {
          name: "a frame cut short by the peer closing",
          tag: "Truncated",
          bytes: (ring) => Framing.unsafeEncode(activation(0, 1, 256), ring.alignment).subarray(0, 700),
          end: true
        },
        {
          name: "a sender that ignores the window",
          tag: "WindowExceeded",
          bytes: (ring) => {
            const frames = Array.from({ length: 6 }, (_, i) =>
              Framing.unsafeEncode(activation(i, 1, 1000, i), ring.alignment)
            )
            return Buffer.concat(frames)
          }
        }
      ]
    // A shared-memory ring physically holds at most one window, so it cannot be overrun.
    for (const h of hostile.filter((h) => !(transport.sharedMemory && h.tag === "WindowExceeded"))) {
      it.scopedLive(`faults the edge with ${h.tag} on ${h.name}, and the receiver survives`, () =>
        Effect.gen(function* () {
          const ring = ringOf(16 * 1024)
          const listener = yield* EdgeTransport.listen({ address: transport.address(), token })
          const receiver = yield* listener.register({ runId, edgeId, ring })
          const raw = yield* rawSender(listener.address, ring, transport.sharedMemory)
          raw.write(h.bytes(ring))
          if (h.end === true) raw.end()
          // Messages that were complete and in order before the bad frame are still handed over.
          let delivered = 0
          const fault = yield* receiver.receive.pipe(
            Effect.tap((frames) => Effect.sync(() => (delivered += frames.length))),
            Effect.forever,
            Effect.flip
          )
          assert.strictEqual(fault._tag, h.tag)
          assert.strictEqual(delivered, h.tag === "WindowExceeded" ? 4 : 0)
          // The same listener still serves a fresh edge.
          const fresh = yield* listener.register({ runId, edgeId: 77 as EdgeId, ring })
          const sender = yield* EdgeTransport.connect({
            address: listener.address,
            token,
            runId,
            edgeId: 77 as EdgeId,
            ring,
            sharedMemory: transport.sharedMemory
          })
          yield* sender.send(
            TokenFrame({ runId, edgeId: 77 as EdgeId, step: 0, payload: { _tag: "Decode", tokenId: 3 } })
          )
          assert.strictEqual((yield* fresh.take)._tag, "TokenFrame")
        })
      )
    }

    // A sender that closes gracefully: complete frames are still delivered, then PeerClosed.
    it.scopedLive("delivers complete frames before reporting a closed peer", () =>
      Effect.gen(function* () {
        const { receiver, sender } = yield* edge(transport.address(), ringOf(64 * 1024), transport.sharedMemory)
        yield* sender.sendAll([decode(0, 1), decode(1, 2)])
        yield* eventually(receiver.stats, (s) => s.messages === 2)
        yield* sender.close
        yield* sleep(20)
        assert.strictEqual((yield* receiver.receive).length, 2)
        const fault = yield* Effect.flip(receiver.receive)
        assert.strictEqual(fault._tag, "PeerClosed")
      })
    )
  })
}

describe.skipIf(!ShmRing.isSupported())("DataPlane over shared memory, busy-polling", () => {
  // A receiver that busy-polls the ring and then sleeps must never miss a frame written around the switch.
  it.scopedLive("delivers every frame whether it is caught by polling or by the doorbell", () =>
    Effect.gen(function* () {
      const ring = ringOf(16 * 1024)
      const listener = yield* EdgeTransport.listen({ address: unixAddress(), token })
      const receiver = yield* listener.register({ runId, edgeId, ring, spinMicros: 200 })
      const sender = yield* EdgeTransport.connect({
        address: listener.address,
        token,
        runId,
        edgeId,
        ring,
        sharedMemory: true
      })
      const producer = yield* Effect.fork(
        Effect.forEach(
          Array.from({ length: 50 }, (_, i) => activation(i, 1, 700, i)),
          (f, i) => Effect.zipRight(i % 7 === 0 ? sleep(1) : Effect.void, sender.send(f)),
          { discard: true }
        )
      )
      // Each batch is checked before the next receive: its payloads are views of the ring until then.
      let count = 0
      while (count < 50) {
        for (const f of yield* receiver.receive) sameActivation(f, activation(count, 1, 700, count++))
      }
      yield* Fiber.join(producer)
      assert.isAbove((yield* receiver.stats).spins, 0)
      assert.isAtMost((yield* sender.stats).maxOutstandingBytes, ring.dataCapacity)
    })
  )
})

describe.skipIf(!ShmRing.isSupported())("DataPlane over shared memory, lent payloads", () => {
  // The receiving side copies nothing: an activation's payload is a view of the ring. The producer cannot write
  // over it while the consumer holds it, only once the consumer asks for the next frame. A payload kept after its
  // edge closed is safe to read, as zeros: the ring's memory is given back at close, its range unmapped only once
  // no view of it is left (reading an unmapped view would crash the process).
  it.scopedLive("a taken payload is the ring's bytes, intact until the next take, zeros after the edge closed", () =>
    Effect.gen(function* () {
      const ring = ringOf(16 * 1024) // four 4 KiB frames
      const frames = Array.from({ length: 12 }, (_, i) => activation(i, 1, 1000, i))
      const kept = yield* Effect.scoped(
        Effect.gen(function* () {
          const { receiver, sender } = yield* edge(unixAddress(), ring, true)
          const producer = yield* Effect.fork(Effect.forEach(frames, (f) => sender.send(f), { discard: true }))
          const first = yield* receiver.take
          yield* eventually(sender.stats, (s) => s.frames === 4)
          yield* sleep(50)
          // Window full: frame 0 is held, so frame 4 (which goes where frame 0 is) waits.
          assert.strictEqual((yield* sender.stats).frames, 4)
          sameActivation(first, frames[0]!)
          const second = yield* receiver.take
          yield* eventually(sender.stats, (s) => s.frames === 5)
          yield* sleep(20)
          sameActivation(second, frames[1]!)
          // Asking for frame 1 gave frame 0's bytes back: frame 4 now lies where frame 0 was, and the first payload,
          // a view of that place, reads it (a copy would still read frame 0).
          assert.deepStrictEqual(
            Array.from(first._tag === "ActivationFrame" ? first.payload : []),
            Array.from(frames[4]!.payload)
          )
          yield* Fiber.interrupt(producer)
          return second
        })
      )
      assert.strictEqual(kept._tag, "ActivationFrame")
      const payload = kept._tag === "ActivationFrame" ? kept.payload : new Float32Array(1)
      assert.strictEqual(payload.length, 1000)
      assert.isTrue(payload.every((x) => x === 0))
    })
  )
})

describe("EdgeTransport.layer", () => {
  it.scopedLive("provides this node's listener as a service", () =>
    Effect.gen(function* () {
      const listener = yield* EdgeTransport.DataPlaneNode
      const receiver = yield* listener.register({ runId, edgeId, ring: ringOf(4096) })
      const sender = yield* EdgeTransport.connect({
        address: listener.address,
        token,
        runId,
        edgeId,
        ring: ringOf(4096)
      })
      yield* sender.send(decode(0, 42))
      const got = yield* receiver.take
      assert.deepStrictEqual(got._tag === "TokenFrame" && got.payload, { _tag: "Decode", tokenId: 42 })
    }).pipe(Effect.provide(EdgeTransport.layer({ token })))
  )
})

describe.skipIf(!ShmRing.isSupported())("ShmRing", () => {
  // Bytes survive the ring's end and the cursor modulus wrapping, at any window size.
  it("round-trips bytes across the ring end and the cursor wrap", () => {
    for (const window of [1000, 4096, 12_345]) {
      const producer = ShmRing.ShmRing.create(window, 64)
      const consumer = ShmRing.ShmRing.open(producer.path, window, 64)
      try {
        assert.strictEqual(producer.capacity % 64, 0)
        producer.unsafeSetCursors(-100)
        let next = 0
        for (let round = 0; round < 50; round++) {
          const chunk = Uint8Array.from({ length: 1 + ((round * 37) % 700) }, (_, i) => (next + i) & 0xff)
          assert.isTrue(producer.write(chunk))
          const out = consumer.drain()
          assert.isTrue(out instanceof Uint8Array)
          assert.deepStrictEqual(Array.from(out as Uint8Array), Array.from(chunk))
          next += chunk.length
        }
        assert.isFalse(producer.write(new Uint8Array(producer.capacity + 1)))
      } finally {
        producer.unlink()
        producer.close()
        consumer.close()
      }
    }
  })
  // writeWith fills the slot in place (or a temporary when the slot wraps the ring's end): the consumer drains
  // exactly the bytes written, over garbage left in the ring by earlier rounds.
  it("writeWith writes in place, across the ring end too", () => {
    for (const window of [1000, 4096]) {
      const producer = ShmRing.ShmRing.create(window, 64)
      const consumer = ShmRing.ShmRing.open(producer.path, window, 64)
      try {
        producer.unsafeSetCursors(-100)
        let wrapped = 0
        for (let round = 0; round < 40; round++) {
          const length = 1 + ((round * 53) % 600)
          const expected = Uint8Array.from({ length }, (_, i) => (round * 7 + i) & 0xff)
          assert.isTrue(
            producer.writeWith(length, (slot) => {
              assert.strictEqual(slot.length, length)
              if (slot.buffer.byteLength === length) wrapped++
              slot.set(expected)
            })
          )
          assert.deepStrictEqual(Array.from(consumer.drain() as Uint8Array), Array.from(expected))
        }
        assert.isAbove(wrapped, 0, "no slot wrapped the ring's end")
        let called = false
        assert.isFalse(producer.writeWith(producer.capacity + 1, () => void (called = true)))
        assert.isFalse(called)
      } finally {
        producer.unlink()
        producer.close()
        consumer.close()
      }
    }
  })
})

describe("DataPlane shared-memory attach", () => {
  // A sender cannot make the receiver map an arbitrary file: only /dev/shm/swactor-* names are accepted.
  for (const path of ["/etc/passwd", "/dev/shm/swactor-../../etc/passwd", "/dev/shm/other.ring"]) {
    it.scopedLive(`refuses to map ${path}`, () =>
      Effect.gen(function* () {
        const ring = ringOf(16 * 1024)
        const listener = yield* EdgeTransport.listen({ address: unixAddress(), token })
        const receiver = yield* listener.register({ runId, edgeId, ring })
        const address = listener.address as { path: string }
        const socket = yield* Effect.acquireRelease(
          Effect.async<Net.Socket>((resume) => {
            const s = Net.createConnection({ path: address.path })
            s.on("error", () => {})
            s.once("connect", () => resume(Effect.succeed(s)))
          }),
          (s) => Effect.sync(() => s.destroy())
        )
        yield* Auth.clientHandshake(socket, { token })
        const received: Array<Buffer> = []
        socket.on("data", (c) => received.push(c))
        const closed = new Promise<void>((r) => socket.on("close", () => r()))
        socket.resume()
        socket.write(
          Framing.unsafeEncode(
            AttachFrame({
              runId,
              edgeId,
              dataCapacity: ring.dataCapacity,
              alignment: ring.alignment,
              wakeCoalescing: ring.wakeCoalescing,
              sharedMemory: path
            }),
            8
          )
        )
        yield* Effect.promise(() => closed)
        const reply = Framing.decode(Buffer.concat(received), Framing.preAttachLimits)
        assert.isTrue(
          Either.isRight(reply) && reply.right._tag === "FaultFrame" && reply.right.reason === "RingMismatch"
        )
        // The registered edge stays unattached.
        assert.isTrue(Option.isNone(yield* Effect.option(Effect.timeout(receiver.attached, "20 millis"))))
      })
    )
  }
})

describe("DataPlane alignment on the wire", () => {
  // Every frame a sender writes is a multiple of the ring alignment, with the payload aligned inside.
  it.scopedLive("pads every frame to the ring alignment", () =>
    Effect.gen(function* () {
      const ring = ringOf(64 * 1024, 256)
      const listener = yield* EdgeTransport.listen({ token })
      const receiver = yield* listener.register({ runId, edgeId, ring })
      const target = listener.address as { port: number }
      const captured: Array<Buffer> = []
      const proxy = yield* Effect.acquireRelease(
        Effect.async<Net.Server>((resume) => {
          const server = Net.createServer((inbound) => {
            const outbound = Net.createConnection({ port: target.port, host: "127.0.0.1" })
            inbound.on("data", (c) => {
              captured.push(c)
              outbound.write(c)
            })
            outbound.on("data", (c) => inbound.write(c))
            inbound.on("error", () => {})
            outbound.on("error", () => {})
            inbound.on("close", () => outbound.destroy())
          })
          server.listen(0, "127.0.0.1", () => resume(Effect.succeed(server)))
        }),
        (server) => Effect.async<void>((resume) => void server.close(() => resume(Effect.void)))
      )
      const sender = yield* EdgeTransport.connect({
        address: { _tag: "Tcp", host: "127.0.0.1", port: (proxy.address() as Net.AddressInfo).port },
        token,
        runId,
        edgeId,
        ring
      })
      const frames: Array<DataFrame> = [activation(0, 1, 3), decode(1, 7), activation(2, 2, 5, 1)]
      for (const f of frames) yield* sender.send(f)
      for (let i = 0; i < frames.length; i++) yield* receiver.take
      const wire = Buffer.concat(captured).subarray(Auth.HELLO_BYTES + Auth.PROOF_BYTES)
      let at = Framing.decodeAt(wire, 0, Framing.preAttachLimits)
      assert.strictEqual(at._tag === "Frame" && at.frame._tag, "AttachFrame")
      let offset = at._tag === "Frame" ? at.length : 0
      let count = 0
      while (offset < wire.length) {
        at = Framing.decodeAt(wire, offset, { alignment: ring.alignment, maxFrameBytes: ring.dataCapacity })
        assert.strictEqual(at._tag, "Frame")
        if (at._tag !== "Frame") break
        assert.strictEqual(offset % ring.alignment, 8 % ring.alignment === 0 ? 0 : offset % ring.alignment)
        assert.strictEqual(at.length % ring.alignment, 0)
        if (at.frame._tag === "ActivationFrame") {
          assert.strictEqual(wire.readUInt32LE(offset + Framing.HEADER_BYTES + 16) % ring.alignment, 0)
        }
        offset += at.length
        count++
      }
      assert.strictEqual(count, frames.length)
    })
  )
})
