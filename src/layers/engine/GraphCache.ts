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
 * A graph allocator and the last graph it placed. A decode step of the same shape as the last call skips graph
 * construction (hundreds of native calls) and allocation; a call of another shape frees the cached graph.
 */
export class GraphSlot {
  cached: CachedGraph | null = null
  private freed = false
  readonly galloc: Ptr

  constructor(
    readonly raw: GgmlRaw,
    buft: Ptr,
    private readonly onFree: (slot: GraphSlot) => void = () => {}
  ) {
    this.galloc = raw.ggml_gallocr_new(buft)
  }

  /** Bytes of this slot's compute buffer (what its largest graph so far needed). */
  get computeBytes(): number {
    return this.freed ? 0 : this.raw.ggml_gallocr_get_buffer_size(this.galloc, 0)
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

  constructor(
    private readonly raw: GgmlRaw,
    private readonly buft: Ptr
  ) {}

  /** A new session's own slot (freed with the session). */
  sessionSlot(): GraphSlot {
    const slot = new GraphSlot(this.raw, this.buft, (s) => this.sessionSlots.delete(s))
    this.sessionSlots.add(slot)
    return slot
  }

  batchSlot(): GraphSlot {
    return (this.batch ??= new GraphSlot(this.raw, this.buft))
  }

  /** The slot for a decode step over several sessions: the one holding `key`'s graph, else the least recently used. */
  decodeSlot(key: string): GraphSlot {
    let at = this.decodeSlots.findIndex((slot) => slot.cached?.key === key)
    if (at < 0) {
      if (this.decodeSlots.length < DECODE_GRAPH_SLOTS) {
        this.decodeSlots.push(new GraphSlot(this.raw, this.buft))
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
    let total = this.batch?.computeBytes ?? 0
    for (const slot of this.decodeSlots) total += slot.computeBytes
    for (const slot of this.sessionSlots) total += slot.computeBytes
    return total
  }

  free(): void {
    this.batch?.free()
    this.batch = null
    for (const slot of this.decodeSlots.splice(0)) slot.free()
  }
}
