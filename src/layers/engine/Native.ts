/**
 * The native side of a stage: weights in backend buffers, a KV cache per session, one ggml graph per call.
 * Everything here assumes a validated StageLayout (StageLayout.ts); inputs are checked again before ggml sees them.
 */
import koffi from "koffi"
import { open } from "node:fs/promises"
import type { LoadProgress, StageInput } from "../../domain/engine.js"
import { type Ggml, getGgml, type GgmlRaw, GgmlType, type Ptr, TensorLayout } from "../ggml/Bindings.js"
import {
  canMap,
  type FileRegion,
  locate,
  MAP_GRANULE,
  mapRanges,
  populateRanges,
  releaseAllBut,
  releasePages,
  unmapAll
} from "./FileMap.js"
import { chooseSmallBatchRows, exactRowsDefault } from "./SmallBatch.js"
import type { StageLayout } from "./StageLayout.js"
import { type AttentionSegment, type BlockWeights, type GraphInputs, type KvLayer, Toolkit } from "./Toolkit.js"
import { checkGraph, chooseExtraBuffer, fewRowRouteAllowed, type WeightHome } from "./WeightPlacement.js"

const GGML_BACKEND_BUFFER_USAGE_WEIGHTS = 1
const READ_CHUNK = 4 * 1024 * 1024
const F16_NEG_INF = 0xfc00

/** Padded KV cache length, as llama.cpp pads n_ctx. */
export const kvCacheSize = (contextLength: number) => Math.ceil(contextLength / 256) * 256

/** Cells attended to: llama.cpp's n_kv = min(size, max(256, pad(used, 256))). */
export const attendedCells = (kvSize: number, used: number) =>
  Math.min(kvSize, Math.max(256, Math.ceil(used / 256) * 256))

/** Serializes native work on one backend (its CPU work buffer is not shared safely). */
class Lock {
  private tail: Promise<void> = Promise.resolve()
  run<A>(f: () => Promise<A>): Promise<A> {
    const result = this.tail.then(f)
    this.tail = result.then(() => undefined, () => undefined)
    return result
  }
}

export interface TensorPlacement {
  readonly name: string
  readonly bufferType: string
  readonly bytes: number
}

export type DeviceKind = "cpu" | "gpu"

/** The buffer type name of weights used in place from the file mapping. */
export const MAPPED_BUFFER_TYPE = "CPU_Mapped"

export class NativeWeights {
  readonly lock = new Lock()
  freed = false

  constructor(
    readonly ggml: Ggml,
    readonly layout: StageLayout,
    readonly device: DeviceKind,
    /** ggml_backend_dev_t the stage computes on */
    readonly dev: Ptr,
    readonly backend: Ptr,
    private readonly contexts: ReadonlyArray<Ptr>,
    private readonly buffers: ReadonlyArray<Ptr>,
    readonly tensors: ReadonlyMap<string, Ptr>,
    readonly placements: ReadonlyArray<TensorPlacement>,
    /** Bytes of the allocated backend buffers that hold (copies of) weights. */
    public bufferBytes: number,
    /** Bytes of the weights used in place in file mappings (not allocated; shared page cache). */
    public mappedBytes: number = 0,
    private regions: ReadonlyArray<FileRegion> = [],
    /** The tensors used in place in the mappings (what `moveOutOfMapping` copies). */
    private readonly mappedTensors: ReadonlyArray<{ readonly name: string; readonly p: Ptr; readonly bytes: number }> = [],
    /** Addresses of the weights in extra (repacked) buffer types (WeightPlacement.ts, rules 2 and 3). */
    readonly extraWeights: ReadonlySet<bigint> = new Set()
  ) {}

  /** Where a loaded weight lives (WeightPlacement.ts). */
  homeOf(p: Ptr): WeightHome {
    return this.extraWeights.has(koffi.address(p)) ? "extra" : "plain"
  }

  private moveStarted = false

  /** Bytes of mapped pages dropped from this process's resident set (after a load, and as the move copies them). */
  releasedBytes = 0

  /** Buffers allocated after the load (the weights moved out of the file mapping). */
  private readonly laterBuffers: Array<Ptr> = []

  /**
   * Moves the weights used in place from the file mapping into allocated CPU memory with transparent huge pages, one
   * tensor per hold of the weights' lock (so decode steps run in between), then unmaps the file. Why: Linux gives a
   * file mapping 4 KiB pages (no read-only THP for files here), and decode, which streams every weight per token, ran
   * ~12% slower from the mapping than from huge pages (bench:pipeline, 16x2048 Q8_0: 43.5 vs 38.7 ms of compute per
   * token). The mapping still gives the fast start. Resolves true once every tensor moved; false when the weights were
   * freed meanwhile, or when there is nothing to move. Numerics do not change: the same bytes, read by the same kernels.
   */
  async moveOutOfMapping(): Promise<boolean> {
    if (this.mappedTensors.length === 0 || this.device !== "cpu" || this.moveStarted) return false
    this.moveStarted = true
    const raw = this.ggml.raw
    const buft = raw.ggml_backend_dev_buffer_type(this.dev)
    const align = BigInt(Math.max(64, Number(raw.ggml_backend_buft_get_alignment(buft))))
    const offsets: Array<bigint> = []
    let total = 0n
    for (const t of this.mappedTensors) {
      total = (total + align - 1n) / align * align
      offsets.push(total)
      total += BigInt(t.bytes)
    }
    const buffer = await this.lock.run(async () => {
      if (this.freed) return null
      const b = raw.ggml_backend_buft_alloc_buffer(buft, Number(total))
      if (b === null) return null
      raw.ggml_backend_buffer_set_usage(b, GGML_BACKEND_BUFFER_USAGE_WEIGHTS)
      if (process.env["SWACTOR_THP"] !== "0") adviseHugePages(raw.ggml_backend_buffer_get_base(b), Number(total))
      this.laterBuffers.push(b)
      return b
    })
    if (buffer === null) return false
    const base = koffi.address(raw.ggml_backend_buffer_get_base(buffer))
    // In address order, so that every page below the tensor being copied is no longer read in place: each chunk's
    // source pages leave the resident set once copied (the mapping and the copy are never both resident).
    const order = this.mappedTensors.map((t, i) => ({ t, i, from: koffi.address(koffi.decode(t.p, TensorLayout.data, "void *") as Ptr) }))
      .sort((a, b) => (a.from < b.from ? -1 : a.from > b.from ? 1 : 0))
    const low = new Map<FileRegion, bigint>(this.regions.map((r) => [r, r.addr]))
    const granule = BigInt(MAP_GRANULE)
    for (const { from, i, t } of order) {
      const region = this.regions.find((r) => from >= r.addr && from < r.addr + BigInt(r.length))
      const moved = await this.lock.run(async () => {
        if (this.freed) return false
        const oldData = koffi.decode(t.p, TensorLayout.data, "void *") as Ptr
        const oldBuffer = koffi.decode(t.p, TensorLayout.buffer, "void *") as Ptr
        // ggml_backend_tensor_alloc wants an unplaced tensor: clear its buffer and data, place it, copy its bytes
        this.ggml.setTensorBuffer(t.p, null)
        koffi.encode(t.p, TensorLayout.data, "void *", null)
        if (raw.ggml_backend_tensor_alloc(buffer, t.p, base + offsets[i]!) !== 0) {
          // left where it was: the mapping stays for this tensor and those after it
          this.ggml.setTensorBuffer(t.p, oldBuffer)
          koffi.encode(t.p, TensorLayout.data, "void *", oldData)
          return false
        }
        for (let off = 0; off < t.bytes; off += MOVE_CHUNK) {
          const n = Math.min(MOVE_CHUNK, t.bytes - off)
          raw.ggml_backend_tensor_set_from(t.p, from + BigInt(off), off, n)
          if (region !== undefined) {
            const end = from + BigInt(off + n)
            this.releasedBytes += releasePages(low.get(region)!, end)
            low.set(region, end / granule * granule)
          }
        }
        return true
      })
      if (!moved) return false
      await new Promise<void>((resolve) => setImmediate(resolve))
    }
    return this.lock.run(async () => {
      if (this.freed) return false
      // nothing points into the mappings any more
      unmapAll(this.regions)
      this.regions = []
      this.bufferBytes += Number(total)
      this.mappedBytes = 0
      return true
    })
  }

  get(name: string): Ptr {
    const t = this.tensors.get(name)
    if (t === undefined) throw new Error(`internal: tensor ${name} is not loaded`)
    return t
  }

  /** Graphs of calls over several sessions that are not all decode steps (created on the first such call). */
  private batch: GraphSlot | null = null

  /**
   * Graphs of decode steps over several sessions, least recently used first. Pipeline groups take turns on a stage
   * (at 4 requests on 2 stages, {a, b} then {c, d} then {a, b}...), so one slot would rebuild the graph at every
   * step: measured ~1.3 ms of the agent's thread per step on a 2-stage 16×2048 pipeline. Decode graphs are small
   * (one row per sequence), so a few slots cost little memory.
   */
  private readonly decodeSlots: Array<GraphSlot> = []

  /**
   * Per weight type, the most rows of a CPU product that take ggml's one-row kernel (SmallBatch.ts): chosen before
   * the first graph over several sessions is built, then fixed for the weights' life.
   */
  smallRowsFor: ((type: number) => number) | undefined = undefined

  batchSlot(): GraphSlot {
    return this.batch ??= new GraphSlot(this.ggml.raw, this.ggml.raw.ggml_backend_dev_buffer_type(this.dev))
  }

  /** The slot for a decode step over several sessions: the one holding `key`'s graph, else the least recently used. */
  decodeSlot(key: string): GraphSlot {
    let at = this.decodeSlots.findIndex((slot) => slot.cached?.key === key)
    if (at < 0) {
      if (this.decodeSlots.length < DECODE_GRAPH_SLOTS) {
        this.decodeSlots.push(new GraphSlot(this.ggml.raw, this.ggml.raw.ggml_backend_dev_buffer_type(this.dev)))
        at = this.decodeSlots.length - 1
      } else {
        at = 0
      }
    }
    const [slot] = this.decodeSlots.splice(at, 1)
    this.decodeSlots.push(slot!)
    return slot!
  }

  /** A session is being freed: no cached graph may keep pointing at its KV cache. */
  forgetSession(sessionId: number): void {
    this.batch?.forget(sessionId)
    for (const slot of this.decodeSlots) slot.forget(sessionId)
  }

  free(): void {
    if (this.freed) return
    this.freed = true
    const raw = this.ggml.raw
    this.batch?.free()
    this.batch = null
    for (const slot of this.decodeSlots.splice(0)) slot.free()
    for (const b of this.buffers) raw.ggml_backend_buffer_free(b)
    for (const b of this.laterBuffers) raw.ggml_backend_buffer_free(b)
    for (const c of this.contexts) raw.ggml_free(c)
    raw.ggml_backend_free(this.backend)
    // after the buffers: nothing points into the mappings any more
    unmapAll(this.regions)
  }
}

/** Bytes of hidden states copied into graph inputs (tests count copies per hop with it). */
export const inputCopies = { bytes: 0 }

/** Compute graphs built (a call whose shape has a cached graph builds none; tests count rebuilds with it). */
export const graphBuilds = { count: 0 }

/** Bytes a weight move copies (and then releases from the mapping) per step, within one hold of the lock. */
const MOVE_CHUNK = 8 * 1024 * 1024

/** Cached graphs of decode steps over several sessions, per loaded stage (pipeline groups that take turns). */
const DECODE_GRAPH_SLOTS = 4

/** A libc function by its C signature, loaded once; null where libc cannot be loaded. */
const libcFunctions = new Map<string, unknown>()
const libcFunction = <F>(signature: string): F | null => {
  if (!libcFunctions.has(signature)) {
    let fn: unknown = null
    try {
      fn = koffi.load("libc.so.6").func(signature)
    } catch {
      fn = null
    }
    libcFunctions.set(signature, fn)
  }
  return libcFunctions.get(signature) as F | null
}

/** The address of a typed array's bytes (libc memmove with n = 0 returns its destination), or null. */
const addressOf = (data: Float32Array): bigint | null => {
  const memmove = libcFunction<(a: unknown, b: unknown, n: number) => bigint | number>(
    "uintptr_t memmove(void *dst, void *src, size_t n)"
  )
  return memmove === null ? null : BigInt(memmove(data, data, 0))
}

/**
 * Points a lone call's hidden input tensor at the caller's rows instead of copying them in (CPU; rows 64-byte aligned,
 * as an inbound ring's payload is; off the V8 heap, so they do not move; SWACTOR_ZERO_COPY=0 turns it off). Returns the
 * tensor's own data address, to put back after the computation, or null when the rows were not borrowed. The tensor is
 * a graph output too, so the graph never computes in place over it.
 */
const borrowHidden = (w: NativeWeights, tensor: Ptr, input: StageInput): bigint | null => {
  if (input._tag !== "Hidden" || w.device !== "cpu" || process.env["SWACTOR_ZERO_COPY"] === "0") return null
  const bytes = w.layout.hp.nEmbd * input.nTokens * 4
  if (input.hidden.byteLength !== bytes || bytes < 256) return null
  const at = addressOf(input.hidden)
  if (at === null || at === 0n || at % 64n !== 0n) return null
  const own = BigInt(koffi.decode(tensor, TensorLayout.data, "uintptr_t") as bigint | number)
  koffi.encode(tensor, TensorLayout.data, "uintptr_t", at)
  return own
}

const MADV_HUGEPAGE = 14
const HUGE_PAGE = 2n * 1024n * 1024n

/**
 * Asks Linux for transparent huge pages over the whole 2 MiB pages inside a weight buffer, before it is written:
 * decode streams every weight once per token, and with 4 KiB pages the page walks vary with where the pages land.
 * Best effort: no-op off Linux or when libc cannot be loaded.
 */
const adviseHugePages = (base: Ptr, size: number) => {
  if (process.platform !== "linux" || base === null) return
  const madvise = libcFunction<(addr: bigint, len: number, advice: number) => number>(
    "int madvise(uintptr_t addr, size_t len, int advice)"
  )
  if (madvise === null) return
  const a = koffi.address(base)
  const start = (a + HUGE_PAGE - 1n) / HUGE_PAGE * HUGE_PAGE
  const end = (a + BigInt(size)) / HUGE_PAGE * HUGE_PAGE
  if (end > start) madvise(start, Number(end - start), MADV_HUGEPAGE)
}

/** ggml's TENSOR_ALIGNMENT: what a CPU buffer over foreign memory promises (and what kernels may assume). */
const MAPPED_ALIGNMENT = 32

/** Is weight mapping wanted (SWACTOR_MMAP=0 turns it off; CPU stages on Linux only)? */
export const mmapWanted = (option: boolean | undefined, device: DeviceKind): boolean =>
  device === "cpu" && option !== false && process.env["SWACTOR_MMAP"] !== "0" && canMap()

/**
 * Allocates and reads the tensors of the stage layout. Throws on native or I/O failure (after freeing what it made).
 *
 * On the CPU (unless `mmap: false` or SWACTOR_MMAP=0) the stage's byte ranges of the file are mapped read-only:
 * plain weights (and their page cache) are used in place, repacked ones are repacked from the mapping. When
 * mapping fails the weights are read into allocated buffers as before.
 */
export const loadWeights = async (
  layout: StageLayout,
  options: {
    readonly repack?: boolean
    readonly device?: DeviceKind
    readonly mmap?: boolean
    /** Fixes the few-row route's row limit for every weight type (nothing measured); see NativeWeights.smallRowsFor. */
    readonly smallBatchRows?: number
    readonly onProgress?: (p: LoadProgress) => void
  } = {}
): Promise<NativeWeights> => {
  const g = getGgml()
  const raw = g.raw
  const device = options.device ?? "cpu"
  const dev = device === "gpu" ? g.gpuDevice() : g.cpuDevice()
  if (dev === null) throw new Error("no GPU device: load node-llama-cpp's CUDA package (SWACTOR_GGML_PACKAGE=cuda)")
  // on a GPU every weight lives in device memory; on the CPU quantized matrices may be repacked
  const cpuBuft = raw.ggml_backend_dev_buffer_type(dev)
  const extra = options.repack === false || device === "gpu" ? [] : g.cpuExtraBufferTypes()

  let regions: ReadonlyArray<FileRegion> = []
  if (mmapWanted(options.mmap, device)) {
    try {
      // not prefaulted whole: the tensors copied out (repacked, unaligned) are read once, then their pages released
      regions = await mapRanges(
        layout.file.path,
        layout.tensors.map((t) => ({ offset: t.info.offset, size: t.info.byteSize })),
        { populate: false }
      )
    } catch (e) {
      // a file now shorter than its table must not be read either; any other mapping failure: copy instead
      if (e instanceof Error && e.message.startsWith("the file is")) throw e
      regions = []
    }
  }

  // group tensors by where they live: a buffer type (allocated, filled by copies) or a file region (in place)
  const groups = new Map<Ptr | FileRegion, Array<{ name: string; index: number; addr?: bigint }>>()
  const keys: Array<Ptr | FileRegion> = []
  layout.tensors.forEach((t, index) => {
    let buft = cpuBuft
    if (t.use === "mul_mat") buft = chooseExtraBuffer(g, extra, t.info.type, t.info.dims) ?? cpuBuft
    let key: Ptr | FileRegion = buft
    let addr: bigint | undefined
    if (buft === cpuBuft && t.info.byteSize > 0 && t.info.offset % MAPPED_ALIGNMENT === 0) {
      const at = locate(regions, t.info.offset, t.info.byteSize)
      if (at !== undefined) {
        key = at.region
        addr = at.addr
      }
    }
    if (!groups.has(key)) {
      groups.set(key, [])
      keys.push(key)
    }
    groups.get(key)!.push(addr === undefined ? { name: t.name, index } : { name: t.name, index, addr })
  })

  const contexts: Array<Ptr> = []
  const buffers: Array<Ptr> = []
  const tensors = new Map<string, Ptr>()
  const placements: Array<TensorPlacement> = []
  const mapped = new Set<string>()
  const mappedTensors: Array<{ name: string; p: Ptr; bytes: number }> = []
  /** tensors in an extra (repacked) buffer type: set whole, repacking needs every row at once */
  const repacked = new Set<string>()
  let backend: Ptr | null = null
  let bufferBytes = 0
  let mappedBytes = 0
  let releasedAtLoad = 0
  const inPlaceRanges: Array<readonly [bigint, number]> = []
  try {
    for (const key of keys) {
      const members = groups.get(key)!
      const inPlace = regions.includes(key as FileRegion)
      const ctx = raw.ggml_init({
        mem_size: raw.ggml_tensor_overhead() * (members.length + 1),
        mem_buffer: null,
        no_alloc: true
      })
      if (ctx === null) throw new Error("ggml_init failed for the weights context")
      contexts.push(ctx)
      const made: Array<{ p: Ptr; addr?: bigint }> = []
      for (const m of members) {
        const t = layout.tensors[m.index]!
        const d = t.info.dims
        const p = d.length <= 1
          ? raw.ggml_new_tensor_1d(ctx, t.info.type, d[0]!)
          : d.length === 2
          ? raw.ggml_new_tensor_2d(ctx, t.info.type, d[0]!, d[1]!)
          : raw.ggml_new_tensor_3d(ctx, t.info.type, d[0]!, d[1]!, d[2] ?? 1)
        raw.ggml_set_name(p, t.name.slice(0, 63))
        const nbytes = raw.ggml_nbytes(p)
        if (nbytes !== t.info.byteSize) {
          throw new Error(`tensor ${t.name}: ggml says ${nbytes} bytes, the GGUF table ${t.info.byteSize}`)
        }
        tensors.set(t.name, p)
        made.push(m.addr === undefined ? { p } : { p, addr: m.addr })
      }
      if (inPlace) {
        const region = key as FileRegion
        const buffer = raw.ggml_backend_cpu_buffer_from_ptr(region.base, region.length)
        if (buffer === null) throw new Error("could not make a CPU buffer over the mapped weights")
        buffers.push(buffer)
        raw.ggml_backend_buffer_set_usage(buffer, GGML_BACKEND_BUFFER_USAGE_WEIGHTS)
        const align = raw.ggml_backend_buffer_get_alignment(buffer)
        for (const [i, m] of made.entries()) {
          const t = layout.tensors[members[i]!.index]!
          if (align <= 0 || m.addr! % BigInt(align) !== 0n) {
            throw new Error(`tensor ${t.name}: mapped address is not aligned to ${align} bytes`)
          }
          if (raw.ggml_backend_tensor_alloc(buffer, m.p, m.addr!) !== 0) {
            throw new Error(`tensor ${t.name}: could not place it in the mapped weights`)
          }
          mapped.add(t.name)
          inPlaceRanges.push([m.addr!, t.info.byteSize])
          mappedTensors.push({ name: t.name, p: m.p, bytes: t.info.byteSize })
          mappedBytes += t.info.byteSize
          placements.push({ name: t.name, bufferType: MAPPED_BUFFER_TYPE, bytes: t.info.byteSize })
        }
        continue
      }
      const buft = key as Ptr
      for (const m of members) {
        const t = layout.tensors[m.index]!
        placements.push({ name: t.name, bufferType: raw.ggml_backend_buft_name(buft), bytes: t.info.byteSize })
        if (buft !== cpuBuft) repacked.add(t.name)
      }
      const buffer = raw.ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft)
      if (buffer === null) {
        throw new Error(`could not allocate ${raw.ggml_backend_buft_name(buft)} memory for the stage's weights`)
      }
      raw.ggml_backend_buffer_set_usage(buffer, GGML_BACKEND_BUFFER_USAGE_WEIGHTS)
      if (device === "cpu" && process.env["SWACTOR_THP"] !== "0") {
        adviseHugePages(raw.ggml_backend_buffer_get_base(buffer), raw.ggml_backend_buffer_get_size(buffer))
      }
      buffers.push(buffer)
      bufferBytes += raw.ggml_backend_buffer_get_size(buffer)
    }

    const total = layout.weightBytes
    let loaded = 0
    options.onProgress?.({ loadedBytes: 0, totalBytes: total })
    const order = [...layout.tensors].sort((a, b) => a.info.offset - b.info.offset)
    if (regions.length > 0) {
      // in place: nothing to copy, only prefaulted; the rest (repacked or unaligned) is set from the mapping, whole,
      // and its pages leave the resident set once copied (rounded inward: a neighbour read in place keeps its own)
      await populateRanges(regions, inPlaceRanges)
      for (const t of order) {
        if (!mapped.has(t.name) && t.info.byteSize > 0) {
          const at = locate(regions, t.info.offset, t.info.byteSize)
          if (at === undefined) throw new Error(`internal: tensor ${t.name} is outside the mapped ranges`)
          raw.ggml_backend_tensor_set_from(tensors.get(t.name)!, at.addr, 0, t.info.byteSize)
          releasedAtLoad += releasePages(at.addr, at.addr + BigInt(t.info.byteSize))
        }
        loaded += t.info.byteSize
        options.onProgress?.({ loadedBytes: loaded, totalBytes: total })
      }
      // the repacked and unaligned tensors were copied out: only the in-place ones still read the mapping
      releasedAtLoad = releaseAllBut(regions, inPlaceRanges)
    } else {
      const fh = await open(layout.file.path, "r")
      try {
        let chunk = Buffer.allocUnsafe(Math.min(READ_CHUNK, Math.max(1, ...order.map((t) => t.info.byteSize))))
        for (const t of order) {
          const p = tensors.get(t.name)!
          const whole = repacked.has(t.name)
          const size = t.info.byteSize
          if (whole && chunk.length < size) chunk = Buffer.allocUnsafe(size)
          const step = whole ? size : chunk.length
          for (let off = 0; off < size; off += step) {
            const n = Math.min(step, size - off)
            let got = 0
            while (got < n) {
              const r = await fh.read(chunk, got, n - got, t.info.offset + off + got)
              if (r.bytesRead === 0) throw new Error(`unexpected end of file reading ${t.name}`)
              got += r.bytesRead
            }
            raw.ggml_backend_tensor_set(p, chunk.subarray(0, n), off, n)
            loaded += n
            options.onProgress?.({ loadedBytes: loaded, totalBytes: total })
          }
        }
      } finally {
        await fh.close()
      }
    }
    backend = raw.ggml_backend_dev_init(dev, null)
    if (backend === null) throw new Error(`could not start the ggml ${raw.ggml_backend_dev_name(dev)} backend`)
    const extraWeights = new Set<bigint>()
    for (const name of repacked) extraWeights.add(koffi.address(tensors.get(name)!))
    const weights = new NativeWeights(
      g,
      layout,
      device,
      dev,
      backend as Ptr,
      contexts,
      buffers,
      tensors,
      placements,
      bufferBytes,
      mappedBytes,
      regions,
      mappedTensors,
      extraWeights
    )
    weights.releasedBytes = releasedAtLoad
    const fixedRows = options.smallBatchRows
    if (fixedRows !== undefined) weights.smallRowsFor = () => fixedRows
    return weights
  } catch (e) {
    for (const b of buffers) raw.ggml_backend_buffer_free(b)
    for (const c of contexts) raw.ggml_free(c)
    if (backend !== null) raw.ggml_backend_free(backend)
    unmapAll(regions)
    throw e
  }
}

export type NativeOutput =
  | { readonly _tag: "Hidden"; readonly hidden: Float32Array; readonly nTokens: number }
  | { readonly _tag: "Logits"; readonly logits: Float32Array }

/** One sequence's part of a native call (validated by the caller, see `runBatch`). */
export interface NativeItem {
  readonly session: NativeSession
  readonly startPos: number
  readonly input: StageInput
}

/** A built and allocated graph of one call shape. */
interface CachedGraph {
  /** (input kind, then session id, n, nKv of each sequence): the graph depends on nothing else */
  readonly key: string
  /** Ids of the sessions whose KV cache tensors the graph writes and reads. */
  readonly sessions: ReadonlyArray<number>
  readonly ctx: Ptr
  readonly graph: Ptr
  readonly inputs: GraphInputs
  /** I64 [n] all sequences' KV cells, in row order */
  readonly kvIdx: Ptr
  /** I64 [n] 0..n-1 (several sequences only) */
  readonly rowIdx: Ptr | null
  readonly tokens: Ptr | null
  readonly hidden: Ptr | null
  readonly out: Ptr
}

/**
 * A graph allocator and the last graph it placed. A decode step of the same shape as the last call skips graph
 * construction (hundreds of native calls) and allocation; a call of another shape frees the cached graph.
 */
class GraphSlot {
  cached: CachedGraph | null = null
  private freed = false
  readonly galloc: Ptr

  constructor(readonly raw: GgmlRaw, buft: Ptr) {
    this.galloc = raw.ggml_gallocr_new(buft)
  }

  drop(): void {
    if (this.cached !== null) this.raw.ggml_free(this.cached.ctx)
    this.cached = null
  }

  /** Forgets the cached graph when it uses this session's KV cache (the session is going away). */
  forget(sessionId: number): void {
    if (this.cached?.sessions.includes(sessionId)) this.drop()
  }

  free(): void {
    if (this.freed) return
    this.freed = true
    this.drop()
    this.raw.ggml_gallocr_free(this.galloc)
  }
}

let nextSessionId = 1

/** One sequence's KV cache over loaded weights. */
export class NativeSession {
  readonly id = nextSessionId++
  private readonly kvCtx: Ptr
  private readonly kvBuffer: Ptr
  readonly kv: Map<number, KvLayer> = new Map()
  /** Graphs of calls on this session alone (a lone session keeps its decode graph between steps). */
  readonly slot: GraphSlot
  freed = false
  /** Cells 0..filled-1 hold this sequence's K/V. */
  filled = 0

  constructor(readonly weights: NativeWeights, readonly contextLength: number, readonly threads: number) {
    const g = weights.ggml
    const raw = g.raw
    const { hp, spec } = weights.layout
    const kvSize = kvCacheSize(contextLength)
    const nLayers = spec.layerEndExclusive - spec.layerStart
    this.kvCtx = raw.ggml_init({
      mem_size: raw.ggml_tensor_overhead() * (2 * nLayers + 1),
      mem_buffer: null,
      no_alloc: true
    })
    for (let il = spec.layerStart; il < spec.layerEndExclusive; il++) {
      const k = raw.ggml_new_tensor_2d(this.kvCtx, GgmlType.F16, hp.headDimK * hp.nHeadKv, kvSize)
      const v = raw.ggml_new_tensor_2d(this.kvCtx, GgmlType.F16, hp.headDimV * hp.nHeadKv, kvSize)
      raw.ggml_set_name(k, `cache_k_l${il}`)
      raw.ggml_set_name(v, `cache_v_l${il}`)
      this.kv.set(il, { k, v })
    }
    const devBuft = raw.ggml_backend_dev_buffer_type(weights.dev)
    const buf = raw.ggml_backend_alloc_ctx_tensors_from_buft(this.kvCtx, devBuft)
    if (buf === null) {
      raw.ggml_free(this.kvCtx)
      throw new Error(`could not allocate the KV cache (${kvSize} cells x ${nLayers} blocks)`)
    }
    this.kvBuffer = buf
    // zeroed: NaN garbage in masked cells would still poison softmax(QK)·V
    raw.ggml_backend_buffer_clear(buf, 0)
    this.slot = new GraphSlot(raw, devBuft)
  }

  get kvSize(): number {
    return kvCacheSize(this.contextLength)
  }

  reset(): void {
    this.filled = 0
    if (!this.freed) this.weights.ggml.raw.ggml_backend_buffer_clear(this.kvBuffer, 0)
  }

  free(): void {
    if (this.freed) return
    this.freed = true
    const raw = this.weights.ggml.raw
    this.weights.forgetSession(this.id)
    this.slot.free()
    raw.ggml_backend_buffer_free(this.kvBuffer)
    raw.ggml_free(this.kvCtx)
  }

  /**
   * Runs positions startPos..startPos+n-1. The caller has validated: 0 <= startPos <= filled,
   * startPos + n <= contextLength, the input kind and size, token ids in range.
   */
  async forward(startPos: number, input: StageInput): Promise<NativeOutput> {
    const [out] = await runBatch(this.weights, [{ session: this, startPos, input }])
    return out!
  }
}

const inputLength = (input: StageInput) => input._tag === "Tokens" ? input.tokens.length : input.nTokens

/**
 * Runs several sequences of one loaded stage in one graph: all rows through every matrix product together, each
 * sequence's attention over its own KV cache. One output per item (its hidden rows, or the logits of its last
 * position on the last stage). The caller has validated every item as for `forward`, that all sessions are of
 * `weights`, that no session appears twice, and that all inputs are of one kind. A single item runs on its
 * session's own graph slot (its decode graph survives other sessions' calls); several on the stage's batch slot.
 */
export const runBatch = (weights: NativeWeights, items: ReadonlyArray<NativeItem>): Promise<Array<NativeOutput>> =>
  weights.lock.run(() => runBatchLocked(weights, items))

const runBatchLocked = async (w: NativeWeights, items: ReadonlyArray<NativeItem>): Promise<Array<NativeOutput>> => {
  if (w.freed) throw new Error("the stage's weights were freed before this session")
  if (items.length === 0) return []
  for (const it of items) {
    if (it.session.freed) throw new Error(`session ${it.session.id} already freed`)
  }
  const g = w.ggml
  const raw = g.raw
  const { hp, spec } = w.layout
  const kind = items[0]!.input._tag
  const shapes = items.map((it) => {
    const n = inputLength(it.input)
    return { n, used: it.startPos + n, nKv: attendedCells(it.session.kvSize, it.startPos + n) }
  })
  const nTotal = shapes.reduce((s, x) => s + x.n, 0)
  const key = kind + items.map((it, i) => `|${it.session.id}:${shapes[i]!.n}:${shapes[i]!.nKv}`).join("")
  const slot = items.length === 1
    ? items[0]!.session.slot
    : shapes.every((x) => x.n === 1)
    ? w.decodeSlot(key)
    : w.batchSlot()

  let c = slot.cached
  if (c === null || c.key !== key) {
    if (items.length > 1 && w.device === "cpu" && w.smallRowsFor === undefined) {
      const threads = Math.max(...items.map((it) => it.session.threads))
      w.smallRowsFor = await chooseSmallBatchRows(
        g,
        w.backend,
        raw.ggml_backend_dev_buffer_type(w.dev),
        new Map([...w.tensors].filter(([, p]) => fewRowRouteAllowed(w.homeOf(p)))),
        threads
      )
    }
    slot.drop()
    c = buildGraph(w, slot, key, items, shapes.map((s) => s.nKv), kind)
    graphBuilds.count++
    slot.cached = c
  }
  const { outIds, pos, segments } = c.inputs

  // inputs: positions, KV cells, row indices, one causal mask per sequence
  const posArr = new Int32Array(nTotal)
  const idxArr = new BigInt64Array(nTotal)
  let row = 0
  for (let s = 0; s < items.length; s++) {
    const startPos = items[s]!.startPos
    for (let i = 0; i < shapes[s]!.n; i++, row++) {
      posArr[row] = startPos + i
      idxArr[row] = BigInt(startPos + i)
    }
  }
  raw.ggml_backend_tensor_set(pos, posArr, 0, nTotal * 4)
  raw.ggml_backend_tensor_set(c.kvIdx, idxArr, 0, nTotal * 8)
  if (c.rowIdx !== null) {
    const rows = new BigInt64Array(nTotal)
    for (let i = 0; i < nTotal; i++) rows[i] = BigInt(i)
    raw.ggml_backend_tensor_set(c.rowIdx, rows, 0, nTotal * 8)
  }
  for (let s = 0; s < items.length; s++) {
    const { n, nKv } = shapes[s]!
    const startPos = items[s]!.startPos
    const maskArr = new Uint16Array(nKv * n)
    for (let i = 0; i < n; i++) {
      const p = startPos + i
      if (p + 1 < nKv) maskArr.subarray(i * nKv, (i + 1) * nKv).fill(F16_NEG_INF, p + 1)
    }
    raw.ggml_backend_tensor_set(segments[s]!.mask, maskArr, 0, maskArr.byteLength)
  }
  if (outIds !== null) {
    raw.ggml_backend_tensor_set(outIds, Int32Array.from(segments, (seg) => seg.offset + seg.n - 1), 0, items.length * 4)
  }
  // A lone call's hidden rows are read where they are (a view of the inbound ring): no copy into the graph.
  const borrowed = c.hidden !== null && items.length === 1 ? borrowHidden(w, c.hidden, items[0]!.input) : null
  for (let s = 0; s < items.length; s++) {
    const input = items[s]!.input
    const offset = segments[s]!.offset
    if (c.tokens !== null && input._tag === "Tokens") {
      raw.ggml_backend_tensor_set(c.tokens, input.tokens, offset * 4, input.tokens.length * 4)
    }
    if (c.hidden !== null && input._tag === "Hidden" && borrowed === null) {
      raw.ggml_backend_tensor_set(c.hidden, input.hidden, offset * hp.nEmbd * 4, hp.nEmbd * input.nTokens * 4)
      inputCopies.bytes += hp.nEmbd * input.nTokens * 4
    }
  }

  // cells from startPos on are being rewritten: until this call succeeds only those before it are valid
  for (const it of items) it.session.filled = Math.min(it.session.filled, it.startPos)
  if (w.device === "cpu") g.setThreads(w.backend, Math.max(...items.map((it) => it.session.threads)))
  let status: number
  try {
    status = await g.computeAsync(w.backend, c.graph)
  } finally {
    // the graph's own memory again, whatever happened
    if (borrowed !== null) koffi.encode(c.hidden!, TensorLayout.data, "uintptr_t", borrowed)
  }
  if (status !== 0) throw new Error(`ggml_backend_graph_compute failed with status ${status}`)
  items.forEach((it, s) => (it.session.filled = shapes[s]!.used))

  if (spec.isLast) {
    const all = new Float32Array(hp.nVocab * items.length)
    raw.ggml_backend_tensor_get(c.out, all, 0, all.byteLength)
    // Views of the one read-back (fresh per call): no second copy per sequence.
    return items.map((_, s) => ({ _tag: "Logits", logits: all.subarray(s * hp.nVocab, (s + 1) * hp.nVocab) }))
  }
  const all = new Float32Array(hp.nEmbd * nTotal)
  raw.ggml_backend_tensor_get(c.out, all, 0, all.byteLength)
  if (items.length === 1) return [{ _tag: "Hidden", hidden: all, nTokens: nTotal }]
  return items.map((_, s) => {
    const seg = segments[s]!
    return {
      _tag: "Hidden",
      hidden: all.subarray(seg.offset * hp.nEmbd, (seg.offset + seg.n) * hp.nEmbd),
      nTokens: seg.n
    }
  })
}

/** Builds (and allocates in `slot`) the graph of one call shape. Frees its context on failure. */
const buildGraph = (
  w: NativeWeights,
  slot: GraphSlot,
  key: string,
  items: ReadonlyArray<NativeItem>,
  nKvs: ReadonlyArray<number>,
  kind: StageInput["_tag"]
): CachedGraph => {
  const raw = w.ggml.raw
  const { arch, hp, spec } = w.layout
  const nLayers = spec.layerEndExclusive - spec.layerStart
  const nSeq = items.length
  const n = items.reduce((s, it) => s + inputLength(it.input), 0)
  const maxNodes = Math.max(2048, (96 + 24 * (nSeq - 1)) * nLayers + 256 + 8 * nSeq)
  const ctx = raw.ggml_init({
    mem_size: raw.ggml_tensor_overhead() * maxNodes + raw.ggml_graph_overhead_custom(maxNodes, false),
    mem_buffer: null,
    no_alloc: true
  })
  if (ctx === null) throw new Error("ggml_init failed for the compute graph")
  try {
    const graph = raw.ggml_new_graph_custom(ctx, maxNodes, false)
    const input1d = (type: number, len: number, name: string) => {
      const t = raw.ggml_new_tensor_1d(ctx, type, len)
      raw.ggml_set_name(t, name)
      raw.ggml_set_input(t)
      return t
    }
    const pos = input1d(GgmlType.I32, n, "inp_pos")
    const kvIdx = input1d(GgmlType.I64, n, "inp_kv_idx")
    const rowIdx = nSeq > 1 ? input1d(GgmlType.I64, n, "inp_rows") : null
    const segments: Array<AttentionSegment> = []
    let offset = 0
    items.forEach((it, s) => {
      const len = inputLength(it.input)
      const nKv = nKvs[s]!
      const mask = raw.ggml_new_tensor_2d(ctx, GgmlType.F16, nKv, len)
      raw.ggml_set_name(mask, nSeq > 1 ? `inp_kq_mask_${s}` : "inp_kq_mask")
      raw.ggml_set_input(mask)
      const session = it.session
      segments.push({
        offset,
        n: len,
        nKv,
        kv: (il) => session.kv.get(il)!,
        kvIdx: nSeq > 1 ? raw.ggml_view_1d(ctx, kvIdx, len, offset * 8) : kvIdx,
        mask,
        rows: rowIdx === null ? null : raw.ggml_view_1d(ctx, rowIdx, len, offset * 8)
      })
      offset += len
    })
    const outIds = spec.isLast ? input1d(GgmlType.I32, nSeq, "inp_out_ids") : null
    const inputs: GraphInputs = { pos, outIds, segments }

    let x: Ptr
    let tokens: Ptr | null = null
    let hidden: Ptr | null = null
    if (kind === "Tokens") {
      tokens = input1d(GgmlType.I32, n, "inp_tokens")
      x = raw.ggml_get_rows(ctx, w.get("token_embd.weight"), tokens)
    } else {
      x = raw.ggml_new_tensor_2d(ctx, GgmlType.F32, hp.nEmbd, n)
      raw.ggml_set_name(x, "inp_hidden")
      raw.ggml_set_input(x)
      // never reused in place by the graph: a lone call may point it at the caller's memory (zeroCopyHidden)
      raw.ggml_set_output(x)
      hidden = x
    }

    // several sequences only: a lone call keeps exactly the products (and bits) it always had
    const small = w.device === "cpu" && nSeq > 1
      ? {
        maxRowsFor: w.smallRowsFor ?? (() => exactRowsDefault),
        allowed: (p: Ptr) => fewRowRouteAllowed(w.homeOf(p)),
        shapeOf: (p: Ptr) => w.ggml.tensorShape(p)
      }
      : null
    const t = new Toolkit(raw, ctx, graph, hp, n, inputs, small)
    for (let il = spec.layerStart; il < spec.layerEndExclusive; il++) {
      t.layer = il
      const prefix = `blk.${il}.`
      const bw: BlockWeights = {
        get: (name) => w.get(prefix + name),
        opt: (name) => w.tensors.get(prefix + name) ?? null,
        global: (name) => w.tensors.get(name) ?? null
      }
      x = arch.buildBlock(t, bw, x)
    }
    if (spec.isLast) {
      x = t.rmsNorm(x, w.get("output_norm.weight"))
      x = t.linear(w.get("output.weight"), x, w.tensors.get("output.bias") ?? null)
    }
    raw.ggml_set_output(x)
    raw.ggml_build_forward_expand(graph, x)

    // one backend, no scheduler: every node must be one the device computes as built (WeightPlacement.ts, rule 3)
    checkGraph(w.ggml, w.dev, graph, w.extraWeights)
    if (!raw.ggml_gallocr_alloc_graph(slot.galloc, graph)) throw new Error("could not allocate the compute graph")
    return {
      key,
      sessions: items.map((it) => it.session.id),
      ctx,
      graph,
      inputs,
      kvIdx,
      rowIdx,
      tokens,
      hidden,
      out: x
    }
  } catch (e) {
    raw.ggml_free(ctx)
    throw e
  }
}
