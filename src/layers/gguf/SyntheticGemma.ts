/**
 * The gemma3 parts of a synthetic model (Synthetic.ts): its options and metadata (sliding window, window pattern, the
 * sliding-window blocks' RoPE base, optional final logit soft-capping). Its tensors, gemma3's extra per-block norms
 * included, are written from the engine's declaration (SyntheticTensors.ts).
 */
import type { GgufTypedValue } from "./GgufWriter.js"
import { GgufValues } from "./GgufWriter.js"

/** gemma3 options of a synthetic model. */
export interface SyntheticGemmaOptions {
  /** Sliding window of the local blocks; default 32 (small, so that short tests slide it). */
  readonly slidingWindow?: number
  /** One global block every `swaPattern` blocks (llama.cpp's sliding_window_pattern); default 6 (5 local : 1 global). */
  readonly swaPattern?: number
  /** Written as final_logit_softcapping when given. */
  readonly logitSoftcap?: number
}

const GEMMA_DEFAULT_WINDOW = 32
const GEMMA_DEFAULT_PATTERN = 6

/** The architectures with sliding-window blocks (slidingWindow, swaPattern) and those that soft-cap their logits. */
const windowArchs: ReadonlyArray<string> = ["gemma3", "gemma4", "gpt-oss"]
const softcapArchs: ReadonlyArray<string> = ["gemma3", "gemma4"]

/** What is wrong with the gemma3 options (also on gpt-oss's window, refused on other architectures), or undefined. */
export const validateGemmaOptions = (o: SyntheticGemmaOptions & { readonly arch: string }): string | undefined => {
  if (!windowArchs.includes(o.arch) && (o.slidingWindow !== undefined || o.swaPattern !== undefined))
    return `slidingWindow and swaPattern are for ${windowArchs.join(", ")} only, not ${o.arch}`
  if (!softcapArchs.includes(o.arch) && o.logitSoftcap !== undefined)
    return `logitSoftcap is for ${softcapArchs.join(", ")} only, not ${o.arch}`
  const w = o.slidingWindow
  if (w !== undefined && !(Number.isSafeInteger(w) && w > 0))
    return `slidingWindow must be a positive integer, got ${w}`
  const p = o.swaPattern
  if (p !== undefined && !(Number.isSafeInteger(p) && p > 0)) return `swaPattern must be a positive integer, got ${p}`
  // llama.cpp aborts on a sliding-window model without a sliding block (GGML_ASSERT(hparams.is_swa_any()))
  if (p === 1) return `swaPattern 1 makes every block global; llama.cpp needs a sliding-window block: 2 or more`
  const c = o.logitSoftcap
  if (c !== undefined && !(c > 0 && Number.isFinite(c))) return `logitSoftcap must be > 0, got ${c}`
  return undefined
}

/** The sliding window the options ask for (default 32). */
export const windowOf = (o: SyntheticGemmaOptions): number => o.slidingWindow ?? GEMMA_DEFAULT_WINDOW

/** One global block every this many blocks (default 6). */
export const swaPeriodOf = (o: SyntheticGemmaOptions): number => o.swaPattern ?? GEMMA_DEFAULT_PATTERN

/** gemma3's own metadata keys. */
export const gemmaMetadata = (o: SyntheticGemmaOptions): Array<readonly [string, GgufTypedValue]> => {
  const md: Array<readonly [string, GgufTypedValue]> = [
    ["gemma3.attention.sliding_window", GgufValues.u32(windowOf(o))],
    ["gemma3.attention.sliding_window_pattern", GgufValues.u32(swaPeriodOf(o))],
    ["gemma3.rope.freq_base_swa", GgufValues.f32(10_000)]
  ]
  if (o.logitSoftcap !== undefined) md.push(["gemma3.final_logit_softcapping", GgufValues.f32(o.logitSoftcap)])
  return md
}
