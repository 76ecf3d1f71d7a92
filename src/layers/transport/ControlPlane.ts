/**
 * The agent control plane over an authenticated socket: @effect/rpc's socket protocol (ndjson
 * serialization) on a TCP or Unix socket that first passes the mutual HMAC handshake of Auth.ts.
 * Nothing is read as RPC before the handshake succeeds; a connection that fails it is logged
 * (Effect.logWarning) and closed.
 *
 * Server (the node agent):
 *
 * ```ts
 * const handlers = ControlRpcs.toLayer({ Provision: ..., StopRun: ..., Heartbeat: ..., Events: ... })
 * const server = ControlPlane.layer({ token, address }).pipe(Layer.provide(handlers))
 * // ControlPlaneServer (in the layer's output) tells the bound address.
 * ```
 *
 * Client (the orchestrator): `ControlPlane.connect(address, token)` — connects and authenticates
 * eagerly (so a wrong token or a dead address fails `connect` with `AuthFailed` / `ConnectFailed`),
 * then returns the typed RPC client. If the connection drops later, in-flight calls fail with an
 * `RpcClientError` and the client reconnects (re-authenticating) in the background.
 *
 * Like the data plane, the listener binds 127.0.0.1 unless given another address.
 */
import * as Net from "node:net"
import { RpcClient, RpcSerialization, RpcServer } from "@effect/rpc"
import type { Rpc, RpcClientError, RpcGroup } from "@effect/rpc"
import * as NodeSocket from "@effect/platform-node/NodeSocket"
import * as Socket from "@effect/platform/Socket"
import * as SocketServer from "@effect/platform/SocketServer"
import { Context, Duration, Effect, Exit, FiberSet, Layer, Scope } from "effect"
import { ControlRpcs } from "../../domain/controlRpc.js"
import { AuthFailed, ConnectFailed, type TransportAddress } from "../../domain/frames.js"
import { type ClusterToken, clientHandshake, serverHandshake } from "./Auth.js"

export interface ServerOptions {
  readonly token: ClusterToken
  /** Default: TCP 127.0.0.1, an ephemeral port. */
  readonly address?: TransportAddress | undefined
  readonly handshakeTimeout?: Duration.DurationInput | undefined
}

/** The running control-plane server. */
export class ControlPlaneServer extends Context.Tag("swactor/ControlPlaneServer")<ControlPlaneServer, {
  readonly address: TransportAddress
}>() {}

/** The typed client of the control plane. */
export type ControlClient = RpcClient.FromGroup<typeof ControlRpcs, RpcClientError.RpcClientError>

const netOptions = (address: TransportAddress): Net.NetConnectOpts =>
  address._tag === "Tcp" ? { host: address.host, port: address.port } : { path: address.path }

/**
 * A platform `Socket` over an authenticated, paused `net.Socket`: the RPC protocol's `data`
 * listener is attached first, then the socket resumes (so bytes that followed the handshake are
 * not lost).
 */
const authenticatedSocket = (
  open: Effect.Effect<Net.Socket, Socket.SocketError, Scope.Scope>
): Effect.Effect<Socket.Socket> => {
  let current: Net.Socket | undefined
  return NodeSocket.fromDuplex(
    Effect.tap(open, (conn) =>
      Effect.sync(() => {
        current = conn
      }))
  ).pipe(
    Effect.map((socket) => {
      const resumeFirst = (onOpen: Effect.Effect<void> | undefined) =>
        Effect.zipRight(Effect.sync(() => current?.resume()), onOpen ?? Effect.void)
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
  Effect.gen(function*() {
    const requested: TransportAddress = options.address ?? { _tag: "Tcp", host: "127.0.0.1", port: 0 }
    const pending: Array<Net.Socket> = []
    let onConnection: (conn: Net.Socket) => void = (conn) => pending.push(conn)
    const sockets = new Set<Net.Socket>()
    const server = yield* Effect.acquireRelease(
      Effect.async<Net.Server, SocketServer.SocketServerError>((resume) => {
        const server = Net.createServer({ pauseOnConnect: true }, (conn) => {
          sockets.add(conn)
          conn.on("close", () => sockets.delete(conn))
          conn.on("error", () => {})
          if (requested._tag === "Tcp") conn.setNoDelay(true)
          onConnection(conn)
        })
        const onError = (cause: Error) => resume(Effect.fail(new SocketServer.SocketServerError({ reason: "Open", cause })))
        server.once("error", onError)
        server.listen(netOptions(requested), () => {
          server.off("error", onError)
          resume(Effect.succeed(server))
        })
      }),
      (server) =>
        Effect.async<void>((resume) => {
          for (const s of sockets) s.destroy()
          server.close(() => resume(Effect.void))
        })
    )
    const bound = server.address()
    const address: SocketServer.Address = typeof bound === "string"
      ? { _tag: "UnixAddress", path: bound }
      : bound === null
      ? (requested._tag === "Unix"
        ? { _tag: "UnixAddress", path: requested.path }
        : { _tag: "TcpAddress", hostname: requested.host, port: requested.port })
      : { _tag: "TcpAddress", hostname: bound.address, port: bound.port }

    const run = <R, E, _>(handler: (socket: Socket.Socket) => Effect.Effect<_, E, R>) =>
      Effect.gen(function*() {
        const scope = yield* Scope.make()
        const fiberSet = yield* FiberSet.make().pipe(Scope.extend(scope))
        const runFork = yield* FiberSet.runtime(fiberSet)<R>()
        const serve = (conn: Net.Socket) =>
          serverHandshake(conn, { token: options.token, timeout: options.handshakeTimeout }).pipe(
            Effect.matchEffect({
              onFailure: (e) =>
                Effect.logWarning(`control-plane connection refused: ${e.detail}`).pipe(
                  Effect.annotateLogs("module", "ControlPlane"),
                  Effect.zipRight(Effect.sync(() => conn.destroy()))
                ),
              onSuccess: () =>
                authenticatedSocket(
                  Effect.acquireRelease(
                    Effect.succeed(conn),
                    (c) => Effect.sync(() => c.destroySoon())
                  )
                ).pipe(Effect.flatMap(handler))
            }),
            Effect.catchAllCause((cause) => Effect.logDebug("control-plane connection ended", cause))
          )
        onConnection = (conn) => void runFork(serve(conn))
        for (const conn of pending.splice(0)) onConnection(conn)
        return yield* Effect.never.pipe(Effect.ensuring(Scope.close(scope, Exit.void)))
      }) as Effect.Effect<never, SocketServer.SocketServerError, R>

    return SocketServer.SocketServer.of({ address, run })
  })

const toTransportAddress = (address: SocketServer.Address): TransportAddress =>
  address._tag === "UnixAddress"
    ? { _tag: "Unix", path: address.path }
    : { _tag: "Tcp", host: address.hostname, port: address.port }

/**
 * The control-plane server. Needs the handlers (`ControlRpcs.toLayer({...})`); provides
 * `ControlPlaneServer` (the bound address). Closed with the layer's scope.
 */
export const layer = (
  options: ServerOptions
): Layer.Layer<ControlPlaneServer, SocketServer.SocketServerError, Rpc.ToHandler<RpcGroup.Rpcs<typeof ControlRpcs>>> => {
  const socketServer = Layer.scoped(SocketServer.SocketServer, makeSocketServer(options))
  const address = Layer.effect(
    ControlPlaneServer,
    Effect.map(SocketServer.SocketServer, (s) => ({ address: toTransportAddress(s.address) }))
  )
  return RpcServer.layer(ControlRpcs).pipe(
    Layer.provide(RpcServer.layerProtocolSocketServer),
    Layer.provide(RpcSerialization.layerNdjson),
    Layer.merge(address),
    Layer.provide(socketServer)
  )
}

/** Open and authenticate one control connection. */
const openAuthenticated = (
  address: TransportAddress,
  token: ClusterToken,
  timeout: Duration.DurationInput
): Effect.Effect<Net.Socket, AuthFailed | ConnectFailed, Scope.Scope> =>
  Effect.acquireRelease(
    Effect.async<Net.Socket, ConnectFailed>((resume) => {
      const conn = Net.createConnection(netOptions(address))
      const onError = (err: Error) => resume(Effect.fail(new ConnectFailed({ detail: err.message })))
      conn.once("error", onError)
      conn.once("connect", () => {
        conn.off("error", onError)
        conn.on("error", () => {})
        if (address._tag === "Tcp") conn.setNoDelay(true)
        resume(Effect.succeed(conn))
      })
      return Effect.sync(() => conn.destroy())
    }),
    (conn) => Effect.sync(() => conn.destroySoon())
  ).pipe(
    Effect.tap((conn) => clientHandshake(conn, { token, timeout })),
    Effect.timeoutFail({ duration: timeout, onTimeout: () => new ConnectFailed({ detail: "timed out" }) })
  )

export interface ConnectOptions {
  /** Bounds connect + handshake (default 10 s). */
  readonly timeout?: Duration.DurationInput | undefined
}

/**
 * Connect to an agent's control plane. Fails with `ConnectFailed` or `AuthFailed`; the connection
 * closes with the scope.
 */
export const connect = (
  address: TransportAddress,
  token: ClusterToken,
  options: ConnectOptions = {}
): Effect.Effect<ControlClient, AuthFailed | ConnectFailed, Scope.Scope> =>
  Effect.gen(function*() {
    const timeout = options.timeout ?? "10 seconds"
    const scope = yield* Effect.scope
    let first: Net.Socket | undefined = yield* openAuthenticated(address, token, timeout)
    const open = Effect.suspend((): Effect.Effect<Net.Socket, Socket.SocketError, Scope.Scope> => {
      if (first !== undefined) {
        const conn = first
        first = undefined
        return Effect.succeed(conn)
      }
      return openAuthenticated(address, token, timeout).pipe(
        Effect.mapError((cause) => new Socket.SocketGenericError({ reason: "Open", cause }))
      )
    })
    const socket = yield* authenticatedSocket(open)
    const protocol = yield* RpcClient.makeProtocolSocket().pipe(
      Effect.provideService(Socket.Socket, socket),
      Effect.provide(RpcSerialization.layerNdjson),
      Scope.extend(scope)
    )
    return yield* RpcClient.make(ControlRpcs).pipe(Effect.provideService(RpcClient.Protocol, protocol))
  })
