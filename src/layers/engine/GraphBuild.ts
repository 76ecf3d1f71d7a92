/**
 * Builds the ggml graph of one call shape over a loaded stage: the inputs, the architecture's blocks
 * (archs/*.ts over Toolkit.ts), the architecture's output head on the last stage; then checks every node against the
 * device (WeightPlacement.ts, rule 3) and allocates it in its slot.
 */
import type { StageInput } from "../../domain/engine.js"
import { type GgmlRaw, GgmlType, type Ptr } from "../ggml/Bindings.js"
import type { HParams } from "./HParams.js"
import type { CachedGraph, GraphSlot } from "./GraphCache.js"
import { blocksEnded, HCA_RATIO } from "./HParams.js"
import { inputLength, type NativeItem } from "./KvCache.js"
import { exactRowsDefault } from "./SmallBatch.js"
import {
  type AttentionSegment,
  type BlockWeights,
  type Dsv4Inputs,
  type Dsv4Segment,
  type GraphInputs,
  type HcaSegment,
  Toolkit
} from "./Toolkit.js"
import { checkedOps } from "./OpChecks.js"
import { activationWidth, joinStageOutput, splitStageInput } from "./PerLayerInputs.js"
import { checkGraph, checkScheduledGraph, fewRowRouteAllowed } from "./WeightPlacement.js"
import type { NativeWeights } from "./Weights.js"

/**
 * Inputs some architectures add, set with the others (Forward.ts): the attention temperature of each token
 * (HParams.attnTemp, [1, 1, n] to broadcast over q's heads) and DSA's indexer rotation (HParams.dsa, a constant).
 */
const constantShapedInputs = (raw: GgmlRaw, ctx: Ptr, graph: Ptr, hp: HParams, n: number) => {
  const input = (t: Ptr, name: string) => {
    raw.ggml_set_name(t, name)
    raw.ggml_set_input(t)
    raw.ggml_build_forward_expand(graph, t)
    return t
  }
  return {
    attnScale:
      hp.attnTemp === undefined ? null : input(raw.ggml_new_tensor_3d(ctx, GgmlType.F32, 1, 1, n), "attn_scale"),
    hadamard: ((size: number | undefined) =>
      size === undefined ? null : input(raw.ggml_new_tensor_2d(ctx, GgmlType.F32, size, size), "attn_inp_k_rot"))(
      hp.dsa?.headSize ?? hp.dsv4?.indexer.headSize
    )
  }
}

/** A 1-d input tensor of the graph, named. */
const input1d = (raw: GgmlRaw, ctx: Ptr, type: number, len: number, name: string) => {
  const t = raw.ggml_new_tensor_1d(ctx, type, len)
  raw.ggml_set_name(t, name)
  raw.ggml_set_input(t)
  return t
}

/** The rows a last stage's call keeps: each item's last, or all of an item's rows that asks for every logit. */
export const outputRowCount = (items: ReadonlyArray<NativeItem>) =>
  items.reduce((s, it) => s + (it.input.verify === true ? inputLength(it.input) : 1), 0)

/** The graph's context, sized for the nodes of the stage's blocks over `nSeq` sequences. */
const graphContext = (raw: GgmlRaw, w: NativeWeights, nSeq: number): { ctx: Ptr; maxNodes: number } => {
  const { hp, spec } = w.layout
  const nLayers = spec.layerEndExclusive - spec.layerStart
  // a routed block (Moe.ts) adds ~30 tensors, a view and an add per expert used, and ~12 for group-limited routing
  const moe = hp.moe
  const moeNodes = moe === undefined ? 0 : 40 + 3 * moe.nExpertUsed + (moe.nExpertGroups > 1 ? 16 : 0)
  // kimi-k3: the attention residuals' mixes (~40) and a KDA block's three convolutions and gate per sequence (~70)
  const kimi = hp.kimi === undefined ? 0 : 96
  const perSeq = hp.kimi === undefined ? 24 : 96
  const maxNodes = Math.max(2048, (96 + moeNodes + kimi + perSeq * (nSeq - 1)) * nLayers + 256 + 8 * nSeq)
  const ctx = raw.ggml_init({
    mem_size: raw.ggml_tensor_overhead() * maxNodes + raw.ggml_graph_overhead_custom(maxNodes, false),
    mem_buffer: null,
    no_alloc: true
  })
  if (ctx === null) throw new Error("ggml_init failed for the compute graph")
  return { ctx, maxNodes }
}

/** The inputs by row: positions, KV cells (and the rings' cells), row indices of a batch. */
interface RowInputs {
  readonly pos: Ptr
  readonly kvIdx: Ptr
  readonly rowIdx: Ptr | null
  readonly swaKvIdx: Ptr | null
}

const rowInputs = (raw: GgmlRaw, ctx: Ptr, graph: Ptr, w: NativeWeights, nSeq: number, n: number): RowInputs => {
  const { hp, spec } = w.layout
  const pos = input1d(raw, ctx, GgmlType.I32, n, "inp_pos")
  const kvIdx = input1d(raw, ctx, GgmlType.I64, n, "inp_kv_idx")
  const rowIdx = nSeq > 1 ? input1d(raw, ctx, GgmlType.I64, n, "inp_rows") : null
  // a second mask and cell index per sequence when the stage holds sliding-window blocks (HParams.swa): their
  // caches are rings capped near the window (KvCache.ts)
  let stageHasSwa = false
  for (let il = spec.layerStart; il < spec.layerEndExclusive; il++) stageHasSwa ||= hp.swa?.layers[il] === true
  const swaKvIdx = stageHasSwa ? input1d(raw, ctx, GgmlType.I64, n, "inp_kv_idx_swa") : null
  // both cell indices are leaves, so both get memory even when the stage's blocks use only one (Forward.ts sets both)
  if (swaKvIdx !== null) {
    raw.ggml_build_forward_expand(graph, kvIdx)
    raw.ggml_build_forward_expand(graph, swaKvIdx)
  }
  return { pos, kvIdx, rowIdx, swaKvIdx }
}

/** Each sequence's attention segment: its rows, its masks, views of the cell and row indices over its rows. */
const attentionSegments = (
  raw: GgmlRaw,
  ctx: Ptr,
  graph: Ptr,
  rows: RowInputs,
  items: ReadonlyArray<NativeItem>,
  nKvs: ReadonlyArray<number>,
  swaNKvs: ReadonlyArray<number>
): Array<AttentionSegment> => {
  const { kvIdx, swaKvIdx, rowIdx } = rows
  const stageHasSwa = swaKvIdx !== null
  const nSeq = items.length
  const segments: Array<AttentionSegment> = []
  let offset = 0
  items.forEach((it, s) => {
    const len = inputLength(it.input)
    const nKv = nKvs[s]!
    const mask = raw.ggml_new_tensor_2d(ctx, GgmlType.F16, nKv, len)
    raw.ggml_set_name(mask, nSeq > 1 ? `inp_kq_mask_${s}` : "inp_kq_mask")
    raw.ggml_set_input(mask)
    let swaMask: Ptr | null = null
    if (stageHasSwa) {
      swaMask = raw.ggml_new_tensor_2d(ctx, GgmlType.F16, swaNKvs[s]!, len)
      raw.ggml_set_name(swaMask, nSeq > 1 ? `inp_kq_mask_swa_${s}` : "inp_kq_mask_swa")
      raw.ggml_set_input(swaMask)
      // both masks are graph leaves, so both get memory even when the stage's blocks use only one (Forward.ts sets both)
      raw.ggml_build_forward_expand(graph, mask)
      raw.ggml_build_forward_expand(graph, swaMask)
    }
    const session = it.session
    segments.push({
      offset,
      n: len,
      nKv,
      kv: (il) => session.kv.get(il)!,
      ...(it.input.verify === true && session.recurrent ? { snapshots: (il: number) => session.snapshotsOf(il) } : {}),
      kvIdx: nSeq > 1 ? raw.ggml_view_1d(ctx, kvIdx, len, offset * 8) : kvIdx,
      mask,
      swaMask,
      swaNKv: stageHasSwa ? swaNKvs[s]! : 0,
      swaKvIdx: swaKvIdx === null ? null : nSeq > 1 ? raw.ggml_view_1d(ctx, swaKvIdx, len, offset * 8) : swaKvIdx,
      rows: rowIdx === null ? null : raw.ggml_view_1d(ctx, rowIdx, len, offset * 8)
    })
    offset += len
  })
  return segments
}

type MutableInputs = { -readonly [K in keyof GraphInputs]: GraphInputs[K] }

/**
 * deepseek4's compressor inputs (Toolkit.Dsv4Inputs), when the stage holds a compressed block: each sequence sees
 * compressed rows once it has 4 positions (`nComp`: a quarter of its attended cells, rounded up).
 */
const dsv4Inputs = (
  raw: GgmlRaw,
  ctx: Ptr,
  graph: Ptr,
  w: NativeWeights,
  items: ReadonlyArray<NativeItem>,
  nKvs: ReadonlyArray<number>,
  n: number
): Dsv4Inputs | undefined => {
  const { hp, spec } = w.layout
  const d = hp.dsv4
  if (d === undefined) return undefined
  let compressed = false
  let heavy = false
  for (let il = spec.layerStart; il < spec.layerEndExclusive; il++) {
    compressed ||= d.ratios[il] !== 0
    heavy ||= d.ratios[il] === 128
  }
  if (!compressed) return undefined
  const leaf = (t: Ptr, name: string) => {
    raw.ggml_set_name(t, name)
    raw.ggml_set_input(t)
    raw.ggml_build_forward_expand(graph, t)
    return t
  }
  const statePos = leaf(raw.ggml_new_tensor_1d(ctx, GgmlType.I32, n), "dsv4_state_pos")
  const segments: Array<Dsv4Segment> = items.map((it, s) => {
    const len = inputLength(it.input)
    const nComp = it.startPos + len >= 4 ? Math.ceil(nKvs[s]! / 4) : 0
    const m = blocksEnded(it.startPos, it.startPos + len, 4)
    const one = (t: () => Ptr, name: string) => (m === 0 ? null : leaf(t(), `${name}_${s}`))
    return {
      nComp,
      m,
      read: one(() => raw.ggml_new_tensor_1d(ctx, GgmlType.I32, 8 * m), "dsv4_read"),
      prevBias: one(() => raw.ggml_new_tensor_3d(ctx, GgmlType.F32, 1, 4, m), "dsv4_prev_bias"),
      write: one(() => raw.ggml_new_tensor_1d(ctx, GgmlType.I64, m), "dsv4_write"),
      compPos: one(() => raw.ggml_new_tensor_1d(ctx, GgmlType.I32, m), "dsv4_comp_pos"),
      mask: nComp === 0 ? null : leaf(raw.ggml_new_tensor_2d(ctx, GgmlType.F16, nComp, len), `dsv4_kq_mask_${s}`)
    }
  })
  return { statePos, segments, ...(heavy ? { hca: hcaInputs(items, nKvs, n, leaf, raw, ctx) } : {}) }
}

/** The heavily compressed blocks' inputs (Toolkit.HcaSegment): each sequence's completed blocks of 128 in this call. */
const hcaInputs = (
  items: ReadonlyArray<NativeItem>,
  nKvs: ReadonlyArray<number>,
  n: number,
  leaf: (t: Ptr, name: string) => Ptr,
  raw: GgmlRaw,
  ctx: Ptr
) => {
  const statePos = leaf(raw.ggml_new_tensor_1d(ctx, GgmlType.I32, n), "dsv4_hca_state_pos")
  const segments: Array<HcaSegment> = items.map((it, s) => {
    const used = it.startPos + inputLength(it.input)
    const m = blocksEnded(it.startPos, used, HCA_RATIO)
    const nComp = used >= HCA_RATIO ? Math.ceil(nKvs[s]! / HCA_RATIO) : 0
    const one = (type: number, len: number, name: string) =>
      m === 0 ? null : leaf(raw.ggml_new_tensor_1d(ctx, type, len), `${name}_${s}`)
    return {
      m,
      read: one(GgmlType.I32, HCA_RATIO * m, "dsv4_hca_read"),
      write: one(GgmlType.I64, m, "dsv4_hca_write"),
      pos: one(GgmlType.I32, m, "dsv4_hca_pos"),
      nComp,
      mask:
        nComp === 0
          ? null
          : leaf(raw.ggml_new_tensor_2d(ctx, GgmlType.F16, nComp, inputLength(it.input)), `dsv4_hca_kq_mask_${s}`)
    }
  })
  return { statePos, segments }
}

/**
 * The stage's first rows: the token embeddings (and, on gemma4, the per-layer inputs derived from the tokens), or the
 * hidden input tensor, split into the residual stream and the per-layer inputs it carries.
 */
const stageInput = (
  raw: GgmlRaw,
  ctx: Ptr,
  w: NativeWeights,
  t: Toolkit,
  inputs: MutableInputs,
  kind: StageInput["_tag"],
  n: number
): { x: Ptr; tokens: Ptr | null; hidden: Ptr | null } => {
  const { arch, hp, spec } = w.layout
  if (kind === "Tokens") {
    const tokens = input1d(raw, ctx, GgmlType.I32, n, "inp_tokens")
    inputs.tokens = tokens
    let x = raw.ggml_get_rows(ctx, w.get("token_embd.weight"), tokens)
    if (arch.embedScale !== undefined) x = raw.ggml_scale(ctx, x, arch.embedScale(hp))
    if (hp.perLayer !== undefined && arch.perLayerInputs !== undefined) {
      const rows = arch.perLayerInputs(t, modelWideWeights(w), tokens, x)
      inputs.perLayer = { rows, stride: hp.perLayer.width * hp.nLayer, offset: 0, first: 0 }
    }
    return { x, tokens, hidden: null }
  }
  // the stage's input rows: the residual stream, then the per-layer inputs of its blocks and later ones
  const hidden = raw.ggml_new_tensor_2d(ctx, GgmlType.F32, activationWidth(hp, spec.layerStart), n)
  raw.ggml_set_name(hidden, "inp_hidden")
  raw.ggml_set_input(hidden)
  // never reused in place by the graph: a lone call may point it at the caller's memory (zeroCopyHidden)
  raw.ggml_set_output(hidden)
  const split = splitStageInput(raw, ctx, hp, hidden, spec.layerStart, n)
  if (split.perLayer !== undefined) inputs.perLayer = split.perLayer
  return { x: split.x, tokens: null, hidden }
}

/** The model-wide weights (embeddings, output head), by their full names. */
const modelWideWeights = (w: NativeWeights) => ({
  get: (name: string) => w.get(name),
  opt: (name: string) => w.tensors.get(name) ?? null
})

/** The stage's blocks over `x`, then the output head on the last stage or the rows later stages read. */
const stageBlocks = (raw: GgmlRaw, ctx: Ptr, w: NativeWeights, t: Toolkit, inputs: GraphInputs, x: Ptr, n: number) => {
  const { arch, hp, spec } = w.layout
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
  if (spec.isLast) return arch.buildOutput(t, modelWideWeights(w), x)
  return joinStageOutput(raw, ctx, hp, x, inputs.perLayer, spec.layerEndExclusive, n)
}

/**
 * Several sequences, or rows whose every logit is read (a speculative step's verification: each row must have its lone
 * bits); a lone call otherwise keeps exactly the products, and bits, it always had: the few-row route.
 */
const smallBatchRoute = (w: NativeWeights, nSeq: number, verify: boolean) =>
  w.device === "cpu" && (nSeq > 1 || verify)
    ? {
        maxRowsFor: w.smallRowsFor ?? (() => exactRowsDefault),
        allowed: (p: Ptr) => fewRowRouteAllowed(w.homeOf(p)),
        shapeOf: (p: Ptr) => w.ggml.tensorShape(p),
        verify
      }
    : null

/** Builds (and allocates in `slot`) the graph of one call shape. Frees its context on failure. */
export const buildGraph = (
  w: NativeWeights,
  slot: GraphSlot,
  key: string,
  items: ReadonlyArray<NativeItem>,
  nKvs: ReadonlyArray<number>,
  kind: StageInput["_tag"],
  swaNKvs: ReadonlyArray<number> = []
): CachedGraph => {
  const raw = checkedOps(w.ggml)
  const { hp, spec } = w.layout
  const nSeq = items.length
  const n = items.reduce((s, it) => s + inputLength(it.input), 0)
  const { ctx, maxNodes } = graphContext(raw, w, nSeq)
  try {
    const graph = raw.ggml_new_graph_custom(ctx, maxNodes, false)
    const rows = rowInputs(raw, ctx, graph, w, nSeq, n)
    const segments = attentionSegments(raw, ctx, graph, rows, items, nKvs, swaNKvs)
    const outIds = spec.isLast ? input1d(raw, ctx, GgmlType.I32, outputRowCount(items), "inp_out_ids") : null
    const { attnScale, hadamard } = constantShapedInputs(raw, ctx, graph, hp, n)
    // perLayer is set below, once the per-layer inputs are known (PerLayerInputs.ts)
    const dsv4 = dsv4Inputs(raw, ctx, graph, w, items, nKvs, n)
    const inputs: MutableInputs = {
      pos: rows.pos,
      outIds,
      segments,
      attnScale,
      hadamard,
      ...(dsv4 === undefined ? {} : { dsv4 })
    }
    const t = new Toolkit(
      raw,
      ctx,
      graph,
      hp,
      n,
      inputs,
      smallBatchRoute(
        w,
        nSeq,
        items.some((it) => it.input.verify === true)
      )
    )
    const { x, tokens, hidden } = stageInput(raw, ctx, w, t, inputs, kind, n)
    const out = stageBlocks(raw, ctx, w, t, inputs, x, n)
    raw.ggml_set_output(out)
    raw.ggml_build_forward_expand(graph, out)

    // a CPU stage has one backend, no scheduler: every node must be one the device computes as built (rule 3); a GPU
    // stage's scheduler runs on the CPU what the device does not compute, and must be given nothing neither computes
    if (w.split === null) checkGraph(w.ggml, w.dev, graph, w.extraWeights)
    else checkScheduledGraph(w.ggml, w.dev, graph)
    if (!slot.allocate(graph)) throw new Error("could not allocate the compute graph")
    return {
      key,
      sessions: items.map((it) => it.session.id),
      ctx,
      graph,
      inputs,
      kvIdx: rows.kvIdx,
      swaKvIdx: rows.swaKvIdx,
      rowIdx: rows.rowIdx,
      tokens,
      hidden,
      out
    }
  } catch (e) {
    raw.ggml_free(ctx)
    throw e
  }
}
