/**
 * One sequence's KV cache on a loaded stage (F16 K and V per block, cells padded as llama.cpp pads n_ctx; sizes from
 * services/KvSize.ts, the one formula), and what a native call is made of. Sliding-window blocks (HParams.swa) get a
 * cache capped near the window (`swaCacheSize`), its cells reused ring-wise: position p lives in cell p mod size, and
 * the window mask is built from the positions the cells hold (Forward.ts).
 */
import type { StageInput } from "../../domain/engine.js"
import { GgmlType, type Ptr } from "../ggml/Bindings.js"
import { kvCacheSize, swaCacheSize } from "../../services/KvSize.js"
import type { GraphSlot } from "./GraphCache.js"
import type { KvLayer } from "./Toolkit.js"
import type { NativeWeights } from "./Weights.js"
import { blockMemory, stateBytesOfMemory } from "./BlockMemory.js"
import { SnapshotStore } from "./SnapshotStore.js"

export type NativeOutput =
  | { readonly _tag: "Hidden"; readonly hidden: Float32Array; readonly nTokens: number }
  | { readonly _tag: "Logits"; readonly logits: Float32Array; readonly rows?: number }

/** One sequence's part of a native call (validated by the caller, see `runBatch`). */
export interface NativeItem {
  readonly session: NativeSession
  readonly startPos: number
  readonly input: StageInput
}

let nextSessionId = 1

/** What this process's open sessions hold: their count, their DeltaNet state bytes and all their cache bytes. */
const held = { sessions: 0, stateBytes: 0, cacheBytes: 0 }

/** The open sessions of this process and the bytes they hold (an agent reports it; a freed session is subtracted). */
export const heldSessionBytes = (): {
  readonly sessions: number
  readonly stateBytes: number
  readonly cacheBytes: number
} => ({
  ...held
})

/** One sequence's KV cache over loaded weights. */
/**
 * Cells of the stage's sliding-window caches: a ring near the window (`swaCacheSize`), or, uncapped (deepseek4), one
 * cell per position; null when the stage holds no sliding-window block.
 */
const windowCells = (
  hp: NativeWeights["layout"]["hp"],
  spec: NativeWeights["layout"]["spec"],
  contextLength: number
): number | null => {
  let hasSwa = false
  for (let il = spec.layerStart; il < spec.layerEndExclusive; il++) hasSwa ||= hp.swa?.layers[il] === true
  if (!hasSwa) return null
  return hp.swa!.uncapped === true ? kvCacheSize(contextLength) : swaCacheSize(contextLength, hp.swa!.window)
}

/** Whether the stage holds DeltaNet blocks (HParams.recurrent). */
const holdsRecurrent = (hp: NativeWeights["layout"]["hp"], spec: NativeWeights["layout"]["spec"]): boolean => {
  let recurrent = false
  for (let il = spec.layerStart; il < spec.layerEndExclusive; il++) recurrent ||= hp.recurrent?.layers[il] === true
  return recurrent
}

/** Values a V cell holds: vRow F16 places, or half as many F32 values (BlockMemory's vF32). */
const vValues = (vRow: number, f32: true | undefined) => (f32 === true ? vRow / 2 : vRow)

export class NativeSession {
  readonly id = nextSessionId++
  private readonly kvCtx: Ptr
  /** Bytes of this session's caches in a GPU stage's device memory (0 on the CPU). */
  private readonly deviceKvBytes: number
  /** A GPU stage's caches of the blocks left in host memory (NativeWeights.onDevice), when it has any. */
  private readonly hostKvCtx: Ptr | null
  /** The caches' buffers: one, or a GPU stage's device and host buffers (its blocks split by NativeWeights.onDevice). */
  private readonly kvBuffers: ReadonlyArray<Ptr>
  readonly kv: Map<number, KvLayer> = new Map()
  /** Graphs of calls on this session alone (a lone session keeps its decode graph between steps). */
  readonly slot: GraphSlot
  /** The slot of this session's speculative steps alone (StageInput.verify), made at the first. */
  private verify: GraphSlot | null = null
  freed = false
  /** Cells 0..filled-1 hold this sequence's K/V (of sliding-window blocks: positions swaLow..filled-1, ring-wise). */
  filled = 0
  /** Cells of each sliding-window block's cache (ring); null when the stage holds no sliding-window block. */
  readonly swaSize: number | null
  /** Sliding-window caches hold positions [swaLow, filled): the ones below were overwritten by later positions. */
  swaLow = 0
  /**
   * The stage holds DeltaNet blocks (HParams.recurrent): their state is that of position `filled` and cannot be
   * rewound, so a call must start at `filled` or at 0 (which clears the state), or inside the last verify step's
   * rows (its per-row snapshots, RecurrentSnapshots.ts), and a prefix copy must be whole.
   */
  readonly recurrent: boolean
  /** The recurrent blocks' per-row states of verify steps (made at the first). */
  snapshots: SnapshotStore | null = null
  /** The last call was a verify step of `snapshotRows` rows from `snapshotFrom` (0: the snapshots are stale). */
  private snapshotFrom = 0
  private snapshotRows = 0
  /** Bytes of this session's DeltaNet states (0 without DeltaNet blocks). */
  readonly stateBytes: number

  constructor(
    readonly weights: NativeWeights,
    readonly contextLength: number,
    readonly threads: number,
    /** Left out of `held` (the tally of runs' sessions): see SessionOptions.scratch. */
    readonly scratch = false,
    /** See SessionOptions.prefillThreads. */
    readonly prefillThreads = threads
  ) {
    const g = weights.ggml
    const raw = g.raw
    const { hp, spec } = weights.layout
    const kvSize = kvCacheSize(contextLength)
    const nLayers = spec.layerEndExclusive - spec.layerStart
    this.swaSize = windowCells(hp, spec, contextLength)
    this.recurrent = holdsRecurrent(hp, spec)
    this.kvCtx = raw.ggml_init({
      mem_size: raw.ggml_tensor_overhead() * (2 * nLayers + 1),
      mem_buffer: null,
      no_alloc: true
    })
    const split = weights.split
    const hostCtx =
      split !== null && split.deviceFrom > spec.layerStart
        ? raw.ggml_init({ mem_size: raw.ggml_tensor_overhead() * (2 * nLayers + 1), mem_buffer: null, no_alloc: true })
        : null
    this.hostKvCtx = hostCtx
    let stateBytes = 0
    for (let il = spec.layerStart; il < spec.layerEndExclusive; il++) {
      const m = blockMemory(hp, il)
      const ctx = split === null || weights.onDevice(il) ? this.kvCtx : hostCtx!
      // a DeltaNet block (qwen35): its recurrent state, F32, constant size (k: conv state, v: SSM state)
      if (m.kind === "state") {
        stateBytes += stateBytesOfMemory(m)
        const k = raw.ggml_new_tensor_1d(ctx, GgmlType.F32, m.conv)
        raw.ggml_set_name(k, `cache_r_l${il}`)
        const v = raw.ggml_new_tensor_1d(ctx, GgmlType.F32, m.ssm)
        raw.ggml_set_name(v, `cache_s_l${il}`)
        this.kv.set(il, { k, v })
        continue
      }
      // a block reading an earlier block's cache (HParams.kvShare: gemma4's shared KV layers) keeps none
      if (m.kind === "sharedKv") continue
      const cells = m.window !== undefined ? this.swaSize! : kvSize
      const k = raw.ggml_new_tensor_2d(ctx, GgmlType.F16, m.kRow, cells)
      raw.ggml_set_name(k, `cache_k_l${il}`)
      // latent attention: no V cache, V is read from K (the latent attention builds its own view)
      if (m.vRow === 0) {
        this.kv.set(il, { k, v: k })
        continue
      }
      const v = raw.ggml_new_tensor_2d(
        ctx,
        m.vF32 === true ? GgmlType.F32 : GgmlType.F16,
        vValues(m.vRow, m.vF32),
        cells
      )
      raw.ggml_set_name(v, `cache_v_l${il}`)
      this.kv.set(il, { k, v })
    }
    const caches = allocateCaches(weights, this.kvCtx, hostCtx)
    if (caches === null) {
      raw.ggml_free(this.kvCtx)
      if (hostCtx !== null) raw.ggml_free(hostCtx)
      throw new Error(`could not allocate the KV cache (${kvSize} cells x ${nLayers} blocks)`)
    }
    this.kvBuffers = caches.buffers
    this.deviceKvBytes = weights.split === null ? 0 : caches.deviceBytes
    weights.deviceKvBytes += this.deviceKvBytes
    // zeroed: NaN garbage in masked cells would still poison softmax(QK)·V
    for (const buf of caches.buffers) raw.ggml_backend_buffer_clear(buf, 0)
    this.slot = weights.graphs.sessionSlot()
    this.stateBytes = stateBytes
    if (!scratch) {
      held.sessions++
      held.stateBytes += stateBytes
      held.cacheBytes += this.kvBytes
    }
  }

  get kvSize(): number {
    return kvCacheSize(this.contextLength)
  }

  /** Bytes of the allocated K and V caches. */
  get kvBytes(): number {
    let sum = 0
    for (const b of this.kvBuffers) sum += this.weights.ggml.raw.ggml_backend_buffer_get_size(b)
    return sum
  }

  /** The sliding window, when the stage holds sliding-window blocks whose cache is smaller than the context's. */
  private get cappedWindow(): number | null {
    return this.swaSize !== null && this.swaSize < this.kvSize ? this.weights.layout.hp.swa!.window : null
  }

  /**
   * The most rows one call may take: all positions a row of it attends to must still be in the ring while the call
   * writes its own (size >= rows + window - 1, as llama.cpp's window + n_ubatch). Longer calls run in pieces.
   */
  get maxCallRows(): number {
    const window = this.cappedWindow
    return window === null ? Number.POSITIVE_INFINITY : this.swaSize! - window + 1
  }

  /**
   * Whether a call may start at `startPos` (<= filled): the positions its first row attends to in a sliding-window
   * block, [startPos - window + 1, startPos), are still held. A rewind further back than the ring reaches cannot be
   * served: StageExecutorLive refuses it (InvalidStageInput), and the caller computes those positions again.
   */
  canStartAt(startPos: number): boolean {
    if (this.recurrent && startPos !== 0 && startPos !== this.filled && !this.inSnapshots(startPos)) return false
    const window = this.cappedWindow
    return window === null || startPos === 0 || Math.max(0, startPos - window + 1) >= this.swaLow
  }

  /** Whether the last call was a verify step with a row after which a call from `startPos` starts. */
  private inSnapshots(startPos: number): boolean {
    const from = this.snapshotFrom
    return (
      this.snapshotRows > 0 && this.filled === from + this.snapshotRows && startPos > from && startPos < this.filled
    )
  }

  /**
   * Before a call from `startPos` (its rows not yet written): a recurrent stage's states are those of the position
   * before it (zeroed for 0; a verify step's row's snapshot for a call inside its rows), and stale snapshots until the
   * call succeeds (`snapshotsWritten`).
   */
  prepareStates(startPos: number): void {
    if (!this.recurrent) return
    if (startPos === 0) this.clearRecurrent()
    else if (this.inSnapshots(startPos)) {
      this.snapshots!.restore(this.kv, startPos - this.snapshotFrom - 1, this.snapshotRows)
    }
    this.snapshotRows = 0
  }

  /**
   * Snapshots with room for a verify step of `rows` rows, for its graph to write (null: the stage holds no recurrent
   * block). Growing them drops this session's verify graphs, which name the old ones.
   */
  snapshotsFor(rows: number): SnapshotStore | null {
    if (!this.recurrent) return null
    if (this.snapshots !== null && this.snapshots.rows >= rows) return this.snapshots
    this.dropSnapshots()
    this.verify?.free()
    this.verify = null
    const store = SnapshotStore.allocate(this.weights, this.kv.keys(), rows)
    if (store === null) throw new Error(`could not allocate the recurrent states of a ${rows}-row speculative step`)
    this.snapshots = store
    if (!this.scratch) held.stateBytes += store.bytes
    return store
  }

  /** The snapshot tensors of block `il` (verify steps' graphs), when made. */
  snapshotsOf(il: number) {
    return this.snapshots?.blocks.get(il)
  }

  /** A verify step of `rows` rows from `startPos` succeeded: its rows' snapshots are the states a rollback takes. */
  snapshotsWritten(startPos: number, rows: number): void {
    this.snapshotFrom = startPos
    this.snapshotRows = rows
  }

  private dropSnapshots(): void {
    if (this.snapshots === null) return
    if (!this.scratch) held.stateBytes -= this.snapshots.bytes
    this.snapshots.free()
    this.snapshots = null
    this.snapshotRows = 0
  }

  /** Zeroes the DeltaNet blocks' states (a call from position 0). */
  clearRecurrent(): void {
    if (!this.recurrent || this.freed) return
    const raw = this.weights.ggml.raw
    const { hp } = this.weights.layout
    for (const [il, state] of this.kv) {
      const m = blockMemory(hp, il)
      if (m.kind !== "state") continue
      raw.ggml_backend_tensor_set(state.k, new Uint8Array(4 * m.conv), 0, 4 * m.conv)
      raw.ggml_backend_tensor_set(state.v, new Uint8Array(4 * m.ssm), 0, 4 * m.ssm)
    }
  }

  reset(): void {
    this.filled = 0
    this.swaLow = 0
    this.snapshotRows = 0
    if (!this.freed) for (const b of this.kvBuffers) this.weights.ggml.raw.ggml_backend_buffer_clear(b, 0)
  }

  /**
   * Copies positions [0, length) of `from`'s K and V (same weights) into this cache: rows of one cell each, so the
   * first `length` rows of every block's tensors. Positions from `length` on are forgotten (filled = length).
   */
  copyPrefixFrom(from: NativeSession, length: number): void {
    if (this.freed || from.freed) throw new Error("the session is closed")
    if (from.weights !== this.weights) throw new Error("the sessions are on different weights")
    if (!(Number.isSafeInteger(length) && length >= 0 && length <= from.filled && length <= this.contextLength)) {
      throw new Error(
        `cannot copy ${length} positions (the source holds ${from.filled}, this cache ${this.contextLength})`
      )
    }
    const raw = this.weights.ggml.raw
    const { hp } = this.weights.layout
    // sliding-window blocks: positions [low, length) from the source's ring into this one (cell = position mod size)
    let low = 0
    if (this.swaSize !== null) {
      low = Math.max(from.swaLow, length - this.swaSize, 0)
      const window = hp.swa!.window
      if (length > 0 && Math.max(0, length - window + 1) < low) {
        throw new Error(
          `cannot copy ${length} positions: the source's sliding-window cache holds positions ${from.swaLow}..${
            from.filled - 1
          } only (the window before position ${length} was overwritten)`
        )
      }
    }
    // a recurrent state of a position before the source's last: only a row of its last verify step (its snapshot)
    const snapshotRow =
      this.recurrent && length !== 0 && length !== from.filled ? from.snapshotRowOf(length) : undefined
    if (this.recurrent && length !== 0 && length !== from.filled && snapshotRow === undefined) {
      throw new Error(`cannot copy ${length} of ${from.filled} positions: a DeltaNet state cannot be rewound`)
    }
    const memory = new Map([...from.kv.keys()].map((il) => [il, blockMemory(hp, il)]))
    let widest = 0
    for (const m of memory.values()) if (m.kind === "kv") widest = Math.max(widest, m.kRow, m.vRow)
    const scratch = new Uint8Array(length * 2 * widest)
    for (const [il, src] of from.kv) {
      const dst = this.kv.get(il)!
      const m = memory.get(il)!
      // a DeltaNet block: the whole state (of position `length` = the source's), or zeros for no position; the
      // snapshots' below (after the loop)
      if (m.kind === "state" && snapshotRow !== undefined) continue
      if (m.kind === "state") {
        for (const [part, n] of [
          ["k", m.conv],
          ["v", m.ssm]
        ] as const) {
          const bytes = new Uint8Array(4 * n)
          if (length > 0) raw.ggml_backend_tensor_get(src[part], bytes, 0, bytes.length)
          raw.ggml_backend_tensor_set(dst[part], bytes, 0, bytes.length)
        }
        continue
      }
      if (m.kind !== "kv") continue
      const rowBytes = { k: 2 * m.kRow, v: 2 * m.vRow }
      if (m.window !== undefined) {
        for (const part of ["k", "v"] as const) {
          const row = rowBytes[part]
          // runs of positions contiguous in both rings
          for (let p = low; p < length && row > 0;) {
            const s = p % from.swaSize!
            const d = p % this.swaSize!
            const run = Math.min(length - p, from.swaSize! - s, this.swaSize! - d)
            raw.ggml_backend_tensor_get(src[part], scratch, s * row, run * row)
            raw.ggml_backend_tensor_set(dst[part], scratch, d * row, run * row)
            p += run
          }
        }
        continue
      }
      for (const part of ["k", "v"] as const) {
        const size = length * rowBytes[part]
        if (size === 0) continue
        raw.ggml_backend_tensor_get(src[part], scratch, 0, size)
        raw.ggml_backend_tensor_set(dst[part], scratch, 0, size)
      }
    }
    if (snapshotRow !== undefined) from.snapshots!.restore(this.kv, snapshotRow.row, snapshotRow.rows)
    this.filled = length
    this.swaLow = low
    this.snapshotRows = 0
  }

  /**
   * The snapshot (row of the last verify step, and its rows) that holds the recurrent states of position `length`:
   * undefined unless a call from `length` could start here (`inSnapshots`).
   */
  snapshotRowOf(length: number): { readonly row: number; readonly rows: number } | undefined {
    return this.inSnapshots(length) ? { row: length - this.snapshotFrom - 1, rows: this.snapshotRows } : undefined
  }

  verifySlot(): GraphSlot {
    return (this.verify ??= this.weights.graphs.sessionSlot())
  }
  free(): void {
    if (this.freed) return
    this.freed = true
    const raw = this.weights.ggml.raw
    if (!this.scratch) {
      held.sessions--
      held.stateBytes -= this.stateBytes
      held.cacheBytes -= this.kvBytes
    }
    this.weights.deviceKvBytes -= this.deviceKvBytes
    this.weights.graphs.forgetSession(this.id)
    this.slot.free()
    this.verify?.free()
    this.dropSnapshots()
    for (const b of this.kvBuffers) raw.ggml_backend_buffer_free(b)
    if (this.deviceKvBytes > 0) this.weights.graphs.deviceCachesFreed()
    raw.ggml_free(this.kvCtx)
    if (this.hostKvCtx !== null) raw.ggml_free(this.hostKvCtx)
  }
}

export const inputLength = (input: StageInput) => (input._tag === "Tokens" ? input.tokens.length : input.nTokens)

/**
 * Allocates a session's caches: those of the weights' device (every block of a CPU stage, a GPU stage's blocks on the
 * device) and, for a GPU stage with blocks left in host memory, theirs in a CPU buffer. Null when one could not be
 * allocated (what was allocated is freed). A context holding no tensor gets no buffer.
 */
const allocateCaches = (
  weights: NativeWeights,
  deviceCtx: Ptr,
  hostCtx: Ptr | null
): { readonly buffers: Array<Ptr>; readonly deviceBytes: number } | null => {
  const raw = weights.ggml.raw
  const out: Array<Ptr> = []
  let deviceBytes = 0
  const sides: Array<[Ptr, Ptr]> = [[deviceCtx, raw.ggml_backend_dev_buffer_type(weights.dev)]]
  if (hostCtx !== null) sides.push([hostCtx, raw.ggml_backend_dev_buffer_type(weights.ggml.cpuDevice())])
  for (const [ctx, buft] of sides) {
    if (raw.ggml_get_first_tensor(ctx) === null) continue
    const buf = raw.ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft)
    if (buf === null) {
      for (const b of out) raw.ggml_backend_buffer_free(b)
      return null
    }
    out.push(buf)
    if (ctx === deviceCtx) deviceBytes = raw.ggml_backend_buffer_get_size(buf)
  }
  return { buffers: out, deviceBytes }
}
