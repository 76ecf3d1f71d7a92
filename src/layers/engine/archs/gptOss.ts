/**
 * gpt-oss (llama.cpp arch "gpt-oss", src/models/openai-moe.cpp), op for op:
 * - attention: RMS norm, q/k/v projections with their (optional) biases, RoPE NEOX (YaRN when the file sets
 *   `rope.scaling.type` yarn: HParams.ts), flash attention with scale 1/sqrt(head size) and per-head attention sinks
 *   (`attn_sinks.weight`, F32 [n_head], ggml_flash_attn_ext_add_sinks), output projection with its bias;
 * - sliding-window blocks: `attention.sliding_window` (required), one global block every
 *   `attention.sliding_window_pattern` (default 2: blocks 0, 2, 4, ... slide), the sliding blocks' RoPE base
 *   `rope.freq_base_swa` (default the model's), same frequency scale;
 * - `post_attention_norm` before the routed feed-forward: router with its bias, top-k over the raw logits, softmax
 *   over the k chosen logits (LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT), experts with per-expert biases
 *   (ggml_add_id) and the clamped SwiGLU ggml_swiglu_oai (alpha 1.702, limit 7, LLM_FFN_SWIGLU_OAI_MOE), no weight
 *   normalisation, no scale.
 * Real files store the experts in MXFP4, the rest F32 / F16 / Q8_0: any type the CPU backend multiplies is taken.
 */
import { Effect } from "effect"
import { type GgufFile, ModelLoadError } from "../../../domain/gguf.js"
import { getGgml, GgmlType, type Ptr } from "../../ggml/Bindings.js"
import { getF32, getOptional, getU32 } from "../../gguf/GgufReader.js"
import type { ArchModule } from "../Arch.js"
import { type HParams, RopeMode } from "../HParams.js"
import { moeOf, readMoeParams, sumExperts } from "../Moe.js"
import type { MoeParams } from "../MoeParams.js"
import { GraphOpError } from "../OpChecks.js"
import { type BlockWeights, llamaOutputHead, type TensorSpec, type Toolkit } from "../Toolkit.js"

const invalid = (file: GgufFile, key: string, message: string) =>
  new ModelLoadError({ path: file.path, reason: "InvalidMetadata", message: `metadata "${key}" ${message}` })

/** A key that must be a single number when present (a per-layer array is refused by name). */
const scalar = <A>(
  file: GgufFile,
  key: string,
  read: (file: GgufFile, key: string) => Effect.Effect<A, ModelLoadError>
): Effect.Effect<A | undefined, ModelLoadError> =>
  Array.isArray(file.metadata.get(key))
    ? Effect.fail(invalid(file, key, "is an array; swactor reads it as one number"))
    : getOptional(file, key, read)

/** gpt-oss's swiglu_oai constants (llama-graph.cpp, LLM_FFN_SWIGLU_OAI_MOE). */
const SWIGLU_ALPHA = 1.702
const SWIGLU_LIMIT = 7

const readGptOss = (file: GgufFile, hp: HParams): Effect.Effect<HParams, ModelLoadError> =>
  Effect.gen(function* () {
    const k = (s: string) => `${hp.arch}.${s}`
    // llama.cpp's loader requires its own output head (no tying to token_embd for gpt-oss)
    if (!file.tensorsByName.has("output.weight")) {
      return yield* Effect.fail(
        new ModelLoadError({
          path: file.path,
          reason: "MissingTensor",
          message: `tensor "output.weight" is missing (gpt-oss has no tied output)`
        })
      )
    }
    // llama.cpp reads these with get_key (required): its loader throws on a missing one
    const ffKey = k("expert_feed_forward_length")
    if (!file.metadata.has(ffKey)) return yield* Effect.fail(invalid(file, ffKey, "is missing"))
    const windowKey = k("attention.sliding_window")
    const window = yield* scalar(file, windowKey, getU32)
    if (window === undefined) return yield* Effect.fail(invalid(file, windowKey, "is missing"))
    if (window <= 0) return yield* Effect.fail(invalid(file, windowKey, `= ${window} must be > 0`))
    const patternKey = k("attention.sliding_window_pattern")
    const period = (yield* scalar(file, patternKey, getU32)) ?? 2
    const baseKey = k("rope.freq_base_swa")
    const base = (yield* scalar(file, baseKey, getF32)) ?? hp.ropeFreqBase
    if (!(base > 0 && Number.isFinite(base))) return yield* Effect.fail(invalid(file, baseKey, `= ${base} must be > 0`))
    const groupsKey = k("expert_group_count")
    const groups = (yield* getOptional(file, groupsKey, getU32)) ?? 0
    if (groups > 1)
      return yield* Effect.fail(
        invalid(file, groupsKey, `= ${groups}: group-limited routing is not supported for gpt-oss`)
      )
    const moe = yield* readMoeParams(file, hp, { gating: "softmax", normWeights: false })
    // llama_hparams::set_swa_pattern (dense_first = false): block il slides unless il % period == period - 1
    const layers = Array.from({ length: hp.nLayer }, (_, il) => period === 0 || il % period < period - 1)
    const f = Math.fround
    return {
      ...hp,
      kqScale: f(1 / f(Math.sqrt(hp.nRot))),
      swa: { window, layers, ropeFreqBase: base, ropeFreqScale: hp.ropeFreqScale },
      moe
    }
  })

const blockSpecs = (hp: HParams): ReadonlyArray<TensorSpec> => {
  const { nExpert: e, nFfExp: f } = moeOf(hp)
  const qDim = hp.headDimK * hp.nHead
  const kvDim = hp.headDimK * hp.nHeadKv
  const m = (name: string, dims: ReadonlyArray<number>): TensorSpec => ({ name, dims, kind: "matrix", required: true })
  const vec = (name: string, dims: ReadonlyArray<number>, required = true): TensorSpec => ({
    name,
    dims,
    kind: "vector",
    required
  })
  return [
    vec("attn_norm.weight", [hp.nEmbd]),
    m("attn_q.weight", [hp.nEmbd, qDim]),
    m("attn_k.weight", [hp.nEmbd, kvDim]),
    m("attn_v.weight", [hp.nEmbd, kvDim]),
    vec("attn_q.bias", [qDim], false),
    vec("attn_k.bias", [kvDim], false),
    vec("attn_v.bias", [kvDim], false),
    m("attn_output.weight", [qDim, hp.nEmbd]),
    vec("attn_output.bias", [hp.nEmbd]),
    vec("attn_sinks.weight", [hp.nHead]),
    vec("post_attention_norm.weight", [hp.nEmbd]),
    m("ffn_gate_inp.weight", [hp.nEmbd, e]),
    vec("ffn_gate_inp.bias", [e]),
    m("ffn_gate_exps.weight", [hp.nEmbd, f, e]),
    m("ffn_up_exps.weight", [hp.nEmbd, f, e]),
    m("ffn_down_exps.weight", [f, hp.nEmbd, e]),
    vec("ffn_gate_exps.bias", [f, e]),
    vec("ffn_up_exps.bias", [f, e]),
    vec("ffn_down_exps.bias", [hp.nEmbd, e])
  ]
}

/**
 * The routed feed-forward over x [n_embd, n] (already normed): llama.cpp's build_moe_ffn with gpt-oss's settings.
 * Shapes of the weights were checked against blockSpecs when the stage loaded; the graph's own shapes are checked here.
 */
const gptOssMoe = (t: Toolkit, w: BlockWeights, x: Ptr, moe: MoeParams): Ptr => {
  const g = t.g
  const ctx = t.ctx
  const ggml = getGgml()
  const shape = (p: Ptr) => ggml.tensorShape(p)
  const { nEmbd } = t.hp
  const { nExpert, nExpertUsed: k } = moe
  const sx = shape(x)
  const n = sx.ne[1]!
  if (sx.ne[0] !== nEmbd || sx.ne[2] !== 1 || sx.ne[3] !== 1) {
    throw new GraphOpError(`gptOssMoe: input must be [${nEmbd}, n], got [${sx.ne.join(", ")}]`)
  }
  if (k > nExpert) throw new GraphOpError(`ggml_argsort_top_k: ${k} of ${nExpert} experts`)

  const logits = t.linear(w.get("ffn_gate_inp.weight"), x, w.get("ffn_gate_inp.bias")) // [n_expert, n]
  const chosen = g.ggml_argsort_top_k(ctx, logits, k) // I32 [k, n]
  let weights = g.ggml_get_rows(ctx, g.ggml_reshape_3d(ctx, logits, 1, nExpert, n), chosen) // [1, k, n]
  weights = g.ggml_reshape_3d(ctx, g.ggml_soft_max(ctx, g.ggml_reshape_2d(ctx, weights, k, n)), 1, k, n)
  g.ggml_build_forward_expand(t.graph, weights)

  const cur = g.ggml_reshape_3d(ctx, x, nEmbd, 1, n)
  const expert = (name: string, input: Ptr) => {
    const a = w.get(`${name}.weight`)
    const b = w.get(`${name}.bias`)
    const [sa, sb, si, sbias] = [shape(a), shape(input), shape(chosen), shape(b)]
    if (!(
      sa.ne[3] === 1 &&
      sb.ne[3] === 1 &&
      si.type === GgmlType.I32 &&
      si.ne[1] === sb.ne[2] &&
      sa.ne[0] === sb.ne[0] &&
      si.ne[0]! % sb.ne[1]! === 0 &&
      sa.ne[2] === nExpert &&
      sbias.type === GgmlType.F32 &&
      sbias.ne[0] === sa.ne[1] &&
      sbias.ne[1] === nExpert
    )) {
      throw new GraphOpError(`ggml_mul_mat_id / ggml_add_id: ${name} does not match its input, bias or expert ids`)
    }
    return g.ggml_add_id(ctx, g.ggml_mul_mat_id(ctx, a, input, chosen), b, chosen) // [rows, k, n]
  }
  const up = expert("ffn_up_exps", cur)
  const gate = expert("ffn_gate_exps", cur)
  const act = g.ggml_swiglu_oai(ctx, gate, up, SWIGLU_ALPHA, SWIGLU_LIMIT)
  let experts = expert("ffn_down_exps", act) // [n_embd, k, n]
  experts = g.ggml_mul(ctx, experts, weights)
  g.ggml_build_forward_expand(t.graph, experts)

  return sumExperts(t, experts, nEmbd, n, k)
}

export const gptOss: ArchModule = {
  name: "gpt-oss",
  ropeMode: RopeMode.NEOX,
  hparams: readGptOss,
  blockTensors: (hp) => blockSpecs(hp),
  buildOutput: llamaOutputHead,
  buildBlock: (t: Toolkit, w: BlockWeights, x: Ptr) => {
    const h = t.rmsNorm(x, w.get("attn_norm.weight"))
    const { k, q, v } = t.qkv(w, h)
    const att = t.attention(
      t.rope(q),
      t.rope(k),
      v,
      w.get("attn_output.weight"),
      w.get("attn_output.bias"),
      t.hp.kqScale,
      w.get("attn_sinks.weight")
    )
    const ffnIn = t.add(t.outputRows(att), t.outputRows(x))
    const ffn = gptOssMoe(t, w, t.rmsNorm(ffnIn, w.get("post_attention_norm.weight")), moeOf(t.hp))
    return t.add(ffn, ffnIn)
  }
}
