/**
 * The data plane: token and activation frames over authenticated stream sockets (TCP across
 * machines, a Unix domain socket on one machine — the same code with a different address), or,
 * for same-host edges, through a shared-memory ring (`connect({ sharedMemory: true })` to a Unix
 * listener; see ShmRing.ts): the sender names its /dev/shm ring in the AttachFrame, data frames
 * go into the ring, and the socket carries only doorbells (PendingBit), faults and the attach.
 *
 * Topology. Every node runs one `EdgeListener`. The consumer of an edge registers an
 * `InboundEdge` for `(runId, edgeId)` on its listener; the producer opens an `OutboundEdge` to that
 * listener. One connection carries one edge:
 *
 * ```
 * sender                                   listener / receiver
 *   ── TCP/Unix connect ─────────────────▶
 *   ◀── mutual HMAC handshake (Auth.ts) ─▶   (nothing else is read before it succeeds; each side states its wire
 *                                             version and number formats, and another is refused: WireMismatch)
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
 *
 * Modules: Edge.ts (the public shapes), EdgeListener.ts (the listener and its edge registry),
 * EdgeConnect.ts (the sending end's connect), InboundCore.ts / OutboundCore.ts (the edge cores: window,
 * credits, sequencing), SendCarrier.ts / ReceiveCarrier.ts (the socket and shared-memory carriers under the
 * cores), FramedSocket.ts (frames over a socket), ShmRing.ts (the ring), Net.ts (socket plumbing shared with
 * the control plane). This module is their public face.
 */
export * from "./Edge.js"
export { connect } from "./EdgeConnect.js"
export { DataPlaneNode, layer, listen } from "./EdgeListener.js"
