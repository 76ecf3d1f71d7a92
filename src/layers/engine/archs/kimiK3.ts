/**
 * kimi-k3 (Kimi K3; llama.cpp src/models/kimi-k3.cpp on kimi-linear.cpp's skeleton): KDA (linear, recurrent) blocks
 * and MLA blocks, the pattern in `attention.head_count_kv` (0 marks a KDA block).
 *
 * - Attention residuals (`attn_res.block_size` > 0): every block il with il % size === 0 banks its raw input on a
 *   stack; before its attention and before its feed-forward every block reads a softmax mix of the stack and the
 *   current stream (scores: rms_norm(row) . attn_res_score / ffn_res_score, one per checkpoint and one for the stream;
 *   ggml_dsv4_hc_pre sums the stack). On a banking block the stream restarts from the attention output alone. The
 *   output head mixes once more (output_res_score). What crosses a stage boundary is the stream then every checkpoint
 *   banked before it, n_embd x (1 + checkpoints) floats a token (PerLayerInputs.activationWidth).
 * - KDA: q, k, v each projected then convolved causally (ggml_ssm_conv, conv_kernel taps, the sequence's conv state)
 *   through SiLU, q and k l2-normed; a per-dimension decay gate from ssm_f_b(ssm_f_a x) + ssm_dt.bias, either
 *   lowerBound x sigmoid(exp(A_log) x (...)) (`kda.gate_lower_bound` set) or -exp(A_log) x softplus(...); beta =
 *   sigmoid(ssm_beta x); ggml_gated_delta_net with the vector gate from the sequence's head_dim^2 x heads state; its
 *   output RMS-normed per head (ssm_norm) times sigmoid(ssm_g x) (K3's full-rank gate), then attn_output.
 * - MLA: deepseek2's absorbed latent attention without RoPE (K3 is nope-only; the shared part of K is passed as is),
 *   its output times sigmoid(attn_gate h) before attn_output.
 * - Feed-forward: the situ activation (Moe.situ) everywhere; `leading_dense_block_count` dense blocks, the rest a
 *   latent MoE: the router scores the full-width input, the routed experts run at `expert_latent_length` between
 *   ffn_routed_down and ffn_routed_up (ffn_routed_norm between), the shared experts at full width.
 */
import { Effect } from "effect"
import type { GgufFile, ModelLoadError } from "../../../domain/gguf.js"
import { getGgml, GgmlType, type Ptr } from "../../ggml/Bindings.js"
import { getF32, getNumberArray, getOptional, getU32 } from "../../gguf/GgufReader.js"
import type { ArchModule, OutputWeights } from "../Arch.js"
import { type HParams, type KimiParams, RopeMode, checkpointsBefore } from "../HParams.js"
import { invalidMetadata } from "../MetadataErrors.js"
import { moeOf, routedExperts, situ, type SituBetas } from "../Moe.js"
import type { RecurrentParams } from "../RecurrentParams.js"
import { type BlockWeights, type TensorSpec, type Toolkit, type StateSnapshots } from "../Toolkit.js"
import { latentHeads, readMlaModel } from "./deepseek2.js"
import { expandBlockInputs } from "./qwen35.js"
import { snapshotConv, snapshotStates } from "../RecurrentSnapshots.js"

const kimiOf = (hp: HParams): KimiParams => {
  if (hp.kimi === undefined) throw new Error("kimi-k3 hyperparameters were not read")
  return hp.kimi
}

/** K3's own keys: KDA sizes and pattern, the situ betas, the residual block size, the latent width. */
const readKimi = (file: GgufFile, hp: HParams): Effect.Effect<HParams, ModelLoadError> =>
  Effect.gen(function* () {
    const k = (s: string) => `${hp.arch}.${s}`
    const refuse = (key: string, message: string) => Effect.fail(invalidMetadata(file, k(key), message))
    const convKernel = yield* getU32(file, k("ssm.conv_kernel"))
    if (convKernel < 2) return yield* refuse("ssm.conv_kernel", `= ${convKernel} must be at least 2`)
    const headDim = yield* getU32(file, k("kda.head_dim"))
    if (!(headDim > 0)) return yield* refuse("kda.head_dim", `= ${headDim} must be > 0`)
    const kvHeads = yield* getNumberArray(file, k("attention.head_count_kv"))
    const resBlockSize = yield* getU32(file, k("attn_res.block_size"))
    const situBeta = yield* getF32(file, k("activation.situ_beta"))
    if (!(situBeta > 0 && Number.isFinite(situBeta))) {
      return yield* refuse("activation.situ_beta", `= ${situBeta} must be > 0`)
    }
    const situLinearBeta = yield* getF32(file, k("activation.situ_linear_beta"))
    const latent = (yield* getOptional(file, k("expert_latent_length"), getU32)) ?? 0
    const gateLowerBound = (yield* getOptional(file, k("kda.gate_lower_bound"), getF32)) ?? -Infinity
    const recurrent: RecurrentParams = {
      layers: kvHeads.map((n) => n === 0),
      convKernel,
      convDim: 3 * headDim * hp.nHead,
      stateSize: headDim,
      kHeads: hp.nHead,
      vHeads: hp.nHead
    }
    const kimi: KimiParams = {
      resBlockSize,
      situBeta,
      situLinearBeta,
      gateLowerBound,
      latent: latent > 0 ? latent : hp.nEmbd
    }
    return { ...hp, recurrent, kimi }
  })

/** The MLA hyperparameters as deepseek2 reads them (latent sizes, routing), then K3's. */
const kimiHParams = (file: GgufFile, hp: HParams): Effect.Effect<HParams, ModelLoadError> =>
  Effect.gen(function* () {
    const mla = yield* readMlaModel(file, hp, "deepseek2")
    return yield* readKimi(file, mla)
  })

const matrix = (name: string, dims: ReadonlyArray<number>): TensorSpec => ({
  name,
  dims,
  kind: "matrix",
  required: true
})
const vector = (name: string, n: number, required = true): TensorSpec => ({ name, dims: [n], kind: "vector", required })

/** A KDA block's mixer tensors. */
const kdaSpecs = (hp: HParams): ReadonlyArray<TensorSpec> => {
  const r = hp.recurrent!
  const hd = r.stateSize
  const inner = hd * hp.nHead
  const e = hp.nEmbd
  return [
    ...["q", "k", "v"].map((x) => ({ ...vector(`ssm_conv1d_${x}.weight`, 0), dims: [r.convKernel, 1, inner] })),
    matrix("attn_q.weight", [e, inner]),
    matrix("attn_k.weight", [e, inner]),
    matrix("attn_v.weight", [e, inner]),
    matrix("ssm_f_a.weight", [e, hd]),
    matrix("ssm_f_b.weight", [hd, inner]),
    matrix("ssm_beta.weight", [e, hp.nHead]),
    vector("ssm_a", hp.nHead),
    vector("ssm_dt.bias", inner),
    matrix("ssm_g.weight", [e, inner]),
    vector("ssm_norm.weight", hd),
    matrix("attn_output.weight", [inner, e])
  ]
}

/** An MLA block's mixer tensors (nope-only, the output gate). */
const mlaSpecs = (hp: HParams): ReadonlyArray<TensorSpec> => {
  const mla = hp.mla!
  const e = hp.nEmbd
  const q =
    mla.qLoraRank > 0
      ? [
          vector("attn_q_a_norm.weight", mla.qLoraRank),
          matrix("attn_q_a.weight", [e, mla.qLoraRank]),
          matrix("attn_q_b.weight", [mla.qLoraRank, hp.nHead * mla.headDimK])
        ]
      : [matrix("attn_q.weight", [e, hp.nHead * mla.headDimK])]
  return [
    ...q,
    vector("attn_kv_a_norm.weight", mla.kvLoraRank),
    matrix("attn_kv_a_mqa.weight", [e, mla.kvLoraRank + hp.nRot]),
    matrix("attn_k_b.weight", [mla.headDimK - hp.nRot, mla.kvLoraRank, hp.nHead]),
    matrix("attn_v_b.weight", [mla.kvLoraRank, mla.headDimV, hp.nHead]),
    { ...matrix("attn_gate.weight", [e, hp.nHead * mla.headDimV]), required: false },
    matrix("attn_output.weight", [hp.nHead * mla.headDimV, e])
  ]
}

/** The feed-forward's tensors: dense situ, or the latent MoE with its shared experts. */
const ffnSpecs = (hp: HParams, il: number): ReadonlyArray<TensorSpec> => {
  const moe = moeOf(hp)
  const e = hp.nEmbd
  if (il < moe.nLeadingDense) {
    return [
      matrix("ffn_gate.weight", [e, hp.nFf]),
      matrix("ffn_up.weight", [e, hp.nFf]),
      matrix("ffn_down.weight", [hp.nFf, e])
    ]
  }
  const lat = kimiOf(hp).latent
  const f = moe.nFfExp
  const routed = (name: string, dims: ReadonlyArray<number>): TensorSpec => ({
    ...matrix(name, dims),
    product: "mul_mat_id"
  })
  const latent =
    lat === e
      ? []
      : [
          matrix("ffn_routed_down.weight", [e, lat]),
          matrix("ffn_routed_up.weight", [lat, e]),
          vector("ffn_routed_norm.weight", lat, false)
        ]
  const shared =
    moe.nFfShared > 0
      ? [
          matrix("ffn_gate_shexp.weight", [e, moe.nFfShared]),
          matrix("ffn_up_shexp.weight", [e, moe.nFfShared]),
          matrix("ffn_down_shexp.weight", [moe.nFfShared, e])
        ]
      : []
  return [
    matrix("ffn_gate_inp.weight", [e, moe.nExpert]),
    vector("exp_probs_b.bias", moe.nExpert),
    routed("ffn_gate_exps.weight", [lat, f, moe.nExpert]),
    routed("ffn_up_exps.weight", [lat, f, moe.nExpert]),
    routed("ffn_down_exps.weight", [f, lat, moe.nExpert]),
    ...latent,
    ...shared
  ]
}

const blockTensors = (hp: HParams, il: number): ReadonlyArray<TensorSpec> => [
  vector("attn_norm.weight", hp.nEmbd),
  vector("ffn_norm.weight", hp.nEmbd),
  ...(kimiOf(hp).resBlockSize > 0
    ? [vector("attn_res_score.weight", hp.nEmbd), vector("ffn_res_score.weight", hp.nEmbd)]
    : []),
  ...(hp.recurrent!.layers[il] === true ? kdaSpecs(hp) : mlaSpecs(hp)),
  ...ffnSpecs(hp, il)
]

const f32 = (n: number) => 4 * n

/** One KDA projection of x (0 q, 1 k, 2 v) convolved over its third of the conv state, through SiLU: [hd, H, n, 1]. */
const kdaConv = (
  t: Toolkit,
  w: BlockWeights,
  h: Ptr,
  n: number,
  conv: Ptr,
  which: number,
  snaps: StateSnapshots | undefined
): Ptr => {
  const g = t.g
  const ctx = t.ctx
  const r = t.hp.recurrent!
  const K = r.convKernel
  const inner = r.stateSize * t.hp.nHead
  const name = ["q", "k", "v"][which]!
  const state = g.ggml_view_3d(
    ctx,
    conv,
    K - 1,
    inner,
    1,
    f32(K - 1),
    f32(3 * (K - 1) * inner),
    f32(which * (K - 1) * inner)
  )
  const proj = t.linear(w.get(`attn_${name}.weight`), h)
  const convIn = g.ggml_concat(ctx, state, g.ggml_transpose(ctx, g.ggml_reshape_3d(ctx, proj, inner, n, 1)), 0)
  const width = K - 1 + n
  const last = g.ggml_view_3d(ctx, convIn, K - 1, inner, 1, f32(width), f32(width * inner), f32(n))
  g.ggml_build_forward_expand(t.graph, g.ggml_cpy(ctx, last, state))
  if (snaps !== undefined) snapshotConv(t, snaps, convIn, n, K - 1, inner, which * (K - 1) * inner)
  const weight = g.ggml_reshape_2d(ctx, w.get(`ssm_conv1d_${name}.weight`), K, inner)
  const out = g.ggml_silu(ctx, g.ggml_reshape_2d(ctx, g.ggml_ssm_conv(ctx, convIn, weight), inner, n))
  return g.ggml_reshape_4d(ctx, out, r.stateSize, t.hp.nHead, n, 1)
}

/** The KDA decay gate per dimension: [hd, H, n, 1]. */
const kdaGate = (t: Toolkit, w: BlockWeights, h: Ptr, n: number): Ptr => {
  const g = t.g
  const ctx = t.ctx
  const hd = t.hp.recurrent!.stateSize
  const H = t.hp.nHead
  const bound = kimiOf(t.hp).gateLowerBound
  let g1 = g.ggml_add(
    ctx,
    t.linear(w.get("ssm_f_b.weight"), t.linear(w.get("ssm_f_a.weight"), h)),
    w.get("ssm_dt.bias")
  )
  const A = g.ggml_reshape_3d(ctx, w.get("ssm_a"), 1, H, 1)
  if (bound > -Infinity) {
    // ssm_a holds -exp(A_log): lowerBound x sigmoid(exp(A_log) x (...))
    g1 = g.ggml_mul(ctx, g.ggml_reshape_3d(ctx, g1, hd, H, n), A)
    g1 = g.ggml_scale(ctx, g.ggml_sigmoid(ctx, g.ggml_scale(ctx, g1, -1)), bound)
  } else {
    g1 = g.ggml_mul(ctx, g.ggml_reshape_3d(ctx, g.ggml_softplus(ctx, g1), hd, H, n), A)
  }
  return g.ggml_reshape_4d(ctx, g1, hd, H, n, 1)
}

/** One sequence's KDA over its rows h [nEmbd, n] and its state (conv, ssm): [nEmbd, n]. */
const kdaSegment = (
  t: Toolkit,
  w: BlockWeights,
  h: Ptr,
  n: number,
  st: { readonly conv: Ptr; readonly ssm: Ptr; readonly snaps: StateSnapshots | undefined }
): Ptr => {
  const g = t.g
  const ctx = t.ctx
  const { conv, ssm, snaps } = st
  const hd = t.hp.recurrent!.stateSize
  const H = t.hp.nHead
  const q = kdaConv(t, w, h, n, conv, 0, snaps)
  const k = kdaConv(t, w, h, n, conv, 1, snaps)
  const v = kdaConv(t, w, h, n, conv, 2, snaps)
  const gate = kdaGate(t, w, h, n)
  const beta = g.ggml_sigmoid(ctx, g.ggml_reshape_4d(ctx, t.linear(w.get("ssm_beta.weight"), h), 1, H, n, 1))
  const state = g.ggml_reshape_4d(ctx, ssm, hd, hd, H, 1)
  const eps = t.hp.rmsEps
  const result = g.ggml_gated_delta_net(
    ctx,
    g.ggml_l2_norm(ctx, q, eps),
    g.ggml_l2_norm(ctx, k, eps),
    v,
    gate,
    beta,
    state,
    // a verify step keeps the state after each row (n snapshot slots, the last row's first)
    snaps === undefined ? 1 : n
  )
  if (snaps !== undefined) snapshotStates(t, snaps, result, hd * H * n, n)
  const out = g.ggml_cont(ctx, g.ggml_view_4d(ctx, result, hd, H, n, 1, f32(hd), f32(hd * H), f32(hd * H * n), 0))
  const newState = g.ggml_view_1d(ctx, result, hd * hd * H, f32(hd * H * n))
  g.ggml_build_forward_expand(t.graph, g.ggml_cpy(ctx, newState, ssm))
  const g2 = g.ggml_reshape_3d(ctx, t.linear(w.get("ssm_g.weight"), h), hd, H, n)
  const normed = t.rmsNorm(g.ggml_reshape_3d(ctx, out, hd, H, n), w.get("ssm_norm.weight"))
  const gated = g.ggml_cont_2d(ctx, g.ggml_mul(ctx, normed, g.ggml_sigmoid(ctx, g2)), hd * H, n)
  return t.linear(w.get("attn_output.weight"), gated)
}

/** KDA over every sequence of the batch, each from and into its own state: [nEmbd, nTokens]. */
const kda = (t: Toolkit, w: BlockWeights, h: Ptr): Ptr => {
  const g = t.g
  const segments = t.inputs.segments
  const nb1 = g.ggml_row_size(GgmlType.F32, t.hp.nEmbd)
  let out: Ptr | null = null
  for (const seg of segments) {
    const rows = segments.length === 1 ? h : g.ggml_view_2d(t.ctx, h, t.hp.nEmbd, seg.n, nb1, seg.offset * nb1)
    const state = seg.kv(t.layer)
    const y = kdaSegment(t, w, rows, seg.n, { conv: state.k, ssm: state.v, snaps: seg.snapshots?.(t.layer) })
    out = out === null ? y : g.ggml_concat(t.ctx, out, y, 1)
  }
  return out!
}

/** K3's MLA (nope-only) over the normed input h: the heads' output times sigmoid(attn_gate h), then attn_output. */
const mla = (t: Toolkit, w: BlockWeights, h: Ptr): Ptr => {
  const g = t.g
  const ctx = t.ctx
  const hp = t.hp
  const p = hp.mla!
  const n = t.nTokens
  const nRot = hp.nRot
  const nope = p.headDimK - nRot
  const qFlat =
    p.qLoraRank > 0
      ? t.linear(
          w.get("attn_q_b.weight"),
          t.rmsNorm(t.linear(w.get("attn_q_a.weight"), h), w.get("attn_q_a_norm.weight"))
        )
      : t.linear(w.get("attn_q.weight"), h)
  const q = g.ggml_reshape_3d(ctx, qFlat, p.headDimK, hp.nHead, n)
  const kvPe = t.linear(w.get("attn_kv_a_mqa.weight"), h)
  const kvRow = f32(p.kvLoraRank + nRot)
  const kPe = g.ggml_view_3d(ctx, kvPe, nRot, 1, n, kvRow, kvRow, f32(p.kvLoraRank))
  const latent = t.rmsNorm(g.ggml_view_2d(ctx, kvPe, p.kvLoraRank, n, kvRow, 0), w.get("attn_kv_a_norm.weight"))
  const qRow = f32(p.headDimK)
  const qNope = g.ggml_view_3d(ctx, q, nope, hp.nHead, n, qRow, qRow * hp.nHead, 0)
  const qPe = g.ggml_view_3d(ctx, q, nRot, hp.nHead, n, qRow, qRow * hp.nHead, f32(nope))
  const absorbed = g.ggml_permute(
    ctx,
    g.ggml_mul_mat(ctx, w.get("attn_k_b.weight"), g.ggml_permute(ctx, qNope, 0, 2, 1, 3)),
    0,
    2,
    1,
    3
  )
  const latent3 = g.ggml_reshape_3d(ctx, latent, p.kvLoraRank, 1, n)
  const heads = latentHeads(
    t,
    g.ggml_concat(ctx, absorbed, qPe, 0),
    g.ggml_concat(ctx, latent3, kPe, 0),
    latent3,
    w,
    null
  )
  const gate = w.opt("attn_gate.weight")
  const gated = gate === null ? heads : g.ggml_mul(ctx, heads, g.ggml_sigmoid(ctx, t.linear(gate, h)))
  return t.linear(w.get("attn_output.weight"), gated)
}

/** The feed-forward over the normed rows x: dense situ, or the latent MoE plus the shared experts. */
const ffn = (t: Toolkit, w: BlockWeights, x: Ptr): Ptr => {
  const hp = t.hp
  const k = kimiOf(hp)
  const betas: SituBetas = { beta: k.situBeta, linearBeta: k.situLinearBeta }
  const dense = (prefix: string) =>
    t.linear(
      w.get(`ffn_down${prefix}.weight`),
      situ(t, t.linear(w.get(`ffn_gate${prefix}.weight`), x), t.linear(w.get(`ffn_up${prefix}.weight`), x), betas)
    )
  const moe = moeOf(hp)
  if (t.layer < moe.nLeadingDense) return dense("")
  const down = w.opt("ffn_routed_down.weight")
  const routedIn = down === null ? x : t.linear(down, x)
  const logits = t.linear(w.get("ffn_gate_inp.weight"), x)
  let out = routedExperts(t, w, routedIn, moe, w.get("exp_probs_b.bias"), { logits, situ: betas })
  const norm = w.opt("ffn_routed_norm.weight")
  if (norm !== null) out = t.rmsNorm(out, norm)
  const up = w.opt("ffn_routed_up.weight")
  if (up !== null) out = t.linear(up, out)
  return moe.nFfShared > 0 ? t.g.ggml_add(t.ctx, out, dense("_shexp")) : out
}

/**
 * llama.cpp's res_mix: the current stream `cur` [nEmbd, n] and the checkpoints `stack` [nEmbd, c, n] (null: none
 * banked, `cur` as is) mixed by a softmax over their scores rms_norm(row) . score: [nEmbd, n].
 */
const resMix = (t: Toolkit, cur: Ptr, stack: Ptr | null, score: Ptr): Ptr => {
  if (stack === null) return cur
  const g = t.g
  const ctx = t.ctx
  const n = getGgml().tensorShape(cur).ne[1]!
  const c = getGgml().tensorShape(stack).ne[1]!
  const eps = t.hp.rmsEps
  const scored = (x: Ptr) => g.ggml_sum_rows(ctx, g.ggml_mul(ctx, g.ggml_rms_norm(ctx, x, eps), score))
  const scores = g.ggml_concat(ctx, g.ggml_reshape_2d(ctx, scored(stack), c, n), scored(cur), 0) // [c + 1, n]
  const probs = g.ggml_soft_max(ctx, scores)
  const row = f32(c + 1)
  const pStack = g.ggml_cont(ctx, g.ggml_view_2d(ctx, probs, c, n, row, 0))
  const pCur = g.ggml_cont(ctx, g.ggml_view_2d(ctx, probs, 1, n, row, f32(c)))
  return g.ggml_add(ctx, g.ggml_dsv4_hc_pre(ctx, stack, pStack), g.ggml_mul(ctx, cur, pCur))
}

/** The packed activation [nEmbd x (1 + c), n] as the stream [nEmbd, n] and the checkpoints [nEmbd, c, n] (or null). */
const unpack = (t: Toolkit, x: Ptr, c: number): { readonly stream: Ptr; readonly stack: Ptr | null } => {
  if (c === 0) return { stream: x, stack: null }
  const g = t.g
  const ctx = t.ctx
  const e = t.hp.nEmbd
  const n = getGgml().tensorShape(x).ne[1]!
  const x3 = g.ggml_reshape_3d(ctx, x, e, 1 + c, n)
  const token = f32(e * (1 + c))
  const stream = g.ggml_cont(ctx, g.ggml_view_2d(ctx, x3, e, n, token, 0))
  const stack = g.ggml_cont(ctx, g.ggml_view_3d(ctx, x3, e, c, n, f32(e), token, f32(e)))
  return { stream, stack }
}

/** The stream then the checkpoints, one row a token: [nEmbd x (1 + c), n]. */
const pack = (t: Toolkit, stream: Ptr, stack: Ptr | null): Ptr => {
  if (stack === null) return stream
  const g = t.g
  const ctx = t.ctx
  const [e, n] = getGgml().tensorShape(stream).ne as [number, number]
  const c = getGgml().tensorShape(stack).ne[1]!
  const both = g.ggml_concat(ctx, g.ggml_reshape_3d(ctx, stream, e, 1, n), stack, 1)
  return g.ggml_reshape_2d(ctx, both, e * (1 + c), n)
}

/** One block: the packed activation in, out (one more checkpoint on a banking block). */
const buildBlock = (t: Toolkit, w: BlockWeights, x: Ptr): Ptr => {
  const g = t.g
  const ctx = t.ctx
  const size = kimiOf(t.hp).resBlockSize
  const { stream, stack } = unpack(t, x, checkpointsBefore(t.hp, t.layer))
  const mixed = size > 0 ? resMix(t, stream, stack, w.get("attn_res_score.weight")) : stream
  const banks = size > 0 && t.layer % size === 0
  const e = t.hp.nEmbd
  const n = t.nTokens
  const bank = !banks
    ? stack
    : stack === null
      ? g.ggml_reshape_3d(ctx, stream, e, 1, n)
      : g.ggml_concat(ctx, stack, g.ggml_reshape_3d(ctx, stream, e, 1, n), 1)
  const h = t.rmsNorm(mixed, w.get("attn_norm.weight"))
  expandBlockInputs(t, h)
  // K3's MLA reads no positions (no RoPE), but Forward sets them on every call: a stage of MLA blocks expands them too
  g.ggml_build_forward_expand(t.graph, t.inputs.pos)
  const att = t.hp.recurrent!.layers[t.layer] === true ? kda(t, w, h) : mla(t, w, h)
  const prefix = banks ? att : g.ggml_add(ctx, stream, att)
  const ffnIn = size > 0 ? resMix(t, prefix, bank, w.get("ffn_res_score.weight")) : prefix
  const out = g.ggml_add(ctx, prefix, ffn(t, w, t.rmsNorm(ffnIn, w.get("ffn_norm.weight"))))
  return pack(t, out, bank)
}

/** The output head: the last mix (output_res_score), the output rows, output_norm, output. */
const buildOutput = (t: Toolkit, w: OutputWeights, x: Ptr): Ptr => {
  const { stream, stack } = unpack(t, x, checkpointsBefore(t.hp, t.hp.nLayer))
  const score = w.opt("output_res_score.weight")
  const mixed = score === null ? stream : resMix(t, stream, stack, score)
  const rows = t.outputRows(mixed)
  return t.linear(w.get("output.weight"), t.rmsNorm(rows, w.get("output_norm.weight")))
}

export const kimiK3: ArchModule = {
  name: "kimi-k3",
  ropeMode: RopeMode.NORM,
  ownHeadShape: true,
  recurrentKvZero: true,
  hparams: kimiHParams,
  blockTensors,
  outputTensors: (hp) => (kimiOf(hp).resBlockSize > 0 ? [vector("output_res_score.weight", hp.nEmbd)] : []),
  buildOutput,
  buildBlock
}
