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

/** An attach to an edge not registered yet, and the timer that refuses it after attachWait. */
interface ParkedAttach {
  readonly conn: FrameConn
  readonly frame: AttachFrame
  readonly timer: NodeJS.Timeout
}

/** At most this many attaches wait for their edge at once; beyond it one is refused at once. */
const MAX_PARKED = 256
const parkKey = (runId: number, edgeId: number) => `${runId}:${edgeId}`

/** The refusal of an attach whose ring is not the one registered, or undefined when they agree. */
const ringMismatch = (frame: AttachFrame, ring: RegisterOptions["ring"]): RingMismatch | undefined =>
  frame.dataCapacity !== ring.dataCapacity ||
  frame.alignment !== ring.alignment ||
  frame.wakeCoalescing !== ring.wakeCoalescing
    ? new RingMismatch({
        detail:
          `sender ring (${frame.dataCapacity} B, align ${frame.alignment}, ${frame.wakeCoalescing}) ≠ ` +
          `receiver ring (${ring.dataCapacity} B, align ${ring.alignment}, ${ring.wakeCoalescing})`
      })
    : undefined

/**
 * The receiving edges registered on one listener, by run and edge, and the attaches that wait for theirs: routes each
 * AttachFrame to its edge (or refuses it), and registers and unregisters edges.
 */
class ReceivingEdges {
  private readonly runs = new Map<number, Map<number, InboundCore>>()
  /**
   * Attaches to edges not registered yet, by `runId:edgeId`: retried at the registration, refused after attachWait
   * (or at once beyond MAX_PARKED, or when the connection closes meanwhile).
   */
  private readonly parked = new Map<string, Array<ParkedAttach>>()
  private parkedCount = 0
  private readonly parkedKeyOf = new WeakMap<FrameConn, string>()

  constructor(
    private readonly attachWait: number,
    /** Whether the listener is on a Unix socket (the only one a sender's shared-memory ring is taken on). */
    private readonly unixListener: boolean
  ) {}

  private unpark(key: string, conn: FrameConn) {
    const list = this.parked.get(key)
    const i = list?.findIndex((p) => p.conn === conn) ?? -1
    if (list === undefined || i < 0) return undefined
    const [entry] = list.splice(i, 1)
    if (list.length === 0) this.parked.delete(key)
    this.parkedKeyOf.delete(conn)
    this.parkedCount--
    clearTimeout(entry!.timer)
    return entry
  }

  /** A connection closed: its attach, if waiting, waits no more. */
  forget(conn: FrameConn) {
    const key = this.parkedKeyOf.get(conn)
    if (key !== undefined) this.unpark(key, conn)
  }

  /** The refusal for a frame naming an edge not registered here: its run unknown, or only its edge; none if known. */
  unregistered(frame: { readonly runId: number; readonly edgeId: number }) {
    return !this.runs.has(frame.runId)
      ? new UnknownRun({ runId: frame.runId })
      : this.runs.get(frame.runId)!.has(frame.edgeId)
        ? undefined
        : new UnknownEdge({ runId: frame.runId, edgeId: frame.edgeId })
  }

  private refuseUnregistered(conn: FrameConn, frame: AttachFrame) {
    conn.fail(this.unregistered(frame) ?? new UnknownEdge({ runId: frame.runId, edgeId: frame.edgeId }))
  }

  /** The attaches waiting for this edge, now registered. */
  private onRegistered(runId: number, edgeId: number) {
    const key = parkKey(runId, edgeId)
    for (const entry of [...(this.parked.get(key) ?? [])]) {
      this.unpark(key, entry.conn)
      this.onAttach(entry.conn, entry.frame)
    }
  }

  /** An attach to an edge not registered (yet): it waits attachWait for the registration, or is refused. */
  private park(conn: FrameConn, frame: AttachFrame) {
    if (this.attachWait <= 0 || this.parkedCount >= MAX_PARKED) return this.refuseUnregistered(conn, frame)
    const key = parkKey(frame.runId, frame.edgeId)
    const timer = setTimeout(() => {
      if (this.unpark(key, conn) !== undefined) this.refuseUnregistered(conn, frame)
    }, this.attachWait)
    timer.unref()
    const list = this.parked.get(key) ?? []
    list.push({ conn, frame, timer })
    this.parkedKeyOf.set(conn, key)
    this.parked.set(key, list)
    this.parkedCount++
  }

  /** The sender's shared-memory ring mapped, none when it offers none, or why it cannot be taken. */
  private senderRing(frame: AttachFrame, ring: RegisterOptions["ring"]): ShmRing | undefined | RingMismatch {
    if (frame.sharedMemory === "") return undefined
    if (!this.unixListener)
      return new RingMismatch({ detail: "shared memory is offered only on a Unix-socket listener" })
    try {
      return ShmRing.open(frame.sharedMemory, ring.dataCapacity, ring.alignment)
    } catch (e) {
      return new RingMismatch({ detail: `cannot map the sender's ring: ${String(e)}` })
    }
  }

  /** Routes an AttachFrame to its edge: attached (answered with AttachedFrame), parked, or refused. */
  onAttach(conn: FrameConn, frame: AttachFrame): void {
    const inbound = this.runs.get(frame.runId)?.get(frame.edgeId)
    conn.bind(frame.runId, frame.edgeId)
    if (inbound === undefined) return this.park(conn, frame)
    if (inbound.conn !== undefined || inbound.failure !== undefined) {
      return conn.fail(new EdgeBusy({ runId: frame.runId, edgeId: frame.edgeId }))
    }
    const ring = inbound.options.ring
    const mismatch = ringMismatch(frame, ring)
    if (mismatch !== undefined) return conn.fail(mismatch)
    const shm = this.senderRing(frame, ring)
    if (shm instanceof RingMismatch) return conn.fail(shm)
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

  private unregister(inbound: InboundCore) {
    return Effect.sync(() => {
      const { edgeId, runId } = inbound.options
      const edges = this.runs.get(runId)
      if (edges?.get(edgeId) === inbound) {
        edges.delete(edgeId)
        if (edges.size === 0) this.runs.delete(runId)
      }
      if (inbound.conn !== undefined) inbound.conn.end(new EdgeClosed())
      inbound.setFault(new EdgeClosed())
    })
  }

  readonly register = (reg: RegisterOptions): Effect.Effect<InboundEdge, EdgeBusy | RingMismatch, Scope.Scope> => {
    const self = this
    return Effect.gen(function* () {
      const invalid = validateRing(reg.ring)
      if (invalid !== undefined) return yield* invalid
      const edges = self.runs.get(reg.runId) ?? new Map<number, InboundCore>()
      if (edges.has(reg.edgeId)) return yield* new EdgeBusy({ runId: reg.runId, edgeId: reg.edgeId })
      const inbound = new InboundCore(reg)
      edges.set(reg.edgeId, inbound)
      self.runs.set(reg.runId, edges)
      yield* Effect.addFinalizer(() => self.unregister(inbound))
      self.onRegistered(reg.runId, reg.edgeId)
      const receiver: InboundEdge = {
        runId: reg.runId,
        edgeId: reg.edgeId,
        ring: reg.ring,
        receive: inbound.receive,
        take: inbound.take,
        attached: Deferred.await(inbound.attachedDeferred),
        fault: Deferred.await(inbound.faulted),
        stats: inbound.stats,
        close: self.unregister(inbound)
      }
      return receiver
    })
  }

  readonly edges = Effect.sync(() =>
    [...this.runs.entries()].flatMap(([runId, edges]) =>
      [...edges.keys()].map((edgeId) => ({ runId: runId as RunId, edgeId: edgeId as EdgeId }))
    )
  )
}

/** What a listener's connections share: its runtime and loggers, handshake settings and edges. */
interface ConnectionContext {
  readonly runtime: Runtime.Runtime<never>
  readonly log: (message: string) => void
  readonly debug: (message: string) => void
  readonly handshake: Parameters<typeof serverHandshake>[1]
  readonly handshakeLog: ReturnType<typeof makeHandshakeLog>
  readonly attachTimeout: number
  readonly edges: ReceivingEdges
}

/** An authenticated connection's first frame must be an AttachFrame, within attachTimeout. */
const awaitAttach = (socket: Net.Socket, ctx: ConnectionContext) => {
  const timer = setTimeout(() => conn.fail(new Malformed({ detail: "no AttachFrame in time" })), ctx.attachTimeout)
  timer.unref()
  const conn: FrameConn = new FrameConn(
    socket,
    Framing.preAttachLimits,
    {
      onFrame: (frame) => {
        clearTimeout(timer)
        if (frame._tag === "AttachFrame") return ctx.edges.onAttach(conn, frame)
        conn.bind(frame.runId, frame.edgeId)
        conn.fail(ctx.edges.unregistered(frame) ?? new Malformed({ detail: `expected AttachFrame, got ${frame._tag}` }))
      },
      onBurstEnd: () => {},
      onClose: () => {
        clearTimeout(timer)
        ctx.edges.forget(conn)
      }
    },
    { runId: 0, edgeId: 0 },
    ctx.log
  )
  conn.start()
}

/** One accepted socket: the handshake, then (on the socket it gives) the wait for its AttachFrame. */
const onConnection = (raw: Net.Socket, ctx: ConnectionContext): void => {
  Runtime.runCallback(ctx.runtime)(serverHandshake(raw, ctx.handshake), {
    onExit: (exit) => {
      if (Exit.isFailure(exit)) {
        // A close before the handshake is a DEBUG line; a failed proof a WARN line, at most one per peer per 10 s
        // (RefusalLog.ts): a flood cannot fill the log, and no flood of closes hides a failed proof.
        const failure = Cause.failureOption(exit.cause)
        const said = Option.isSome(failure) ? ctx.handshakeLog(peerAddress(raw), failure.value) : undefined
        if (said !== undefined) (said.level === "Warning" ? ctx.log : ctx.debug)(said.line)
        raw.destroy()
        return
      }
      // The socket to speak on: TLS over `raw` across hosts, `raw` itself on loopback and Unix sockets.
      awaitAttach(exit.value, ctx)
    }
  })
}

/**
 * Listen for data-plane connections. Every connection must pass the HMAC handshake, then attach to
 * an edge registered here; everything else is refused and logged. Closed with the scope.
 */
export const listen = (options: ListenOptions): Effect.Effect<EdgeListener, ListenFailed, Scope.Scope> =>
  Effect.gen(function* () {
    const runtime = yield* Effect.runtime<never>()
    const log = makeLogger(runtime)
    const requested = options.address ?? defaultListenAddress
    const edges = new ReceivingEdges(Duration.toMillis(options.attachWait ?? "2 seconds"), requested._tag === "Unix")
    const ctx: ConnectionContext = {
      runtime,
      log,
      debug: makeLogger(runtime, "Debug"),
      handshake: { token: options.token, timeout: options.handshakeTimeout, formats: options.formats },
      handshakeLog: makeHandshakeLog("data-plane connection"),
      attachTimeout: Duration.toMillis(options.attachTimeout ?? "5 seconds"),
      edges
    }
    const address = yield* serveSockets(requested, (raw) => onConnection(raw, ctx), {
      onOpenError: (err) => new ListenFailed({ address: requested, detail: err.message }),
      onError: (err) => log(`data-plane listener error: ${err.message}`)
    })
    const listener: EdgeListener = { address, register: edges.register, edges: edges.edges }
    return listener
  })

/** This node's data-plane listener, as a service. */
export class DataPlaneNode extends Context.Tag("swactor/DataPlaneNode")<DataPlaneNode, EdgeListener>() {}

/** `listen` as a layer: the listener lives as long as the layer. */
export const layer = (options: ListenOptions): Layer.Layer<DataPlaneNode, ListenFailed> =>
  Layer.scoped(DataPlaneNode, listen(options))
