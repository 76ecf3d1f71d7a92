/**
 * The receiving core of one edge: checks every data frame against the attached run and edge, the window
 * (`dataCapacity`) and the order (`Sequencer.ts`), reassembles chunks, hands messages over per the ring's
 * wake coalescing, and credits consumed bytes back, as CreditFrames on a socket or through the shared-memory ring.
 *
 * A carrier that lends payloads (shared memory: views of the ring) has a frame's bytes credited back only when its
 * consumer asks for the next frame (`receive` / `take`): a frame's payload is valid until then. Chunks of a message
 * that is reassembled here are copied as they come, since they are credited before the message is complete.
 */
import { Deferred, Effect, Exit, FiberId } from "effect"
import {
  type DataFrame,
  type EdgeFault,
  Malformed,
  Oversized,
  PeerFaulted,
  UnknownEdge,
  UnknownRun,
  WindowExceeded,
  type WireFrame
} from "../../domain/frames.js"
import type { ReceiverStats, RegisterOptions } from "./Edge.js"
import type { ConnHandlers, FrameConn } from "./FramedSocket.js"
import type { ReceiveCarrier } from "./ReceiveCarrier.js"
import { Sequencer } from "./Sequencer.js"
import { stampArrival } from "./WireClock.js"

export class InboundCore implements ConnHandlers {
  conn: FrameConn | undefined
  private readonly sequencer: Sequencer
  private ready: Array<DataFrame> = []
  private readyBytes: Array<number> = []
  private unconsumed = 0
  private creditNow = 0
  /** Bytes of frames handed to the consumer whose payloads may still be in use (lending carriers only). */
  private lent = 0
  private pending = false
  private signalPending = false
  private waiter: (() => void) | undefined
  failure: EdgeFault | undefined
  readonly faulted = Deferred.unsafeMake<EdgeFault>(FiberId.none)
  readonly attachedDeferred = Deferred.unsafeMake<void, EdgeFault>(FiberId.none)
  private counters = { messages: 0, frames: 0, bytes: 0, signals: 0, wakes: 0, creditFrames: 0, spins: 0, spinHits: 0 }

  constructor(readonly options: RegisterOptions) {
    this.sequencer = new Sequencer(options.initialStep ?? 0, options.reassemble ?? true)
  }

  private carrier: ReceiveCarrier | undefined

  attach(conn: FrameConn, carrier: ReceiveCarrier): void {
    this.conn = conn
    this.carrier = carrier
    Deferred.unsafeDone(this.attachedDeferred, Exit.void)
  }

  onFrame(frame: WireFrame, length: number): void {
    const conn = this.conn!
    if (frame._tag === "FaultFrame") {
      return this.setFault(new PeerFaulted({ reason: frame.reason, detail: frame.detail }))
    }
    if (frame._tag === "DoorbellFrame" && this.carrier?.expectsDoorbells === true) return this.carrier.drain(false)
    if (frame._tag !== "TokenFrame" && frame._tag !== "ActivationFrame") {
      return conn.fail(new Malformed({ detail: `unexpected ${frame._tag} from a sender` }))
    }
    if (this.carrier?.dataOnSocket === false) {
      return conn.fail(new Malformed({ detail: "data frame on the socket of a shared-memory edge" }))
    }
    this.onData(frame, length)
  }

  readonly onData = (frame: DataFrame, length: number): void => {
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
    const owned =
      this.carrier?.lendsPayload === true &&
      frame.chunkCount > 1 &&
      frame._tag === "ActivationFrame" &&
      (this.options.reassemble ?? true)
        ? { ...frame, payload: frame.payload.slice() }
        : frame
    const step = this.sequencer.accept(owned)
    switch (step._tag) {
      case "Fault":
        return conn.fail(step.fault)
      case "Partial":
        this.creditNow += length
        return
      case "Complete":
        stampArrival(step.frame)
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
    const truncated = fault._tag === "PeerClosed" ? this.carrier?.finish() : undefined
    this.setFault(truncated ?? fault)
  }

  setFault(fault: EdgeFault): void {
    if (this.failure !== undefined) return
    this.failure = fault
    Deferred.unsafeDone(this.faulted, Exit.succeed(fault))
    Deferred.unsafeDone(this.attachedDeferred, Exit.fail(fault))
    if (this.conn !== undefined && !this.conn.closed) this.conn.fail(fault)
    this.carrier?.close()
    this.waiter?.()
  }

  private credit(bytes: number): void {
    this.unconsumed -= bytes
    const conn = this.conn
    if (conn === undefined || conn.closed || this.carrier === undefined) return
    this.counters.creditFrames++
    this.carrier.credit(bytes)
  }

  private takeReady(max: number): Array<DataFrame> {
    const n = Math.min(max, this.ready.length)
    const frames = this.ready.splice(0, n)
    const bytes = this.readyBytes.splice(0, n).reduce((a, b) => a + b, 0)
    if (this.ready.length === 0) this.pending = false
    this.counters.wakes++
    if (this.carrier?.lendsPayload === true) this.lent += bytes
    else this.credit(bytes)
    return frames
  }

  /** The consumer asks for more: what it was lent before is free again. */
  private returnLent(): void {
    if (this.lent > 0) {
      const bytes = this.lent
      this.lent = 0
      this.credit(bytes)
    }
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
    const carrier = this.carrier
    const conn = this.conn
    const spin = this.options.spinMicros ?? 0
    if (carrier === undefined || !carrier.canSpin || conn === undefined || conn.closed || spin <= 0) return false
    if (this.failure !== undefined) return false
    this.counters.spins++
    carrier.spin(
      spin,
      () => this.ready.length > 0,
      () => this.flushPartialCredit()
    )
    if (this.ready.length > 0) this.counters.spinHits++
    if (!conn.closed) carrier.drain(false)
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

  readonly receive: Effect.Effect<ReadonlyArray<DataFrame>, EdgeFault> = Effect.suspend(() => {
    this.returnLent()
    return this.wait(
      this.options.ring.wakeCoalescing === "PendingBit" ? Number.MAX_SAFE_INTEGER : 1,
      (frames) => frames
    )
  })

  readonly take: Effect.Effect<DataFrame, EdgeFault> = Effect.suspend(() => {
    this.returnLent()
    return this.wait(1, (frames) => frames[0]!)
  })

  readonly stats: Effect.Effect<ReceiverStats> = Effect.sync(() => ({
    ...this.counters,
    unconsumedBytes: this.unconsumed
  }))
}
