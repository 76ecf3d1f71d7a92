/**
 * How a sending edge core puts its frames on their way. The core owns the window, the credits and the order; a
 * carrier only moves encoded frames and reports credits that come through itself:
 * - `socketSendCarrier`: frames go on the authenticated socket; credits come back as CreditFrames on it.
 * - `sharedMemorySendCarrier`: frames are encoded straight into the /dev/shm ring (ShmRing.ts), the socket carries
 *   a doorbell when the consumer must be woken; credits are a counter in the ring.
 */
import { type DataFrame, DoorbellFrame, type EdgeFault, WindowExceeded } from "../../domain/frames.js"
import type { EdgeId, RunId } from "../../domain/ids.js"
import type { RingSpec } from "../../domain/plan.js"
import type { FrameConn } from "./FramedSocket.js"
import * as Framing from "./Framing.js"
import type { ShmRing } from "./ShmRing.js"
import { noteEncoded } from "./WireClock.js"

export interface SendCarrier {
  /** Put one chunk (`length` bytes encoded); a fault when the carrier has no room for it. */
  readonly put: (frame: DataFrame, length: number) => EdgeFault | undefined
  /** Bytes credited through the carrier itself since the last call (never any on a socket). */
  readonly takeCredits: () => number
  /** The core is about to wait for window: true when credits may still arrive through the carrier, so look again. */
  readonly announceWaiting: () => boolean
  /** Whether a DoorbellFrame from the receiver is expected (it means: credits are in the carrier). */
  readonly expectsDoorbells: boolean
  readonly close: () => void
}

export const socketSendCarrier = (conn: FrameConn, alignment: number): SendCarrier => ({
  put: (frame) => {
    const started = performance.now()
    const bytes = Framing.unsafeEncode(frame, alignment)
    const encoded = performance.now()
    noteEncoded(encoded - started, encoded)
    conn.write(bytes)
    return undefined
  },
  takeCredits: () => 0,
  announceWaiting: () => false,
  expectsDoorbells: false,
  close: () => {}
})

export const sharedMemorySendCarrier = (
  conn: FrameConn,
  shm: ShmRing,
  edge: { readonly runId: RunId; readonly edgeId: EdgeId; readonly ring: RingSpec }
): SendCarrier => {
  const { alignment, wakeCoalescing } = edge.ring
  const doorbell = Framing.unsafeEncode(DoorbellFrame({ runId: edge.runId, edgeId: edge.edgeId }), alignment)
  let lastCredited = 0
  return {
    put: (frame, length) => {
      // Encoded straight into the ring: the payload is copied once on this side.
      const started = performance.now()
      const written = shm.writeWith(length, (slot) => Framing.encodeInto(frame, alignment, slot))
      // published in the ring: a consumer that polls may take it from now on (others after the doorbell)
      const published = performance.now()
      noteEncoded(published - started, published)
      if (!written) return new WindowExceeded({ outstanding: shm.used + length, capacity: shm.capacity })
      if (shm.raisePending() || wakeCoalescing === "EveryFrame") conn.write(doorbell)
      return undefined
    },
    takeCredits: () => {
      const credited = shm.credited
      const delta = (credited - lastCredited) >>> 0
      lastCredited = credited
      return delta
    },
    announceWaiting: () => {
      // Say we wait, then look again: the consumer either sees the flag or we see its credit.
      shm.setProducerWaiting()
      return true
    },
    expectsDoorbells: true,
    close: () => shm.close()
  }
}
