/**
 * Writes GGUF files (v3 by default): typed metadata of every GGUF value type and a tensor table whose data follows,
 * each tensor aligned and packed in table order exactly as ggml's gguf loader expects. Tensor data is produced
 * lazily, one tensor at a time, so files larger than memory can be written.
 */
import * as Fs from "node:fs"
import { Data, Effect, Exit } from "effect"
import { ggmlTypeName, GgmlShapeError, tensorBytes } from "../../domain/ggmlTypes.js"
import { type GgufValue, GgufValueType } from "../../domain/gguf.js"
import { GGML_MAX_NAME, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC } from "./GgufReader.js"

/** A metadata value with its GGUF type (arrays carry their item type). */
export interface GgufTypedValue {
  readonly type: GgufValueType
  readonly itemType?: GgufValueType
  readonly value: GgufValue
}

type ScalarType = Exclude<GgufValueType, typeof GgufValueType.ARRAY>

/** Constructors for typed metadata values. */
export const GgufValues = {
  u8: (value: number): GgufTypedValue => ({ type: GgufValueType.UINT8, value }),
  i8: (value: number): GgufTypedValue => ({ type: GgufValueType.INT8, value }),
  u16: (value: number): GgufTypedValue => ({ type: GgufValueType.UINT16, value }),
  i16: (value: number): GgufTypedValue => ({ type: GgufValueType.INT16, value }),
  u32: (value: number): GgufTypedValue => ({ type: GgufValueType.UINT32, value }),
  i32: (value: number): GgufTypedValue => ({ type: GgufValueType.INT32, value }),
  f32: (value: number): GgufTypedValue => ({ type: GgufValueType.FLOAT32, value }),
  bool: (value: boolean): GgufTypedValue => ({ type: GgufValueType.BOOL, value }),
  string: (value: string): GgufTypedValue => ({ type: GgufValueType.STRING, value }),
  u64: (value: bigint): GgufTypedValue => ({ type: GgufValueType.UINT64, value }),
  i64: (value: bigint): GgufTypedValue => ({ type: GgufValueType.INT64, value }),
  f64: (value: number): GgufTypedValue => ({ type: GgufValueType.FLOAT64, value }),
  array: (itemType: ScalarType, value: ReadonlyArray<GgufValue>): GgufTypedValue => ({
    type: GgufValueType.ARRAY,
    itemType,
    value
  })
} as const

export interface GgufTensorSpec {
  readonly name: string
  /** ggml type id. */
  readonly type: number
  /** ggml order: dims[0] = ne0. */
  readonly dims: ReadonlyArray<number>
  /**
   * The tensor's bytes (exactly tensorBytes(type, dims) in all), whole or as consecutive chunks; called once, when the
   * tensor is written. Each array must stay unmodified after it is handed over (it may be written later).
   */
  readonly data: () => Uint8Array | Iterable<Uint8Array>
}

export interface GgufWriteSpec {
  /** Metadata in file order. */
  readonly metadata: ReadonlyArray<readonly [string, GgufTypedValue]>
  readonly tensors: ReadonlyArray<GgufTensorSpec>
  /** Default 32; any other power of two adds (or must match) a general.alignment UINT32 key. */
  readonly alignment?: number
  /** 3 (default) or 2: the two encode identically on little-endian hosts. */
  readonly version?: 2 | 3
}

export interface GgufWriteSummary {
  readonly path: string
  readonly bytes: number
  readonly tensors: number
  readonly dataOffset: number
}

export class GgufWriteError extends Data.TaggedError("GgufWriteError")<{
  readonly path: string
  readonly message: string
}> {}

class SpecError {
  constructor(readonly message: string) {}
}

const bad = (message: string): never => {
  throw new SpecError(message)
}

/** A growable little-endian byte buffer for the header. */
class ByteBuilder {
  private buf = new Uint8Array(4096)
  private view = new DataView(this.buf.buffer)
  length = 0

  private grow(n: number): void {
    if (this.length + n <= this.buf.length) return
    let cap = this.buf.length * 2
    while (cap < this.length + n) cap *= 2
    const next = new Uint8Array(cap)
    next.set(this.buf.subarray(0, this.length))
    this.buf = next
    this.view = new DataView(next.buffer)
  }
  u8(v: number): void {
    this.grow(1)
    this.view.setUint8(this.length, v)
    this.length += 1
  }
  i8(v: number): void {
    this.grow(1)
    this.view.setInt8(this.length, v)
    this.length += 1
  }
  u16(v: number): void {
    this.grow(2)
    this.view.setUint16(this.length, v, true)
    this.length += 2
  }
  i16(v: number): void {
    this.grow(2)
    this.view.setInt16(this.length, v, true)
    this.length += 2
  }
  u32(v: number): void {
    this.grow(4)
    this.view.setUint32(this.length, v, true)
    this.length += 4
  }
  i32(v: number): void {
    this.grow(4)
    this.view.setInt32(this.length, v, true)
    this.length += 4
  }
  f32(v: number): void {
    this.grow(4)
    this.view.setFloat32(this.length, v, true)
    this.length += 4
  }
  f64(v: number): void {
    this.grow(8)
    this.view.setFloat64(this.length, v, true)
    this.length += 8
  }
  u64(v: bigint): void {
    this.grow(8)
    this.view.setBigUint64(this.length, v, true)
    this.length += 8
  }
  i64(v: bigint): void {
    this.grow(8)
    this.view.setBigInt64(this.length, v, true)
    this.length += 8
  }
  bytes(b: Uint8Array): void {
    this.grow(b.length)
    this.buf.set(b, this.length)
    this.length += b.length
  }
  string(s: string): void {
    const b = utf8.encode(s)
    this.u64(BigInt(b.length))
    this.bytes(b)
  }
  zeros(n: number): void {
    this.grow(n)
    this.buf.fill(0, this.length, this.length + n)
    this.length += n
  }
  result(): Uint8Array {
    return this.buf.slice(0, this.length)
  }
}

const utf8 = new TextEncoder()

const intIn = (v: GgufValue, lo: number, hi: number, what: string): number => {
  if (typeof v !== "number" || !Number.isInteger(v) || v < lo || v > hi) {
    return bad(`${what}: ${String(v)} is not an integer in [${lo}, ${hi}]`)
  }
  return v
}

const bigIn = (v: GgufValue, lo: bigint, hi: bigint, what: string): bigint => {
  const b = typeof v === "bigint" ? v : typeof v === "number" && Number.isSafeInteger(v) ? BigInt(v) : undefined
  if (b === undefined || b < lo || b > hi) return bad(`${what}: ${String(v)} is not a 64-bit integer in range`)
  return b
}

const writeScalar = (out: ByteBuilder, type: number, v: GgufValue, what: string): void => {
  switch (type) {
    case GgufValueType.UINT8:
      return out.u8(intIn(v, 0, 0xff, what))
    case GgufValueType.INT8:
      return out.i8(intIn(v, -0x80, 0x7f, what))
    case GgufValueType.UINT16:
      return out.u16(intIn(v, 0, 0xffff, what))
    case GgufValueType.INT16:
      return out.i16(intIn(v, -0x8000, 0x7fff, what))
    case GgufValueType.UINT32:
      return out.u32(intIn(v, 0, 0xffffffff, what))
    case GgufValueType.INT32:
      return out.i32(intIn(v, -0x80000000, 0x7fffffff, what))
    case GgufValueType.FLOAT32:
    case GgufValueType.FLOAT64:
      if (typeof v !== "number") return bad(`${what}: ${String(v)} is not a number`)
      return type === GgufValueType.FLOAT32 ? out.f32(v) : out.f64(v)
    case GgufValueType.BOOL:
      if (typeof v !== "boolean") return bad(`${what}: ${String(v)} is not a boolean`)
      return out.u8(v ? 1 : 0)
    case GgufValueType.STRING:
      if (typeof v !== "string") return bad(`${what}: value is not a string`)
      return out.string(v)
    case GgufValueType.UINT64:
      return out.u64(bigIn(v, 0n, 0xffffffffffffffffn, what))
    case GgufValueType.INT64:
      return out.i64(bigIn(v, -(1n << 63n), (1n << 63n) - 1n, what))
    default:
      return bad(`${what}: unknown GGUF value type ${type}`)
  }
}

interface Layout {
  readonly header: Uint8Array
  readonly dataOffset: number
  readonly alignment: number
  readonly tensors: ReadonlyArray<{ readonly spec: GgufTensorSpec; readonly rel: number; readonly size: number }>
  readonly totalBytes: number
}

const layout = (spec: GgufWriteSpec): Layout => {
  let alignment = spec.alignment ?? GGUF_DEFAULT_ALIGNMENT
  if (!Number.isInteger(alignment) || alignment <= 0 || (alignment & (alignment - 1)) !== 0) {
    bad(`alignment ${alignment} is not a power of two`)
  }
  const metadata = [...spec.metadata]
  const keys = new Set<string>()
  for (const [k] of metadata) {
    if (k.length === 0) bad("empty metadata key")
    if (keys.has(k)) bad(`duplicate metadata key "${k}"`)
    keys.add(k)
  }
  const given = metadata.find(([k]) => k === "general.alignment")
  if (given !== undefined) {
    if (given[1].type !== GgufValueType.UINT32) bad("general.alignment must be UINT32")
    if (spec.alignment !== undefined && given[1].value !== spec.alignment) {
      bad(`general.alignment ${String(given[1].value)} disagrees with alignment ${spec.alignment}`)
    }
    alignment = given[1].value as number
  } else if (alignment !== GGUF_DEFAULT_ALIGNMENT) {
    metadata.push(["general.alignment", GgufValues.u32(alignment)])
  }

  const out = new ByteBuilder()
  out.u32(GGUF_MAGIC)
  out.u32(spec.version ?? 3)
  out.u64(BigInt(spec.tensors.length))
  out.u64(BigInt(metadata.length))
  for (const [key, v] of metadata) {
    out.string(key)
    out.u32(v.type)
    if (v.type === GgufValueType.ARRAY) {
      if (v.itemType === undefined || v.itemType === GgufValueType.ARRAY) bad(`array "${key}" needs a scalar item type`)
      if (!Array.isArray(v.value)) bad(`array "${key}" value is not an array`)
      const items = v.value as ReadonlyArray<GgufValue>
      out.u32(v.itemType!)
      out.u64(BigInt(items.length))
      for (let i = 0; i < items.length; i++) writeScalar(out, v.itemType!, items[i]!, `item ${i} of "${key}"`)
    } else {
      writeScalar(out, v.type, v.value, `metadata "${key}"`)
    }
  }

  const names = new Set<string>()
  const tensors: Array<{ spec: GgufTensorSpec; rel: number; size: number }> = []
  let rel = 0
  for (const t of spec.tensors) {
    if (t.name.length === 0 || utf8.encode(t.name).length >= GGML_MAX_NAME) bad(`bad tensor name "${t.name}"`)
    if (names.has(t.name)) bad(`duplicate tensor name "${t.name}"`)
    names.add(t.name)
    if (t.dims.length < 1 || t.dims.length > 4) bad(`tensor "${t.name}" has ${t.dims.length} dimensions`)
    let size: number
    try {
      size = tensorBytes(t.type, t.dims)
    } catch (e) {
      if (e instanceof GgmlShapeError) return bad(`tensor "${t.name}" (${ggmlTypeName(t.type)}): ${e.message}`)
      throw e
    }
    out.string(t.name)
    out.u32(t.dims.length)
    for (const d of t.dims) out.i64(BigInt(d))
    out.u32(t.type)
    out.u64(BigInt(rel))
    tensors.push({ spec: t, rel, size })
    rel += Math.ceil(size / alignment) * alignment
  }
  const tableEnd = out.length
  const dataOffset = spec.tensors.length > 0 ? Math.ceil(tableEnd / alignment) * alignment : tableEnd
  out.zeros(dataOffset - tableEnd)
  const last = tensors[tensors.length - 1]
  const totalBytes = last === undefined ? dataOffset : dataOffset + last.rel + last.size
  return { header: out.result(), dataOffset, alignment, tensors, totalBytes }
}

type Sink = (bytes: Uint8Array) => void

/** The file as consecutive parts (header+table, then each tensor with the padding before it); no padding at the end. */
const parts = (l: Layout): ReadonlyArray<(sink: Sink) => void> => {
  const out: Array<(sink: Sink) => void> = [(sink) => sink(l.header)]
  let pos = 0
  for (const t of l.tensors) {
    const gap = t.rel - pos
    out.push((sink) => {
      if (gap > 0) sink(new Uint8Array(gap))
      const data = t.spec.data()
      let written = 0
      for (const chunk of data instanceof Uint8Array ? [data] : data) {
        written += chunk.length
        if (written > t.size) break
        sink(chunk)
      }
      if (written !== t.size) {
        bad(
          `tensor "${t.spec.name}" data is ${written > t.size ? "over" : written} bytes, its type and shape need ${t.size}`
        )
      }
    })
    pos = t.rel + t.size
  }
  return out
}

const writeError = (path: string) => (e: unknown) =>
  new GgufWriteError({
    path,
    message: e instanceof SpecError ? e.message : e instanceof Error ? e.message : String(e)
  })

/** Encodes a whole GGUF file in memory (small files: tests, corpora). */
export const encodeGguf = (spec: GgufWriteSpec): Effect.Effect<Uint8Array, GgufWriteError> =>
  Effect.try({
    try: () => {
      const l = layout(spec)
      const out = new Uint8Array(l.totalBytes)
      let at = 0
      for (const part of parts(l)) {
        part((b) => {
          out.set(b, at)
          at += b.length
        })
      }
      return out
    },
    catch: writeError("<memory>")
  })

/**
 * Writes a GGUF file, replacing `path`: written to `path.tmp-<pid>` first, renamed when complete, removed on failure or
 * interruption. Yields between tensors, so a long write can be interrupted.
 */
export const writeGgufFile = (path: string, spec: GgufWriteSpec): Effect.Effect<GgufWriteSummary, GgufWriteError> =>
  Effect.gen(function* () {
    const catchError = writeError(path)
    const l = yield* Effect.try({ try: () => layout(spec), catch: catchError })
    const tmp = `${path}.tmp-${process.pid}`
    yield* Effect.acquireUseRelease(
      Effect.try({ try: () => Fs.openSync(tmp, "w"), catch: catchError }),
      (fd) =>
        Effect.gen(function* () {
          const pending: Array<Uint8Array> = []
          let pendingBytes = 0
          const flush = () => {
            if (pendingBytes === 0) return
            const chunk = pending.length === 1 ? pending[0]! : Buffer.concat(pending)
            let off = 0
            while (off < chunk.length) off += Fs.writeSync(fd, chunk, off, chunk.length - off)
            pending.length = 0
            pendingBytes = 0
          }
          const sink: Sink = (b) => {
            pending.push(b)
            pendingBytes += b.length
            if (pendingBytes >= 1 << 22) flush()
          }
          for (const part of parts(l)) {
            yield* Effect.try({ try: () => part(sink), catch: catchError })
            yield* Effect.yieldNow()
          }
          yield* Effect.try({ try: flush, catch: catchError })
        }),
      (fd, exit) =>
        Effect.sync(() => {
          Fs.closeSync(fd)
          if (Exit.isFailure(exit)) Fs.rmSync(tmp, { force: true })
        })
    )
    yield* Effect.try({ try: () => Fs.renameSync(tmp, path), catch: catchError })
    return { path, bytes: l.totalBytes, tensors: l.tensors.length, dataOffset: l.dataOffset }
  }).pipe(Effect.withSpan("GgufWriter.writeGgufFile", { attributes: { path } }))
