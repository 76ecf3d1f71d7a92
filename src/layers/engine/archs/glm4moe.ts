/**
 * glm4moe (GLM-4.5, llama.cpp src/models/glm4-moe.cpp): llama-family attention with optional q/k/v biases and
 * optional q/k RMS norms, RoPE NEOX; `post_attention_norm` before the feed-forward; the first
 * `leading_dense_block_count` blocks have a dense SwiGLU feed-forward, the rest route (Moe.ts): sigmoid gate (or the
 * file's `expert_gating_func`), the expert bias `exp_probs_b` added for the choice only, weights normalised when
 * `expert_weights_norm`, scaled by `expert_weights_scale`, plus `expert_shared_count` shared experts.
 * MTP blocks (`nextn_predict_layers` > 0) are left out, as llama.cpp decodes: the model's blocks are the trunk.
 * Partial RoPE runs as the converter writes it (rope.dimension_count = half the head: RoPE on those values only).
 * Not supported (refused naming the key): multi-section RoPE.
 */
import { Effect } from "effect"
import type { GgufFile, ModelLoadError } from "../../../domain/gguf.js"
import type { Ptr } from "../../ggml/Bindings.js"
import { getBool, getF32, getOptional, getU32 } from "../../gguf/GgufReader.js"
import { trunkBlockCount } from "../../gguf/TrunkBlocks.js"
import type { ArchModule } from "../Arch.js"
import { type HParams, RopeMode } from "../HParams.js"
import { invalidMetadata } from "../MetadataErrors.js"
import { moeBlockSpecs, moeFfn, moeOf, readMoeParams } from "../Moe.js"
import type { ExpertGating } from "../MoeParams.js"
import { type BlockWeights, llamaBlockSpecs, llamaOutputHead, type Toolkit } from "../Toolkit.js"

/** llama.cpp's llama_expert_gating_func_type: 0 (none: GLM's default, sigmoid), 1 softmax, 2 sigmoid. */
const gatingOf = (n: number | undefined): ExpertGating | undefined =>
  n === undefined || n === 0 || n === 2 ? "sigmoid" : n === 1 ? "softmax" : undefined

const readGlm4Moe = (file: GgufFile, hp: HParams): Effect.Effect<HParams, ModelLoadError> =>
  Effect.gen(function* () {
    const k = (s: string) => `${hp.arch}.${s}`
    // MTP blocks (`nextn_predict_layers`, GLM-4.5/4.6 carry one) trail the trunk: llama.cpp decodes without them
    // (n_layer() = block_count - nextn), so the stages cover the trunk only and never load those blocks' tensors
    const nLayer = yield* trunkBlockCount(file, hp.arch)
    if (file.metadata.has(k("rope.dimension_sections"))) {
      return yield* Effect.fail(
        invalidMetadata(file, k("rope.dimension_sections"), "is set: multi-section RoPE is not supported")
      )
    }
    const gatingKey = k("expert_gating_func")
    const gatingId = yield* getOptional(file, gatingKey, getU32)
    const gating = gatingOf(gatingId)
    if (gating === undefined) {
      return yield* Effect.fail(
        invalidMetadata(file, gatingKey, `= ${gatingId} is not a gating swactor supports (1 softmax, 2 sigmoid)`)
      )
    }
    const nExpertShared = yield* getU32(file, k("expert_shared_count"))
    const nLeadingDense = (yield* getOptional(file, k("leading_dense_block_count"), getU32)) ?? 0
    const moe = yield* readMoeParams(
      file,
      { ...hp, nLayer },
      {
        gating,
        normWeights: (yield* getOptional(file, k("expert_weights_norm"), getBool)) ?? false,
        weightsScale: (yield* getOptional(file, k("expert_weights_scale"), getF32)) ?? 0,
        nExpertShared,
        nLeadingDense
      }
    )
    return { ...hp, nLayer, moe }
  })

const routed = (hp: HParams, il: number) => il >= moeOf(hp).nLeadingDense

/** The llama family's dense feed-forward tensors and ffn_norm (glm4moe: post_attention_norm instead). */
const denseFfn = /^ffn_(gate|up|down)\./

export const glm4moe: ArchModule = {
  name: "glm4moe",
  ropeMode: RopeMode.NEOX,
  hparams: readGlm4Moe,
  blockTensors: (hp, il) => {
    const attention = llamaBlockSpecs(hp, [
      { name: "attn_q_norm.weight", dims: [hp.headDimK], kind: "vector", required: false },
      { name: "attn_k_norm.weight", dims: [hp.headDimK], kind: "vector", required: false },
      { name: "post_attention_norm.weight", dims: [hp.nEmbd], kind: "vector", required: true }
    ]).filter((s) => s.name !== "ffn_norm.weight" && !(routed(hp, il) && denseFfn.test(s.name)))
    if (!routed(hp, il)) return attention
    const moe = moeOf(hp)
    return [
      ...attention,
      ...moeBlockSpecs(hp, moe),
      { name: "exp_probs_b.bias", dims: [moe.nExpert], kind: "vector", required: true }
    ]
  },
  buildOutput: llamaOutputHead,
  buildBlock: (t: Toolkit, w: BlockWeights, x: Ptr) => {
    const h = t.rmsNorm(x, w.get("attn_norm.weight"))
    const { k, q, v } = t.qkv(w, h)
    const qNorm = w.opt("attn_q_norm.weight")
    const kNorm = w.opt("attn_k_norm.weight")
    const qn = qNorm === null ? q : t.rmsNorm(q, qNorm)
    const kn = kNorm === null ? k : t.rmsNorm(k, kNorm)
    const att = t.attention(t.rope(qn), t.rope(kn), v, w.get("attn_output.weight"))
    const ffnIn = t.add(t.outputRows(att), t.outputRows(x))
    const normed = t.rmsNorm(ffnIn, w.get("post_attention_norm.weight"))
    const moe = moeOf(t.hp)
    const ffn =
      t.layer < moe.nLeadingDense ? t.ffnSwiglu(normed, w) : moeFfn(t, w, normed, moe, w.get("exp_probs_b.bias"))
    return t.add(ffn, ffnIn)
  }
}
