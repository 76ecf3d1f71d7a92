import * as Net from "node:net"
import { assert, describe, it } from "@effect/vitest"
import { Effect, Either, Exit, Redacted } from "effect"
import { ActivationFrame, AttachFrame, tcpAddress } from "../../src/domain/frames.js"
import type { EdgeId, RunId } from "../../src/domain/ids.js"
import type { RingSpec } from "../../src/domain/plan.js"
import * as Auth from "../../src/layers/transport/Auth.js"
import * as EdgeTransport from "../../src/layers/transport/EdgeTransport.js"
import * as Framing from "../../src/layers/transport/Framing.js"
import { untilAsync } from "../support/until.js"

const TOKEN_TEXT = "correct-horse-battery-staple-0123456789"
const token = Redacted.make(TOKEN_TEXT)
const wrongToken = Redacted.make("not-the-cluster-token")
const runId = 1 as RunId
const edgeId = 2 as EdgeId
const ring: RingSpec = {
  dataCapacity: 64 * 1024,
  alignment: 64,
  direction: "Egress",
  hostPinning: "Pageable",
  wakeCoalescing: "PendingBit"
}

/** A raw TCP server running `serverHandshake` on each connection; records each outcome. */
const handshakeServer = Effect.acquireRelease(
  Effect.async<{ port: number; outcomes: Array<Exit.Exit<void, unknown>>; server: Net.Server }>((resume) => {
    const outcomes: Array<Exit.Exit<void, unknown>> = []
    const server = Net.createServer((socket) => {
      socket.on("error", () => {})
      Effect.runCallback(Effect.asVoid(Auth.serverHandshake(socket, { token, timeout: "500 millis" })), {
        onExit: (exit) => {
          outcomes.push(exit)
          socket.destroy()
        }
      })
    })
    server.listen(0, "127.0.0.1", () => {
      const address = server.address() as Net.AddressInfo
      resume(Effect.succeed({ port: address.port, outcomes, server }))
    })
  }),
  ({ server }) => Effect.async<void>((resume) => void server.close(() => resume(Effect.void)))
)

/** A raw client socket with a byte log and an "everything received until close" promise. */
const rawClient = (port: number) =>
  Effect.async<{ socket: Net.Socket; received: () => Buffer; closed: Promise<void> }>((resume) => {
    const chunks: Array<Buffer> = []
    const socket = Net.createConnection({ port, host: "127.0.0.1" })
    socket.on("error", () => {})
    socket.on("data", (c) => chunks.push(c))
    const closed = new Promise<void>((r) => socket.on("close", () => r()))
    socket.once("connect", () => resume(Effect.succeed({ socket, received: () => Buffer.concat(chunks), closed })))
  })

const waitBytes = (received: () => Buffer, n: number) =>
  Effect.promise(() => untilAsync(`${n} bytes from the listener`, received, (bytes) => bytes.length >= n))

const lastOutcome = (outcomes: ReadonlyArray<Exit.Exit<void, unknown>>, count: number) =>
  Effect.promise(() =>
    untilAsync(
      `${count} handshake outcomes`,
      () => outcomes.length,
      (n) => n >= count
    ).then(() => outcomes[count - 1])
  )

/** A TCP proxy that records the bytes flowing each way. */
const capturingProxy = (targetPort: number) =>
  Effect.acquireRelease(
    Effect.async<{ port: number; clientToServer: Array<Buffer>; serverToClient: Array<Buffer>; server: Net.Server }>(
      (resume) => {
        const clientToServer: Array<Buffer> = []
        const serverToClient: Array<Buffer> = []
        const server = Net.createServer((inbound) => {
          const outbound = Net.createConnection({ port: targetPort, host: "127.0.0.1" })
          inbound.on("error", () => {})
          outbound.on("error", () => {})
          inbound.on("data", (c) => {
            clientToServer.push(c)
            outbound.write(c)
          })
          outbound.on("data", (c) => {
            serverToClient.push(c)
            inbound.write(c)
          })
          inbound.on("close", () => outbound.destroy())
          outbound.on("close", () => inbound.destroy())
        })
        server.listen(0, "127.0.0.1", () =>
          resume(
            Effect.succeed({
              port: (server.address() as Net.AddressInfo).port,
              clientToServer,
              serverToClient,
              server
            })
          )
        )
      }
    ),
    ({ server }) => Effect.async<void>((resume) => void server.close(() => resume(Effect.void)))
  )

const connectClient = (port: number, tok: Redacted.Redacted<string>) =>
  Effect.gen(function* () {
    const { socket } = yield* rawClient(port)
    const exit = yield* Effect.exit(Auth.clientHandshake(socket, { token: tok, timeout: "1 second" }))
    socket.destroy()
    return exit
  })

describe("Auth handshake", () => {
  // Both sides holding the cluster token authenticate each other.
  it.scopedLive("accepts a client with the right token", () =>
    Effect.gen(function* () {
      const { outcomes, port } = yield* handshakeServer
      const exit = yield* connectClient(port, token)
      assert.isTrue(Exit.isSuccess(exit))
      assert.isTrue(Exit.isSuccess((yield* lastOutcome(outcomes, 1))!))
    })
  )

  // A client holding another token is refused (it cannot even verify the server, and the server never accepts it).
  it.scopedLive("refuses a client with a wrong token", () =>
    Effect.gen(function* () {
      const { outcomes, port } = yield* handshakeServer
      const exit = yield* connectClient(port, wrongToken)
      assert.isTrue(Exit.isFailure(exit))
      assert.isTrue(Exit.isFailure((yield* lastOutcome(outcomes, 1))!))
    })
  )

  // A client that ignores the server's proof and sends a proof made with a wrong token gets verdict 0.
  it.scopedLive("refuses a forged client proof with verdict 0", () =>
    Effect.gen(function* () {
      const { outcomes, port } = yield* handshakeServer
      const { closed, received, socket } = yield* rawClient(port)
      const clientNonce = Buffer.alloc(32, 7)
      socket.write(Buffer.concat([Buffer.from("SWH1"), Buffer.from([1, 0, 0, 0]), clientNonce]))
      const challenge = yield* waitBytes(received, Auth.CHALLENGE_BYTES)
      const serverNonce = challenge.subarray(8, 40)
      const forged = Auth.proof(wrongToken, "client", clientNonce, serverNonce)
      socket.write(Buffer.concat([Buffer.from("SWH3"), Buffer.alloc(4), forged]))
      yield* Effect.promise(() => closed)
      const all = received()
      assert.strictEqual(all.length, Auth.CHALLENGE_BYTES + Auth.VERDICT_BYTES)
      assert.strictEqual(all[Auth.CHALLENGE_BYTES + 4], 0)
      assert.isTrue(Exit.isFailure((yield* lastOutcome(outcomes, 1))!))
    })
  )

  // A connection without the token — silent, or sending frames straight away — is refused.
  it.scopedLive("refuses a connection that does not handshake", () =>
    Effect.gen(function* () {
      const { outcomes, port } = yield* handshakeServer
      const silent = yield* rawClient(port)
      yield* Effect.promise(() => silent.closed)
      assert.isTrue(Exit.isFailure((yield* lastOutcome(outcomes, 1))!))
      const eager = yield* rawClient(port)
      eager.socket.write(
        Framing.unsafeEncode(
          AttachFrame({ runId, edgeId, dataCapacity: 1, alignment: 8, wakeCoalescing: "PendingBit" }),
          8
        )
      )
      yield* Effect.promise(() => eager.closed)
      assert.isTrue(Exit.isFailure((yield* lastOutcome(outcomes, 2))!))
    })
  )

  // A recorded, once-valid handshake replayed against the server fails: its nonce is fresh.
  it.scopedLive("refuses a replayed client handshake", () =>
    Effect.gen(function* () {
      const { outcomes, port } = yield* handshakeServer
      const proxy = yield* capturingProxy(port)
      assert.isTrue(Exit.isSuccess(yield* connectClient(proxy.port, token)))
      const sent = Buffer.concat(proxy.clientToServer)
      assert.strictEqual(sent.length, Auth.HELLO_BYTES + Auth.PROOF_BYTES)
      const replay = yield* rawClient(port)
      replay.socket.write(sent.subarray(0, Auth.HELLO_BYTES))
      yield* waitBytes(replay.received, Auth.CHALLENGE_BYTES)
      replay.socket.write(sent.subarray(Auth.HELLO_BYTES))
      yield* Effect.promise(() => replay.closed)
      const reply = replay.received()
      assert.strictEqual(reply[Auth.CHALLENGE_BYTES + 4], 0)
      assert.isTrue(Exit.isSuccess((yield* lastOutcome(outcomes, 1))!))
      assert.isTrue(Exit.isFailure((yield* lastOutcome(outcomes, 2))!))
    })
  )

  // A recorded server challenge replayed to a new client fails: the client's nonce is fresh.
  it.scopedLive("a client refuses a replayed server challenge", () =>
    Effect.gen(function* () {
      const { port } = yield* handshakeServer
      const proxy = yield* capturingProxy(port)
      assert.isTrue(Exit.isSuccess(yield* connectClient(proxy.port, token)))
      const recorded = Buffer.concat(proxy.serverToClient)
      const fake = yield* Effect.acquireRelease(
        Effect.async<Net.Server>((resume) => {
          const server = Net.createServer((s) => {
            s.on("error", () => {})
            s.once("data", () => s.write(recorded))
          })
          server.listen(0, "127.0.0.1", () => resume(Effect.succeed(server)))
        }),
        (server) => Effect.async<void>((resume) => void server.close(() => resume(Effect.void)))
      )
      const exit = yield* connectClient((fake.address() as Net.AddressInfo).port, token)
      assert.isTrue(Exit.isFailure(exit))
    })
  )

  // The token itself never crosses the wire, in either direction.
  it.scopedLive("never sends the token", () =>
    Effect.gen(function* () {
      const { port } = yield* handshakeServer
      const proxy = yield* capturingProxy(port)
      assert.isTrue(Exit.isSuccess(yield* connectClient(proxy.port, token)))
      const wire = Buffer.concat([...proxy.clientToServer, ...proxy.serverToClient])
      assert.isAbove(wire.length, 0)
      for (const needle of [
        TOKEN_TEXT,
        Buffer.from(TOKEN_TEXT).toString("hex"),
        Buffer.from(TOKEN_TEXT).toString("base64")
      ]) {
        assert.strictEqual(wire.indexOf(needle), -1)
      }
    })
  )
})

describe("Data-plane listener security", () => {
  const listen = EdgeTransport.listen({ address: tcpAddress(0), token, handshakeTimeout: "500 millis" })

  // The listener binds loopback unless told otherwise.
  it.scopedLive("binds 127.0.0.1 by default", () =>
    Effect.gen(function* () {
      const listener = yield* EdgeTransport.listen({ token })
      assert.deepStrictEqual(listener.address._tag === "Tcp" && listener.address.host, "127.0.0.1")
    })
  )

  it.scopedLive("refuses an edge sender with a wrong token", () =>
    Effect.gen(function* () {
      const listener = yield* listen
      yield* listener.register({ runId, edgeId, ring })
      const result = yield* Effect.either(
        EdgeTransport.connect({ address: listener.address, token: wrongToken, runId, edgeId, ring })
      )
      assert.isTrue(Either.isLeft(result) && result.left._tag === "AuthFailed")
    })
  )

  // Attaching to a run or edge not registered here is refused with the typed reason.
  it.scopedLive("refuses an attach for an unknown run or edge", () =>
    Effect.gen(function* () {
      const listener = yield* listen
      yield* listener.register({ runId, edgeId, ring })
      const unknownRun = yield* Effect.either(
        EdgeTransport.connect({ address: listener.address, token, runId: 99 as RunId, edgeId, ring })
      )
      assert.isTrue(
        Either.isLeft(unknownRun) && unknownRun.left._tag === "PeerFaulted" && unknownRun.left.reason === "UnknownRun"
      )
      const unknownEdge = yield* Effect.either(
        EdgeTransport.connect({ address: listener.address, token, runId, edgeId: 42 as EdgeId, ring })
      )
      assert.isTrue(
        Either.isLeft(unknownEdge) &&
          unknownEdge.left._tag === "PeerFaulted" &&
          unknownEdge.left.reason === "UnknownEdge"
      )
    })
  )

  // On an attached connection, a frame naming a foreign run or edge is refused, never delivered, and faults the edge.
  it.scopedLive("refuses a frame with a foreign run or edge id", () =>
    Effect.gen(function* () {
      for (const foreign of [
        { runId: 5 as RunId, edgeId, tag: "UnknownRun" },
        { runId, edgeId: 9 as EdgeId, tag: "UnknownEdge" }
      ]) {
        yield* Effect.scoped(
          Effect.gen(function* () {
            const listener = yield* listen
            const receiver = yield* listener.register({ runId, edgeId, ring })
            const { socket } = yield* rawClient((listener.address as { port: number }).port)
            yield* Auth.clientHandshake(socket, { token })
            socket.resume()
            socket.write(
              Framing.unsafeEncode(
                AttachFrame({
                  runId,
                  edgeId,
                  dataCapacity: ring.dataCapacity,
                  alignment: ring.alignment,
                  wakeCoalescing: ring.wakeCoalescing
                }),
                8
              )
            )
            yield* receiver.attached
            const frame = ActivationFrame({
              runId: foreign.runId,
              edgeId: foreign.edgeId,
              step: 0,
              startPos: 0,
              nTokens: 1,
              hiddenDim: 4,
              payload: new Float32Array(4)
            })
            socket.write(Framing.unsafeEncode(frame, ring.alignment))
            const result = yield* Effect.either(receiver.receive)
            assert.isTrue(Either.isLeft(result) && result.left._tag === foreign.tag)
            assert.strictEqual((yield* receiver.stats).messages, 0)
            socket.destroy()
          })
        )
      }
    })
  )
})
