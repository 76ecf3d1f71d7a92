/**
 * olmo2 (OLMo 2 and OLMo 3; llama.cpp src/models/olmo2.cpp): no norm before attention or the feed-forward; q and k
 * RMS-normed over the whole projection (all heads together), RoPE NEOX over the whole head; RMS norms after attention
 * (`attn_post_norm`) and after the SwiGLU feed-forward (`ffn_post_norm`), each before its residual add. OLMo 3 adds
 * sliding-window blocks (`attention.sliding_window`): llama.cpp reads the pattern as a period (default 4: every fourth
 * block global) and gives those blocks plain RoPE (`rope.freq_base_swa`, scale 1, no YaRN).
 */
import { Effect } from "effect"
import type { GgufFile, ModelLoadError } from "../../../domain/gguf.js"
import type { Ptr } from "../../ggml/Bindings.js"
import { getF32, getOptional, getU32 } from "../../gguf/GgufReader.js"
import type { ArchModule } from "../Arch.js"
import { type HParams, RopeMode, type SwaParams } from "../HParams.js"
import { type BlockWeights, llamaBlockSpecs, llamaOutputHead, type Toolkit } from "../Toolkit.js"
import { swaLayerPattern } from "./gemma3.js"
import { invalidMetadata } from "../MetadataErrors.js"

/** llama.cpp's default period of OLMo 3's sliding-window pattern: three sliding blocks, then a global one. */
const DEFAULT_PERIOD = 4

/**
 * OLMo 3's sliding window. llama.cpp reads `attention.sliding_window_pattern` as a period only (an array, as the
 * converter writes it, is passed over for the default 4); an array is accepted when it says the same, refused when
 * it does not (swactor would otherwise run other blocks than llama.cpp does).
 */
const swaOf = (file: GgufFile, hp: HParams): Effect.Effect<SwaParams | undefined, ModelLoadError> =>
  Effect.gen(function* () {
    const k = (s: string) => `${hp.arch}.${s}`
    const window = yield* getOptional(file, k("attention.sliding_window"), getU32)
    if (window === undefined || window === 0) return undefined
    const patternKey = k("attention.sliding_window_pattern")
    const raw = file.metadata.get(patternKey)
    let period = DEFAULT_PERIOD
    if (raw !== undefined && !Array.isArray(raw)) period = yield* getU32(file, patternKey)
    const layers = swaLayerPattern(hp.nLayer, period)
    if (Array.isArray(raw)) {
      const same = raw.length === hp.nLayer && raw.every((v, il) => v === layers[il])
      if (!same)
        return yield* Effect.fail(
          invalidMetadata(
            file,
            patternKey,
            `is a per-block pattern other than one global block in ${DEFAULT_PERIOD}, which llama.cpp reads as ` +
              `that period regardless; swactor refuses rather than run other blocks than llama.cpp`
          )
        )
    }
    const base = (yield* getOptional(file, k("rope.freq_base_swa"), getF32)) ?? hp.ropeFreqBase
    return { window, layers, ropeFreqBase: base, ropeFreqScale: 1, plainRope: true }
  })

const olmo2HParams = (file: GgufFile, hp: HParams): Effect.Effect<HParams, ModelLoadError> =>
  Effect.gen(function* () {
    // olmo2.cpp asserts n_rot == the head size
    if (hp.nRot !== hp.headDimK)
      return yield* Effect.fail(
        invalidMetadata(file, `${hp.arch}.rope.dimension_count`, `= ${hp.nRot} must equal the head size ${hp.headDimK}`)
      )
    const swa = yield* swaOf(file, hp)
    return swa === undefined ? hp : { ...hp, swa }
  })

/** The llama family's pre-norms: olmo2 has none (its norms come after attention and the feed-forward). */
const preNorm = /^(attn_norm|ffn_norm)\./

export const olmo2: ArchModule = {
  name: "olmo2",
  ropeMode: RopeMode.NEOX,
  hparams: olmo2HParams,
  blockTensors: (hp) => [
    ...llamaBlockSpecs(hp, [
      { name: "attn_q_norm.weight", dims: [hp.headDimK * hp.nHead], kind: "vector", required: true },
      { name: "attn_k_norm.weight", dims: [hp.headDimK * hp.nHeadKv], kind: "vector", required: true },
      { name: "post_attention_norm.weight", dims: [hp.nEmbd], kind: "vector", required: true },
      { name: "post_ffw_norm.weight", dims: [hp.nEmbd], kind: "vector", required: true }
    ]).filter((s) => !preNorm.test(s.name))
  ],
  buildOutput: llamaOutputHead,
  buildBlock: (t: Toolkit, w: BlockWeights, x: Ptr) => {
    const { k, q, v } = t.qkv(w, x)
    // the norms span every head of the projection
    const qn = t.rope(t.rmsNormWide(q, t.hp.nHead, w.get("attn_q_norm.weight")))
    const kn = t.rope(t.rmsNormWide(k, t.heads.nHeadKv, w.get("attn_k_norm.weight")))
    const att = t.attention(qn, kn, v, w.get("attn_output.weight"))
    const ffnIn = t.add(t.rmsNorm(t.outputRows(att), w.get("post_attention_norm.weight")), t.outputRows(x))
    return t.add(t.rmsNorm(t.ffnSwiglu(ffnIn, w), w.get("post_ffw_norm.weight")), ffnIn)
  }
}
