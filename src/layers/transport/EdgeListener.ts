/**
 * A node's data-plane listener and its registry of receiving edges: authenticates each connection, routes its
 * AttachFrame to the edge registered for `(runId, edgeId)` (or refuses it with a FaultFrame), and maps the sender's
 * shared-memory ring when it offers one.
 */
import type * as Net from "node:net"
import { Cause, Context, Deferred, Duration, Effect, Exit, Layer, Option, Runtime, type Scope } from "effect"
import {
  AttachedFrame,
  type AttachFrame,
  EdgeBusy,
  EdgeClosed,
  Malformed,
  RingMismatch,
  UnknownEdge,
  UnknownRun
} from "../../domain/frames.js"
import type { EdgeId, RunId } from "../../domain/ids.js"
import { serverHandshake } from "./Auth.js"
import { type EdgeListener, type InboundEdge, ListenFailed, type ListenOptions, type RegisterOptions } from "./Edge.js"
import { boundLimits, FrameConn, makeLogger, validateRing } from "./FramedSocket.js"
import * as Framing from "./Framing.js"
import { InboundCore } from "./InboundCore.js"
import { defaultListenAddress, serveSockets } from "./Net.js"
import { sharedMemoryReceiveCarrier, socketReceiveCarrier } from "./ReceiveCarrier.js"
import { ShmRing } from "./ShmRing.js"
import { makeHandshakeLog, peerAddress } from "./RefusalLog.js"

/**
 * Listen for data-plane connections. Every connection must pass the HMAC handshake, then attach to
 * an edge registered here; everything else is refused and logged. Closed with the scope.
 */
export const listen = (options: ListenOptions): Effect.Effect<EdgeListener, ListenFailed, Scope.Scope> =>
  Effect.gen(function* () {
    const runtime = yield* Effect.runtime<never>()
    const log = makeLogger(runtime)
    const debug = makeLogger(runtime, "Debug")
    const requested = options.address ?? defaultListenAddress
    const runs = new Map<number, Map<number, InboundCore>>()
    const attachTimeout = Duration.toMillis(options.attachTimeout ?? "5 seconds")

    const attachWait = Duration.toMillis(options.attachWait ?? "2 seconds")
    /**
     * Attaches to edges not registered yet, by `runId:edgeId`: retried at the registration, refused after attachWait
     * (or at once beyond MAX_PARKED, or when the connection closes meanwhile).
     */
    const parked = new Map<
      string,
      Array<{ readonly conn: FrameConn; readonly frame: AttachFrame; readonly timer: NodeJS.Timeout }>
    >()
    let parkedCount = 0
    const MAX_PARKED = 256
    const parkKey = (runId: number, edgeId: number) => `${runId}:${edgeId}`
    const parkedKeyOf = new WeakMap<FrameConn, string>()
    const unpark = (key: string, conn: FrameConn) => {
      const list = parked.get(key)
      const i = list?.findIndex((p) => p.conn === conn) ?? -1
      if (list === undefined || i < 0) return undefined
      const [entry] = list.splice(i, 1)
      if (list.length === 0) parked.delete(key)
      parkedKeyOf.delete(conn)
      parkedCount--
      clearTimeout(entry!.timer)
      return entry
    }
    /** The refusal for a frame naming an edge not registered here: its run unknown, or only its edge; none if known. */
    const unregistered = (frame: { readonly runId: number; readonly edgeId: number }) =>
      !runs.has(frame.runId)
        ? new UnknownRun({ runId: frame.runId })
        : runs.get(frame.runId)!.has(frame.edgeId)
          ? undefined
          : new UnknownEdge({ runId: frame.runId, edgeId: frame.edgeId })
    const refuseUnregistered = (conn: FrameConn, frame: AttachFrame) =>
      conn.fail(unregistered(frame) ?? new UnknownEdge({ runId: frame.runId, edgeId: frame.edgeId }))
    /** The attaches waiting for this edge, now registered. */
    const onRegistered = (runId: number, edgeId: number) => {
      const key = parkKey(runId, edgeId)
      for (const entry of [...(parked.get(key) ?? [])]) {
        unpark(key, entry.conn)
        onAttach(entry.conn, entry.frame)
      }
    }

    const onAttach = (conn: FrameConn, frame: AttachFrame): void => {
      const edges = runs.get(frame.runId)
      const inbound = edges?.get(frame.edgeId)
      conn.bind(frame.runId, frame.edgeId)
      if (inbound === undefined) {
        if (attachWait <= 0 || parkedCount >= MAX_PARKED) return refuseUnregistered(conn, frame)
        const key = parkKey(frame.runId, frame.edgeId)
        const timer = setTimeout(() => {
          if (unpark(key, conn) !== undefined) refuseUnregistered(conn, frame)
        }, attachWait)
        timer.unref()
        const list = parked.get(key) ?? []
        list.push({ conn, frame, timer })
        parkedKeyOf.set(conn, key)
        parked.set(key, list)
        parkedCount++
        return
      }
      if (inbound.conn !== undefined || inbound.failure !== undefined) {
        return conn.fail(new EdgeBusy({ runId: frame.runId, edgeId: frame.edgeId }))
      }
      const ring = inbound.options.ring
      if (
        frame.dataCapacity !== ring.dataCapacity ||
        frame.alignment !== ring.alignment ||
        frame.wakeCoalescing !== ring.wakeCoalescing
      ) {
        return conn.fail(
          new RingMismatch({
            detail:
              `sender ring (${frame.dataCapacity} B, align ${frame.alignment}, ${frame.wakeCoalescing}) ≠ ` +
              `receiver ring (${ring.dataCapacity} B, align ${ring.alignment}, ${ring.wakeCoalescing})`
          })
        )
      }
      let shm: ShmRing | undefined
      if (frame.sharedMemory !== "") {
        if (requested._tag !== "Unix") {
          return conn.fail(new RingMismatch({ detail: "shared memory is offered only on a Unix-socket listener" }))
        }
        try {
          shm = ShmRing.open(frame.sharedMemory, ring.dataCapacity, ring.alignment)
        } catch (e) {
          return conn.fail(new RingMismatch({ detail: `cannot map the sender's ring: ${String(e)}` }))
        }
      }
      conn.write(Framing.unsafeEncode(AttachedFrame({ runId: frame.runId, edgeId: frame.edgeId }), 8))
      conn.limits = boundLimits(ring)
      conn.handlers = inbound
      inbound.attach(
        conn,
        shm === undefined
          ? socketReceiveCarrier(conn, inbound.options)
          : sharedMemoryReceiveCarrier(conn, shm, inbound.options, inbound)
      )
    }

    const handshakeLog = makeHandshakeLog("data-plane connection")
    const handshake = { token: options.token, timeout: options.handshakeTimeout, formats: options.formats }
    const onConnection = (raw: Net.Socket): void => {
      Runtime.runCallback(runtime)(serverHandshake(raw, handshake), {
        onExit: (exit) => {
          if (Exit.isFailure(exit)) {
            // A close before the handshake is a DEBUG line; a failed proof a WARN line, at most one per peer per 10 s
            // (RefusalLog.ts): a flood cannot fill the log, and no flood of closes hides a failed proof.
            const failure = Cause.failureOption(exit.cause)
            const said = Option.isSome(failure) ? handshakeLog(peerAddress(raw), failure.value) : undefined
            if (said !== undefined) (said.level === "Warning" ? log : debug)(said.line)
            raw.destroy()
            return
          }
          // The socket to speak on: TLS over `raw` across hosts, `raw` itself on loopback and Unix sockets.
          const socket = exit.value
          const timer = setTimeout(() => conn.fail(new Malformed({ detail: "no AttachFrame in time" })), attachTimeout)
          timer.unref()
          const conn: FrameConn = new FrameConn(
            socket,
            Framing.preAttachLimits,
            {
              onFrame: (frame) => {
                clearTimeout(timer)
                if (frame._tag === "AttachFrame") return onAttach(conn, frame)
                conn.bind(frame.runId, frame.edgeId)
                conn.fail(unregistered(frame) ?? new Malformed({ detail: `expected AttachFrame, got ${frame._tag}` }))
              },
              onBurstEnd: () => {},
              onClose: () => {
                clearTimeout(timer)
                const key = parkedKeyOf.get(conn)
                if (key !== undefined) unpark(key, conn)
              }
            },
            { runId: 0, edgeId: 0 },
            log
          )
          conn.start()
        }
      })
    }

    const address = yield* serveSockets(requested, onConnection, {
      onOpenError: (err) => new ListenFailed({ address: requested, detail: err.message }),
      onError: (err) => log(`data-plane listener error: ${err.message}`)
    })

    const unregister = (inbound: InboundCore) =>
      Effect.sync(() => {
        const { edgeId, runId } = inbound.options
        const edges = runs.get(runId)
        if (edges?.get(edgeId) === inbound) {
          edges.delete(edgeId)
          if (edges.size === 0) runs.delete(runId)
        }
        if (inbound.conn !== undefined) inbound.conn.end(new EdgeClosed())
        inbound.setFault(new EdgeClosed())
      })

    const register = (reg: RegisterOptions): Effect.Effect<InboundEdge, EdgeBusy | RingMismatch, Scope.Scope> =>
      Effect.gen(function* () {
        const invalid = validateRing(reg.ring)
        if (invalid !== undefined) return yield* invalid
        const edges = runs.get(reg.runId) ?? new Map<number, InboundCore>()
        if (edges.has(reg.edgeId)) return yield* new EdgeBusy({ runId: reg.runId, edgeId: reg.edgeId })
        const inbound = new InboundCore(reg)
        edges.set(reg.edgeId, inbound)
        runs.set(reg.runId, edges)
        yield* Effect.addFinalizer(() => unregister(inbound))
        onRegistered(reg.runId, reg.edgeId)
        const receiver: InboundEdge = {
          runId: reg.runId,
          edgeId: reg.edgeId,
          ring: reg.ring,
          receive: inbound.receive,
          take: inbound.take,
          attached: Deferred.await(inbound.attachedDeferred),
          fault: Deferred.await(inbound.faulted),
          stats: inbound.stats,
          close: unregister(inbound)
        }
        return receiver
      })

    const listener: EdgeListener = {
      address,
      register,
      edges: Effect.sync(() =>
        [...runs.entries()].flatMap(([runId, edges]) =>
          [...edges.keys()].map((edgeId) => ({ runId: runId as RunId, edgeId: edgeId as EdgeId }))
        )
      )
    }
    return listener
  })

/** This node's data-plane listener, as a service. */
export class DataPlaneNode extends Context.Tag("swactor/DataPlaneNode")<DataPlaneNode, EdgeListener>() {}

/** `listen` as a layer: the listener lives as long as the layer. */
export const layer = (options: ListenOptions): Layer.Layer<DataPlaneNode, ListenFailed> =>
  Layer.scoped(DataPlaneNode, listen(options))
