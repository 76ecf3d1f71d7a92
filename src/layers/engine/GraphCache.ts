/**
 * A stage's cached compute graphs: one slot per session (a lone session keeps its decode graph between steps), one
 * for calls over several sessions that are not all decode steps, and up to DECODE_GRAPH_SLOTS for decode steps over
 * several sessions (pipeline groups take turns on a stage). Each slot owns a graph allocator and its compute
 * buffer; `computeBytes` counts them all, and the number of slots is bounded (sessions + 1 + DECODE_GRAPH_SLOTS).
 */
import type { GgmlRaw, Ptr } from "../ggml/Bindings.js"
import type { GraphInputs } from "./Toolkit.js"

/** Compute graphs built (a call whose shape has a cached graph builds none; tests count rebuilds with it). */
export const graphBuilds = { count: 0 }

/**
 * Cached graphs of decode steps over several sessions, per loaded stage. At 4 requests on 2 stages a stage runs
 * {a, b}, then {c, d}, then {a, b}...: one slot rebuilt the graph at every step (its cost: bench/README.md, "Design
 * measurements"). Decode graphs are small (one row per sequence).
 */
export const DECODE_GRAPH_SLOTS = 4

/** A built and allocated graph of one call shape. */
export interface CachedGraph {
  /** (input kind, then session id, n, nKv of each sequence): the graph depends on nothing else */
  readonly key: string
  /** Ids of the sessions whose KV cache tensors the graph writes and reads. */
  readonly sessions: ReadonlyArray<number>
  readonly ctx: Ptr
  readonly graph: Ptr
  readonly inputs: GraphInputs
  /** I64 [n] all sequences' KV cells, in row order */
  readonly kvIdx: Ptr
  /** I64 [nTokens] ring cells of the sliding-window blocks' caches (null when the stage has none) */
  readonly swaKvIdx: Ptr | null
  /** I64 [n] 0..n-1 (several sequences only) */
  readonly rowIdx: Ptr | null
  readonly tokens: Ptr | null
  readonly hidden: Ptr | null
  readonly out: Ptr
}

/**
 * How a stage's graphs are placed and run: on one backend by a graph allocator (a CPU stage), or by a ggml scheduler
 * over the GPU backend and the CPU backend (a GPU stage: blocks left in host memory, and ops the device does not
 * compute, run on the CPU, with copies only where a split changes backend).
 */
export type GraphPlacer =
  | { readonly kind: "backend"; readonly buft: Ptr }
  | { readonly kind: "scheduler"; readonly gpu: Ptr; readonly cpu: Ptr }

/**
 * What a stage's slots share: how they place graphs (a GPU stage's GPU backend is replaced by
 * NativeWeights.renewStaleBackend), and whether a buffer in device memory was destroyed while that backend lived (a
 * slot's compute buffer freed or replaced by a larger one, a session's caches freed).
 */
export class SlotPlacement {
  deviceBuffersFreed = false
  constructor(public placer: GraphPlacer) {}
}

/**
 * A graph allocator (or scheduler) and the last graph it placed. A decode step of the same shape as the last call skips
 * graph construction (hundreds of native calls) and allocation; a call of another shape frees the cached graph.
 */
export class GraphSlot {
  cached: CachedGraph | null = null
  private freed = false
  readonly galloc: Ptr | null
  /** The scheduler of a GPU stage's slot (made for the first graph, again for a larger one). */
  sched: Ptr | null = null
  private schedSize = 0

  constructor(
    readonly raw: GgmlRaw,
    private readonly shared: SlotPlacement,
    private readonly onFree: (slot: GraphSlot) => void = () => {}
  ) {
    const placer = shared.placer
    this.galloc = placer.kind === "backend" ? raw.ggml_gallocr_new(placer.buft) : null
  }

  private get placer(): GraphPlacer {
    return this.shared.placer
  }

  /** Places a built graph's tensors in this slot's compute buffers (false: no memory). */
  allocate(graph: Ptr): boolean {
    if (this.galloc !== null) return this.raw.ggml_gallocr_alloc_graph(this.galloc, graph)
    if (this.placer.kind !== "scheduler") return false
    // the scheduler's hash set must hold every node and leaf (ggml asserts it): a graph holds at most `size` of each
    const needed = 2 * this.raw.ggml_graph_size(graph) + 64
    if (this.sched === null || this.schedSize < needed) {
      this.freeSched()
      this.sched = this.raw.ggml_backend_sched_new([this.placer.gpu, this.placer.cpu], null, 2, needed, false, true)
      this.schedSize = needed
      if (this.sched === null) throw new Error("could not make the GPU stage's scheduler")
    }
    const deviceBytes = this.computeBytesOn(this.placer.gpu)
    this.raw.ggml_backend_sched_reset(this.sched)
    const placed = this.raw.ggml_backend_sched_alloc_graph(this.sched, graph)
    if (placed) this.splits = Math.max(this.splits, this.raw.ggml_backend_sched_get_n_splits(this.sched))
    // ggml's allocator replaces a compute buffer that must grow: the smaller one is destroyed
    if (deviceBytes > 0 && this.computeBytesOn(this.placer.gpu) !== deviceBytes) this.shared.deviceBuffersFreed = true
    return placed
  }

  /** Frees the scheduler and its compute buffers (those in device memory are destroyed: SlotPlacement says so). */
  private freeSched(): void {
    if (this.sched === null) return
    this.raw.ggml_backend_sched_free(this.sched)
    this.sched = null
    this.schedSize = 0
    this.shared.deviceBuffersFreed = true
  }

  /**
   * Frees the cached graph and the scheduler, keeping the slot: its next graph gets a scheduler over the stage's
   * backends as they are then (NativeWeights.renewStaleBackend replaces the GPU one).
   */
  release(): void {
    this.drop()
    this.freeSched()
  }

  /** The most pieces a graph of this slot was split into between backends (1: all on the device; 0: none yet). */
  splits = 0

  /** Bytes of this slot's compute buffers (what its largest graph so far needed), on `backend` only when given. */
  computeBytesOn(backend?: Ptr): number {
    if (this.freed) return 0
    if (this.galloc !== null) return this.raw.ggml_gallocr_get_buffer_size(this.galloc, 0)
    if (this.sched === null || this.placer.kind !== "scheduler") return 0
    const backends = backend === undefined ? [this.placer.gpu, this.placer.cpu] : [backend]
    let sum = 0
    for (const b of backends) sum += this.raw.ggml_backend_sched_get_buffer_size(this.sched!, b)
    return sum
  }

  /** Bytes of this slot's compute buffers (what its largest graph so far needed). */
  get computeBytes(): number {
    return this.computeBytesOn()
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
    if (this.galloc !== null) this.raw.ggml_gallocr_free(this.galloc)
    this.freeSched()
    this.onFree(this)
  }
}

/** Every graph slot of one loaded stage. */
export class StageGraphs {
  /** Graphs of calls over several sessions that are not all decode steps (created on the first such call). */
  private batch: GraphSlot | null = null
  /** Graphs of decode steps over several sessions, least recently used first. */
  private readonly decodeSlots: Array<GraphSlot> = []
  /** The sessions' own slots, while they live. */
  private readonly sessionSlots = new Set<GraphSlot>()

  private readonly placement: SlotPlacement

  constructor(
    private readonly raw: GgmlRaw,
    placer: GraphPlacer
  ) {
    this.placement = new SlotPlacement(placer)
  }

  /** Whether a buffer in device memory was destroyed since the GPU backend was made (SlotPlacement). */
  get deviceBuffersFreed(): boolean {
    return this.placement.deviceBuffersFreed
  }

  /** A session's caches in device memory were freed. */
  deviceCachesFreed(): void {
    this.placement.deviceBuffersFreed = true
  }

  /** Frees every slot's cached graph and scheduler, keeping the slots (NativeWeights.renewStaleBackend). */
  releaseSchedulers(): void {
    this.batch?.release()
    for (const slot of [...this.decodeSlots, ...this.sessionSlots]) slot.release()
  }

  /** A GPU stage's new GPU backend, for the slots' next schedulers (after releaseSchedulers): none of its buffers freed. */
  useGpu(gpu: Ptr): void {
    const placer = this.placement.placer
    if (placer.kind === "scheduler") this.placement.placer = { ...placer, gpu }
    this.placement.deviceBuffersFreed = false
  }

  /** A new session's own slot (freed with the session). */
  sessionSlot(): GraphSlot {
    const slot = new GraphSlot(this.raw, this.placement, (s) => this.sessionSlots.delete(s))
    this.sessionSlots.add(slot)
    return slot
  }

  batchSlot(): GraphSlot {
    return (this.batch ??= new GraphSlot(this.raw, this.placement))
  }

  /** The slot for a decode step over several sessions: the one holding `key`'s graph, else the least recently used. */
  decodeSlot(key: string): GraphSlot {
    let at = this.decodeSlots.findIndex((slot) => slot.cached?.key === key)
    if (at < 0) {
      if (this.decodeSlots.length < DECODE_GRAPH_SLOTS) {
        this.decodeSlots.push(new GraphSlot(this.raw, this.placement))
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

  /** Bytes of every compute buffer of the stage (its sessions' slots included). */
  get computeBytes(): number {
    return this.computeBytesOn()
  }

  /** The most pieces one of the stage's graphs was split into between the device and the CPU (GraphSlot.splits). */
  get splits(): number {
    let most = this.batch?.splits ?? 0
    for (const slot of [...this.decodeSlots, ...this.sessionSlots]) most = Math.max(most, slot.splits)
    return most
  }

  /** Bytes of every compute buffer of the stage on `backend` (a GPU stage's device or CPU), or on all when absent. */
  computeBytesOn(backend?: Ptr): number {
    let total = this.batch?.computeBytesOn(backend) ?? 0
    for (const slot of this.decodeSlots) total += slot.computeBytesOn(backend)
    for (const slot of this.sessionSlots) total += slot.computeBytesOn(backend)
    return total
  }

  free(): void {
    this.batch?.free()
    this.batch = null
    for (const slot of this.decodeSlots.splice(0)) slot.free()
  }
}
