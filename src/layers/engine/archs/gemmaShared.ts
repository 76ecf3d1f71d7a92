/**
 * What gemma3 and gemma4 (archs/gemma3.ts, archs/gemma4.ts; llama.cpp src/models/gemma3.cpp, gemma4.cpp) share: the
 * sliding-window blocks' RoPE base and the final logit soft-capping keys, the norms after attention and after the
 * feed-forward, the GELU-gated feed-forward with its residual, and the soft-capped output head.
 */
import { Effect } from "effect"
import type { GgufFile, ModelLoadError } from "../../../domain/gguf.js"
import type { Ptr } from "../../ggml/Bindings.js"
import { getF32 } from "../../gguf/GgufReader.js"
import type { OutputWeights } from "../Arch.js"
import { invalidMetadata, scalarKey } from "../MetadataErrors.js"
import type { BlockWeights, TensorSpec, Toolkit } from "../Toolkit.js"

/** `<arch>.rope.freq_base_swa`: the sliding-window blocks' RoPE base (default 10000, llama_hparams'), > 0. */
export const swaRopeBase = (file: GgufFile, arch: string): Effect.Effect<number, ModelLoadError> =>
  Effect.gen(function* () {
    const key = `${arch}.rope.freq_base_swa`
    const base = (yield* scalarKey(file, key, getF32)) ?? 10000
    if (!(base > 0 && Number.isFinite(base)))
      return yield* Effect.fail(invalidMetadata(file, key, `= ${base} must be > 0`))
    return base
  })

/** `<arch>.final_logit_softcapping` (0 or absent: none), >= 0. */
export const logitSoftcapOf = (
  file: GgufFile,
  arch: string
): Effect.Effect<{ logitSoftcap?: number }, ModelLoadError> =>
  Effect.gen(function* () {
    const key = `${arch}.final_logit_softcapping`
    const cap = (yield* scalarKey(file, key, getF32)) ?? 0
    if (!(cap >= 0 && Number.isFinite(cap)))
      return yield* Effect.fail(invalidMetadata(file, key, `= ${cap} must be >= 0`))
    return cap > 0 ? { logitSoftcap: cap } : {}
  })

/** A required F32 vector of `n` elements. */
export const normSpec = (name: string, n: number): TensorSpec => ({ name, dims: [n], kind: "vector", required: true })

/** The gemma block's q/k norms (head size) and its norms after attention and after the feed-forward. */
export const gemmaNormSpecs = (headDim: number, nEmbd: number): ReadonlyArray<TensorSpec> => [
  normSpec("attn_q_norm.weight", headDim),
  normSpec("attn_k_norm.weight", headDim),
  normSpec("post_attention_norm.weight", nEmbd),
  normSpec("post_ffw_norm.weight", nEmbd)
]

/**
 * After attention (`att`: wo's output): its post-attention norm plus the residual `x`, then the GELU-gated feed-forward
 * (LLM_FFN_GELU, LLM_FFN_PAR) with its post-FFN norm plus that sum. On the model's last block, the output rows only.
 */
export const gemmaAttnResidualAndFfn = (t: Toolkit, w: BlockWeights, x: Ptr, att: Ptr): Ptr => {
  const saOut = t.add(t.rmsNorm(t.outputRows(att), w.get("post_attention_norm.weight")), t.outputRows(x))
  const ffnIn = t.rmsNorm(saOut, w.get("ffn_norm.weight"))
  const up = t.linear(w.get("ffn_up.weight"), ffnIn)
  const gate = t.linear(w.get("ffn_gate.weight"), ffnIn)
  const ffn = t.linear(w.get("ffn_down.weight"), t.g.ggml_geglu_split(t.ctx, gate, up))
  return t.add(t.rmsNorm(ffn, w.get("post_ffw_norm.weight")), saOut)
}

/** Output norm, output projection, then cap * tanh(logits / cap) when the model soft-caps its logits. */
export const gemmaOutput = (t: Toolkit, w: OutputWeights, x: Ptr): Ptr => {
  const logits = t.linear(w.get("output.weight"), t.rmsNorm(x, w.get("output_norm.weight")))
  const cap = t.hp.logitSoftcap
  if (cap === undefined) return logits
  const g = t.g
  const f = Math.fround
  const capped = g.ggml_tanh(t.ctx, g.ggml_scale(t.ctx, logits, f(1 / f(cap))))
  return g.ggml_scale(t.ctx, capped, cap)
}
