/**
 * The gpt-oss parts of a synthetic model (Synthetic.ts), tensors and metadata as llama.cpp's loader expects them
 * (src/models/openai-moe.cpp):
 * - per block, beside attn_norm / attn_q / attn_k / attn_v / attn_output: q/k/v and output biases N(0, 0.1),
 *   `attn_sinks.weight` [heads] N(0, 1) (per-head sink logits), `post_attention_norm`, the router
 *   `ffn_gate_inp.weight` [hidden, experts] (F32 in every file type) with its bias N(0, 0.5), stacked experts
 *   `ffn_{gate,up}_exps.weight` [hidden, expertFfn, experts], `ffn_down_exps.weight` [expertFfn, hidden, experts] and
 *   their per-expert biases `ffn_*_exps.bias` (F32, N(0, 0.1));
 * - metadata: `expert_count`, `expert_used_count`, `expert_feed_forward_length` (SyntheticMoe.ts), `attention.sliding_window`
 *   (default 16), `attention.sliding_window_pattern` (default 2: every other block slides), key/value lengths, and YaRN
 *   RoPE scaling (`rope.scaling.type` yarn, factor default 4 over an original context of context/8; factor 0: none),
 *   as the real files set it (factor 32 over 4096).
 * Storage: `--type mxfp4` keeps the experts MXFP4 and stores the other matrices Q8_0, as gpt-oss files come; a mixed
 * recipe (q4_k_m, q3_k_m) stores the experts MXFP4 too (llama.cpp's quantizer keeps MXFP4 experts); other types
 * apply to every matrix.
 * The tensors described here are written from the engine's declaration (SyntheticTensors.ts); this module keeps the
 * options, their checks and the metadata.
 */
import { GgmlType } from "../../domain/ggmlTypes.js"
import { type GgufTypedValue, GgufValues } from "./GgufWriter.js"
import { syntheticStorageType, type SyntheticWeightType } from "./SyntheticTypes.js"

const DEFAULT_WINDOW = 16
const DEFAULT_PATTERN = 2
const DEFAULT_YARN_FACTOR = 4

/** What is wrong with the gpt-oss options, or undefined (llama.cpp requires gpt-oss's own output head). */
export const validateGptOssOptions = (o: {
  readonly arch: string
  readonly tiedOutput?: boolean
}): string | undefined =>
  o.arch === "gpt-oss" && o.tiedOutput === true
    ? "tiedOutput is not for gpt-oss (llama.cpp requires its own output.weight)"
    : undefined

/** gpt-oss's storage type for a tensor of a `type` file, or undefined for the generic rule (Synthetic.ts). */
export const gptOssTensorType = (
  type: SyntheticWeightType,
  name: string,
  dims: ReadonlyArray<number>,
  model: { readonly layers: number; readonly tiedOutput: boolean }
): number | undefined => {
  const expert = /\.ffn_(gate|up|down)_exps\.weight$/.test(name)
  if (expert && (type === "mxfp4" || type === "q4_k_m" || type === "q3_k_m")) {
    return dims[0]! % 32 === 0 ? GgmlType.MXFP4 : GgmlType.F16
  }
  if (type === "mxfp4" && dims.length >= 2) return syntheticStorageType("q8_0", name, dims, model)
  return undefined
}

/** The YaRN options gpt-oss shares with mistral3 (SyntheticMistral3Options). */
interface SyntheticGptOssYarn {
  /** `rope.scaling.factor` of YaRN; 0 writes no RoPE scaling. */
  readonly yarnFactor?: number
  /** `rope.scaling.original_context_length`. */
  readonly yarnOriginalContext?: number
}

/** gpt-oss's own metadata keys (the expert keys come from SyntheticMoe.ts). */
export const gptOssMetadata = (
  o: SyntheticGptOssYarn & { readonly slidingWindow?: number; readonly swaPattern?: number },
  contextLength: number
): ReadonlyArray<readonly [string, GgufTypedValue]> => {
  const md: Array<readonly [string, GgufTypedValue]> = [
    ["gpt-oss.attention.sliding_window", GgufValues.u32(o.slidingWindow ?? DEFAULT_WINDOW)],
    ["gpt-oss.attention.sliding_window_pattern", GgufValues.u32(o.swaPattern ?? DEFAULT_PATTERN)]
  ]
  const factor = o.yarnFactor ?? DEFAULT_YARN_FACTOR
  if (factor > 0) {
    md.push(
      ["gpt-oss.rope.scaling.type", GgufValues.string("yarn")],
      ["gpt-oss.rope.scaling.factor", GgufValues.f32(factor)],
      [
        "gpt-oss.rope.scaling.original_context_length",
        GgufValues.u32(o.yarnOriginalContext ?? Math.max(1, Math.floor(contextLength / 8)))
      ]
    )
  }
  return md
}
