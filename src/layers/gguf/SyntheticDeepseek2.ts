/**
 * Synthetic deepseek2 models (Synthetic.ts's hooks): multi-head latent attention in the absorbed form this llama.cpp
 * loads (src/models/deepseek2.cpp, load_arch_tensors with key_length_mla / value_length_mla set):
 * attn_q_a [hidden, q_lora] + attn_q_a_norm + attn_q_b [q_lora, heads x key_length_mla] (or attn_q when q_lora is 0),
 * attn_kv_a_mqa [hidden, kv_lora + rope] + attn_kv_a_norm, attn_k_b [nope, kv_lora, heads],
 * attn_v_b [kv_lora, value_length_mla, heads], attn_output; the feed-forward as SyntheticMoe.ts writes it (ffn_norm,
 * leading dense blocks, routed blocks with exp_probs_b and shared experts; DeepSeek V3's sigmoid gate, norm, scale 2.5).
 * Metadata: head_count_kv 1, key_length = kv_lora + rope, value_length = kv_lora (the cached row), the *_mla lengths,
 * q_lora_rank / kv_lora_rank, rope.dimension_count = the RoPE part.
 * The tensors described here are written from the engine's declaration (SyntheticTensors.ts); this module keeps the
 * options, their checks and the metadata.
 */
import { type GgufTypedValue, GgufValues } from "./GgufWriter.js"

export interface SyntheticDeepseek2Options {
  /** deepseek2: the latent's size (`attention.kv_lora_rank`, default 64). */
  readonly kvLoraRank?: number
  /** deepseek2: Q's compressed size (`attention.q_lora_rank`, default 64; 0: one attn_q projection). */
  readonly qLoraRank?: number
  /** deepseek2: the RoPE part of each head (`rope.dimension_count`, default half the head size). */
  readonly ropeDim?: number
  /**
   * deepseek2: YaRN as DeepSeek V3 / R1 ship it (`rope.scaling.type` yarn, `factor`, `original_context_length`,
   * `yarn_log_multiplier` as the convert script writes it: mscale_all_dim x 0.1; absent: no multiplier key); default none.
   */
  readonly deepseekYarn?: { readonly factor: number; readonly originalContext: number; readonly logMultiplier?: number }
}

interface Shape extends SyntheticDeepseek2Options {
  readonly arch: string
  readonly hidden: number
  readonly heads: number
  readonly headDim?: number
}

const sizes = (o: Shape) => {
  const head = o.headDim ?? o.hidden / o.heads
  return { head, kvLora: o.kvLoraRank ?? 64, qLora: o.qLoraRank ?? 64, rope: o.ropeDim ?? head / 2 }
}

/** What is wrong with the deepseek2 options, or undefined (also refuses them on another architecture). */
export const validateDeepseek2Options = (o: Shape): string | undefined => {
  const given = (["kvLoraRank", "qLoraRank", "ropeDim", "deepseekYarn"] as const).find((k) => o[k] !== undefined)
  if (o.arch !== "deepseek2") {
    return given === undefined ? undefined : `${given} is a deepseek2 option, not ${o.arch}`
  }
  const y = o.deepseekYarn
  if (y !== undefined) {
    if (!(y.factor > 1 && Number.isFinite(y.factor))) return `deepseekYarn.factor must be > 1, got ${y.factor}`
    if (!(Number.isSafeInteger(y.originalContext) && y.originalContext > 0)) {
      return `deepseekYarn.originalContext must be a positive integer, got ${y.originalContext}`
    }
    const m = y.logMultiplier
    if (m !== undefined && !(m >= 0 && Number.isFinite(m))) return `deepseekYarn.logMultiplier must be >= 0, got ${m}`
  }
  const s = sizes(o)
  // the RoPE part defaults to half a head, and rotates pairs
  if (o.ropeDim === undefined && s.head % 4 !== 0)
    return `deepseek2 rotates half of each head: the head dimension ${s.head} (headDim, or hidden / heads) must be a multiple of 4`
  for (const [k, v] of [
    ["kvLoraRank", s.kvLora],
    ["ropeDim", s.rope]
  ] as const) {
    if (!Number.isSafeInteger(v) || v <= 0) return `${k} must be a positive integer, got ${v}`
  }
  if (!Number.isSafeInteger(s.qLora) || s.qLora < 0) return `qLoraRank must be a non-negative integer, got ${s.qLora}`
  if (s.rope % 2 !== 0 || s.rope >= s.head)
    return `ropeDim (${s.rope}) must be even and below the head size (${s.head})`
  return undefined
}

/** The metadata with deepseek2's attention keys in place of the common head_count_kv / rope.dimension_count. */
export const deepseek2Metadata = (
  md: ReadonlyArray<readonly [string, GgufTypedValue]>,
  o: Shape
): Array<readonly [string, GgufTypedValue]> => {
  const s = sizes(o)
  const a = o.arch
  const replaced = new Set(
    ["attention.head_count_kv", "rope.dimension_count", "attention.key_length", "attention.value_length"].map(
      (k) => `${a}.${k}`
    )
  )
  return [
    ...md.filter(([key]) => !replaced.has(key)),
    [`${a}.attention.head_count_kv`, GgufValues.u32(1)],
    [`${a}.rope.dimension_count`, GgufValues.u32(s.rope)],
    [`${a}.attention.q_lora_rank`, GgufValues.u32(s.qLora)],
    [`${a}.attention.kv_lora_rank`, GgufValues.u32(s.kvLora)],
    [`${a}.attention.key_length`, GgufValues.u32(s.kvLora + s.rope)],
    [`${a}.attention.value_length`, GgufValues.u32(s.kvLora)],
    [`${a}.attention.key_length_mla`, GgufValues.u32(s.head)],
    [`${a}.attention.value_length_mla`, GgufValues.u32(s.head)],
    ...yarnMetadata(a, o.deepseekYarn)
  ]
}

const yarnMetadata = (
  a: string,
  y: SyntheticDeepseek2Options["deepseekYarn"]
): Array<readonly [string, GgufTypedValue]> =>
  y === undefined
    ? []
    : [
        [`${a}.rope.scaling.type`, GgufValues.string("yarn")],
        [`${a}.rope.scaling.factor`, GgufValues.f32(y.factor)],
        [`${a}.rope.scaling.original_context_length`, GgufValues.u32(y.originalContext)],
        ...(y.logMultiplier === undefined
          ? []
          : [[`${a}.rope.scaling.yarn_log_multiplier`, GgufValues.f32(y.logMultiplier)] as const])
      ]
