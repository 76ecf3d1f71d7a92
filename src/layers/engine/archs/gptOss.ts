/**
 * gpt-oss (llama.cpp arch "gpt-oss", src/models/openai-moe.cpp), op for op:
 * - attention: RMS norm, q/k/v projections with their (optional) biases, RoPE NEOX (YaRN when the file sets
 *   `rope.scaling.type` yarn: HParams.ts), flash attention with scale 1/sqrt(head size) and per-head attention sinks
 *   (`attn_sinks.weight`, F32 [n_head], ggml_flash_attn_ext_add_sinks), output projection with its bias;
 * - sliding-window blocks: `attention.sliding_window` (required), one global block every
 *   `attention.sliding_window_pattern` (default 2: blocks 0, 2, 4, ... slide), the sliding blocks' RoPE base
 *   `rope.freq_base_swa` (default the model's), same frequency scale;
 * - `post_attention_norm` before the routed feed-forward (Moe.ts's moeFfn): router with its bias, top-k over the raw
 *   logits, softmax over the k chosen logits (gating softmaxWeight, LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT),
 *   experts with per-expert biases (ggml_add_id) and the clamped SwiGLU ggml_swiglu_oai (alpha 1.702, limit 7,
 *   LLM_FFN_SWIGLU_OAI_MOE), no weight normalisation, no scale.
 * Real files store the experts in MXFP4, the rest F32 / F16 / Q8_0: any type the CPU backend multiplies is taken.
 */
import { Effect } from "effect"
import { type GgufFile, ModelLoadError } from "../../../domain/gguf.js"
import type { Ptr } from "../../ggml/Bindings.js"
import { getF32, getOptional, getU32 } from "../../gguf/GgufReader.js"
import type { ArchModule } from "../Arch.js"
import { type HParams, RopeMode } from "../HParams.js"
import { moeFfn, moeOf, readMoeParams } from "../Moe.js"
import { type BlockWeights, llamaOutputHead, type TensorSpec, type Toolkit } from "../Toolkit.js"
import { invalidMetadata, scalarKey } from "../MetadataErrors.js"

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
    if (!file.metadata.has(ffKey)) return yield* Effect.fail(invalidMetadata(file, ffKey, "is missing"))
    const windowKey = k("attention.sliding_window")
    const window = yield* scalarKey(file, windowKey, getU32)
    if (window === undefined) return yield* Effect.fail(invalidMetadata(file, windowKey, "is missing"))
    if (window <= 0) return yield* Effect.fail(invalidMetadata(file, windowKey, `= ${window} must be > 0`))
    const patternKey = k("attention.sliding_window_pattern")
    const period = (yield* scalarKey(file, patternKey, getU32)) ?? 2
    const baseKey = k("rope.freq_base_swa")
    const base = (yield* scalarKey(file, baseKey, getF32)) ?? hp.ropeFreqBase
    if (!(base > 0 && Number.isFinite(base)))
      return yield* Effect.fail(invalidMetadata(file, baseKey, `= ${base} must be > 0`))
    const groupsKey = k("expert_group_count")
    const groups = (yield* getOptional(file, groupsKey, getU32)) ?? 0
    if (groups > 1)
      return yield* Effect.fail(
        invalidMetadata(file, groupsKey, `= ${groups}: group-limited routing is not supported for gpt-oss`)
      )
    const moe = yield* readMoeParams(file, hp, { gating: "softmaxWeight", normWeights: false })
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
    const normed = t.rmsNorm(ffnIn, w.get("post_attention_norm.weight"))
    const ffn = moeFfn(t, w, normed, moeOf(t.hp), null, { biases: true, activation: "swigluOai" })
    return t.add(ffn, ffnIn)
  }
}
