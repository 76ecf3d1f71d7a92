/**
 * Synthetic mixture-of-experts models (Synthetic.ts's hooks), tensors and metadata as llama.cpp's loader expects them:
 * - qwen3moe (src/models/qwen3moe.cpp): every block routed, `ffn_norm`
 * - glm4moe (src/models/glm4-moe.cpp): `post_attention_norm`; the first `denseBlocks` blocks with a dense SwiGLU
 *   feed-forward, the rest routed with the expert bias `exp_probs_b.bias` and `sharedExperts` shared experts;
 *   sigmoid gate, weights normalised and scaled by 2.5 (GLM-4.5's settings)
 * - qwen35moe (src/models/qwen35moe.cpp): SyntheticQwen35.ts's hybrid blocks, `post_attention_norm`, every block
 *   routed plus one shared expert of `sharedExperts` x expertFfn (`expert_shared_feed_forward_length`) gated per
 *   token by `ffn_gate_inp_shexp.weight` [hidden]; softmax gate, weights normalised, no scale (llama.cpp's settings)
 * Routed blocks: `ffn_gate_inp.weight` [hidden, experts], kept F32 in every file type (as llama.cpp's quantizer keeps
 * it); stacked `ffn_{gate,up}_exps.weight` [hidden, expertFfn, experts] and `ffn_down_exps.weight` [expertFfn, hidden,
 * experts], quantized per row like any matrix, N(0, 1/sqrt(fan_in)). Metadata: `<arch>.expert_count`,
 * `expert_used_count`, `expert_feed_forward_length` (+ glm4moe's shared count, dense blocks, gating, norm, scale).
 * The tensors described here are written from the engine's declaration (SyntheticTensors.ts); this module keeps the
 * options, their checks and the metadata.
 */
import { GgmlType } from "../../domain/ggmlTypes.js"
import { type GgufTypedValue, GgufValues } from "./GgufWriter.js"

export interface SyntheticMoeOptions {
  /** Experts per block (MoE architectures; default 8). */
  readonly experts?: number
  /** Experts each token goes through (default 2, at most `experts`). */
  readonly expertsUsed?: number
  /** Feed-forward length of one expert (default: the model's ffn). */
  readonly expertFfn?: number
  /** glm4moe, deepseek2: shared experts per routed block; qwen35moe: its shared expert's width in experts (default 1). */
  readonly sharedExperts?: number
  /** glm4moe: leading blocks with a dense feed-forward (default 1). */
  readonly denseBlocks?: number
  /** glm4moe: group-limited routing, `expert_group_count` groups of which `expert_group_used_count` may be chosen. */
  readonly expertGroups?: { readonly count: number; readonly used: number }
}

/** The synthetic writer's mixture-of-experts architectures. */
export const syntheticMoeArchs = ["qwen3moe", "glm4moe", "gpt-oss", "deepseek2", "qwen35moe"] as const

export const isSyntheticMoe = (arch: string): boolean => (syntheticMoeArchs as ReadonlyArray<string>).includes(arch)

const settings = (o: SyntheticMoeOptions & { readonly arch: string; readonly ffn: number }) => {
  const glm = o.arch === "glm4moe" || o.arch === "deepseek2"
  return {
    experts: o.experts ?? 8,
    used: o.expertsUsed ?? 2,
    ffn: o.expertFfn ?? o.ffn,
    shared: o.sharedExperts ?? (glm || o.arch === "qwen35moe" ? 1 : 0),
    dense: o.denseBlocks ?? (glm ? 1 : 0)
  }
}

/** What is wrong with the MoE options, or undefined (also refuses them on a dense architecture). */
export const validateMoeOptions = (
  o: SyntheticMoeOptions & { readonly arch: string; readonly ffn: number; readonly layers: number }
): string | undefined => {
  const given = (["experts", "expertsUsed", "expertFfn", "sharedExperts", "denseBlocks"] as const).find(
    (k) => o[k] !== undefined
  )
  // gemma4 (26B-A4B), mistral3: experts only when asked for (SyntheticGemma4.ts, SyntheticMistral3.ts)
  if (!isSyntheticMoe(o.arch) && !((o.arch === "gemma4" || o.arch === "mistral3") && o.experts !== undefined)) {
    if (given === undefined) return undefined
    return o.arch === "gemma4" || o.arch === "mistral3"
      ? `${given} needs experts on ${o.arch}`
      : `${given} is not a ${o.arch} option (mixture-of-experts: ${syntheticMoeArchs.join(", ")}, gemma4, mistral3)`
  }
  if (o.arch === "qwen35moe" && (o.denseBlocks !== undefined || o.expertGroups !== undefined)) {
    return `denseBlocks and expertGroups are not qwen35moe options (every block is routed, no groups)`
  }
  if (o.sharedExperts !== undefined && !["glm4moe", "deepseek2", "qwen35moe"].includes(o.arch))
    return `sharedExperts is for glm4moe, deepseek2, qwen35moe only, not ${o.arch}`
  if (o.denseBlocks !== undefined && o.arch !== "glm4moe" && o.arch !== "deepseek2")
    return `denseBlocks is for glm4moe, deepseek2 only, not ${o.arch}`
  if (o.expertGroups !== undefined && o.arch !== "glm4moe" && o.arch !== "deepseek2")
    return `expertGroups is for glm4moe, deepseek2 only, not ${o.arch}`
  const s = settings(o)
  for (const [k, v] of [
    ["experts", s.experts],
    ["expertsUsed", s.used],
    ["expertFfn", s.ffn]
  ] as const) {
    if (!Number.isSafeInteger(v) || v <= 0) return `${k} must be a positive integer, got ${v}`
  }
  for (const [k, v] of [
    ["sharedExperts", s.shared],
    ["denseBlocks", s.dense]
  ] as const) {
    if (!Number.isSafeInteger(v) || v < 0) return `${k} must be a non-negative integer, got ${v}`
  }
  if (s.experts > 1024) return `experts must be at most 1024 (llama.cpp's limit), got ${s.experts}`
  if (s.used > s.experts) return `expertsUsed (${s.used}) must be at most experts (${s.experts})`
  if (o.arch === "qwen35moe" && s.shared < 1)
    return `sharedExperts must be at least 1 for qwen35moe (its shared expert is required)`
  // llama.cpp's deepseek2 loader asks for the shared expert of every routed block, and its glm4moe graph adds one
  // built of no tensors (the normed input through SiLU) when there is none
  if ((o.arch === "deepseek2" || o.arch === "glm4moe") && s.shared < 1)
    return `sharedExperts must be at least 1 for ${o.arch} (llama.cpp computes a shared expert on every routed block)`
  if (s.dense >= o.layers) return `denseBlocks (${s.dense}) must be fewer than layers (${o.layers})`
  return undefined
}

/** A storage type the tensor keeps whatever the file's type (the router: F32), or undefined. */
export const moeTensorType = (name: string): number | undefined =>
  name.endsWith(".ffn_gate_inp.weight") ? GgmlType.F32 : undefined

export const moeMetadata = (
  o: SyntheticMoeOptions & { readonly arch: string; readonly ffn: number }
): ReadonlyArray<readonly [string, GgufTypedValue]> => {
  if (!isSyntheticMoe(o.arch)) return []
  const s = settings(o)
  const a = o.arch
  const common: Array<readonly [string, GgufTypedValue]> = [
    [`${a}.expert_count`, GgufValues.u32(s.experts)],
    [`${a}.expert_used_count`, GgufValues.u32(s.used)],
    [`${a}.expert_feed_forward_length`, GgufValues.u32(s.ffn)]
  ]
  if (a === "qwen35moe")
    return [...common, [`${a}.expert_shared_feed_forward_length`, GgufValues.u32(s.ffn * s.shared)]]
  if (a !== "glm4moe" && a !== "deepseek2") return common
  return [
    ...common,
    [`${a}.expert_shared_count`, GgufValues.u32(s.shared)],
    [`${a}.leading_dense_block_count`, GgufValues.u32(s.dense)],
    [`${a}.expert_gating_func`, GgufValues.u32(2)],
    [`${a}.expert_weights_norm`, GgufValues.bool(true)],
    [`${a}.expert_weights_scale`, GgufValues.f32(2.5)],
    ...(o.expertGroups === undefined
      ? []
      : [
          [`${a}.expert_group_count`, GgufValues.u32(o.expertGroups.count)] as const,
          [`${a}.expert_group_used_count`, GgufValues.u32(o.expertGroups.used)] as const
        ])
  ]
}
