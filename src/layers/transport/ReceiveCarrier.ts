/**
 * How data frames reach a receiving edge core, and how its credits go back. The core owns the checks, the window,
 * the order and the hand-over; a carrier only brings frames in and takes credits out:
 * - `socketReceiveCarrier`: frames come on the authenticated socket (FramedSocket.ts decodes them); credits go back
 *   as CreditFrames.
 * - `sharedMemoryReceiveCarrier`: a doorbell on the socket says frames are in the /dev/shm ring (ShmRing.ts); they
 *   are decoded in place (an activation's payload is a view of the ring: no copy on this side) through the same
 *   stream decoder and checks; credits are a counter in the ring, with a doorbell when the producer waits for them.
 *   It can also busy-poll the ring instead of sleeping on the doorbell.
 */
import { CreditFrame, type DataFrame, DoorbellFrame, Malformed, type Truncated } from "../../domain/frames.js"
import type { EdgeId, RunId } from "../../domain/ids.js"
import type { RingSpec } from "../../domain/plan.js"
import type { FrameConn } from "./FramedSocket.js"
import * as Framing from "./Framing.js"
import type { ShmRing } from "./ShmRing.js"
import { markBurst } from "./WireClock.js"

/** What a carrier hands frames to: the core's checks, window and sequencing. */
export interface ReceiveSink {
  readonly onData: (frame: DataFrame, length: number) => void
}

export interface ReceiveCarrier {
  /** Whether data frames may come on the socket itself (not on a shared-memory edge). */
  readonly dataOnSocket: boolean
  /**
   * Whether payloads are lent: views of the carrier's memory that stay intact only until their bytes are credited
   * back (the core credits a frame when its consumer asks for the next one).
   */
  readonly lendsPayload: boolean
  /** Whether a DoorbellFrame is expected: it means frames wait in the carrier. */
  readonly expectsDoorbells: boolean
  /** Hand every frame waiting in the carrier to the sink; `stayAwake` keeps the producer from ringing. */
  readonly drain: (stayAwake: boolean) => void
  /** Whether `spin` can poll this carrier. */
  readonly canSpin: boolean
  /** Poll the carrier for `micros` µs or until `done()`, calling `afterDrain` after each drain that found bytes. */
  readonly spin: (micros: number, done: () => boolean, afterDrain: () => void) => void
  /** Give `bytes` of window back to the sender. */
  readonly credit: (bytes: number) => void
  /** The peer closed: the partial frame left inside the carrier, if any. */
  readonly finish: () => Truncated | undefined
  readonly close: () => void
}

interface EdgeIds {
  readonly runId: RunId
  readonly edgeId: EdgeId
  readonly ring: RingSpec
}

export const socketReceiveCarrier = (conn: FrameConn, edge: EdgeIds): ReceiveCarrier => {
  let creditStep = 0
  return {
    dataOnSocket: true,
    lendsPayload: false,
    expectsDoorbells: false,
    drain: () => {},
    canSpin: false,
    spin: () => {},
    credit: (bytes) => {
      const frame = CreditFrame({ runId: edge.runId, edgeId: edge.edgeId, step: creditStep, bytes })
      creditStep = (creditStep + 1) >>> 0
      conn.write(Framing.unsafeEncode(frame, edge.ring.alignment))
    },
    finish: () => undefined,
    close: () => {}
  }
}

export const sharedMemoryReceiveCarrier = (
  conn: FrameConn,
  shm: ShmRing,
  edge: EdgeIds,
  sink: ReceiveSink
): ReceiveCarrier => {
  // The ring's bytes are decoded in place: payloads are views of the ring, intact until credited back (a frame
  // that wraps around the ring's end is joined into a copy by the decoder).
  const decoder = new Framing.StreamDecoder(true)
  const drain = (stayAwake: boolean): void => {
    const views = shm.drainViews(stayAwake)
    if (views === "corrupt") return conn.fail(new Malformed({ detail: "shared-memory ring cursors are corrupt" }))
    if (views === undefined) return
    markBurst()
    for (const bytes of views) {
      decoder.push(bytes)
      for (;;) {
        const step = decoder.next(conn.limits)
        if (step._tag === "NeedMore") break
        if (step._tag === "Fault") return conn.fail(step.fault)
        if (step.frame._tag !== "TokenFrame" && step.frame._tag !== "ActivationFrame") {
          return conn.fail(new Malformed({ detail: `unexpected ${step.frame._tag} in the shared-memory ring` }))
        }
        sink.onData(step.frame, step.length)
        if (conn.closed) return
      }
    }
  }
  return {
    dataOnSocket: false,
    lendsPayload: true,
    expectsDoorbells: true,
    drain,
    canSpin: true,
    spin: (micros, done, afterDrain) => {
      shm.claimAwake()
      const deadline = performance.now() + micros / 1000
      while (!done() && !conn.closed && performance.now() < deadline) {
        if (shm.used > 0) {
          drain(true)
          afterDrain()
        }
      }
    },
    credit: (bytes) => {
      if (shm.addCredit(bytes)) {
        conn.write(Framing.unsafeEncode(DoorbellFrame({ runId: edge.runId, edgeId: edge.edgeId }), edge.ring.alignment))
      }
    },
    finish: () => decoder.finish(),
    close: () => shm.close()
  }
}
