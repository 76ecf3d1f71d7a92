/**
 * Synthetic mixture-of-experts models (Synthetic.ts's hooks): qwen3moe's routed blocks, tensors and metadata as
 * llama.cpp's loader expects them (src/models/qwen3moe.cpp):
 * - `blk.N.ffn_gate_inp.weight` [hidden, experts], kept F32 in every file type (as llama.cpp's quantizer keeps it)
 * - `blk.N.ffn_{gate,up}_exps.weight` [hidden, expertFfn, experts], `blk.N.ffn_down_exps.weight` [expertFfn, hidden,
 *   experts]: stacked experts, quantized per row like any matrix, N(0, 1/sqrt(fan_in))
 * - `<arch>.expert_count`, `<arch>.expert_used_count`, `<arch>.expert_feed_forward_length`
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
}

/** The synthetic writer's mixture-of-experts architectures. */
export const syntheticMoeArchs = ["qwen3moe"] as const

export const isSyntheticMoe = (arch: string): boolean => (syntheticMoeArchs as ReadonlyArray<string>).includes(arch)

const settings = (o: SyntheticMoeOptions & { readonly ffn: number }) => ({
  experts: o.experts ?? 8,
  used: o.expertsUsed ?? 2,
  ffn: o.expertFfn ?? o.ffn
})

/** What is wrong with the MoE options, or undefined (also refuses them on a dense architecture). */
export const validateMoeOptions = (o: SyntheticMoeOptions & { readonly arch: string; readonly ffn: number }): string | undefined => {
  const given = o.experts !== undefined || o.expertsUsed !== undefined || o.expertFfn !== undefined
  if (!isSyntheticMoe(o.arch)) {
    return given ? `experts, expertsUsed and expertFfn are for ${syntheticMoeArchs.join(", ")} only, not ${o.arch}` : undefined
  }
  const s = settings(o)
  for (const [k, v] of [["experts", s.experts], ["expertsUsed", s.used], ["expertFfn", s.ffn]] as const) {
    if (!Number.isSafeInteger(v) || v <= 0) return `${k} must be a positive integer, got ${v}`
  }
  if (s.experts > 1024) return `experts must be at most 1024 (llama.cpp's limit), got ${s.experts}`
  if (s.used > s.experts) return `expertsUsed (${s.used}) must be at most experts (${s.experts})`
  return undefined
}

/** A routed block's feed-forward tensors (in place of ffn_gate/up/down), with their generator settings. */
export const moeBlockTensors = (
  block: string,
  o: SyntheticMoeOptions & { readonly hidden: number; readonly ffn: number }
): ReadonlyArray<{ readonly name: string; readonly dims: ReadonlyArray<number>; readonly mean: number; readonly std: number }> => {
  const s = settings(o)
  const m = (name: string, dims: ReadonlyArray<number>) => ({ name: `${block}.${name}`, dims, mean: 0, std: 1 / Math.sqrt(dims[0]!) })
  return [
    m("ffn_gate_inp.weight", [o.hidden, s.experts]),
    m("ffn_gate_exps.weight", [o.hidden, s.ffn, s.experts]),
    m("ffn_up_exps.weight", [o.hidden, s.ffn, s.experts]),
    m("ffn_down_exps.weight", [s.ffn, o.hidden, s.experts])
  ]
}

/** A storage type the tensor keeps whatever the file's type (the router: F32), or undefined. */
export const moeTensorType = (name: string): number | undefined =>
  name.endsWith(".ffn_gate_inp.weight") ? GgmlType.F32 : undefined

export const moeMetadata = (
  o: SyntheticMoeOptions & { readonly arch: string; readonly ffn: number }
): ReadonlyArray<readonly [string, GgufTypedValue]> => {
  if (!isSyntheticMoe(o.arch)) return []
  const s = settings(o)
  return [
    [`${o.arch}.expert_count`, GgufValues.u32(s.experts)],
    [`${o.arch}.expert_used_count`, GgufValues.u32(s.used)],
    [`${o.arch}.expert_feed_forward_length`, GgufValues.u32(s.ffn)]
  ]
}
