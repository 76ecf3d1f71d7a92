/**
 * The data plane's public shapes: the two ends of an edge (`InboundEdge`, `OutboundEdge`), their counters, the
 * listener that edges register on, and the options of `listen` / `connect` (EdgeTransport.ts tells the protocol).
 */
import { Data, type Duration, type Effect, type Scope } from "effect"
import type { DataFrame, EdgeBusy, EdgeFault, RingMismatch, TransportAddress } from "../../domain/frames.js"
import type { EdgeId, RunId } from "../../domain/ids.js"
import type { RingSpec } from "../../domain/plan.js"
import type { WireFormats } from "../../domain/wireFormats.js"
import type { ClusterToken } from "./Auth.js"

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
export interface InboundEdge {
  readonly runId: RunId
  readonly edgeId: EdgeId
  readonly ring: RingSpec
  /**
   * Wait for messages and take them, per `ring.wakeCoalescing`: `PendingBit` → every message
   * ready (at least one), `EveryFrame` → exactly one. Credits the taken bytes back to the sender (on a
   * shared-memory edge only at the next `receive`/`take`: until then an activation's payload is a view of the ring,
   * to be read, not kept; copy what must outlive it).
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
export interface OutboundEdge {
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
  /** Step number of the first message (default 0). */
  readonly initialStep?: number | undefined
  /** Join chunks into whole messages before delivery (default true). */
  readonly reassemble?: boolean | undefined
  /**
   * Shared-memory edges only: when `receive` finds nothing ready, busy-poll the ring this many
   * microseconds before sleeping on the doorbell. Trades CPU for latency; default 0 (no polling).
   */
  readonly spinMicros?: number | undefined
}

/** A node's data-plane listener, routing authenticated connections to registered edges. */
export interface EdgeListener {
  /** The bound address (with the real port when listening on port 0). */
  readonly address: TransportAddress
  /**
   * Register the receiving end of an edge; unregistered when the scope closes (or on `close`).
   * One sender may attach, once: after the edge faults or its sender leaves, `close` it and
   * register again for a fresh edge (a reconnect cannot resume a half-delivered sequence).
   * Register before the producer connects: an attach for an unregistered edge is refused.
   */
  readonly register: (options: RegisterOptions) => Effect.Effect<InboundEdge, EdgeBusy | RingMismatch, Scope.Scope>
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
  /**
   * How long an attach to an edge not registered yet is held, waiting for its registration, before it is refused
   * (UnknownRun / UnknownEdge). Default 2 seconds; 0: refused at once. A sender that connects before the receiver has
   * registered (the stages of a new run set up side by side) is then attached the moment it registers, instead of
   * being refused and polling.
   */
  readonly attachWait?: Duration.DurationInput | undefined
  /**
   * What this node states in its handshakes: wire version and number formats (default: its own, from its host's byte
   * order; src/domain/wireFormats.ts). A connection stating others is refused with `WireMismatch`.
   */
  readonly formats?: WireFormats | undefined
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
  /** What this side states in the handshake (default: this node's); a listener stating others refuses the edge. */
  readonly formats?: WireFormats | undefined
}
