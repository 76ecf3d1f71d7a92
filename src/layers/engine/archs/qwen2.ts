/** qwen2 (llama.cpp src/models/qwen2.cpp): q/k/v biases, RoPE NEOX, optional output bias. */
import type { Ptr } from "../../ggml/Bindings.js"
import type { ArchModule } from "../Arch.js"
import { RopeMode } from "../HParams.js"
import { type BlockWeights, llamaBlockSpecs, llamaOutputHead, type Toolkit } from "../Toolkit.js"

export const qwen2: ArchModule = {
  name: "qwen2",
  ropeMode: RopeMode.NEOX,
  blockTensors: (hp) => llamaBlockSpecs(hp, [], { qkvBias: true }),
  outputTensors: (hp) => [{ name: "output.bias", dims: [hp.nVocab], kind: "vector", required: false }],
  buildOutput: llamaOutputHead,
  buildBlock: (t: Toolkit, w: BlockWeights, x: Ptr) => {
    const h = t.rmsNorm(x, w.get("attn_norm.weight"))
    const { k, q, v } = t.qkv(w, h)
    const att = t.attention(t.rope(q), t.rope(k), v, w.get("attn_output.weight"), w.opt("attn_output.bias"))
    const ffnIn = t.add(t.outputRows(att), t.outputRows(x))
    return t.add(t.ffnSwiglu(t.rmsNorm(ffnIn, w.get("ffn_norm.weight")), w), ffnIn)
  }
}
