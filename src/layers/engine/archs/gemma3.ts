/**
 * gemma3 (llama.cpp src/models/gemma3.cpp): token embeddings scaled by sqrt(n_embd); RMS norms on q and k before
 * RoPE NEOX; q scaled by the attention scale before attention (scale 1 inside it); norms after attention and after
 * the feed-forward; a GELU-gated feed-forward; sliding-window blocks (`attention.sliding_window`, one global block
 * every `attention.sliding_window_pattern`) with their own RoPE base (`rope.freq_base_swa`); optional final logit
 * soft-capping. The parts gemma4 shares are in gemmaShared.ts.
 */
import { Effect } from "effect"
import type { GgufFile, ModelLoadError } from "../../../domain/gguf.js"
import type { Ptr } from "../../ggml/Bindings.js"
import { getU32 } from "../../gguf/GgufReader.js"
import type { ArchModule } from "../Arch.js"
import { type HParams, RopeMode, type SwaParams } from "../HParams.js"
import { scalarKey } from "../MetadataErrors.js"
import { type BlockWeights, llamaBlockSpecs, type Toolkit } from "../Toolkit.js"
import { gemmaAttnResidualAndFfn, gemmaNormSpecs, gemmaOutput, logitSoftcapOf, swaRopeBase } from "./gemmaShared.js"

/** llama.cpp's llama_hparams::set_swa_pattern (dense_first = false): block il is global when il % period == period - 1. */
export const swaLayerPattern = (nLayer: number, period: number): ReadonlyArray<boolean> =>
  Array.from({ length: nLayer }, (_, il) => period === 0 || il % period < period - 1)

const gemma3HParams = (file: GgufFile, hp: HParams): Effect.Effect<HParams, ModelLoadError> =>
  Effect.gen(function* () {
    const k = (s: string) => `${hp.arch}.${s}`
    const window = yield* scalarKey(file, k("attention.sliding_window"), getU32)
    let swa: SwaParams | undefined
    if (window !== undefined && window > 0) {
      const period = (yield* scalarKey(file, k("attention.sliding_window_pattern"), getU32)) ?? 6
      const base = yield* swaRopeBase(file, hp.arch)
      swa = { window, layers: swaLayerPattern(hp.nLayer, period), ropeFreqBase: base, ropeFreqScale: 1 }
    }
    const cap = yield* logitSoftcapOf(file, hp.arch)
    // gemma3.cpp: 1/sqrt(n_embd / n_head) for the 62-block (27B) model, else 1/sqrt(head size), in float
    const f = Math.fround
    const d = hp.nLayer === 62 ? Math.floor(hp.nEmbd / hp.nHead) : hp.headDimK
    const kqScale = f(1 / f(Math.sqrt(d)))
    return { ...hp, kqScale, ...(swa === undefined ? {} : { swa }), ...cap }
  })

export const gemma3: ArchModule = {
  name: "gemma3",
  ropeMode: RopeMode.NEOX,
  hparams: gemma3HParams,
  embedScale: (hp) => Math.sqrt(hp.nEmbd),
  blockTensors: (hp) => llamaBlockSpecs(hp, gemmaNormSpecs(hp.headDimK, hp.nEmbd)),
  buildBlock: (t: Toolkit, w: BlockWeights, x: Ptr) => {
    const g = t.g
    const h = t.rmsNorm(x, w.get("attn_norm.weight"))
    const { k, q, v } = t.qkv(w, h)
    const qr = t.rope(t.rmsNorm(q, w.get("attn_q_norm.weight")))
    const kr = t.rope(t.rmsNorm(k, w.get("attn_k_norm.weight")))
    const qs = g.ggml_scale(t.ctx, qr, t.hp.kqScale)
    const att = t.attention(qs, kr, v, w.get("attn_output.weight"), null, 1)
    return gemmaAttnResidualAndFfn(t, w, x, att)
  },
  buildOutput: gemmaOutput
}
