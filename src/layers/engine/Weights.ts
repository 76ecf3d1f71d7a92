/**
 * A stage's weights: placed (WeightPlacement.ts), mapped from the file or read into buffers, repacked where the rule
 * allows, and later moved out of the mapping into huge-page memory ("settle"). Everything here assumes a validated
 * StageLayout (StageLayout.ts).
 */
import koffi from "koffi"
import { type FileHandle, open } from "node:fs/promises"
import { tensorFilePath } from "../../domain/gguf.js"
import type { LoadProgress } from "../../domain/engine.js"
import { type Ggml, getGgml, type Ptr, TensorLayout } from "../ggml/Bindings.js"
import {
  canMap,
  type FileRegion,
  libcFunction,
  locate,
  MAP_GRANULE,
  mapRanges,
  populateRanges,
  releaseAllBut,
  releasePages,
  unmapAll
} from "./FileMap.js"
import { StageGraphs } from "./GraphCache.js"
import type { PlannedTensor, StageLayout } from "./StageLayout.js"
import { chooseExtraBuffer, deviceComputesWeight, type WeightHome } from "./WeightPlacement.js"

const GGML_BACKEND_BUFFER_USAGE_WEIGHTS = 1
const READ_CHUNK = 4 * 1024 * 1024

/** Bytes a weight move copies (and then releases from the mapping) per step, within one hold of the lock. */
const MOVE_CHUNK = 8 * 1024 * 1024

/** Serializes native work on one backend (its CPU work buffer is not shared safely). */
class Lock {
  private tail: Promise<void> = Promise.resolve()
  run<A>(f: () => Promise<A>): Promise<A> {
    const result = this.tail.then(f)
    this.tail = result.then(
      () => undefined,
      () => undefined
    )
    return result
  }
}

export interface TensorPlacement {
  readonly name: string
  readonly bufferType: string
  readonly bytes: number
}

export type DeviceKind = "cpu" | "gpu"

/**
 * A GPU stage's split between device and host memory (like llama.cpp's `-ngl`): blocks from `deviceFrom` on, with the
 * output head, in device memory; earlier blocks (and the input tables when any block stays behind) in host memory, run
 * on the CPU by the stage's scheduler. The CPU backend runs those and the ops the device does not compute.
 */
export interface DeviceSplitOf {
  readonly deviceFrom: number
  readonly cpuBackend: Ptr
}

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
    backend: Ptr,
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
    private readonly mappedTensors: ReadonlyArray<{
      readonly name: string
      readonly p: Ptr
      readonly bytes: number
    }> = [],
    /** Addresses of the weights in extra (repacked) buffer types (WeightPlacement.ts, rules 2 and 3). */
    readonly extraWeights: ReadonlySet<bigint> = new Set(),
    /** A GPU stage's split (null on the CPU). */
    readonly split: DeviceSplitOf | null = null,
    /** Bytes of the weight buffers in device memory (a GPU stage; 0 on the CPU). */
    readonly deviceWeightBytes: number = 0
  ) {
    this.stageBackend = backend
    this.renewsBackend = split !== null && bindsStaleDescriptors(ggml.raw.ggml_backend_dev_description(dev))
    this.graphs = new StageGraphs(
      ggml.raw,
      split === null
        ? { kind: "backend", buft: ggml.raw.ggml_backend_dev_buffer_type(dev) }
        : { kind: "scheduler", gpu: backend, cpu: split.cpuBackend }
    )
  }

  private stageBackend: Ptr

  /** The backend the stage computes on (a GPU stage's GPU backend; replaced by `renewStaleBackend`). */
  get backend(): Ptr {
    return this.stageBackend
  }

  /** Whether this GPU stage's device needs `renewStaleBackend` (bindsStaleDescriptors). */
  readonly renewsBackend: boolean

  /**
   * On a device that binds stale descriptors (bindsStaleDescriptors), a GPU stage's backend that may have bound a buffer
   * since destroyed is replaced before it computes again: every slot's scheduler and cached graph are freed, then the
   * backend (its descriptor sets with it), and a new one made. True when it was replaced (the callers' graphs are gone).
   */
  renewStaleBackend(): boolean {
    if (!this.renewsBackend || !this.graphs.deviceBuffersFreed) return false
    const raw = this.ggml.raw
    const backend = raw.ggml_backend_dev_init(this.dev, null)
    if (backend === null)
      throw new Error(`could not start the ggml ${raw.ggml_backend_dev_name(this.dev)} backend again`)
    // the schedulers (over the old backend) first, then the old backend
    this.graphs.releaseSchedulers()
    raw.ggml_backend_free(this.stageBackend)
    this.stageBackend = backend
    this.graphs.useGpu(backend)
    return true
  }

  /** Bytes of the device buffers of the caches of this stage's open sessions (KvCache.ts keeps it). */
  deviceKvBytes = 0

  /** Is block `il`'s memory (weights, KV) on the device? */
  onDevice(il: number): boolean {
    return this.split !== null && il >= this.split.deviceFrom
  }

  /** The backend threads are set on: the stage's CPU backend (a GPU stage's CPU part). */
  get threadsBackend(): Ptr {
    return this.split === null ? this.backend : this.split.cpuBackend
  }

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
      total = ((total + align - 1n) / align) * align
      offsets.push(total)
      total += BigInt(t.bytes)
    }
    const buffer = await this.lock.run(async () => {
      if (this.freed) return null
      const b = raw.ggml_backend_buft_alloc_buffer(buft, Number(total))
      if (b === null) return null
      raw.ggml_backend_buffer_set_usage(b, GGML_BACKEND_BUFFER_USAGE_WEIGHTS)
      if (this.hugePages) adviseHugePages(raw.ggml_backend_buffer_get_base(b), Number(total))
      this.laterBuffers.push(b)
      return b
    })
    if (buffer === null) return false
    const base = koffi.address(raw.ggml_backend_buffer_get_base(buffer))
    // In address order, so that every page below the tensor being copied is no longer read in place: each chunk's
    // source pages leave the resident set once copied (the mapping and the copy are never both resident).
    const order = this.mappedTensors
      .map((t, i) => ({ t, i, from: koffi.address(koffi.decode(t.p, TensorLayout.data, "void *") as Ptr) }))
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
            low.set(region, (end / granule) * granule)
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

  /** The stage's cached compute graphs and their allocators (GraphCache.ts): counted, bounded. */
  readonly graphs: StageGraphs

  /**
   * Per weight type, the most rows of a CPU product that take ggml's one-row kernel (SmallBatch.ts): chosen before
   * the first graph over several sessions is built, then fixed for the weights' life.
   */
  smallRowsFor: ((type: number) => number) | undefined = undefined

  /** Point a lone call's hidden input at the caller's rows (loadWeights' `zeroCopy`; Forward.ts). */
  zeroCopy = true

  /** Advise transparent huge pages for this stage's CPU weight memory (loadWeights' `hugePages`). */
  hugePages = true

  /** Bytes of hidden states copied into graph inputs so far (Forward.ts; tests count copies per hop with it). */
  copiedInputBytes = 0
  /** Threads of the last CPU forward (diagnostics: which of a session's thread counts a call took). */
  lastThreads = 0

  free(): void {
    if (this.freed) return
    this.freed = true
    const raw = this.ggml.raw
    this.graphs.free()
    for (const b of this.buffers) raw.ggml_backend_buffer_free(b)
    for (const b of this.laterBuffers) raw.ggml_backend_buffer_free(b)
    for (const c of this.contexts) raw.ggml_free(c)
    raw.ggml_backend_free(this.backend)
    if (this.split !== null) raw.ggml_backend_free(this.split.cpuBackend)
    // after the buffers: nothing points into the mappings any more
    unmapAll(this.regions)
  }
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
  const start = ((a + HUGE_PAGE - 1n) / HUGE_PAGE) * HUGE_PAGE
  const end = ((a + BigInt(size)) / HUGE_PAGE) * HUGE_PAGE
  if (end > start) madvise(start, Number(end - start), MADV_HUGEPAGE)
}

/** ggml's TENSOR_ALIGNMENT: what a CPU buffer over foreign memory promises (and what kernels may assume). */
const MAPPED_ALIGNMENT = 32

/** Is weight mapping wanted (`mmap: false` turns it off; CPU stages on Linux only)? */
const mmapWanted = (option: boolean | undefined, device: DeviceKind): boolean =>
  device === "cpu" && option !== false && canMap()

/** How loadWeights places and reads a stage's weights. */
interface LoadOptions {
  readonly repack?: boolean
  readonly device?: DeviceKind
  readonly mmap?: boolean
  /** Fixes the few-row route's row limit for every weight type (nothing measured); see NativeWeights.smallRowsFor. */
  readonly smallBatchRows?: number
  /** Lone calls read hidden inputs in place (default true; Forward.ts). */
  readonly zeroCopy?: boolean
  /** Advise transparent huge pages for CPU weight memory (default true). */
  readonly hugePages?: boolean
  /** A GPU stage: the first block in device memory (default: the stage's first, every block on the device). */
  readonly deviceFrom?: number
  readonly onProgress?: (p: LoadProgress) => void
}

/**
 * The stage's byte ranges of its file (a split set's parts apart, only those holding the stage's tensors), mapped
 * read-only and not prefaulted whole; none when mapping is not wanted or fails (the weights are then read).
 */
const mapStageRanges = async (
  layout: StageLayout,
  mmap: boolean | undefined,
  device: DeviceKind
): Promise<ReadonlyArray<FileRegion>> => {
  if (!mmapWanted(mmap, device)) return []
  try {
    // not prefaulted whole: the tensors copied out (repacked, unaligned) are read once, then their pages released
    // a split set's parts map apart, and only those holding this stage's tensors
    const byFile = new Map<string, Array<{ offset: number; size: number }>>()
    for (const t of layout.tensors) {
      const path = tensorFilePath(layout.file, t.info)
      if (!byFile.has(path)) byFile.set(path, [])
      byFile.get(path)!.push({ offset: t.info.offset, size: t.info.byteSize })
    }
    const mapped: Array<FileRegion> = []
    try {
      for (const [path, ranges] of byFile) mapped.push(...(await mapRanges(path, ranges, { populate: false })))
    } catch (e) {
      unmapAll(mapped)
      throw e
    }
    return mapped
  } catch (e) {
    // a file now shorter than its table must not be read either; any other mapping failure: copy instead
    if (e instanceof Error && e.message.startsWith("the file is")) throw e
    return []
  }
}

/** A group's member: the tensor's index in the layout, and its address when used in place in a mapping. */
type GroupMember = { name: string; index: number; addr?: bigint }

/** Where the tensors live, in first-seen order: a buffer type (allocated, filled by copies) or a file region (in place). */
interface TensorGroups {
  readonly groups: Map<Ptr | FileRegion, Array<GroupMember>>
  readonly keys: Array<Ptr | FileRegion>
}

const groupTensors = (
  g: Ggml,
  layout: StageLayout,
  homeBuft: (t: PlannedTensor) => Ptr,
  extra: ReturnType<Ggml["cpuExtraBufferTypes"]>,
  cpuBuft: Ptr,
  regions: ReadonlyArray<FileRegion>
): TensorGroups => {
  const groups = new Map<Ptr | FileRegion, Array<GroupMember>>()
  const keys: Array<Ptr | FileRegion> = []
  layout.tensors.forEach((t, index) => {
    let buft = homeBuft(t)
    if (t.use === "mul_mat" || t.use === "mul_mat_id")
      buft = chooseExtraBuffer(g, extra, t.use, t.info.type, t.info.dims) ?? buft
    let key: Ptr | FileRegion = buft
    let addr: bigint | undefined
    if (buft === cpuBuft && t.info.byteSize > 0 && t.info.offset % MAPPED_ALIGNMENT === 0) {
      const at = locate(regions, tensorFilePath(layout.file, t.info), t.info.offset, t.info.byteSize)
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
  return { groups, keys }
}

/** What a load has made so far (freed by loadWeights if it fails), and its tallies. */
interface WeightsInProgress {
  readonly raw: Ggml["raw"]
  readonly layout: StageLayout
  readonly device: DeviceKind
  readonly cpuBuft: Ptr
  readonly contexts: Array<Ptr>
  readonly buffers: Array<Ptr>
  readonly tensors: Map<string, Ptr>
  readonly placements: Array<TensorPlacement>
  /** names of the tensors used in place in a mapping */
  readonly mapped: Set<string>
  readonly mappedTensors: Array<{ name: string; p: Ptr; bytes: number }>
  /** tensors in an extra (repacked) buffer type: set whole, repacking needs every row at once */
  readonly repacked: Set<string>
  readonly inPlaceRanges: Array<readonly [bigint, number]>
  bufferBytes: number
  deviceBytes: number
  mappedBytes: number
}

/** A group's context and its tensors (not yet allocated), each checked against the GGUF table's byte size. */
const newGroupTensors = (s: WeightsInProgress, members: ReadonlyArray<GroupMember>) => {
  const { raw, layout } = s
  const ctx = raw.ggml_init({
    mem_size: raw.ggml_tensor_overhead() * (members.length + 1),
    mem_buffer: null,
    no_alloc: true
  })
  if (ctx === null) throw new Error("ggml_init failed for the weights context")
  s.contexts.push(ctx)
  const made: Array<{ p: Ptr; addr?: bigint }> = []
  for (const m of members) {
    const t = layout.tensors[m.index]!
    const d = t.info.dims
    const p =
      d.length <= 1
        ? raw.ggml_new_tensor_1d(ctx, t.info.type, d[0]!)
        : d.length === 2
          ? raw.ggml_new_tensor_2d(ctx, t.info.type, d[0]!, d[1]!)
          : raw.ggml_new_tensor_3d(ctx, t.info.type, d[0]!, d[1]!, d[2] ?? 1)
    raw.ggml_set_name(p, t.name.slice(0, 63))
    const nbytes = raw.ggml_nbytes(p)
    if (nbytes !== t.info.byteSize) {
      throw new Error(`tensor ${t.name}: ggml says ${nbytes} bytes, the GGUF table ${t.info.byteSize}`)
    }
    s.tensors.set(t.name, p)
    made.push(m.addr === undefined ? { p } : { p, addr: m.addr })
  }
  return { ctx, made }
}

/** A group used in place: a CPU buffer over the mapped region, each tensor at its address in it. */
const placeInMapping = (
  s: WeightsInProgress,
  region: FileRegion,
  members: ReadonlyArray<GroupMember>,
  made: ReadonlyArray<{ p: Ptr; addr?: bigint }>
) => {
  const raw = s.raw
  const buffer = raw.ggml_backend_cpu_buffer_from_ptr(region.base, region.length)
  if (buffer === null) throw new Error("could not make a CPU buffer over the mapped weights")
  s.buffers.push(buffer)
  raw.ggml_backend_buffer_set_usage(buffer, GGML_BACKEND_BUFFER_USAGE_WEIGHTS)
  const align = raw.ggml_backend_buffer_get_alignment(buffer)
  for (const [i, m] of made.entries()) {
    const t = s.layout.tensors[members[i]!.index]!
    if (align <= 0 || m.addr! % BigInt(align) !== 0n) {
      throw new Error(`tensor ${t.name}: mapped address is not aligned to ${align} bytes`)
    }
    if (raw.ggml_backend_tensor_alloc(buffer, m.p, m.addr!) !== 0) {
      throw new Error(`tensor ${t.name}: could not place it in the mapped weights`)
    }
    s.mapped.add(t.name)
    s.inPlaceRanges.push([m.addr!, t.info.byteSize])
    s.mappedTensors.push({ name: t.name, p: m.p, bytes: t.info.byteSize })
    s.mappedBytes += t.info.byteSize
    s.placements.push({ name: t.name, bufferType: MAPPED_BUFFER_TYPE, bytes: t.info.byteSize })
  }
}

/** A group of one buffer type: one buffer allocated for its context's tensors (huge pages advised on the CPU). */
const allocateGroup = (
  s: WeightsInProgress,
  ctx: Ptr,
  buft: Ptr,
  members: ReadonlyArray<GroupMember>,
  hugePages: boolean | undefined
) => {
  const { raw, device, cpuBuft } = s
  for (const m of members) {
    const t = s.layout.tensors[m.index]!
    s.placements.push({ name: t.name, bufferType: raw.ggml_backend_buft_name(buft), bytes: t.info.byteSize })
    if (device === "cpu" && buft !== cpuBuft) s.repacked.add(t.name)
  }
  const buffer = raw.ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft)
  if (buffer === null) {
    throw new Error(`could not allocate ${raw.ggml_backend_buft_name(buft)} memory for the stage's weights`)
  }
  raw.ggml_backend_buffer_set_usage(buffer, GGML_BACKEND_BUFFER_USAGE_WEIGHTS)
  if (device === "cpu" && hugePages !== false) {
    adviseHugePages(raw.ggml_backend_buffer_get_base(buffer), raw.ggml_backend_buffer_get_size(buffer))
  }
  s.buffers.push(buffer)
  s.bufferBytes += raw.ggml_backend_buffer_get_size(buffer)
  if (device === "gpu" && buft === cpuBuft) s.deviceBytes += raw.ggml_backend_buffer_get_size(buffer)
}

/** Reports bytes loaded so far of the stage's total. */
type Progress = (loaded: number) => void

/**
 * In place: nothing to copy, only prefaulted; the rest (repacked or unaligned) is set from the mapping, whole, and its
 * pages leave the resident set once copied (rounded inward: a neighbour read in place keeps its own). Returns the bytes
 * released from the mappings.
 */
const fillFromMapping = async (
  s: WeightsInProgress,
  regions: ReadonlyArray<FileRegion>,
  order: ReadonlyArray<PlannedTensor>,
  progress: Progress
): Promise<number> => {
  const raw = s.raw
  let loaded = 0
  await populateRanges(regions, s.inPlaceRanges)
  for (const t of order) {
    if (!s.mapped.has(t.name) && t.info.byteSize > 0) {
      const at = locate(regions, tensorFilePath(s.layout.file, t.info), t.info.offset, t.info.byteSize)
      if (at === undefined) throw new Error(`internal: tensor ${t.name} is outside the mapped ranges`)
      raw.ggml_backend_tensor_set_from(s.tensors.get(t.name)!, at.addr, 0, t.info.byteSize)
      releasePages(at.addr, at.addr + BigInt(t.info.byteSize))
    }
    loaded += t.info.byteSize
    progress(loaded)
  }
  // the repacked and unaligned tensors were copied out: only the in-place ones still read the mapping
  return releaseAllBut(regions, s.inPlaceRanges)
}

/** Reads every tensor from its file in chunks (a repacked one whole: repacking needs every row at once). */
const fillFromFiles = async (s: WeightsInProgress, order: ReadonlyArray<PlannedTensor>, progress: Progress) => {
  const raw = s.raw
  let loaded = 0
  const handles = new Map<string, FileHandle>()
  const handleOf = async (path: string) => {
    let fh = handles.get(path)
    if (fh === undefined) {
      fh = await open(path, "r")
      handles.set(path, fh)
    }
    return fh
  }
  try {
    let chunk = Buffer.allocUnsafe(Math.min(READ_CHUNK, Math.max(1, ...order.map((t) => t.info.byteSize))))
    for (const t of order) {
      const p = s.tensors.get(t.name)!
      const whole = s.repacked.has(t.name)
      const size = t.info.byteSize
      if (whole && chunk.length < size) chunk = Buffer.allocUnsafe(size)
      const step = whole ? size : chunk.length
      const fh = await handleOf(tensorFilePath(s.layout.file, t.info))
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
        progress(loaded)
      }
    }
  } finally {
    for (const fh of handles.values()) await fh.close()
  }
}

/** The loaded stage's weights over its backends, with the load's options. */
const finishWeights = (
  g: Ggml,
  s: WeightsInProgress,
  dev: Ptr,
  backend: Ptr,
  cpuBackend: Ptr | null,
  regions: ReadonlyArray<FileRegion>,
  releasedAtLoad: number,
  options: LoadOptions
): NativeWeights => {
  const { layout } = s
  const extraWeights = new Set<bigint>()
  for (const name of s.repacked) extraWeights.add(koffi.address(s.tensors.get(name)!))
  const weights = new NativeWeights(
    g,
    layout,
    s.device,
    dev,
    backend,
    s.contexts,
    s.buffers,
    s.tensors,
    s.placements,
    s.bufferBytes,
    s.mappedBytes,
    regions,
    s.mappedTensors,
    extraWeights,
    cpuBackend === null ? null : { deviceFrom: options.deviceFrom ?? layout.spec.layerStart, cpuBackend },
    s.deviceBytes
  )
  weights.releasedBytes = releasedAtLoad
  const fixedRows = options.smallBatchRows
  if (fixedRows !== undefined) weights.smallRowsFor = () => fixedRows
  weights.zeroCopy = options.zeroCopy !== false
  weights.hugePages = options.hugePages !== false
  return weights
}

/**
 * Allocates and reads the tensors of the stage layout. Throws on native or I/O failure (after freeing what it made).
 *
 * On the CPU (unless `mmap: false`, as StageExecutorLive passes for SWACTOR_MMAP=0) the stage's byte ranges of the
 * file are mapped read-only:
 * plain weights (and their page cache) are used in place, repacked ones are repacked from the mapping. When
 * mapping fails the weights are read into allocated buffers as before.
 */
export const loadWeights = async (layout: StageLayout, options: LoadOptions = {}): Promise<NativeWeights> => {
  const g = getGgml()
  const raw = g.raw
  const device = options.device ?? "cpu"
  const dev = device === "gpu" ? g.gpuDevice() : g.cpuDevice()
  if (dev === null) throw new Error("no GPU device: load node-llama-cpp's CUDA package (SWACTOR_GGML_PACKAGE=cuda)")
  // on a GPU every weight lives in device memory; on the CPU quantized matrices may be repacked
  const cpuBuft = raw.ggml_backend_dev_buffer_type(dev)
  const extra = options.repack === false || device === "gpu" ? [] : g.cpuExtraBufferTypes()
  const homeBuft = homeOf(g, layout, device, dev, options.deviceFrom ?? layout.spec.layerStart)

  const regions = await mapStageRanges(layout, options.mmap, device)
  const { groups, keys } = groupTensors(g, layout, homeBuft, extra, cpuBuft, regions)

  const s: WeightsInProgress = {
    raw,
    layout,
    device,
    cpuBuft,
    contexts: [],
    buffers: [],
    tensors: new Map(),
    placements: [],
    mapped: new Set(),
    mappedTensors: [],
    repacked: new Set(),
    inPlaceRanges: [],
    bufferBytes: 0,
    deviceBytes: 0,
    mappedBytes: 0
  }
  let backend: Ptr | null = null
  let cpuBackend: Ptr | null = null
  try {
    for (const key of keys) {
      const members = groups.get(key)!
      const { ctx, made } = newGroupTensors(s, members)
      if (regions.includes(key as FileRegion)) placeInMapping(s, key as FileRegion, members, made)
      else allocateGroup(s, ctx, key as Ptr, members, options.hugePages)
    }

    const total = layout.weightBytes
    const progress: Progress = (loaded) => options.onProgress?.({ loadedBytes: loaded, totalBytes: total })
    progress(0)
    const order = [...layout.tensors].sort((a, b) => a.info.offset - b.info.offset)
    let releasedAtLoad = 0
    if (regions.length > 0) releasedAtLoad = await fillFromMapping(s, regions, order, progress)
    else await fillFromFiles(s, order, progress)
    backend = raw.ggml_backend_dev_init(dev, null)
    if (backend === null) throw new Error(`could not start the ggml ${raw.ggml_backend_dev_name(dev)} backend`)
    if (device === "gpu") cpuBackend = startCpuBackend(g)
    return finishWeights(g, s, dev, backend, cpuBackend, regions, releasedAtLoad, options)
  } catch (e) {
    for (const b of s.buffers) raw.ggml_backend_buffer_free(b)
    for (const c of s.contexts) raw.ggml_free(c)
    if (backend !== null) raw.ggml_backend_free(backend)
    if (cpuBackend !== null) raw.ggml_backend_free(cpuBackend)
    unmapAll(regions)
    throw e
  }
}

/**
 * Where a tensor is allocated: `dev`'s buffer type, or for a GPU stage's tensor that stays behind (DeviceSplitOf, or a
 * type the device does not compute: WeightPlacement.ts deviceComputesWeight) the CPU's.
 */
const homeOf = (g: Ggml, layout: StageLayout, device: DeviceKind, dev: Ptr, deviceFrom: number) => {
  const devBuft = g.raw.ggml_backend_dev_buffer_type(dev)
  const hostBuft = g.raw.ggml_backend_dev_buffer_type(g.cpuDevice())
  return (t: PlannedTensor): Ptr =>
    device === "gpu" &&
    !(onDeviceSide(layout, t, deviceFrom) && deviceComputesWeight(g, dev, t.use, t.info.type, t.info.dims))
      ? hostBuft
      : devBuft
}

/**
 * Does the device read every binding of a bound descriptor set, those its shader does not use included? Mesa's lavapipe
 * (llvmpipe) 22.3 does: ggml's Vulkan backend reuses its descriptor sets and writes only the bindings a shader uses, so a
 * binding left by an earlier dispatch still names the buffer it had, and once that buffer is destroyed (a compute
 * buffer replaced, a session's caches freed) binding the set again makes lavapipe take and drop references on the
 * freed buffer's resource: the process dies some dispatches later (SIGSEGV, "double free or corruption"). llama.cpp
 * frees a context's buffers with its backend, so it never binds a set so left; a stage's backend outlives its sessions
 * (renewStaleBackend).
 */
const bindsStaleDescriptors = (description: string): boolean => /llvmpipe/i.test(description)

/** The CPU backend of a GPU stage's scheduler (it runs what stays in host memory). */
const startCpuBackend = (g: Ggml): Ptr => {
  const backend = g.raw.ggml_backend_dev_init(g.cpuDevice(), null)
  if (backend === null) throw new Error("could not start the ggml CPU backend of the GPU stage")
  return backend
}

/**
 * Does tensor `t` belong on the device side of a GPU stage whose blocks from `deviceFrom` are on the device? A block's
 * tensors by its index; the input tables (first in the layout: token embeddings, per-layer tables) only when every
 * block is; shared and output tensors when any block is.
 */
const onDeviceSide = (layout: StageLayout, t: PlannedTensor, deviceFrom: number): boolean => {
  const { layerEndExclusive, layerStart } = layout.spec
  const block = /^blk\.(\d+)\./.exec(t.name)
  if (block !== null) return Number(block[1]) >= deviceFrom
  if (t.part === "input") return deviceFrom <= layerStart
  return deviceFrom < layerEndExclusive
}
