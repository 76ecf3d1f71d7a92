/** qwen3 (llama.cpp src/models/qwen3.cpp): RMS norms on q and k before RoPE NEOX, head size from key_length. */
import type { Ptr } from "../../ggml/Bindings.js"
import type { ArchModule } from "../Arch.js"
import { RopeMode } from "../HParams.js"
import { type BlockWeights, llamaBlockSpecs, llamaOutputHead, type Toolkit } from "../Toolkit.js"

export const qwen3: ArchModule = {
  name: "qwen3",
  ropeMode: RopeMode.NEOX,
  blockTensors: (hp) =>
    llamaBlockSpecs(hp, [
      { name: "attn_q_norm.weight", dims: [hp.headDimK], kind: "vector", required: true },
      { name: "attn_k_norm.weight", dims: [hp.headDimK], kind: "vector", required: true }
    ]),
  buildOutput: llamaOutputHead,
  buildBlock: (t: Toolkit, w: BlockWeights, x: Ptr) => {
    const h = t.rmsNorm(x, w.get("attn_norm.weight"))
    const { k, q, v } = t.qkv(w, h)
    const qn = t.rmsNorm(q, w.get("attn_q_norm.weight"))
    const kn = t.rmsNorm(k, w.get("attn_k_norm.weight"))
    const att = t.attention(t.rope(qn), t.rope(kn), v, w.get("attn_output.weight"), w.opt("attn_output.bias"))
    const ffnIn = t.add(t.outputRows(att), t.outputRows(x))
    return t.add(t.ffnSwiglu(t.rmsNorm(ffnIn, w.get("ffn_norm.weight")), w), ffnIn)
  }
}
