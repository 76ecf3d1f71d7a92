/**
 * The gemma4 parts of a synthetic model (Synthetic.ts): gemma3's per-block norms (SyntheticGemma.ts) plus a per-block
 * `layer_output_scale`, one model-wide `rope_freqs` (the global blocks' RoPE frequency factors), and gemma4's metadata:
 * the sliding-window pattern as one bool per block (true: the block slides), the sliding-window blocks' own head sizes
 * (`attention.key_length_swa`, equal to the global ones here) and no per-layer embeddings
 * (`embedding_length_per_layer_input` 0). With `kEqV` the global blocks have no attn_v (V is K's projection, as
 * Gemma 4's global layers ship). With `swaHeadDim` / `globalKvHeads` the two kinds of block get their own head sizes
 * and KV head counts, as the 31B's (sliding-window blocks: 256-wide heads, 16 KV heads; global ones 512-wide, 4):
 * `attention.key_length_swa`, `value_length_swa`, `rope.dimension_count_swa` and one `head_count_kv` per block.
 * With `doubleWideSharedFfn` the shared-KV blocks' feed-forward is twice as wide (E2B; `feed_forward_length` per block).
 * The tensors described here are written from the engine's declaration (SyntheticTensors.ts); this module keeps the
 * options, their checks and the metadata.
 */
import { GgufValueType } from "../../domain/gguf.js"
import type { GgufTypedValue } from "./GgufWriter.js"
import { GgufValues } from "./GgufWriter.js"
import { kvShareSources } from "../../services/KvShare.js"
import { type SyntheticGemmaOptions, swaPeriodOf, windowOf } from "./SyntheticGemma.js"
import type { SyntheticMoeOptions } from "./SyntheticMoe.js"

/** gemma4 options of a synthetic model (besides gemma3's window, pattern and soft-capping). */
export interface SyntheticGemma4Options extends SyntheticGemmaOptions {
  /** Global blocks without attn_v.weight (V = K's projection); default false. */
  readonly kEqV?: boolean
  /** Per-layer embeddings (E2B/E4B): `embedding_length_per_layer_input` and its tensors; default 0 (none). */
  readonly perLayerEmbd?: number
  /** Blocks at the end that read an earlier block's KV cache (`attention.shared_kv_layers`); default none. */
  readonly sharedKvLayers?: number
  /** Head size of the sliding-window blocks (key_length_swa); default the model's head size. */
  readonly swaHeadDim?: number
  /** KV heads of the global blocks (head_count_kv becomes one count per block); default kvHeads. */
  readonly globalKvHeads?: number
  /**
   * The shared-KV blocks' feed-forward twice as wide as the others' (E2B's use_double_wide_mlp): `feed_forward_length`
   * becomes one width per block, as llama.cpp's converter writes it; default false.
   */
  readonly doubleWideSharedFfn?: boolean
}

/** Block il's feed-forward width (`ffn` the model's): doubled on a shared-KV block with `doubleWideSharedFfn`. */
export const gemma4BlockFfn = (
  o: SyntheticGemma4Options & { readonly layers: number },
  il: number,
  ffn: number
): number => (o.doubleWideSharedFfn === true && il >= o.layers - (o.sharedKvLayers ?? 0) ? ffn * 2 : ffn)

/** `feed_forward_length`: one width, or one per block with `doubleWideSharedFfn` (llama.cpp's converter). */
export const gemma4FfnValue = (
  o: SyntheticGemma4Options & { readonly layers: number; readonly ffn: number }
): GgufTypedValue =>
  o.doubleWideSharedFfn === true
    ? GgufValues.array(
        GgufValueType.UINT32,
        Array.from({ length: o.layers }, (_, il) => gemma4BlockFfn(o, il, o.ffn))
      )
    : GgufValues.u32(o.ffn)

/** gemma4's experts (26B-A4B) when `experts` is given: count, used per token (default 2), expert width (default ffn). */
const gemma4MoeShape = (o: SyntheticGemma4Options & SyntheticMoeOptions & { readonly ffn?: number }) =>
  o.experts === undefined ? undefined : { experts: o.experts, used: o.expertsUsed ?? 2, ffn: o.expertFfn ?? o.ffn ?? 0 }

/** The options only gemma4 files carry. */
const gemma4Only = [
  "kEqV",
  "perLayerEmbd",
  "sharedKvLayers",
  "swaHeadDim",
  "globalKvHeads",
  "doubleWideSharedFfn"
] as const

/** What is wrong with the gemma4 head options (of a model of `heads` query heads), or undefined. */
export const validateGemma4Options = (
  o: SyntheticGemma4Options & { readonly arch: string; readonly heads: number; readonly layers: number }
): string | undefined => {
  if (o.arch !== "gemma4") {
    const given = gemma4Only.find((k) => o[k] !== undefined && o[k] !== false)
    return given === undefined ? undefined : `${given} is a gemma4 option, not ${o.arch}`
  }
  // llama.cpp's gemma4 cache asserts n_layer_kv_from_start >= 2 for every model, KV sharing or not
  if (o.layers < 2) return `layers must be at least 2 for gemma4 (llama.cpp keeps at least 2 blocks' caches)`
  const w = o.perLayerEmbd
  if (w !== undefined && !(Number.isSafeInteger(w) && w >= 0)) return `perLayerEmbd must be an integer >= 0, got ${w}`
  // llama.cpp keeps at least 2 blocks' caches, and each shared block reads a block of its own kind (else it aborts)
  const shared = o.sharedKvLayers
  if (shared !== undefined) {
    if (!(Number.isSafeInteger(shared) && shared >= 0 && shared <= o.layers - 2)) {
      return `sharedKvLayers must be between 0 and layers - 2 (${o.layers - 2}), got ${shared}`
    }
    const slides = gemma4SwaBlocks(o, o.layers)
    const sources = kvShareSources(o.layers, shared, slides)
    const bad = sources.findIndex((src, il) => slides[src] !== slides[il])
    if (bad >= 0)
      return `sharedKvLayers ${shared}: block ${bad} would read the cache of block ${sources[bad]}, of the other kind`
  }
  const d = o.swaHeadDim
  if (d !== undefined && !(Number.isSafeInteger(d) && d > 0 && d % 2 === 0))
    return `swaHeadDim must be even and > 0, got ${d}`
  const kv = o.globalKvHeads
  if (kv !== undefined && !(Number.isSafeInteger(kv) && kv > 0 && o.heads % kv === 0)) {
    return `globalKvHeads must divide heads (${o.heads}), got ${kv}`
  }
  return undefined
}

/** `head_count_kv`: one count for all blocks, or one per block when the global blocks have their own. */
export const gemma4KvHeadsValue = (
  o: SyntheticGemma4Options & { readonly kvHeads: number; readonly layers: number }
): GgufTypedValue =>
  o.globalKvHeads === undefined
    ? GgufValues.u32(o.kvHeads)
    : GgufValues.array(
        GgufValueType.UINT32,
        gemma4SwaBlocks(o, o.layers).map((s) => (s ? o.kvHeads : o.globalKvHeads!))
      )

/** Per block: does block il slide? (gemma3's period read as llama.cpp's set_swa_pattern: il % period < period - 1) */
export const gemma4SwaBlocks = (o: SyntheticGemmaOptions, layers: number): ReadonlyArray<boolean> => {
  const period = swaPeriodOf(o)
  return Array.from({ length: layers }, (_, il) => il % period < period - 1)
}

/** gemma4's own metadata keys (the model's head size `hd`, `layers` blocks). */
export const gemma4Metadata = (
  o: SyntheticGemma4Options & SyntheticMoeOptions & { readonly ffn?: number },
  layers: number,
  hd: number
): Array<readonly [string, GgufTypedValue]> => {
  const md: Array<readonly [string, GgufTypedValue]> = [
    ["gemma4.attention.sliding_window", GgufValues.u32(windowOf(o))],
    ["gemma4.attention.sliding_window_pattern", GgufValues.array(GgufValueType.BOOL, gemma4SwaBlocks(o, layers))],
    ["gemma4.rope.freq_base_swa", GgufValues.f32(10_000)],
    ["gemma4.attention.key_length_swa", GgufValues.u32(o.swaHeadDim ?? hd)],
    ["gemma4.attention.value_length_swa", GgufValues.u32(o.swaHeadDim ?? hd)],
    ["gemma4.embedding_length_per_layer_input", GgufValues.u32(o.perLayerEmbd ?? 0)]
  ]
  if (o.sharedKvLayers !== undefined) md.push(["gemma4.attention.shared_kv_layers", GgufValues.u32(o.sharedKvLayers)])
  if (o.logitSoftcap !== undefined) md.push(["gemma4.final_logit_softcapping", GgufValues.f32(o.logitSoftcap)])
  if (o.swaHeadDim !== undefined) md.push(["gemma4.rope.dimension_count_swa", GgufValues.u32(o.swaHeadDim)])
  const moe = gemma4MoeShape(o)
  if (moe !== undefined) {
    md.push(
      ["gemma4.expert_count", GgufValues.u32(moe.experts)],
      ["gemma4.expert_used_count", GgufValues.u32(moe.used)],
      ["gemma4.expert_feed_forward_length", GgufValues.u32(moe.ffn)]
    )
  }
  return md
}
