/**
 * The sending core of one edge: splits a message into chunks that fit the window, waits while the window is
 * full, and takes credits back (CreditFrames on a socket, the ring's counter with shared memory); each chunk is
 * encoded onto the socket or straight into the shared-memory ring.
 */
import { Deferred, Effect, Either, Exit, FiberId } from "effect"
import {
  type DataFrame,
  type EdgeFault,
  Malformed,
  PeerFaulted,
  UnknownEdge,
  type WireFrame
} from "../../domain/frames.js"
import type { ConnectOptions, SenderStats } from "./Edge.js"
import type { ConnHandlers, FrameConn } from "./FramedSocket.js"
import * as Framing from "./Framing.js"
import type { SendCarrier } from "./SendCarrier.js"

/** A chunk checked for the wire, with its encoded length (encoding waits until it has window). */
interface EncodedChunk {
  readonly frame: DataFrame
  readonly length: number
}

export class OutboundCore implements ConnHandlers {
  private outstanding = 0
  private windowWaiter: (() => void) | undefined
  failure: EdgeFault | undefined
  readonly faulted = Deferred.unsafeMake<EdgeFault>(FiberId.none)
  private counters = { frames: 0, bytes: 0, maxOutstandingBytes: 0, windowWaits: 0, creditFrames: 0 }

  constructor(
    readonly conn: FrameConn,
    readonly options: ConnectOptions,
    readonly carrier: SendCarrier
  ) {}

  onFrame(frame: WireFrame): void {
    if (frame._tag === "FaultFrame")
      return this.setFault(new PeerFaulted({ reason: frame.reason, detail: frame.detail }))
    if (frame._tag === "DoorbellFrame" && this.carrier.expectsDoorbells) return // credits are in the carrier: onBurstEnd re-checks
    if (frame._tag !== "CreditFrame") {
      return this.conn.fail(new Malformed({ detail: `unexpected ${frame._tag} from a receiver` }))
    }
    if (frame.runId !== this.options.runId || frame.edgeId !== this.options.edgeId) {
      return this.conn.fail(new UnknownEdge({ runId: frame.runId, edgeId: frame.edgeId }))
    }
    if (frame.bytes > this.outstanding) {
      return this.conn.fail(
        new Malformed({ detail: `credit of ${frame.bytes} B exceeds ${this.outstanding} B outstanding` })
      )
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
    this.carrier.close()
    this.windowWaiter?.()
  }

  /** Take the credits that came through the carrier (shared memory publishes them in the ring). */
  private refreshCredits(): void {
    const delta = this.carrier.takeCredits()
    if (delta === 0) return
    if (delta > this.outstanding) {
      return this.conn.fail(new Malformed({ detail: `credit of ${delta} B exceeds ${this.outstanding} B outstanding` }))
    }
    this.outstanding -= delta
    this.counters.creditFrames++
  }

  private fits(length: number): boolean {
    this.refreshCredits()
    if (this.outstanding + length <= this.options.ring.dataCapacity) return true
    if (!this.carrier.announceWaiting()) return false
    this.refreshCredits()
    return this.outstanding + length <= this.options.ring.dataCapacity
  }

  private put(chunk: EncodedChunk): void {
    const length = chunk.length
    this.outstanding += length
    if (this.outstanding > this.counters.maxOutstandingBytes) this.counters.maxOutstandingBytes = this.outstanding
    this.counters.frames++
    this.counters.bytes += length
    const fault = this.carrier.put(chunk.frame, length)
    if (fault !== undefined) this.conn.fail(fault)
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
      chunks.map((c) => ({ frame: c, length: Framing.encodedLength(c, alignment) }))
    )
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
      return Effect.ensuring(
        this.sendEncoded(encoded),
        Effect.sync(() => this.conn.socket.uncork())
      )
    })

  readonly stats: Effect.Effect<SenderStats> = Effect.sync(() => {
    this.refreshCredits()
    return { ...this.counters, outstandingBytes: this.outstanding }
  })
}
