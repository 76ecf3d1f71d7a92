/**
 * qwen3moe (llama.cpp src/models/qwen3moe.cpp): qwen3's attention (q/k RMS norms before RoPE NEOX, head size from
 * key_length), then in every block a routed feed-forward: softmax gate, top-k experts, weights normalised to sum 1,
 * no scale, no shared experts (Moe.ts).
 */
import { Effect } from "effect"
import type { Ptr } from "../../ggml/Bindings.js"
import type { ArchModule } from "../Arch.js"
import { RopeMode } from "../HParams.js"
import { moeBlockSpecs, moeFfn, moeOf, readMoeParams } from "../Moe.js"
import { type BlockWeights, llamaBlockSpecs, llamaOutputHead, type Toolkit } from "../Toolkit.js"

/** The llama family's dense feed-forward tensors: a routed block has none. */
const denseFfn = /^ffn_(gate|up|down)\./

export const qwen3moe: ArchModule = {
  name: "qwen3moe",
  ropeMode: RopeMode.NEOX,
  hparams: (file, hp) =>
    Effect.map(readMoeParams(file, hp, { gating: "softmax", normWeights: true }), (moe) => ({ ...hp, moe })),
  blockTensors: (hp) => [
    ...llamaBlockSpecs(hp, [
      { name: "attn_q_norm.weight", dims: [hp.headDimK], kind: "vector", required: true },
      { name: "attn_k_norm.weight", dims: [hp.headDimK], kind: "vector", required: true }
    ]).filter((s) => !denseFfn.test(s.name)),
    ...moeBlockSpecs(hp, moeOf(hp))
  ],
  buildOutput: llamaOutputHead,
  buildBlock: (t: Toolkit, w: BlockWeights, x: Ptr) => {
    const h = t.rmsNorm(x, w.get("attn_norm.weight"))
    const { k, q, v } = t.qkv(w, h)
    const qn = t.rmsNorm(q, w.get("attn_q_norm.weight"))
    const kn = t.rmsNorm(k, w.get("attn_k_norm.weight"))
    const att = t.attention(t.rope(qn), t.rope(kn), v, w.get("attn_output.weight"), w.opt("attn_output.bias"))
    const ffnIn = t.add(t.outputRows(att), t.outputRows(x))
    return t.add(moeFfn(t, w, t.rmsNorm(ffnIn, w.get("ffn_norm.weight")), moeOf(t.hp)), ffnIn)
  }
}
