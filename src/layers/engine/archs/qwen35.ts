/**
 * qwen35 (llama.cpp src/models/qwen35.cpp, delta-net-base.cpp): Qwen3.5's hybrid stack. Every block: RMS norm, then
 * a gated DeltaNet linear attention (recurrent blocks) or a gated full attention, the residual, post_attention_norm,
 * a SiLU-gated feed-forward, the residual.
 *
 * Full attention: attn_q gives each head's query and output gate; RMS norms on q and k; RoPE over the first nRot
 * dimensions of each head; flash attention; the output times sigmoid(gate) before attn_output. llama.cpp rotates
 * with IMROPE (`rope.dimension_sections`) and text positions equal in the t, h and w components: that is NEOX over
 * nRot when every section index falls in t, h or w (checked), so ggml_rope_ext NEOX is used.
 *
 * DeltaNet: attn_qkv's output convolved causally (ggml_ssm_conv, conv_kernel taps, the previous conv_kernel - 1
 * inputs from the sequence's conv state) through SiLU into q, k (l2-normed) and v; beta = sigmoid(ssm_beta x), the
 * decay g = softplus(ssm_alpha x + ssm_dt) * ssm_a; ggml_gated_delta_net (llama.cpp's fused path) from the
 * sequence's S x S x Hv state; its output RMS-normed by ssm_norm times silu(attn_gate x), then ssm_out. Both
 * states are read and written in the graph (KvCache.ts holds them per session: k = conv state, v = SSM state).
 *
 * MTP blocks (`nextn_predict_layers` > 0: a full-attention block plus nextn.* tensors after the trunk, as current
 * converters write Qwen3.5/3.6) are left out, as llama.cpp decodes: the model's blocks are the trunk (TrunkBlocks.ts).
 */
import { Effect } from "effect"
import type { GgufFile, ModelLoadError } from "../../../domain/gguf.js"
import { GgmlType, type Ptr } from "../../ggml/Bindings.js"
import { getNumberArray, getOptional, getU32 } from "../../gguf/GgufReader.js"
import { trunkBlockCount } from "../../gguf/TrunkBlocks.js"
import type { ArchModule } from "../Arch.js"
import { type HParams, RopeMode } from "../HParams.js"
import type { RecurrentParams } from "../RecurrentParams.js"
import { type BlockWeights, llamaOutputHead, type TensorSpec, type Toolkit, type StateSnapshots } from "../Toolkit.js"
import { invalidMetadata } from "../MetadataErrors.js"
import { snapshotConv, snapshotStates } from "../RecurrentSnapshots.js"

/** ggml's IMROPE sector assignment: does every rotated pair take the t, h or w position (never the 4th, e)? */
const sectionsCoverText = (sections: ReadonlyArray<number>, nRot: number): boolean => {
  const total = sections.reduce((a, b) => a + b, 0)
  if (total <= 0) return false
  for (let i = 0; i < nRot / 2; i++) {
    const s = i % total
    const text =
      (s % 3 === 1 && s < 3 * sections[1]!) ||
      (s % 3 === 2 && s < 3 * sections[2]!) ||
      (s % 3 === 0 && s < 3 * sections[0]!)
    if (!text) return false
  }
  return true
}

/** qwen35's hyperparameters (IMROPE sections, the DeltaNet sizes and block pattern), checked; qwen35moe reads them too. */
export const qwen35HParams = (file: GgufFile, hp: HParams): Effect.Effect<HParams, ModelLoadError> =>
  Effect.gen(function* () {
    const k = (s: string) => `${hp.arch}.${s}`
    const refuse = (key: string, message: string) => Effect.fail(invalidMetadata(file, k(key), message))
    const u32 = (key: string) =>
      Effect.gen(function* () {
        const v = yield* getOptional(file, k(key), getU32)
        if (v === undefined) return yield* refuse(key, "is missing")
        if (!(v > 0)) return yield* refuse(key, `= ${v} must be > 0`)
        return v
      })
    if (hp.headDimV !== hp.headDimK) {
      return yield* refuse("attention.value_length", `= ${hp.headDimV} must equal key_length = ${hp.headDimK}`)
    }
    if (!(hp.nRot > 0 && hp.nRot % 2 === 0 && hp.nRot <= hp.headDimK)) {
      return yield* refuse("rope.dimension_count", `= ${hp.nRot} must be even and at most the head size ${hp.headDimK}`)
    }
    const sections = yield* getOptional(file, k("rope.dimension_sections"), getNumberArray)
    if (sections === undefined || sections.length !== 4 || sections.some((s) => !(Number.isSafeInteger(s) && s >= 0))) {
      return yield* refuse("rope.dimension_sections", "must be 4 non-negative integers")
    }
    if (!sectionsCoverText(sections, hp.nRot)) {
      return yield* refuse(
        "rope.dimension_sections",
        `= [${sections.join(", ")}] leaves rotated dimensions on the 4th position component (not supported)`
      )
    }
    if (file.metadata.has(k("attention.recurrent_layers"))) {
      return yield* refuse("attention.recurrent_layers", "is not supported (full_attention_interval only)")
    }
    // MTP blocks (`nextn_predict_layers`, Qwen3.5/3.6 files carry one) trail the trunk: llama.cpp decodes without
    // them (n_layer() = block_count - nextn) and marks them non-recurrent; the stages, the block pattern and the
    // recurrent state cover the trunk only and never load those blocks' tensors
    const nLayer = yield* trunkBlockCount(file, hp.arch)
    const convKernel = yield* u32("ssm.conv_kernel")
    if (convKernel < 2) return yield* refuse("ssm.conv_kernel", `= ${convKernel} must be at least 2`)
    const inner = yield* u32("ssm.inner_size")
    const stateSize = yield* u32("ssm.state_size")
    const vHeads = yield* u32("ssm.time_step_rank")
    const kHeads = yield* u32("ssm.group_count")
    if (vHeads % kHeads !== 0) {
      return yield* refuse(
        "ssm.time_step_rank",
        `= ${vHeads} must be a multiple of ${k("ssm.group_count")} = ${kHeads}`
      )
    }
    if (inner !== stateSize * vHeads) {
      return yield* refuse(
        "ssm.inner_size",
        `= ${inner} must be ssm.state_size x ssm.time_step_rank = ${stateSize * vHeads}`
      )
    }
    const interval = (yield* getOptional(file, k("full_attention_interval"), getU32)) ?? 4
    if (!(interval > 0)) return yield* refuse("full_attention_interval", `= ${interval} must be > 0`)
    const recurrent: RecurrentParams = {
      layers: Array.from({ length: nLayer }, (_, il) => (il + 1) % interval !== 0),
      convKernel,
      convDim: 2 * stateSize * kHeads + stateSize * vHeads,
      stateSize,
      kHeads,
      vHeads
    }
    return { ...hp, nLayer, recurrent }
  })

/** A block's tensors but its feed-forward: the two norms, then the DeltaNet's or the gated attention's (qwen35moe too). */
export const qwen35MixerTensors = (hp: HParams, il: number): ReadonlyArray<TensorSpec> => {
  const m = (name: string, dims: ReadonlyArray<number>): TensorSpec => ({ name, dims, kind: "matrix", required: true })
  const vec = (name: string, dims: ReadonlyArray<number>): TensorSpec => ({
    name,
    dims,
    kind: "vector",
    required: true
  })
  const e = hp.nEmbd
  const common = [vec("attn_norm.weight", [e]), vec("post_attention_norm.weight", [e])]
  const r = hp.recurrent!
  if (r.layers[il] === true) {
    const value = r.stateSize * r.vHeads
    return [
      ...common,
      m("attn_qkv.weight", [e, r.convDim]),
      m("attn_gate.weight", [e, value]),
      vec("ssm_conv1d.weight", [r.convKernel, r.convDim]),
      vec("ssm_dt.bias", [r.vHeads]),
      vec("ssm_a", [r.vHeads]),
      m("ssm_beta.weight", [e, r.vHeads]),
      m("ssm_alpha.weight", [e, r.vHeads]),
      vec("ssm_norm.weight", [r.stateSize]),
      m("ssm_out.weight", [value, e])
    ]
  }
  const hd = hp.headDimK
  return [
    ...common,
    m("attn_q.weight", [e, hd * hp.nHead * 2]),
    m("attn_k.weight", [e, hd * hp.nHeadKv]),
    m("attn_v.weight", [e, hd * hp.nHeadKv]),
    vec("attn_q_norm.weight", [hd]),
    vec("attn_k_norm.weight", [hd]),
    m("attn_output.weight", [hd * hp.nHead, e])
  ]
}

const blockTensors = (hp: HParams, il: number): ReadonlyArray<TensorSpec> => {
  const m = (name: string, dims: ReadonlyArray<number>): TensorSpec => ({ name, dims, kind: "matrix", required: true })
  return [
    ...qwen35MixerTensors(hp, il),
    m("ffn_gate.weight", [hp.nEmbd, hp.nFf]),
    m("ffn_up.weight", [hp.nEmbd, hp.nFf]),
    m("ffn_down.weight", [hp.nFf, hp.nEmbd])
  ]
}

const f32 = (n: number) => 4 * n

/** Gated full attention: [nEmbd, n]. */
const gatedAttention = (t: Toolkit, w: BlockWeights, h: Ptr): Ptr => {
  const g = t.g
  const ctx = t.ctx
  const { headDimK: hd, nHead, nHeadKv } = t.hp
  const n = t.nTokens
  const qFull = t.linear(w.get("attn_q.weight"), h)
  const qView = g.ggml_view_3d(ctx, qFull, hd, nHead, n, f32(2 * hd), f32(2 * hd * nHead), 0)
  const q = t.rmsNorm(qView, w.get("attn_q_norm.weight"))
  const kRaw = t.linear(w.get("attn_k.weight"), h)
  const vRaw = t.linear(w.get("attn_v.weight"), h)
  const k = t.rmsNorm(g.ggml_reshape_3d(ctx, kRaw, hd, nHeadKv, n), w.get("attn_k_norm.weight"))
  const gateView = g.ggml_view_3d(ctx, qFull, hd, nHead, n, f32(2 * hd), f32(2 * hd * nHead), f32(hd))
  const gate = g.ggml_cont_2d(ctx, gateView, hd * nHead, n)
  const v = g.ggml_reshape_3d(ctx, vRaw, hd, nHeadKv, n)
  return t.attention(t.rope(q), t.rope(k), v, w.get("attn_output.weight"), null, t.hp.kqScale, null, gate)
}

/**
 * One sequence's DeltaNet over its rows h [nEmbd, n] and its state (conv, ssm): [nEmbd, n]. `snaps`: a verify step's,
 * where each row's states go (RecurrentSnapshots.ts).
 */
const deltaNetSegment = (
  t: Toolkit,
  w: BlockWeights,
  h: Ptr,
  n: number,
  state: { readonly conv: Ptr; readonly ssm: Ptr; readonly snaps: StateSnapshots | undefined }
): Ptr => {
  const { conv, ssm, snaps } = state
  const g = t.g
  const ctx = t.ctx
  const r = t.hp.recurrent!
  const S = r.stateSize
  const Hv = r.vHeads
  const Hk = r.kHeads
  const K = r.convKernel
  const qkv = t.linear(w.get("attn_qkv.weight"), h)
  const z = t.linear(w.get("attn_gate.weight"), h)
  const beta = g.ggml_sigmoid(ctx, g.ggml_reshape_4d(ctx, t.linear(w.get("ssm_beta.weight"), h), 1, Hv, n, 1))
  const alpha = g.ggml_reshape_3d(ctx, t.linear(w.get("ssm_alpha.weight"), h), Hv, n, 1)
  const decay = g.ggml_mul(ctx, g.ggml_softplus(ctx, g.ggml_add(ctx, alpha, w.get("ssm_dt.bias"))), w.get("ssm_a"))
  const gate = g.ggml_reshape_4d(ctx, decay, 1, Hv, n, 1)
  // causal convolution over the previous K - 1 inputs and this call's
  const convState = g.ggml_reshape_3d(ctx, conv, K - 1, r.convDim, 1)
  const qkvT = g.ggml_transpose(ctx, g.ggml_reshape_3d(ctx, qkv, r.convDim, n, 1))
  const convIn = g.ggml_concat(ctx, convState, qkvT, 0)
  const width = K - 1 + n
  const last = g.ggml_view_3d(ctx, convIn, K - 1, r.convDim, 1, f32(width), f32(width * r.convDim), f32(n))
  g.ggml_build_forward_expand(t.graph, g.ggml_cpy(ctx, last, convState))
  if (snaps !== undefined) snapshotConv(t, snaps, convIn, n, K - 1, r.convDim, 0)
  const convOut = g.ggml_silu(ctx, g.ggml_ssm_conv(ctx, convIn, w.get("ssm_conv1d.weight")))
  const row = f32(r.convDim)
  const q = g.ggml_view_4d(ctx, convOut, S, Hk, n, 1, f32(S), row, row * n, 0)
  const k = g.ggml_view_4d(ctx, convOut, S, Hk, n, 1, f32(S), row, row * n, f32(S * Hk))
  const v = g.ggml_view_4d(ctx, convOut, S, Hv, n, 1, f32(S), row, row * n, f32(2 * S * Hk))
  const eps = t.hp.rmsEps
  const s0 = g.ggml_reshape_4d(ctx, ssm, S, S, Hv, 1)
  // a verify step keeps the state after each row (n snapshot slots, the last row's first)
  const slots = snaps === undefined ? 1 : n
  const result = g.ggml_gated_delta_net(
    ctx,
    g.ggml_l2_norm(ctx, q, eps),
    g.ggml_l2_norm(ctx, k, eps),
    v,
    gate,
    beta,
    s0,
    slots
  )
  if (snaps !== undefined) snapshotStates(t, snaps, result, S * Hv * n, n)
  const out = g.ggml_view_4d(ctx, result, S, Hv, n, 1, f32(S), f32(S * Hv), f32(S * Hv * n), 0)
  const newState = g.ggml_view_1d(ctx, result, S * S * Hv, f32(S * Hv * n))
  g.ggml_build_forward_expand(t.graph, g.ggml_cpy(ctx, newState, ssm))
  const z4 = g.ggml_reshape_4d(ctx, z, S, Hv, n, 1)
  const normed = g.ggml_mul(ctx, t.rmsNorm(out, w.get("ssm_norm.weight")), g.ggml_silu(ctx, z4))
  return t.linear(w.get("ssm_out.weight"), g.ggml_reshape_2d(ctx, normed, S * Hv, n))
}

/** DeltaNet over every sequence of the batch, each from and into its own state: [nEmbd, nTokens]. */
const deltaNet = (t: Toolkit, w: BlockWeights, h: Ptr): Ptr => {
  const g = t.g
  const segments = t.inputs.segments
  const nb1 = g.ggml_row_size(GgmlType.F32, t.hp.nEmbd)
  let out: Ptr | null = null
  for (const seg of segments) {
    const rows = segments.length === 1 ? h : g.ggml_view_2d(t.ctx, h, t.hp.nEmbd, seg.n, nb1, seg.offset * nb1)
    const state = seg.kv(t.layer)
    const y = deltaNetSegment(t, w, rows, seg.n, { conv: state.k, ssm: state.v, snaps: seg.snapshots?.(t.layer) })
    out = out === null ? y : g.ggml_concat(t.ctx, out, y, 1)
  }
  return out!
}

/**
 * One qwen35-family block around its feed-forward `ffn` (normed input in, output out): attn_norm, the DeltaNet or
 * the gated attention, the residual, post_attention_norm, `ffn`, the residual (qwen35: SwiGLU; qwen35moe: routed).
 */
export const qwen35Block =
  (ffn: (t: Toolkit, w: BlockWeights, normed: Ptr) => Ptr) =>
  (t: Toolkit, w: BlockWeights, x: Ptr): Ptr => {
    const h = t.rmsNorm(x, w.get("attn_norm.weight"))
    expandBlockInputs(t, h)
    const mixed = t.hp.recurrent!.layers[t.layer] === true ? deltaNet(t, w, h) : gatedAttention(t, w, h)
    const ffnIn = t.add(mixed, x)
    const out = t.add(ffn(t, w, t.rmsNorm(ffnIn, w.get("post_attention_norm.weight"))), ffnIn)
    return t.outputRows(out)
  }

export const qwen35: ArchModule = {
  name: "qwen35",
  ropeMode: RopeMode.NEOX,
  ownHeadShape: true,
  hparams: qwen35HParams,
  blockTensors,
  buildOutput: llamaOutputHead,
  buildBlock: qwen35Block((t, w, normed) => t.ffnSwiglu(normed, w))
}

/**
 * llama.cpp expands the block's norm before its attention (ggml_build_forward_expand(gf, cur)). A DeltaNet block
 * also expands the attention inputs (positions, cells, masks, rows) that it does not read: on a stage of DeltaNet
 * blocks only they would otherwise get no memory, and Forward.ts sets them on every call.
 */
export const expandBlockInputs = (t: Toolkit, h: Ptr) => {
  const g = t.g
  g.ggml_build_forward_expand(t.graph, h)
  if (t.hp.recurrent!.layers[t.layer] !== true) return
  g.ggml_build_forward_expand(t.graph, t.inputs.pos)
  for (const seg of t.inputs.segments) {
    for (const leaf of [seg.kvIdx, seg.mask, seg.rows]) if (leaf !== null) g.ggml_build_forward_expand(t.graph, leaf)
  }
}
