/**
 * Mutual challenge–response authentication with the cluster token, run on a freshly connected
 * socket before any frame or RPC message is read.
 *
 * Protocol (fixed-size messages, version 1):
 *
 * 1. client → server `Hello`     = "SWH1" u8 version, formats[3], clientNonce[32]
 * 2. server → client `Challenge` = "SWH2" formats[3], u8 0, serverNonce[32],
 *                                  serverProof = HMAC-SHA256(token, "swactor-auth-v1/server" ‖ clientNonce ‖ serverNonce)
 * 3. client checks serverProof, then client → server `Proof` = "SWH3" 4×u8 0,
 *                                  clientProof = HMAC-SHA256(token, "swactor-auth-v1/client" ‖ clientNonce ‖ serverNonce)
 * 4. server checks clientProof, then server → client `Verdict` = "SWH4" u8 (1 accepted, 0 refused: the proof,
 *                                  2 refused: the formats), 3×u8 0
 *
 * `formats` states what the side speaks (src/domain/wireFormats.ts): u8 wire version (WIRE_VERSION), u8 activation
 * format, u8 token-id format; a format byte is an element code (1 f32, 2 f16, 3 bf16, 4 u32, 5 i32) with bit 7 set for
 * big-endian. All zero: not stated (a node of wire 1, which sent zeros there). Once both proofs are checked, each side
 * compares the other's statement with its own and refuses a difference with `WireMismatch`, one line naming both sides'
 * values; so a mixed pipeline (x64 + arm64) cannot silently misread activations, and a node of another release is
 * named as such rather than faulting on its first frame. The formats are compared only after the proofs, so only a
 * peer holding the token learns why it was refused.
 *
 * Both nonces are 32 fresh random bytes per connection, so a recorded handshake replayed against
 * either side fails (the other side's nonce differs); the two proofs use different labels, so a
 * proof cannot be reflected back. Proofs are compared in constant time (`timingSafeEqual`). The
 * token never crosses the wire. The whole handshake is bounded by a timeout (default 5 s).
 *
 * Encryption: on a TCP connection that leaves the host (or always, with SWACTOR_TLS=always) both
 * functions first run TLS 1.3 keyed from the token (Tls.ts) and then this handshake inside the tunnel;
 * loopback TCP and Unix sockets stay plain.
 *
 * Both functions take a connected `net.Socket` and, on success, return the socket to speak on (the
 * TLS socket over it, or itself), paused with no listeners of their own and any bytes that arrived
 * after the handshake back in its read buffer: the next protocol attaches its `data` listener and
 * calls `resume()`. On failure the socket is destroyed.
 */
import { createHmac, randomBytes, timingSafeEqual } from "node:crypto"
import type * as Net from "node:net"
import { Duration, Effect, Redacted } from "effect"
import { endianness } from "node:os"
import { AuthFailed } from "../../domain/frames.js"
import { nodeWireFormats, sameWireFormats, type WireFormats, WireMismatch } from "../../domain/wireFormats.js"
import { secure, type TlsMode } from "./Tls.js"

/** The shared secret of a cluster. Build with `Redacted.make("...")`; never logged. */
export type ClusterToken = Redacted.Redacted<string>

export const NONCE_BYTES = 32
export const HELLO_BYTES = 40
export const CHALLENGE_BYTES = 72
export const PROOF_BYTES = 40
export const VERDICT_BYTES = 8
export const DEFAULT_HANDSHAKE_TIMEOUT: Duration.DurationInput = "5 seconds"

const TAG_HELLO = Buffer.from("SWH1", "ascii")
const TAG_CHALLENGE = Buffer.from("SWH2", "ascii")
const TAG_PROOF = Buffer.from("SWH3", "ascii")
const TAG_VERDICT = Buffer.from("SWH4", "ascii")
const VERSION = 1

/** Element codes of a format byte (its low 7 bits); bit 7 is set for big-endian. */
const ELEMENTS = ["f32", "f16", "bf16", "u32", "i32"]
const BIG_ENDIAN = 0x80
const UNKNOWN_ELEMENT = 0x7f

/** The byte stating `format` (`<element>-<le|be>`). */
const formatByte = (format: string): number => {
  const [element = "", order] = format.split("-")
  const code = ELEMENTS.indexOf(element) + 1
  return (code === 0 ? UNKNOWN_ELEMENT : code) | (order === "be" ? BIG_ENDIAN : 0)
}

/** The format a byte states, in words (an unknown code as `format 0x..`). */
const formatName = (byte: number): string => {
  const element = ELEMENTS[(byte & ~BIG_ENDIAN) - 1]
  return element === undefined
    ? `format 0x${byte.toString(16).padStart(2, "0")}`
    : `${element}-${(byte & BIG_ENDIAN) !== 0 ? "be" : "le"}`
}

/** Write `formats` as its three bytes at `at`. */
const stateFormats = (message: Buffer, at: number, formats: WireFormats): void => {
  message[at] = formats.wire
  message[at + 1] = formatByte(formats.activations)
  message[at + 2] = formatByte(formats.tokenIds)
}

/** The formats stated at `at` (undefined: all zero, not stated). */
const statedFormats = (message: Buffer, at: number): WireFormats | undefined => {
  const [wire = 0, activations = 0, tokenIds = 0] = message.subarray(at, at + 3)
  if (wire === 0 && activations === 0 && tokenIds === 0) return undefined
  return { wire, activations: formatName(activations), tokenIds: formatName(tokenIds) }
}

const agrees = (theirs: WireFormats | undefined, ours: WireFormats): boolean =>
  theirs !== undefined && sameWireFormats(theirs, ours)

/** What this side states: the options' formats, else this node's (its host's byte order). */
const oursOf = (options: HandshakeOptions): WireFormats => options.formats ?? nodeWireFormats(endianness())

/** The peer's address in words: host:port over TCP, "unix socket" over a local socket. */
const peerOf = (socket: Net.Socket): string =>
  socket.remoteAddress === undefined ? "unix socket" : `${socket.remoteAddress}:${socket.remotePort ?? "?"}`

/** HMAC-SHA256(token, label ‖ clientNonce ‖ serverNonce). */
export const proof = (
  token: ClusterToken,
  side: "client" | "server",
  clientNonce: Uint8Array,
  serverNonce: Uint8Array
): Buffer =>
  createHmac("sha256", Redacted.value(token))
    .update(`swactor-auth-v1/${side}`)
    .update(clientNonce)
    .update(serverNonce)
    .digest()

const sameBytes = (a: Uint8Array, b: Uint8Array): boolean => a.length === b.length && timingSafeEqual(a, b)

/** Reads exact byte counts from a socket during the handshake. */
class Reader {
  private chunks: Array<Buffer> = []
  private size = 0
  private waiter: { n: number; resume: (r: Buffer | AuthFailed) => void } | undefined
  private failure: AuthFailed | undefined

  constructor(private readonly socket: Net.Socket) {
    socket.on("data", this.onData)
    socket.on("end", this.onEnd)
    socket.on("close", this.onEnd)
    socket.on("error", this.onError)
    socket.resume()
  }

  private onData = (chunk: Buffer) => {
    this.chunks.push(chunk)
    this.size += chunk.length
    this.poke()
  }
  private onEnd = () =>
    this.fail(new AuthFailed({ detail: "peer closed the connection during the handshake", reason: "closed" }))
  private onError = (err: Error) =>
    this.fail(new AuthFailed({ detail: `socket error during the handshake: ${err.message}`, reason: "closed" }))

  private fail(failure: AuthFailed) {
    this.failure ??= failure
    this.poke()
  }

  private poke() {
    const w = this.waiter
    if (w === undefined) return
    if (this.size >= w.n) {
      this.waiter = undefined
      const all = Buffer.concat(this.chunks, this.size)
      this.chunks = [all.subarray(w.n)]
      this.size -= w.n
      w.resume(all.subarray(0, w.n))
    } else if (this.failure !== undefined) {
      this.waiter = undefined
      w.resume(this.failure)
    }
  }

  read(n: number): Effect.Effect<Buffer, AuthFailed> {
    return Effect.async<Buffer, AuthFailed>((resume) => {
      this.waiter = { n, resume: (r) => resume(r instanceof AuthFailed ? Effect.fail(r) : Effect.succeed(r)) }
      this.poke()
      return Effect.sync(() => {
        this.waiter = undefined
      })
    })
  }

  /** Detach, pause the socket, and put unread bytes back at the front of its buffer. Idempotent. */
  release(): void {
    this.socket.pause()
    this.socket.off("data", this.onData)
    this.socket.off("end", this.onEnd)
    this.socket.off("close", this.onEnd)
    this.socket.off("error", this.onError)
    const rest = Buffer.concat(this.chunks, this.size)
    this.chunks = []
    this.size = 0
    if (rest.length > 0 && !this.socket.destroyed) this.socket.unshift(rest)
  }
}

const write = (socket: Net.Socket, bytes: Uint8Array): Effect.Effect<void, AuthFailed> =>
  Effect.async<void, AuthFailed>((resume) => {
    socket.write(bytes, (err) =>
      resume(
        err ? Effect.fail(new AuthFailed({ detail: `write failed: ${err.message}`, reason: "closed" })) : Effect.void
      )
    )
  })

const expectTag = (msg: Buffer, tag: Buffer, what: string): Effect.Effect<void, AuthFailed> =>
  msg.subarray(0, 4).equals(tag)
    ? Effect.void
    : Effect.fail(new AuthFailed({ detail: `expected ${what}`, reason: "protocol" }))

export interface HandshakeOptions {
  readonly token: ClusterToken
  readonly timeout?: Duration.DurationInput | undefined
  /** Default: --tls / SWACTOR_TLS (auto; config/Settings.ts). */
  readonly tls?: TlsMode | undefined
  /** What this side states (default: this node's, `nodeWireFormats(os.endianness())`); a test states another. */
  readonly formats?: WireFormats | undefined
  /** The peer's name in a refusal (default: the socket's remote address and port). */
  readonly peer?: string | undefined
}

/** Why a handshake failed: the token (`AuthFailed`) or what the peer speaks (`WireMismatch`). */
export type HandshakeError = AuthFailed | WireMismatch

const withReader = (
  socket: Net.Socket,
  options: HandshakeOptions,
  f: (reader: Reader) => Effect.Effect<void, HandshakeError>
): Effect.Effect<void, HandshakeError> =>
  Effect.acquireUseRelease(
    Effect.sync(() => new Reader(socket)),
    (reader) =>
      f(reader).pipe(
        Effect.timeoutFail({
          duration: options.timeout ?? DEFAULT_HANDSHAKE_TIMEOUT,
          onTimeout: () => new AuthFailed({ detail: "handshake timed out", reason: "timeout" })
        })
      ),
    (reader) => Effect.sync(() => reader.release())
  ).pipe(Effect.tapError(() => Effect.sync(() => socket.destroy())))

/**
 * Server side: the peer must prove the token; we prove it back; then its wire version and formats must be ours. On
 * failure the socket is destroyed.
 */
export const serverHandshake = (
  socket: Net.Socket,
  options: HandshakeOptions
): Effect.Effect<Net.Socket, HandshakeError> =>
  secured(socket, "server", options, (link) => serverProtocol(link, options, options.peer ?? peerOf(socket)))

const secured = (
  socket: Net.Socket,
  side: "server" | "client",
  options: HandshakeOptions,
  protocol: (socket: Net.Socket) => Effect.Effect<void, HandshakeError>
): Effect.Effect<Net.Socket, HandshakeError> =>
  secure(socket, side, {
    token: options.token,
    mode: options.tls,
    timeout: options.timeout ?? DEFAULT_HANDSHAKE_TIMEOUT
  }).pipe(Effect.flatMap((link) => protocol(link).pipe(Effect.as(link))))

/** Hello (its version checked) → Challenge stating our formats and proving the token → the peer's Proof. */
const challengePeer = (socket: Net.Socket, reader: Reader, options: HandshakeOptions, ours: WireFormats) =>
  Effect.gen(function* () {
    const hello = yield* reader.read(HELLO_BYTES)
    yield* expectTag(hello, TAG_HELLO, "Hello")
    if (hello[4] !== VERSION) {
      return yield* new AuthFailed({ detail: `unsupported auth version ${hello[4]}`, reason: "protocol" })
    }
    const clientNonce = hello.subarray(8, 8 + NONCE_BYTES)
    const serverNonce = randomBytes(NONCE_BYTES)
    const challenge = Buffer.alloc(CHALLENGE_BYTES)
    TAG_CHALLENGE.copy(challenge, 0)
    stateFormats(challenge, 4, ours)
    serverNonce.copy(challenge, 8)
    proof(options.token, "server", clientNonce, serverNonce).copy(challenge, 8 + NONCE_BYTES)
    yield* write(socket, challenge)
    // A peer that leaves now, having sent a proper Hello, did not accept our proof: it holds another token.
    const msg = yield* reader.read(PROOF_BYTES).pipe(
      Effect.mapError((e) =>
        e.reason === "closed"
          ? new AuthFailed({
              detail: "the peer left after our challenge (it holds another cluster token?)",
              reason: "proof"
            })
          : e
      )
    )
    yield* expectTag(msg, TAG_PROOF, "Proof")
    const ok = sameBytes(msg.subarray(8, 40), proof(options.token, "client", clientNonce, serverNonce))
    return { ok, theirs: statedFormats(hello, 5) }
  })

const serverProtocol = (
  socket: Net.Socket,
  options: HandshakeOptions,
  peer: string
): Effect.Effect<void, HandshakeError> =>
  withReader(socket, options, (reader) =>
    Effect.gen(function* () {
      const ours = oursOf(options)
      const { ok, theirs } = yield* challengePeer(socket, reader, options, ours)
      const agreed = agrees(theirs, ours)
      const verdict = Buffer.alloc(VERDICT_BYTES)
      TAG_VERDICT.copy(verdict, 0)
      verdict[4] = !ok ? 0 : agreed ? 1 : 2
      yield* write(socket, verdict)
      if (!ok)
        return yield* new AuthFailed({ detail: "client proof does not match the cluster token", reason: "proof" })
      if (!agreed) return yield* new WireMismatch({ peer, theirs, ours })
    })
  )

/**
 * Client side: the server must prove the token first; then we prove it; then its wire version and formats must be
 * ours. On failure the socket is destroyed.
 */
export const clientHandshake = (
  socket: Net.Socket,
  options: HandshakeOptions
): Effect.Effect<Net.Socket, HandshakeError> =>
  secured(socket, "client", options, (link) => clientProtocol(link, options, options.peer ?? peerOf(socket)))

const clientProtocol = (
  socket: Net.Socket,
  options: HandshakeOptions,
  peer: string
): Effect.Effect<void, HandshakeError> =>
  withReader(socket, options, (reader) =>
    Effect.gen(function* () {
      const ours = oursOf(options)
      const clientNonce = randomBytes(NONCE_BYTES)
      const hello = Buffer.alloc(HELLO_BYTES)
      TAG_HELLO.copy(hello, 0)
      hello[4] = VERSION
      stateFormats(hello, 5, ours)
      clientNonce.copy(hello, 8)
      yield* write(socket, hello)
      const challenge = yield* reader.read(CHALLENGE_BYTES)
      yield* expectTag(challenge, TAG_CHALLENGE, "Challenge")
      const serverNonce = challenge.subarray(8, 8 + NONCE_BYTES)
      const serverProof = challenge.subarray(8 + NONCE_BYTES, 8 + 2 * NONCE_BYTES)
      if (!sameBytes(serverProof, proof(options.token, "server", clientNonce, serverNonce))) {
        return yield* new AuthFailed({ detail: "server proof does not match the cluster token", reason: "proof" })
      }
      const msg = Buffer.alloc(PROOF_BYTES)
      TAG_PROOF.copy(msg, 0)
      proof(options.token, "client", clientNonce, serverNonce).copy(msg, 8)
      yield* write(socket, msg)
      const verdict = yield* reader.read(VERDICT_BYTES)
      yield* expectTag(verdict, TAG_VERDICT, "Verdict")
      if (verdict[4] === 0) return yield* new AuthFailed({ detail: "server refused our proof", reason: "proof" })
      // A server of wire 1 accepts whatever we state (verdict 1): our own comparison refuses it.
      const theirs = statedFormats(challenge, 4)
      if (verdict[4] !== 1 || !agrees(theirs, ours)) return yield* new WireMismatch({ peer, theirs, ours })
    })
  )
