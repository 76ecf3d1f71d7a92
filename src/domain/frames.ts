/**
 * Frames: the data that flows over a run's edges, as values.
 *
 * - `TokenFrame` carries tokens: the orchestrator's `Prompt` / `Decode` into stage 0 (TokenIn) and
 *   the last stage's `Sampled` token back (TokenOut).
 * - `ActivationFrame` carries f32 hidden states between stages: `nTokens` rows of `hiddenDim`
 *   floats, for positions `[startPos, startPos + nTokens)`.
 * - `step` is the logical message number on one edge (0, 1, 2, ... — the decode step); a
 *   message larger than the edge's window travels as `chunkCount` chunks that share its step
 *   (`chunkIndex` 0 .. chunkCount-1). A receiver that reassembles delivers whole messages
 *   (`chunkIndex` 0, `chunkCount` 1).
 * - Control frames (`AttachFrame`, `AttachedFrame`, `CreditFrame`, `FaultFrame`) are the data
 *   plane's own: binding a connection to an edge, window credits, telling the peer why it faulted.
 * - Frames are plain, immutable data: each has a Schema (`XSchema`, for RPC / logs / validation at
 *   the edges) and a same-named builder function that fills defaults without validating (the
 *   wire encoder validates before anything is sent).
 * - `EdgeFault` is the typed reason an edge (or a connection) stops: every malformed, truncated,
 *   oversized, out-of-order or foreign frame ends in one of these, never in a throw.
 * - `TransportAddress` is where a data-plane or control-plane listener can be reached.
 *
 * The binary encoding lives in `src/layers/transport/Framing.ts`.
 */
import { Schema } from "effect"
import { EdgeId, RunId } from "./ids.js"
import { WakeCoalescing } from "./plan.js"
import { WireMismatch } from "./wireFormats.js"

const U32 = Schema.Number.pipe(Schema.int(), Schema.between(0, 0xffff_ffff))
const U16 = Schema.Number.pipe(Schema.int(), Schema.between(0, 0xffff))

/** Step number of a message on one edge (u32 on the wire). */
export const StepNumber = U32
export type StepNumber = typeof StepNumber.Type

/** A vocabulary token id (u32 on the wire). */
export const TokenId = U32
export type TokenId = typeof TokenId.Type

export const Prompt = Schema.TaggedStruct("Prompt", { tokens: Schema.Array(TokenId) })
export const Decode = Schema.TaggedStruct("Decode", { tokenId: TokenId })
/** A sampled token's log-probability and the most likely alternatives (most likely first), from the raw logits. */
export const SampledLogprob = Schema.Struct({
  logprob: Schema.Number,
  top: Schema.Array(Schema.Struct({ tokenId: TokenId, logprob: Schema.Number }))
})
export type SampledLogprob = typeof SampledLogprob.Type
/**
 * The last stage's token. `draws`: the random draws its sampler has made in the generation so far (a resumed
 * generation's sampler skips them); `logprob` when the run asked for log-probabilities.
 */
export const Sampled = Schema.TaggedStruct("Sampled", {
  tokenId: TokenId,
  eos: Schema.Boolean,
  draws: Schema.optional(U32),
  logprob: Schema.optional(SampledLogprob)
})
export const TokenPayload = Schema.Union(Prompt, Decode, Sampled)
export type TokenPayload = typeof TokenPayload.Type

const chunkFields = {
  chunkIndex: Schema.optionalWith(U16, { default: () => 0 }),
  chunkCount: Schema.optionalWith(U16.pipe(Schema.positive()), { default: () => 1 })
}

/** Fields that default when building a frame: a whole message (chunk 0 of 1), f32. */
type Defaulted<A, K extends keyof A> = Omit<A, "_tag" | K> & { readonly [P in K]?: A[P] }

/** Tokens on a TokenIn / TokenOut edge. Only a `Prompt` may be split into chunks. */
export const TokenFrameSchema = Schema.TaggedStruct("TokenFrame", {
  runId: RunId,
  edgeId: EdgeId,
  step: StepNumber,
  ...chunkFields,
  payload: TokenPayload
})
export type TokenFrame = typeof TokenFrameSchema.Type
/**
 * Build a `TokenFrame` (plain data, no validation: encoding validates). Frames are plain objects
 * rather than Schema classes because they are built once per token per hop, and constructing a
 * Schema class costs a noticeable share of the hop budget (bench/README.md, "Design measurements").
 */
export const TokenFrame = (props: Defaulted<TokenFrame, "chunkIndex" | "chunkCount">): TokenFrame => ({
  _tag: "TokenFrame",
  runId: props.runId,
  edgeId: props.edgeId,
  step: props.step,
  chunkIndex: props.chunkIndex ?? 0,
  chunkCount: props.chunkCount ?? 1,
  payload: props.payload
})

/** A `Float32Array` over any buffer (a subarray of a larger one is fine). */
export const Float32ArraySchema = Schema.declare((u: unknown): u is Float32Array => u instanceof Float32Array, {
  identifier: "Float32Array"
})

export const ActivationDType = Schema.Literal("f32")
export type ActivationDType = typeof ActivationDType.Type

/** Hidden states on an Activation edge: `payload.length === nTokens * hiddenDim`, row-major. */
export const ActivationFrameSchema = Schema.TaggedStruct("ActivationFrame", {
  runId: RunId,
  edgeId: EdgeId,
  step: StepNumber,
  ...chunkFields,
  startPos: U32,
  nTokens: U32.pipe(Schema.positive()),
  hiddenDim: U32.pipe(Schema.positive()),
  dtype: Schema.optionalWith(ActivationDType, { default: () => "f32" as const }),
  payload: Float32ArraySchema,
  /**
   * A speculative step: the tokens drafted after the step's first row, one per later row (nTokens = 1 + drafts; such a
   * message is never chunked). The last stage keeps the drafts its logits agree with. Absent: none.
   */
  drafts: Schema.optional(Schema.Array(TokenId).pipe(Schema.maxItems(255)))
})
export type ActivationFrame = typeof ActivationFrameSchema.Type
/** Build an `ActivationFrame` (plain data, no validation: encoding validates). */
export const ActivationFrame = (
  props: Defaulted<ActivationFrame, "chunkIndex" | "chunkCount" | "dtype">
): ActivationFrame => ({
  _tag: "ActivationFrame",
  runId: props.runId,
  edgeId: props.edgeId,
  step: props.step,
  chunkIndex: props.chunkIndex ?? 0,
  chunkCount: props.chunkCount ?? 1,
  startPos: props.startPos,
  nTokens: props.nTokens,
  hiddenDim: props.hiddenDim,
  dtype: props.dtype ?? "f32",
  payload: props.payload,
  ...(props.drafts === undefined ? {} : { drafts: props.drafts })
})

/** A frame the user of an edge sends and receives. */
export type DataFrame = TokenFrame | ActivationFrame

/** The fields of either data frame kind, `_tag` saying which; the chunk fields and dtype may be left out. */
export type DataFrameFields =
  | (Defaulted<TokenFrame, "chunkIndex" | "chunkCount"> & { readonly _tag: "TokenFrame" })
  | (Defaulted<ActivationFrame, "chunkIndex" | "chunkCount" | "dtype"> & { readonly _tag: "ActivationFrame" })

/** Build a data frame of the kind `_tag` names, through that kind's builder (plain data, no validation). */
export const dataFrame = (fields: DataFrameFields): DataFrame =>
  fields._tag === "ActivationFrame" ? ActivationFrame(fields) : TokenFrame(fields)

/**
 * Sender → receiver, first frame on a connection: bind it to one edge, stating the sender's ring.
 * `sharedMemory` names the /dev/shm ring file the sender writes data frames into ("" = frames
 * travel on the socket).
 */
export const AttachFrameSchema = Schema.TaggedStruct("AttachFrame", {
  runId: RunId,
  edgeId: EdgeId,
  dataCapacity: U32,
  alignment: U32,
  wakeCoalescing: WakeCoalescing,
  sharedMemory: Schema.optionalWith(Schema.String, { default: () => "" })
})
export type AttachFrame = typeof AttachFrameSchema.Type
export const AttachFrame = (props: Defaulted<AttachFrame, "sharedMemory">): AttachFrame => ({
  _tag: "AttachFrame",
  runId: props.runId,
  edgeId: props.edgeId,
  dataCapacity: props.dataCapacity,
  alignment: props.alignment,
  wakeCoalescing: props.wakeCoalescing,
  sharedMemory: props.sharedMemory ?? ""
})

/** Sender → receiver on a shared-memory edge: new frames are in the ring (the pending bit was clear). */
export const DoorbellFrameSchema = Schema.TaggedStruct("DoorbellFrame", { runId: RunId, edgeId: EdgeId })
export type DoorbellFrame = typeof DoorbellFrameSchema.Type
export const DoorbellFrame = (props: Omit<DoorbellFrame, "_tag">): DoorbellFrame => ({
  _tag: "DoorbellFrame",
  ...props
})

/** Receiver → sender: the connection is bound to the edge; data frames may flow. */
export const AttachedFrameSchema = Schema.TaggedStruct("AttachedFrame", {
  runId: RunId,
  edgeId: EdgeId
})
export type AttachedFrame = typeof AttachedFrameSchema.Type
export const AttachedFrame = (props: Omit<AttachedFrame, "_tag">): AttachedFrame => ({
  _tag: "AttachedFrame",
  ...props
})

/** Receiver → sender: `bytes` more of the window are free (the consumer took frames that long). */
export const CreditFrameSchema = Schema.TaggedStruct("CreditFrame", {
  runId: RunId,
  edgeId: EdgeId,
  step: StepNumber,
  bytes: U32
})
export type CreditFrame = typeof CreditFrameSchema.Type
export const CreditFrame = (props: Omit<CreditFrame, "_tag">): CreditFrame => ({ _tag: "CreditFrame", ...props })

/** Either side → the other, just before closing: why this side faulted the edge. */
export const FaultFrameSchema = Schema.TaggedStruct("FaultFrame", {
  runId: RunId,
  edgeId: EdgeId,
  reason: Schema.String,
  detail: Schema.String
})
export type FaultFrame = typeof FaultFrameSchema.Type
export const FaultFrame = (props: Omit<FaultFrame, "_tag">): FaultFrame => ({ _tag: "FaultFrame", ...props })

/** Any frame on the wire. */
export type WireFrame = DataFrame | AttachFrame | AttachedFrame | CreditFrame | FaultFrame | DoorbellFrame
export const WireFrameSchema = Schema.Union(
  DoorbellFrameSchema,
  TokenFrameSchema,
  ActivationFrameSchema,
  AttachFrameSchema,
  AttachedFrameSchema,
  CreditFrameSchema,
  FaultFrameSchema
)

/** Where a listener can be reached: TCP (host defaults to 127.0.0.1 when listening) or a Unix socket. */
export const TransportAddress = Schema.Union(
  Schema.TaggedStruct("Tcp", { host: Schema.String, port: Schema.Number.pipe(Schema.int(), Schema.between(0, 65535)) }),
  Schema.TaggedStruct("Unix", { path: Schema.String })
)
export type TransportAddress = typeof TransportAddress.Type

export const tcpAddress = (port: number, host = "127.0.0.1"): TransportAddress => ({ _tag: "Tcp", host, port })
export const unixAddress = (path: string): TransportAddress => ({ _tag: "Unix", path })

// ---------------------------------------------------------------------------------------------
// Edge faults
// ---------------------------------------------------------------------------------------------

/** Bytes that do not form a valid frame (bad magic, version, type, field, padding, alignment). */
export class Malformed extends Schema.TaggedError<Malformed>()("Malformed", { detail: Schema.String }) {}

/** A frame cut short: fewer bytes than its header announces. */
export class Truncated extends Schema.TaggedError<Truncated>()("Truncated", {
  needed: Schema.Number,
  available: Schema.Number
}) {}

/** A frame larger than the edge allows (its window), or a message that cannot be chunked to fit. */
export class Oversized extends Schema.TaggedError<Oversized>()("Oversized", {
  size: Schema.Number,
  limit: Schema.Number
}) {}

/** A frame whose (step, chunk) is not the next one expected on the edge. */
export class OutOfOrder extends Schema.TaggedError<OutOfOrder>()("OutOfOrder", {
  expectedStep: Schema.Number,
  expectedChunk: Schema.Number,
  step: Schema.Number,
  chunkIndex: Schema.Number
}) {}

/** The sender put more unacknowledged bytes on the wire than the window allows. */
export class WindowExceeded extends Schema.TaggedError<WindowExceeded>()("WindowExceeded", {
  outstanding: Schema.Number,
  capacity: Schema.Number
}) {}

/** A frame or attach for a run that has no edge registered here. */
export class UnknownRun extends Schema.TaggedError<UnknownRun>()("UnknownRun", { runId: Schema.Number }) {}

/** A frame or attach for an edge that is not registered here (or not the one the connection is bound to). */
export class UnknownEdge extends Schema.TaggedError<UnknownEdge>()("UnknownEdge", {
  runId: Schema.Number,
  edgeId: Schema.Number
}) {}

/** The two ends of an edge disagree on its `RingSpec`. */
export class RingMismatch extends Schema.TaggedError<RingMismatch>()("RingMismatch", { detail: Schema.String }) {}

/** A second connection tried to attach to an edge that already has a sender. */
export class EdgeBusy extends Schema.TaggedError<EdgeBusy>()("EdgeBusy", {
  runId: Schema.Number,
  edgeId: Schema.Number
}) {}

/**
 * Why a handshake failed: the peer closed (or reset) the connection before it finished (`closed`: a health probe, a port
 * scan, a peer that gave up), it did not finish in time (`timeout`), it spoke something other than the handshake
 * (`protocol`), or a proof did not match the cluster token (`proof`: a forged handshake, another token, or a peer that
 * left once it saw ours).
 */
export const HandshakeFailure = Schema.Literal("closed", "timeout", "protocol", "proof")
export type HandshakeFailure = typeof HandshakeFailure.Type

/** The peer did not prove knowledge of the cluster token (or we refused its proof, or it timed out): `reason` says how. */
export class AuthFailed extends Schema.TaggedError<AuthFailed>()("AuthFailed", {
  detail: Schema.String,
  reason: HandshakeFailure
}) {}

/** The connection could not be opened. */
export class ConnectFailed extends Schema.TaggedError<ConnectFailed>()("ConnectFailed", { detail: Schema.String }) {}

/** The peer closed the connection (possibly mid-frame) or the socket errored. */
export class PeerClosed extends Schema.TaggedError<PeerClosed>()("PeerClosed", { detail: Schema.String }) {}

/** The peer faulted the edge and said why (a `FaultFrame`). */
export class PeerFaulted extends Schema.TaggedError<PeerFaulted>()("PeerFaulted", {
  reason: Schema.String,
  detail: Schema.String
}) {}

/** This side closed the edge (scope closed / unregistered). */
export class EdgeClosed extends Schema.TaggedError<EdgeClosed>()("EdgeClosed", {}) {}

export const EdgeFault = Schema.Union(
  Malformed,
  Truncated,
  Oversized,
  OutOfOrder,
  WindowExceeded,
  UnknownRun,
  UnknownEdge,
  RingMismatch,
  EdgeBusy,
  AuthFailed,
  WireMismatch,
  ConnectFailed,
  PeerClosed,
  PeerFaulted,
  EdgeClosed
)
export type EdgeFault = typeof EdgeFault.Type

/** Faults the wire decoder produces. */
export type DecodeFault = Malformed | Truncated | Oversized

/** One-line description of a fault, for logs and `FaultFrame.detail`. */
export const describeFault = (fault: EdgeFault): string => {
  // A refused peer's formats: its own line, naming both sides' values.
  if (fault._tag === "WireMismatch") return fault.message
  const { _tag, ...rest } = fault
  const fields = Object.entries(rest).filter(([k]) => k !== "stack" && k !== "message")
  return `${_tag}(${fields.map(([k, v]) => `${k}=${String(v)}`).join(", ")})`
}
