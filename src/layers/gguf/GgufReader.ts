/**
 * A validating GGUF v2/v3 parser in TypeScript. It reads the header, the metadata and the tensor table with bounded
 * file reads (never the tensor data, never a mapping of the whole file) and rejects, as a typed ModelLoadError,
 * everything that could later make ggml assert: every count, length, shape, type and offset is checked against the
 * file before it is trusted, so a lying field cannot cause a huge allocation or a long loop.
 */
import * as Fs from "node:fs"
import * as Path from "node:path"
import { Effect, Option } from "effect"
import { ggmlTypeInfo } from "../../domain/ggmlTypes.js"
import {
  type GgufFile,
  type GgufTensorInfo,
  type GgufValue,
  type GgufValueKind,
  GgufValueType,
  ModelLoadError,
  type ModelLoadReason
} from "../../domain/gguf.js"
import { mergeSplitSet, resolveModelPath, splitPartPath, splitPosition, splitPrefix } from "./GgufSplit.js"

/** "GGUF" read as a little-endian uint32. */
export const GGUF_MAGIC = 0x46554747
export const GGUF_DEFAULT_ALIGNMENT = 32
/** ggml's GGML_MAX_NAME: a tensor name must be shorter than this many bytes. */
export const GGML_MAX_NAME = 64
export const GGML_MAX_DIMS = 4

/** Limits beyond which a value is rejected as absurd even when the file is big enough to hold it. */
export const GgufLimits = {
  /** Longest metadata string (key or value), in bytes. */
  maxStringBytes: 16 * 1024 * 1024,
  /** Most elements of one metadata array. */
  maxArrayLength: 16 * 1024 * 1024,
  /** Largest general.alignment accepted. */
  maxAlignment: 1024 * 1024,
  /**
   * Most bytes of header, metadata and tensor table together. Real models need tens of MiB (a 256k-token vocabulary
   * with merges); the cap bounds what a lying count can make the parser read and keep from a multi-GB file.
   */
  maxHeaderBytes: 256 * 1024 * 1024
} as const

export type GgufLimitSettings = { readonly [K in keyof typeof GgufLimits]: number }

/** Random-access bytes of a file (or of a buffer, for tests). `read` may return fewer bytes only at the end. */
export interface ByteSource {
  readonly size: number
  readonly read: (position: number, length: number) => Uint8Array
  /** Bytes the parser asks for at a time (default 1 MiB): a remote source asks for less. */
  readonly readAhead?: number
}

class ParseFailure {
  constructor(
    readonly reason: ModelLoadReason,
    readonly message: string
  ) {}
}

class IoFailure {
  constructor(readonly message: string) {}
}

const fail = (reason: ModelLoadReason, message: string): never => {
  throw new ParseFailure(reason, message)
}

// Smallest encodings, used to bound counts by the bytes left in the file.
const MIN_KV_BYTES = 8 + 1 + 4 + 1 // key length, 1-byte key, value type, 1-byte value
const MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8 // name length, 1-byte name, n_dims, ne0, type, offset

const scalarSize = (type: number): number | undefined => {
  switch (type) {
    case GgufValueType.UINT8:
    case GgufValueType.INT8:
    case GgufValueType.BOOL:
      return 1
    case GgufValueType.UINT16:
    case GgufValueType.INT16:
      return 2
    case GgufValueType.UINT32:
    case GgufValueType.INT32:
    case GgufValueType.FLOAT32:
      return 4
    case GgufValueType.UINT64:
    case GgufValueType.INT64:
    case GgufValueType.FLOAT64:
      return 8
    case GgufValueType.STRING:
      return 8 // the length prefix; the bytes follow
    default:
      return undefined
  }
}

const strictUtf8 = new TextDecoder("utf-8", { fatal: true })
const lenientUtf8 = new TextDecoder("utf-8")

const CHUNK = 1 << 20

/** A forward cursor over a ByteSource with a 1 MiB read-ahead window. */
class Cursor {
  pos = 0
  private buf: Uint8Array = new Uint8Array(0)
  private view: DataView = new DataView(this.buf.buffer)
  private bufStart = 0

  constructor(
    private readonly src: ByteSource,
    readonly limits: GgufLimitSettings
  ) {}

  get remaining(): number {
    return this.src.size - this.pos
  }

  /** Makes [pos, pos + n) available in the window and returns its offset there. */
  private ensure(n: number, what: string): number {
    if (this.pos + n > this.limits.maxHeaderBytes) {
      fail(
        "InvalidMetadata",
        `header, metadata and tensor table run past the ${this.limits.maxHeaderBytes}-byte limit while reading ${what} ` +
          `at offset ${this.pos}`
      )
    }
    if (n > this.remaining) {
      fail("Truncated", `file ends at byte ${this.src.size} while reading ${what} (${n} bytes at offset ${this.pos})`)
    }
    const rel = this.pos - this.bufStart
    if (rel >= 0 && rel + n <= this.buf.length) return rel
    const want = Math.min(Math.max(n, this.src.readAhead ?? CHUNK), this.remaining)
    const got = this.src.read(this.pos, want)
    if (got.length < n) {
      fail("Truncated", `file ends at byte ${this.pos + got.length} while reading ${what} (offset ${this.pos})`)
    }
    this.buf = got
    this.view = new DataView(got.buffer, got.byteOffset, got.byteLength)
    this.bufStart = this.pos
    return 0
  }

  u8(what: string): number {
    const r = this.ensure(1, what)
    this.pos += 1
    return this.view.getUint8(r)
  }
  i8(what: string): number {
    const r = this.ensure(1, what)
    this.pos += 1
    return this.view.getInt8(r)
  }
  u16(what: string): number {
    const r = this.ensure(2, what)
    this.pos += 2
    return this.view.getUint16(r, true)
  }
  i16(what: string): number {
    const r = this.ensure(2, what)
    this.pos += 2
    return this.view.getInt16(r, true)
  }
  u32(what: string): number {
    const r = this.ensure(4, what)
    this.pos += 4
    return this.view.getUint32(r, true)
  }
  i32(what: string): number {
    const r = this.ensure(4, what)
    this.pos += 4
    return this.view.getInt32(r, true)
  }
  f32(what: string): number {
    const r = this.ensure(4, what)
    this.pos += 4
    return this.view.getFloat32(r, true)
  }
  u64(what: string): bigint {
    const r = this.ensure(8, what)
    this.pos += 8
    return this.view.getBigUint64(r, true)
  }
  i64(what: string): bigint {
    const r = this.ensure(8, what)
    this.pos += 8
    return this.view.getBigInt64(r, true)
  }
  f64(what: string): number {
    const r = this.ensure(8, what)
    this.pos += 8
    return this.view.getFloat64(r, true)
  }
  bytes(n: number, what: string): Uint8Array {
    const r = this.ensure(n, what)
    this.pos += n
    return this.buf.subarray(r, r + n)
  }
}

const describe = (n: bigint): string => n.toString()

/** A u64 count/length that must be a safe integer and at most `max`. */
const boundedCount = (
  value: bigint,
  max: number,
  reasonIfOver: ModelLoadReason,
  message: (v: string) => string
): number => {
  if (value > BigInt(Math.max(0, max))) fail(reasonIfOver, message(describe(value)))
  return Number(value)
}

interface Parsed {
  readonly version: number
  readonly alignment: number
  readonly dataOffset: number
  readonly metadata: Map<string, GgufValue>
  readonly metadataTypes: Map<string, GgufValueKind>
  readonly tensors: Array<GgufTensorInfo>
  readonly tensorsByName: Map<string, GgufTensorInfo>
}

const readString = (c: Cursor, what: string, strict: boolean): string => {
  const at = c.pos
  const len = c.u64(`length of ${what}`)
  if (len > BigInt(c.limits.maxStringBytes)) {
    if (len > BigInt(c.remaining)) {
      fail(
        "Truncated",
        `${what} at offset ${at} declares length ${len}, beyond the ${c.remaining} bytes left in the file`
      )
    }
    fail(
      "InvalidMetadata",
      `${what} at offset ${at} declares length ${len}, over the ${c.limits.maxStringBytes}-byte limit`
    )
  }
  const n = Number(len)
  if (n > c.remaining) {
    fail("Truncated", `${what} at offset ${at} declares length ${n}, beyond the ${c.remaining} bytes left in the file`)
  }
  const raw = c.bytes(n, what)
  if (!strict) return lenientUtf8.decode(raw)
  try {
    return strictUtf8.decode(raw)
  } catch {
    return fail("InvalidMetadata", `${what} at offset ${at} is not valid UTF-8`)
  }
}

const readScalar = (c: Cursor, type: number, what: string): GgufValue => {
  switch (type) {
    case GgufValueType.UINT8:
      return c.u8(what)
    case GgufValueType.INT8:
      return c.i8(what)
    case GgufValueType.UINT16:
      return c.u16(what)
    case GgufValueType.INT16:
      return c.i16(what)
    case GgufValueType.UINT32:
      return c.u32(what)
    case GgufValueType.INT32:
      return c.i32(what)
    case GgufValueType.FLOAT32:
      return c.f32(what)
    case GgufValueType.BOOL: {
      const at = c.pos
      const b = c.u8(what)
      if (b > 1) fail("InvalidMetadata", `${what} at offset ${at} is a bool with byte value ${b} (must be 0 or 1)`)
      return b === 1
    }
    case GgufValueType.STRING:
      return readString(c, what, false)
    case GgufValueType.UINT64:
      return c.u64(what)
    case GgufValueType.INT64:
      return c.i64(what)
    case GgufValueType.FLOAT64:
      return c.f64(what)
    default:
      return fail("InvalidMetadata", `${what} has unknown value type ${type}`)
  }
}

const typeName = (t: number): string => {
  for (const [k, v] of Object.entries(GgufValueType)) if (v === t) return k
  return `unknown(${t})`
}

/** The magic, the version (2 or 3, little-endian) and the two counts, each bounded by what the file can hold. */
const readHeader = (c: Cursor, src: ByteSource) => {
  if (src.size < 4) fail("NotGguf", `file is ${src.size} bytes, too short for the GGUF magic`)
  const magic = c.u32("magic")
  if (magic !== GGUF_MAGIC) {
    const text = Array.from(new Uint8Array(new Uint32Array([magic]).buffer))
      .map((b) => (b >= 0x20 && b < 0x7f ? String.fromCharCode(b) : `\\x${b.toString(16).padStart(2, "0")}`))
      .join("")
    fail("NotGguf", `bad magic "${text}" at offset 0 (expected "GGUF")`)
  }
  const version = c.u32("version")
  if (version === 0x0200_0000 || version === 0x0300_0000) {
    // gguf-py writes big-endian files on request: their version reads byte-swapped here (issue 42).
    fail(
      "UnsupportedVersion",
      `GGUF version ${version} at offset 4 is version ${version >>> 24} byte-swapped: a big-endian GGUF; swactor ` +
        "reads little-endian GGUF files only (convert it without --bigendian)"
    )
  }
  if (version !== 2 && version !== 3) {
    fail("UnsupportedVersion", `GGUF version ${version} at offset 4 is not supported (only 2 and 3)`)
  }

  const nTensorsRaw = c.u64("tensor count")
  const nKvRaw = c.u64("metadata count")
  // Each entry needs a minimum number of bytes, so a count the file cannot hold is rejected before any loop runs.
  const afterHeader = c.remaining
  const nTensors = boundedCount(
    nTensorsRaw,
    Math.floor(afterHeader / MIN_TENSOR_INFO_BYTES),
    "Truncated",
    (v) => `header declares ${v} tensors, which cannot fit in the ${afterHeader} bytes after the header (offset 8)`
  )
  const nKv = boundedCount(
    nKvRaw,
    Math.floor((afterHeader - nTensors * MIN_TENSOR_INFO_BYTES) / MIN_KV_BYTES),
    "Truncated",
    (v) =>
      `header declares ${v} metadata entries (and ${nTensors} tensors), which cannot fit in the ${afterHeader} bytes ` +
      `after the header (offset 16)`
  )
  return { version, nTensors, nKv }
}

/** An array value of metadata `key` (its item type and length read and bounded first). */
const readArray = (c: Cursor, key: string): { items: Array<GgufValue>; itemType: number } => {
  const itemTypeAt = c.pos
  const itemType = c.u32(`item type of array "${key}"`)
  const itemSize = scalarSize(itemType)
  if (itemSize === undefined) {
    fail(
      "InvalidMetadata",
      `array "${key}" has ${itemType === GgufValueType.ARRAY ? "nested array" : "unknown"} item type ${itemType} ` +
        `at offset ${itemTypeAt}`
    )
  }
  const lenAt = c.pos
  const lenRaw = c.u64(`length of array "${key}"`)
  const left = c.remaining
  if (lenRaw * BigInt(itemSize!) > BigInt(left)) {
    fail(
      "Truncated",
      `array "${key}" at offset ${lenAt} declares ${lenRaw} items of ${typeName(itemType)}, beyond the ${left} ` +
        `bytes left in the file`
    )
  }
  const len = boundedCount(
    lenRaw,
    c.limits.maxArrayLength,
    "InvalidMetadata",
    (v) => `array "${key}" at offset ${lenAt} declares ${v} items, over the ${c.limits.maxArrayLength} limit`
  )
  const items: Array<GgufValue> = new Array(len)
  for (let j = 0; j < len; j++) items[j] = readScalar(c, itemType, `item ${j} of array "${key}"`)
  return { items, itemType }
}

/** The `nKv` metadata entries: keys non-empty and unique, each value of a known type. */
const readMetadata = (c: Cursor, nKv: number) => {
  const metadata = new Map<string, GgufValue>()
  const metadataTypes = new Map<string, GgufValueKind>()
  for (let i = 0; i < nKv; i++) {
    const keyAt = c.pos
    const key = readString(c, `metadata key #${i}`, true)
    if (key.length === 0) fail("InvalidMetadata", `metadata key #${i} at offset ${keyAt} is empty`)
    if (metadata.has(key)) fail("InvalidMetadata", `duplicate metadata key "${key}" (entry #${i} at offset ${keyAt})`)
    const typeAt = c.pos
    const type = c.u32(`value type of "${key}"`)
    if (type === GgufValueType.ARRAY) {
      const { items, itemType } = readArray(c, key)
      metadata.set(key, items)
      metadataTypes.set(key, { type: GgufValueType.ARRAY, itemType: itemType as GgufValueType })
    } else {
      if (scalarSize(type) === undefined) {
        fail("InvalidMetadata", `metadata "${key}" has unknown value type ${type} at offset ${typeAt}`)
      }
      metadata.set(key, readScalar(c, type, `value of "${key}"`))
      metadataTypes.set(key, { type: type as GgufValueType })
    }
  }
  return { metadata, metadataTypes }
}

/** `general.alignment` (a UINT32 power of two within the limit), else the default. */
const readAlignment = (
  metadata: ReadonlyMap<string, GgufValue>,
  metadataTypes: ReadonlyMap<string, GgufValueKind>,
  limits: GgufLimitSettings
): number => {
  let alignment = GGUF_DEFAULT_ALIGNMENT
  const alignKind = metadataTypes.get("general.alignment")
  if (alignKind !== undefined) {
    if (alignKind.type !== GgufValueType.UINT32) {
      fail("InvalidMetadata", `general.alignment must be a UINT32 but is ${typeName(alignKind.type)}`)
    }
    alignment = metadata.get("general.alignment") as number
    if (alignment === 0 || (alignment & (alignment - 1)) !== 0) {
      fail("InvalidMetadata", `general.alignment ${alignment} is not a power of two`)
    }
    if (alignment > limits.maxAlignment) {
      fail("InvalidMetadata", `general.alignment ${alignment} is over the ${limits.maxAlignment} limit`)
    }
  }
  return alignment
}

/** A tensor table entry as read, before its data offset is checked. */
interface RawTensor {
  readonly name: string
  readonly type: number
  readonly dims: ReadonlyArray<number>
  readonly relOffset: bigint
  readonly byteSize: number
  readonly tableAt: number
}

/** A tensor's dimensions (1..4, each > 0, under 2^53 elements in all) and its element count. */
const readDims = (c: Cursor, name: string) => {
  const nDimsAt = c.pos
  const nDims = c.u32(`n_dims of tensor "${name}"`)
  if (nDims < 1 || nDims > GGML_MAX_DIMS) {
    fail("TensorShapeMismatch", `tensor "${name}" has ${nDims} dimensions at offset ${nDimsAt} (must be 1..4)`)
  }
  const dims: Array<number> = []
  let elements = 1n
  for (let d = 0; d < nDims; d++) {
    const at = c.pos
    const ne = c.i64(`dimension ${d} of tensor "${name}"`)
    if (ne <= 0n) fail("TensorShapeMismatch", `tensor "${name}" dimension ${d} is ${ne} at offset ${at} (must be > 0)`)
    elements *= ne
    if (elements > BigInt(Number.MAX_SAFE_INTEGER)) {
      fail(
        "TensorShapeMismatch",
        `tensor "${name}" has more than 2^53 elements (dimension ${d} = ${ne} at offset ${at})`
      )
    }
    dims.push(Number(ne))
  }
  return { dims, elements }
}

/** Tensor table entry #i: a unique name ggml can hold, its shape, a known type whose blocks tile its rows. */
const readTensorEntry = (c: Cursor, i: number, seen: Map<string, number>): RawTensor => {
  const tableAt = c.pos
  const name = readString(c, `name of tensor #${i}`, true)
  if (name.length === 0) fail("InvalidMetadata", `tensor #${i} at offset ${tableAt} has an empty name`)
  const nameBytes = Buffer.byteLength(name, "utf8")
  if (nameBytes >= GGML_MAX_NAME) {
    fail(
      "InvalidMetadata",
      `tensor #${i} name "${name}" is ${nameBytes} bytes, ggml allows at most ${GGML_MAX_NAME - 1}`
    )
  }
  const prev = seen.get(name)
  if (prev !== undefined) fail("InvalidMetadata", `duplicate tensor name "${name}" (tensors #${prev} and #${i})`)
  seen.set(name, i)

  const { dims, elements } = readDims(c, name)
  const typeAt = c.pos
  const type = c.u32(`ggml type of tensor "${name}"`)
  const info = ggmlTypeInfo(type)
  if (info === undefined) {
    fail("UnsupportedTensorType", `tensor "${name}" has unknown ggml type ${type} at offset ${typeAt}`)
  }
  const t = info!
  if (dims[0]! % t.blockSize !== 0) {
    fail(
      "TensorShapeMismatch",
      `tensor "${name}" of type ${t.name} has ne0 = ${dims[0]}, not a multiple of the block size ${t.blockSize}`
    )
  }
  const byteSize = (Number(elements) / t.blockSize) * t.typeSize
  if (!Number.isSafeInteger(byteSize)) {
    fail("TensorShapeMismatch", `tensor "${name}" of shape [${dims.join(", ")}] is larger than 2^53 bytes`)
  }
  const relOffset = c.u64(`data offset of tensor "${name}"`)
  return { name, type, dims, relOffset, byteSize, tableAt }
}

/**
 * Each tensor's data where ggml's gguf loader requires it: at exactly the aligned end of the previous one, in table
 * order, inside the file. Returns the tensors and the bytes their data spans.
 */
const placeTensors = (raw: ReadonlyArray<RawTensor>, dataOffset: number, alignment: number, size: number) => {
  const tensors: Array<GgufTensorInfo> = []
  const tensorsByName = new Map<string, GgufTensorInfo>()
  let expected = 0
  for (const r of raw) {
    if (r.relOffset % BigInt(alignment) !== 0n) {
      fail(
        "OffsetOutOfBounds",
        `tensor "${r.name}" data offset ${r.relOffset} is not a multiple of the alignment ${alignment}`
      )
    }
    if (r.relOffset < BigInt(expected)) {
      fail(
        "OffsetOutOfBounds",
        `tensor "${r.name}" data offset ${r.relOffset} overlaps the previous tensor, which ends at ${expected}`
      )
    }
    if (r.relOffset !== BigInt(expected)) {
      fail(
        "OffsetOutOfBounds",
        `tensor "${r.name}" data offset ${r.relOffset} is not where ggml expects it (${expected}: tensors packed in ` +
          `table order)`
      )
    }
    const offset = dataOffset + expected
    const end = offset + r.byteSize
    if (end > size) {
      fail("Truncated", `tensor "${r.name}" data [${offset}, ${end}) extends past the end of the file (${size} bytes)`)
    }
    expected += Math.ceil(r.byteSize / alignment) * alignment
    const info: GgufTensorInfo = { name: r.name, type: r.type, dims: r.dims, offset, byteSize: r.byteSize }
    tensors.push(info)
    tensorsByName.set(r.name, info)
  }
  return { tensors, tensorsByName, dataBytes: expected }
}

const parse = (src: ByteSource, limits: GgufLimitSettings): Parsed => {
  const c = new Cursor(src, limits)
  const { version, nTensors, nKv } = readHeader(c, src)
  const { metadata, metadataTypes } = readMetadata(c, nKv)
  const alignment = readAlignment(metadata, metadataTypes, limits)
  const raw: Array<RawTensor> = []
  const seen = new Map<string, number>()
  for (let i = 0; i < nTensors; i++) raw.push(readTensorEntry(c, i, seen))

  // ggml: the data section starts at the next multiple of the alignment after the table (when there are tensors).
  const tableEnd = c.pos
  const dataOffset = nTensors > 0 ? Math.ceil(tableEnd / alignment) * alignment : tableEnd
  if (nTensors > 0 && dataOffset > src.size) {
    fail("Truncated", `file ends at byte ${src.size}, before the tensor data section at offset ${dataOffset}`)
  }
  const { tensors, tensorsByName, dataBytes } = placeTensors(raw, dataOffset, alignment, src.size)

  // Writers end the file at the (padded) end of the last tensor. More bytes than one alignment's padding mean the
  // table does not describe the file (e.g. a tensor count one short, which would shift every tensor's data).
  const described = nTensors > 0 ? dataOffset + dataBytes : tableEnd
  const slack = Math.max(alignment, GGUF_DEFAULT_ALIGNMENT)
  if (src.size - described >= slack) {
    fail(
      "OffsetOutOfBounds",
      `file has ${src.size - described} bytes after the end of the tensor data at offset ${described}: the tensor ` +
        `table (${nTensors} tensors) does not describe the file`
    )
  }

  return { version, alignment, dataOffset, metadata, metadataTypes, tensors, tensorsByName }
}

const toFile = (path: string, size: number, p: Parsed): GgufFile => ({
  path,
  version: p.version,
  alignment: p.alignment,
  dataOffset: p.dataOffset,
  fileSize: size,
  metadata: p.metadata,
  metadataTypes: p.metadataTypes,
  tensors: p.tensors,
  tensorsByName: p.tensorsByName
})

const run = (
  path: string,
  src: ByteSource,
  limits: Partial<GgufLimitSettings> = {}
): Effect.Effect<GgufFile, ModelLoadError> =>
  Effect.suspend(() => {
    try {
      return Effect.succeed(toFile(path, src.size, parse(src, { ...GgufLimits, ...limits })))
    } catch (e) {
      if (e instanceof ParseFailure)
        return Effect.fail(new ModelLoadError({ path, reason: e.reason, message: e.message }))
      if (e instanceof IoFailure) {
        return Effect.fail(new ModelLoadError({ path, reason: "Io", message: `reading ${path}: ${e.message}` }))
      }
      return Effect.die(e)
    }
  })

/** Parses GGUF bytes held in memory (tests, fuzzing). `path` only labels errors; `limits` override GgufLimits. */
export const parseGgufBytes = (
  bytes: Uint8Array,
  path = "<memory>",
  limits: Partial<GgufLimitSettings> = {}
): Effect.Effect<GgufFile, ModelLoadError> =>
  run(
    path,
    {
      size: bytes.length,
      read: (position, length) => bytes.subarray(position, Math.min(bytes.length, position + length))
    },
    limits
  )

/**
 * What a ByteSource holding only a prefix of its file throws when the parser reads past that prefix: the parse is
 * run again once the source holds at least `upTo` bytes (src/layers/gguf/RemoteGguf.ts, a header read over HTTP).
 */
export class NeedMoreBytes {
  constructor(readonly upTo: number) {}
}

/** Parses a ByteSource that may hold only a prefix of the file: NeedMoreBytes says how far it must reach. */
export const parseGgufPrefix = (
  source: ByteSource,
  path: string,
  limits: Partial<GgufLimitSettings> = {}
): Effect.Effect<GgufFile | NeedMoreBytes, ModelLoadError> =>
  run(path, source, limits).pipe(
    Effect.catchSomeDefect((e) => (e instanceof NeedMoreBytes ? Option.some(Effect.succeed(e)) : Option.none()))
  )

/** Parses any ByteSource. */
export const parseGgufSource = (
  source: ByteSource,
  path: string,
  limits: Partial<GgufLimitSettings> = {}
): Effect.Effect<GgufFile, ModelLoadError> => run(path, source, limits)

const fdSource = (fd: number, size: number): ByteSource => ({
  size,
  read: (position, length) => {
    const out = Buffer.allocUnsafe(length)
    let got = 0
    try {
      while (got < length) {
        const n = Fs.readSync(fd, out, got, length - got, position + got)
        if (n === 0) break
        got += n
      }
    } catch (e) {
      throw new IoFailure(e instanceof Error ? e.message : String(e))
    }
    return new Uint8Array(out.buffer, out.byteOffset, got)
  }
})

/**
 * Reads and validates one GGUF file's header, metadata and tensor table (not the tensor data), as it is: a part of a
 * split set stays one part. Every failure is a ModelLoadError whose message names the offending key, tensor or offset.
 */
export const readGgufPart = (path: string): Effect.Effect<GgufFile, ModelLoadError> =>
  Effect.acquireUseRelease(
    Effect.try({
      try: () => {
        const fd = Fs.openSync(path, "r")
        try {
          const st = Fs.fstatSync(fd)
          if (!st.isFile()) throw new Error("not a regular file")
          return { fd, size: st.size }
        } catch (e) {
          Fs.closeSync(fd)
          throw e
        }
      },
      catch: (e) =>
        new ModelLoadError({
          path,
          reason: "Io",
          message: `cannot open ${path}: ${e instanceof Error ? e.message : String(e)}`
        })
    }),
    ({ fd, size }) => run(path, fdSource(fd, size)),
    ({ fd }) => Effect.sync(() => Fs.closeSync(fd))
  ).pipe(Effect.withSpan("GgufReader.readGgufPart", { attributes: { path } }))

/**
 * Reads and validates a GGUF model's header, metadata and tensor table (not the tensor data): a single file, or the
 * whole split set whose first part is `path` (every part read and the set checked: GgufSplit.ts). Naming a later part
 * of a set fails, naming the first. Every failure is a ModelLoadError whose message names the offending part, key,
 * tensor or offset.
 */
export const readGgufFile = (named: string): Effect.Effect<GgufFile, ModelLoadError> =>
  Effect.gen(function* () {
    // a folder holding one model, or a later part of a set, names that model (its first part)
    const resolved = resolveModelPath(named)
    if (typeof resolved !== "string") {
      return yield* new ModelLoadError({ path: named, reason: "Io", message: resolved.message })
    }
    const path = resolved
    const first = yield* readGgufPart(path)
    const { index, count } = yield* splitPosition(first)
    if (count === 1) return first
    if (index !== 0) {
      // named as a first part (or resolved to one) but its split.no says otherwise
      const prefix = splitPrefix(path, index, count)
      return yield* new ModelLoadError({
        path,
        reason: "InvalidMetadata",
        message:
          `${Path.basename(path)} is part ${index + 1} of a ${count}-part split set by its "split.no"` +
          (prefix === undefined ? "" : `; its first part would be ${splitPartPath(prefix, 0, count)}`)
      })
    }
    return yield* mergeSplitSet(first, count, readGgufPart, (p) => Fs.existsSync(p))
  }).pipe(Effect.withSpan("GgufReader.readGgufFile", { attributes: { path: named } }))

// ---------------------------------------------------------------------------------------------------------------
// Typed metadata accessors

const metadataError = (file: GgufFile, message: string) =>
  new ModelLoadError({ path: file.path, reason: "InvalidMetadata", message })

const kindName = (k: GgufValueKind): string =>
  k.type === GgufValueType.ARRAY && k.itemType !== undefined ? `ARRAY<${typeName(k.itemType)}>` : typeName(k.type)

const lookup = (file: GgufFile, key: string): Effect.Effect<[GgufValue, GgufValueKind], ModelLoadError> => {
  const v = file.metadata.get(key)
  const k = file.metadataTypes.get(key)
  return v === undefined || k === undefined
    ? Effect.fail(metadataError(file, `metadata key "${key}" is missing`))
    : Effect.succeed([v, k])
}

const isIntType = (t: number): boolean =>
  t === GgufValueType.UINT8 ||
  t === GgufValueType.INT8 ||
  t === GgufValueType.UINT16 ||
  t === GgufValueType.INT16 ||
  t === GgufValueType.UINT32 ||
  t === GgufValueType.INT32 ||
  t === GgufValueType.UINT64 ||
  t === GgufValueType.INT64

const toInt = (v: GgufValue): number | undefined =>
  typeof v === "number"
    ? v
    : typeof v === "bigint" && v <= BigInt(Number.MAX_SAFE_INTEGER) && v >= BigInt(Number.MIN_SAFE_INTEGER)
      ? Number(v)
      : undefined

/** An integer key (of any GGUF integer type) whose value fits in [0, 2^32). */
export const getU32 = (file: GgufFile, key: string): Effect.Effect<number, ModelLoadError> =>
  Effect.flatMap(lookup(file, key), ([v, k]) => {
    const n = isIntType(k.type) ? toInt(v) : undefined
    if (n === undefined) {
      return Effect.fail(metadataError(file, `metadata "${key}" must be an integer but is ${kindName(k)}`))
    }
    return n >= 0 && n <= 0xffffffff
      ? Effect.succeed(n)
      : Effect.fail(metadataError(file, `metadata "${key}" = ${n} is outside the uint32 range`))
  })

/** An integer key (of any GGUF integer type) whose value is a safe integer. */
export const getInt = (file: GgufFile, key: string): Effect.Effect<number, ModelLoadError> =>
  Effect.flatMap(lookup(file, key), ([v, k]) => {
    const n = isIntType(k.type) ? toInt(v) : undefined
    return n === undefined
      ? Effect.fail(metadataError(file, `metadata "${key}" must be a safe integer but is ${kindName(k)} ${String(v)}`))
      : Effect.succeed(n)
  })

/** A FLOAT32 or FLOAT64 key. */
export const getF32 = (file: GgufFile, key: string): Effect.Effect<number, ModelLoadError> =>
  Effect.flatMap(lookup(file, key), ([v, k]) =>
    (k.type === GgufValueType.FLOAT32 || k.type === GgufValueType.FLOAT64) && typeof v === "number"
      ? Effect.succeed(v)
      : Effect.fail(metadataError(file, `metadata "${key}" must be a float but is ${kindName(k)}`))
  )

export const getString = (file: GgufFile, key: string): Effect.Effect<string, ModelLoadError> =>
  Effect.flatMap(lookup(file, key), ([v, k]) =>
    k.type === GgufValueType.STRING && typeof v === "string"
      ? Effect.succeed(v)
      : Effect.fail(metadataError(file, `metadata "${key}" must be a STRING but is ${kindName(k)}`))
  )

export const getBool = (file: GgufFile, key: string): Effect.Effect<boolean, ModelLoadError> =>
  Effect.flatMap(lookup(file, key), ([v, k]) =>
    k.type === GgufValueType.BOOL && typeof v === "boolean"
      ? Effect.succeed(v)
      : Effect.fail(metadataError(file, `metadata "${key}" must be a BOOL but is ${kindName(k)}`))
  )

/** An array key of any item type. */
export const getArray = (file: GgufFile, key: string): Effect.Effect<ReadonlyArray<GgufValue>, ModelLoadError> =>
  Effect.flatMap(lookup(file, key), ([v, k]) =>
    k.type === GgufValueType.ARRAY && Array.isArray(v)
      ? Effect.succeed(v as ReadonlyArray<GgufValue>)
      : Effect.fail(metadataError(file, `metadata "${key}" must be an ARRAY but is ${kindName(k)}`))
  )

export const getStringArray = (file: GgufFile, key: string): Effect.Effect<ReadonlyArray<string>, ModelLoadError> =>
  Effect.flatMap(lookup(file, key), ([v, k]) =>
    k.type === GgufValueType.ARRAY && k.itemType === GgufValueType.STRING
      ? Effect.succeed(v as ReadonlyArray<string>)
      : Effect.fail(metadataError(file, `metadata "${key}" must be an ARRAY<STRING> but is ${kindName(k)}`))
  )

/** An array of 8/16/32-bit integers or floats, as numbers. */
export const getNumberArray = (file: GgufFile, key: string): Effect.Effect<ReadonlyArray<number>, ModelLoadError> =>
  Effect.flatMap(lookup(file, key), ([v, k]) =>
    k.type === GgufValueType.ARRAY &&
    k.itemType !== undefined &&
    k.itemType !== GgufValueType.STRING &&
    k.itemType !== GgufValueType.BOOL &&
    k.itemType !== GgufValueType.UINT64 &&
    k.itemType !== GgufValueType.INT64
      ? Effect.succeed(v as ReadonlyArray<number>)
      : Effect.fail(metadataError(file, `metadata "${key}" must be a numeric ARRAY but is ${kindName(k)}`))
  )

/** Whether a key is present. */
export const hasKey = (file: GgufFile, key: string): boolean => file.metadata.has(key)

/** A key's value when present, for optional settings: Option-free, `undefined` when absent. */
export const getOptional = <A>(
  file: GgufFile,
  key: string,
  get: (file: GgufFile, key: string) => Effect.Effect<A, ModelLoadError>
): Effect.Effect<A | undefined, ModelLoadError> => (file.metadata.has(key) ? get(file, key) : Effect.succeed(undefined))

/** The `general.architecture` string. */
export const getArchitecture = (file: GgufFile): Effect.Effect<string, ModelLoadError> =>
  getString(file, "general.architecture")
