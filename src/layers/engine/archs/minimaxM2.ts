/**
 * minimax-m2 (MiniMax-M2 / M2.1 / M2.5; llama.cpp src/models/minimax-m2.cpp): full attention with q/k RMS norms over
 * the whole projection (all heads together, not per head), partial RoPE NEOX (`rope.dimension_count` = the
 * checkpoint's rotary_dim, 64 of a 128 head), then in every block a routed SwiGLU feed-forward: the file's gating
 * (`expert_gating_func`; the converter writes sigmoid from scoring_func), the expert bias `exp_probs_b` added for the
 * choice only, weights normalised, scaled by `expert_weights_scale` when the file has one, no shared experts (Moe.ts).
 */
import { Effect } from "effect"
import type { GgufFile, ModelLoadError } from "../../../domain/gguf.js"
import type { Ptr } from "../../ggml/Bindings.js"
import { getF32, getOptional, getU32 } from "../../gguf/GgufReader.js"
import type { ArchModule } from "../Arch.js"
import { type HParams, RopeMode } from "../HParams.js"
import { invalidMetadata } from "../MetadataErrors.js"
import { moeBlockSpecs, moeFfn, moeOf, readMoeParams } from "../Moe.js"
import type { ExpertGating } from "../MoeParams.js"
import { type BlockWeights, llamaBlockSpecs, llamaOutputHead, type Toolkit } from "../Toolkit.js"

/** llama.cpp's llama_expert_gating_func_type: 1 softmax, 2 sigmoid (no default: its graph aborts on 0). */
const gatingOf = (n: number | undefined): ExpertGating | undefined =>
  n === 1 ? "softmax" : n === 2 ? "sigmoid" : undefined

const readMinimaxM2 = (file: GgufFile, hp: HParams): Effect.Effect<HParams, ModelLoadError> =>
  Effect.gen(function* () {
    const gatingKey = `${hp.arch}.expert_gating_func`
    const gatingId = yield* getOptional(file, gatingKey, getU32)
    const gating = gatingOf(gatingId)
    if (gating === undefined) {
      return yield* Effect.fail(
        invalidMetadata(
          file,
          gatingKey,
          gatingId === undefined
            ? "is missing (llama.cpp's minimax-m2 graph needs it: 1 softmax, 2 sigmoid)"
            : `= ${gatingId} is not a gating swactor supports (1 softmax, 2 sigmoid)`
        )
      )
    }
    const moe = yield* readMoeParams(file, hp, {
      gating,
      normWeights: true,
      weightsScale: (yield* getOptional(file, `${hp.arch}.expert_weights_scale`, getF32)) ?? 0
    })
    return { ...hp, moe }
  })

/** The llama family's dense feed-forward tensors: a routed block has none. */
const denseFfn = /^ffn_(gate|up|down)\./

export const minimaxM2: ArchModule = {
  name: "minimax-m2",
  ropeMode: RopeMode.NEOX,
  hparams: readMinimaxM2,
  blockTensors: (hp) => {
    const moe = moeOf(hp)
    return [
      ...llamaBlockSpecs(hp, [
        { name: "attn_q_norm.weight", dims: [hp.headDimK * hp.nHead], kind: "vector", required: true },
        { name: "attn_k_norm.weight", dims: [hp.headDimK * hp.nHeadKv], kind: "vector", required: true }
      ]).filter((s) => !denseFfn.test(s.name)),
      ...moeBlockSpecs(hp, moe),
      { name: "exp_probs_b.bias", dims: [moe.nExpert], kind: "vector", required: true }
    ]
  },
  buildOutput: llamaOutputHead,
  buildBlock: (t: Toolkit, w: BlockWeights, x: Ptr) => {
    const h = t.rmsNorm(x, w.get("attn_norm.weight"))
    const { k, q, v } = t.qkv(w, h)
    // the norms span every head of the projection
    const qn = t.rmsNormWide(q, t.hp.nHead, w.get("attn_q_norm.weight"))
    const kn = t.rmsNormWide(k, t.heads.nHeadKv, w.get("attn_k_norm.weight"))
    const att = t.attention(t.rope(qn), t.rope(kn), v, w.get("attn_output.weight"))
    const ffnIn = t.add(t.outputRows(att), t.outputRows(x))
    const normed = t.rmsNorm(ffnIn, w.get("ffn_norm.weight"))
    return t.add(moeFfn(t, w, normed, moeOf(t.hp), w.get("exp_probs_b.bias")), ffnIn)
  }
}
