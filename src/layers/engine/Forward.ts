/**
 * A native call over one loaded stage: the batch's inputs (positions, KV cells, masks, tokens or hidden rows), the
 * compute on a koffi worker thread, the read-back of hidden rows or logits. Inputs were validated by the caller
 * (StageExecutorLive.ts) before anything here runs.
 */
import koffi from "koffi"
import type { StageInput } from "../../domain/engine.js"
import type { ForwardPhases } from "../../services/StageExecutor.js"
import { type Ptr, TensorLayout } from "../ggml/Bindings.js"
import { attendedCells } from "../../services/KvSize.js"
import { libcFunction } from "./FileMap.js"
import { activationWidth } from "./PerLayerInputs.js"
import { type CachedGraph, type GraphSlot, graphBuilds } from "./GraphCache.js"
import { buildGraph } from "./GraphBuild.js"
import { inputLength, type NativeItem, type NativeOutput, type NativeSession } from "./KvCache.js"
import { attnTempScales } from "./PositionScaling.js"
import { blocksEnded, HCA_RATIO } from "./HParams.js"
import type { Dsv4Inputs, Dsv4Segment } from "./Toolkit.js"
import { hadamardRotation } from "./archs/dsa.js"
import { chooseSmallBatchRows } from "./SmallBatch.js"
import { fewRowRouteAllowed } from "./WeightPlacement.js"
import type { NativeWeights } from "./Weights.js"

const F16_NEG_INF = 0xfc00

/** Floats per row of the stage's hidden input (PerLayerInputs.ts: gemma4's per-layer inputs travel with them). */
const inWidth = (w: NativeWeights) => activationWidth(w.layout.hp, w.layout.spec.layerStart)

/** The address of a typed array's bytes (libc memmove with n = 0 returns its destination), or null. */
const addressOf = (data: Float32Array): bigint | null => {
  const memmove = libcFunction<(a: unknown, b: unknown, n: number) => bigint | number>(
    "uintptr_t memmove(void *dst, void *src, size_t n)"
  )
  return memmove === null ? null : BigInt(memmove(data, data, 0))
}

/**
 * Points a lone call's hidden input tensor at the caller's rows instead of copying them in (CPU; rows 64-byte aligned,
 * as an inbound ring's payload is; off the V8 heap, so they do not move; the weights' `zeroCopy` false, from
 * SWACTOR_ZERO_COPY=0, turns it off). Returns the
 * tensor's own data address, to put back after the computation, or null when the rows were not borrowed. The tensor is
 * a graph output too, so the graph never computes in place over it.
 */
const borrowHidden = (w: NativeWeights, tensor: Ptr, input: StageInput): bigint | null => {
  if (input._tag !== "Hidden" || w.device !== "cpu" || !w.zeroCopy) return null
  // rows that carry per-layer inputs too are read through views, whose data pointers were fixed when the graph was
  // allocated: those are copied in
  // (deepseek4's hc_mult streams too: its blocks read them through a reshape, a view)
  if (inWidth(w) !== w.layout.hp.nEmbd) return null
  const bytes = w.layout.hp.nEmbd * input.nTokens * 4
  if (input.hidden.byteLength !== bytes || bytes < 256) return null
  const at = addressOf(input.hidden)
  if (at === null || at === 0n || at % 64n !== 0n) return null
  const own = BigInt(koffi.decode(tensor, TensorLayout.data, "uintptr_t") as bigint | number)
  koffi.encode(tensor, TensorLayout.data, "uintptr_t", at)
  return own
}

/**
 * The window mask of one sequence's call over its sliding-window ring, F16 [nKv, n]: cell c holds, once the call
 * wrote its rows, the latest position q < used with q = c mod size, if q >= the ring's lowest held position; row p
 * sees it when p - window < q <= p (llama.cpp's is_masked_swa, LLAMA_SWA_TYPE_STANDARD, over the cells' positions).
 */
const ringMask = (it: NativeItem, used: number, nKv: number, window: number): Uint16Array => {
  const size = it.session.swaSize!
  const low = Math.max(it.session.swaLow, used - size)
  const n = inputLength(it.input)
  const mask = new Uint16Array(nKv * n).fill(F16_NEG_INF)
  for (let c = 0; c < nKv; c++) {
    if (c > used - 1) continue
    const q = c + size * Math.floor((used - 1 - c) / size)
    if (q < low) continue
    for (let i = 0; i < n; i++) {
      const p = it.startPos + i
      if (q <= p && p - q < window) mask[i * nKv + c] = 0
    }
  }
  return mask
}

/** One session's positions startPos..startPos+n-1 (validated as for `runBatch`). */
export const forwardOne = async (
  session: NativeSession,
  startPos: number,
  input: StageInput
): Promise<NativeOutput> => {
  const [out] = await runBatch(session.weights, [{ session, startPos, input }])
  return out!
}

/**
 * Runs several sequences of one loaded stage in one graph: all rows through every matrix product together, each
 * sequence's attention over its own KV cache. One output per item (its hidden rows, or the logits of its last
 * position on the last stage). The caller has validated every item as for `forward`, that all sessions are of
 * `weights`, that no session appears twice, and that all inputs are of one kind. A single item runs on its
 * session's own graph slot (its decode graph survives other sessions' calls); several on the stage's batch slot.
 */
export const runBatch = (
  weights: NativeWeights,
  items: ReadonlyArray<NativeItem>,
  phases?: ForwardPhases
): Promise<Array<NativeOutput>> =>
  weights.lock.run(() =>
    items.some((it) => inputLength(it.input) > it.session.maxCallRows)
      ? runInPieces(weights, items)
      : runBatchLocked(weights, items, phases)
  )

/**
 * A batch with an item longer than its capped sliding-window cache takes in one call (KvCache.ts `maxCallRows`):
 * each item alone, in pieces of at most that many rows (llama.cpp splits a batch into ubatches so); the hidden rows
 * of the pieces joined, the logits of the last.
 */
const runInPieces = async (w: NativeWeights, items: ReadonlyArray<NativeItem>): Promise<Array<NativeOutput>> => {
  const outs: Array<NativeOutput> = []
  for (const it of items) {
    const n = inputLength(it.input)
    // pieces of equal size (300 rows, at most 241 a call: 150 + 150, not 241 + 59): ggml's flash attention takes its
    // tiled F32 kernel for 64 query rows or more and its row kernel (queries rounded to F16) below, so a short last
    // piece would drift from llama.cpp, which runs the whole prompt as one ubatch (5.7e-3 against 3e-5 in log-prob)
    const pieces = Math.ceil(n / it.session.maxCallRows)
    const step = Math.ceil(n / pieces)
    const hidden: Array<Float32Array> = []
    let last: NativeOutput | undefined
    for (let at = 0; at < n; at += step) {
      const m = Math.min(step, n - at)
      const input: StageInput =
        it.input._tag === "Tokens"
          ? { _tag: "Tokens", tokens: it.input.tokens.subarray(at, at + m) }
          : {
              _tag: "Hidden",
              hidden: it.input.hidden.subarray(at * inWidth(w), (at + m) * inWidth(w)),
              nTokens: m
            }
      last = (await runBatchLocked(w, [{ session: it.session, startPos: it.startPos + at, input }]))[0]!
      if (last._tag === "Hidden") hidden.push(last.hidden)
    }
    if (last!._tag === "Logits") outs.push(last!)
    else {
      const all = new Float32Array(hidden.reduce((s, h) => s + h.length, 0))
      let o = 0
      for (const h of hidden) all.set(h, (o += h.length) - h.length)
      outs.push({ _tag: "Hidden", hidden: all, nTokens: n })
    }
  }
  return outs
}

/** The slot's graph of `key`: the cached one, else one built and allocated (GraphBuild.ts) and cached. */
const graphOf = async (
  w: NativeWeights,
  slot: GraphSlot,
  key: string,
  items: ReadonlyArray<NativeItem>,
  shapes: ReadonlyArray<{ readonly nKv: number; readonly nKvSwa: number }>,
  kind: StageInput["_tag"]
): Promise<CachedGraph> => {
  if (slot.cached !== null && slot.cached.key === key) return slot.cached
  if (items.length > 1 && w.device === "cpu" && w.smallRowsFor === undefined) {
    const threads = Math.max(...items.map((it) => it.session.threads))
    w.smallRowsFor = await chooseSmallBatchRows(
      w.ggml,
      w.backend,
      w.ggml.raw.ggml_backend_dev_buffer_type(w.dev),
      new Map([...w.tensors].filter(([, p]) => fewRowRouteAllowed(w.homeOf(p)))),
      threads
    )
  }
  slot.drop()
  const c = buildGraph(
    w,
    slot,
    key,
    items,
    shapes.map((s) => s.nKv),
    kind,
    shapes.map((s) => s.nKvSwa)
  )
  graphBuilds.count++
  slot.cached = c
  return c
}

/** One item's rows in a call: n rows, the positions used after it, the KV cells attended (and the ring's, or 0). */
interface CallShape {
  readonly n: number
  readonly used: number
  readonly nKv: number
  readonly nKvSwa: number
}

const shapesOf = (items: ReadonlyArray<NativeItem>): Array<CallShape> =>
  items.map((it) => {
    const n = inputLength(it.input)
    const ring = it.session.swaSize
    const nKvSwa = ring === null ? 0 : attendedCells(ring, it.startPos + n)
    return { n, used: it.startPos + n, nKv: attendedCells(it.session.kvSize, it.startPos + n), nKvSwa }
  })

/** A lone item's own slot (a speculative step's rows their own, to keep its decode graph); a batch of decode rows the decode slot of its key; any other batch the batch slot. */
const slotFor = (
  w: NativeWeights,
  items: ReadonlyArray<NativeItem>,
  shapes: ReadonlyArray<CallShape>,
  key: string
): GraphSlot =>
  items.length === 1
    ? items[0]!.input.verify === true
      ? items[0]!.session.verifySlot()
      : items[0]!.session.slot
    : shapes.every((x) => x.n === 1)
      ? w.graphs.decodeSlot(key)
      : w.graphs.batchSlot()

/** Inputs by row: positions (and what derives from them: temperature scales, the DSA rotation), KV cells, row indices. */
const setRowPositions = (
  w: NativeWeights,
  c: CachedGraph,
  items: ReadonlyArray<NativeItem>,
  shapes: ReadonlyArray<CallShape>,
  nTotal: number
) => {
  const raw = w.ggml.raw
  const hp = w.layout.hp
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
  raw.ggml_backend_tensor_set(c.inputs.pos, posArr, 0, nTotal * 4)
  const attnScale = c.inputs.attnScale
  if (attnScale !== undefined && attnScale !== null) {
    raw.ggml_backend_tensor_set(attnScale, attnTempScales(hp.attnTemp!, posArr), 0, nTotal * 4)
  }
  const hadamard = c.inputs.hadamard
  if (hadamard !== undefined && hadamard !== null) {
    const rotation = hadamardRotation(hp.dsa?.headSize ?? hp.dsv4!.indexer.headSize)
    raw.ggml_backend_tensor_set(hadamard, rotation, 0, rotation.byteLength)
  }
  raw.ggml_backend_tensor_set(c.kvIdx, idxArr, 0, nTotal * 8)
  if (c.swaKvIdx !== null) {
    // ring cells of the sliding-window blocks: position mod the ring's size
    const ringIdx = new BigInt64Array(nTotal)
    let r = 0
    for (const it of items) {
      const size = it.session.swaSize!
      for (let i = 0; i < inputLength(it.input); i++, r++) ringIdx[r] = BigInt((it.startPos + i) % size)
    }
    raw.ggml_backend_tensor_set(c.swaKvIdx, ringIdx, 0, nTotal * 8)
  }
  if (c.rowIdx !== null) {
    const rows = new BigInt64Array(nTotal)
    for (let i = 0; i < nTotal; i++) rows[i] = BigInt(i)
    raw.ggml_backend_tensor_set(c.rowIdx, rows, 0, nTotal * 8)
  }
}

/** Inputs by sequence: its causal mask (and its window mask), then the rows whose outputs are kept. */
const setSequenceMasks = (
  w: NativeWeights,
  c: CachedGraph,
  items: ReadonlyArray<NativeItem>,
  shapes: ReadonlyArray<CallShape>
) => {
  const raw = w.ggml.raw
  const { outIds, segments } = c.inputs
  for (let s = 0; s < items.length; s++) {
    const { n, nKv } = shapes[s]!
    const startPos = items[s]!.startPos
    const maskArr = new Uint16Array(nKv * n)
    for (let i = 0; i < n; i++) {
      const p = startPos + i
      if (p + 1 < nKv) maskArr.subarray(i * nKv, (i + 1) * nKv).fill(F16_NEG_INF, p + 1)
    }
    raw.ggml_backend_tensor_set(segments[s]!.mask, maskArr, 0, maskArr.byteLength)
    const swaMask = segments[s]!.swaMask
    if (swaMask !== null) {
      raw.ggml_backend_tensor_set(
        swaMask,
        ringMask(items[s]!, shapes[s]!.used, shapes[s]!.nKvSwa, w.layout.hp.swa!.window),
        0,
        2 * n * shapes[s]!.nKvSwa
      )
    }
  }
  if (outIds !== null) {
    const kept: Array<number> = []
    segments.forEach((seg, s) => {
      const from = items[s]!.input.verify === true ? seg.offset : seg.offset + seg.n - 1
      for (let r = from; r < seg.offset + seg.n; r++) kept.push(r)
    })
    const ids = Int32Array.from(kept)
    raw.ggml_backend_tensor_set(outIds, ids, 0, ids.byteLength)
  }
}

/**
 * deepseek4's compressor inputs (Toolkit.Dsv4Inputs), cells being positions (its window's cache is uncapped): each
 * block b of 4 positions a sequence's call completes reads the cells of blocks b - 1 and b (block -1: cell 0 under a
 * -inf score) and goes to compressed row b, rotated at its first position; row b is seen from position 4b + 3.
 */
const setDsv4Inputs = (w: NativeWeights, c: CachedGraph, items: ReadonlyArray<NativeItem>) => {
  const d = c.inputs.dsv4
  if (d === undefined) return
  const raw = w.ggml.raw
  const segments = c.inputs.segments
  const all = new Int32Array(segments.reduce((s, seg) => s + seg.n, 0))
  items.forEach((it, s) => {
    const n = segments[s]!.n
    const ds = d.segments[s]!
    for (let i = 0; i < n; i++) all[segments[s]!.offset + i] = (it.startPos + i) % 4
    if (ds.m > 0) setCompressedBlocks(w, ds, Math.floor(it.startPos / 4))
    if (ds.mask !== null) {
      const mask = new Uint16Array(ds.nComp * n).fill(F16_NEG_INF)
      for (let i = 0; i < n; i++) {
        mask.fill(0, i * ds.nComp, i * ds.nComp + Math.min(ds.nComp, Math.floor((it.startPos + i + 1) / 4)))
      }
      raw.ggml_backend_tensor_set(ds.mask, mask, 0, mask.byteLength)
    }
  })
  raw.ggml_backend_tensor_set(d.statePos, all, 0, all.byteLength)
  if (d.hca !== undefined) setHcaInputs(w, c, d.hca, items)
}

/** The cells, rows and positions of the `ds.m` blocks of 4 a call completes, the first of them block `first`. */
const setCompressedBlocks = (w: NativeWeights, ds: Dsv4Segment, first: number) => {
  const raw = w.ggml.raw
  const m = ds.m
  const read = new Int32Array(8 * m)
  const prevBias = new Float32Array(4 * m)
  for (let k = 0; k < m; k++) {
    const b = first + k
    for (let j = 0; j < 4; j++) {
      read[4 * k + j] = b === 0 ? 0 : 4 * (b - 1) + j
      read[4 * m + 4 * k + j] = 4 * b + j
      prevBias[4 * k + j] = b === 0 ? -Infinity : 0
    }
  }
  const write = BigInt64Array.from({ length: m }, (_, k) => BigInt(first + k))
  const compPos = Int32Array.from({ length: m }, (_, k) => 4 * (first + k))
  raw.ggml_backend_tensor_set(ds.read!, read, 0, read.byteLength)
  raw.ggml_backend_tensor_set(ds.prevBias!, prevBias, 0, prevBias.byteLength)
  raw.ggml_backend_tensor_set(ds.write!, write, 0, write.byteLength)
  raw.ggml_backend_tensor_set(ds.compPos!, compPos, 0, compPos.byteLength)
}

/**
 * deepseek4's graph changes with whether a sequence sees compressed rows yet (4 positions; 128 for the heavily compressed
 * blocks) and with how many blocks of 128 its call completes.
 */
const dsv4Key = (w: NativeWeights, start: number, used: number): string => {
  const d = w.layout.hp.dsv4
  if (d === undefined) return ""
  const heavy = d.ratios.includes(HCA_RATIO)
    ? `:h${blocksEnded(start, used, HCA_RATIO)}${used >= HCA_RATIO ? "v" : ""}`
    : ""
  return `${used >= 4 ? ":c" : ""}${blocksEnded(start, used, 4)}${heavy}`
}

/**
 * The heavily compressed blocks' inputs: each block of 128 a sequence's call completes reads the cells of its positions
 * and goes to compressed row b, rotated at its first position; row b is seen from position 128b + 127.
 */
const setHcaInputs = (
  w: NativeWeights,
  c: CachedGraph,
  h: NonNullable<Dsv4Inputs["hca"]>,
  items: ReadonlyArray<NativeItem>
) => {
  const raw = w.ggml.raw
  const segments = c.inputs.segments
  const all = new Int32Array(segments.reduce((s, seg) => s + seg.n, 0))
  items.forEach((it, s) => {
    const seg = segments[s]!
    const hs = h.segments[s]!
    for (let i = 0; i < seg.n; i++) all[seg.offset + i] = (it.startPos + i) % HCA_RATIO
    if (hs.m > 0) {
      const first = Math.floor(it.startPos / HCA_RATIO)
      const read = Int32Array.from({ length: HCA_RATIO * hs.m }, (_, j) => HCA_RATIO * first + j)
      const write = BigInt64Array.from({ length: hs.m }, (_, j) => BigInt(first + j))
      const pos = Int32Array.from({ length: hs.m }, (_, j) => HCA_RATIO * (first + j))
      raw.ggml_backend_tensor_set(hs.read!, read, 0, read.byteLength)
      raw.ggml_backend_tensor_set(hs.write!, write, 0, write.byteLength)
      raw.ggml_backend_tensor_set(hs.pos!, pos, 0, pos.byteLength)
    }
    if (hs.mask !== null) {
      const mask = new Uint16Array(hs.nComp * seg.n).fill(F16_NEG_INF)
      for (let i = 0; i < seg.n; i++) {
        const seen = Math.min(hs.nComp, Math.floor((it.startPos + i + 1) / HCA_RATIO))
        mask.fill(0, i * hs.nComp, i * hs.nComp + seen)
      }
      raw.ggml_backend_tensor_set(hs.mask, mask, 0, mask.byteLength)
    }
  })
  raw.ggml_backend_tensor_set(h.statePos, all, 0, all.byteLength)
}

/**
 * The call's tokens or hidden rows. A lone call's hidden rows are read where they are (a view of the inbound ring): no
 * copy into the graph. Returns the hidden tensor's own data address to put back, or null when nothing was borrowed.
 */
const setInputRows = (w: NativeWeights, c: CachedGraph, items: ReadonlyArray<NativeItem>): bigint | null => {
  const raw = w.ggml.raw
  const segments = c.inputs.segments
  const borrowed = c.hidden !== null && items.length === 1 ? borrowHidden(w, c.hidden, items[0]!.input) : null
  for (let s = 0; s < items.length; s++) {
    const input = items[s]!.input
    const offset = segments[s]!.offset
    if (c.tokens !== null && input._tag === "Tokens") {
      raw.ggml_backend_tensor_set(c.tokens, input.tokens, offset * 4, input.tokens.length * 4)
    }
    if (c.hidden !== null && input._tag === "Hidden" && borrowed === null) {
      raw.ggml_backend_tensor_set(c.hidden, input.hidden, offset * inWidth(w) * 4, inWidth(w) * input.nTokens * 4)
      w.copiedInputBytes += inWidth(w) * input.nTokens * 4
    }
  }
  return borrowed
}

/**
 * Cells from startPos on are being rewritten: until this call succeeds only those before it are valid (rings: the
 * positions whose cells this call takes are gone whatever happens).
 */
const markRewriting = (items: ReadonlyArray<NativeItem>, shapes: ReadonlyArray<CallShape>) =>
  items.forEach((it, s) => {
    // DeltaNet states (KvCache.ts `recurrent`): cleared for a call from 0, a verify step's row's for a call inside its
    // rows (a rollback); invalid until this call succeeds
    it.session.prepareStates(it.startPos)
    it.session.filled = Math.min(it.session.filled, it.startPos)
    if (it.session.recurrent) it.session.filled = 0
    if (it.session.swaSize !== null)
      it.session.swaLow = Math.max(it.session.swaLow, shapes[s]!.used - it.session.swaSize)
  })

/** Sets the threads, computes the graph on a worker thread, and puts the borrowed hidden tensor's memory back. */
const computeGraph = async (
  w: NativeWeights,
  slot: GraphSlot,
  c: CachedGraph,
  items: ReadonlyArray<NativeItem>,
  nTotal: number,
  borrowed: bigint | null
) => {
  const g = w.ggml
  if (w.device === "cpu" || w.split !== null) {
    // a lone call of several rows (a prompt) may take the session's prefill threads (SessionOptions.prefillThreads)
    const lonePrompt = items.length === 1 && nTotal > 1
    w.lastThreads = lonePrompt ? items[0]!.session.prefillThreads : Math.max(...items.map((it) => it.session.threads))
    g.setThreads(w.threadsBackend, w.lastThreads)
  }
  let status: number
  try {
    // a GPU stage's graph runs through its slot's scheduler (device, and the CPU for what stays in host memory)
    status =
      slot.sched !== null ? await g.schedComputeAsync(slot.sched, c.graph) : await g.computeAsync(w.backend, c.graph)
  } finally {
    // the graph's own memory again, whatever happened
    if (borrowed !== null) koffi.encode(c.hidden!, TensorLayout.data, "uintptr_t", borrowed)
  }
  if (status !== 0) throw new Error(`ggml_backend_graph_compute failed with status ${status}`)
}

/** The last stage's logits of each item's last row, or the rows of the residual stream (and per-layer inputs). */
const readOutputs = (
  w: NativeWeights,
  c: CachedGraph,
  items: ReadonlyArray<NativeItem>,
  nTotal: number
): Array<NativeOutput> => {
  const raw = w.ggml.raw
  const { hp, spec } = w.layout
  if (spec.isLast) {
    const counts = items.map((it) => (it.input.verify === true ? inputLength(it.input) : 1))
    const all = new Float32Array(hp.nVocab * counts.reduce((a, b) => a + b, 0))
    raw.ggml_backend_tensor_get(c.out, all, 0, all.byteLength)
    // Views of the one read-back (fresh per call): no second copy per sequence.
    let row = 0
    return items.map((it, s) => {
      const logits = all.subarray(row * hp.nVocab, (row + counts[s]!) * hp.nVocab)
      row += counts[s]!
      return it.input.verify === true ? { _tag: "Logits", logits, rows: counts[s]! } : { _tag: "Logits", logits }
    })
  }
  // rows of the residual stream and the per-layer inputs later stages read (PerLayerInputs.ts)
  const width = activationWidth(hp, spec.layerEndExclusive)
  const all = new Float32Array(width * nTotal)
  raw.ggml_backend_tensor_get(c.out, all, 0, all.byteLength)
  if (items.length === 1) return [{ _tag: "Hidden", hidden: all, nTokens: nTotal }]
  const segments = c.inputs.segments
  return items.map((_, s) => {
    const seg = segments[s]!
    return {
      _tag: "Hidden",
      hidden: all.subarray(seg.offset * width, (seg.offset + seg.n) * width),
      nTokens: seg.n
    }
  })
}

/**
 * One graph of `items` (the lock held). `phases`: the ms spent setting its inputs (positions, masks, rows) and reading
 * its outputs back are added to its copyMillis.
 */
const runBatchLocked = async (
  w: NativeWeights,
  items: ReadonlyArray<NativeItem>,
  phases?: ForwardPhases
): Promise<Array<NativeOutput>> => {
  if (w.freed) throw new Error("the stage's weights were freed before this session")
  if (items.length === 0) return []
  for (const it of items) {
    if (it.session.freed) throw new Error(`session ${it.session.id} already freed`)
  }
  const kind = items[0]!.input._tag
  const shapes = shapesOf(items)
  const nTotal = shapes.reduce((s, x) => s + x.n, 0)
  // deepseek4: whether a sequence sees compressed rows yet (4 positions) changes its graph
  const seen = (i: number) => dsv4Key(w, items[i]!.startPos, shapes[i]!.used)
  const key =
    kind +
    items
      .map((it, i) => {
        const all = it.input.verify === true ? ":all" : ""
        return `|${it.session.id}:${shapes[i]!.n}:${shapes[i]!.nKv}:${shapes[i]!.nKvSwa}${seen(i)}${all}`
      })
      .join("")
  // a verify step on recurrent blocks writes each row's states (RecurrentSnapshots.ts): room for them before its graph
  items.forEach((it, s) => (it.input.verify === true ? it.session.snapshotsFor(shapes[s]!.n) : null))
  const slot = slotFor(w, items, shapes, key)

  // lavapipe: a backend that may have bound a buffer since destroyed is replaced first (NativeWeights.renewStaleBackend)
  w.renewStaleBackend()
  let c = await graphOf(w, slot, key, items, shapes, kind)
  // allocating it may have replaced a compute buffer that had to grow: then again over a new backend
  if (w.renewStaleBackend()) c = await graphOf(w, slot, key, items, shapes, kind)

  // inputs: positions, KV cells, row indices, one causal mask per sequence, the rows
  const copyIn = performance.now()
  setRowPositions(w, c, items, shapes, nTotal)
  setSequenceMasks(w, c, items, shapes)
  setDsv4Inputs(w, c, items)
  const borrowed = setInputRows(w, c, items)
  const copiedIn = performance.now() - copyIn

  markRewriting(items, shapes)
  await computeGraph(w, slot, c, items, nTotal, borrowed)
  items.forEach((it, s) => {
    it.session.filled = shapes[s]!.used
    if (it.input.verify === true) it.session.snapshotsWritten(it.startPos, shapes[s]!.n)
  })
  const copyOut = performance.now()
  const outputs = readOutputs(w, c, items, nTotal)
  if (phases !== undefined) phases.copyMillis += copiedIn + performance.now() - copyOut
  return outputs
}
