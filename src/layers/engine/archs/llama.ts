/** llama 2/3 (llama.cpp src/models/llama.cpp): RoPE NORM with optional freq factors, GQA, optional tied output. */
import type { Ptr } from "../../ggml/Bindings.js"
import type { ArchModule } from "../Arch.js"
import { RopeMode } from "../HParams.js"
import { type BlockWeights, llamaBlockSpecs, llamaOutputHead, type Toolkit } from "../Toolkit.js"

export const llama: ArchModule = {
  name: "llama",
  ropeMode: RopeMode.NORM,
  blockTensors: (hp) => llamaBlockSpecs(hp),
  sharedTensors: (hp) => [{ name: "rope_freqs.weight", dims: [hp.nRot / 2], kind: "vector", required: false }],
  buildOutput: llamaOutputHead,
  buildBlock: (t: Toolkit, w: BlockWeights, x: Ptr) => {
    const freqs = w.global("rope_freqs.weight")
    const h = t.rmsNorm(x, w.get("attn_norm.weight"))
    const { k, q, v } = t.qkv(w, h)
    const wo = w.get("attn_output.weight")
    const att = t.attention(t.rope(q, freqs), t.rope(k, freqs), v, wo, w.opt("attn_output.bias"))
    const ffnIn = t.add(t.outputRows(att), t.outputRows(x))
    return t.add(t.ffnSwiglu(t.rmsNorm(ffnIn, w.get("ffn_norm.weight")), w), ffnIn)
  }
}
