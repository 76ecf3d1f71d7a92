/**
 * The qwen35 parts of a synthetic model (Synthetic.ts), after llama.cpp's src/models/qwen35.cpp loader: Qwen3.5's
 * hybrid stack of gated DeltaNet linear-attention blocks and gated full-attention blocks, one full-attention block
 * every `full_attention_interval` (default 4: three DeltaNet blocks, then one attention block, as Qwen3.5 ships).
 *
 * Every block: attn_norm, post_attention_norm (the feed-forward's input norm; there is no ffn_norm), a SiLU-gated
 * feed-forward. A full-attention block: attn_q of twice the heads' width (query and output gate per head),
 * attn_k/v, attn_q_norm/k_norm of one head, attn_output. A DeltaNet block: attn_qkv (the convolved q, k, v of
 * `ssm.group_count` key heads and `ssm.time_step_rank` value heads, each `ssm.state_size` wide), attn_gate (z),
 * ssm_conv1d (`ssm.conv_kernel` taps per channel, always F32: ggml_ssm_conv computes F32 only and llama-quantize
 * keeps it), ssm_dt.bias, ssm_a (negative: -exp(A_log)), ssm_alpha, ssm_beta, ssm_norm (one value head), ssm_out.
 * RoPE is IMROPE over a quarter of the head (`rope.dimension_sections` split as Qwen3.5's [11, 11, 10, 0]).
 *
 * MTP blocks (`nextnLayers`, SyntheticNextn.ts) after the `layers` trunk blocks are full-attention blocks whatever
 * the interval says, with the block's usual feed-forward, as the converter writes Qwen3.5/3.6's `mtp.layers.*` and
 * llama.cpp's loader reads them (src/models/qwen35.cpp, qwen35moe.cpp: load_block_mtp; never recurrent).
 * The tensors described here are written from the engine's declaration (SyntheticTensors.ts); this module keeps the
 * options, their checks and the metadata.
 */
import { GgufValueType } from "../../domain/gguf.js"
import type { GgufTypedValue } from "./GgufWriter.js"
import { GgufValues } from "./GgufWriter.js"

/** qwen35 options of a synthetic model. */
export interface SyntheticQwen35Options {
  /** `ssm.state_size`: width of one DeltaNet key/value head; default 32. */
  readonly ssmStateSize?: number
  /** `ssm.group_count`: DeltaNet key heads; default 2. */
  readonly ssmGroups?: number
  /** `ssm.time_step_rank`: DeltaNet value heads, a multiple of ssmGroups; default 4. */
  readonly ssmHeads?: number
  /** `ssm.conv_kernel`: taps of the causal convolution; default 4. */
  readonly ssmConvKernel?: number
  /**
   * `full_attention_interval`: every Nth block is full attention, at most `layers` (llama.cpp needs one attention
   * block); default 4, or `layers` when fewer.
   */
  readonly fullAttentionInterval?: number
}

interface Shape extends SyntheticQwen35Options {
  readonly arch: string
  /** Trunk blocks; blocks from here on are MTP blocks (full attention). */
  readonly layers: number
  readonly hidden: number
  readonly ffn: number
  readonly heads: number
  readonly kvHeads: number
  readonly headDim?: number
}

const sizes = (o: Shape) => {
  const state = o.ssmStateSize ?? 32
  const groups = o.ssmGroups ?? 2
  const vHeads = o.ssmHeads ?? 4
  const kernel = o.ssmConvKernel ?? 4
  // fewer blocks than 4: the last one attends (llama.cpp's KV cache needs an attention block, else it aborts)
  const interval = o.fullAttentionInterval ?? Math.min(4, o.layers)
  const hd = o.headDim ?? o.hidden / o.heads
  return { state, groups, vHeads, kernel, interval, hd, rot: hd / 4, convDim: 2 * state * groups + state * vHeads }
}

/** qwen35 and qwen35moe share the hybrid stack (qwen35moe: the feed-forwards are SyntheticMoe.ts's). */
export const isQwen35Family = (arch: string): boolean => arch === "qwen35" || arch === "qwen35moe"

/** What is wrong with the qwen35 options, or undefined. */
export const validateQwen35Options = (o: Shape): string | undefined => {
  if (!isQwen35Family(o.arch)) {
    for (const k of ["ssmStateSize", "ssmGroups", "ssmHeads", "ssmConvKernel", "fullAttentionInterval"] as const) {
      if (o[k] !== undefined) return `${k} is a qwen35 option (arch is ${o.arch})`
    }
    return undefined
  }
  for (const k of ["ssmStateSize", "ssmGroups", "ssmHeads", "ssmConvKernel", "fullAttentionInterval"] as const) {
    const v = o[k]
    if (v !== undefined && !(Number.isSafeInteger(v) && v > 0)) return `${k} must be a positive integer, got ${v}`
  }
  const s = sizes(o)
  if (s.vHeads % s.groups !== 0) return `ssmHeads (${s.vHeads}) must be a multiple of ssmGroups (${s.groups})`
  if (s.kernel < 2) return `ssmConvKernel must be at least 2, got ${s.kernel}`
  // llama.cpp's hybrid cache allocates both halves: an empty one aborts it (GGML_ASSERT(buffer))
  if (o.layers < 2) return `layers must be at least 2 for ${o.arch} (llama.cpp needs a DeltaNet and an attention block)`
  if (s.interval < 2 || s.interval > o.layers) {
    return `fullAttentionInterval (${s.interval}) must be between 2 and layers (${o.layers}): llama.cpp needs a DeltaNet and an attention block`
  }
  if (!Number.isInteger(s.rot) || s.rot % 2 !== 0) {
    return `qwen35 rotates a quarter of the head: the head dimension ${s.hd} (headDim, or hidden / heads) must be a multiple of 8`
  }
  return undefined
}

/** The common metadata `md` with qwen35's: partial IMROPE, head lengths, the DeltaNet sizes and the block pattern. */
export const qwen35Metadata = (
  md: ReadonlyArray<readonly [string, GgufTypedValue]>,
  o: Shape
): Array<readonly [string, GgufTypedValue]> => {
  const s = sizes(o)
  const a = o.arch
  // IMROPE deals the rotated pairs out round-robin over t, h, w: section k holds the pairs i < half with i % 3 == k
  // (Qwen3.5's 64 rotated dimensions: [11, 11, 10, 0]), so none lands on the 4th component
  const half = s.rot / 2
  const sections = [0, 1, 2].map((k) => Math.ceil((half - k) / 3))
  const replaced = new Set(
    ["rope.dimension_count", "attention.key_length", "attention.value_length"].map((k) => `${a}.${k}`)
  )
  return [
    ...md.filter(([key]) => !replaced.has(key)),
    [`${a}.rope.dimension_count`, GgufValues.u32(s.rot)],
    [`${a}.rope.dimension_sections`, GgufValues.array(GgufValueType.INT32, [...sections, 0])],
    [`${a}.attention.key_length`, GgufValues.u32(s.hd)],
    [`${a}.attention.value_length`, GgufValues.u32(s.hd)],
    [`${a}.ssm.conv_kernel`, GgufValues.u32(s.kernel)],
    [`${a}.ssm.inner_size`, GgufValues.u32(s.state * s.vHeads)],
    [`${a}.ssm.state_size`, GgufValues.u32(s.state)],
    [`${a}.ssm.time_step_rank`, GgufValues.u32(s.vHeads)],
    [`${a}.ssm.group_count`, GgufValues.u32(s.groups)],
    [`${a}.full_attention_interval`, GgufValues.u32(s.interval)]
  ]
}
