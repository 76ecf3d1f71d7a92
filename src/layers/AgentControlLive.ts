/**
 * The orchestrator ↔ agent control link over an authenticated socket: the transport's mutual HMAC
 * handshake (src/layers/transport/Auth.ts), then newline-delimited JSON messages, each encoded and
 * decoded with a Schema. Requests carry an id; replies and stage reports name it.
 *
 * - Hello / Capacity / Stop: one reply each.
 * - Provision: a stream of StageReports ending with End (after StageStopped). Cancel (or a closed
 *   connection) stops the stage: an agent never keeps hosting stages for an orchestrator it lost.
 * - A closed connection fails everything in flight with AgentUnavailable at once, so a crashed
 *   agent is seen as a fault immediately, never as a hang.
 */
import * as Net from "node:net"
import { Cause, Deferred, Effect, Exit, Fiber, Layer, Redacted, Runtime, Schema, type Scope, Stream } from "effect"
import { type TransportAddress, TransportAddress as TransportAddressSchema } from "../domain/frames.js"
import { RunId } from "../domain/ids.js"
import {
  AgentControl,
  AgentHello,
  type AgentLink,
  AgentUnavailable,
  ProvisionRequest,
  StageReport
} from "../services/AgentLinks.js"
import { NodeCapacity, type NodeEndpoint } from "../services/Membership.js"
import type { StageHost } from "./NodeAgent.js"
import { clientHandshake, serverHandshake } from "./transport/Auth.js"

const Request = Schema.Union(
  Schema.TaggedStruct("Hello", { id: Schema.Number }),
  Schema.TaggedStruct("Capacity", { id: Schema.Number }),
  Schema.TaggedStruct("Provision", { id: Schema.Number, request: ProvisionRequest }),
  Schema.TaggedStruct("Stop", { id: Schema.Number, runId: RunId, stageIndex: Schema.Number }),
  Schema.TaggedStruct("Cancel", { id: Schema.Number })
)
type Request = typeof Request.Type

const Response = Schema.Union(
  Schema.TaggedStruct("Hello", { id: Schema.Number, hello: AgentHello }),
  Schema.TaggedStruct("Capacity", { id: Schema.Number, capacity: NodeCapacity }),
  Schema.TaggedStruct("Stopped", { id: Schema.Number }),
  Schema.TaggedStruct("Report", { id: Schema.Number, report: StageReport }),
  Schema.TaggedStruct("End", { id: Schema.Number }),
  Schema.TaggedStruct("Error", { id: Schema.Number, message: Schema.String })
)
type Response = typeof Response.Type

const RequestJson = Schema.parseJson(Request)
const ResponseJson = Schema.parseJson(Response)
const encodeRequest = Schema.encodeSync(RequestJson)
const decodeRequest = Schema.decodeUnknownEither(RequestJson)
const encodeResponse = Schema.encodeSync(ResponseJson)
const decodeResponse = Schema.decodeUnknownEither(ResponseJson)

const netOptions = (address: TransportAddress): Net.NetConnectOpts =>
  address._tag === "Tcp" ? { host: address.host, port: address.port } : { path: address.path }

/** Calls `onLine` for every complete line that arrives on the socket. */
const readLines = (socket: Net.Socket, onLine: (line: string) => void) => {
  let buffered = ""
  socket.setEncoding("utf8")
  socket.on("data", (chunk: string) => {
    buffered += chunk
    let newline = buffered.indexOf("\n")
    while (newline >= 0) {
      const line = buffered.slice(0, newline)
      buffered = buffered.slice(newline + 1)
      if (line.length > 0) onLine(line)
      newline = buffered.indexOf("\n")
    }
  })
  socket.resume()
}

/** Parses `host:port` (IPv6 in brackets) into a TCP address. */
export const parseAddress = (text: string): TransportAddress | undefined => {
  const match = /^\[?([^\]]*?)\]?:(\d+)$/.exec(text.trim())
  if (match === null) return undefined
  const port = Number(match[2])
  if (!Number.isInteger(port) || port < 0 || port > 65535) return undefined
  return Schema.decodeUnknownSync(TransportAddressSchema)({ _tag: "Tcp", host: match[1] === "" ? "127.0.0.1" : match[1], port })
}

export const formatAddress = (address: TransportAddress): string =>
  address._tag === "Tcp" ? (address.host.includes(":") ? `[${address.host}]:${address.port}` : `${address.host}:${address.port}`) : address.path

// ---------------------------------------------------------------------------------------------
// Agent side
// ---------------------------------------------------------------------------------------------

export interface ControlServerOptions {
  readonly address: TransportAddress
  readonly token: string
  readonly host: StageHost
  /** What to say in answer to Hello, given the local address the orchestrator reached us on. */
  readonly hello: (localAddress: string | undefined) => AgentHello
}

/** Serves the control link for a stage host until the scope closes; returns the bound address. */
export const serveControl = (options: ControlServerOptions): Effect.Effect<TransportAddress, AgentUnavailable, Scope.Scope> =>
  Effect.gen(function*() {
    const runtime = yield* Effect.runtime<never>()
    const runFork = Runtime.runFork(runtime)
    const token = Redacted.make(options.token)
    const sockets = new Set<Net.Socket>()

    const handle = (socket: Net.Socket) => {
      sockets.add(socket)
      socket.on("error", () => {})
      const inFlight = new Map<number, Fiber.RuntimeFiber<unknown, unknown>>()
      const send = (response: Response) => {
        if (!socket.destroyed) socket.write(encodeResponse(response) + "\n")
      }
      socket.on("close", () => {
        sockets.delete(socket)
        // The orchestrator is gone: stop whatever it asked us to host.
        for (const fiber of inFlight.values()) runFork(Fiber.interrupt(fiber))
        inFlight.clear()
      })
      const serve = (request: Request): Effect.Effect<void> => {
        switch (request._tag) {
          case "Hello":
            return Effect.sync(() => send({ _tag: "Hello", id: request.id, hello: options.hello(socket.localAddress) }))
          case "Capacity":
            return Effect.map(options.host.capacity, (capacity) => send({ _tag: "Capacity", id: request.id, capacity }))
          case "Stop":
            return Effect.zipRight(
              options.host.stop(request.runId, request.stageIndex),
              Effect.sync(() => send({ _tag: "Stopped", id: request.id }))
            )
          case "Provision":
            return options.host.provision(request.request).pipe(
              Stream.runForEach((report) => Effect.sync(() => send({ _tag: "Report", id: request.id, report }))),
              Effect.zipRight(Effect.sync(() => send({ _tag: "End", id: request.id })))
            )
          case "Cancel":
            return Effect.suspend(() => {
              const fiber = inFlight.get(request.id)
              return fiber === undefined ? Effect.void : Fiber.interrupt(fiber)
            })
        }
      }
      const authenticated = runFork(serverHandshake(socket, { token }))
      authenticated.addObserver((exit) => {
        if (Exit.isFailure(exit)) return socket.destroy()
        readLines(socket, (line) => {
          const decoded = decodeRequest(line)
          if (decoded._tag === "Left") {
            send({ _tag: "Error", id: -1, message: `bad request: ${decoded.left.message}` })
            return socket.destroy()
          }
          const request = decoded.right
          const fiber = runFork(
            serve(request).pipe(
              Effect.catchAllCause((cause) =>
                Cause.isInterruptedOnly(cause)
                  ? Effect.void
                  : Effect.sync(() => send({ _tag: "Error", id: request.id, message: Cause.pretty(cause) }))
              ),
              Effect.ensuring(Effect.sync(() => inFlight.delete(request.id)))
            )
          )
          if (request._tag === "Provision") inFlight.set(request.id, fiber)
        })
      })
    }

    const server = yield* Effect.acquireRelease(
      Effect.async<Net.Server, AgentUnavailable>((resume) => {
        const server = Net.createServer({ pauseOnConnect: true }, handle)
        const onError = (error: Error) =>
          resume(Effect.fail(new AgentUnavailable({ address: formatAddress(options.address), message: error.message })))
        server.once("error", onError)
        server.listen(netOptions(options.address), () => {
          server.off("error", onError)
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
    if (options.address._tag === "Unix" || bound === null || typeof bound === "string") return options.address
    return { _tag: "Tcp", host: options.address.host, port: bound.port } satisfies TransportAddress
  })

// ---------------------------------------------------------------------------------------------
// Orchestrator side
// ---------------------------------------------------------------------------------------------

interface Pending {
  readonly onResponse: (response: Response) => void
  readonly onClose: (error: AgentUnavailable) => void
}

const connect = (node: NodeEndpoint, token: string): Effect.Effect<AgentLink, AgentUnavailable, Scope.Scope> =>
  Effect.gen(function*() {
    const address = parseAddress(node.address)
    const unavailable = (message: string) => new AgentUnavailable({ address: node.address, message })
    if (address === undefined) return yield* Effect.fail(unavailable(`not a host:port address: ${node.address}`))
    const socket = yield* Effect.acquireRelease(
      Effect.async<Net.Socket, AgentUnavailable>((resume) => {
        const socket = Net.createConnection(netOptions(address))
        const onError = (error: Error) => resume(Effect.fail(unavailable(`cannot connect: ${error.message}`)))
        socket.once("error", onError)
        socket.once("connect", () => {
          socket.off("error", onError)
          socket.setNoDelay(true)
          socket.on("error", () => {})
          resume(Effect.succeed(socket))
        })
      }).pipe(Effect.timeoutFail({ duration: "10 seconds", onTimeout: () => unavailable("timed out connecting") })),
      (socket) => Effect.sync(() => socket.destroy())
    )
    yield* clientHandshake(socket, { token: Redacted.make(token) }).pipe(
      Effect.mapError((failed) => unavailable(`authentication failed: ${failed.detail}`))
    )

    const pending = new Map<number, Pending>()
    let closed: AgentUnavailable | undefined
    let nextId = 1
    socket.on("close", () => {
      closed ??= unavailable("the agent closed the control connection (it exited or crashed)")
      for (const entry of pending.values()) entry.onClose(closed)
      pending.clear()
    })
    readLines(socket, (line) => {
      const decoded = decodeResponse(line)
      if (decoded._tag === "Left") {
        closed = unavailable(`bad message from the agent: ${decoded.left.message}`)
        return socket.destroy()
      }
      pending.get(decoded.right.id)?.onResponse(decoded.right)
    })

    const write = (request: Request) => {
      if (!socket.destroyed) socket.write(encodeRequest(request) + "\n")
    }

    const call = <A>(make: (id: number) => Request, pick: (response: Response) => A | undefined) =>
      Effect.async<A, AgentUnavailable>((resume) => {
        if (closed !== undefined) return resume(Effect.fail(closed))
        const id = nextId++
        pending.set(id, {
          onResponse: (response) => {
            pending.delete(id)
            const value = pick(response)
            resume(
              value !== undefined
                ? Effect.succeed(value)
                : Effect.fail(unavailable(response._tag === "Error" ? response.message : `unexpected ${response._tag}`))
            )
          },
          onClose: (error) => resume(Effect.fail(error))
        })
        write(make(id))
        return Effect.sync(() => pending.delete(id))
      })

    const hello = yield* call((id) => ({ _tag: "Hello", id }), (r) => (r._tag === "Hello" ? r.hello : undefined)).pipe(
      Effect.timeoutFail({ duration: "10 seconds", onTimeout: () => unavailable("no answer to hello") })
    )

    const provision = (request: ProvisionRequest): Stream.Stream<StageReport, AgentUnavailable> =>
      Stream.asyncScoped<StageReport, AgentUnavailable>((emit) =>
        Effect.gen(function*() {
          if (closed !== undefined) return yield* Effect.fail(closed)
          const id = nextId++
          const done = yield* Deferred.make<void>()
          pending.set(id, {
            onResponse: (response) => {
              if (response._tag === "Report") return void emit.single(response.report)
              pending.delete(id)
              Deferred.unsafeDone(done, Exit.void)
              if (response._tag === "End") return void emit.end()
              void emit.fail(unavailable(response._tag === "Error" ? response.message : `unexpected ${response._tag}`))
            },
            onClose: (error) => {
              Deferred.unsafeDone(done, Exit.void)
              void emit.fail(error)
            }
          })
          write({ _tag: "Provision", id, request })
          // The consumer went away before the stage ended: ask the agent to stop it.
          yield* Effect.addFinalizer(() =>
            Deferred.isDone(done).pipe(
              Effect.flatMap((finished) =>
                finished ? Effect.void : Effect.sync(() => {
                  pending.delete(id)
                  write({ _tag: "Cancel", id })
                })
              )
            )
          )
        })
      )

    const link: AgentLink = {
      node,
      hello,
      capacity: call((id) => ({ _tag: "Capacity", id }), (r) => (r._tag === "Capacity" ? r.capacity : undefined)),
      provision,
      stop: (runId, stageIndex) =>
        call((id) => ({ _tag: "Stop", id, runId, stageIndex }), (r) => (r._tag === "Stopped" ? true : undefined)).pipe(
          Effect.asVoid
        )
    }
    return link
  })

/** AgentControl over authenticated sockets. */
export const layer: Layer.Layer<AgentControl> = Layer.succeed(AgentControl, AgentControl.of({ connect }))
