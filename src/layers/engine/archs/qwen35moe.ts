/**
 * qwen35moe (Qwen3.5's mixture of experts, llama.cpp src/models/qwen35moe.cpp): qwen35's hybrid stack (archs/qwen35.ts:
 * gated DeltaNet blocks and, every `full_attention_interval`th, a gated full-attention block; the same norms,
 * residuals, IMROPE check and recurrent state), with every block's feed-forward routed (Moe.ts): softmax gate, top-k,
 * the k weights normalised to sum 1, no scale (llama.cpp reads no expert_weights_scale for it); plus one shared
 * SwiGLU expert of `expert_shared_feed_forward_length` (default feed_forward_length) whose output is multiplied by
 * sigmoid(ffn_gate_inp_shexp x), one gate per token, before it is added to the routed sum. The shared expert is
 * required, as llama.cpp's loader requires it. MTP blocks (`nextn_predict_layers`) are left out as in qwen35.ts: the
 * stages cover the trunk only.
 */
import { Effect } from "effect"
import { getOptional, getU32 } from "../../gguf/GgufReader.js"
import type { ArchModule } from "../Arch.js"
import { moeBlockSpecs, moeFfn, moeOf, readMoeParams } from "../Moe.js"
import { qwen35, qwen35Block, qwen35HParams, qwen35MixerTensors } from "./qwen35.js"

export const qwen35moe: ArchModule = {
  ...qwen35,
  name: "qwen35moe",
  hparams: (file, hp) =>
    Effect.gen(function* () {
      const hybrid = yield* qwen35HParams(file, hp)
      const sharedKey = `${hp.arch}.expert_shared_feed_forward_length`
      const shared = (yield* getOptional(file, sharedKey, getU32)) ?? 0
      const moe = yield* readMoeParams(file, hybrid, {
        gating: "softmax",
        normWeights: true,
        nFfShared: shared > 0 ? shared : hp.nFf,
        sharedGate: true,
        fusedGateUp: true
      })
      return { ...hybrid, moe }
    }),
  blockTensors: (hp, il) => [...qwen35MixerTensors(hp, il), ...moeBlockSpecs(hp, moeOf(hp))],
  buildBlock: qwen35Block((t, w, normed) => moeFfn(t, w, normed, moeOf(t.hp)))
}
