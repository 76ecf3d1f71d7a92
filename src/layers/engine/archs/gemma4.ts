/**
 * gemma4, the dense text model (llama.cpp src/models/gemma4.cpp, Gemma 4 31B's layout): gemma3's block (embeddings
 * scaled by sqrt(n_embd), q/k RMS norms before RoPE NEOX, post-attention and post-FFN norms, GELU-gated feed-forward,
 * soft-capped output; the shared parts in gemmaShared.ts) with gemma4's differences:
 * - attention scale 1 (no 1/sqrt(head size)); V RMS-normed without a weight; attn_v optional (V = K's projection);
 * - the global blocks' RoPE takes the model-wide frequency factors `rope_freqs.weight` (proportional RoPE);
 * - an optional per-block scalar `layer_output_scale` on the block output;
 * - which blocks slide is `attention.sliding_window_pattern`, one bool per block (or one bool for all);
 * - per-block attention shapes (HParams.blockHeads, the 31B's layout): the sliding-window blocks' own head size and RoPE
 *   width (`attention.key_length_swa` = `value_length_swa`, `rope.dimension_count_swa`), `attention.head_count_kv` one
 *   count per block; each block's KV cache, projections and q/k norms take its own widths.
 * - E2B/E4B (archs/gemma4PerLayer.ts): per-layer embeddings (`embedding_length_per_layer_input` > 0; the first stage
 *   computes every block's per-layer input and they travel with the activations, engine/PerLayerInputs.ts) and shared
 *   KV layers (`attention.shared_kv_layers` > 0: the last blocks attend over an earlier block's cache and keep none;
 *   never on another stage than that block); E2B's double-wide MLP on the shared-KV blocks (`feed_forward_length`
 *   one width per block, HParams.blockFf);
 * - 26B-A4B (archs/gemma4Moe.ts): blocks with `ffn_gate_inp` add routed GELU experts beside the dense feed-forward.
 * Refused with a ModelLoadError naming the key: `expert_count` above 1024; key_length_swa odd or not value_length_swa, a RoPE width odd or past its head size; shared KV
 * layers leaving fewer than 2 blocks with a cache or a block reading a cache of the other kind (sliding-window /
 * global).
 */
import { Effect } from "effect"
import type { GgufFile, GgufValue, ModelLoadError } from "../../../domain/gguf.js"
import type { Ptr } from "../../ggml/Bindings.js"
import { getNumberArray, getU32 } from "../../gguf/GgufReader.js"
import type { ArchModule } from "../Arch.js"
import { ffOf, type HParams, headsOf, RopeMode } from "../HParams.js"
import { invalidMetadata, scalarKey } from "../MetadataErrors.js"
import { type BlockWeights, llamaBlockSpecs, type TensorSpec, type Toolkit } from "../Toolkit.js"
import { gemmaAttnResidualAndFfn, gemmaNormSpecs, gemmaOutput, logitSoftcapOf, swaRopeBase } from "./gemmaShared.js"
import { gemma4AttnResidualAndMoe, gemma4MoeParams, gemma4MoeSpecs } from "./gemma4Moe.js"
import {
  gemma4PerLayerInputs,
  gemma4PerLayerParams,
  perLayerBlockOut,
  perLayerBlockSpecs,
  perLayerInputTensors,
  reusesKv,
  sharedKvAttention,
  withoutOwnKv
} from "./gemma4PerLayer.js"

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
    v === undefined
      ? Effect.fail(invalidMetadata(file, key, "is missing (llama.cpp requires it for gemma4)"))
      : Effect.succeed(v)
  )

const gemma4HParams = (file: GgufFile, hp: HParams): Effect.Effect<HParams, ModelLoadError> =>
  Effect.gen(function* () {
    const k = (s: string) => `${hp.arch}.${s}`
    const refuse = (key: string, message: string) => Effect.fail(invalidMetadata(file, k(key), message))
    // experts (26B-A4B): archs/gemma4Moe.ts
    const moe = yield* gemma4MoeParams(file, hp)
    const heads = yield* gemma4BlockHeads(file, hp)
    const window = yield* required(file, k("attention.sliding_window"), getU32)
    if (window === 0) return yield* refuse("attention.sliding_window", "= 0 must be > 0")
    const layers = gemma4SwaPattern(file.metadata.get(k("attention.sliding_window_pattern")), hp.nLayer)
    if (typeof layers === "string") return yield* refuse("attention.sliding_window_pattern", layers)
    const ropeFreqBase = yield* swaRopeBase(file, hp.arch)
    // per-layer embeddings and shared KV layers (E2B/E4B): archs/gemma4PerLayer.ts
    const perLayer = yield* gemma4PerLayerParams(file, hp, layers)
    const cap = yield* logitSoftcapOf(file, hp.arch)
    // gemma4.cpp: f_attention_scale = 1 (no pre-attention scaling), the scale inside flash attention
    const blockHeads = layers.map((slides) => (slides ? heads.swa : heads.global))
    return {
      ...hp,
      kqScale: 1,
      swa: { window, layers, ropeFreqBase, ropeFreqScale: 1 },
      ...cap,
      ...moe,
      ...perLayer,
      blockHeads: blockHeads.map((h, il) => ({ ...h, nHeadKv: heads.kvHeads[il]! }))
    }
  })

/**
 * gemma4's per-block attention shape (llama.cpp's n_embd_head_k(il), n_head_kv(il), n_rot(il)): the global blocks'
 * head size `attention.key_length` and RoPE width `rope.dimension_count`, the sliding-window blocks' own
 * `attention.key_length_swa` / `value_length_swa` / `rope.dimension_count_swa` (31B: 256 against the global 512), and
 * `attention.head_count_kv` as one count per block (31B: 16 in sliding-window blocks, 4 in global ones) or one for all.
 */
const gemma4BlockHeads = (file: GgufFile, hp: HParams) =>
  Effect.gen(function* () {
    const k = (s: string) => `${hp.arch}.${s}`
    const refuse = (key: string, message: string) => Effect.fail(invalidMetadata(file, k(key), message))
    // llama.cpp: "Gemma 4 requires n_embd_head_k == n_embd_head_v" (both kinds of block)
    if (hp.headDimV !== hp.headDimK) {
      return yield* refuse("attention.value_length", `= ${hp.headDimV} must equal key_length ${hp.headDimK} (gemma4)`)
    }
    if (hp.nRot > hp.headDimK || hp.nRot % 2 !== 0) {
      return yield* refuse("rope.dimension_count", `= ${hp.nRot} must be even and at most key_length ${hp.headDimK}`)
    }
    const kSwa = yield* required(file, k("attention.key_length_swa"), getU32)
    if (kSwa === 0 || kSwa % 2 !== 0) return yield* refuse("attention.key_length_swa", `= ${kSwa} must be even and > 0`)
    const vSwa = yield* required(file, k("attention.value_length_swa"), getU32)
    if (vSwa !== kSwa) {
      return yield* refuse("attention.value_length_swa", `= ${vSwa} must equal key_length_swa ${kSwa} (gemma4)`)
    }
    const rotSwa = (yield* scalarKey(file, k("rope.dimension_count_swa"), getU32)) ?? hp.nRot
    if (rotSwa === 0 || rotSwa > kSwa || rotSwa % 2 !== 0) {
      return yield* refuse(
        "rope.dimension_count_swa",
        `= ${rotSwa} must be even, > 0 and at most key_length_swa ${kSwa}`
      )
    }
    const kvValue = file.metadata.get(k("attention.head_count_kv"))
    const kvHeads = Array.isArray(kvValue)
      ? yield* getNumberArray(file, k("attention.head_count_kv"))
      : Array.from({ length: hp.nLayer }, () => hp.nHeadKv)
    return {
      global: { headDimK: hp.headDimK, headDimV: hp.headDimV, nRot: hp.nRot },
      swa: { headDimK: kSwa, headDimV: vSwa, nRot: rotSwa },
      kvHeads
    }
  })

/** Does the model have a global (not sliding-window) block? Then it has RoPE frequency factors. */
const hasGlobalBlock = (hp: HParams) => hp.swa?.layers.some((s) => !s) ?? true

export const gemma4: ArchModule = {
  name: "gemma4",
  ropeMode: RopeMode.NEOX,
  kvHeadsPerBlock: true,
  ffPerBlock: true,
  hparams: gemma4HParams,
  embedScale: (hp) => Math.sqrt(hp.nEmbd),
  blockTensors: (model, il) => {
    // the block's own head size and KV heads (its projections and q/k norms) and feed-forward width (E2B)
    const hp = { ...model, ...headsOf(model, il), nFf: ffOf(model, il) }
    const specs = llamaBlockSpecs(hp, [
      ...gemmaNormSpecs(hp.headDimK, hp.nEmbd),
      { name: "layer_output_scale.weight", dims: [1], kind: "vector", required: false },
      ...gemma4MoeSpecs(hp),
      ...perLayerBlockSpecs(hp)
    ]).map((s): TensorSpec => (s.name === "attn_v.weight" ? { ...s, required: false } : s))
    return reusesKv(model, il) ? withoutOwnKv(specs) : specs
  },
  inputTensors: perLayerInputTensors,
  perLayerInputs: gemma4PerLayerInputs,
  sharedTensors: (hp) => [
    { name: "rope_freqs.weight", dims: [hp.headDimK / 2], kind: "vector", required: hasGlobalBlock(hp) }
  ],
  buildBlock: (t: Toolkit, w: BlockWeights, x: Ptr) => {
    const g = t.g
    const { nHead, rmsEps } = t.hp
    const { headDimK, headDimV, nHeadKv } = t.heads
    const heads = (y: Ptr, d: number, n: number) => g.ggml_reshape_3d(t.ctx, y, d, n, t.nTokens)
    const h = t.rmsNorm(x, w.get("attn_norm.weight"))
    // global blocks: proportional RoPE through the frequency factors
    const factors = t.slidingWindow ? null : w.global("rope_freqs.weight")
    const q = t.rope(
      t.rmsNorm(heads(t.linear(w.get("attn_q.weight"), h), headDimK, nHead), w.get("attn_q_norm.weight")),
      factors
    )
    // a shared KV layer (E2B/E4B) attends over an earlier block's cache
    const source = t.hp.kvShare?.sources[t.layer] ?? t.layer
    const att =
      source !== t.layer
        ? sharedKvAttention(t, q, w.get("attn_output.weight"), source, t.hp.kqScale)
        : (() => {
            const kProj = t.linear(w.get("attn_k.weight"), h)
            const wv = w.opt("attn_v.weight")
            const vProj = wv === null ? kProj : t.linear(wv, h)
            const k = t.rope(t.rmsNorm(heads(kProj, headDimK, nHeadKv), w.get("attn_k_norm.weight")), factors)
            const v = g.ggml_rms_norm(t.ctx, heads(vProj, headDimV, nHeadKv), rmsEps)
            return t.attention(q, k, v, w.get("attn_output.weight"), null, t.hp.kqScale)
          })()
    // per-layer embeddings (E2B/E4B) after the feed-forward residual, before the output scale
    const out = perLayerBlockOut(
      t,
      w,
      (t.hp.moe === undefined ? gemmaAttnResidualAndFfn : gemma4AttnResidualAndMoe)(t, w, x, att)
    )
    const scale = w.opt("layer_output_scale.weight")
    return scale === null ? out : g.ggml_mul(t.ctx, out, scale)
  },
  buildOutput: gemmaOutput
}
