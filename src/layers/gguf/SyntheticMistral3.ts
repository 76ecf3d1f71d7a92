/**
 * The mistral3 parts of a synthetic model (Synthetic.ts): llama's tensors with mistral3's metadata, YaRN RoPE scaling
 * (as Ministral 3 ships: `rope.scaling.type` yarn, factor, original context, beta_fast 32, beta_slow 1, log multiplier
 * 1) and attention temperature tuning (`attention.temperature_scale`), both on by default and small enough that a
 * short test crosses the original context.
 *
 * With `experts` (SyntheticMoe.ts's options): the mixture-of-experts variant llama.cpp's mistral3.cpp builds, every
 * block routed (`ffn_norm`, `ffn_gate_inp`, stacked `ffn_{gate,up,down}_exps`, no shared expert), `expert_count` and
 * `expert_used_count` written. llama.cpp sizes mistral3's experts by `feed_forward_length` (it reads no
 * `expert_feed_forward_length`), so the file's `feed_forward_length` is the experts' width: `expertFfn`, default `ffn`.
 */
import type { GgufTypedValue } from "./GgufWriter.js"
import { GgufValues } from "./GgufWriter.js"
import type { SyntheticMoeOptions } from "./SyntheticMoe.js"

/** mistral3 options of a synthetic model. */
export interface SyntheticMistral3Options {
  /** `rope.scaling.factor` of YaRN; default 4; 0 writes no RoPE scaling at all. */
  readonly yarnFactor?: number
  /** `rope.scaling.original_context_length`; default the context length / 8 (at least 1). */
  readonly yarnOriginalContext?: number
  /** `rope.scaling.yarn_log_multiplier`; default 1. */
  readonly yarnLogMultiplier?: number
  /** `attention.temperature_scale`; default 0.1; 0 writes none. */
  readonly attnTemperatureScale?: number
}

/** What is wrong with the mistral3 options, or undefined. */
export const validateMistral3Options = (o: SyntheticMistral3Options): string | undefined => {
  const f = o.yarnFactor
  if (f !== undefined && !(f === 0 || (f >= 1 && Number.isFinite(f)))) return `yarnFactor must be 0 or >= 1, got ${f}`
  const c = o.yarnOriginalContext
  if (c !== undefined && !(Number.isSafeInteger(c) && c > 0))
    return `yarnOriginalContext must be a positive integer, got ${c}`
  const m = o.yarnLogMultiplier
  if (m !== undefined && !Number.isFinite(m)) return `yarnLogMultiplier must be finite, got ${m}`
  const t = o.attnTemperatureScale
  if (t !== undefined && !(t >= 0 && Number.isFinite(t))) return `attnTemperatureScale must be >= 0, got ${t}`
  return undefined
}

/** Whether a synthetic mistral3 is the mixture-of-experts variant (every block routed). */
export const isMistral3Moe = (o: { readonly arch: string } & SyntheticMoeOptions): boolean =>
  o.arch === "mistral3" && o.experts !== undefined

/** mistral3's `feed_forward_length`: the experts' width when it has experts (llama.cpp's n_ff sizes them). */
export const mistral3Ffn = (o: { readonly arch: string; readonly ffn: number } & SyntheticMoeOptions): number =>
  isMistral3Moe(o) ? (o.expertFfn ?? o.ffn) : o.ffn

/** mistral3's own metadata keys (YaRN, attention temperature, expert counts) for a model of `contextLength`. */
export const mistral3Metadata = (
  o: SyntheticMistral3Options & SyntheticMoeOptions,
  contextLength: number
): Array<readonly [string, GgufTypedValue]> => {
  const md: Array<readonly [string, GgufTypedValue]> = []
  if (o.experts !== undefined) {
    md.push(
      ["mistral3.expert_count", GgufValues.u32(o.experts)],
      ["mistral3.expert_used_count", GgufValues.u32(o.expertsUsed ?? 2)]
    )
  }
  const factor = o.yarnFactor ?? 4
  const original = o.yarnOriginalContext ?? Math.max(1, Math.floor(contextLength / 8))
  if (factor > 0) {
    md.push(
      ["mistral3.rope.scaling.type", GgufValues.string("yarn")],
      ["mistral3.rope.scaling.factor", GgufValues.f32(factor)],
      ["mistral3.rope.scaling.original_context_length", GgufValues.u32(original)],
      ["mistral3.rope.scaling.yarn_beta_fast", GgufValues.f32(32)],
      ["mistral3.rope.scaling.yarn_beta_slow", GgufValues.f32(1)],
      ["mistral3.rope.scaling.yarn_log_multiplier", GgufValues.f32(o.yarnLogMultiplier ?? 1)]
    )
  } else if (o.yarnOriginalContext !== undefined) {
    md.push(["mistral3.rope.scaling.original_context_length", GgufValues.u32(original)])
  }
  const temp = o.attnTemperatureScale ?? 0.1
  if (temp > 0) md.push(["mistral3.attention.temperature_scale", GgufValues.f32(temp)])
  return md
}
