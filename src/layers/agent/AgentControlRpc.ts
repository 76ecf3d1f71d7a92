/**
 * The control plane's two ends: the agent serves the `AgentRpcs` group (src/domain/controlRpc.ts)
 * for its StageHost, and the orchestrator's `AgentControl` layer connects to it, both over the
 * transport's authenticated sockets (src/layers/transport/ControlPlane.ts: mutual HMAC handshake,
 * then ndjson RPC). A dropped connection fails the orchestrator's calls and provision streams at
 * once (a crashed agent is a fault, never a hang); the agent interrupts the handlers of a client
 * that went away (its stages stop).
 */
import * as Net from "node:net"
import * as Socket from "@effect/platform/Socket"
import * as SocketServer from "@effect/platform/SocketServer"
import { RpcClient, RpcSerialization, RpcServer } from "@effect/rpc"
import { type Duration, Effect, Layer, Redacted, Schema, Scope, Stream } from "effect"
import { type TransportAddress, TransportAddress as TransportAddressSchema } from "../../domain/frames.js"
import { AgentHello, AgentRpcs, WeightDeliveryError } from "../../domain/controlRpc.js"
import { AgentControl, type AgentLink, AgentUnavailable, type StageHost } from "../../services/AgentLinks.js"
import type { NodeEndpoint } from "../../services/Membership.js"
import type { WeightStore } from "../gguf/SliceStore.js"
import { receiveSlice, sendSlice, SLICE_STREAM_MAGIC, SliceStreamBroken } from "../gguf/SliceStream.js"
import { WireMismatch, type WireFormats } from "../../domain/wireFormats.js"
import { clientHandshake } from "../transport/Auth.js"
import { authenticatedSocket, makeSocketServer, netOptions } from "../transport/ControlPlane.js"

/** Parses `host:port` (IPv6 in brackets) into a TCP address, or an absolute path into a Unix socket address. */
export const parseAddress = (text: string): TransportAddress | undefined => {
  if (text.trim().startsWith("/"))
    return Schema.decodeUnknownSync(TransportAddressSchema)({ _tag: "Unix", path: text.trim() })
  const match = /^\[?([^\]]*?)\]?:(\d+)$/.exec(text.trim())
  if (match === null) return undefined
  const port = Number(match[2])
  if (!Number.isInteger(port) || port < 0 || port > 65535) return undefined
  return Schema.decodeUnknownSync(TransportAddressSchema)({
    _tag: "Tcp",
    host: match[1] === "" ? "127.0.0.1" : match[1],
    port
  })
}

export const formatAddress = (address: TransportAddress): string =>
  address._tag === "Tcp"
    ? address.host.includes(":")
      ? `[${address.host}]:${address.port}`
      : `${address.host}:${address.port}`
    : address.path

const isWildcard = (host: string) => host === "0.0.0.0" || host === "::" || host === ""

// ---------------------------------------------------------------------------------------------
// Agent side
// ---------------------------------------------------------------------------------------------

export interface RpcServerOptions {
  readonly address: TransportAddress
  readonly token: string
  readonly host: StageHost
  readonly hello: AgentHello
  /** The agent's received slices (weight delivery); without it the agent refuses deliveries. */
  readonly weights?: WeightStore
  /** What the agent states in its handshakes (default: its own; a test states another wire version or formats). */
  readonly formats?: WireFormats
}

/** Serves the control group for a stage host until the scope closes; returns the bound address. */
export const serveControlRpc = (
  options: RpcServerOptions
): Effect.Effect<TransportAddress, AgentUnavailable, Scope.Scope> =>
  Effect.gen(function* () {
    const weights = options.weights
    const socketServer = yield* makeSocketServer({
      token: Redacted.make(options.token),
      address: options.address,
      formats: options.formats,
      // Weight delivery's byte streams arrive on the same port, after the same handshake.
      divert:
        weights === undefined
          ? undefined
          : { magic: SLICE_STREAM_MAGIC, handle: (socket) => receiveSlice(socket, weights.sink) }
    }).pipe(
      Effect.mapError(
        (error) =>
          new AgentUnavailable({
            address: formatAddress(options.address),
            message: `cannot listen: ${String(error.cause)}`
          })
      )
    )
    const store: Effect.Effect<WeightStore, WeightDeliveryError> =
      options.weights === undefined
        ? Effect.fail(new WeightDeliveryError({ reason: "Io", message: "this agent takes no weight deliveries" }))
        : Effect.succeed(options.weights)
    const handlers = AgentRpcs.toLayer({
      Hello: () => Effect.succeed(options.hello),
      Capacity: () => options.host.capacity,
      Provision: ({ request }) => options.host.provision(request),
      Stop: ({ runId, stageIndex }) => options.host.stop(runId, stageIndex),
      DropCached: ({ all, entries }) => options.host.dropCached?.(entries, all) ?? Effect.void,
      WeightsCheck: ({ weights }) => store.pipe(Effect.flatMap((s) => s.check(weights))),
      SliceChunk: ({ bytes, hash, offset }) => store.pipe(Effect.flatMap((s) => s.chunk(hash, offset, bytes))),
      SliceFinish: ({ weights }) => store.pipe(Effect.flatMap((s) => s.finish(weights)))
    })
    yield* Layer.build(
      RpcServer.layer(AgentRpcs).pipe(
        Layer.provide(handlers),
        Layer.provide(RpcServer.layerProtocolSocketServer),
        Layer.provide(RpcSerialization.layerNdjson),
        Layer.provide(Layer.succeed(SocketServer.SocketServer, socketServer))
      )
    )
    const bound = socketServer.address
    return bound._tag === "UnixAddress"
      ? ({ _tag: "Unix", path: bound.path } satisfies TransportAddress)
      : ({
          _tag: "Tcp",
          host: options.address._tag === "Tcp" ? options.address.host : bound.hostname,
          port: bound.port
        } satisfies TransportAddress)
  })

// ---------------------------------------------------------------------------------------------
// Orchestrator side
// ---------------------------------------------------------------------------------------------

/** One authenticated connection, paused until the RPC protocol attaches its reader. */
const openAuthenticated = (address: TransportAddress, token: string, timeout: Duration.DurationInput, peer: string) =>
  Effect.acquireRelease(
    Effect.async<Net.Socket, Socket.SocketError>((resume) => {
      const conn = Net.createConnection(netOptions(address))
      const onError = (cause: Error) => resume(Effect.fail(new Socket.SocketGenericError({ reason: "Open", cause })))
      conn.once("error", onError)
      conn.once("connect", () => {
        conn.off("error", onError)
        conn.on("error", () => {})
        if (address._tag === "Tcp") conn.setNoDelay(true)
        resume(Effect.succeed(conn))
      })
      return Effect.sync(() => conn.destroy())
    }),
    (conn) => Effect.sync(() => conn.destroy())
  ).pipe(
    // The socket to speak on: TLS over the connection across hosts, the connection itself on loopback.
    Effect.flatMap((conn) =>
      clientHandshake(conn, { token: Redacted.make(token), timeout, peer }).pipe(
        Effect.mapError(
          (failed) =>
            new Socket.SocketGenericError({
              reason: "Open",
              cause: failed._tag === "WireMismatch" ? failed : new Error(failed.detail)
            })
        )
      )
    ),
    Effect.timeoutFail({
      duration: timeout,
      onTimeout: () => new Socket.SocketGenericError({ reason: "OpenTimeout", cause: new Error("timed out") })
    })
  )

/** Why a control connection could not be opened, in words: a peer that is not a swactor node is named as such. */
const connectFailure = (address: string, error: Socket.SocketError): string => {
  // Another wire version or other formats: the handshake's own line names both sides' values.
  if (error.cause instanceof WireMismatch) return error.cause.message
  const detail = error.cause instanceof Error ? error.cause.message : String(error.cause ?? error.message)
  const prefix = `cannot connect to ${address}`
  if (/^expected |unsupported auth version/.test(detail)) {
    return `${prefix}: not a swactor node (it answered, but not with a swactor handshake: ${detail})`
  }
  if (error.reason === "OpenTimeout" || detail === "handshake timed out") {
    return `${prefix}: no swactor handshake within the connect timeout (is a swactor node listening there?)`
  }
  if (/does not match the cluster token/.test(detail)) {
    return `${prefix}: the cluster token does not match (${detail}); use the same token on every node`
  }
  return `${prefix}: ${detail}`
}

const connect = (node: NodeEndpoint, token: string): Effect.Effect<AgentLink, AgentUnavailable, Scope.Scope> =>
  Effect.gen(function* () {
    const address = parseAddress(node.address)
    const unavailable = (message: string) => new AgentUnavailable({ address: node.address, message })
    if (address === undefined) return yield* Effect.fail(unavailable(`not a host:port or socket path: ${node.address}`))
    const scope = yield* Effect.scope
    const timeout = "10 seconds"
    let first: Net.Socket | undefined = yield* openAuthenticated(address, token, timeout, node.address).pipe(
      Effect.mapError((error) => unavailable(connectFailure(node.address, error)))
    )
    const open = Effect.suspend(() => {
      if (first === undefined) return openAuthenticated(address, token, timeout, node.address)
      const conn = first
      first = undefined
      return Effect.succeed(conn)
    })
    const socket = yield* authenticatedSocket(open)
    const protocol = yield* RpcClient.makeProtocolSocket().pipe(
      Effect.provideService(Socket.Socket, socket),
      Effect.provide(RpcSerialization.layerNdjson),
      Scope.extend(scope)
    )
    const client = yield* RpcClient.make(AgentRpcs).pipe(Effect.provideService(RpcClient.Protocol, protocol))
    const lost = (error: { readonly message: string }) =>
      unavailable(`the control connection to the agent failed (it exited or crashed): ${error.message}`)
    const said = yield* client
      .Hello()
      .pipe(
        Effect.mapError(lost),
        Effect.timeoutFail({ duration: timeout, onTimeout: () => unavailable("no answer to hello") })
      )
    // An agent bound to a wildcard address is reached on the host we reached its control plane on.
    const hello =
      said.dataAddress._tag === "Tcp" && isWildcard(said.dataAddress.host) && address._tag === "Tcp"
        ? new AgentHello({ ...said, dataAddress: { ...said.dataAddress, host: address.host } })
        : said
    const link: AgentLink = {
      node,
      hello,
      capacity: client.Capacity().pipe(Effect.mapError(lost)),
      provision: (request) => client.Provision({ request }).pipe(Stream.mapError(lost)),
      stop: (runId, stageIndex) => client.Stop({ runId, stageIndex }).pipe(Effect.mapError(lost)),
      dropCached: (entries, all) => client.DropCached({ entries, all }).pipe(Effect.mapError(lost)),
      weights: {
        check: (weights) =>
          client.WeightsCheck({ weights }).pipe(Effect.catchTag("RpcClientError", (e) => Effect.fail(lost(e)))),
        chunk: (hash, offset, bytes) =>
          client
            .SliceChunk({ hash, offset, bytes })
            .pipe(Effect.catchTag("RpcClientError", (e) => Effect.fail(lost(e)))),
        finish: (weights) =>
          client.SliceFinish({ weights }).pipe(Effect.catchTag("RpcClientError", (e) => Effect.fail(lost(e)))),
        stream: (transfer) =>
          openAuthenticated(address, token, timeout, node.address).pipe(
            Effect.mapError((error) => unavailable(connectFailure(node.address, error))),
            Effect.flatMap((socket) => sendSlice(socket, transfer)),
            Effect.mapError((e) =>
              e instanceof SliceStreamBroken ? unavailable(`the slice stream to the agent broke: ${e.message}`) : e
            ),
            Effect.scoped
          )
      }
    }
    return link
  })

/** AgentControl over the @effect/rpc control group. */
export const layer: Layer.Layer<AgentControl> = Layer.succeed(AgentControl, AgentControl.of({ connect }))
