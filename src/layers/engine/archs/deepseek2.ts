/**
 * deepseek2 (DeepSeek V2 / V3 / R1, Kimi K2; llama.cpp src/models/deepseek2.cpp) with multi-head latent attention
 * in llama.cpp's absorbed form:
 * - Q: attn_q_a -> RMS norm (attn_q_a_norm) -> attn_q_b, or one attn_q when `attention.q_lora_rank` is 0 / absent;
 *   per head the no-RoPE part then the RoPE part (`rope.dimension_count`, RoPE NORM).
 * - attn_kv_a_mqa gives per token the latent (`kv_lora_rank`, RMS-normed by attn_kv_a_norm) and one shared RoPE part.
 *   The cache holds one row per token: latent then roped part (K); V is a view of the latent (no V cache).
 * - The no-RoPE part of Q is absorbed into the latent through attn_k_b [nope, kv_lora_rank, heads], so attention is
 *   MQA over [latent | rope] (flash attention, scale 1 / sqrt(key_length_mla)); its output, per head a latent, is
 *   decompressed through attn_v_b [kv_lora_rank, value_length_mla, heads] before attn_output.
 * - ffn_norm, then `leading_dense_block_count` dense SwiGLU blocks, the rest routed (Moe.ts: softmax or sigmoid gate,
 *   optional expert bias exp_probs_b, weights norm and scale, group-limited routing, `expert_shared_count` shared
 *   experts).
 * Refused naming the key: legacy files without `key_length_mla` / `value_length_mla` (unsplit attn_kv_b), KV heads
 * other than 1, key/value lengths that are not the latent's, linear RoPE scaling, attention temperature, MTP layers.
 * YaRN (`rope.scaling.type` yarn, DeepSeek V3 / R1, Kimi K2) as llama.cpp computes it for deepseek2: the RoPE part's
 * ggml_rope_ext attn_factor from llama_context (mscale = mscale_all_dim: 1 / (1 + 0.1 ln factor)), and kq_scale =
 * mscale^2 / sqrt(key_length_mla) with mscale = 1 + 0.1 x (yarn_log_multiplier / 0.1) x ln factor.
 */
import { Effect } from "effect"
import type { GgufFile, ModelLoadError } from "../../../domain/gguf.js"
import { GgmlType, type Ptr } from "../../ggml/Bindings.js"
import { getBool, getF32, getOptional, getString, getStringArray, getU32 } from "../../gguf/GgufReader.js"
import { trunkBlockCount } from "../../gguf/TrunkBlocks.js"
import type { ArchModule } from "../Arch.js"
import { type HParams, type MlaParams, RopeMode } from "../HParams.js"
import { invalidMetadata } from "../MetadataErrors.js"
import { type RopeExt, yarnRopeExt } from "../PositionScaling.js"
import { moeBlockSpecs, moeFfn, moeOf, readMoeParams } from "../Moe.js"
import type { ExpertGating } from "../MoeParams.js"
import {
  GGML_PREC_F32,
  type AttentionSegment,
  type BlockWeights,
  llamaOutputHead,
  type SequenceRows,
  type TensorSpec,
  type Toolkit
} from "../Toolkit.js"

const f = Math.fround

/**
 * The latent-attention families' file rules: deepseek2 refuses MTP blocks and defaults a missing gating to softmax;
 * deepseek32 and glm-dsa (archs/dsa.ts) decode the trunk without the MTP block their files carry, deepseek32 requires
 * `expert_gating_func`, glm-dsa defaults it to sigmoid (llama.cpp's load_arch_hparams of each).
 */
export type MlaFamily = "deepseek2" | "deepseek32" | "glm-dsa"

/**
 * The routing's gating (`expert_gating_func`: 1 softmax, 2 sigmoid). Absent or 0: deepseek2 softmax (sigmoid for GLM
 * 4.7 Lite's shape, as llama.cpp), glm-dsa sigmoid; deepseek32 requires it.
 */
const readGating = (file: GgufFile, hp: HParams, family: MlaFamily): Effect.Effect<ExpertGating, ModelLoadError> =>
  Effect.gen(function* () {
    const gatingKey = `${hp.arch}.expert_gating_func`
    const gatingId = (yield* getOptional(file, gatingKey, getU32)) ?? 0
    if (gatingId === 1) return "softmax"
    if (gatingId === 2) return "sigmoid"
    if (gatingId !== 0) {
      return yield* Effect.fail(
        invalidMetadata(file, gatingKey, `= ${gatingId} is not a gating swactor supports (1 softmax, 2 sigmoid)`)
      )
    }
    if (family === "glm-dsa") return "sigmoid"
    if (family === "deepseek32") {
      return yield* Effect.fail(
        invalidMetadata(file, gatingKey, `is missing: ${family} names its expert gating (1 softmax, 2 sigmoid)`)
      )
    }
    const vocab = file.metadata.has("tokenizer.ggml.tokens")
      ? (yield* getStringArray(file, "tokenizer.ggml.tokens")).length
      : hp.nVocab
    return (hp.nLayer === 47 || hp.nLayer === 48) && vocab === 154880 ? "sigmoid" : "softmax"
  })

/** The MLA family's hyperparameters (latent sizes, routing, YaRN) read and checked; deepseek2's reader. */
export const readMlaModel = (file: GgufFile, hp0: HParams, family: MlaFamily): Effect.Effect<HParams, ModelLoadError> =>
  Effect.gen(function* () {
    const k = (s: string) => `${hp0.arch}.${s}`
    const fail = (key: string, message: string) => Effect.fail(invalidMetadata(file, key, message))
    const nextn = (yield* getOptional(file, k("nextn_predict_layers"), getU32)) ?? 0
    if (nextn > 0 && family === "deepseek2") {
      return yield* fail(k("nextn_predict_layers"), `= ${nextn}: MTP layers are not supported`)
    }
    // deepseek32 / glm-dsa: the MTP block trails the trunk, and llama.cpp decodes without it (TrunkBlocks.ts)
    const hp = family === "deepseek2" ? hp0 : { ...hp0, nLayer: yield* trunkBlockCount(file, hp0.arch) }
    const scaling = (yield* getOptional(file, k("rope.scaling.type"), getString)) ?? "none"
    if (scaling !== "none" && scaling !== "yarn") {
      return yield* fail(k("rope.scaling.type"), `= "${scaling}": deepseek2 supports plain RoPE and YaRN only`)
    }
    const logMulKey = k("rope.scaling.yarn_log_multiplier")
    // glm-dsa: llama.cpp never reads the multiplier (its rope_yarn_log_mul stays 0)
    const logMulRaw = family === "glm-dsa" ? undefined : yield* getOptional(file, logMulKey, getF32)
    if (logMulRaw !== undefined && !(logMulRaw >= 0 && Number.isFinite(logMulRaw))) {
      return yield* fail(logMulKey, `= ${logMulRaw} must be finite and >= 0`)
    }
    if (file.metadata.has(k("attention.temperature_scale"))) {
      return yield* fail(
        k("attention.temperature_scale"),
        `is set: attention temperature is not supported for deepseek2`
      )
    }
    const kMlaKey = k("attention.key_length_mla")
    const vMlaKey = k("attention.value_length_mla")
    const kMla = yield* getOptional(file, kMlaKey, getU32)
    const vMla = yield* getOptional(file, vMlaKey, getU32)
    if (kMla === undefined || vMla === undefined) {
      return yield* fail(
        kMla === undefined ? kMlaKey : vMlaKey,
        `is missing: only the absorbed latent form (attn_k_b / attn_v_b) is supported`
      )
    }
    const kvLoraKey = k("attention.kv_lora_rank")
    const kvLoraRank = yield* getU32(file, kvLoraKey)
    if (kvLoraRank <= 0) return yield* fail(kvLoraKey, `= ${kvLoraRank} must be > 0`)
    const qLoraRank = (yield* getOptional(file, k("attention.q_lora_rank"), getU32)) ?? 0
    const nRot = hp.nRot
    if (!(nRot > 0 && nRot % 2 === 0 && nRot < kMla)) {
      return yield* fail(k("rope.dimension_count"), `= ${nRot} must be even and below "${kMlaKey}" = ${kMla}`)
    }
    if (vMla <= 0) return yield* fail(vMlaKey, `= ${vMla} must be > 0`)
    if (hp.nHeadKv !== 1) {
      return yield* fail(k("attention.head_count_kv"), `= ${hp.nHeadKv} must be 1 (one latent per token)`)
    }
    if (hp.headDimK !== kvLoraRank + nRot) {
      return yield* fail(
        k("attention.key_length"),
        `= ${hp.headDimK} must be "${kvLoraKey}" + rope.dimension_count = ${kvLoraRank + nRot}`
      )
    }
    if (hp.headDimV !== kvLoraRank) {
      return yield* fail(k("attention.value_length"), `= ${hp.headDimV} must be "${kvLoraKey}" = ${kvLoraRank}`)
    }
    const gating = yield* readGating(file, hp, family)
    const moe = yield* readMoeParams(file, hp, {
      gating,
      normWeights: (yield* getOptional(file, k("expert_weights_norm"), getBool)) ?? false,
      weightsScale: (yield* getOptional(file, k("expert_weights_scale"), getF32)) ?? 0,
      nExpertShared: yield* getU32(file, k("expert_shared_count")),
      nLeadingDense: (yield* getOptional(file, k("leading_dense_block_count"), getU32)) ?? 0,
      fusedGateUp: true
    })
    const mla: MlaParams = { qLoraRank, kvLoraRank, headDimK: kMla, headDimV: vMla }
    if (scaling !== "yarn") return { ...hp, moe, mla, kqScale: 1 / Math.sqrt(kMla) }
    const ropeAttnFactor = (yield* getOptional(file, k("rope.scaling.attn_factor"), getF32)) ?? 1
    return { ...hp, moe, mla, ...mlaYarn(hp, family, logMulRaw, ropeAttnFactor, kMla) }
  })

/**
 * YaRN for the MLA families as llama.cpp computes it: the RoPE part's ggml_rope_ext settings (llama_context) and
 * kq_scale (each family's graph: mscale(factor, multiplier) squared over sqrt(key_length_mla)).
 */
const mlaYarn = (
  hp: HParams,
  family: MlaFamily,
  logMulRaw: number | undefined,
  ropeAttnFactor: number,
  kMla: number
): { readonly ropeExt: RopeExt; readonly kqScale: number } => {
  // llama.cpp divides the file's multiplier by 0.1 (the convert script wrote mscale_all_dim x 0.1)
  const logMul = logMulRaw === undefined ? 0 : f(f(logMulRaw) / f(0.1))
  // llama_context: for deepseek2 mscale = mscale_all_dim, so with a multiplier the ratio get_mscale(factor, m) /
  // get_mscale(factor, m) is exactly 1 (what yarnRopeExt's ratio with multiplier 1 gives); without one get_mscale(factor, 1)
  // (deepseek32, glm-dsa: mscale stays 1, so the ratio is get_mscale(factor, 1) / get_mscale(factor, multiplier))
  const ropeExt = yarnRopeExt(hp.ropeFreqScale, {
    logMul: family !== "deepseek2" || logMul === 0 ? logMul : 1,
    betaFast: 32,
    betaSlow: 1,
    ropeAttnFactor
  })
  // deepseek2.cpp: undo ggml's own magnitude correction, apply mscale(factor, multiplier) to it, square into kq_scale
  const lnFactor = f(Math.log(f(1 / hp.ropeFreqScale)))
  const attnOrg = f(ropeExt.attnFactor * f(1 + f(f(0.1) * lnFactor)))
  const mscale = f(attnOrg * f(1 + f(f(f(0.1) * logMul) * lnFactor)))
  const kqScale = f(f(mscale * mscale) / f(Math.sqrt(kMla)))
  return { ropeExt, kqScale }
}

const mlaOf = (hp: HParams): MlaParams => {
  if (hp.mla === undefined) throw new Error("deepseek2 hyperparameters were not read")
  return hp.mla
}

/** A latent-attention block's tensors (deepseek2's; archs/dsa.ts adds the indexer's). */
export const mlaBlockSpecs = (hp: HParams, il: number): ReadonlyArray<TensorSpec> => {
  const mla = mlaOf(hp)
  const moe = moeOf(hp)
  const nope = mla.headDimK - hp.nRot
  const m = (name: string, dims: ReadonlyArray<number>): TensorSpec => ({ name, dims, kind: "matrix", required: true })
  const vec = (name: string, n: number, required = true): TensorSpec => ({ name, dims: [n], kind: "vector", required })
  const q: ReadonlyArray<TensorSpec> =
    mla.qLoraRank > 0
      ? [
          vec("attn_q_a_norm.weight", mla.qLoraRank),
          m("attn_q_a.weight", [hp.nEmbd, mla.qLoraRank]),
          m("attn_q_b.weight", [mla.qLoraRank, hp.nHead * mla.headDimK])
        ]
      : [m("attn_q.weight", [hp.nEmbd, hp.nHead * mla.headDimK])]
  const ffn: ReadonlyArray<TensorSpec> =
    il < moe.nLeadingDense
      ? [
          m("ffn_gate.weight", [hp.nEmbd, hp.nFf]),
          m("ffn_up.weight", [hp.nEmbd, hp.nFf]),
          m("ffn_down.weight", [hp.nFf, hp.nEmbd])
        ]
      : [...moeBlockSpecs(hp, moe), vec("exp_probs_b.bias", moe.nExpert, false)]
  return [
    vec("attn_norm.weight", hp.nEmbd),
    ...q,
    vec("attn_kv_a_norm.weight", mla.kvLoraRank),
    m("attn_kv_a_mqa.weight", [hp.nEmbd, mla.kvLoraRank + hp.nRot]),
    m("attn_k_b.weight", [nope, mla.kvLoraRank, hp.nHead]),
    m("attn_v_b.weight", [mla.kvLoraRank, mla.headDimV, hp.nHead]),
    m("attn_output.weight", [hp.nHead * mla.headDimV, hp.nEmbd]),
    vec("ffn_norm.weight", hp.nEmbd),
    ...ffn
  ]
}

/** DSA's part of a latent block (archs/dsa.ts): per sequence, the mask its attention reads through. */
export interface SparseMask {
  /** Rows of the batch the masks are computed from: `maskOf` gets each sequence's rows of them, in this order. */
  readonly parts: ReadonlyArray<SequenceRows>
  /** This sequence's attention mask (F16 [nKv, seg.n]) and the most cells it leaves open to a row. */
  readonly maskOf: (seg: AttentionSegment, rows: ReadonlyArray<Ptr>) => { readonly mask: Ptr; readonly open: number }
}

/**
 * One sequence's latent attention: its K rows (latent | rope) into its cache, flash attention of all heads over the
 * one shared K (V = the latent part of the same cells) through `mask` (the causal one, or DSA's top-k), each head's
 * latent decompressed through attn_v_b; [headDimV_mla * nHead, seg.n].
 */
const attendLatent = (
  t: Toolkit,
  seg: AttentionSegment,
  q: Ptr,
  k: Ptr,
  wvB: Ptr,
  kqScale: number,
  sparse: ((seg: AttentionSegment) => { readonly mask: Ptr; readonly open: number }) | null
): Ptr => {
  const g = t.g
  const ctx = t.ctx
  const hp = t.hp
  const mla = mlaOf(hp)
  const width = hp.headDimK
  const cache = seg.kv(t.layer).k
  const k2 = g.ggml_view_2d(ctx, k, width, seg.n, g.ggml_row_size(GgmlType.F32, width), 0)
  g.ggml_build_forward_expand(t.graph, g.ggml_set_rows(ctx, cache, k2, seg.kvIdx))
  const open = sparse?.(seg) ?? null
  const row = g.ggml_row_size(GgmlType.F16, width)
  const kView = g.ggml_view_3d(ctx, cache, width, 1, seg.nKv, row, row, 0)
  const vView = g.ggml_view_3d(ctx, cache, mla.kvLoraRank, 1, seg.nKv, row, row, 0)
  const fa = g.ggml_flash_attn_ext(
    ctx,
    g.ggml_permute(ctx, q, 0, 2, 1, 3),
    g.ggml_permute(ctx, kView, 0, 2, 1, 3),
    g.ggml_permute(ctx, vView, 0, 2, 1, 3),
    open?.mask ?? seg.mask,
    kqScale,
    0,
    0
  )
  if (open !== null) g.ggml_flash_attn_ext_set_n_kv_max(fa, open.open)
  g.ggml_flash_attn_ext_set_prec(fa, GGML_PREC_F32)
  // fa: [kv_lora_rank, nHead, n] -> [kv_lora_rank, n, nHead] x attn_v_b -> [v_mla, n, nHead] -> [v_mla, nHead, n]
  const perHead = g.ggml_mul_mat(ctx, wvB, g.ggml_permute(ctx, fa, 0, 2, 1, 3))
  const out = g.ggml_cont(ctx, g.ggml_permute(ctx, perHead, 0, 2, 1, 3))
  return g.ggml_reshape_2d(ctx, out, mla.headDimV * hp.nHead, seg.n)
}

/** Latent attention over every sequence of the batch, then attn_output. q: [width, nHead, n], k: [width, 1, n]. */
const latentAttention = (t: Toolkit, q: Ptr, k: Ptr, v: Ptr, w: BlockWeights, sparse: SparseMask | null): Ptr =>
  t.linear(w.get("attn_output.weight"), latentHeads(t, q, k, v, w, sparse))

/**
 * Latent attention over every sequence of the batch, each head's latent decompressed (attn_v_b), before attn_output
 * (kimi-k3 gates it first): [headDimV_mla x nHead, n]. q: [width, nHead, n], k: [width, 1, n].
 */
export const latentHeads = (t: Toolkit, q: Ptr, k: Ptr, v: Ptr, w: BlockWeights, sparse: SparseMask | null): Ptr => {
  const g = t.g
  const hp = t.hp
  const mla = mlaOf(hp)
  const width = hp.headDimK
  const wvB = w.get("attn_v_b.weight")
  // same expansion order as llama.cpp's build_attn: q, v, k, then the cache writes
  g.ggml_build_forward_expand(t.graph, q)
  g.ggml_build_forward_expand(t.graph, v)
  g.ggml_build_forward_expand(t.graph, k)
  return t.perSequence(
    mla.headDimV * hp.nHead,
    [{ x: q, ne0: width, ne1: hp.nHead }, { x: k, ne0: width, ne1: 1 }, ...(sparse?.parts ?? [])],
    (seg, [qs, ks, ...rest]) =>
      attendLatent(t, seg, qs!, ks!, wvB, hp.kqScale, sparse === null ? null : (s) => sparse.maskOf(s, rest))
  )
}

/**
 * One latent-attention block: residual stream in, out. `sparse` (DSA, archs/dsa.ts) gets the block's normed input
 * and its normed Q latent (attn_q_a_norm's output) and returns the mask each sequence's attention reads through.
 */
export const mlaBlock = (
  t: Toolkit,
  w: BlockWeights,
  x: Ptr,
  sparse: ((h: Ptr, qr: Ptr) => SparseMask) | null = null
): Ptr => {
  const g = t.g
  const ctx = t.ctx
  const hp = t.hp
  const mla = mlaOf(hp)
  const n = t.nTokens
  const nRot = hp.nRot
  const nope = mla.headDimK - nRot
  const h = t.rmsNorm(x, w.get("attn_norm.weight"))
  let mask: SparseMask | null = null
  let qFlat: Ptr
  if (mla.qLoraRank > 0) {
    const qr = t.rmsNorm(t.linear(w.get("attn_q_a.weight"), h), w.get("attn_q_a_norm.weight"))
    mask = sparse?.(h, qr) ?? null
    qFlat = t.linear(w.get("attn_q_b.weight"), qr)
  } else qFlat = t.linear(w.get("attn_q.weight"), h)
  const q = g.ggml_reshape_3d(ctx, qFlat, mla.headDimK, hp.nHead, n)
  const kvPe = t.linear(w.get("attn_kv_a_mqa.weight"), h)
  const f32 = (ne: number) => g.ggml_row_size(GgmlType.F32, ne)
  const kvRow = f32(mla.kvLoraRank + nRot)
  const kvLatent = g.ggml_view_2d(ctx, kvPe, mla.kvLoraRank, n, kvRow, 0)
  const kPe = t.rope(g.ggml_view_3d(ctx, kvPe, nRot, 1, n, kvRow, kvRow, f32(mla.kvLoraRank)))
  const latent = t.rmsNorm(kvLatent, w.get("attn_kv_a_norm.weight"))
  const qRow = f32(mla.headDimK)
  const qNope = g.ggml_view_3d(ctx, q, nope, hp.nHead, n, qRow, qRow * hp.nHead, 0)
  const qPe = t.rope(g.ggml_view_3d(ctx, q, nRot, hp.nHead, n, qRow, qRow * hp.nHead, f32(nope)))
  // [nope, n, nHead] x attn_k_b [nope, kv_lora_rank, nHead] -> [kv_lora_rank, n, nHead] -> [kv_lora_rank, nHead, n]
  const absorbed = g.ggml_permute(
    ctx,
    g.ggml_mul_mat(ctx, w.get("attn_k_b.weight"), g.ggml_permute(ctx, qNope, 0, 2, 1, 3)),
    0,
    2,
    1,
    3
  )
  const qCur = g.ggml_concat(ctx, absorbed, qPe, 0)
  const latent3 = g.ggml_reshape_3d(ctx, latent, mla.kvLoraRank, 1, n)
  const kCur = g.ggml_concat(ctx, latent3, kPe, 0)
  const att = latentAttention(t, qCur, kCur, latent3, w, mask)
  const ffnIn = t.add(t.outputRows(att), t.outputRows(x))
  const normed = t.rmsNorm(ffnIn, w.get("ffn_norm.weight"))
  const moe = moeOf(hp)
  const ffn =
    t.layer < moe.nLeadingDense ? t.ffnSwiglu(normed, w) : moeFfn(t, w, normed, moe, w.opt("exp_probs_b.bias"))
  return t.add(ffn, ffnIn)
}

export const deepseek2: ArchModule = {
  name: "deepseek2",
  ropeMode: RopeMode.NORM,
  ownHeadShape: true,
  hparams: (file, hp) => readMlaModel(file, hp, "deepseek2"),
  blockTensors: mlaBlockSpecs,
  buildOutput: llamaOutputHead,
  buildBlock: (t: Toolkit, w: BlockWeights, x: Ptr) => mlaBlock(t, w, x)
}
