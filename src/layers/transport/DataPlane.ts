/**
 * The data plane: token and activation frames over authenticated stream sockets (TCP across
 * machines, a Unix domain socket on one machine — the same code with a different address), or,
 * for same-host edges, through a shared-memory ring (`connect({ sharedMemory: true })` to a Unix
 * listener; see ShmRing.ts): the sender names its /dev/shm ring in the AttachFrame, data frames
 * go into the ring, and the socket carries only doorbells (PendingBit), faults and the attach.
 *
 * Topology. Every node runs one `DataPlaneListener`. The consumer of an edge registers an
 * `EdgeReceiver` for `(runId, edgeId)` on its listener; the producer opens an `EdgeSender` to that
 * listener. One connection carries one edge:
 *
 * ```
 * sender                                   listener / receiver
 *   ── TCP/Unix connect ─────────────────▶
 *   ◀── mutual HMAC handshake (Auth.ts) ─▶   (nothing else is read before it succeeds)
 *   ── AttachFrame(run, edge, ring) ─────▶   unknown run / edge, ring mismatch, busy edge →
 *   ◀── AttachedFrame ────────────────────    FaultFrame + close, logged (Effect.logWarning)
 *   ── Token/ActivationFrame ... ─────────▶   frames must carry the attached (run, edge)
 *   ◀── CreditFrame(bytes) ───────────────    when the consumer takes frames
 * ```
 *
 * `RingSpec` on every transport:
 * - `dataCapacity` is the flow-control window: the sender counts the encoded bytes of frames not
 *   yet credited and waits while one more frame would exceed the window. The receiver credits a
 *   message's bytes when its consumer takes it (and a chunk's bytes as soon as it is copied into
 *   the reassembly buffer, so a message larger than the window can flow). A sender that overruns
 *   the window faults the edge (`WindowExceeded`). A frame never exceeds the window: a larger
 *   activation / prompt is split into chunks that fit (`Framing.chunk`) and reassembled on arrival.
 * - `alignment`: every frame is padded to a multiple of `max(8, alignment)` and an activation's
 *   payload starts aligned inside its frame (see Framing.ts).
 * - `wakeCoalescing`: `PendingBit` — the receiver rings its consumer only when the pending bit goes
 *   from clear to set, and `receive` hands over every message ready (one wake, one credit frame per
 *   burst); `EveryFrame` — one signal per message and `receive` hands over exactly one.
 *   `stats.signals` / `stats.wakes` / `stats.creditFrames` count them.
 * - `direction` and `hostPinning` do not change these transports (pinning matters to GPU staging).
 *
 * Same rules on every transport: shared-memory frames are drained into the same stream decoder and
 * pass the same checks; credits go through the ring instead of CreditFrames.
 *
 * Faults. Anything wrong on the wire — malformed, truncated (peer closed mid-frame), oversized,
 * out-of-order, foreign run/edge, window overrun — faults the edge with a typed `EdgeFault`: the
 * receiver's `receive` fails with it (after handing over the messages that were complete), the
 * peer gets a `FaultFrame` (the sender's `send` then fails with `PeerFaulted`), the connection
 * closes. The receiving process never throws and never delivers a bad frame.
 *
 * Each side has one consumer: do not call `receive` (or `send`) from two fibers at once.
 */
import * as Net from "node:net"
import { Context, Data, Deferred, Duration, Effect, Either, Exit, FiberId, Layer, Runtime, Scope } from "effect"
import {
  AttachedFrame,
  AttachFrame,
  ConnectFailed,
  CreditFrame,
  type DataFrame,
  describeFault,
  DoorbellFrame,
  EdgeBusy,
  EdgeClosed,
  type EdgeFault,
  FaultFrame,
  Malformed,
  Oversized,
  PeerClosed,
  PeerFaulted,
  RingMismatch,
  type TransportAddress,
  UnknownEdge,
  UnknownRun,
  WindowExceeded,
  type WireFrame
} from "../../domain/frames.js"
import type { EdgeId, RunId } from "../../domain/ids.js"
import type { RingSpec } from "../../domain/plan.js"
import { type ClusterToken, clientHandshake, serverHandshake } from "./Auth.js"
import * as Framing from "./Framing.js"
import { ShmRing } from "./ShmRing.js"

/** The listener could not be opened. */
export class ListenFailed extends Data.TaggedError("ListenFailed")<{
  readonly address: TransportAddress
  readonly detail: string
}> {}

/** Counters of a receiving edge. */
export interface ReceiverStats {
  /** Complete messages handed to the sequencer (chunked messages count once). */
  readonly messages: number
  /** Frames decoded (chunks count one each). */
  readonly frames: number
  readonly bytes: number
  /** Doorbell rings: pending-bit transitions (PendingBit) or messages (EveryFrame). */
  readonly signals: number
  /** Consumer wake-ups: `receive` calls that returned messages. */
  readonly wakes: number
  readonly creditFrames: number
  /** Bytes received and not yet credited back. */
  readonly unconsumedBytes: number
  /** Shared memory with `spinMicros`: busy-polls started, and those that found a message. */
  readonly spins: number
  readonly spinHits: number
}

/** Counters of a sending edge. */
export interface SenderStats {
  readonly frames: number
  readonly bytes: number
  /** Bytes sent and not yet credited (never above `ring.dataCapacity`). */
  readonly outstandingBytes: number
  /** Highest `outstandingBytes` seen. */
  readonly maxOutstandingBytes: number
  /** Times `send` had to wait for credit. */
  readonly windowWaits: number
  readonly creditFrames: number
}

/** The consuming end of one edge. */
export interface EdgeReceiver {
  readonly runId: RunId
  readonly edgeId: EdgeId
  readonly ring: RingSpec
  /**
   * Wait for messages and take them, per `ring.wakeCoalescing`: `PendingBit` → every message
   * ready (at least one), `EveryFrame` → exactly one. Credits the taken bytes back to the sender.
   * Fails with the edge's fault once no message is left.
   */
  readonly receive: Effect.Effect<ReadonlyArray<DataFrame>, EdgeFault>
  /** Wait for and take exactly one message. */
  readonly take: Effect.Effect<DataFrame, EdgeFault>
  /** Succeeds once a sender has attached; fails if the edge faults first. */
  readonly attached: Effect.Effect<void, EdgeFault>
  /** Waits until the edge faults or closes, and returns why. */
  readonly fault: Effect.Effect<EdgeFault>
  readonly stats: Effect.Effect<ReceiverStats>
  /** Unregister and close the connection (also done when the registering scope closes). */
  readonly close: Effect.Effect<void>
}

/** The producing end of one edge. */
export interface EdgeSender {
  readonly runId: RunId
  readonly edgeId: EdgeId
  readonly ring: RingSpec
  /**
   * Send one message: split into chunks when larger than the window, each chunk waiting while
   * the window is full. Fails with `UnknownEdge` if the frame names another edge, with
   * `Oversized` / `Malformed` if it can't be encoded (neither faults the edge), or with the
   * edge's fault.
   */
  readonly send: (frame: DataFrame) => Effect.Effect<void, EdgeFault>
  /** Send several messages in one socket write where the window allows (one receiver wake). */
  readonly sendAll: (frames: Iterable<DataFrame>) => Effect.Effect<void, EdgeFault>
  readonly fault: Effect.Effect<EdgeFault>
  readonly stats: Effect.Effect<SenderStats>
  /** End the stream gracefully (also done when the connecting scope closes). */
  readonly close: Effect.Effect<void>
}

export interface RegisterOptions {
  readonly runId: RunId
  readonly edgeId: EdgeId
  readonly ring: RingSpec
  /** Sequence number of the first message (default 0). */
  readonly initialSequence?: number | undefined
  /** Join chunks into whole messages before delivery (default true). */
  readonly reassemble?: boolean | undefined
  /**
   * Shared-memory edges only: when `receive` finds nothing ready, busy-poll the ring this many
   * microseconds before sleeping on the doorbell. Trades CPU for latency; default 0 (no polling).
   */
  readonly spinMicros?: number | undefined
}

/** A node's data-plane listener, routing authenticated connections to registered edges. */
export interface DataPlaneListener {
  /** The bound address (with the real port when listening on port 0). */
  readonly address: TransportAddress
  /**
   * Register the receiving end of an edge; unregistered when the scope closes (or on `close`).
   * One sender may attach, once: after the edge faults or its sender leaves, `close` it and
   * register again for a fresh edge (a reconnect cannot resume a half-delivered sequence).
   * Register before the producer connects: an attach for an unregistered edge is refused.
   */
  readonly register: (options: RegisterOptions) => Effect.Effect<EdgeReceiver, EdgeBusy | RingMismatch, Scope.Scope>
  /** Currently registered edges. */
  readonly edges: Effect.Effect<ReadonlyArray<{ readonly runId: RunId; readonly edgeId: EdgeId }>>
}

export interface ListenOptions {
  /** Default: TCP on 127.0.0.1, an ephemeral port. Bind other interfaces only when told to. */
  readonly address?: TransportAddress | undefined
  readonly token: ClusterToken
  readonly handshakeTimeout?: Duration.DurationInput | undefined
  /** How long a connection may stay authenticated but unattached (default 5 s). */
  readonly attachTimeout?: Duration.DurationInput | undefined
}

export interface ConnectOptions {
  readonly address: TransportAddress
  readonly token: ClusterToken
  readonly runId: RunId
  readonly edgeId: EdgeId
  readonly ring: RingSpec
  /** Bounds connect + handshake + attach (default 10 s). */
  readonly timeout?: Duration.DurationInput | undefined
  /**
   * Same-host edges only (a Unix-socket `address`): carry data frames through a shared-memory ring
   * (ShmRing.ts) and use the socket only for doorbells, credits and faults. Default false.
   */
  readonly sharedMemory?: boolean | undefined
}

// ---------------------------------------------------------------------------------------------
// Shared: a framed connection over an authenticated socket
// ---------------------------------------------------------------------------------------------

interface ConnHandlers {
  /** One decoded frame. May call `conn.fail`. */
  onFrame(frame: WireFrame, length: number): void
  /** End of one batch of bytes from the socket (a burst). */
  onBurstEnd(): void
  /** The connection is gone, with the reason. Called once. */
  onClose(fault: EdgeFault): void
}

/** Frame-level view of a socket: decodes each `data` event completely, then `onBurstEnd`. */
class FrameConn {
  // A socket's data chunks are never written again, so activation payloads may be views of them.
  readonly decoder = new Framing.StreamDecoder(true)
  closed = false

  constructor(
    readonly socket: Net.Socket,
    public limits: Framing.Limits,
    public handlers: ConnHandlers,
    private readonly ids: { runId: number; edgeId: number },
    private readonly log: (message: string) => void
  ) {}

  start(): void {
    this.socket.on("data", this.onData)
    this.socket.on("end", this.onEnd)
    this.socket.on("error", this.onError)
    this.socket.on("close", this.onSocketClose)
    this.socket.resume()
  }

  bind(runId: number, edgeId: number): void {
    this.ids.runId = runId
    this.ids.edgeId = edgeId
  }

  write(bytes: Uint8Array): void {
    if (!this.closed) this.socket.write(bytes)
  }

  /** Fault this connection: tell the peer why (best effort), close, report. */
  fail(fault: EdgeFault): void {
    if (this.closed) return
    this.log(`edge run=${this.ids.runId} edge=${this.ids.edgeId} faulted: ${describeFault(fault)}`)
    const frame = FaultFrame({
      runId: this.ids.runId as RunId,
      edgeId: this.ids.edgeId as EdgeId,
      reason: fault._tag,
      detail: describeFault(fault)
    })
    this.socket.write(Framing.unsafeEncode(frame, this.limits.alignment))
    this.socket.end()
    setTimeout(() => this.socket.destroy(), 1000).unref()
    this.closeWith(fault)
  }

  /** Close without a fault frame (local close). */
  end(fault: EdgeFault): void {
    if (this.closed) return
    this.socket.end()
    setTimeout(() => this.socket.destroy(), 1000).unref()
    this.closeWith(fault)
  }

  private closeWith(fault: EdgeFault): void {
    if (this.closed) return
    this.closed = true
    this.handlers.onClose(fault)
  }

  private onData = (chunk: Buffer): void => {
    if (this.closed) return
    this.decoder.push(chunk)
    for (;;) {
      const step = this.decoder.next(this.limits)
      if (step._tag === "NeedMore") break
      if (step._tag === "Fault") return this.fail(step.fault)
      this.handlers.onFrame(step.frame, step.length)
      if (this.closed) return
    }
    this.handlers.onBurstEnd()
  }

  private onEnd = (): void => {
    const truncated = this.decoder.finish()
    this.closeWith(truncated ?? new PeerClosed({ detail: "peer ended the stream" }))
    this.socket.end()
  }

  private onError = (err: Error): void => {
    this.closeWith(new PeerClosed({ detail: `socket error: ${err.message}` }))
  }

  private onSocketClose = (): void => {
    const truncated = this.decoder.finish()
    this.closeWith(truncated ?? new PeerClosed({ detail: "connection closed" }))
  }
}

const netOptions = (address: TransportAddress): Net.NetConnectOpts =>
  address._tag === "Tcp" ? { host: address.host, port: address.port } : { path: address.path }

const validateRing = (ring: RingSpec): RingMismatch | undefined => {
  if (!Framing.isValidAlignment(ring.alignment)) {
    return new RingMismatch({ detail: `alignment ${ring.alignment} is not a power of two in 1..4096` })
  }
  const minimum = Framing.alignUp(Framing.HEADER_BYTES + 16, Framing.effectiveAlignment(ring.alignment)) * 2
  if (!Number.isInteger(ring.dataCapacity) || ring.dataCapacity < minimum || ring.dataCapacity > 0xffff_ffff) {
    return new RingMismatch({ detail: `dataCapacity ${ring.dataCapacity} must be an integer ≥ ${minimum}` })
  }
  return undefined
}

/** Decoder limits on a bound connection: data frames up to the window, control frames up to 2 KiB. */
const boundLimits = (ring: RingSpec): Framing.Limits => ({
  alignment: ring.alignment,
  maxFrameBytes: Math.max(ring.dataCapacity, 2048)
})

const makeLogger = (runtime: Runtime.Runtime<never>) => (message: string) =>
  Runtime.runFork(runtime)(Effect.logWarning(message).pipe(Effect.annotateLogs("module", "DataPlane")))

// ---------------------------------------------------------------------------------------------
// Receiving side
// ---------------------------------------------------------------------------------------------

class Inbound implements ConnHandlers {
  conn: FrameConn | undefined
  private readonly sequencer: Framing.Sequencer
  private ready: Array<DataFrame> = []
  private readyBytes: Array<number> = []
  private unconsumed = 0
  private creditNow = 0
  private creditSequence = 0
  private pending = false
  private signalPending = false
  private waiter: (() => void) | undefined
  failure: EdgeFault | undefined
  readonly faulted = Deferred.unsafeMake<EdgeFault>(FiberId.none)
  readonly attachedDeferred = Deferred.unsafeMake<void, EdgeFault>(FiberId.none)
  private counters = { messages: 0, frames: 0, bytes: 0, signals: 0, wakes: 0, creditFrames: 0, spins: 0, spinHits: 0 }

  constructor(readonly options: RegisterOptions) {
    this.sequencer = new Framing.Sequencer(options.initialSequence ?? 0, options.reassemble ?? true)
  }

  private shm: ShmRing | undefined
  // `drain` hands over a fresh copy of the ring's bytes: payloads may be views of it.
  private readonly shmDecoder = new Framing.StreamDecoder(true)

  attach(conn: FrameConn, shm: ShmRing | undefined): void {
    this.conn = conn
    this.shm = shm
    Deferred.unsafeDone(this.attachedDeferred, Exit.void)
  }

  onFrame(frame: WireFrame, length: number): void {
    const conn = this.conn!
    if (frame._tag === "FaultFrame") {
      return this.setFault(new PeerFaulted({ reason: frame.reason, detail: frame.detail }))
    }
    if (frame._tag === "DoorbellFrame" && this.shm !== undefined) return this.drainShm(conn, this.shm)
    if (frame._tag !== "TokenFrame" && frame._tag !== "ActivationFrame") {
      return conn.fail(new Malformed({ detail: `unexpected ${frame._tag} from a sender` }))
    }
    if (this.shm !== undefined) {
      return conn.fail(new Malformed({ detail: "data frame on the socket of a shared-memory edge" }))
    }
    this.onData(frame, length)
  }

  /** Doorbell: decode every frame in the ring through the same checks as socket frames. */
  private drainShm(conn: FrameConn, shm: ShmRing, stayAwake = false): void {
    const bytes = shm.drain(stayAwake)
    if (bytes === "corrupt") return conn.fail(new Malformed({ detail: "shared-memory ring cursors are corrupt" }))
    if (bytes === undefined) return
    this.shmDecoder.push(bytes)
    for (;;) {
      const step = this.shmDecoder.next(conn.limits)
      if (step._tag === "NeedMore") return
      if (step._tag === "Fault") return conn.fail(step.fault)
      if (step.frame._tag !== "TokenFrame" && step.frame._tag !== "ActivationFrame") {
        return conn.fail(new Malformed({ detail: `unexpected ${step.frame._tag} in the shared-memory ring` }))
      }
      this.onData(step.frame, step.length)
      if (conn.closed) return
    }
  }

  private onData(frame: DataFrame, length: number): void {
    const { edgeId, ring, runId } = this.options
    const conn = this.conn!
    if (frame.runId !== runId) return conn.fail(new UnknownRun({ runId: frame.runId }))
    if (frame.edgeId !== edgeId) return conn.fail(new UnknownEdge({ runId: frame.runId, edgeId: frame.edgeId }))
    if (length > ring.dataCapacity) return conn.fail(new Oversized({ size: length, limit: ring.dataCapacity }))
    this.unconsumed += length
    if (this.unconsumed > ring.dataCapacity) {
      return conn.fail(new WindowExceeded({ outstanding: this.unconsumed, capacity: ring.dataCapacity }))
    }
    this.counters.frames++
    this.counters.bytes += length
    const step = this.sequencer.accept(frame)
    switch (step._tag) {
      case "Fault":
        return conn.fail(step.fault)
      case "Partial":
        this.creditNow += length
        return
      case "Complete":
        this.counters.messages++
        this.ready.push(step.frame)
        this.readyBytes.push(length)
        if (ring.wakeCoalescing === "EveryFrame" || !this.pending) {
          this.pending = true
          this.counters.signals++
          this.signalPending = true
        }
    }
  }

  onBurstEnd(): void {
    if (this.creditNow > 0) {
      const bytes = this.creditNow
      this.creditNow = 0
      this.credit(bytes)
    }
    if (this.signalPending) {
      this.signalPending = false
      this.waiter?.()
    }
  }

  onClose(fault: EdgeFault): void {
    // A shared-memory peer that closed mid-frame left a partial frame in the ring, not the socket.
    const truncated = fault._tag === "PeerClosed" && this.shm !== undefined ? this.shmDecoder.finish() : undefined
    this.setFault(truncated ?? fault)
  }

  setFault(fault: EdgeFault): void {
    if (this.failure !== undefined) return
    this.failure = fault
    Deferred.unsafeDone(this.faulted, Exit.succeed(fault))
    Deferred.unsafeDone(this.attachedDeferred, Exit.fail(fault))
    if (this.conn !== undefined && !this.conn.closed) this.conn.fail(fault)
    this.shm?.close()
    this.waiter?.()
  }

  private credit(bytes: number): void {
    this.unconsumed -= bytes
    const conn = this.conn
    if (conn === undefined || conn.closed) return
    this.counters.creditFrames++
    if (this.shm !== undefined) {
      if (this.shm.addCredit(bytes)) {
        conn.write(Framing.unsafeEncode(
          DoorbellFrame({ runId: this.options.runId, edgeId: this.options.edgeId }),
          this.options.ring.alignment
        ))
      }
      return
    }
    const frame = CreditFrame({
      runId: this.options.runId,
      edgeId: this.options.edgeId,
      sequence: this.creditSequence,
      bytes
    })
    this.creditSequence = (this.creditSequence + 1) >>> 0
    conn.write(Framing.unsafeEncode(frame, this.options.ring.alignment))
  }

  private takeReady(max: number): Array<DataFrame> {
    const n = Math.min(max, this.ready.length)
    const frames = this.ready.splice(0, n)
    const bytes = this.readyBytes.splice(0, n).reduce((a, b) => a + b, 0)
    if (this.ready.length === 0) this.pending = false
    this.counters.wakes++
    this.credit(bytes)
    return frames
  }

  private wait<A>(max: number, f: (frames: Array<DataFrame>) => A): Effect.Effect<A, EdgeFault> {
    return Effect.async<A, EdgeFault>((resume) => {
      const attempt = (): boolean => {
        if (this.ready.length > 0) {
          resume(Effect.succeed(f(this.takeReady(max))))
          return true
        }
        if (this.failure !== undefined) {
          resume(Effect.fail(this.failure))
          return true
        }
        return false
      }
      if (attempt()) return
      if (this.spinShm() && attempt()) return
      this.waiter = () => {
        if (attempt()) this.waiter = undefined
      }
      return Effect.sync(() => {
        this.waiter = undefined
      })
    })
  }

  /**
   * Shared memory with `spinMicros`: poll the ring (staying awake, so the producer skips the
   * doorbell) until a message is ready or the time is up; then clear the pending bit and drain once
   * more, so nothing written before sleeping is missed. True when messages became ready.
   */
  private spinShm(): boolean {
    const shm = this.shm
    const conn = this.conn
    const spin = this.options.spinMicros ?? 0
    if (shm === undefined || conn === undefined || conn.closed || spin <= 0 || this.failure !== undefined) return false
    shm.claimAwake()
    this.counters.spins++
    const deadline = performance.now() + spin / 1000
    while (this.ready.length === 0 && !conn.closed && performance.now() < deadline) {
      if (shm.used > 0) {
        this.drainShm(conn, shm, true)
        this.flushPartialCredit()
      }
    }
    if (this.ready.length > 0) this.counters.spinHits++
    if (!conn.closed) this.drainShm(conn, shm, false)
    this.signalPending = false
    this.flushPartialCredit()
    return this.ready.length > 0 || this.failure !== undefined
  }

  private flushPartialCredit(): void {
    if (this.creditNow > 0) {
      const bytes = this.creditNow
      this.creditNow = 0
      this.credit(bytes)
    }
  }

  readonly receive: Effect.Effect<ReadonlyArray<DataFrame>, EdgeFault> = Effect.suspend(() =>
    this.wait(this.options.ring.wakeCoalescing === "PendingBit" ? Number.MAX_SAFE_INTEGER : 1, (frames) => frames)
  )

  readonly take: Effect.Effect<DataFrame, EdgeFault> = Effect.suspend(() => this.wait(1, (frames) => frames[0]!))

  readonly stats: Effect.Effect<ReceiverStats> = Effect.sync(() => ({
    ...this.counters,
    unconsumedBytes: this.unconsumed
  }))
}

/**
 * Listen for data-plane connections. Every connection must pass the HMAC handshake, then attach to
 * an edge registered here; everything else is refused and logged. Closed with the scope.
 */
export const listen = (options: ListenOptions): Effect.Effect<DataPlaneListener, ListenFailed, Scope.Scope> =>
  Effect.gen(function*() {
    const runtime = yield* Effect.runtime<never>()
    const log = makeLogger(runtime)
    const requested = options.address ?? { _tag: "Tcp", host: "127.0.0.1", port: 0 }
    const runs = new Map<number, Map<number, Inbound>>()
    const sockets = new Set<Net.Socket>()
    const attachTimeout = Duration.toMillis(options.attachTimeout ?? "5 seconds")

    const onAttach = (conn: FrameConn, frame: AttachFrame): void => {
      const edges = runs.get(frame.runId)
      const inbound = edges?.get(frame.edgeId)
      conn.bind(frame.runId, frame.edgeId)
      if (edges === undefined) return conn.fail(new UnknownRun({ runId: frame.runId }))
      if (inbound === undefined) return conn.fail(new UnknownEdge({ runId: frame.runId, edgeId: frame.edgeId }))
      if (inbound.conn !== undefined || inbound.failure !== undefined) {
        return conn.fail(new EdgeBusy({ runId: frame.runId, edgeId: frame.edgeId }))
      }
      const ring = inbound.options.ring
      if (
        frame.dataCapacity !== ring.dataCapacity || frame.alignment !== ring.alignment ||
        frame.wakeCoalescing !== ring.wakeCoalescing
      ) {
        return conn.fail(
          new RingMismatch({
            detail: `sender ring (${frame.dataCapacity} B, align ${frame.alignment}, ${frame.wakeCoalescing}) ≠ ` +
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
      inbound.attach(conn, shm)
    }

    const onConnection = (socket: Net.Socket): void => {
      sockets.add(socket)
      socket.on("close", () => sockets.delete(socket))
      socket.on("error", () => {})
      if (requested._tag === "Tcp") socket.setNoDelay(true)
      Runtime.runCallback(runtime)(serverHandshake(socket, { token: options.token, timeout: options.handshakeTimeout }), {
        onExit: (exit) => {
          if (Exit.isFailure(exit)) {
            log(`data-plane connection from ${socket.remoteAddress ?? "unix socket"} refused: authentication failed`)
            socket.destroy()
            return
          }
          const timer = setTimeout(() => conn.fail(new Malformed({ detail: "no AttachFrame in time" })), attachTimeout)
          timer.unref()
          const conn: FrameConn = new FrameConn(socket, Framing.preAttachLimits, {
            onFrame: (frame) => {
              clearTimeout(timer)
              if (frame._tag === "AttachFrame") return onAttach(conn, frame)
              conn.bind(frame.runId, frame.edgeId)
              if (!runs.has(frame.runId)) return conn.fail(new UnknownRun({ runId: frame.runId }))
              if (!runs.get(frame.runId)!.has(frame.edgeId)) {
                return conn.fail(new UnknownEdge({ runId: frame.runId, edgeId: frame.edgeId }))
              }
              conn.fail(new Malformed({ detail: `expected AttachFrame, got ${frame._tag}` }))
            },
            onBurstEnd: () => {},
            onClose: () => clearTimeout(timer)
          }, { runId: 0, edgeId: 0 }, log)
          conn.start()
        }
      })
    }

    const server = yield* Effect.acquireRelease(
      Effect.async<Net.Server, ListenFailed>((resume) => {
        const server = Net.createServer({ pauseOnConnect: true }, onConnection)
        const onError = (err: Error) =>
          resume(Effect.fail(new ListenFailed({ address: requested, detail: err.message })))
        server.once("error", onError)
        server.listen(netOptions(requested), () => {
          server.off("error", onError)
          server.on("error", (err) => log(`data-plane listener error: ${err.message}`))
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
    const address: TransportAddress = typeof bound === "string"
      ? { _tag: "Unix", path: bound }
      : bound === null
      ? requested
      : { _tag: "Tcp", host: bound.address, port: bound.port }

    const unregister = (inbound: Inbound) =>
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

    const register = (reg: RegisterOptions): Effect.Effect<EdgeReceiver, EdgeBusy | RingMismatch, Scope.Scope> =>
      Effect.gen(function*() {
        const invalid = validateRing(reg.ring)
        if (invalid !== undefined) return yield* invalid
        const edges = runs.get(reg.runId) ?? new Map<number, Inbound>()
        if (edges.has(reg.edgeId)) return yield* new EdgeBusy({ runId: reg.runId, edgeId: reg.edgeId })
        const inbound = new Inbound(reg)
        edges.set(reg.edgeId, inbound)
        runs.set(reg.runId, edges)
        yield* Effect.addFinalizer(() => unregister(inbound))
        const receiver: EdgeReceiver = {
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

    const listener: DataPlaneListener = {
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
export class DataPlaneNode extends Context.Tag("swactor/DataPlaneNode")<DataPlaneNode, DataPlaneListener>() {}

/** `listen` as a layer: the listener lives as long as the layer. */
export const layer = (options: ListenOptions): Layer.Layer<DataPlaneNode, ListenFailed> =>
  Layer.scoped(DataPlaneNode, listen(options))

// ---------------------------------------------------------------------------------------------
// Sending side
// ---------------------------------------------------------------------------------------------

/** A chunk checked for the wire, with its encoded length (encoding waits until it has window). */
interface EncodedChunk {
  readonly frame: DataFrame
  readonly length: number
}

class Outbound implements ConnHandlers {
  private outstanding = 0
  private windowWaiter: (() => void) | undefined
  failure: EdgeFault | undefined
  readonly faulted = Deferred.unsafeMake<EdgeFault>(FiberId.none)
  private counters = { frames: 0, bytes: 0, maxOutstandingBytes: 0, windowWaits: 0, creditFrames: 0 }

  private readonly doorbell: Uint8Array

  constructor(readonly conn: FrameConn, readonly options: ConnectOptions, readonly shm: ShmRing | undefined) {
    this.doorbell = Framing.unsafeEncode(DoorbellFrame({ runId: options.runId, edgeId: options.edgeId }), options.ring.alignment)
  }

  onFrame(frame: WireFrame): void {
    if (frame._tag === "FaultFrame") return this.setFault(new PeerFaulted({ reason: frame.reason, detail: frame.detail }))
    if (frame._tag === "DoorbellFrame" && this.shm !== undefined) return // credits are in the ring: onBurstEnd re-checks
    if (frame._tag !== "CreditFrame") {
      return this.conn.fail(new Malformed({ detail: `unexpected ${frame._tag} from a receiver` }))
    }
    if (frame.runId !== this.options.runId || frame.edgeId !== this.options.edgeId) {
      return this.conn.fail(new UnknownEdge({ runId: frame.runId, edgeId: frame.edgeId }))
    }
    if (frame.bytes > this.outstanding) {
      return this.conn.fail(new Malformed({ detail: `credit of ${frame.bytes} B exceeds ${this.outstanding} B outstanding` }))
    }
    this.counters.creditFrames++
    this.outstanding -= frame.bytes
  }

  onBurstEnd(): void {
    this.windowWaiter?.()
  }

  onClose(fault: EdgeFault): void {
    this.setFault(fault)
  }

  setFault(fault: EdgeFault): void {
    if (this.failure !== undefined) return
    this.failure = fault
    Deferred.unsafeDone(this.faulted, Exit.succeed(fault))
    if (!this.conn.closed) this.conn.fail(fault)
    this.shm?.close()
    this.windowWaiter?.()
  }

  private lastCredited = 0

  /** Shared memory: take the credits the consumer published in the ring. */
  private refreshCredits(): void {
    const shm = this.shm
    if (shm === undefined) return
    const credited = shm.credited
    const delta = (credited - this.lastCredited) >>> 0
    if (delta === 0) return
    if (delta > this.outstanding) {
      return this.conn.fail(new Malformed({ detail: `credit of ${delta} B exceeds ${this.outstanding} B outstanding` }))
    }
    this.lastCredited = credited
    this.outstanding -= delta
    this.counters.creditFrames++
  }

  private fits(length: number): boolean {
    this.refreshCredits()
    if (this.outstanding + length <= this.options.ring.dataCapacity) return true
    if (this.shm === undefined) return false
    // Say we wait, then look again: the consumer either sees the flag or we see its credit.
    this.shm.setProducerWaiting()
    this.refreshCredits()
    return this.outstanding + length <= this.options.ring.dataCapacity
  }

  private put(chunk: EncodedChunk): void {
    const length = chunk.length
    this.outstanding += length
    if (this.outstanding > this.counters.maxOutstandingBytes) this.counters.maxOutstandingBytes = this.outstanding
    this.counters.frames++
    this.counters.bytes += length
    const shm = this.shm
    const alignment = this.options.ring.alignment
    if (shm === undefined) return this.conn.write(Framing.unsafeEncode(chunk.frame, alignment))
    // Encoded straight into the ring: the payload is copied once on this side.
    if (!shm.writeWith(length, (slot) => Framing.encodeInto(chunk.frame, alignment, slot))) {
      return this.conn.fail(new WindowExceeded({ outstanding: shm.used + length, capacity: shm.capacity }))
    }
    if (shm.raisePending() || this.options.ring.wakeCoalescing === "EveryFrame") this.conn.write(this.doorbell)
  }

  /** Wait until `length` more bytes fit the window (or the edge faults). */
  private awaitWindow(length: number): Effect.Effect<void, EdgeFault> {
    return Effect.async<void, EdgeFault>((resume) => {
      this.counters.windowWaits++
      const attempt = (): boolean => {
        if (this.failure !== undefined) {
          resume(Effect.fail(this.failure))
          return true
        }
        if (this.fits(length)) {
          resume(Effect.void)
          return true
        }
        return false
      }
      if (attempt()) return
      this.windowWaiter = () => {
        if (attempt()) this.windowWaiter = undefined
      }
      return Effect.sync(() => {
        this.windowWaiter = undefined
      })
    })
  }

  /** Checks the frame and splits it into chunks that fit the window; each is encoded when it is put. */
  private encodeAll(frame: DataFrame): Either.Either<ReadonlyArray<EncodedChunk>, EdgeFault> {
    const { alignment, dataCapacity } = this.options.ring
    if (frame.runId !== this.options.runId || frame.edgeId !== this.options.edgeId) {
      return Either.left(new UnknownEdge({ runId: frame.runId, edgeId: frame.edgeId }))
    }
    return Either.map(Framing.chunk(frame, dataCapacity, alignment), (chunks) =>
      chunks.map((c) => ({ frame: c, length: Framing.encodedLength(c, alignment) })))
  }

  private sendEncoded(encoded: ReadonlyArray<EncodedChunk>): Effect.Effect<void, EdgeFault> {
    let i = 0
    const loop: Effect.Effect<void, EdgeFault> = Effect.suspend(() => {
      for (; i < encoded.length; i++) {
        if (this.failure !== undefined) return Effect.fail(this.failure)
        const chunk = encoded[i]!
        if (!this.fits(chunk.length)) {
          this.conn.socket.uncork()
          return Effect.zipRight(this.awaitWindow(chunk.length), loop)
        }
        this.put(chunk)
      }
      return Effect.void
    })
    return loop
  }

  readonly send = (frame: DataFrame): Effect.Effect<void, EdgeFault> =>
    Effect.suspend(() => {
      if (this.failure !== undefined) return Effect.fail(this.failure)
      const encoded = this.encodeAll(frame)
      if (Either.isLeft(encoded)) return Effect.fail(encoded.left)
      return this.sendEncoded(encoded.right)
    })

  readonly sendAll = (frames: Iterable<DataFrame>): Effect.Effect<void, EdgeFault> =>
    Effect.suspend(() => {
      if (this.failure !== undefined) return Effect.fail(this.failure)
      const encoded: Array<EncodedChunk> = []
      for (const frame of frames) {
        const e = this.encodeAll(frame)
        if (Either.isLeft(e)) return Effect.fail(e.left)
        encoded.push(...e.right)
      }
      this.conn.socket.cork()
      return Effect.ensuring(this.sendEncoded(encoded), Effect.sync(() => this.conn.socket.uncork()))
    })

  readonly stats: Effect.Effect<SenderStats> = Effect.sync(() => {
    this.refreshCredits()
    return { ...this.counters, outstandingBytes: this.outstanding }
  })
}

/**
 * Open the sending end of an edge: connect, authenticate (mutual HMAC), attach to the receiver
 * registered for `(runId, edgeId)` at `address`. Fails with `ConnectFailed`, `AuthFailed`, or the
 * receiver's refusal as `PeerFaulted` (reason `UnknownRun`, `UnknownEdge`, `RingMismatch`,
 * `EdgeBusy`). The stream is ended gracefully when the scope closes.
 */
export const connect = (options: ConnectOptions): Effect.Effect<EdgeSender, EdgeFault, Scope.Scope> =>
  Effect.gen(function*() {
    const invalid = validateRing(options.ring)
    if (invalid !== undefined) return yield* invalid
    const runtime = yield* Effect.runtime<never>()
    const log = makeLogger(runtime)
    let shm: ShmRing | undefined
    if (options.sharedMemory === true) {
      if (options.address._tag !== "Unix") {
        return yield* new ConnectFailed({ detail: "shared memory needs a Unix-socket address (same host)" })
      }
      shm = yield* Effect.acquireRelease(
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
    }
    const socket = yield* Effect.acquireRelease(
      Effect.async<Net.Socket, ConnectFailed>((resume) => {
        const socket = Net.createConnection(netOptions(options.address))
        const onError = (err: Error) => resume(Effect.fail(new ConnectFailed({ detail: err.message })))
        socket.once("error", onError)
        socket.once("connect", () => {
          socket.off("error", onError)
          socket.on("error", () => {})
          if (options.address._tag === "Tcp") socket.setNoDelay(true)
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
    const outbound = yield* Effect.gen(function*() {
      yield* clientHandshake(socket, { token: options.token })
      return yield* Effect.async<Outbound, EdgeFault>((resume) => {
        const ids = { runId: options.runId as number, edgeId: options.edgeId as number }
        const conn: FrameConn = new FrameConn(socket, Framing.preAttachLimits, {
          onFrame: (frame) => {
            if (frame._tag === "AttachedFrame" && frame.runId === options.runId && frame.edgeId === options.edgeId) {
              shm?.unlink()
              const outbound = new Outbound(conn, options, shm)
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
        }, ids, log)
        conn.start()
        const { alignment, dataCapacity, wakeCoalescing } = options.ring
        conn.write(Framing.unsafeEncode(
          AttachFrame({
            runId: options.runId,
            edgeId: options.edgeId,
            dataCapacity,
            alignment,
            wakeCoalescing,
            sharedMemory: shm?.path ?? ""
          }),
          8
        ))
      })
    }).pipe(
      Effect.timeoutFail({
        duration: options.timeout ?? "10 seconds",
        onTimeout: () => new ConnectFailed({ detail: "timed out connecting the edge" })
      }),
      Effect.tapError(() => Effect.sync(() => socket.destroy()))
    )
    const close = Effect.sync(() => outbound.conn.end(new EdgeClosed()))
    yield* Effect.addFinalizer(() => close)
    const sender: EdgeSender = {
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
