/**
 * gemma3 (llama.cpp src/models/gemma3.cpp): token embeddings scaled by sqrt(n_embd); RMS norms on q and k before
 * RoPE NEOX; q scaled by the attention scale before attention (scale 1 inside it); norms after attention and after
 * the feed-forward; a GELU-gated feed-forward; sliding-window blocks (`attention.sliding_window`, one global block
 * every `attention.sliding_window_pattern`) with their own RoPE base (`rope.freq_base_swa`); optional final logit
 * soft-capping.
 */
import { Effect } from "effect"
import { type GgufFile, ModelLoadError } from "../../../domain/gguf.js"
import type { Ptr } from "../../ggml/Bindings.js"
import { getF32, getOptional, getU32 } from "../../gguf/GgufReader.js"
import type { ArchModule } from "../Arch.js"
import { type HParams, RopeMode, type SwaParams } from "../HParams.js"
import { type BlockWeights, llamaBlockSpecs, type Toolkit } from "../Toolkit.js"

const invalid = (file: GgufFile, key: string, message: string) =>
  new ModelLoadError({ path: file.path, reason: "InvalidMetadata", message: `metadata "${key}" ${message}` })

/** A key that must be a single number when present (a per-layer array is refused by name). */
const scalar = <A>(
  file: GgufFile,
  key: string,
  read: (file: GgufFile, key: string) => Effect.Effect<A, ModelLoadError>
): Effect.Effect<A | undefined, ModelLoadError> =>
  Array.isArray(file.metadata.get(key))
    ? Effect.fail(invalid(file, key, "is an array; swactor reads it as one number"))
    : getOptional(file, key, read)

/** llama.cpp's llama_hparams::set_swa_pattern (dense_first = false): block il is global when il % period == period - 1. */
export const swaLayerPattern = (nLayer: number, period: number): ReadonlyArray<boolean> =>
  Array.from({ length: nLayer }, (_, il) => period === 0 || il % period < period - 1)

const gemma3HParams = (file: GgufFile, hp: HParams): Effect.Effect<HParams, ModelLoadError> =>
  Effect.gen(function*() {
    const k = (s: string) => `${hp.arch}.${s}`
    const window = yield* scalar(file, k("attention.sliding_window"), getU32)
    let swa: SwaParams | undefined
    if (window !== undefined && window > 0) {
      const period = (yield* scalar(file, k("attention.sliding_window_pattern"), getU32)) ?? 6
      const base = (yield* scalar(file, k("rope.freq_base_swa"), getF32)) ?? 10000
      if (!(base > 0 && Number.isFinite(base))) {
        return yield* Effect.fail(invalid(file, k("rope.freq_base_swa"), `= ${base} must be > 0`))
      }
      swa = { window, layers: swaLayerPattern(hp.nLayer, period), ropeFreqBase: base, ropeFreqScale: 1 }
    }
    const cap = (yield* scalar(file, k("final_logit_softcapping"), getF32)) ?? 0
    if (!(cap >= 0 && Number.isFinite(cap))) {
      return yield* Effect.fail(invalid(file, k("final_logit_softcapping"), `= ${cap} must be >= 0`))
    }
    // gemma3.cpp: 1/sqrt(n_embd / n_head) for the 62-block (27B) model, else 1/sqrt(head size), in float
    const f = Math.fround
    const d = hp.nLayer === 62 ? Math.floor(hp.nEmbd / hp.nHead) : hp.headDimK
    const kqScale = f(1 / f(Math.sqrt(d)))
    return {
      ...hp,
      kqScale,
      ...(swa === undefined ? {} : { swa }),
      ...(cap > 0 ? { logitSoftcap: cap } : {})
    }
  })

const norm = (name: string, n: number) => ({ name, dims: [n], kind: "vector", required: true }) as const

export const gemma3: ArchModule = {
  name: "gemma3",
  ropeMode: RopeMode.NEOX,
  hparams: gemma3HParams,
  embedScale: (hp) => Math.sqrt(hp.nEmbd),
  blockTensors: (hp) =>
    llamaBlockSpecs(hp, [
      norm("attn_q_norm.weight", hp.headDimK),
      norm("attn_k_norm.weight", hp.headDimK),
      norm("post_attention_norm.weight", hp.nEmbd),
      norm("post_ffw_norm.weight", hp.nEmbd)
    ]),
  buildBlock: (t: Toolkit, w: BlockWeights, x: Ptr) => {
    const g = t.g
    const h = t.rmsNorm(x, w.get("attn_norm.weight"))
    const { k, q, v } = t.qkv(w, h)
    const qr = t.rope(t.rmsNorm(q, w.get("attn_q_norm.weight")))
    const kr = t.rope(t.rmsNorm(k, w.get("attn_k_norm.weight")))
    const qs = g.ggml_scale(t.ctx, qr, t.hp.kqScale)
    const att = t.attention(qs, kr, v, w.get("attn_output.weight"), null, 1)
    const saOut = t.add(t.rmsNorm(t.outputRows(att), w.get("post_attention_norm.weight")), t.outputRows(x))
    const ffnIn = t.rmsNorm(saOut, w.get("ffn_norm.weight"))
    const up = t.linear(w.get("ffn_up.weight"), ffnIn)
    const gate = t.linear(w.get("ffn_gate.weight"), ffnIn)
    const ffn = t.linear(w.get("ffn_down.weight"), g.ggml_geglu_split(t.ctx, gate, up))
    return t.add(t.rmsNorm(ffn, w.get("post_ffw_norm.weight")), saOut)
  },
  buildOutput: (t, w, x) => {
    const logits = t.linear(w.get("output.weight"), t.rmsNorm(x, w.get("output_norm.weight")))
    const cap = t.hp.logitSoftcap
    if (cap === undefined) return logits
    const g = t.g
    const f = Math.fround
    const capped = g.ggml_tanh(t.ctx, g.ggml_scale(t.ctx, logits, f(1 / f(cap))))
    return g.ggml_scale(t.ctx, capped, cap)
  }
}
