/**
 * Every handshake states the wire version and the number formats (issue 42, mixed x64 + arm64 pipelines;
 * src/domain/wireFormats.ts, Auth.ts): a peer speaking another wire version or another activation format is refused
 * on both sides, after both proved the token, in one line naming both sides' values, as `WireMismatch`; a data-plane
 * edge and a control connection (the orchestrator's) report that line; peers that agree work as before. Real sockets.
 */
import * as Net from "node:net"
import { randomBytes } from "node:crypto"
import { assert, describe, it } from "@effect/vitest"
import { Effect, Either, Exit, Logger, Redacted, Stream } from "effect"
import { AgentHello } from "../../src/domain/controlRpc.js"
import { ActivationFrame, tcpAddress } from "../../src/domain/frames.js"
import type { EdgeId, NodeId, RunId } from "../../src/domain/ids.js"
import type { RingSpec } from "../../src/domain/plan.js"
import { nodeWireFormats, WIRE_VERSION, type WireFormats } from "../../src/domain/wireFormats.js"
import * as AgentControlRpc from "../../src/layers/agent/AgentControlRpc.js"
import * as Auth from "../../src/layers/transport/Auth.js"
import * as EdgeTransport from "../../src/layers/transport/EdgeTransport.js"
import { AgentControl, type StageHost } from "../../src/services/AgentLinks.js"
import type { NodeEndpoint } from "../../src/services/Membership.js"
import { untilAsync } from "../support/until.js"

const TOKEN = "wire-formats-test-token-0123456789"
const token = Redacted.make(TOKEN)
const ours = nodeWireFormats("LE")
const nextWire: WireFormats = { ...ours, wire: WIRE_VERSION + 1 }
const halfActivations: WireFormats = { ...ours, activations: "f16-le" }
const ring: RingSpec = {
  dataCapacity: 64 * 1024,
  alignment: 64,
  direction: "Egress",
  hostPinning: "Pageable",
  wakeCoalescing: "PendingBit"
}
const runId = 5 as RunId
const edgeId = 6 as EdgeId

/** The line a node speaking `mine` gives about a peer at `peer` speaking `theirs`. */
const line = (peer: string, theirs: string, mine: string) =>
  `peer ${peer} ${theirs}; this node speaks ${mine}: refused ` +
  "(every node of a pipeline must speak the same wire version and formats)"

/** A raw TCP server running `serverHandshake` stating `formats` on each connection; records each outcome. */
const handshakeServer = (formats?: WireFormats) =>
  Effect.acquireRelease(
    Effect.async<{ port: number; outcomes: Array<Exit.Exit<unknown, Auth.HandshakeError>>; server: Net.Server }>(
      (resume) => {
        const outcomes: Array<Exit.Exit<unknown, Auth.HandshakeError>> = []
        const server = Net.createServer((socket) => {
          socket.on("error", () => {})
          Effect.runCallback(Auth.serverHandshake(socket, { token, timeout: "2 seconds", formats }), {
            onExit: (exit) => {
              outcomes.push(exit)
              socket.destroy()
            }
          })
        })
        server.listen(0, "127.0.0.1", () =>
          resume(Effect.succeed({ port: (server.address() as Net.AddressInfo).port, outcomes, server }))
        )
      }
    ),
    ({ server }) => Effect.async<void>((resume) => void server.close(() => resume(Effect.void)))
  )

/** A client handshake stating `formats` to 127.0.0.1:`port`; its exit and its own local port. */
const clientHandshake = (port: number, formats?: WireFormats) =>
  Effect.gen(function* () {
    const socket = yield* Effect.async<Net.Socket>((resume) => {
      const s = Net.createConnection({ port, host: "127.0.0.1" })
      s.on("error", () => {})
      s.once("connect", () => resume(Effect.succeed(s)))
    })
    const localPort = socket.localPort
    const exit = yield* Effect.exit(Auth.clientHandshake(socket, { token, timeout: "2 seconds", formats }))
    socket.destroy()
    return { exit, localPort }
  })

const outcome = (outcomes: ReadonlyArray<Exit.Exit<unknown, Auth.HandshakeError>>) =>
  Effect.promise(() =>
    untilAsync(
      "the server's handshake outcome",
      () => outcomes.length,
      (n) => n >= 1
    ).then(() => outcomes[0]!)
  )

/** The `WireMismatch` an exit failed with (fails the test otherwise). */
const mismatchOf = (exit: Exit.Exit<unknown, Auth.HandshakeError>) => {
  assert.isTrue(Exit.isFailure(exit), "the handshake was refused")
  const error = Exit.isFailure(exit) && exit.cause._tag === "Fail" ? exit.cause.error : undefined
  assert.strictEqual(error?._tag, "WireMismatch", `a WireMismatch, got ${String(error)}`)
  return error as Extract<Auth.HandshakeError, { _tag: "WireMismatch" }>
}

const assertOneLine = (text: string) => assert.notInclude(text, "\n")

describe("handshakes state the wire version and number formats", () => {
  // A node of the next wire version meets this one: both sides refuse, each naming both sides' values in one line.
  it.scopedLive("a peer of another wire version is refused on both sides in one line", () =>
    Effect.gen(function* () {
      const { outcomes, port } = yield* handshakeServer()
      const { exit, localPort } = yield* clientHandshake(port, nextWire)
      const client = mismatchOf(exit)
      assert.strictEqual(
        client.message,
        line(
          `127.0.0.1:${port}`,
          `speaks wire ${WIRE_VERSION} with activations f32-le, token ids u32-le`,
          `wire ${WIRE_VERSION + 1} with activations f32-le, token ids u32-le`
        )
      )
      assertOneLine(client.message)
      const server = mismatchOf(yield* outcome(outcomes))
      assert.strictEqual(
        server.message,
        line(
          `127.0.0.1:${localPort}`,
          `speaks wire ${WIRE_VERSION + 1} with activations f32-le, token ids u32-le`,
          `wire ${WIRE_VERSION} with activations f32-le, token ids u32-le`
        )
      )
    })
  )

  // Same wire version, half-precision activations (another build, another host): refused, never misread.
  it.scopedLive("a peer of another activation format is refused on both sides", () =>
    Effect.gen(function* () {
      const { outcomes, port } = yield* handshakeServer(halfActivations)
      const { exit } = yield* clientHandshake(port)
      const client = mismatchOf(exit)
      assert.deepStrictEqual(client.theirs, halfActivations)
      assert.deepStrictEqual(client.ours, ours)
      assert.include(client.message, `speaks wire ${WIRE_VERSION} with activations f16-le, token ids u32-le;`)
      assert.include(client.message, `this node speaks wire ${WIRE_VERSION} with activations f32-le, token ids u32-le`)
      assertOneLine(client.message)
      const server = mismatchOf(yield* outcome(outcomes))
      assert.deepStrictEqual(server.theirs, ours)
      assert.deepStrictEqual(server.ours, halfActivations)
    })
  )

  // A big-endian peer states f32-be: refused, the byte order named.
  it.scopedLive("a big-endian peer's activations are refused, the byte order named", () =>
    Effect.gen(function* () {
      const { port } = yield* handshakeServer()
      const { exit } = yield* clientHandshake(port, nodeWireFormats("BE"))
      assert.include(mismatchOf(exit).message, "speaks wire 2 with activations f32-le")
      assert.include(mismatchOf(exit).message, "this node speaks wire 2 with activations f32-be")
    })
  )

  // Peers that agree (stated explicitly, or by default) authenticate as before.
  it.scopedLive("peers of the same wire version and formats are accepted", () =>
    Effect.gen(function* () {
      const { outcomes, port } = yield* handshakeServer(halfActivations)
      assert.isTrue(Exit.isSuccess((yield* clientHandshake(port, halfActivations)).exit))
      assert.isTrue(Exit.isSuccess(yield* outcome(outcomes)))
      const defaults = yield* handshakeServer()
      assert.isTrue(Exit.isSuccess((yield* clientHandshake(defaults.port)).exit))
    })
  )

  // A node of wire 1 sent zeros where the formats now go: this node's server refuses it with verdict 2, naming it.
  it.scopedLive("a client of wire 1 (stating nothing) is refused with verdict 2", () =>
    Effect.gen(function* () {
      const { outcomes, port } = yield* handshakeServer()
      const verdict = yield* Effect.promise(() => wireOneClient(port))
      assert.strictEqual(verdict, 2)
      const server = mismatchOf(yield* outcome(outcomes))
      assert.isUndefined(server.theirs)
      assert.match(server.message, /^peer 127\.0\.0\.1:\d+ states no wire version or formats \(a swactor of wire 1\);/)
    })
  )

  // A server of wire 1 accepts whatever a client states (verdict 1): this node's client refuses it itself.
  it.scopedLive("a server of wire 1 (stating nothing, accepting) is refused by the client", () =>
    Effect.gen(function* () {
      const server = yield* Effect.acquireRelease(
        Effect.async<Net.Server>((resume) => {
          const s = Net.createServer(wireOneServer)
          s.listen(0, "127.0.0.1", () => resume(Effect.succeed(s)))
        }),
        (s) => Effect.async<void>((resume) => void s.close(() => resume(Effect.void)))
      )
      const port = (server.address() as Net.AddressInfo).port
      const client = mismatchOf((yield* clientHandshake(port)).exit)
      assert.strictEqual(
        client.message,
        line(
          `127.0.0.1:${port}`,
          "states no wire version or formats (a swactor of wire 1)",
          `wire ${WIRE_VERSION} with activations f32-le, token ids u32-le`
        )
      )
    })
  )
})

/** The client side of the wire-1 handshake (zeros where the formats go, a valid proof); resolves with the verdict. */
const wireOneClient = (port: number) =>
  new Promise<number>((resolve, reject) => {
    const socket = Net.createConnection({ host: "127.0.0.1", port })
    const clientNonce = randomBytes(Auth.NONCE_BYTES)
    let received = Buffer.alloc(0)
    let proved = false
    socket.on("connect", () =>
      socket.write(Buffer.concat([Buffer.from("SWH1"), Buffer.from([1, 0, 0, 0]), clientNonce]))
    )
    socket.on("data", (chunk: Buffer) => {
      received = Buffer.concat([received, chunk])
      if (!proved && received.length >= Auth.CHALLENGE_BYTES) {
        proved = true
        const serverNonce = received.subarray(8, 8 + Auth.NONCE_BYTES)
        const proof = Auth.proof(token, "client", clientNonce, serverNonce)
        socket.write(Buffer.concat([Buffer.from("SWH3"), Buffer.alloc(4), proof]))
      }
      if (received.length >= Auth.CHALLENGE_BYTES + Auth.VERDICT_BYTES) {
        resolve(received[Auth.CHALLENGE_BYTES + 4]!)
        socket.destroy()
      }
    })
    socket.on("error", () => {})
    socket.on("close", () => reject(new Error("closed before the verdict")))
  })

/** The server side of the wire-1 handshake: zeros where the formats go, a valid proof, verdict 1 for a valid proof. */
const wireOneServer = (socket: Net.Socket) => {
  socket.on("error", () => {})
  let received = Buffer.alloc(0)
  let clientNonce = Buffer.alloc(0)
  let serverNonce = Buffer.alloc(0)
  socket.on("data", (chunk: Buffer) => {
    received = Buffer.concat([received, chunk])
    if (clientNonce.length === 0 && received.length >= Auth.HELLO_BYTES) {
      clientNonce = Buffer.from(received.subarray(8, 8 + Auth.NONCE_BYTES))
      serverNonce = randomBytes(Auth.NONCE_BYTES)
      const proof = Auth.proof(token, "server", clientNonce, serverNonce)
      socket.write(Buffer.concat([Buffer.from("SWH2"), Buffer.alloc(4), serverNonce, proof]))
    }
    if (received.length >= Auth.HELLO_BYTES + Auth.PROOF_BYTES) {
      const claimed = received.subarray(Auth.HELLO_BYTES + 8, Auth.HELLO_BYTES + Auth.PROOF_BYTES)
      const ok = claimed.equals(Auth.proof(token, "client", clientNonce, serverNonce))
      socket.write(Buffer.concat([Buffer.from("SWH4"), Buffer.from([ok ? 1 : 0, 0, 0, 0])]))
      socket.removeAllListeners("data")
    }
  })
}

describe("a data-plane edge and a control connection report the refusal", () => {
  // The receiver's node speaks the next wire version: the sender's connect fails with the line, the listener logs it.
  it.scopedLive("an edge to a listener of another wire version fails with the one line; the listener warns once", () =>
    Effect.gen(function* () {
      const logged: Array<string> = []
      const capture = Logger.replace(
        Logger.defaultLogger,
        Logger.make(({ logLevel, message }) => logged.push(`${logLevel.label} ${String(message)}`))
      )
      const listener = yield* EdgeTransport.listen({ token, formats: nextWire }).pipe(Effect.provide(capture))
      yield* listener.register({ runId, edgeId, ring })
      const address = listener.address
      assert.strictEqual(address._tag, "Tcp")
      const port = address._tag === "Tcp" ? address.port : 0
      const sent = yield* Effect.either(EdgeTransport.connect({ address, token, runId, edgeId, ring }))
      assert.isTrue(Either.isLeft(sent))
      const fault = Either.isLeft(sent) ? sent.left : undefined
      assert.strictEqual(fault?._tag, "WireMismatch")
      assert.strictEqual(
        fault?.message,
        line(
          `127.0.0.1:${port}`,
          `speaks wire ${WIRE_VERSION + 1} with activations f32-le, token ids u32-le`,
          `wire ${WIRE_VERSION} with activations f32-le, token ids u32-le`
        )
      )
      yield* Effect.promise(() =>
        untilAsync(
          "the listener's warning",
          () => logged.filter((l) => l.startsWith("WARN") && l.includes("refused: peer 127.0.0.1:")),
          (lines) => lines.length >= 1
        )
      )
      const warnings = logged.filter((l) => l.startsWith("WARN"))
      assert.strictEqual(warnings.length, 1)
      assert.match(
        warnings[0]!,
        new RegExp(
          `^WARN data-plane connection from 127\\.0\\.0\\.1 refused: peer 127\\.0\\.0\\.1:\\d+ speaks wire ` +
            `${WIRE_VERSION} with activations f32-le, token ids u32-le; this node speaks wire ${WIRE_VERSION + 1} `
        )
      )
    })
  )

  // Matching formats: the same edge carries an activation as before.
  it.scopedLive("an edge whose two ends state the same formats carries activations", () =>
    Effect.gen(function* () {
      const listener = yield* EdgeTransport.listen({ token, formats: halfActivations })
      const receiver = yield* listener.register({ runId, edgeId, ring })
      const sender = yield* EdgeTransport.connect({
        address: listener.address,
        token,
        runId,
        edgeId,
        ring,
        formats: halfActivations
      })
      const payload = Float32Array.from([1.5, -2.25, 3, 0.125])
      yield* sender.send(ActivationFrame({ runId, edgeId, step: 0, startPos: 0, nTokens: 1, hiddenDim: 4, payload }))
      const got = yield* receiver.take
      assert.strictEqual(got._tag, "ActivationFrame")
      assert.deepStrictEqual(Array.from(got._tag === "ActivationFrame" ? got.payload : []), Array.from(payload))
    })
  )

  // The orchestrator reaching an agent of another activation format: AgentUnavailable says the one line, nothing else.
  it.scopedLive("the orchestrator's connect to an agent of another format fails with the one line", () =>
    Effect.gen(function* () {
      const bound = yield* AgentControlRpc.serveControlRpc({
        address: tcpAddress(0),
        token: TOKEN,
        host: idleHost,
        hello: new AgentHello({ dataAddress: tcpAddress(1), pid: 1 }),
        formats: halfActivations
      })
      assert.strictEqual(bound._tag, "Tcp")
      const address = AgentControlRpc.formatAddress(bound)
      const control = yield* AgentControl.pipe(Effect.provide(AgentControlRpc.layer))
      const node = { nodeId: 1 as NodeId, address } as NodeEndpoint
      const result = yield* Effect.either(control.connect(node, TOKEN))
      assert.isTrue(Either.isLeft(result))
      const unavailable = Either.isLeft(result) ? result.left : undefined
      assert.strictEqual(
        unavailable?.message,
        line(
          address,
          `speaks wire ${WIRE_VERSION} with activations f16-le, token ids u32-le`,
          `wire ${WIRE_VERSION} with activations f32-le, token ids u32-le`
        )
      )
    })
  )
})

/** A stage host that hosts nothing (the control connection above never gets as far as asking it). */
const idleHost: StageHost = {
  provision: () => Stream.empty,
  stop: () => Effect.void,
  capacity: Effect.die("not asked"),
  cachedRanges: Effect.succeed([])
}
