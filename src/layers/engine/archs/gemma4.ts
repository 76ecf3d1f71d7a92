/**
 * gemma4, the dense text model (llama.cpp src/models/gemma4.cpp, Gemma 4 31B's layout): gemma3's block (embeddings
 * scaled by sqrt(n_embd), q/k RMS norms before RoPE NEOX, post-attention and post-FFN norms, GELU-gated feed-forward,
 * soft-capped output; the shared parts in gemmaShared.ts) with gemma4's differences:
 * - attention scale 1 (no 1/sqrt(head size)); V RMS-normed without a weight; attn_v optional (V = K's projection);
 * - the global blocks' RoPE takes the model-wide frequency factors `rope_freqs.weight` (proportional RoPE);
 * - an optional per-block scalar `layer_output_scale` on the block output;
 * - which blocks slide is `attention.sliding_window_pattern`, one bool per block (or one bool for all).
 * Refused with a ModelLoadError naming the key: per-layer embeddings (`embedding_length_per_layer_input` > 0, E2B/E4B),
 * shared KV layers (`attention.shared_kv_layers` > 0), experts (`expert_count` > 0, 26B-A4B), sliding-window head
 * sizes or RoPE width other than the global ones (`attention.key_length_swa`, `value_length_swa`,
 * `rope.dimension_count_swa`).
 */
import { Effect } from "effect"
import type { GgufFile, GgufValue, ModelLoadError } from "../../../domain/gguf.js"
import type { Ptr } from "../../ggml/Bindings.js"
import { getU32 } from "../../gguf/GgufReader.js"
import type { ArchModule } from "../Arch.js"
import { type HParams, RopeMode } from "../HParams.js"
import { type BlockWeights, llamaBlockSpecs, type TensorSpec, type Toolkit } from "../Toolkit.js"
import {
  gemmaAttnResidualAndFfn,
  gemmaNormSpecs,
  gemmaOutput,
  invalidKey,
  logitSoftcapOf,
  scalarKey,
  swaRopeBase
} from "./gemmaShared.js"

/**
 * gemma4's `attention.sliding_window_pattern` as llama.cpp reads it (get_key_or_arr): one bool per block (true: the
 * block slides), or one bool for every block; a message saying what is wrong otherwise.
 */
export const gemma4SwaPattern = (value: GgufValue | undefined, nLayer: number): ReadonlyArray<boolean> | string => {
  if (value === undefined) return "is missing (llama.cpp requires it for gemma4)"
  if (typeof value === "boolean") return Array.from({ length: nLayer }, () => value)
  if (!Array.isArray(value)) return "must be one bool per block (an array of BOOL)"
  if (value.length !== nLayer) return `has ${value.length} entries for ${nLayer} blocks`
  if (!value.every((b) => typeof b === "boolean")) return "must be an array of BOOL"
  return value as ReadonlyArray<boolean>
}

/** A key gemma4 must have (llama.cpp's get_key without a default). */
const required = <A>(
  file: GgufFile,
  key: string,
  read: (file: GgufFile, key: string) => Effect.Effect<A, ModelLoadError>
): Effect.Effect<A, ModelLoadError> =>
  Effect.flatMap(scalarKey(file, key, read), (v) =>
    v === undefined ? Effect.fail(invalidKey(file, key, "is missing (llama.cpp requires it for gemma4)")) : Effect.succeed(v))

const gemma4HParams = (file: GgufFile, hp: HParams): Effect.Effect<HParams, ModelLoadError> =>
  Effect.gen(function*() {
    const k = (s: string) => `${hp.arch}.${s}`
    const refuse = (key: string, message: string) => Effect.fail(invalidKey(file, k(key), message))
    const perLayer = yield* required(file, k("embedding_length_per_layer_input"), getU32)
    if (perLayer > 0) {
      return yield* refuse("embedding_length_per_layer_input", `= ${perLayer}: per-layer embeddings (Gemma 4 E2B/E4B) are not supported`)
    }
    const shared = (yield* scalarKey(file, k("attention.shared_kv_layers"), getU32)) ?? 0
    if (shared > 0) return yield* refuse("attention.shared_kv_layers", `= ${shared}: shared KV layers are not supported`)
    const experts = (yield* scalarKey(file, k("expert_count"), getU32)) ?? 0
    if (experts > 0) return yield* refuse("expert_count", `= ${experts}: the gemma4 mixture of experts is not supported`)
    const kSwa = yield* required(file, k("attention.key_length_swa"), getU32)
    if (kSwa !== hp.headDimK) {
      return yield* refuse("attention.key_length_swa", `= ${kSwa} differs from key_length ${hp.headDimK}: per-block head sizes are not supported`)
    }
    const vSwa = yield* required(file, k("attention.value_length_swa"), getU32)
    if (vSwa !== hp.headDimV) {
      return yield* refuse("attention.value_length_swa", `= ${vSwa} differs from value_length ${hp.headDimV}: per-block head sizes are not supported`)
    }
    const rotSwa = (yield* scalarKey(file, k("rope.dimension_count_swa"), getU32)) ?? hp.nRot
    if (rotSwa !== hp.nRot) {
      return yield* refuse("rope.dimension_count_swa", `= ${rotSwa} differs from rope.dimension_count ${hp.nRot}: not supported`)
    }
    const window = yield* required(file, k("attention.sliding_window"), getU32)
    if (window === 0) return yield* refuse("attention.sliding_window", "= 0 must be > 0")
    const layers = gemma4SwaPattern(file.metadata.get(k("attention.sliding_window_pattern")), hp.nLayer)
    if (typeof layers === "string") return yield* refuse("attention.sliding_window_pattern", layers)
    const ropeFreqBase = yield* swaRopeBase(file, hp.arch)
    const cap = yield* logitSoftcapOf(file, hp.arch)
    // gemma4.cpp: f_attention_scale = 1 (no pre-attention scaling), the scale inside flash attention
    return { ...hp, kqScale: 1, swa: { window, layers, ropeFreqBase, ropeFreqScale: 1 }, ...cap }
  })

/** Does the model have a global (not sliding-window) block? Then it has RoPE frequency factors. */
const hasGlobalBlock = (hp: HParams) => hp.swa?.layers.some((s) => !s) ?? true

export const gemma4: ArchModule = {
  name: "gemma4",
  ropeMode: RopeMode.NEOX,
  hparams: gemma4HParams,
  embedScale: (hp) => Math.sqrt(hp.nEmbd),
  blockTensors: (hp) =>
    llamaBlockSpecs(hp, [
      ...gemmaNormSpecs(hp.headDimK, hp.nEmbd),
      { name: "layer_output_scale.weight", dims: [1], kind: "vector", required: false }
    ]).map((s): TensorSpec => (s.name === "attn_v.weight" ? { ...s, required: false } : s)),
  sharedTensors: (hp) => [
    { name: "rope_freqs.weight", dims: [hp.headDimK / 2], kind: "vector", required: hasGlobalBlock(hp) }
  ],
  buildBlock: (t: Toolkit, w: BlockWeights, x: Ptr) => {
    const g = t.g
    const { headDimK, headDimV, nHead, nHeadKv, rmsEps } = t.hp
    const heads = (y: Ptr, d: number, n: number) => g.ggml_reshape_3d(t.ctx, y, d, n, t.nTokens)
    const h = t.rmsNorm(x, w.get("attn_norm.weight"))
    // global blocks: proportional RoPE through the frequency factors
    const factors = t.slidingWindow ? null : w.global("rope_freqs.weight")
    const q = t.rope(t.rmsNorm(heads(t.linear(w.get("attn_q.weight"), h), headDimK, nHead), w.get("attn_q_norm.weight")), factors)
    const kProj = t.linear(w.get("attn_k.weight"), h)
    const wv = w.opt("attn_v.weight")
    const vProj = wv === null ? kProj : t.linear(wv, h)
    const k = t.rope(t.rmsNorm(heads(kProj, headDimK, nHeadKv), w.get("attn_k_norm.weight")), factors)
    const v = g.ggml_rms_norm(t.ctx, heads(vProj, headDimV, nHeadKv), rmsEps)
    const att = t.attention(q, k, v, w.get("attn_output.weight"), null, t.hp.kqScale)
    const out = gemmaAttnResidualAndFfn(t, w, x, att)
    const scale = w.opt("layer_output_scale.weight")
    return scale === null ? out : g.ggml_mul(t.ctx, out, scale)
  },
  buildOutput: gemmaOutput
}
