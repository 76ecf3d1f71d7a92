/**
 * Position-dependent scaling beyond plain RoPE, as llama.cpp computes it:
 * - YaRN (`rope.scaling.type` = yarn): ggml_rope_ext's ext_factor, attn_factor, beta_fast and beta_slow, derived the
 *   way llama_context's constructor derives them (src/llama-context.cpp): ext_factor 1; attn_factor = mscale(factor)
 *   (or mscale(factor, 1) / mscale(factor, yarn_log_multiplier) when that key is set), times 1 / (1 + 0.1 ln factor)
 *   which cancels the magnitude correction ggml's rope applies itself, times `rope.scaling.attn_factor`.
 * - Attention temperature (llama 4, mistral3: `attention.temperature_scale`): q of a token at position p is multiplied
 *   by log(floor((p + offset) / floor_scale) + 1) * scale + 1 (llm_graph_input_attn_temp::set_input).
 * Every step in float where llama.cpp computes in float.
 */

/** ggml_rope_ext's extrapolation settings. */
export interface RopeExt {
  readonly extFactor: number
  readonly attnFactor: number
  readonly betaFast: number
  readonly betaSlow: number
}

/** Plain RoPE: no YaRN mixing, no magnitude correction (ggml's defaults as llama.cpp passes them without YaRN). */
export const PLAIN_ROPE: RopeExt = { extFactor: 0, attnFactor: 1, betaFast: 32, betaSlow: 1 }

const f = Math.fround

/** llama.cpp's get_mscale in float: 0.1 * mscale * ln(scale) + 1 above a scale of 1. */
const mscale = (scale: number, m: number) => (scale <= 1 ? 1 : f(f(f(f(0.1) * f(m)) * f(Math.log(scale))) + 1))

/**
 * YaRN's ggml_rope_ext settings for a model whose RoPE frequency scale is `freqScale` (1 / rope.scaling.factor, as a
 * float): `logMul` = rope.scaling.yarn_log_multiplier (0: absent), `ropeAttnFactor` = rope.scaling.attn_factor (1).
 */
export const yarnRopeExt = (
  freqScale: number,
  options: {
    readonly logMul: number
    readonly betaFast: number
    readonly betaSlow: number
    readonly ropeAttnFactor: number
  }
): RopeExt => {
  const factor = f(1 / f(freqScale))
  let attn = options.logMul !== 0 ? f(mscale(factor, 1) / mscale(factor, options.logMul)) : mscale(factor, 1)
  attn = f(attn * f(1 / f(1 + f(f(0.1) * f(Math.log(factor))))))
  attn = f(attn * f(options.ropeAttnFactor))
  return { extFactor: 1, attnFactor: attn, betaFast: f(options.betaFast), betaSlow: f(options.betaSlow) }
}

/** Attention temperature tuning: q scaled per position. */
export interface AttnTemp {
  /** `attention.temperature_scale` (non-zero). */
  readonly scale: number
  /** Positions per step (llama.cpp's n_attn_temp_floor_scale: mistral3 takes the YaRN original context). */
  readonly floorScale: number
  /** Added to the position first (mistral3: 0). */
  readonly offset: number
}

/** The factor q is multiplied by at each position (llama.cpp: double arithmetic on a float position, stored as float). */
export const attnTempScales = (t: AttnTemp, positions: Int32Array): Float32Array =>
  Float32Array.from(positions, (p) => {
    const step = Math.floor(f(f(p + t.offset) / t.floorScale))
    return Math.log(step + 1) * f(t.scale) + 1
  })
