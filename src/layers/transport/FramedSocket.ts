/**
 * The socket carrier of the data plane: a frame-level view of an authenticated socket (`FrameConn` decodes each
 * burst of bytes into frames for its handlers, writes encoded frames, and faults with a `FaultFrame` to the peer),
 * and the checks and limits every edge shares.
 */
import type * as Net from "node:net"
import { Effect, Runtime } from "effect"
import { alignUp } from "../../domain/plan.js"
import {
  describeFault,
  type EdgeFault,
  FaultFrame,
  PeerClosed,
  RingMismatch,
  type WireFrame
} from "../../domain/frames.js"
import type { EdgeId, RunId } from "../../domain/ids.js"
import type { RingSpec } from "../../domain/plan.js"
import * as Framing from "./Framing.js"
import { markBurst } from "./WireClock.js"

/** Frame handlers of a connection: the edge core that owns it once it is attached. */
export interface ConnHandlers {
  /** One decoded frame. May call `conn.fail`. */
  onFrame(frame: WireFrame, length: number): void
  /** End of one batch of bytes from the socket (a burst). */
  onBurstEnd(): void
  /** The connection is gone, with the reason. Called once. */
  onClose(fault: EdgeFault): void
}

/** Frame-level view of a socket: decodes each `data` event completely, then `onBurstEnd`. */
export class FrameConn {
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
    markBurst()
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

export const validateRing = (ring: RingSpec): RingMismatch | undefined => {
  if (!Framing.isValidAlignment(ring.alignment)) {
    return new RingMismatch({ detail: `alignment ${ring.alignment} is not a power of two in 1..4096` })
  }
  const minimum = alignUp(Framing.HEADER_BYTES + 16, Framing.effectiveAlignment(ring.alignment)) * 2
  if (!Number.isInteger(ring.dataCapacity) || ring.dataCapacity < minimum || ring.dataCapacity > 0xffff_ffff) {
    return new RingMismatch({ detail: `dataCapacity ${ring.dataCapacity} must be an integer ≥ ${minimum}` })
  }
  return undefined
}

/** Decoder limits on a bound connection: data frames up to the window, control frames up to 2 KiB. */
export const boundLimits = (ring: RingSpec): Framing.Limits => ({
  alignment: ring.alignment,
  maxFrameBytes: Math.max(ring.dataCapacity, 2048)
})

export const makeLogger =
  (runtime: Runtime.Runtime<never>, level: "Warning" | "Debug" = "Warning") =>
  (message: string) =>
    Runtime.runFork(runtime)(
      (level === "Warning" ? Effect.logWarning(message) : Effect.logDebug(message)).pipe(
        Effect.annotateLogs("module", "DataPlane")
      )
    )
