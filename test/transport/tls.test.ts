// Encrypted links (issue 10): TLS 1.3 keyed from the cluster token on TCP connections that leave the host.
// T1–T3 in specs/BEHAVIOR_GUARANTEES.md.
import * as Net from "node:net"
import { assert, describe, it } from "@effect/vitest"
import { Effect, Either, Redacted } from "effect"
import { ActivationFrame, TokenFrame, type TransportAddress } from "../../src/domain/frames.js"
import type { EdgeId, RunId } from "../../src/domain/ids.js"
import type { RingSpec } from "../../src/domain/plan.js"
import { Settings } from "../../src/layers/config/Settings.js"
import * as EdgeTransport from "../../src/layers/transport/EdgeTransport.js"
import * as Tls from "../../src/layers/transport/Tls.js"

const token = Redacted.make("tls-test-cluster-token")
const otherToken = Redacted.make("tls-test-another-token")
const runId = 21 as RunId
const edgeId = 1 as EdgeId
const ring: RingSpec = {
  dataCapacity: 1 << 16,
  alignment: 64,
  direction: "Egress",
  hostPinning: "Pageable",
  wakeCoalescing: "PendingBit"
}

/** Both ends of the links `effect` makes in this process run with TLS mode `mode` (the Settings service's). */
const withMode =
  (mode: Tls.TlsMode) =>
  <A, E, R>(effect: Effect.Effect<A, E, R>) =>
    Effect.provide(effect, Settings.layer({ tls: mode }))

/** A TCP proxy to `target` that records every byte it forwards, both ways. */
const recordingProxy = (target: number) =>
  Effect.acquireRelease(
    Effect.async<{ readonly address: TransportAddress; readonly captured: () => Buffer; readonly server: Net.Server }>(
      (resume) => {
        const chunks: Array<Buffer> = []
        const server = Net.createServer((client) => {
          const upstream = Net.createConnection({ host: "127.0.0.1", port: target })
          client.on("data", (chunk: Buffer) => {
            chunks.push(chunk)
            upstream.write(chunk)
          })
          upstream.on("data", (chunk: Buffer) => {
            chunks.push(chunk)
            client.write(chunk)
          })
          client.on("error", () => upstream.destroy())
          upstream.on("error", () => client.destroy())
          client.on("close", () => upstream.destroy())
          upstream.on("close", () => client.destroy())
        })
        server.listen(0, "127.0.0.1", () => {
          const port = (server.address() as Net.AddressInfo).port
          resume(
            Effect.succeed({
              address: { _tag: "Tcp", host: "127.0.0.1", port },
              captured: () => Buffer.concat(chunks),
              server
            })
          )
        })
      }
    ),
    ({ server }) => Effect.sync(() => server.close())
  )

// A distinctive activation payload and token id, easy to find in a capture.
const payload = Float32Array.from({ length: 256 }, (_, i) => 1000 + i * 0.5)
const payloadBytes = Buffer.from(payload.buffer).subarray(0, 64)
const TOKEN_ID = 0x5a5a1234

/** One edge over TCP through the recording proxy: an activation and a token frame, both received whole. */
const capturedRun = Effect.gen(function* () {
  const listener = yield* EdgeTransport.listen({ address: { _tag: "Tcp", host: "127.0.0.1", port: 0 }, token })
  const receiver = yield* listener.register({ runId, edgeId, ring })
  const proxy = yield* recordingProxy(listener.address._tag === "Tcp" ? listener.address.port : 0)
  const sender = yield* EdgeTransport.connect({ address: proxy.address, token, runId, edgeId, ring })
  yield* sender.send(ActivationFrame({ runId, edgeId, step: 0, startPos: 0, nTokens: 1, hiddenDim: 256, payload }))
  yield* sender.send(TokenFrame({ runId, edgeId, step: 1, payload: { _tag: "Decode", tokenId: TOKEN_ID } }))
  const first = yield* receiver.take
  const second = yield* receiver.take
  assert.strictEqual(first._tag, "ActivationFrame")
  if (first._tag === "ActivationFrame") assert.deepStrictEqual(Array.from(first.payload), Array.from(payload))
  assert.deepStrictEqual(second._tag === "TokenFrame" && second.payload, { _tag: "Decode", tokenId: TOKEN_ID })
  return proxy.captured()
}).pipe(Effect.scoped)

const tokenIdBytes = () => {
  const b = Buffer.alloc(4)
  b.writeUInt32LE(TOKEN_ID)
  return b
}
const frameMagic = Buffer.from("SWAF", "ascii")
const authHello = Buffer.from("SWH1", "ascii")

describe("encrypted links", () => {
  // T1: an observer of a TCP link sees no frame, activation or token id in the clear once TLS is on; the same capture
  // without TLS shows all three (so the check can see plaintext).
  it.live(
    "a capture of a TCP edge's bytes holds no plaintext frames, activations or token ids under TLS",
    () =>
      Effect.gen(function* () {
        const plain = yield* capturedRun.pipe(withMode("off"))
        assert.isTrue(plain.includes(frameMagic) && plain.includes(payloadBytes) && plain.includes(tokenIdBytes()))
        assert.isTrue(plain.includes(authHello))

        const encrypted = yield* capturedRun.pipe(withMode("always"))
        assert.isAbove(encrypted.length, payload.byteLength)
        assert.isFalse(encrypted.includes(frameMagic), "frame magic in the clear")
        assert.isFalse(encrypted.includes(payloadBytes), "activation bytes in the clear")
        assert.isFalse(encrypted.includes(tokenIdBytes()), "token id in the clear")
        assert.isFalse(encrypted.includes(authHello), "auth handshake in the clear")
        // A TLS 1.3 handshake record opens the connection.
        assert.strictEqual(encrypted[0], 0x16)
      }),
    30_000
  )

  // T2: a peer with another token cannot finish the TLS handshake; the edge is refused with AuthFailed.
  it.live(
    "a wrong token fails the TLS handshake",
    () =>
      Effect.gen(function* () {
        const listener = yield* EdgeTransport.listen({ address: { _tag: "Tcp", host: "127.0.0.1", port: 0 }, token })
        yield* listener.register({ runId, edgeId, ring })
        const refused = yield* Effect.either(
          EdgeTransport.connect({ address: listener.address, token: otherToken, runId, edgeId, ring })
        )
        assert.isTrue(Either.isLeft(refused))
        if (Either.isLeft(refused)) {
          assert.strictEqual(refused.left._tag, "AuthFailed")
          assert.include(refused.left.message + JSON.stringify(refused.left), "TLS handshake failed")
        }
        // The right token still gets through.
        const accepted = yield* Effect.either(
          EdgeTransport.connect({ address: listener.address, token, runId, edgeId, ring })
        )
        assert.isTrue(Either.isRight(accepted))
      }).pipe(Effect.scoped, withMode("always")),
    30_000
  )

  // T3: in the default mode only links that leave the host are encrypted; Unix sockets never are.
  it("auto mode encrypts non-loopback TCP peers only", () => {
    const socketFrom = (remoteAddress: string | undefined) => ({ remoteAddress }) as Net.Socket
    assert.isFalse(Tls.wantsTls(socketFrom("127.0.0.1"), "auto"))
    assert.isFalse(Tls.wantsTls(socketFrom("::ffff:127.0.0.1"), "auto"))
    assert.isFalse(Tls.wantsTls(socketFrom("::1"), "auto"))
    assert.isFalse(Tls.wantsTls(socketFrom(undefined), "always"))
    assert.isTrue(Tls.wantsTls(socketFrom("10.0.0.2"), "auto"))
    assert.isTrue(Tls.wantsTls(socketFrom("::ffff:192.168.1.4"), "auto"))
    assert.isTrue(Tls.wantsTls(socketFrom("127.0.0.1"), "always"))
    assert.isFalse(Tls.wantsTls(socketFrom("10.0.0.2"), "off"))
    // The PSK is a pure function of the token.
    assert.isTrue(Tls.pskOf(token).equals(Tls.pskOf(Redacted.make("tls-test-cluster-token"))))
    assert.isFalse(Tls.pskOf(token).equals(Tls.pskOf(otherToken)))
  })
})
