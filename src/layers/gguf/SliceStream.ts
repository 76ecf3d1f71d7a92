/**
 * Weight delivery's byte stream (issue 10): a slice's bytes travel on a connection of their own, piped from the
 * orchestrator's slice file into the agent's partial file with backpressure, instead of chunks inside control RPC
 * messages. The connection is a control-plane connection (same address, same handshake: Auth.ts's HMAC challenge,
 * TLS 1.3 across hosts) whose first bytes after the handshake are `SWSL`; the agent's control server hands such a
 * connection here instead of to the RPC protocol (ControlPlane.ts `divert`).
 *
 * Wire (after the handshake; lengths u32 little-endian):
 *
 * 1. orchestrator → agent  "SWSL" u32 n, n bytes JSON `{ v: 1, hash, offset, total, sha256, format }`
 *    (`sha256`: hex SHA-256 of the whole slice file; `offset`: where the agent's partial file ends; `format`: the
 *    slice's format and byte order, `gguf-le` (GGUF is little-endian by its spec): an agent refuses any other in one
 *    line, reason `Io`, before it opens the partial file)
 * 2. agent → orchestrator  u32 n, JSON `{ ok: true }` or `{ ok: false, reason, message }` (a `WeightDeliveryError`)
 * 3. orchestrator → agent  the bytes [offset, total) of the slice file, raw
 * 4. agent → orchestrator  u32 n, JSON `{ ok: true, have: total }` once the file is written and its SHA-256 (the
 *    partial prefix it held, hashed again from disk, then every received byte as it arrives) equals `sha256`;
 *    else `{ ok: false, reason: "Corrupt", ... }` and the partial file is deleted.
 *
 * A connection that drops mid-transfer leaves the agent's partial file with what arrived; the next transfer resumes
 * from its length.
 */
import { createHash, type Hash } from "node:crypto"
import * as Fs from "node:fs"
import type * as Net from "node:net"
import * as Path from "node:path"
import { Effect, Schema } from "effect"
import { WeightDeliveryError } from "../../domain/controlRpc.js"
import type { SliceTransfer } from "../../services/AgentLinks.js"

export const SLICE_STREAM_MAGIC = Buffer.from("SWSL", "ascii")
const VERSION = 1
/** What a slice is: a GGUF file, little-endian (issue 42: a mixed x64 + arm64 pipeline reads it the same everywhere). */
const SLICE_FORMAT = "gguf-le"
const MAX_MESSAGE = 1 << 16
const IDLE_TIMEOUT_MS = 120_000

const Request = Schema.Struct({
  v: Schema.Literal(VERSION),
  hash: Schema.String,
  offset: Schema.Number.pipe(Schema.int(), Schema.nonNegative()),
  total: Schema.Number.pipe(Schema.int(), Schema.nonNegative()),
  sha256: Schema.String,
  format: Schema.String
})
export type SliceStreamRequest = typeof Request.Type

const Refusal = Schema.Struct({
  ok: Schema.Literal(false),
  reason: Schema.Literal("BadHash", "OutOfOrder", "Corrupt", "Io"),
  message: Schema.String
})
const Answer = Schema.Union(Schema.Struct({ ok: Schema.Literal(true), have: Schema.optional(Schema.Number) }), Refusal)

/** A failure of the connection itself (not an answer of the agent). */
export class SliceStreamBroken extends Error {}

/** Reads length-prefixed messages and raw byte runs from a socket, pulling (so the socket's own backpressure holds). */
class Wire {
  private readonly chunks: AsyncIterator<Buffer>
  private held: Buffer = Buffer.alloc(0)

  constructor(socket: Net.Socket) {
    this.chunks = socket[Symbol.asyncIterator]()
  }

  private async more(): Promise<void> {
    const next = await this.chunks.next()
    if (next.done === true) throw new SliceStreamBroken("the connection closed")
    this.held = this.held.length === 0 ? next.value : Buffer.concat([this.held, next.value])
  }

  async bytes(n: number): Promise<Buffer> {
    while (this.held.length < n) await this.more()
    const out = this.held.subarray(0, n)
    this.held = this.held.subarray(n)
    return out
  }

  async message(): Promise<unknown> {
    const n = (await this.bytes(4)).readUInt32LE(0)
    if (n > MAX_MESSAGE) throw new SliceStreamBroken(`a ${n}-byte message is too long`)
    return JSON.parse((await this.bytes(n)).toString("utf8"))
  }

  /** Hands the next `n` bytes to `sink` as they arrive (awaiting it before reading on). */
  async pump(n: number, sink: (chunk: Buffer) => Promise<void> | void): Promise<void> {
    let left = n
    while (left > 0) {
      if (this.held.length === 0) await this.more()
      const chunk = this.held.subarray(0, Math.min(left, this.held.length))
      this.held = this.held.subarray(chunk.length)
      left -= chunk.length
      await sink(chunk)
    }
  }
}

const frame = (value: unknown): Buffer => {
  const body = Buffer.from(JSON.stringify(value), "utf8")
  const head = Buffer.alloc(4)
  head.writeUInt32LE(body.length, 0)
  return Buffer.concat([head, body])
}

/** Writes `bytes`; resolves once the socket can take more (drain), rejects when it closes first. */
const send = (socket: Net.Socket, bytes: Uint8Array): Promise<void> =>
  new Promise((resolve, reject) => {
    if (socket.destroyed) return reject(new SliceStreamBroken("the connection closed"))
    if (socket.write(bytes)) return resolve()
    const onDrain = () => {
      socket.off("close", onClose)
      resolve()
    }
    const onClose = () => {
      socket.off("drain", onDrain)
      reject(new SliceStreamBroken("the connection closed"))
    }
    socket.once("drain", onDrain)
    socket.once("close", onClose)
  })

const refusal = (answer: unknown): WeightDeliveryError | undefined => {
  const decoded = Schema.decodeUnknownOption(Answer)(answer)
  if (decoded._tag === "None")
    return new WeightDeliveryError({ reason: "Io", message: `unexpected answer ${JSON.stringify(answer)}` })
  const value = decoded.value
  return value.ok ? undefined : new WeightDeliveryError({ reason: value.reason, message: value.message })
}

export type SendSliceOptions = SliceTransfer

/**
 * The orchestrator's side: pipes the slice file from `offset` into an authenticated connection (which it owns and
 * destroys at the end). Succeeds with the slice's size once the agent verified it; fails with the agent's refusal
 * (`WeightDeliveryError`) or `SliceStreamBroken`.
 */
export const sendSlice = (
  socket: Net.Socket,
  options: SendSliceOptions
): Effect.Effect<number, WeightDeliveryError | SliceStreamBroken> =>
  Effect.tryPromise({
    try: async (interrupted) => {
      const stop = () => socket.destroy()
      interrupted.addEventListener("abort", stop)
      options.signal?.addEventListener("abort", stop)
      // An agent that never answers (or a link gone silent) ends the transfer instead of hanging it.
      let silent = false
      const silence = options.silenceMillis ?? IDLE_TIMEOUT_MS / 2
      socket.setTimeout(silence, () => {
        silent = true
        socket.destroy()
      })
      try {
        const total = Fs.statSync(options.path).size
        const wire = new Wire(socket)
        const request: SliceStreamRequest = {
          v: VERSION,
          hash: options.hash,
          offset: options.offset,
          total,
          sha256: options.sha256,
          format: SLICE_FORMAT
        }
        await send(socket, Buffer.concat([SLICE_STREAM_MAGIC, frame(request)]))
        const refused = refusal(await wire.message())
        if (refused !== undefined) throw refused
        let offset = options.offset
        if (offset < total) {
          const file = Fs.createReadStream(options.path, {
            start: offset,
            highWaterMark: options.chunkBytes ?? 1 << 20
          })
          try {
            for await (const chunk of file as AsyncIterable<Buffer>) {
              await send(socket, chunk)
              offset += chunk.length
              options.onBytes?.(offset)
              if (options.signal?.aborted === true)
                throw new SliceStreamBroken(String(options.signal.reason ?? "aborted"))
            }
          } finally {
            file.destroy()
          }
        }
        const verdict = refusal(await wire.message())
        if (verdict !== undefined) throw verdict
        return total
      } catch (e) {
        throw silent ? new SliceStreamBroken(`no answer from the agent for ${silence / 1000} s`) : e
      } finally {
        interrupted.removeEventListener("abort", stop)
        options.signal?.removeEventListener("abort", stop)
        socket.destroy()
      }
    },
    catch: (e) =>
      e instanceof WeightDeliveryError || e instanceof SliceStreamBroken
        ? e
        : new SliceStreamBroken(e instanceof Error ? e.message : String(e))
  })

/**
 * The agent's answer to a slice stream stating another format than `gguf-le`: one line naming both, reason `Io` (not
 * `Corrupt`: the orchestrator does not send the slice again, whole, in a format this node cannot read).
 */
const formatRefusal = (format: string) => ({
  ok: false,
  reason: "Io",
  message: `the slice stream sends ${JSON.stringify(format)} slices; this node reads ${SLICE_FORMAT} only: refused`
})

/** Where the agent keeps a slice while it arrives, and what happens once it verified. */
export interface SliceSink {
  /**
   * The partial file of `hash` (a `BadHash` refusal for a malformed hash), once no other transfer of it is running;
   * `release` ends this one's hold on it.
   */
  readonly open: (
    hash: string
  ) => Effect.Effect<{ readonly path: string; readonly release: () => void }, WeightDeliveryError>
  /** Called with the partial file's size once its SHA-256 matched the orchestrator's. */
  readonly verified: (hash: string, size: number) => void
}

/** Hashes `n` bytes of `fd` from the start (the partial prefix a resumed transfer continues), off the event loop. */
const hashPrefix = async (hash: Hash, fd: number, n: number): Promise<void> => {
  if (n === 0) return
  let got = 0
  const prefix = Fs.createReadStream("", { fd, start: 0, end: n - 1, autoClose: false, highWaterMark: 4 << 20 })
  for await (const chunk of prefix as AsyncIterable<Buffer>) {
    hash.update(chunk)
    got += chunk.length
  }
  if (got !== n) throw new Error("the partial slice shrank while it was read")
}

/** Appends to `fd` from a queue of chunks in the background; `write` waits only when a few MiB are in flight. */
const appender = (fd: number) => {
  const file = Fs.createWriteStream("", { fd, autoClose: false, highWaterMark: 8 << 20 })
  let failure: Error | undefined
  file.on("error", (e) => (failure = e))
  return {
    write: (chunk: Buffer): Promise<void> | void => {
      if (failure !== undefined) throw failure
      if (file.write(chunk)) return
      return new Promise<void>((resolve, reject) => {
        file.once("drain", resolve)
        file.once("error", reject)
      })
    },
    /** Flushes what is queued (the fd stays open). */
    end: () =>
      new Promise<void>((resolve, reject) => {
        if (failure !== undefined) return reject(failure)
        file.end(() => (failure === undefined ? resolve() : reject(failure)))
      })
  }
}

/**
 * The agent's side of one connection whose `SWSL` magic was seen (still unread): takes the request, appends the
 * bytes to the partial slice with the SHA-256 running, answers. Never fails: a bad request or a dropped connection
 * ends it (the partial file keeps what arrived).
 */
export const receiveSlice = (socket: Net.Socket, sink: SliceSink): Effect.Effect<void> =>
  Effect.promise(async () => {
    const wire = new Wire(socket)
    const answer = (value: unknown) => send(socket, frame(value))
    // An orchestrator that went silent (a half-open link across hosts) does not hold the slice forever.
    socket.setTimeout(IDLE_TIMEOUT_MS, () => socket.destroy())
    let fd: number | undefined
    let release: (() => void) | undefined
    try {
      const magic = await wire.bytes(SLICE_STREAM_MAGIC.length)
      if (!magic.equals(SLICE_STREAM_MAGIC)) return
      const decoded = Schema.decodeUnknownOption(Request)(await wire.message())
      if (decoded._tag === "None") return await answer({ ok: false, reason: "Io", message: "malformed slice request" })
      const request = decoded.value
      if (request.format !== SLICE_FORMAT) return await answer(formatRefusal(request.format))
      const opened = await Effect.runPromise(Effect.either(sink.open(request.hash)))
      if (opened._tag === "Left")
        return await answer({ ok: false, reason: opened.left.reason, message: opened.left.message })
      release = opened.right.release
      const path = opened.right.path
      Fs.mkdirSync(Path.dirname(path), { recursive: true })
      fd = Fs.openSync(path, "a+")
      const have = Fs.fstatSync(fd).size
      if (have > request.total) {
        // Longer than the slice: not a prefix of it. Dropped; the orchestrator sends the slice whole.
        Fs.closeSync(fd)
        fd = undefined
        Fs.rmSync(path, { force: true })
        return await answer({
          ok: false,
          reason: "Corrupt",
          message: `the partial slice (${have} bytes) is longer than the slice; it was discarded`
        })
      }
      if (request.offset !== have) {
        return await answer({
          ok: false,
          reason: "OutOfOrder",
          message: `a transfer from ${request.offset} of ${request.total} bytes, the partial slice has ${have} bytes`
        })
      }
      const hash = createHash("sha256")
      await hashPrefix(hash, fd, have)
      await answer({ ok: true })
      const out = appender(fd)
      try {
        await wire.pump(request.total - request.offset, (chunk) => {
          hash.update(chunk)
          return out.write(chunk)
        })
      } finally {
        // What arrived stays in the partial file, complete or not (a later transfer resumes after it).
        await out.end()
      }
      const size = Fs.fstatSync(fd).size
      if (hash.digest("hex") !== request.sha256 || size !== request.total) {
        Fs.closeSync(fd)
        fd = undefined
        Fs.rmSync(path, { force: true })
        return await answer({
          ok: false,
          reason: "Corrupt",
          message: "the received slice's SHA-256 does not match the orchestrator's; it was discarded"
        })
      }
      sink.verified(request.hash, size)
      await answer({ ok: true, have: size })
    } catch {
      // A dropped connection or a disk error: the orchestrator sees the connection end.
    } finally {
      if (fd !== undefined) Fs.closeSync(fd)
      release?.()
      socket.end()
    }
  })
