/**
 * Node's HTTP server under the HTTP front, with its connection limits (HttpGuard.ts HttpLimits) and counts, and the
 * one-line error when it cannot listen.
 */
import { createServer, type Server as NodeServer } from "node:http"
import type { Socket } from "node:net"
import { Schema } from "effect"
import { declaredTooLarge, type HttpLimits } from "./HttpGuard.js"
import { errorJson } from "./OpenAiErrors.js"

/** The HTTP server could not listen (address in use, not permitted, no such address): one line that says so. */
export class ListenError extends Schema.TaggedError<ListenError>()("ListenError", { message: Schema.String }) {}

export const listenError = (host: string, port: number, cause: unknown) => {
  const code = (cause as NodeJS.ErrnoException | undefined)?.code
  const why =
    code === "EADDRINUSE"
      ? "the address is in use (another server listens there; pick another --port, or 0 for any free one)"
      : code === "EACCES"
        ? "not permitted (ports below 1024 need privileges)"
        : code === "EADDRNOTAVAIL"
          ? "this machine has no such address (--host)"
          : ((cause as Error | undefined)?.message ?? String(cause))
  return new ListenError({
    message: `cannot listen on ${host}:${port}: ${why}${code === undefined ? "" : ` (${code})`}`
  })
}

/** The HTTP front's connection counts, for /metrics. */
export interface ConnectionStats {
  open: number
  /** Connections closed at once: the limit was reached and none was silent. */
  refused: number
  /** Silent connections (no request yet) closed: to make room for a new one, or past the header timeout. */
  dropped: number
}

/** How long a connection closed after its answer keeps reading (and dropping) what the client still sends. */
export const lingerMillis = 3_000

/**
 * Closes a socket the way Node's `destroySoon` does (end, then destroy), but lingering: after the answer is written
 * and the write side ended, whatever the client still sends is read and dropped, outside the HTTP parser, until the
 * client ends its side or `lingerMillis` pass. Closing a socket with unread bytes resets the connection, and a client
 * still sending a body it was refused (413 before the body is read) would then lose the answer to the reset.
 */
const lingeringClose = (socket: Socket) => {
  if (socket.writable) socket.end()
  const timer = setTimeout(() => socket.destroy(), lingerMillis)
  timer.unref()
  socket.once("close", () => clearTimeout(timer))
  socket.once("end", () => socket.destroy())
  socket.removeAllListeners("data")
  socket.on("data", () => undefined)
  socket.resume()
}

/**
 * Node's HTTP server with the connection limits. At most `maxConnections` are open: a new one past the limit takes the
 * place of the oldest connection that has not sent a request for 250 ms (a quarter of the header timeout when
 * shorter), so idle connections cannot lock callers out; it is closed at once when there is none such (a burst that
 * fills every place within 250 ms is refused until then). A connection must send its first request's headers within
 * `headerTimeoutMillis` (Node's own `headersTimeout` covers headers that trickle; a silent connection is closed here);
 * a request must be received whole within the body timeout (Node's `requestTimeout` backs up readBody's own, which
 * answers in OpenAI's shape). `Expect: 100-continue` with a Content-Length over the limit is refused before the body
 * is sent. A connection closed after its answer lingers (`lingeringClose`).
 */
export const makeNodeServer = (limits: HttpLimits, stats: ConnectionStats): NodeServer => {
  const server = createServer({
    headersTimeout: limits.headerTimeoutMillis,
    requestTimeout: limits.bodyTimeoutMillis + 5_000
  })
  server.keepAliveTimeout = 5_000
  const open = new Set<Socket>()
  // Connections that have not sent a request yet, oldest first, with their header timers and when they came.
  const silent = new Map<Socket, { readonly timer: NodeJS.Timeout; readonly at: number }>()
  // A silent connection younger than this may be a caller whose headers are on their way: it is not dropped for room.
  const graceMillis = Math.min(250, limits.headerTimeoutMillis / 4)
  const spoke = (socket: Socket) => {
    const entry = silent.get(socket)
    if (entry === undefined) return
    clearTimeout(entry.timer)
    silent.delete(socket)
  }
  const drop = (socket: Socket) => {
    spoke(socket)
    open.delete(socket)
    stats.open = open.size
    stats.dropped++
    socket.destroy()
  }
  server.on("connection", (socket: Socket) => {
    if (open.size >= limits.maxConnections) {
      const oldest = silent.entries().next()
      if (oldest.done === true || performance.now() - oldest.value[1].at < graceMillis) {
        stats.refused++
        socket.destroy()
        return
      }
      drop(oldest.value[0])
    }
    open.add(socket)
    stats.open = open.size
    // Node's server closes a connection after an answer that says `connection: close` with destroySoon
    socket.destroySoon = () => lingeringClose(socket)
    const timer = setTimeout(() => drop(socket), limits.headerTimeoutMillis)
    timer.unref()
    silent.set(socket, { timer, at: performance.now() })
    socket.once("close", () => {
      spoke(socket)
      open.delete(socket)
      stats.open = open.size
    })
  })
  server.prependListener("request", (request) => spoke(request.socket))
  server.on("checkContinue", (request, response) => {
    spoke(request.socket)
    const refusal = declaredTooLarge(request.headers["content-length"], limits.maxBodyBytes)
    if (refusal === undefined) {
      response.writeContinue()
      server.emit("request", request, response)
      return
    }
    response.writeHead(413, { "content-type": "application/json", connection: "close" })
    response.end(JSON.stringify(errorJson(refusal)))
  })
  return server
}
