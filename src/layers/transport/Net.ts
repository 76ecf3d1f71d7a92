/**
 * Socket plumbing shared by the data plane and the control plane: Node `net` options for a transport address,
 * and a server that hands over paused sockets and closes them all with its scope.
 */
import * as Net from "node:net"
import { Effect, type Scope } from "effect"
import type { TransportAddress } from "../../domain/frames.js"

/** Node `net` options for a transport address. */
export const netOptions = (address: TransportAddress): Net.NetConnectOpts =>
  address._tag === "Tcp" ? { host: address.host, port: address.port } : { path: address.path }

/** Where listeners bind unless told otherwise: TCP on 127.0.0.1, an ephemeral port. */
export const defaultListenAddress: TransportAddress = { _tag: "Tcp", host: "127.0.0.1", port: 0 }

/**
 * Listens on `requested` and hands each accepted socket to `onConnection` paused (nothing is read until its owner
 * resumes it, so nothing is read before authentication), with TCP no-delay set and socket errors swallowed (owners
 * watch `close`). Closing the scope destroys every open socket and closes the server. Succeeds with the bound
 * address (the real port when listening on port 0).
 */
export const serveSockets = <E>(
  requested: TransportAddress,
  onConnection: (socket: Net.Socket) => void,
  options: {
    /** The error when the server cannot listen. */
    readonly onOpenError: (error: Error) => E
    /** A server error after it listens. */
    readonly onError?: ((error: Error) => void) | undefined
  }
): Effect.Effect<TransportAddress, E, Scope.Scope> =>
  Effect.gen(function* () {
    const sockets = new Set<Net.Socket>()
    const server = yield* Effect.acquireRelease(
      Effect.async<Net.Server, E>((resume) => {
        const server = Net.createServer({ pauseOnConnect: true }, (socket) => {
          sockets.add(socket)
          socket.on("close", () => sockets.delete(socket))
          socket.on("error", () => {})
          if (requested._tag === "Tcp") socket.setNoDelay(true)
          onConnection(socket)
        })
        const onOpenError = (err: Error) => resume(Effect.fail(options.onOpenError(err)))
        server.once("error", onOpenError)
        server.listen(netOptions(requested), () => {
          server.off("error", onOpenError)
          server.on("error", (err) => options.onError?.(err))
          resume(Effect.succeed(server))
        })
      }),
      (server) =>
        Effect.async<void>((resume) => {
          for (const socket of sockets) socket.destroy()
          server.close(() => resume(Effect.void))
        })
    )
    const bound = server.address()
    return typeof bound === "string"
      ? { _tag: "Unix", path: bound }
      : bound === null
        ? requested
        : { _tag: "Tcp", host: bound.address, port: bound.port }
  })
