/**
 * The per-row recurrent states a session's verify steps write (RecurrentSnapshots.ts): their tensors, allocated beside
 * the session's caches, and the copy back into the live states that a rollback makes.
 */
import { GgmlType, type Ptr } from "../ggml/Bindings.js"
import { blockMemory } from "./BlockMemory.js"
import type { StateSnapshots } from "./Toolkit.js"
import type { NativeWeights } from "./Weights.js"

/** Rows a session's snapshots are first made for (a step of the default 6 drafts has 7). */
const MIN_ROWS = 8

/** One session's snapshot tensors over the recurrent blocks of its stage. */
export class SnapshotStore {
  readonly blocks = new Map<number, StateSnapshots>()
  private readonly buffers: ReadonlyArray<Ptr>
  private readonly ctxs: ReadonlyArray<Ptr>
  /** Bytes of its buffers. */
  readonly bytes: number

  private constructor(
    private readonly weights: NativeWeights,
    readonly rows: number,
    parts: { buffers: Array<Ptr>; ctxs: Array<Ptr>; blocks: Map<number, StateSnapshots> }
  ) {
    this.buffers = parts.buffers
    this.ctxs = parts.ctxs
    this.blocks = parts.blocks
    let bytes = 0
    for (const b of this.buffers) bytes += weights.ggml.raw.ggml_backend_buffer_get_size(b)
    this.bytes = bytes
  }

  /** Snapshots for `rows` rows of every recurrent block in `layers` (null: they could not be allocated). */
  static allocate(weights: NativeWeights, layers: Iterable<number>, rows: number): SnapshotStore | null {
    const raw = weights.ggml.raw
    const { hp } = weights.layout
    const capacity = Math.max(rows, MIN_ROWS)
    const list = [...layers].filter((il) => hp.recurrent?.layers[il] === true)
    const sides = new Map<boolean, Ptr>()
    const blocks = new Map<number, StateSnapshots>()
    for (const il of list) {
      const m = blockMemory(hp, il)
      if (m.kind !== "state") continue
      // a GPU stage keeps a block's snapshots where it keeps the block's state (NativeWeights.onDevice)
      const device = weights.split === null || weights.onDevice(il)
      let ctx = sides.get(device)
      if (ctx === undefined) {
        ctx = raw.ggml_init({
          mem_size: raw.ggml_tensor_overhead() * (2 * list.length + 1),
          mem_buffer: null,
          no_alloc: true
        })
        sides.set(device, ctx)
      }
      const conv = raw.ggml_new_tensor_1d(ctx, GgmlType.F32, m.conv * capacity)
      raw.ggml_set_name(conv, `snap_r_l${il}`)
      const ssm = raw.ggml_new_tensor_1d(ctx, GgmlType.F32, m.ssm * capacity)
      raw.ggml_set_name(ssm, `snap_s_l${il}`)
      blocks.set(il, { conv, ssm, convElems: m.conv, ssmElems: m.ssm })
    }
    const buffers: Array<Ptr> = []
    for (const [device, ctx] of sides) {
      const dev = device ? weights.dev : weights.ggml.cpuDevice()
      const buf = raw.ggml_backend_alloc_ctx_tensors_from_buft(ctx, raw.ggml_backend_dev_buffer_type(dev))
      if (buf === null) {
        for (const b of buffers) raw.ggml_backend_buffer_free(b)
        for (const c of sides.values()) raw.ggml_free(c)
        return null
      }
      buffers.push(buf)
    }
    return new SnapshotStore(weights, capacity, { buffers, ctxs: [...sides.values()], blocks })
  }

  /**
   * The live states take row `row`'s snapshots of a verify step of `rows` rows: the conv state of slot `row`, the SSM
   * state of slot rows - 1 - row (the op's slots count back from the last row).
   */
  restore(live: ReadonlyMap<number, { readonly k: Ptr; readonly v: Ptr }>, row: number, rows: number): void {
    const raw = this.weights.ggml.raw
    for (const [il, s] of this.blocks) {
      const state = live.get(il)
      if (state === undefined) continue
      const conv = new Uint8Array(4 * s.convElems)
      raw.ggml_backend_tensor_get(s.conv, conv, row * conv.length, conv.length)
      raw.ggml_backend_tensor_set(state.k, conv, 0, conv.length)
      const ssm = new Uint8Array(4 * s.ssmElems)
      raw.ggml_backend_tensor_get(s.ssm, ssm, (rows - 1 - row) * ssm.length, ssm.length)
      raw.ggml_backend_tensor_set(state.v, ssm, 0, ssm.length)
    }
  }

  free(): void {
    const raw = this.weights.ggml.raw
    for (const b of this.buffers) raw.ggml_backend_buffer_free(b)
    for (const c of this.ctxs) raw.ggml_free(c)
  }
}
