/**
 * Multi-token-prediction (MTP, "NextN") blocks of a synthetic glm4moe model (Synthetic.ts), as GLM-4.5/4.6 files carry
 * them: `<arch>.nextn_predict_layers` = n and n extra blocks after the trunk, counted in `block_count`, each a whole
 * routed block (attention, router, experts) plus `nextn.eh_proj` [2 x hidden, hidden], `nextn.enorm`, `nextn.hnorm`
 * and `nextn.shared_head_norm` [hidden] (llama.cpp src/models/glm4-moe.cpp; the optional `nextn.embed_tokens` and
 * `nextn.shared_head_head` are left out, as in the released files). llama.cpp decodes with the trunk only
 * (llama_hparams::n_layer() = block_count - nextn_predict_layers); so does swactor. qwen35 and qwen35moe files
 * carry the same nextn.* tensors on a full-attention block (SyntheticQwen35.ts), as Qwen3.5/3.6's converter writes.
 */
import { GgufValues, type GgufTypedValue } from "./GgufWriter.js"

export interface SyntheticNextnOptions {
  /** glm4moe, qwen35, qwen35moe: MTP blocks after the `layers` trunk blocks (default 0). */
  readonly nextnLayers?: number
}

/** The architectures whose synthetic files can carry MTP blocks (qwen35, qwen35moe: SyntheticQwen35.ts). */
const nextnArchs: ReadonlyArray<string> = ["glm4moe", "qwen35", "qwen35moe"]

export const validateNextnOptions = (o: SyntheticNextnOptions & { readonly arch: string }): string | undefined => {
  const n = o.nextnLayers
  if (n === undefined || n === 0) return undefined
  if (!Number.isSafeInteger(n) || n < 0) return `nextnLayers must be a non-negative integer, got ${n}`
  if (!nextnArchs.includes(o.arch)) {
    return `nextnLayers (MTP blocks) is for ${nextnArchs.join(", ")} only, got arch ${o.arch}`
  }
  return undefined
}

/** Blocks the file holds: the trunk and the MTP blocks after it. */
export const syntheticBlockCount = (o: SyntheticNextnOptions & { readonly layers: number }): number =>
  o.layers + (o.nextnLayers ?? 0)

/** The MTP-only tensors of block `b` (beside its ordinary block tensors): [name, dims, kind]. */
export const nextnBlockTensors = (
  b: string,
  hidden: number
): ReadonlyArray<readonly [string, ReadonlyArray<number>, "matrix" | "norm"]> => [
  [`${b}.nextn.eh_proj.weight`, [2 * hidden, hidden], "matrix"],
  [`${b}.nextn.enorm.weight`, [hidden], "norm"],
  [`${b}.nextn.hnorm.weight`, [hidden], "norm"],
  [`${b}.nextn.shared_head_norm.weight`, [hidden], "norm"]
]

export const nextnMetadata = (
  o: SyntheticNextnOptions & { readonly arch: string }
): ReadonlyArray<readonly [string, GgufTypedValue]> =>
  (o.nextnLayers ?? 0) > 0 ? [[`${o.arch}.nextn_predict_layers`, GgufValues.u32(o.nextnLayers!)]] : []
