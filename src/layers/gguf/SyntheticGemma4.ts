/**
 * The gemma4 parts of a synthetic model (Synthetic.ts): gemma3's per-block norms (SyntheticGemma.ts) plus a per-block
 * `layer_output_scale`, one model-wide `rope_freqs` (the global blocks' RoPE frequency factors), and gemma4's metadata:
 * the sliding-window pattern as one bool per block (true: the block slides), the sliding-window blocks' own head sizes
 * (`attention.key_length_swa`, equal to the global ones here) and no per-layer embeddings
 * (`embedding_length_per_layer_input` 0). With `kEqV` the global blocks have no attn_v (V is K's projection, as
 * Gemma 4's global layers ship).
 */
import { GgufValueType } from "../../domain/gguf.js"
import type { GgufTypedValue } from "./GgufWriter.js"
import { GgufValues } from "./GgufWriter.js"
import { type SyntheticGemmaOptions, swaPeriodOf, windowOf } from "./SyntheticGemma.js"

/** gemma4 options of a synthetic model (besides gemma3's window, pattern and soft-capping). */
export interface SyntheticGemma4Options extends SyntheticGemmaOptions {
  /** Global blocks without attn_v.weight (V = K's projection); default false. */
  readonly kEqV?: boolean
}

/** Per block: does block il slide? (gemma3's period read as llama.cpp's set_swa_pattern: il % period < period - 1) */
export const gemma4SwaBlocks = (o: SyntheticGemmaOptions, layers: number): ReadonlyArray<boolean> => {
  const period = swaPeriodOf(o)
  return Array.from({ length: layers }, (_, il) => il % period < period - 1)
}

/** The model-wide tensors of gemma4: RoPE frequency factors of the global blocks (head size / 2). */
export const gemma4SharedTensors = (headDim: number) => [
  { name: "rope_freqs.weight", dims: [headDim / 2], mean: 1.5, std: 0.5 }
] as const

/** gemma4's extra tensor of block `b` besides gemma3's norms: the scalar the block output is multiplied by. */
export const gemma4LayerScale = (b: string) => ({ name: `${b}.layer_output_scale.weight`, dims: [1], mean: 1, std: 0.2 })

/** gemma4's own metadata keys (the model's head size `hd`, `layers` blocks). */
export const gemma4Metadata = (
  o: SyntheticGemmaOptions,
  layers: number,
  hd: number
): Array<readonly [string, GgufTypedValue]> => {
  const md: Array<readonly [string, GgufTypedValue]> = [
    ["gemma4.attention.sliding_window", GgufValues.u32(windowOf(o))],
    ["gemma4.attention.sliding_window_pattern", GgufValues.array(GgufValueType.BOOL, gemma4SwaBlocks(o, layers))],
    ["gemma4.rope.freq_base_swa", GgufValues.f32(10_000)],
    ["gemma4.attention.key_length_swa", GgufValues.u32(hd)],
    ["gemma4.attention.value_length_swa", GgufValues.u32(hd)],
    ["gemma4.embedding_length_per_layer_input", GgufValues.u32(0)]
  ]
  if (o.logitSoftcap !== undefined) md.push(["gemma4.final_logit_softcapping", GgufValues.f32(o.logitSoftcap)])
  return md
}
