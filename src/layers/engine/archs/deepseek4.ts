/**
 * deepseek4 (DeepSeek-V4, V4-Flash; llama.cpp src/models/deepseek4.cpp), op for op:
 * - Hyper-connections: the residual stream is `hyper_connection.count` (4) streams of nEmbd, [nEmbd, hc, n] (the
 *   token embedding repeated into each at block 0). Before attention and before the feed-forward, the streams are
 *   RMS-normed as one row and projected (hc_*_fn) to `(2 + hc) x hc` mixes: `pre` weights (sigmoid + eps) sum the
 *   streams into the sublayer's input (ggml_dsv4_hc_pre), `post` weights (2 sigmoid) spread its output back, and a
 *   Sinkhorn-normalised hc x hc matrix (ggml_dsv4_hc_comb, `sinkhorn_iterations`) mixes the streams
 *   (ggml_dsv4_hc_post). The output head sums the streams with its own weights (output_hc_*) before output_norm.
 *   What crosses a stage boundary is the whole stream: nEmbd x hc floats a token (PerLayerInputs.activationWidth).
 * - Attention: a q LoRA (attn_q_a, its norm, attn_q_b), each head RMS-normed without weight; one K=V head (attn_kv,
 *   its norm); RoPE NORM on the last rope.dimension_count values of a head (ggml_rope_set_offset), the output rotated
 *   back (ggml_rope_ext_back); per-head sinks; a sliding window (`attention.sliding_window`); the output through
 *   `attention.output_group_count` groups of a LoRA (attn_output_a, rank `output_lora_rank`) and attn_output_b.
 * - Compressed blocks (`attention.compress_ratios` 4): every 4 positions are compressed into one row (a softmax over
 *   the 8 rows of the block and the one before, per value, of attn_compressor_kv under attn_compressor_gate + ape, its
 *   norm, RoPE at the block's first position with `compress_rope_freq_base`); a lightning indexer (its own compressor,
 *   Hadamard-rotated keys; indexer.attn_q_b of the q latent, indexer.proj weights) scores the complete compressed rows
 *   and attention reads the window plus the indexer's top-k (`attention.indexer.top_k`) of them. Heavily compressed
 *   blocks (ratio 128) compress each complete block of 128 positions (a softmax over them per value, no overlap, no
 *   indexer) and attention reads the window plus every complete compressed row.
 * - Feed-forward: routed experts under sqrt(softplus) gating with the correction bias, weights normalised and scaled,
 *   the first `hash_layer_count` blocks routed by token id (ffn_gate_tid2eid) instead, plus the shared experts; both
 *   with the clamped SwiGLU (`swiglu_clamp_exp`, `swiglu_clamp_shexp`).
 * Refused naming the key: a compress ratio other than 0, 4 and 128, hc other than 4 (llama.cpp asserts it), gating
 * other than sqrtsoftplus, an indexer key_length equal to key_length (llama.cpp then rotates the compressed caches).
 */
import { Effect } from "effect"
import type { GgufFile, ModelLoadError } from "../../../domain/gguf.js"
import { getGgml, GgmlType, type Ptr } from "../../ggml/Bindings.js"
import { getBool, getF32, getNumberArray, getOptional, getU32 } from "../../gguf/GgufReader.js"
import type { ArchModule, OutputWeights } from "../Arch.js"
import { type Dsv4Params, HCA_RATIO, type HParams, RopeMode } from "../HParams.js"
import { invalidMetadata } from "../MetadataErrors.js"
import { moeBlockSpecs, moeFfn, moeOf, readMoeParams } from "../Moe.js"
import type { AttentionSegment, BlockWeights, Dsv4Segment, TensorSpec, Toolkit } from "../Toolkit.js"
import { GGML_PREC_F32 } from "../Toolkit.js"

const f = Math.fround

/** llama.cpp's llama_expert_gating_func_type SQRT_SOFTPLUS, the one deepseek4's loader takes. */
const SQRT_SOFTPLUS = 4

/** Per-block float array of `key` (a scalar repeated, as get_key_or_arr); `fallback` when absent. */
const perBlockFloats = (file: GgufFile, key: string, nLayer: number, fallback?: ReadonlyArray<number>) =>
  Effect.gen(function* () {
    if (!file.metadata.has(key)) {
      if (fallback !== undefined) return fallback
      return yield* Effect.fail(invalidMetadata(file, key, "is missing"))
    }
    const v = file.metadata.get(key)
    if (Array.isArray(v)) {
      const arr = yield* getNumberArray(file, key)
      if (arr.length < nLayer) return yield* Effect.fail(invalidMetadata(file, key, `has fewer than ${nLayer} entries`))
      return arr.slice(0, nLayer)
    }
    return Array<number>(nLayer).fill(yield* getF32(file, key))
  })

const readRatios = (file: GgufFile, hp: HParams) =>
  Effect.gen(function* () {
    const key = `${hp.arch}.attention.compress_ratios`
    const ratios = yield* getNumberArray(file, key)
    if (ratios.length < hp.nLayer) {
      return yield* Effect.fail(invalidMetadata(file, key, `is shorter than block_count (${hp.nLayer})`))
    }
    const bad = ratios.slice(0, hp.nLayer).findIndex((r) => r !== 0 && r !== 4 && r !== HCA_RATIO)
    if (bad >= 0) {
      return yield* Effect.fail(
        invalidMetadata(file, key, `block ${bad} has ratio ${ratios[bad]}: llama.cpp's graph takes 0, 4 and 128`)
      )
    }
    return ratios.slice(0, hp.nLayer)
  })

const readDsv4Params = (file: GgufFile, hp: HParams): Effect.Effect<Dsv4Params, ModelLoadError> =>
  Effect.gen(function* () {
    const k = (s: string) => `${hp.arch}.${s}`
    const fail = (key: string, message: string) => Effect.fail(invalidMetadata(file, k(key), message))
    const hcMult = yield* getU32(file, k("hyper_connection.count"))
    if (hcMult !== 4) return yield* fail("hyper_connection.count", `= ${hcMult}: llama.cpp's graph takes 4`)
    const oGroups = yield* getU32(file, k("attention.output_group_count"))
    if (oGroups <= 0 || hp.nHead % oGroups !== 0) {
      return yield* fail("attention.output_group_count", `= ${oGroups} must divide head_count = ${hp.nHead}`)
    }
    const headSize = yield* getU32(file, k("attention.indexer.key_length"))
    if (!(headSize >= 64 && (headSize & (headSize - 1)) === 0) || headSize < hp.nRot) {
      return yield* fail(
        "attention.indexer.key_length",
        `= ${headSize} must be a power of two >= 64 and >= rope.dimension_count`
      )
    }
    if (headSize === hp.headDimK) {
      return yield* fail(
        "attention.indexer.key_length",
        `= ${headSize} equals key_length: llama.cpp then rotates the compressed cache too, which swactor does not`
      )
    }
    const clampExp = yield* perBlockFloats(file, k("swiglu_clamp_exp"), hp.nLayer)
    return {
      hcMult,
      sinkhornIters: yield* getU32(file, k("hyper_connection.sinkhorn_iterations")),
      hcEps: yield* getF32(file, k("hyper_connection.epsilon")),
      qLoraRank: yield* getU32(file, k("attention.q_lora_rank")),
      oGroups,
      oLoraRank: yield* getU32(file, k("attention.output_lora_rank")),
      ratios: yield* readRatios(file, hp),
      compressRopeBase: yield* getF32(file, k("attention.compress_rope_freq_base")),
      hashLayers: yield* getU32(file, k("hash_layer_count")),
      clampExp,
      clampShexp: yield* perBlockFloats(file, k("swiglu_clamp_shexp"), hp.nLayer, clampExp),
      indexer: {
        nHead: yield* getU32(file, k("attention.indexer.head_count")),
        headSize,
        topK: yield* getU32(file, k("attention.indexer.top_k"))
      }
    }
  })

const readDeepseek4 = (file: GgufFile, hp: HParams): Effect.Effect<HParams, ModelLoadError> =>
  Effect.gen(function* () {
    const gatingKey = `${hp.arch}.expert_gating_func`
    const gating = yield* getOptional(file, gatingKey, getU32)
    if (gating !== SQRT_SOFTPLUS) {
      return yield* Effect.fail(
        invalidMetadata(file, gatingKey, `= ${gating}: llama.cpp's deepseek4 graph takes sqrtsoftplus (4) only`)
      )
    }
    if (hp.headDimV !== hp.headDimK) {
      return yield* Effect.fail(invalidMetadata(file, `${hp.arch}.attention.value_length`, "must equal key_length"))
    }
    const dsv4 = yield* readDsv4Params(file, hp)
    const moe = yield* readMoeParams(file, hp, {
      gating: "sqrtSoftplus",
      normWeights: (yield* getOptional(file, `${hp.arch}.expert_weights_norm`, getBool)) === true,
      weightsScale: yield* getF32(file, `${hp.arch}.expert_weights_scale`),
      nExpertShared: yield* getU32(file, `${hp.arch}.expert_shared_count`)
    })
    const window = yield* getU32(file, `${hp.arch}.attention.sliding_window`)
    return {
      ...hp,
      dsv4,
      moe,
      kqScale: f(1 / f(Math.sqrt(hp.headDimK))),
      swa: {
        window,
        layers: Array<boolean>(hp.nLayer).fill(true),
        ropeFreqBase: hp.ropeFreqBase,
        ropeFreqScale: 1,
        uncapped: true
      }
    }
  })

const dsv4Of = (hp: HParams): Dsv4Params => {
  if (hp.dsv4 === undefined) throw new Error("deepseek4 hyperparameters were not read")
  return hp.dsv4
}

const blockSpecs = (hp: HParams, il: number): ReadonlyArray<TensorSpec> => {
  const d = dsv4Of(hp)
  const moe = moeOf(hp)
  const hd = hp.headDimK
  const hcDim = d.hcMult * hp.nEmbd
  const mix = (2 + d.hcMult) * d.hcMult
  const m = (name: string, dims: ReadonlyArray<number>): TensorSpec => ({ name, dims, kind: "matrix", required: true })
  const vec = (name: string, dims: ReadonlyArray<number>): TensorSpec => ({
    name,
    dims,
    kind: "vector",
    required: true
  })
  const specs: Array<TensorSpec> = [
    vec("attn_norm.weight", [hp.nEmbd]),
    vec("attn_sinks.weight", [hp.nHead]),
    m("attn_q_a.weight", [hp.nEmbd, d.qLoraRank]),
    vec("attn_q_a_norm.weight", [d.qLoraRank]),
    m("attn_q_b.weight", [d.qLoraRank, hp.nHead * hd]),
    m("attn_kv.weight", [hp.nEmbd, hd]),
    vec("attn_kv_a_norm.weight", [hd]),
    m("attn_output_a.weight", [(hp.nHead * hd) / d.oGroups, d.oGroups * d.oLoraRank]),
    m("attn_output_b.weight", [d.oGroups * d.oLoraRank, hp.nEmbd]),
    m("hc_attn_fn.weight", [hcDim, mix]),
    vec("hc_attn_base.weight", [mix]),
    vec("hc_attn_scale.weight", [3]),
    m("hc_ffn_fn.weight", [hcDim, mix]),
    vec("hc_ffn_base.weight", [mix]),
    vec("hc_ffn_scale.weight", [3]),
    vec("ffn_norm.weight", [hp.nEmbd]),
    ...moeBlockSpecs(hp, moe),
    il < d.hashLayers
      ? {
          name: "ffn_gate_tid2eid.weight",
          dims: [moe.nExpertUsed, hp.nVocab],
          kind: "vector",
          required: true,
          exactType: GgmlType.I32
        }
      : vec("exp_probs_b.bias", [moe.nExpert])
  ]
  if (d.ratios[il] === HCA_RATIO) {
    specs.push(
      m("attn_compressor_kv.weight", [hp.nEmbd, hd]),
      m("attn_compressor_gate.weight", [hp.nEmbd, hd]),
      vec("attn_compressor_ape.weight", [hd, HCA_RATIO]),
      vec("attn_compressor_norm.weight", [hd])
    )
  }
  if (d.ratios[il] === 4) {
    const ih = d.indexer.headSize
    specs.push(
      m("attn_compressor_kv.weight", [hp.nEmbd, 2 * hd]),
      m("attn_compressor_gate.weight", [hp.nEmbd, 2 * hd]),
      vec("attn_compressor_ape.weight", [2 * hd, 4]),
      vec("attn_compressor_norm.weight", [hd]),
      m("indexer.proj.weight", [hp.nEmbd, d.indexer.nHead]),
      m("indexer.attn_q_b.weight", [d.qLoraRank, d.indexer.nHead * ih]),
      m("indexer_compressor_kv.weight", [hp.nEmbd, 2 * ih]),
      m("indexer_compressor_gate.weight", [hp.nEmbd, 2 * ih]),
      vec("indexer_compressor_ape.weight", [2 * ih, 4]),
      vec("indexer_compressor_norm.weight", [ih])
    )
  }
  return specs
}

/** The mixes of one hyper-connection: the sublayer's input, and its post weights and combination matrix. */
interface HcMix {
  readonly cur: Ptr
  readonly post: Ptr
  readonly comb: Ptr
}

/** llama.cpp's build_hc_pre over x [nEmbd, hc, n] with the fused pre and comb ops (as its CPU context resolves them). */
const hcPre = (t: Toolkit, x: Ptr, fn: Ptr, scale: Ptr, base: Ptr): HcMix => {
  const g = t.g
  const ctx = t.ctx
  const d = dsv4Of(t.hp)
  const hc = d.hcMult
  const n = t.nTokens
  const flat = g.ggml_rms_norm(ctx, g.ggml_reshape_2d(ctx, x, hc * t.hp.nEmbd, n), t.hp.rmsEps)
  const mixes = t.linear(fn, flat) // [(2 + hc) hc, n]
  const row = g.ggml_row_size(GgmlType.F32, (2 + hc) * hc)
  const part = (i: number, width: number) => g.ggml_view_2d(ctx, mixes, width, n, row, i * 4)
  const affine = (v: Ptr, i: number) =>
    g.ggml_add(ctx, g.ggml_mul(ctx, v, g.ggml_view_1d(ctx, scale, 1, i * 4)), g.ggml_view_1d(ctx, base, hc, i * hc * 4))
  const pre = g.ggml_scale_bias(ctx, g.ggml_sigmoid(ctx, affine(part(0, hc), 0)), 1, d.hcEps)
  const post = g.ggml_scale(ctx, g.ggml_sigmoid(ctx, affine(part(hc, hc), 1)), 2)
  const comb = g.ggml_dsv4_hc_comb(ctx, mixes, scale, base, d.hcEps, d.sinkhornIters)
  return { cur: g.ggml_dsv4_hc_pre(ctx, x, pre), post, comb }
}

/** RoPE settings of a block: its compressed blocks rotate with the compressor's base and the model's scaling. */
const ropeOf = (t: Toolkit, compressed: boolean) => {
  const hp = t.hp
  if (!compressed) return { nCtxOrig: 0, base: hp.ropeFreqBase, scale: 1, ext: 0, attn: 1, fast: 0, slow: 0 }
  const ext = hp.ropeExt?.extFactor ?? 0
  return {
    nCtxOrig: hp.nCtxOrig,
    base: dsv4Of(hp).compressRopeBase,
    scale: hp.ropeFreqScale,
    ext,
    attn: ext === 0 ? 1 : f(1 / f(1 + f(0.1 * Math.log(1 / hp.ropeFreqScale)))),
    fast: hp.ropeExt?.betaFast ?? 32,
    slow: hp.ropeExt?.betaSlow ?? 1
  }
}

/** RoPE on the last nRot values of each head of x [width, heads, n] at `pos` (inverse with `back`). */
const tailRope = (t: Toolkit, x: Ptr, pos: Ptr, width: number, compressed: boolean, back = false): Ptr => {
  const r = ropeOf(t, compressed)
  const rope = back ? t.g.ggml_rope_ext_back : t.g.ggml_rope_ext
  const out = rope(
    t.ctx,
    x,
    pos,
    null,
    t.hp.nRot,
    RopeMode.NORM,
    r.nCtxOrig,
    r.base,
    r.scale,
    r.ext,
    r.attn,
    r.fast,
    r.slow
  )
  return t.g.ggml_rope_set_offset(out, width - t.hp.nRot)
}

/** The compressor's per-position rows of a compressed block: K and score (+ ape), the attention's and the indexer's. */
const compressorRows = (t: Toolkit, w: BlockWeights, h: Ptr) => {
  const g = t.g
  const statePos = t.inputs.dsv4!.statePos
  const rows = (prefix: string) => ({
    kv: t.linear(w.get(`${prefix}_kv.weight`), h),
    score: g.ggml_add(
      t.ctx,
      t.linear(w.get(`${prefix}_gate.weight`), h),
      g.ggml_get_rows(t.ctx, w.get(`${prefix}_ape.weight`), statePos)
    )
  })
  return { attn: rows("attn_compressor"), lid: rows("indexer_compressor") }
}

/**
 * One sequence's compressed rows [width, 1, n] of the n blocks its call completes, from the compressor's rows in the
 * V cache at `vOffset` (floats): per value, a softmax over the previous block's first halves and the block's second halves, their weighted sum,
 * the norm, RoPE at the block's first position (llama.cpp's build_overlap_compressed_kv_from_state).
 */
const compress = (t: Toolkit, v: Ptr, vOffset: number, width: number, ds: Dsv4Segment, norm: Ptr, n: number): Ptr => {
  const g = t.g
  const ctx = t.ctx
  const vRow = t.g.ggml_row_size(GgmlType.F32, 1) * (t.hp.headDimK * 4 + dsv4Of(t.hp).indexer.headSize * 4)
  const cells = (off: number) => g.ggml_view_2d(ctx, v, 2 * width, kvCells(t, v), vRow, off * 4)
  const halves = (off: number) => {
    const rows = g.ggml_get_rows(ctx, cells(off), ds.read!) // [2 width, 8n]
    const nb1 = 2 * width * 4
    const prev = g.ggml_reshape_3d(ctx, g.ggml_cont(ctx, g.ggml_view_2d(ctx, rows, width, 4 * n, nb1, 0)), width, 4, n)
    const cur = g.ggml_reshape_3d(
      ctx,
      g.ggml_cont(ctx, g.ggml_view_2d(ctx, rows, width, 4 * n, nb1, 4 * n * nb1 + width * 4)),
      width,
      4,
      n
    )
    return { prev, cur }
  }
  const kv = halves(vOffset)
  const score = halves(vOffset + 2 * width)
  const values = g.ggml_cont(ctx, g.ggml_permute(ctx, g.ggml_concat(ctx, kv.prev, kv.cur, 1), 1, 0, 2, 3))
  const prevScore = g.ggml_add(ctx, score.prev, ds.prevBias!)
  const scores = g.ggml_cont(ctx, g.ggml_permute(ctx, g.ggml_concat(ctx, prevScore, score.cur, 1), 1, 0, 2, 3))
  let comp = g.ggml_sum_rows(ctx, g.ggml_mul(ctx, values, g.ggml_soft_max(ctx, scores)))
  comp = g.ggml_cont(ctx, g.ggml_permute(ctx, comp, 1, 0, 2, 3)) // [width, 1, n]
  comp = t.rmsNorm(comp, norm)
  return tailRope(t, comp, ds.compPos!, width, true)
}

/** Cells of a cache tensor (its second dimension). */
const kvCells = (_t: Toolkit, cache: Ptr): number => getGgml().tensorShape(cache).ne[1]!

/** The top-k mask of the compressed rows [nComp, n] (F16): -inf but at each row's top-k, plus the visibility mask. */
const topKMask = (t: Toolkit, scores: Ptr, mask: Ptr, nComp: number, n: number): Ptr => {
  const g = t.g
  const ctx = t.ctx
  const open = Math.min(nComp, dsv4Of(t.hp).indexer.topK)
  const top = g.ggml_cont(ctx, g.ggml_top_k(ctx, scores, open))
  const half = 2
  const closed = g.ggml_fill(ctx, mask, -Infinity)
  const cells = g.ggml_view_4d(ctx, closed, 1, nComp, n, 1, half, half * nComp, half * nComp * n, 0)
  const zeros = g.ggml_fill(ctx, g.ggml_new_tensor_4d(ctx, GgmlType.F16, 1, open, n, 1), 0)
  const picked = g.ggml_set_rows(
    ctx,
    cells,
    zeros,
    g.ggml_view_4d(ctx, top, open, n, 1, 1, 4 * open, 4 * open * n, 4 * open * n, 0)
  )
  const back = g.ggml_view_4d(ctx, picked, nComp, n, 1, 1, half * nComp, half * nComp * n, half * nComp * n, 0)
  return g.ggml_add(ctx, back, mask)
}

/** Writes one sequence's compressor rows into the block's V cache (cell = position). */
const putCompressorRows = (t: Toolkit, seg: AttentionSegment, parts: ReadonlyArray<Ptr>) => {
  const g = t.g
  const ctx = t.ctx
  const hd = t.hp.headDimK
  const ih = dsv4Of(t.hp).indexer.headSize
  const v = seg.kv(t.layer).v
  const vRow = g.ggml_row_size(GgmlType.F32, 4 * hd + 4 * ih)
  const widths = [2 * hd, 2 * hd, 2 * ih, 2 * ih]
  let off = 0
  parts.forEach((src, i) => {
    const width = widths[i]!
    const dst = g.ggml_view_2d(ctx, v, width, kvCells(t, v), vRow, off * 4)
    const rows = g.ggml_view_2d(ctx, src, width, seg.n, width * 4, 0)
    g.ggml_build_forward_expand(t.graph, g.ggml_set_rows(ctx, dst, rows, seg.kvIdx))
    off += width
  })
}

/**
 * The blocks of 4 positions one sequence's call completes, compressed into their rows: attention's beside the window's
 * row (K row offset hd), the indexer's Hadamard-rotated (offset 2 hd).
 */
const compressBlocks = (t: Toolkit, w: BlockWeights, seg: AttentionSegment, ds: Dsv4Segment) => {
  const g = t.g
  const ctx = t.ctx
  const hd = t.hp.headDimK
  const ih = dsv4Of(t.hp).indexer.headSize
  const m = ds.m
  const cache = seg.kv(t.layer)
  const kRow = g.ggml_row_size(GgmlType.F16, 2 * hd + ih)
  const kPart = (off: number, width: number) => g.ggml_view_2d(ctx, cache.k, width, kvCells(t, cache.k), kRow, off * 2)
  const attnComp = compress(t, cache.v, 0, hd, ds, w.get("attn_compressor_norm.weight"), m)
  g.ggml_build_forward_expand(
    t.graph,
    g.ggml_set_rows(ctx, kPart(hd, hd), g.ggml_reshape_2d(ctx, attnComp, hd, m), ds.write!)
  )
  const lidComp = compress(t, cache.v, 4 * hd, ih, ds, w.get("indexer_compressor_norm.weight"), m)
  const rotated = g.ggml_mul_mat(ctx, t.inputs.hadamard!, lidComp)
  g.ggml_build_forward_expand(
    t.graph,
    g.ggml_set_rows(ctx, kPart(2 * hd, ih), g.ggml_reshape_2d(ctx, rotated, ih, m), ds.write!)
  )
}

/**
 * One sequence's complete compressed rows as attention reads them: the indexer's scores of them and the mask of each
 * row's top-k. Returns the compressed K [hd, 1, nComp] and that mask.
 */
const compressedRows = (
  t: Toolkit,
  seg: AttentionSegment,
  ds: Dsv4Segment,
  iq: Ptr,
  iw: Ptr
): { readonly k: Ptr; readonly mask: Ptr } => {
  const g = t.g
  const ctx = t.ctx
  const hd = t.hp.headDimK
  const d = dsv4Of(t.hp)
  const ih = d.indexer.headSize
  const n = seg.n
  const cache = seg.kv(t.layer)
  const kRow = g.ggml_row_size(GgmlType.F16, 2 * hd + ih)
  const nComp = ds.nComp
  const keys = g.ggml_view_3d(ctx, cache.k, ih, 1, nComp, kRow, kRow, 2 * hd * 2)
  const w2 = g.ggml_view_2d(ctx, iw, d.indexer.nHead, n, g.ggml_row_size(GgmlType.F32, d.indexer.nHead), 0)
  const scores = g.ggml_lightning_indexer(ctx, iq, keys, w2, ds.mask!)
  return {
    k: g.ggml_view_3d(ctx, cache.k, hd, 1, nComp, kRow, kRow, hd * 2),
    mask: topKMask(t, scores, ds.mask!, nComp, n)
  }
}

/** One sequence's attention: the window's cache write, its compressed rows when it sees any, flash attention with sinks. */
const attendSegment = (t: Toolkit, w: BlockWeights, seg: AttentionSegment, rows: ReadonlyArray<Ptr>): Ptr => {
  const g = t.g
  const ctx = t.ctx
  const hp = t.hp
  const hd = hp.headDimK
  const ratio = dsv4Of(hp).ratios[t.layer]!
  if (ratio === HCA_RATIO) return attendHeavy(t, w, seg, rows)
  const compressed = ratio === 4
  const ds = compressed ? t.inputs.dsv4!.segments[t.inputs.segments.indexOf(seg)]! : undefined
  const [q, kv] = rows as [Ptr, Ptr]
  const cache = seg.kv(t.layer)
  const kRow = g.ggml_row_size(GgmlType.F16, hd + (compressed ? hd + dsv4Of(hp).indexer.headSize : 0))
  const kv2 = g.ggml_view_2d(ctx, kv, hd, seg.n, hd * 4, 0)
  const raw = g.ggml_view_2d(ctx, cache.k, hd, kvCells(t, cache.k), kRow, 0)
  g.ggml_build_forward_expand(t.graph, g.ggml_set_rows(ctx, raw, kv2, seg.kvIdx))
  let k: Ptr = g.ggml_view_3d(ctx, cache.k, hd, 1, seg.nKv, kRow, kRow, 0)
  if (seg.swaMask === null) throw new Error(`block ${t.layer}: the graph has no window mask`)
  let mask: Ptr = seg.swaMask
  if (compressed) {
    putCompressorRows(t, seg, rows.slice(2, 6))
    if (ds!.m > 0) compressBlocks(t, w, seg, ds!)
    if (ds!.nComp > 0) {
      const comp = compressedRows(t, seg, ds!, rows[6]!, rows[7]!)
      k = g.ggml_concat(ctx, k, comp.k, 2)
      mask = g.ggml_concat(ctx, mask, comp.mask, 0)
    }
  }
  return flashWithSinks(t, w, seg, q, k, mask)
}

/**
 * One sequence's attention on a heavily compressed block (ratio 128): the window's row and the compressor's rows
 * written; each block of 128 this call completes compressed (a softmax over its positions per value, the norm, RoPE
 * at its first position: llama.cpp's build_hca_compressed_kv_from_state) into its row beside the window's; attention
 * over the window and every complete compressed row.
 */
const attendHeavy = (t: Toolkit, w: BlockWeights, seg: AttentionSegment, rows: ReadonlyArray<Ptr>): Ptr => {
  const g = t.g
  const ctx = t.ctx
  const hp = t.hp
  const hd = hp.headDimK
  const hs = t.inputs.dsv4!.hca!.segments[t.inputs.segments.indexOf(seg)]!
  const [q, kv, ck, cs] = rows as [Ptr, Ptr, Ptr, Ptr]
  const cache = seg.kv(t.layer)
  const kRow = g.ggml_row_size(GgmlType.F16, 2 * hd)
  const vRow = g.ggml_row_size(GgmlType.F32, 2 * hd)
  const cells = kvCells(t, cache.k)
  const put = (dst: Ptr, src: Ptr, idx: Ptr) =>
    g.ggml_build_forward_expand(t.graph, g.ggml_set_rows(ctx, dst, src, idx))
  const view2 = (x: Ptr) => g.ggml_view_2d(ctx, x, hd, seg.n, hd * 4, 0)
  put(g.ggml_view_2d(ctx, cache.k, hd, cells, kRow, 0), view2(kv), seg.kvIdx)
  put(g.ggml_view_2d(ctx, cache.v, hd, cells, vRow, 0), view2(ck), seg.kvIdx)
  put(g.ggml_view_2d(ctx, cache.v, hd, cells, vRow, hd * 4), view2(cs), seg.kvIdx)
  if (hs.m > 0) {
    const gather = (off: number) =>
      g.ggml_cont(
        ctx,
        g.ggml_permute(
          ctx,
          g.ggml_reshape_3d(
            ctx,
            g.ggml_get_rows(ctx, g.ggml_view_2d(ctx, cache.v, hd, cells, vRow, off * 4), hs.read!),
            hd,
            HCA_RATIO,
            hs.m
          ),
          1,
          0,
          2,
          3
        )
      )
    const values = gather(0)
    const weights = g.ggml_soft_max(ctx, gather(hd))
    let comp = g.ggml_sum_rows(ctx, g.ggml_mul(ctx, values, weights))
    comp = t.rmsNorm(g.ggml_cont(ctx, g.ggml_permute(ctx, comp, 1, 0, 2, 3)), w.get("attn_compressor_norm.weight"))
    comp = tailRope(t, comp, hs.pos!, hd, true)
    put(g.ggml_view_2d(ctx, cache.k, hd, cells, kRow, hd * 2), g.ggml_reshape_2d(ctx, comp, hd, hs.m), hs.write!)
  }
  if (seg.swaMask === null) throw new Error(`block ${t.layer}: the graph has no window mask`)
  let k: Ptr = g.ggml_view_3d(ctx, cache.k, hd, 1, seg.nKv, kRow, kRow, 0)
  let mask: Ptr = seg.swaMask
  if (hs.nComp > 0) {
    k = g.ggml_concat(ctx, k, g.ggml_view_3d(ctx, cache.k, hd, 1, hs.nComp, kRow, kRow, hd * 2), 2)
    mask = g.ggml_concat(ctx, mask, hs.mask!, 0)
  }
  return flashWithSinks(t, w, seg, q, k, mask)
}

/** Flash attention of q over k (= v) under `mask`, with the block's sinks: [hd x heads, n]. */
const flashWithSinks = (t: Toolkit, w: BlockWeights, seg: AttentionSegment, q: Ptr, k: Ptr, mask: Ptr): Ptr => {
  const g = t.g
  const ctx = t.ctx
  const kp = g.ggml_permute(ctx, k, 0, 2, 1, 3)
  const fa = g.ggml_flash_attn_ext(ctx, g.ggml_permute(ctx, q, 0, 2, 1, 3), kp, kp, mask, t.hp.kqScale, 0, 0)
  g.ggml_flash_attn_ext_add_sinks(fa, w.get("attn_sinks.weight"))
  g.ggml_flash_attn_ext_set_prec(fa, GGML_PREC_F32)
  return g.ggml_reshape_2d(ctx, fa, t.hp.headDimK * t.hp.nHead, seg.n)
}

/** The attention sublayer over h [nEmbd, n] (attn_norm applied): [nEmbd, n]. */
const attention = (t: Toolkit, w: BlockWeights, h: Ptr): Ptr => {
  const g = t.g
  const ctx = t.ctx
  const hp = t.hp
  const d = dsv4Of(hp)
  const hd = hp.headDimK
  const n = t.nTokens
  const pos = t.inputs.pos
  const ratio = d.ratios[t.layer]
  const compressed = ratio !== 0
  const qr = t.rmsNorm(t.linear(w.get("attn_q_a.weight"), h), w.get("attn_q_a_norm.weight"))
  let q = g.ggml_reshape_3d(ctx, t.linear(w.get("attn_q_b.weight"), qr), hd, hp.nHead, n)
  q = tailRope(t, g.ggml_rms_norm(ctx, q, hp.rmsEps), pos, hd, compressed)
  let kv = t.rmsNorm(t.linear(w.get("attn_kv.weight"), h), w.get("attn_kv_a_norm.weight"))
  kv = tailRope(t, g.ggml_reshape_3d(ctx, kv, hd, 1, n), pos, hd, compressed)
  const parts = [
    { x: q, ne0: hd, ne1: hp.nHead },
    { x: kv, ne0: hd, ne1: 1 }
  ]
  if (ratio === HCA_RATIO) {
    const hca = t.inputs.dsv4!.hca!
    const rows = g.ggml_add(
      ctx,
      t.linear(w.get("attn_compressor_gate.weight"), h),
      g.ggml_get_rows(ctx, w.get("attn_compressor_ape.weight"), hca.statePos)
    )
    parts.push({ x: t.linear(w.get("attn_compressor_kv.weight"), h), ne0: hd, ne1: 1 }, { x: rows, ne0: hd, ne1: 1 })
  }
  if (ratio === 4) {
    const ih = d.indexer.headSize
    const c = compressorRows(t, w, h)
    let iq = g.ggml_reshape_3d(ctx, t.linear(w.get("indexer.attn_q_b.weight"), qr), ih, d.indexer.nHead, n)
    iq = g.ggml_mul_mat(ctx, t.inputs.hadamard!, tailRope(t, iq, pos, ih, true))
    const iw = g.ggml_scale(ctx, t.linear(w.get("indexer.proj.weight"), h), f(1 / f(Math.sqrt(ih * d.indexer.nHead))))
    parts.push(
      { x: c.attn.kv, ne0: 2 * hd, ne1: 1 },
      { x: c.attn.score, ne0: 2 * hd, ne1: 1 },
      { x: c.lid.kv, ne0: 2 * ih, ne1: 1 },
      { x: c.lid.score, ne0: 2 * ih, ne1: 1 },
      { x: iq, ne0: ih, ne1: d.indexer.nHead },
      { x: iw, ne0: d.indexer.nHead, ne1: 1 }
    )
  }
  g.ggml_build_forward_expand(t.graph, q)
  g.ggml_build_forward_expand(t.graph, kv)
  let out = t.perSequence(hd * hp.nHead, parts, (seg, rows) => attendSegment(t, w, seg, rows), true)
  // rotated back, then each group of heads through its LoRA
  out = tailRope(t, g.ggml_reshape_3d(ctx, out, hd, hp.nHead, n), pos, hd, compressed, true)
  const groupDim = (hp.nHead / d.oGroups) * hd
  out = g.ggml_permute(ctx, g.ggml_reshape_3d(ctx, out, groupDim, d.oGroups, n), 0, 2, 1, 3)
  const woA = g.ggml_reshape_3d(ctx, w.get("attn_output_a.weight"), groupDim, d.oLoraRank, d.oGroups)
  let oa = g.ggml_permute(ctx, g.ggml_mul_mat(ctx, woA, out), 0, 2, 1, 3)
  oa = g.ggml_cont_2d(ctx, oa, d.oLoraRank * d.oGroups, n)
  return t.linear(w.get("attn_output_b.weight"), oa)
}

/** The feed-forward over h [nEmbd, n] (ffn_norm applied): routed (by token id on hash blocks) plus shared experts. */
const feedForward = (t: Toolkit, w: BlockWeights, h: Ptr): Ptr => {
  const d = dsv4Of(t.hp)
  const il = t.layer
  const swigluClamp = { experts: d.clampExp[il]!, shared: d.clampShexp[il]! }
  if (il < d.hashLayers) {
    const tokens = t.inputs.tokens
    if (tokens === undefined || tokens === null) {
      throw new Error(`block ${il} routes by token id (deepseek4.hash_layer_count) but its stage has no token ids`)
    }
    const chosen = t.g.ggml_get_rows(t.ctx, w.get("ffn_gate_tid2eid.weight"), tokens)
    return moeFfn(t, w, h, moeOf(t.hp), null, { chosen, swigluClamp })
  }
  return moeFfn(t, w, h, moeOf(t.hp), w.get("exp_probs_b.bias"), { swigluClamp })
}

/** One block: x [nEmbd x hc, n] (block 0: the embeddings [nEmbd, n], repeated into the hc streams) in and out. */
const buildBlock = (t: Toolkit, w: BlockWeights, x: Ptr): Ptr => {
  const g = t.g
  const ctx = t.ctx
  const { nEmbd } = t.hp
  const hc = dsv4Of(t.hp).hcMult
  const n = t.nTokens
  let res =
    t.layer === 0
      ? g.ggml_repeat_4d(ctx, g.ggml_reshape_3d(ctx, x, nEmbd, 1, n), nEmbd, hc, n, 1)
      : g.ggml_reshape_3d(ctx, x, nEmbd, hc, n)
  const a = hcPre(t, res, w.get("hc_attn_fn.weight"), w.get("hc_attn_scale.weight"), w.get("hc_attn_base.weight"))
  const att = attention(t, w, t.rmsNorm(a.cur, w.get("attn_norm.weight")))
  res = g.ggml_dsv4_hc_post(ctx, att, res, a.post, a.comb)
  const m = hcPre(t, res, w.get("hc_ffn_fn.weight"), w.get("hc_ffn_scale.weight"), w.get("hc_ffn_base.weight"))
  g.ggml_build_forward_expand(t.graph, res)
  g.ggml_build_forward_expand(t.graph, m.post)
  g.ggml_build_forward_expand(t.graph, m.comb)
  const ffn = feedForward(t, w, t.rmsNorm(m.cur, w.get("ffn_norm.weight")))
  res = g.ggml_dsv4_hc_post(ctx, ffn, res, m.post, m.comb)
  return t.outputRows(g.ggml_reshape_2d(ctx, res, nEmbd * hc, n))
}

/** The output head: the streams summed by output_hc_* (llama.cpp's unfused build_hc_head), output_norm, output. */
const buildOutput = (t: Toolkit, w: OutputWeights, x: Ptr): Ptr => {
  const g = t.g
  const ctx = t.ctx
  const { nEmbd } = t.hp
  const d = dsv4Of(t.hp)
  const hc = d.hcMult
  const nOut = getGgml().tensorShape(x).ne[1]!
  const mixes = t.linear(w.get("output_hc_fn.weight"), g.ggml_rms_norm(ctx, x, t.hp.rmsEps)) // [hc, nOut]
  let pre = g.ggml_add(ctx, g.ggml_mul(ctx, mixes, w.get("output_hc_scale.weight")), w.get("output_hc_base.weight"))
  pre = g.ggml_scale_bias(ctx, g.ggml_sigmoid(ctx, pre), 1, d.hcEps)
  const x3 = g.ggml_reshape_3d(ctx, x, nEmbd, hc, nOut)
  let sum: Ptr | null = null
  for (let i = 0; i < hc; i++) {
    const xi = g.ggml_view_2d(ctx, x3, nEmbd, nOut, nEmbd * hc * 4, i * nEmbd * 4)
    const wi = g.ggml_view_2d(ctx, pre, 1, nOut, hc * 4, i * 4)
    const cur = g.ggml_mul(ctx, xi, wi)
    sum = sum === null ? cur : g.ggml_add(ctx, sum, cur)
  }
  return t.linear(w.get("output.weight"), t.rmsNorm(sum!, w.get("output_norm.weight")))
}

const outputTensors = (hp: HParams): ReadonlyArray<TensorSpec> => {
  const hc = dsv4Of(hp).hcMult
  return [
    { name: "output_hc_fn.weight", dims: [hc * hp.nEmbd, hc], kind: "matrix", required: true },
    { name: "output_hc_base.weight", dims: [hc], kind: "vector", required: true },
    { name: "output_hc_scale.weight", dims: [1], kind: "vector", required: true }
  ]
}

export const deepseek4: ArchModule = {
  name: "deepseek4",
  ropeMode: RopeMode.NORM,
  ffOptional: true,
  hparams: readDeepseek4,
  blockTensors: blockSpecs,
  outputTensors,
  buildBlock,
  buildOutput
}
