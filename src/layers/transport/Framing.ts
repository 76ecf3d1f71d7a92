/**
 * Binary framing of the data plane: pure encode / decode, chunking, and the incremental decoder
 * used on stream sockets.
 *
 * Every frame starts with a 32-byte header (all integers little-endian):
 *
 * | off | size | field                                                              |
 * |-----|------|--------------------------------------------------------------------|
 * |   0 | u32  | magic `0x46415753` ("SWAF")                                        |
 * |   4 | u8   | version: WIRE_VERSION (2; src/domain/wireFormats.ts)               |
 * |   5 | u8   | type: 1 Token, 2 Activation, 3 Credit, 4 Attach, 5 Attached, 6 Fault, 7 Doorbell |
 * |   6 | u16  | flags (0)                                                          |
 * |   8 | u32  | frameLength: header + body + zero padding, a multiple of the alignment |
 * |  12 | u32  | bodyLength: meaningful bytes after the header                      |
 * |  16 | u32  | runId                                                              |
 * |  20 | u32  | edgeId                                                             |
 * |  24 | u32  | step                                                               |
 * |  28 | u16  | chunkIndex                                                         |
 * |  30 | u16  | chunkCount                                                         |
 *
 * Bodies: Token `u8 kind (0 Prompt, 1 Decode, 2 Sampled), u8 flags, u16 nTop, u32 count, u32 tokens[count]`, where
 * flags and nTop are 0 except for Sampled: flags bit 0 eos, bit 1 a `u32 draws` follows the token, bit 2 a log-prob
 * follows (after draws): `f64 logprob` then nTop (at most 20) × `u32 tokenId, f64 logprob`, every log-prob ≤ 0 and
 * not NaN, the alternatives most likely first; nTop is 0 without bit 2, other bits 0;
 * Activation `u8 dtype (0 f32), 3×u8 0, u32 startPos, u32 nTokens, u32 hiddenDim, u32 payloadOffset,
 * u32 payloadLength`, zero padding up to `payloadOffset` (aligned, from the frame start), then
 * `nTokens*hiddenDim` f32; Credit `u32 bytes, u32 0`; Attach `u32 dataCapacity, u32 alignment,
 * u8 wake (0 PendingBit, 1 EveryFrame), u8 0, u16 shmPathLength` + UTF-8 shared-memory path;
 * Attached and Doorbell empty; Fault `u16 reasonLen, u16 detailLen` + UTF-8 reason + detail.
 *
 * Alignment: frames are padded so that `frameLength` is a multiple of `max(8, RingSpec.alignment)`,
 * so every frame starts aligned in the stream, and an activation payload starts aligned inside its
 * frame. Decoding is strict: exact lengths, zero padding and reserved fields, so any mutation of a
 * header is caught. Decoding is total: any byte sequence yields a frame, "need more bytes", or a
 * typed `DecodeFault` (`Malformed` / `Truncated` / `Oversized`) — never a throw.
 *
 * Ids and step numbers are u32 on the wire; encoding a frame whose fields do not fit fails with
 * `Malformed`. The f32 payload is written in the host's byte order: every handshake states it (`f32-le`; Auth.ts,
 * src/domain/wireFormats.ts), a peer stating another is refused there, and a big-endian host runs no stage.
 */
import { Either } from "effect"
import {
  ActivationFrame,
  AttachedFrame,
  AttachFrame,
  CreditFrame,
  type DataFrame,
  type DecodeFault,
  DoorbellFrame,
  FaultFrame,
  Malformed,
  OutOfOrder,
  Oversized,
  TokenFrame,
  type TokenPayload,
  Truncated,
  type WireFrame
} from "../../domain/frames.js"
import { WIRE_VERSION } from "../../domain/wireFormats.js"
import { alignUp } from "../../domain/plan.js"
import type { EdgeId, RunId } from "../../domain/ids.js"

export const MAGIC = 0x46415753
export const VERSION = WIRE_VERSION
export const HEADER_BYTES = 32
export const ACTIVATION_BODY_HEADER_BYTES = 24
export const TOKEN_BODY_HEADER_BYTES = 8

export const FrameType = {
  Token: 1,
  Activation: 2,
  Credit: 3,
  Attach: 4,
  Attached: 5,
  Fault: 6,
  Doorbell: 7
} as const

const MAX_FAULT_TEXT = 1024
const MAX_SHM_PATH = 255
const MAX_ALIGNMENT = 4096

/** What the decoder accepts: the edge's alignment and its largest frame (the window). */
export interface Limits {
  readonly alignment: number
  readonly maxFrameBytes: number
}

/** Limits for a connection not yet bound to an edge: only small control frames. */
export const preAttachLimits: Limits = { alignment: 8, maxFrameBytes: 2048 }

/** `max(8, alignment)`: the alignment frames are actually padded to. */
export const effectiveAlignment = (alignment: number): number => Math.max(8, alignment)

/** Is `alignment` usable as a ring alignment (a power of two, 1 ..= 4096)? */
export const isValidAlignment = (alignment: number): boolean =>
  Number.isInteger(alignment) && alignment >= 1 && alignment <= MAX_ALIGNMENT && (alignment & (alignment - 1)) === 0

const isU32 = (n: number) => Number.isInteger(n) && n >= 0 && n <= 0xffff_ffff
const isU16 = (n: number) => Number.isInteger(n) && n >= 0 && n <= 0xffff

const textEncoder = new TextEncoder()
const textDecoder = new TextDecoder("utf-8", { fatal: false })

// ---------------------------------------------------------------------------------------------
// Encode
// ---------------------------------------------------------------------------------------------

/** Byte offset of the f32 payload inside an activation frame. */
export const activationPayloadOffset = (alignment: number): number =>
  alignUp(HEADER_BYTES + ACTIVATION_BODY_HEADER_BYTES, effectiveAlignment(alignment))

/** The most tokens a speculative step's activation frame drafts (u8 on the wire). */
export const MAX_DRAFTS = 255

/** Bytes of an activation frame's drafted tokens (u32 each, after its payload). */
const draftBytes = (frame: ActivationFrame): number => 4 * (frame.drafts?.length ?? 0)

/** Encoded size of a frame (without encoding it). */
export const encodedLength = (frame: WireFrame, alignment: number): number => {
  const a = effectiveAlignment(alignment)
  switch (frame._tag) {
    case "ActivationFrame":
      return alignUp(activationPayloadOffset(alignment) + frame.payload.length * 4 + draftBytes(frame), a)
    case "TokenFrame":
      return alignUp(
        HEADER_BYTES + TOKEN_BODY_HEADER_BYTES + 4 * tokenCount(frame.payload) + sampledExtraBytes(frame.payload),
        a
      )
    case "CreditFrame":
      return alignUp(HEADER_BYTES + 8, a)
    case "AttachFrame":
      return alignUp(HEADER_BYTES + 12 + textEncoder.encode(frame.sharedMemory).length, a)
    case "AttachedFrame":
    case "DoorbellFrame":
      return alignUp(HEADER_BYTES, a)
    case "FaultFrame": {
      const { detail, reason } = faultText(frame)
      return alignUp(HEADER_BYTES + 4 + reason.length + detail.length, a)
    }
  }
}

const tokenCount = (payload: TokenPayload): number => (payload._tag === "Prompt" ? payload.tokens.length : 1)

/** The most alternatives a Sampled token's log-prob may carry. */
export const MAX_SAMPLED_TOP = 20
const SAMPLED_EOS = 1
const SAMPLED_DRAWS = 2
const SAMPLED_LOGPROB = 4
const TOP_ENTRY_BYTES = 12

/** Bytes a Sampled body carries after its token: draws, log-prob and alternatives. */
const sampledExtraBytes = (payload: TokenPayload): number =>
  payload._tag !== "Sampled"
    ? 0
    : (payload.draws === undefined ? 0 : 4) +
      (payload.logprob === undefined ? 0 : 8 + TOP_ENTRY_BYTES * payload.logprob.top.length)

const isLogprob = (x: number) => typeof x === "number" && !Number.isNaN(x) && x <= 0

const faultText = (frame: FaultFrame) => ({
  reason: textEncoder.encode(frame.reason.slice(0, 64)).subarray(0, 64),
  detail: textEncoder.encode(frame.detail.slice(0, MAX_FAULT_TEXT)).subarray(0, MAX_FAULT_TEXT)
})

const typeOf = (frame: WireFrame): number => {
  switch (frame._tag) {
    case "TokenFrame":
      return FrameType.Token
    case "ActivationFrame":
      return FrameType.Activation
    case "CreditFrame":
      return FrameType.Credit
    case "AttachFrame":
      return FrameType.Attach
    case "AttachedFrame":
      return FrameType.Attached
    case "FaultFrame":
      return FrameType.Fault
    case "DoorbellFrame":
      return FrameType.Doorbell
  }
}

const checkEncodable = (frame: WireFrame, alignment: number): string | undefined => {
  if (!isValidAlignment(alignment)) return `alignment ${alignment} is not a power of two in 1..${MAX_ALIGNMENT}`
  if (!isU32(frame.runId) || !isU32(frame.edgeId)) return "runId / edgeId must fit in u32"
  switch (frame._tag) {
    case "TokenFrame":
    case "ActivationFrame": {
      if (!isU32(frame.step)) return "step must fit in u32"
      if (!isU16(frame.chunkIndex) || !isU16(frame.chunkCount) || frame.chunkCount < 1) return "bad chunk fields"
      if (frame.chunkIndex >= frame.chunkCount) return "chunkIndex >= chunkCount"
      if (frame._tag === "ActivationFrame") {
        if (!isU32(frame.startPos) || !isU32(frame.nTokens) || !isU32(frame.hiddenDim)) return "bad activation shape"
        if (frame.nTokens < 1 || frame.hiddenDim < 1) return "empty activation"
        const drafts = frame.drafts
        if (drafts !== undefined && (drafts.length > MAX_DRAFTS || !drafts.every(isU32))) {
          return `at most ${MAX_DRAFTS} drafted tokens, each a u32`
        }
        if (frame.payload.length !== frame.nTokens * frame.hiddenDim) {
          return `payload has ${frame.payload.length} floats, expected nTokens*hiddenDim = ${
            frame.nTokens * frame.hiddenDim
          }`
        }
      } else {
        const p = frame.payload
        if (p._tag === "Prompt") {
          if (p.tokens.length < 1) return "empty prompt"
          if (!p.tokens.every(isU32)) return "token ids must fit in u32"
        } else {
          if (!isU32(p.tokenId)) return "token id must fit in u32"
          if (frame.chunkCount !== 1) return "only a Prompt may be chunked"
          if (p._tag === "Sampled") {
            if (p.draws !== undefined && !isU32(p.draws)) return "draws must fit in u32"
            const lp = p.logprob
            if (lp !== undefined) {
              if (lp.top.length > MAX_SAMPLED_TOP) return `at most ${MAX_SAMPLED_TOP} log-prob alternatives`
              if (!isLogprob(lp.logprob) || !lp.top.every((t) => isU32(t.tokenId) && isLogprob(t.logprob))) {
                return "log-probs must be numbers ≤ 0"
              }
              if (lp.top.some((t, i) => i > 0 && t.logprob > lp.top[i - 1]!.logprob))
                return "alternatives not most likely first"
            }
          }
        }
      }
      return undefined
    }
    case "CreditFrame":
      return isU32(frame.bytes) && isU32(frame.step) ? undefined : "bad credit"
    case "AttachFrame":
      return isU32(frame.dataCapacity) &&
        isU32(frame.alignment) &&
        textEncoder.encode(frame.sharedMemory).length <= MAX_SHM_PATH
        ? undefined
        : "bad attach"
    case "AttachedFrame":
    case "FaultFrame":
    case "DoorbellFrame":
      return undefined
  }
}

/**
 * Encode one frame, padded to `alignment`. Fails with `Malformed` when a field does not fit the
 * wire format (the frame could never be decoded).
 */
export const encode = (frame: WireFrame, alignment: number): Either.Either<Uint8Array, Malformed> => {
  const problem = checkEncodable(frame, alignment)
  if (problem !== undefined) return Either.left(new Malformed({ detail: `cannot encode ${frame._tag}: ${problem}` }))
  return Either.right(unsafeEncode(frame, alignment))
}

/** `encode` without validation, for frames already known to be encodable. */
export const unsafeEncode = (frame: WireFrame, alignment: number): Uint8Array => {
  const buf = new Uint8Array(encodedLength(frame, alignment))
  encodeInto(frame, alignment, buf, true)
  return buf
}

/** A Token body: kind, count and tokens, and a Sampled token's flags, draws and log-probs; returns its length. */
const encodeTokenBody = (p: TokenPayload, view: DataView): number => {
  const o = HEADER_BYTES
  view.setUint8(o, p._tag === "Prompt" ? 0 : p._tag === "Decode" ? 1 : 2)
  const tokens = p._tag === "Prompt" ? p.tokens : [p.tokenId]
  view.setUint32(o + 4, tokens.length, true)
  for (let i = 0; i < tokens.length; i++) view.setUint32(o + 8 + 4 * i, tokens[i]!, true)
  const bodyLength = TOKEN_BODY_HEADER_BYTES + 4 * tokens.length
  if (p._tag !== "Sampled") return bodyLength
  view.setUint8(
    o + 1,
    (p.eos ? SAMPLED_EOS : 0) |
      (p.draws === undefined ? 0 : SAMPLED_DRAWS) |
      (p.logprob === undefined ? 0 : SAMPLED_LOGPROB)
  )
  let at = o + bodyLength
  if (p.draws !== undefined) {
    view.setUint32(at, p.draws, true)
    at += 4
  }
  if (p.logprob !== undefined) {
    view.setUint16(o + 2, p.logprob.top.length, true)
    view.setFloat64(at, p.logprob.logprob, true)
    at += 8
    for (const t of p.logprob.top) {
      view.setUint32(at, t.tokenId, true)
      view.setFloat64(at + 4, t.logprob, true)
      at += TOP_ENTRY_BYTES
    }
  }
  return at - o
}

/** An Activation body: its shape, the payload's offset and length, then the payload (aligned); returns its length. */
const encodeActivationBody = (frame: ActivationFrame, view: DataView, buf: Uint8Array, alignment: number): number => {
  const o = HEADER_BYTES
  const payloadOffset = activationPayloadOffset(alignment)
  const payloadLength = frame.payload.length * 4
  const drafts = frame.drafts ?? []
  view.setUint8(o, 0)
  view.setUint8(o + 1, drafts.length)
  view.setUint32(o + 4, frame.startPos, true)
  view.setUint32(o + 8, frame.nTokens, true)
  view.setUint32(o + 12, frame.hiddenDim, true)
  view.setUint32(o + 16, payloadOffset, true)
  view.setUint32(o + 20, payloadLength, true)
  buf.set(new Uint8Array(frame.payload.buffer, frame.payload.byteOffset, payloadLength), payloadOffset)
  drafts.forEach((t, i) => view.setUint32(payloadOffset + payloadLength + 4 * i, t, true))
  return payloadOffset - HEADER_BYTES + payloadLength + 4 * drafts.length
}

const encodeAttachBody = (frame: AttachFrame, view: DataView, buf: Uint8Array): number => {
  const path = textEncoder.encode(frame.sharedMemory)
  view.setUint32(HEADER_BYTES, frame.dataCapacity, true)
  view.setUint32(HEADER_BYTES + 4, frame.alignment, true)
  view.setUint8(HEADER_BYTES + 8, frame.wakeCoalescing === "PendingBit" ? 0 : 1)
  view.setUint16(HEADER_BYTES + 10, path.length, true)
  buf.set(path, HEADER_BYTES + 12)
  return 12 + path.length
}

const encodeFaultBody = (frame: FaultFrame, view: DataView, buf: Uint8Array): number => {
  const { detail, reason } = faultText(frame)
  view.setUint16(HEADER_BYTES, reason.length, true)
  view.setUint16(HEADER_BYTES + 2, detail.length, true)
  buf.set(reason, HEADER_BYTES + 4)
  buf.set(detail, HEADER_BYTES + 4 + reason.length)
  return 4 + reason.length + detail.length
}

/** Writes a frame's body after the header; returns the body's length. */
const encodeBody = (frame: WireFrame, view: DataView, buf: Uint8Array, alignment: number): number => {
  switch (frame._tag) {
    case "TokenFrame":
      return encodeTokenBody(frame.payload, view)
    case "ActivationFrame":
      return encodeActivationBody(frame, view, buf, alignment)
    case "CreditFrame":
      view.setUint32(HEADER_BYTES, frame.bytes, true)
      return 8
    case "AttachFrame":
      return encodeAttachBody(frame, view, buf)
    case "AttachedFrame":
    case "DoorbellFrame":
      return 0
    case "FaultFrame":
      return encodeFaultBody(frame, view, buf)
  }
}

/** The header's step and chunk fields: a data frame's own, a Credit's step, else 0, 0 of 1. */
const dataFields = (frame: WireFrame): { step: number; chunkIndex: number; chunkCount: number } =>
  frame._tag === "TokenFrame" || frame._tag === "ActivationFrame"
    ? { step: frame.step, chunkIndex: frame.chunkIndex, chunkCount: frame.chunkCount }
    : { step: frame._tag === "CreditFrame" ? frame.step : 0, chunkIndex: 0, chunkCount: 1 }

/**
 * Encode a frame known to be encodable straight into `buf`, which must be exactly
 * `encodedLength(frame, alignment)` bytes (a slot of a shared-memory ring, say, so the payload is copied
 * once). Reserved fields and padding are zeroed unless `zeroed` says `buf` is all zeros already.
 */
export const encodeInto = (frame: WireFrame, alignment: number, buf: Uint8Array, zeroed = false): void => {
  const frameLength = buf.length
  const view = new DataView(buf.buffer, buf.byteOffset, frameLength)
  if (!zeroed) {
    // Everything but an activation's payload is rewritten below or must be zero: clear it.
    if (frame._tag === "ActivationFrame") {
      const payloadOffset = activationPayloadOffset(alignment)
      buf.fill(0, 0, payloadOffset)
      buf.fill(0, payloadOffset + frame.payload.length * 4)
    } else {
      buf.fill(0)
    }
  }
  const bodyLength = encodeBody(frame, view, buf, alignment)
  const { chunkCount, chunkIndex, step } = dataFields(frame)
  view.setUint32(0, MAGIC, true)
  view.setUint8(4, VERSION)
  view.setUint8(5, typeOf(frame))
  view.setUint16(6, 0, true)
  view.setUint32(8, frameLength, true)
  view.setUint32(12, bodyLength, true)
  view.setUint32(16, frame.runId, true)
  view.setUint32(20, frame.edgeId, true)
  view.setUint32(24, step, true)
  view.setUint16(28, chunkIndex, true)
  view.setUint16(30, chunkCount, true)
}

// ---------------------------------------------------------------------------------------------
// Decode
// ---------------------------------------------------------------------------------------------

/** Result of decoding at one position of a buffer. */
export type DecodeStep =
  | { readonly _tag: "Frame"; readonly frame: WireFrame; readonly length: number }
  | { readonly _tag: "NeedMore"; readonly needed: number }
  | { readonly _tag: "Fault"; readonly fault: DecodeFault }

const needMore = (needed: number): DecodeStep => ({ _tag: "NeedMore", needed })
const malformed = (detail: string): DecodeStep => ({ _tag: "Fault", fault: new Malformed({ detail }) })

/** The fixed header fields, once validated. */
export interface Header {
  readonly type: number
  readonly frameLength: number
  readonly bodyLength: number
  readonly runId: number
  readonly edgeId: number
  readonly step: number
  readonly chunkIndex: number
  readonly chunkCount: number
}

/**
 * Decode the frame starting at `offset` of `bytes`. Never throws: returns the frame and its length,
 * `NeedMore` when `bytes` ends inside the frame (after validating as much of the header as is
 * present — an oversized announced length faults at once), or a typed fault.
 */
export const decodeAt = (bytes: Uint8Array, offset: number, limits: Limits, aliasPayload = false): DecodeStep => {
  try {
    return decodeAtUnguarded(bytes, offset, limits, aliasPayload)
  } catch (cause) {
    return malformed(`decoder error: ${String(cause)}`)
  }
}

const decodeAtUnguarded = (bytes: Uint8Array, offset: number, limits: Limits, aliasPayload = false): DecodeStep => {
  const available = bytes.length - offset
  const view = new DataView(bytes.buffer, bytes.byteOffset + offset, available)
  // Check the magic as soon as it is there, so garbage faults without waiting for more bytes.
  if (available >= 4 && view.getUint32(0, true) !== MAGIC) return malformed("bad magic")
  if (available < 16) {
    if (available >= 5 && view.getUint8(4) !== VERSION) return malformed(`unsupported version ${view.getUint8(4)}`)
    return needMore(HEADER_BYTES)
  }
  const alignment = effectiveAlignment(limits.alignment)
  const version = view.getUint8(4)
  const type = view.getUint8(5)
  const flags = view.getUint16(6, true)
  const frameLength = view.getUint32(8, true)
  const bodyLength = view.getUint32(12, true)
  if (version !== VERSION) return malformed(`unsupported version ${version}`)
  if (type < FrameType.Token || type > FrameType.Doorbell) return malformed(`unknown frame type ${type}`)
  if (flags !== 0) return malformed(`unknown flags ${flags}`)
  if (frameLength > limits.maxFrameBytes) {
    return { _tag: "Fault", fault: new Oversized({ size: frameLength, limit: limits.maxFrameBytes }) }
  }
  if (frameLength < HEADER_BYTES || frameLength % alignment !== 0) {
    return malformed(`frame length ${frameLength} is not a multiple of the alignment ${alignment}`)
  }
  if (frameLength !== alignUp(HEADER_BYTES + bodyLength, alignment)) {
    return malformed(`frame length ${frameLength} does not match body length ${bodyLength}`)
  }
  if (available < HEADER_BYTES) return needMore(HEADER_BYTES)
  const header: Header = {
    type,
    frameLength,
    bodyLength,
    runId: view.getUint32(16, true),
    edgeId: view.getUint32(20, true),
    step: view.getUint32(24, true),
    chunkIndex: view.getUint16(28, true),
    chunkCount: view.getUint16(30, true)
  }
  const isData = type === FrameType.Token || type === FrameType.Activation
  if (header.chunkCount < 1 || header.chunkIndex >= header.chunkCount) {
    return malformed(`bad chunk ${header.chunkIndex}/${header.chunkCount}`)
  }
  if (!isData && (header.chunkCount !== 1 || (type !== FrameType.Credit && header.step !== 0))) {
    return malformed("control frame with data fields")
  }
  if (available < frameLength) return needMore(frameLength)
  for (let i = HEADER_BYTES + bodyLength; i < frameLength; i++) {
    if (view.getUint8(i) !== 0) return malformed("non-zero padding")
  }
  const body = decodeBody(view, header, limits.alignment, aliasPayload)
  if (typeof body === "string") return malformed(body)
  return { _tag: "Frame", frame: body, length: frameLength }
}

const runIdOf = (n: number) => n as RunId
const edgeIdOf = (n: number) => n as EdgeId

/** A Sampled token's draws and log-probs, after its token id at `o + 12`. */
const decodeSampled = (view: DataView, tokenId: number, flags: number, nTop: number): TokenPayload | string => {
  let at = HEADER_BYTES + 12
  let draws: number | undefined
  if ((flags & SAMPLED_DRAWS) !== 0) {
    draws = view.getUint32(at, true)
    at += 4
  }
  let logprob: { logprob: number; top: Array<{ tokenId: number; logprob: number }> } | undefined
  if ((flags & SAMPLED_LOGPROB) !== 0) {
    const own = view.getFloat64(at, true)
    at += 8
    const top: Array<{ tokenId: number; logprob: number }> = []
    for (let i = 0; i < nTop; i++, at += TOP_ENTRY_BYTES) {
      top.push({ tokenId: view.getUint32(at, true), logprob: view.getFloat64(at + 4, true) })
    }
    if (!isLogprob(own) || !top.every((t) => isLogprob(t.logprob))) return "log-probs must be numbers ≤ 0"
    if (top.some((t, i) => i > 0 && t.logprob > top[i - 1]!.logprob)) return "alternatives not most likely first"
    logprob = { logprob: own, top }
  }
  return {
    _tag: "Sampled",
    tokenId,
    eos: (flags & SAMPLED_EOS) !== 0,
    ...(draws === undefined ? {} : { draws }),
    ...(logprob === undefined ? {} : { logprob })
  }
}

const decodeTokenBody = (view: DataView, h: Header): WireFrame | string => {
  const o = HEADER_BYTES
  if (h.bodyLength < TOKEN_BODY_HEADER_BYTES) return "token body too short"
  const kind = view.getUint8(o)
  const flags = view.getUint8(o + 1)
  const nTop = view.getUint16(o + 2, true)
  const count = view.getUint32(o + 4, true)
  if (kind > 2) return `unknown token kind ${kind}`
  if (kind !== 2 && (flags !== 0 || nTop !== 0)) return "token flags / reserved field not zero"
  if (flags > (SAMPLED_EOS | SAMPLED_DRAWS | SAMPLED_LOGPROB)) return "bad Sampled flags"
  if ((flags & SAMPLED_LOGPROB) === 0 ? nTop !== 0 : nTop > MAX_SAMPLED_TOP) return "bad log-prob count"
  const extra =
    kind !== 2
      ? 0
      : ((flags & SAMPLED_DRAWS) === 0 ? 0 : 4) + ((flags & SAMPLED_LOGPROB) === 0 ? 0 : 8 + TOP_ENTRY_BYTES * nTop)
  if (h.bodyLength !== TOKEN_BODY_HEADER_BYTES + 4 * count + extra) return "token count does not match body length"
  if (count < 1) return "empty token frame"
  if (kind !== 0 && (count !== 1 || h.chunkCount !== 1)) return "Decode/Sampled carries exactly one token"
  let payload: TokenPayload | string
  if (kind === 0) {
    const tokens = new Array<number>(count)
    for (let i = 0; i < count; i++) tokens[i] = view.getUint32(o + 8 + 4 * i, true)
    payload = { _tag: "Prompt", tokens }
  } else {
    const tokenId = view.getUint32(o + 8, true)
    payload = kind === 1 ? { _tag: "Decode", tokenId } : decodeSampled(view, tokenId, flags, nTop)
  }
  if (typeof payload === "string") return payload
  return TokenFrame({
    runId: runIdOf(h.runId),
    edgeId: edgeIdOf(h.edgeId),
    step: h.step,
    chunkIndex: h.chunkIndex,
    chunkCount: h.chunkCount,
    payload
  })
}

const decodeActivationBody = (
  view: DataView,
  h: Header,
  alignment: number,
  aliasPayload: boolean
): WireFrame | string => {
  const o = HEADER_BYTES
  if (h.bodyLength < ACTIVATION_BODY_HEADER_BYTES) return "activation body too short"
  const dtype = view.getUint8(o)
  if (dtype !== 0) return `unsupported dtype ${dtype}`
  const nDrafts = view.getUint8(o + 1)
  if (view.getUint16(o + 2, true) !== 0) return "activation reserved field not zero"
  const startPos = view.getUint32(o + 4, true)
  const nTokens = view.getUint32(o + 8, true)
  const hiddenDim = view.getUint32(o + 12, true)
  const payloadOffset = view.getUint32(o + 16, true)
  const payloadLength = view.getUint32(o + 20, true)
  if (nTokens < 1 || hiddenDim < 1) return "empty activation"
  if (payloadOffset !== activationPayloadOffset(alignment)) return `payload offset ${payloadOffset} is not aligned`
  if (payloadLength !== nTokens * hiddenDim * 4) return "payload length does not match nTokens*hiddenDim*4"
  if (nDrafts >= nTokens) return `${nDrafts} drafted tokens need more than ${nTokens} rows`
  if (h.bodyLength !== payloadOffset - HEADER_BYTES + payloadLength + 4 * nDrafts) {
    return "payload and drafted tokens do not end the body"
  }
  for (let i = o + ACTIVATION_BODY_HEADER_BYTES; i < payloadOffset; i++) {
    if (view.getUint8(i) !== 0) return "non-zero payload padding"
  }
  const at = view.byteOffset + payloadOffset
  let payload: Float32Array
  if (aliasPayload && at % 4 === 0) {
    payload = new Float32Array(view.buffer, at, nTokens * hiddenDim)
  } else {
    payload = new Float32Array(nTokens * hiddenDim)
    new Uint8Array(payload.buffer).set(new Uint8Array(view.buffer, at, payloadLength))
  }
  return ActivationFrame({
    runId: runIdOf(h.runId),
    edgeId: edgeIdOf(h.edgeId),
    step: h.step,
    chunkIndex: h.chunkIndex,
    chunkCount: h.chunkCount,
    startPos,
    nTokens,
    hiddenDim,
    dtype: "f32",
    payload,
    ...(nDrafts === 0 ? {} : { drafts: readDrafts(view, payloadOffset + payloadLength, nDrafts) })
  })
}

const readDrafts = (view: DataView, at: number, n: number): Array<number> =>
  Array.from({ length: n }, (_, i) => view.getUint32(at + 4 * i, true))

const decodeCreditBody = (view: DataView, h: Header): WireFrame | string => {
  if (h.bodyLength !== 8) return "bad credit body length"
  if (view.getUint32(HEADER_BYTES + 4, true) !== 0) return "credit reserved field not zero"
  return CreditFrame({
    runId: runIdOf(h.runId),
    edgeId: edgeIdOf(h.edgeId),
    step: h.step,
    bytes: view.getUint32(HEADER_BYTES, true)
  })
}

const decodeAttachBody = (view: DataView, h: Header): WireFrame | string => {
  const o = HEADER_BYTES
  if (h.bodyLength < 12) return "bad attach body length"
  const wake = view.getUint8(o + 8)
  if (wake > 1) return "bad wake coalescing"
  if (view.getUint8(o + 9) !== 0) return "attach reserved field not zero"
  const pathLength = view.getUint16(o + 10, true)
  if (pathLength > MAX_SHM_PATH || h.bodyLength !== 12 + pathLength) return "bad shared-memory path length"
  return AttachFrame({
    runId: runIdOf(h.runId),
    edgeId: edgeIdOf(h.edgeId),
    dataCapacity: view.getUint32(o, true),
    alignment: view.getUint32(o + 4, true),
    wakeCoalescing: wake === 0 ? "PendingBit" : "EveryFrame",
    sharedMemory: textDecoder.decode(new Uint8Array(view.buffer, view.byteOffset + o + 12, pathLength))
  })
}

const decodeFaultBody = (view: DataView, h: Header): WireFrame | string => {
  const o = HEADER_BYTES
  if (h.bodyLength < 4) return "fault body too short"
  const reasonLen = view.getUint16(o, true)
  const detailLen = view.getUint16(o + 2, true)
  if (reasonLen > 64 || detailLen > MAX_FAULT_TEXT) return "fault text too long"
  if (h.bodyLength !== 4 + reasonLen + detailLen) return "fault lengths do not match body length"
  const text = (start: number, len: number) =>
    textDecoder.decode(new Uint8Array(view.buffer, view.byteOffset + start, len))
  return FaultFrame({
    runId: runIdOf(h.runId),
    edgeId: edgeIdOf(h.edgeId),
    reason: text(o + 4, reasonLen),
    detail: text(o + 4 + reasonLen, detailLen)
  })
}

/** The frame a validated header's body holds, or why it is malformed. */
const decodeBody = (view: DataView, h: Header, alignment: number, aliasPayload: boolean): WireFrame | string => {
  switch (h.type) {
    case FrameType.Token:
      return decodeTokenBody(view, h)
    case FrameType.Activation:
      return decodeActivationBody(view, h, alignment, aliasPayload)
    case FrameType.Credit:
      return decodeCreditBody(view, h)
    case FrameType.Attach:
      return decodeAttachBody(view, h)
    case FrameType.Attached:
      if (h.bodyLength !== 0) return "bad attached body length"
      return AttachedFrame({ runId: runIdOf(h.runId), edgeId: edgeIdOf(h.edgeId) })
    case FrameType.Doorbell:
      if (h.bodyLength !== 0) return "bad doorbell body length"
      return DoorbellFrame({ runId: runIdOf(h.runId), edgeId: edgeIdOf(h.edgeId) })
    case FrameType.Fault:
      return decodeFaultBody(view, h)
    default:
      return `unknown frame type ${h.type}`
  }
}

const decodeWith = (step: DecodeStep, bytes: Uint8Array): Either.Either<WireFrame, DecodeFault> => {
  switch (step._tag) {
    case "Frame":
      return step.length === bytes.length
        ? Either.right(step.frame)
        : Either.left(new Malformed({ detail: `${bytes.length - step.length} trailing bytes` }))
    case "NeedMore":
      return Either.left(new Truncated({ needed: step.needed, available: bytes.length }))
    case "Fault":
      return Either.left(step.fault)
  }
}

/**
 * Decode a buffer that must hold exactly one frame. Total: a short buffer is `Truncated`, trailing
 * bytes are `Malformed`.
 */
export const decode = (bytes: Uint8Array, limits: Limits): Either.Either<WireFrame, DecodeFault> =>
  decodeWith(decodeAt(bytes, 0, limits), bytes)

/**
 * `decode` without the safety net that turns an exception into `Malformed`: the fuzz tests use it, so that a
 * decoder that throws (a bug: every fault must be found by a check) fails them instead of passing as `Malformed`.
 */
export const decodeUnguarded = (bytes: Uint8Array, limits: Limits): Either.Either<WireFrame, DecodeFault> =>
  decodeWith(decodeAtUnguarded(bytes, 0, limits), bytes)

/**
 * Incremental decoder for a byte stream: `push` chunks as they arrive, then call `next` until it
 * answers `NeedMore`. Buffers at most one partial frame (bounded by `limits.maxFrameBytes`, since
 * an oversized announced length faults as soon as the header is in).
 */
export class StreamDecoder {
  private buf: Uint8Array = new Uint8Array(0)
  private off = 0

  /**
   * `aliasPayload`: an activation's payload is a view of the pushed bytes instead of a copy. Only for
   * chunks nobody writes to after `push` (a socket's data events, a drained ring's copy).
   */
  constructor(private readonly aliasPayload = false) {}

  /** Bytes received but not yet decoded. */
  get buffered(): number {
    return this.buf.length - this.off
  }

  push(chunk: Uint8Array): void {
    if (this.off >= this.buf.length) {
      this.buf = chunk
      this.off = 0
    } else {
      const rest = this.buf.subarray(this.off)
      const merged = new Uint8Array(rest.length + chunk.length)
      merged.set(rest, 0)
      merged.set(chunk, rest.length)
      this.buf = merged
      this.off = 0
    }
  }

  next(limits: Limits): DecodeStep {
    const step = decodeAt(this.buf, this.off, limits, this.aliasPayload)
    if (step._tag === "Frame") this.off += step.length
    return step
  }

  /** Called when the stream ends: `Truncated` when a partial frame is left. */
  finish(): Truncated | undefined {
    const left = this.buffered
    if (left === 0) return undefined
    const step = decodeAt(this.buf, this.off, { alignment: 8, maxFrameBytes: 0xffff_ffff })
    return new Truncated({ needed: step._tag === "NeedMore" ? step.needed : left + 1, available: left })
  }
}

// ---------------------------------------------------------------------------------------------
// Chunking and reassembly
// ---------------------------------------------------------------------------------------------

/**
 * Split a data frame into chunks whose encoding fits `maxFrameBytes` (the window). A frame that
 * fits is returned as is. Activations split by token rows, prompts by tokens; a Decode / Sampled
 * token or a single activation row that does not fit is `Oversized`.
 */
export const chunk = (
  frame: DataFrame,
  maxFrameBytes: number,
  alignment: number
): Either.Either<ReadonlyArray<DataFrame>, Oversized | Malformed> => {
  const problem = checkEncodable(frame, alignment)
  if (problem !== undefined) return Either.left(new Malformed({ detail: `cannot encode ${frame._tag}: ${problem}` }))
  const size = encodedLength(frame, alignment)
  if (size <= maxFrameBytes) return Either.right([frame])
  if (frame.chunkCount !== 1) return Either.left(new Oversized({ size, limit: maxFrameBytes }))
  const usable = Math.floor(maxFrameBytes / effectiveAlignment(alignment)) * effectiveAlignment(alignment)
  if (frame._tag === "ActivationFrame") {
    // a speculative step's rows travel whole (its drafts name its rows): the sender keeps them within a window
    if (frame.drafts !== undefined) return Either.left(new Oversized({ size, limit: maxFrameBytes }))
    const rowBytes = frame.hiddenDim * 4
    const perChunk = Math.floor((usable - activationPayloadOffset(alignment)) / rowBytes)
    if (perChunk < 1) return Either.left(new Oversized({ size, limit: maxFrameBytes }))
    const count = Math.ceil(frame.nTokens / perChunk)
    if (count > 0xffff) return Either.left(new Oversized({ size, limit: maxFrameBytes }))
    const chunks: Array<DataFrame> = []
    for (let i = 0; i < count; i++) {
      const first = i * perChunk
      const n = Math.min(perChunk, frame.nTokens - first)
      chunks.push(
        ActivationFrame({
          runId: frame.runId,
          edgeId: frame.edgeId,
          step: frame.step,
          chunkIndex: i,
          chunkCount: count,
          startPos: frame.startPos + first,
          nTokens: n,
          hiddenDim: frame.hiddenDim,
          dtype: frame.dtype,
          payload: frame.payload.subarray(first * frame.hiddenDim, (first + n) * frame.hiddenDim)
        })
      )
    }
    return Either.right(chunks)
  }
  const p = frame.payload
  if (p._tag !== "Prompt") return Either.left(new Oversized({ size, limit: maxFrameBytes }))
  const perChunk = Math.floor((usable - HEADER_BYTES - TOKEN_BODY_HEADER_BYTES) / 4)
  if (perChunk < 1) return Either.left(new Oversized({ size, limit: maxFrameBytes }))
  const count = Math.ceil(p.tokens.length / perChunk)
  if (count > 0xffff) return Either.left(new Oversized({ size, limit: maxFrameBytes }))
  const chunks: Array<DataFrame> = []
  for (let i = 0; i < count; i++) {
    chunks.push(
      TokenFrame({
        runId: frame.runId,
        edgeId: frame.edgeId,
        step: frame.step,
        chunkIndex: i,
        chunkCount: count,
        payload: { _tag: "Prompt", tokens: p.tokens.slice(i * perChunk, (i + 1) * perChunk) }
      })
    )
  }
  return Either.right(chunks)
}
