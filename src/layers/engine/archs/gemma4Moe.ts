/**
 * gemma4's mixture of experts (Gemma 4 26B-A4B; llama.cpp src/models/gemma4.cpp, a block with `ffn_gate_inp`): the
 * dense GELU feed-forward stays as a shared expert and the routed experts run beside it on the same input, each branch
 * with its own norms, the two added before the block's post-FFN norm:
 *
 *   mlp    = post_ffw_norm_1(ffn(ffn_norm(a)))                             (dense GELU-gated, as without experts)
 *   logits = ffn_gate_inp (rms_norm(a) / sqrt(n_embd) * ffn_gate_inp.scale)   (the router reads a, not the norm)
 *   moe    = post_ffw_norm_2(experts(pre_ffw_norm_2(a), softmax, top-k, weights normalised, GELU experts,
 *                                    each chosen expert's output times ffn_down_exps.scale when the file has it))
 *   out    = post_ffw_norm(mlp + moe) + a                                  (a: the attention output plus residual)
 *
 * The expert products are Moe.ts's (ggml_mul_mat_id). The routed gate and up come fused as `ffn_gate_up_exps` [n_embd,
 * 2 x n_ff_exp, n_expert] (gate rows first) in the files the converter writes (the checkpoint's experts.gate_up_proj
 * maps to it as it is), or apart as `ffn_gate_exps` / `ffn_up_exps`; llama.cpp reads both.
 */
import { Effect } from "effect"
import type { GgufFile, ModelLoadError } from "../../../domain/gguf.js"
import type { Ptr } from "../../ggml/Bindings.js"
import type { HParams } from "../HParams.js"
import { moeBlockSpecs, moeFfn, moeOf, readMoeParams } from "../Moe.js"
import type { BlockWeights, TensorSpec, Toolkit } from "../Toolkit.js"
import { normSpec } from "./gemmaShared.js"

/** gemma4's MoE hyperparameters when `expert_count` > 0 (softmax router, weights normalised, no scale); else none. */
export const gemma4MoeParams = (file: GgufFile, hp: HParams): Effect.Effect<Pick<HParams, "moe">, ModelLoadError> =>
  file.metadata.has(`${hp.arch}.expert_count`)
    ? Effect.map(
        readMoeParams(file, hp, { gating: "softmax", normWeights: true, weightsScale: 1, fusedGateUp: true }),
        (moe) => ({ moe })
      )
    : Effect.succeed({})

/** A routed block's tensors beside the dense feed-forward's (none without experts). */
export const gemma4MoeSpecs = (hp: HParams): ReadonlyArray<TensorSpec> =>
  hp.moe === undefined
    ? []
    : [
        ...moeBlockSpecs(hp, hp.moe),
        normSpec("ffn_gate_inp.scale", hp.nEmbd),
        normSpec("pre_ffw_norm_2.weight", hp.nEmbd),
        normSpec("post_ffw_norm_1.weight", hp.nEmbd),
        normSpec("post_ffw_norm_2.weight", hp.nEmbd),
        { name: "ffn_down_exps.scale", dims: [hp.moe.nExpert], kind: "vector", required: false }
      ]

/**
 * After attention (`att`: wo's output) of a routed block: the post-attention norm plus the residual `x`, then the dense
 * and the routed feed-forward added, the post-FFN norm, plus that sum (gemmaShared's gemmaAttnResidualAndFfn with
 * experts). On the model's last block, the output rows only.
 */
export const gemma4AttnResidualAndMoe = (t: Toolkit, w: BlockWeights, x: Ptr, att: Ptr): Ptr => {
  const g = t.g
  const ctx = t.ctx
  const moe = moeOf(t.hp)
  const attnOut = t.add(t.rmsNorm(t.outputRows(att), w.get("post_attention_norm.weight")), t.outputRows(x))
  // the dense feed-forward (the shared expert)
  const mlpIn = t.rmsNorm(attnOut, w.get("ffn_norm.weight"))
  const up = t.linear(w.get("ffn_up.weight"), mlpIn)
  const gate = t.linear(w.get("ffn_gate.weight"), mlpIn)
  const mlp = t.rmsNorm(
    t.linear(w.get("ffn_down.weight"), g.ggml_geglu_split(ctx, gate, up)),
    w.get("post_ffw_norm_1.weight")
  )
  // the routed experts: their own input norm, the router over the un-normed-weight RMS of attnOut
  const moeIn = t.rmsNorm(attnOut, w.get("pre_ffw_norm_2.weight"))
  let routerIn = g.ggml_rms_norm(ctx, attnOut, t.hp.rmsEps)
  routerIn = g.ggml_scale(ctx, routerIn, Math.fround(1 / Math.fround(Math.sqrt(t.hp.nEmbd))))
  routerIn = g.ggml_mul(ctx, routerIn, w.get("ffn_gate_inp.scale"))
  const logits = t.linear(w.get("ffn_gate_inp.weight"), routerIn)
  const routed = moeFfn(t, w, moeIn, moe, null, { logits, activation: "gelu", downScale: w.opt("ffn_down_exps.scale") })
  const experts = t.rmsNorm(routed, w.get("post_ffw_norm_2.weight"))
  return t.add(t.rmsNorm(g.ggml_add(ctx, mlp, experts), w.get("post_ffw_norm.weight")), attnOut)
}
