/** Opening the sending end of an edge: connect, authenticate, attach, then hand the connection to its core. */
import * as Net from "node:net"
import { Deferred, Effect, type Scope } from "effect"
import { AttachFrame, ConnectFailed, EdgeClosed, type EdgeFault, Malformed, PeerFaulted } from "../../domain/frames.js"
import { clientHandshake } from "./Auth.js"
import type { ConnectOptions, OutboundEdge } from "./Edge.js"
import { boundLimits, FrameConn, makeLogger, validateRing } from "./FramedSocket.js"
import * as Framing from "./Framing.js"
import { netOptions } from "./Net.js"
import { OutboundCore } from "./OutboundCore.js"
import { sharedMemorySendCarrier, socketSendCarrier } from "./SendCarrier.js"
import { ShmRing } from "./ShmRing.js"

/** The shared-memory ring a same-host sender writes into (unlinked and closed with the scope), when asked for. */
const createSendRing = (options: ConnectOptions): Effect.Effect<ShmRing | undefined, ConnectFailed, Scope.Scope> =>
  Effect.gen(function* () {
    if (options.sharedMemory !== true) return undefined
    if (options.address._tag !== "Unix") {
      return yield* new ConnectFailed({ detail: "shared memory needs a Unix-socket address (same host)" })
    }
    return yield* Effect.acquireRelease(
      Effect.try({
        try: () => ShmRing.create(options.ring.dataCapacity, options.ring.alignment),
        catch: (e) => new ConnectFailed({ detail: `cannot create a shared-memory ring: ${String(e)}` })
      }),
      (ring) =>
        Effect.sync(() => {
          ring.unlink()
          ring.close()
        })
    )
  })

/** The connected socket, ended gracefully (destroyed a second later) when the scope closes. */
const openSocket = (address: ConnectOptions["address"]): Effect.Effect<Net.Socket, ConnectFailed, Scope.Scope> =>
  Effect.acquireRelease(
    Effect.async<Net.Socket, ConnectFailed>((resume) => {
      const socket = Net.createConnection(netOptions(address))
      const onError = (err: Error) => resume(Effect.fail(new ConnectFailed({ detail: err.message })))
      socket.once("error", onError)
      socket.once("connect", () => {
        socket.off("error", onError)
        socket.on("error", () => {})
        if (address._tag === "Tcp") socket.setNoDelay(true)
        resume(Effect.succeed(socket))
      })
      return Effect.sync(() => socket.destroy())
    }),
    (socket) =>
      Effect.sync(() => {
        socket.end()
        setTimeout(() => socket.destroy(), 1000).unref()
      })
  )

/**
 * Sends the Attach frame over the authenticated socket and waits for the receiver's Attached: then the connection's
 * core (its carrier the shared-memory ring or the socket) takes the frames. A Fault frame is the receiver's refusal.
 */
const attach = (
  socket: Net.Socket,
  options: ConnectOptions,
  shm: ShmRing | undefined,
  log: (message: string) => void
): Effect.Effect<OutboundCore, EdgeFault> =>
  Effect.async<OutboundCore, EdgeFault>((resume) => {
    const ids = { runId: options.runId as number, edgeId: options.edgeId as number }
    const conn: FrameConn = new FrameConn(
      socket,
      Framing.preAttachLimits,
      {
        onFrame: (frame) => {
          if (frame._tag === "AttachedFrame" && frame.runId === options.runId && frame.edgeId === options.edgeId) {
            shm?.unlink()
            const carrier =
              shm === undefined
                ? socketSendCarrier(conn, options.ring.alignment)
                : sharedMemorySendCarrier(conn, shm, options)
            const outbound = new OutboundCore(conn, options, carrier)
            conn.limits = boundLimits(options.ring)
            conn.handlers = outbound
            return resume(Effect.succeed(outbound))
          }
          if (frame._tag === "FaultFrame") {
            const fault = new PeerFaulted({ reason: frame.reason, detail: frame.detail })
            conn.end(fault)
            return
          }
          conn.fail(new Malformed({ detail: `expected AttachedFrame, got ${frame._tag}` }))
        },
        onBurstEnd: () => {},
        onClose: (fault) => resume(Effect.fail(fault))
      },
      ids,
      log
    )
    conn.start()
    const { alignment, dataCapacity, wakeCoalescing } = options.ring
    conn.write(
      Framing.unsafeEncode(
        AttachFrame({
          runId: options.runId,
          edgeId: options.edgeId,
          dataCapacity,
          alignment,
          wakeCoalescing,
          sharedMemory: shm?.path ?? ""
        }),
        8
      )
    )
  })

/**
 * Open the sending end of an edge: connect, authenticate (mutual HMAC), attach to the receiver
 * registered for `(runId, edgeId)` at `address`. Fails with `ConnectFailed`, `AuthFailed`, `WireMismatch` (the listener
 * speaks another wire version or other number formats), or the
 * receiver's refusal as `PeerFaulted` (reason `UnknownRun`, `UnknownEdge`, `RingMismatch`,
 * `EdgeBusy`). The stream is ended gracefully when the scope closes.
 */
export const connect = (options: ConnectOptions): Effect.Effect<OutboundEdge, EdgeFault, Scope.Scope> =>
  Effect.gen(function* () {
    const invalid = validateRing(options.ring)
    if (invalid !== undefined) return yield* invalid
    const runtime = yield* Effect.runtime<never>()
    const log = makeLogger(runtime)
    const shm = yield* createSendRing(options)
    const raw = yield* openSocket(options.address)
    const outbound = yield* Effect.gen(function* () {
      // TLS over `raw` across hosts; `raw` itself on loopback and Unix sockets.
      const socket = yield* clientHandshake(raw, {
        token: options.token,
        formats: options.formats,
        peer: options.address._tag === "Tcp" ? `${options.address.host}:${options.address.port}` : options.address.path
      })
      return yield* attach(socket, options, shm, log)
    }).pipe(
      Effect.timeoutFail({
        duration: options.timeout ?? "10 seconds",
        onTimeout: () => new ConnectFailed({ detail: "timed out connecting the edge" })
      }),
      Effect.tapError(() => Effect.sync(() => raw.destroy()))
    )
    const close = Effect.sync(() => outbound.conn.end(new EdgeClosed()))
    yield* Effect.addFinalizer(() => close)
    const sender: OutboundEdge = {
      runId: options.runId,
      edgeId: options.edgeId,
      ring: options.ring,
      send: outbound.send,
      sendAll: outbound.sendAll,
      fault: Deferred.await(outbound.faulted),
      stats: outbound.stats,
      close
    }
    return sender
  })
