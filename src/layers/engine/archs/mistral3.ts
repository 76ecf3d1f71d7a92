/**
 * mistral3 (llama.cpp src/models/mistral3.cpp): the llama block (RoPE NORM with optional freq factors, GQA, SwiGLU,
 * optional attn_output / FFN biases, optional tied output) with its own hyperparameters: YaRN's beta_fast, beta_slow
 * and yarn_log_multiplier (`rope.scaling.*`, applied when `rope.scaling.type` is yarn), and optional attention
 * temperature tuning (`attention.temperature_scale`: q times log(floor(pos / n_ctx_orig_yarn) + 1) * scale + 1, the
 * YaRN original context being the floor scale). The attention scale is always 1/sqrt(head size) (mistral3 reads no
 * `attention.scale`).
 *
 * Its mixture-of-experts variant (`expert_count` > 0): every block routes its feed-forward (ffn_norm, then llama.cpp's
 * build_moe_ffn through Moe.ts): softmax gate, top `expert_used_count` experts, their weights normalised to sum 1, no
 * scale (mistral3 reads no `expert_weights_scale`), no shared expert and no leading dense blocks (it reads neither
 * count). Each expert is `feed_forward_length` wide: llama.cpp sizes mistral3's ffn_*_exps by n_ff and reads no
 * `expert_feed_forward_length`. swactor requires ffn_gate_exps (llama.cpp would run silu(up) without it).
 */
import { Effect } from "effect"
import type { GgufFile, ModelLoadError } from "../../../domain/gguf.js"
import type { Ptr } from "../../ggml/Bindings.js"
import { getF32, getOptional, getU32 } from "../../gguf/GgufReader.js"
import type { ArchModule } from "../Arch.js"
import { type HParams, RopeMode } from "../HParams.js"
import { moeBlockSpecs, moeFfn, readMoeParams } from "../Moe.js"
import { type AttnTemp, PLAIN_ROPE, type RopeExt, yarnRopeExt } from "../PositionScaling.js"
import { type BlockWeights, llamaBlockSpecs, llamaOutputHead, type Toolkit } from "../Toolkit.js"
import { invalidMetadata, scalarKey } from "../MetadataErrors.js"

/** A float key that must be one finite number when present (a per-layer array is refused by name). */
const finiteScalar = (file: GgufFile, key: string): Effect.Effect<number | undefined, ModelLoadError> =>
  Effect.gen(function* () {
    const v = yield* scalarKey(file, key, getF32)
    if (v !== undefined && !Number.isFinite(v))
      return yield* Effect.fail(invalidMetadata(file, key, `= ${v} must be finite`))
    return v
  })

const mistral3HParams = (file: GgufFile, hp: HParams): Effect.Effect<HParams, ModelLoadError> =>
  Effect.gen(function* () {
    const k = (s: string) => `${hp.arch}.${s}`
    const experts = yield* getOptional(file, k("expert_count"), getU32)
    // llama.cpp (llama-model.cpp load_hparams): n_expert 0 asserts expert_used_count 0
    const used = experts === undefined || experts === 0 ? yield* getOptional(file, k("expert_used_count"), getU32) : 0
    if (used !== undefined && used > 0) {
      return yield* Effect.fail(
        invalidMetadata(file, k("expert_used_count"), `= ${used} without experts ("${k("expert_count")}" absent or 0)`)
      )
    }
    const moe =
      experts === undefined || experts === 0
        ? undefined
        : yield* readMoeParams(file, hp, { gating: "softmax", normWeights: true, weightsScale: 0, nFfExp: hp.nFf })
    const betaFast = (yield* finiteScalar(file, k("rope.scaling.yarn_beta_fast"))) ?? 32
    const betaSlow = (yield* finiteScalar(file, k("rope.scaling.yarn_beta_slow"))) ?? 1
    const logMul = (yield* finiteScalar(file, k("rope.scaling.yarn_log_multiplier"))) ?? 0
    const ropeAttnFactor = (yield* finiteScalar(file, k("rope.scaling.attn_factor"))) ?? 1
    // YaRN (HParams.ts accepted rope.scaling.type yarn and its factor): again with mistral3's own keys
    const ropeExt: RopeExt =
      hp.ropeExt === undefined
        ? { ...PLAIN_ROPE, betaFast: Math.fround(betaFast), betaSlow: Math.fround(betaSlow) }
        : yarnRopeExt(hp.ropeFreqScale, { logMul, betaFast, betaSlow, ropeAttnFactor })
    const tempScale = (yield* finiteScalar(file, k("attention.temperature_scale"))) ?? 0
    // llama.cpp: n_attn_temp_floor_scale = n_ctx_orig_yarn (rope.scaling.original_context_length, else the training
    // context), which HParams.ts has read as nCtxOrig and checked > 0
    const attnTemp: AttnTemp | undefined =
      tempScale === 0 ? undefined : { scale: tempScale, floorScale: hp.nCtxOrig, offset: 0 }
    if (!(Number.isSafeInteger(hp.nCtxOrig) && hp.nCtxOrig > 0)) {
      return yield* Effect.fail(
        invalidMetadata(file, k("rope.scaling.original_context_length"), `= ${hp.nCtxOrig} must be > 0`)
      )
    }
    const f = Math.fround
    return {
      ...hp,
      kqScale: f(1 / f(Math.sqrt(hp.headDimK))),
      ropeExt,
      ...(attnTemp === undefined ? {} : { attnTemp }),
      ...(moe === undefined ? {} : { moe })
    }
  })

/** The llama family's dense feed-forward tensors (and their optional biases): a routed block has none. */
const denseFfn = /^ffn_(gate|up|down)\./

export const mistral3: ArchModule = {
  name: "mistral3",
  ropeMode: RopeMode.NORM,
  hparams: mistral3HParams,
  blockTensors: (hp) =>
    hp.moe === undefined
      ? llamaBlockSpecs(hp)
      : [...llamaBlockSpecs(hp).filter((s) => !denseFfn.test(s.name)), ...moeBlockSpecs(hp, hp.moe)],
  sharedTensors: (hp) => [{ name: "rope_freqs.weight", dims: [hp.nRot / 2], kind: "vector", required: false }],
  buildOutput: llamaOutputHead,
  buildBlock: (t: Toolkit, w: BlockWeights, x: Ptr) => {
    const freqs = w.global("rope_freqs.weight")
    const h = t.rmsNorm(x, w.get("attn_norm.weight"))
    const { k, q, v } = t.qkv(w, h)
    const qr = t.attnTemperature(t.rope(q, freqs))
    const att = t.attention(qr, t.rope(k, freqs), v, w.get("attn_output.weight"), w.opt("attn_output.bias"))
    const ffnIn = t.add(t.outputRows(att), t.outputRows(x))
    const normed = t.rmsNorm(ffnIn, w.get("ffn_norm.weight"))
    const moe = t.hp.moe
    return t.add(moe === undefined ? t.ffnSwiglu(normed, w) : moeFfn(t, w, normed, moe), ffnIn)
  }
}
