/**
 * Builds the ggml graph of one call shape over a loaded stage: the inputs, the architecture's blocks
 * (archs/*.ts over Toolkit.ts), the architecture's output head on the last stage; then checks every node against the
 * device (WeightPlacement.ts, rule 3) and allocates it in its slot.
 */
import type { StageInput } from "../../domain/engine.js"
import { type GgmlRaw, GgmlType, type Ptr } from "../ggml/Bindings.js"
import type { HParams } from "./HParams.js"
import type { CachedGraph, GraphSlot } from "./GraphCache.js"
import { inputLength, type NativeItem } from "./KvCache.js"
import { exactRowsDefault } from "./SmallBatch.js"
import { type AttentionSegment, type BlockWeights, type GraphInputs, Toolkit } from "./Toolkit.js"
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
    hadamard:
      hp.dsa === undefined
        ? null
        : input(raw.ggml_new_tensor_2d(ctx, GgmlType.F32, hp.dsa.headSize, hp.dsa.headSize), "attn_inp_k_rot")
  }
}

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
  const { arch, hp, spec } = w.layout
  const nLayers = spec.layerEndExclusive - spec.layerStart
  const nSeq = items.length
  const n = items.reduce((s, it) => s + inputLength(it.input), 0)
  // a routed block (Moe.ts) adds ~30 tensors, a view and an add per expert used, and ~12 for group-limited routing
  const moe = hp.moe
  const moeNodes = moe === undefined ? 0 : 40 + 3 * moe.nExpertUsed + (moe.nExpertGroups > 1 ? 16 : 0)
  const maxNodes = Math.max(2048, (96 + moeNodes + 24 * (nSeq - 1)) * nLayers + 256 + 8 * nSeq)
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
    // a second mask and cell index per sequence when the stage holds sliding-window blocks (HParams.swa): their
    // caches are rings capped near the window (KvCache.ts)
    let stageHasSwa = false
    for (let il = spec.layerStart; il < spec.layerEndExclusive; il++) stageHasSwa ||= hp.swa?.layers[il] === true
    const swaKvIdx = stageHasSwa ? input1d(GgmlType.I64, n, "inp_kv_idx_swa") : null
    // both cell indices are leaves, so both get memory even when the stage's blocks use only one (Forward.ts sets both)
    if (swaKvIdx !== null) {
      raw.ggml_build_forward_expand(graph, kvIdx)
      raw.ggml_build_forward_expand(graph, swaKvIdx)
    }
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
        kvIdx: nSeq > 1 ? raw.ggml_view_1d(ctx, kvIdx, len, offset * 8) : kvIdx,
        mask,
        swaMask,
        swaNKv: stageHasSwa ? swaNKvs[s]! : 0,
        swaKvIdx: swaKvIdx === null ? null : nSeq > 1 ? raw.ggml_view_1d(ctx, swaKvIdx, len, offset * 8) : swaKvIdx,
        rows: rowIdx === null ? null : raw.ggml_view_1d(ctx, rowIdx, len, offset * 8)
      })
      offset += len
    })
    const outIds = spec.isLast ? input1d(GgmlType.I32, nSeq, "inp_out_ids") : null
    const { attnScale, hadamard } = constantShapedInputs(raw, ctx, graph, hp, n)
    // perLayer is set below, once the per-layer inputs are known (PerLayerInputs.ts)
    const inputs: { -readonly [K in keyof GraphInputs]: GraphInputs[K] } = {
      pos,
      outIds,
      segments,
      attnScale,
      hadamard
    }

    // several sequences only: a lone call keeps exactly the products (and bits) it always had
    const small =
      w.device === "cpu" && nSeq > 1
        ? {
            maxRowsFor: w.smallRowsFor ?? (() => exactRowsDefault),
            allowed: (p: Ptr) => fewRowRouteAllowed(w.homeOf(p)),
            shapeOf: (p: Ptr) => w.ggml.tensorShape(p)
          }
        : null
    const t = new Toolkit(raw, ctx, graph, hp, n, inputs, small)
    const modelWide = { get: (name: string) => w.get(name), opt: (name: string) => w.tensors.get(name) ?? null }

    let x: Ptr
    let tokens: Ptr | null = null
    let hidden: Ptr | null = null
    if (kind === "Tokens") {
      tokens = input1d(GgmlType.I32, n, "inp_tokens")
      x = raw.ggml_get_rows(ctx, w.get("token_embd.weight"), tokens)
      if (arch.embedScale !== undefined) x = raw.ggml_scale(ctx, x, arch.embedScale(hp))
      if (hp.perLayer !== undefined && arch.perLayerInputs !== undefined) {
        const rows = arch.perLayerInputs(t, modelWide, tokens, x)
        inputs.perLayer = { rows, stride: hp.perLayer.width * hp.nLayer, offset: 0, first: 0 }
      }
    } else {
      // the stage's input rows: the residual stream, then the per-layer inputs of its blocks and later ones
      x = raw.ggml_new_tensor_2d(ctx, GgmlType.F32, activationWidth(hp, spec.layerStart), n)
      raw.ggml_set_name(x, "inp_hidden")
      raw.ggml_set_input(x)
      // never reused in place by the graph: a lone call may point it at the caller's memory (zeroCopyHidden)
      raw.ggml_set_output(x)
      hidden = x
      const split = splitStageInput(raw, ctx, hp, x, spec.layerStart, n)
      x = split.x
      if (split.perLayer !== undefined) inputs.perLayer = split.perLayer
    }
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
    if (spec.isLast) x = arch.buildOutput(t, modelWide, x)
    else x = joinStageOutput(raw, ctx, hp, x, inputs.perLayer, spec.layerEndExclusive, n)
    raw.ggml_set_output(x)
    raw.ggml_build_forward_expand(graph, x)

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
      kvIdx,
      swaKvIdx,
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
