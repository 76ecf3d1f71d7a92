/**
 * The control plane's transport: a socket server (TCP or Unix) whose connections must first pass
 * the mutual HMAC handshake of Auth.ts. Nothing is read as RPC before the handshake succeeds; a
 * connection that fails it is logged (Effect.logWarning) and closed. The RPC group it carries is
 * `AgentRpcs` (src/domain/controlRpc.ts); src/layers/agent/AgentControlRpc.ts serves it on
 * `makeSocketServer` (ndjson serialization) and connects to it with `authenticatedSocket`.
 *
 * Like the data plane, the listener binds 127.0.0.1 unless given another address.
 *
 * `divert`: a connection whose first bytes after the handshake are the given magic is handed to another protocol
 * instead (weight delivery's byte stream, src/layers/gguf/SliceStream.ts), so one port and one handshake serve both.
 */
import type * as Net from "node:net"
import * as NodeSocket from "@effect/platform-node/NodeSocket"
import * as Socket from "@effect/platform/Socket"
import * as SocketServer from "@effect/platform/SocketServer"
import { type Duration, Effect, Exit, FiberSet, Scope } from "effect"
import type { TransportAddress } from "../../domain/frames.js"
import type { WireFormats } from "../../domain/wireFormats.js"
import { type ClusterToken, serverHandshake } from "./Auth.js"
import { defaultListenAddress, netOptions, serveSockets } from "./Net.js"
import { makeHandshakeLog, peerAddress } from "./RefusalLog.js"

export interface ServerOptions {
  readonly token: ClusterToken
  /** Default: TCP 127.0.0.1, an ephemeral port. */
  readonly address?: TransportAddress | undefined
  readonly handshakeTimeout?: Duration.DurationInput | undefined
  /** What this node states in its handshakes (default: its own; Auth.ts `HandshakeOptions.formats`). */
  readonly formats?: WireFormats | undefined
  /** Authenticated connections that start with `magic` go to `handle` (it owns the socket) instead of the RPC. */
  readonly divert?:
    | {
        readonly magic: Uint8Array
        readonly handle: (socket: Net.Socket) => Effect.Effect<void>
      }
    | undefined
}

/**
 * The first `n` bytes a paused socket receives (undefined: it closed before), left unread: the socket is paused
 * again with them back in its buffer.
 */
const peek = (socket: Net.Socket, n: number): Effect.Effect<Buffer | undefined> =>
  Effect.async<Buffer | undefined>((resume) => {
    const got: Array<Buffer> = []
    let size = 0
    const detach = () => {
      socket.pause()
      socket.off("data", onData)
      socket.off("close", onClose)
      const all = Buffer.concat(got, size)
      if (all.length > 0 && !socket.destroyed) socket.unshift(all)
      return all
    }
    const onData = (chunk: Buffer) => {
      got.push(chunk)
      size += chunk.length
      if (size >= n) resume(Effect.succeed(detach().subarray(0, n)))
    }
    const onClose = () => {
      detach()
      resume(Effect.succeed(undefined))
    }
    socket.on("data", onData)
    socket.once("close", onClose)
    socket.resume()
    return Effect.sync(detach)
  })

// Shared with the data plane; re-exported for the control link's client.
export { netOptions }

/**
 * A platform `Socket` over authenticated, paused `net.Socket`s (`open` runs again on each
 * reconnect): the RPC protocol's `data` listener is attached first, then the socket resumes (so
 * bytes that followed the handshake are not lost).
 */
export const authenticatedSocket = (
  open: Effect.Effect<Net.Socket, Socket.SocketError, Scope.Scope>
): Effect.Effect<Socket.Socket> => {
  let current: Net.Socket | undefined
  return NodeSocket.fromDuplex(
    Effect.tap(open, (conn) =>
      Effect.sync(() => {
        current = conn
      })
    )
  ).pipe(
    Effect.map((socket) => {
      const resumeFirst = (onOpen: Effect.Effect<void> | undefined) =>
        Effect.zipRight(
          Effect.sync(() => current?.resume()),
          onOpen ?? Effect.void
        )
      return Socket.Socket.of({
        ...socket,
        run: (handler, options) => socket.run(handler, { onOpen: resumeFirst(options?.onOpen) }),
        runRaw: (handler, options) => socket.runRaw(handler, { onOpen: resumeFirst(options?.onOpen) })
      })
    })
  )
}

/** A `SocketServer` whose sockets have passed the HMAC handshake. */
export const makeSocketServer = (
  options: ServerOptions
): Effect.Effect<SocketServer.SocketServer["Type"], SocketServer.SocketServerError, Scope.Scope> =>
  Effect.gen(function* () {
    const requested: TransportAddress = options.address ?? defaultListenAddress
    const pending: Array<Net.Socket> = []
    let onConnection: (conn: Net.Socket) => void = (conn) => pending.push(conn)
    const bound = yield* serveSockets(requested, (conn) => onConnection(conn), {
      onOpenError: (cause) => new SocketServer.SocketServerError({ reason: "Open", cause })
    })
    const address: SocketServer.Address =
      bound._tag === "Unix"
        ? { _tag: "UnixAddress", path: bound.path }
        : { _tag: "TcpAddress", hostname: bound.host, port: bound.port }

    const handshakeLog = makeHandshakeLog("control-plane connection")
    const run = <R, E, _>(handler: (socket: Socket.Socket) => Effect.Effect<_, E, R>) =>
      Effect.gen(function* () {
        const scope = yield* Scope.make()
        const fiberSet = yield* FiberSet.make().pipe(Scope.extend(scope))
        const runFork = yield* FiberSet.runtime(fiberSet)<R>()
        const serve = (conn: Net.Socket) =>
          serverHandshake(conn, {
            token: options.token,
            timeout: options.handshakeTimeout,
            formats: options.formats
          }).pipe(
            Effect.matchEffect({
              onFailure: (e) => {
                // A close before the handshake is a DEBUG line; a failed proof one WARN line naming the peer, at most one
                // per peer per 10 s (RefusalLog.ts): a flood cannot fill the log, nor hide a failed proof behind closes.
                const said = handshakeLog(peerAddress(conn), e)
                return (
                  said === undefined
                    ? Effect.void
                    : said.level === "Warning"
                      ? Effect.logWarning(said.line)
                      : Effect.logDebug(said.line)
                ).pipe(
                  Effect.annotateLogs("module", "ControlPlane"),
                  Effect.zipRight(Effect.sync(() => conn.destroy()))
                )
              },
              onSuccess: (link) => {
                const rpc = authenticatedSocket(
                  Effect.acquireRelease(Effect.succeed(link), (c) => Effect.sync(() => c.destroySoon()))
                ).pipe(Effect.flatMap(handler))
                const divert = options.divert
                if (divert === undefined) return rpc
                return peek(link, divert.magic.length).pipe(
                  Effect.flatMap((first) =>
                    first === undefined
                      ? Effect.sync(() => link.destroy())
                      : first.equals(divert.magic)
                        ? divert.handle(link).pipe(Effect.ensuring(Effect.sync(() => link.destroySoon())))
                        : rpc
                  )
                )
              }
            }),
            Effect.catchAllCause((cause) => Effect.logDebug("control-plane connection ended", cause))
          )
        onConnection = (conn) => void runFork(serve(conn))
        for (const conn of pending.splice(0)) onConnection(conn)
        return yield* Effect.never.pipe(Effect.ensuring(Scope.close(scope, Exit.void)))
      }) as Effect.Effect<never, SocketServer.SocketServerError, R>

    return SocketServer.SocketServer.of({ address, run })
  })
