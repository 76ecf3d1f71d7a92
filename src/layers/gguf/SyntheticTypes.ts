/**
 * Storage types of synthetic models (`swactor synth --type`): one ggml type for every matrix ("pure"), or a mixed
 * recipe that picks a type per tensor the way llama.cpp's quantizer does for that file type (`--type q4_k_m`,
 * `--type q3_k_m`), and `general.file_type` (llama_ftype) for each.
 *
 * Quantization runs through ggml's own `ggml_quantize_chunk` (after `ggml_quantize_init`). Types for which ggml
 * requires an importance matrix (`ggml_quantize_requires_imatrix`: iq1_s, iq2_xxs, iq2_xs) get one of all ones:
 * every column equally important, the same for every chunk of rows, so a tensor generated in chunks equals the
 * tensor generated at once. Every other type is quantized without one (as llama-quantize does without --imatrix).
 */
import { GgmlType, ggmlTypeInfo } from "../../domain/ggmlTypes.js"
import { getGgml } from "../ggml/Bindings.js"

/** Pure types: every 2-D matrix in this ggml type (F16 where its row length is not a multiple of the block size). */
const pureTypes = {
  f32: { id: GgmlType.F32, ftype: 0 },
  f16: { id: GgmlType.F16, ftype: 1 },
  bf16: { id: GgmlType.BF16, ftype: 32 },
  q8_0: { id: GgmlType.Q8_0, ftype: 7 },
  q4_0: { id: GgmlType.Q4_0, ftype: 2 },
  q4_1: { id: GgmlType.Q4_1, ftype: 3 },
  q5_0: { id: GgmlType.Q5_0, ftype: 8 },
  q5_1: { id: GgmlType.Q5_1, ftype: 9 },
  q2_k: { id: GgmlType.Q2_K, ftype: 10 },
  // llama_ftype has no "all Q3_K/Q4_K/Q5_K": the _S variant is the nearest (its default type)
  q3_k: { id: GgmlType.Q3_K, ftype: 11 },
  q4_k: { id: GgmlType.Q4_K, ftype: 14 },
  q5_k: { id: GgmlType.Q5_K, ftype: 16 },
  q6_k: { id: GgmlType.Q6_K, ftype: 18 },
  iq1_s: { id: GgmlType.IQ1_S, ftype: 24 },
  iq1_m: { id: GgmlType.IQ1_M, ftype: 31 },
  iq2_xxs: { id: GgmlType.IQ2_XXS, ftype: 19 },
  iq2_xs: { id: GgmlType.IQ2_XS, ftype: 20 },
  // LLAMA_FTYPE_MOSTLY_IQ2_M's default type is IQ2_S (IQ2_S's is IQ2_XS)
  iq2_s: { id: GgmlType.IQ2_S, ftype: 29 },
  iq3_xxs: { id: GgmlType.IQ3_XXS, ftype: 23 },
  iq3_s: { id: GgmlType.IQ3_S, ftype: 26 },
  iq4_nl: { id: GgmlType.IQ4_NL, ftype: 25 },
  iq4_xs: { id: GgmlType.IQ4_XS, ftype: 30 },
  tq1_0: { id: GgmlType.TQ1_0, ftype: 36 },
  tq2_0: { id: GgmlType.TQ2_0, ftype: 37 },
  // LLAMA_FTYPE_MOSTLY_MXFP4_MOE: the one llama_ftype whose default type is MXFP4
  mxfp4: { id: GgmlType.MXFP4, ftype: 38 },
  nvfp4: { id: GgmlType.NVFP4, ftype: 39 },
  q1_0: { id: GgmlType.Q1_0, ftype: 40 },
  q2_0: { id: GgmlType.Q2_0, ftype: 41 }
} as const

/** Mixed recipes: llama_ftype and the default type of their matrices (the rules are in `recipeTensorType`). */
const mixedTypes = {
  q3_k_m: { id: GgmlType.Q3_K, ftype: 12 },
  q4_k_m: { id: GgmlType.Q4_K, ftype: 15 }
} as const

export type SyntheticWeightType = keyof typeof pureTypes | keyof typeof mixedTypes

const table: Record<SyntheticWeightType, { readonly id: number; readonly ftype: number }> = {
  ...pureTypes,
  ...mixedTypes
}

/** Every `--type`, pure ones first. */
export const syntheticWeightTypes = Object.keys(table) as ReadonlyArray<SyntheticWeightType>

/** llama_ftype (`general.file_type`) of a file of this type. */
export const syntheticFileType = (type: SyntheticWeightType): number => table[type].ftype

/** The ggml type most matrices of a file of this type have. */
export const syntheticDefaultTypeId = (type: SyntheticWeightType): number => table[type].id

/** What `recipeTensorType` needs to know of the model. */
export interface RecipeModel {
  readonly layers: number
  /** No output.weight: token_embd is the output head too. */
  readonly tiedOutput: boolean
  /** llama.cpp's n_expert: experts per routed block (0 or absent: a dense model). */
  readonly experts?: number
}

/** llama.cpp's use_more_bits: the first and last eighth of the blocks, and every third block between. */
const useMoreBits = (i: number, n: number): boolean =>
  i < Math.floor(n / 8) || i >= Math.floor((7 * n) / 8) || (i - Math.floor(n / 8)) % 3 === 2

const blockOf = (name: string): number | undefined => {
  const m = /^blk\.(\d+)\./.exec(name)
  return m === null ? undefined : Number(m[1])
}

/**
 * The ggml type of 2-D tensor `name` in a file of `type` (before the block-size fallback). For q4_k_m and q3_k_m,
 * the rules of llama.cpp's llama_tensor_get_type for a dense model without experts, at the level of tensor roles:
 * - output.weight (or token_embd when tied): Q6_K;
 * - attn_v: q4_k_m Q6_K in use_more_bits blocks, else Q4_K; q3_k_m Q5_K in blocks 0-1, else Q4_K;
 * - ffn_down: q4_k_m Q6_K in use_more_bits blocks, else Q4_K; q3_k_m Q5_K in the first sixteenth, else Q4_K;
 * - attn_output: q3_k_m Q4_K;
 * - everything else the recipe's default (Q4_K / Q3_K).
 * (llama.cpp counts attn_v and ffn_down tensors as they come; with one per block that is the block index.)
 * With experts: every tensor named ffn_down* (ffn_down_exps, ffn_down_shexp, a dense block's ffn_down) takes the
 * ffn_down rule of the block in its name; with exactly 8 experts attn_v and attn_k are Q8_0 and attn_output Q5_K.
 */
export const recipeTensorType = (type: SyntheticWeightType, name: string, model: RecipeModel): number => {
  const id = table[type].id
  if (type !== "q4_k_m" && type !== "q3_k_m") return id
  if (name === "output.weight" || (model.tiedOutput && name === "token_embd.weight")) return GgmlType.Q6_K
  const i = blockOf(name)
  if (i === undefined) return id
  const n = model.layers
  const eight = model.experts === 8
  if (name.endsWith(".attn_v.weight")) {
    if (eight) return GgmlType.Q8_0
    if (type === "q4_k_m") return useMoreBits(i, n) ? GgmlType.Q6_K : GgmlType.Q4_K
    return i < 2 ? GgmlType.Q5_K : GgmlType.Q4_K
  }
  if (eight && name.endsWith(".attn_k.weight")) return GgmlType.Q8_0
  if (eight && name.endsWith(".attn_output.weight")) return GgmlType.Q5_K
  if (name.endsWith(".ffn_down.weight") || ((model.experts ?? 0) > 1 && name.includes(".ffn_down"))) {
    if (type === "q4_k_m") return useMoreBits(i, n) ? GgmlType.Q6_K : GgmlType.Q4_K
    return i < Math.floor(n / 16) ? GgmlType.Q5_K : GgmlType.Q4_K
  }
  if (name.endsWith(".attn_output.weight") && type === "q3_k_m") return GgmlType.Q4_K
  return id
}

/** The ggml type a tensor gets: F32 for 1-D, the recipe's type, or F16 when the row length does not fit its blocks. */
export const syntheticStorageType = (
  type: SyntheticWeightType,
  name: string,
  dims: ReadonlyArray<number>,
  model: RecipeModel
): number => {
  if (dims.length < 2) return GgmlType.F32
  const id = recipeTensorType(type, name, model)
  return dims[0]! % ggmlTypeInfo(id)!.blockSize === 0 ? id : GgmlType.F16
}

/** Every quantized type a synthetic file may hold (what ggml_quantize_chunk quantizes to). */
const quantizable: ReadonlySet<number> = new Set(
  [...Object.values(table).map((t) => t.id), GgmlType.Q5_K, GgmlType.Q6_K].filter(
    (id) => ggmlTypeInfo(id)?.quantized === true
  )
)

const onesOf = new Map<number, Float32Array>()

/**
 * Quantizes whole rows of `nPerRow` floats to the quantized ggml `type` through ggml_quantize_chunk, with an
 * all-ones importance matrix where ggml requires one. Throws RangeError on a shape the type cannot hold (checked
 * here: ggml would abort).
 */
export const quantizeRows = (type: number, src: Float32Array, nPerRow: number): Uint8Array => {
  const info = ggmlTypeInfo(type)
  // ggml_quantize_chunk aborts on a type outside its switch (q8_1, q8_K): only the quantized types of the table
  if (info === undefined || !info.quantized || !quantizable.has(type)) {
    throw new RangeError(`quantizeRows: ggml type ${type} is not one swactor synth quantizes to`)
  }
  if (!Number.isSafeInteger(nPerRow) || nPerRow <= 0 || nPerRow % info.blockSize !== 0) {
    throw new RangeError(
      `quantizeRows: row length ${nPerRow} is not a multiple of ${info.name}'s block size ${info.blockSize}`
    )
  }
  if (src.length % nPerRow !== 0)
    throw new RangeError(`quantizeRows: ${src.length} floats are not whole rows of ${nPerRow}`)
  const nrows = src.length / nPerRow
  const g = getGgml()
  let imatrix: Float32Array | null = null
  if (g.raw.ggml_quantize_requires_imatrix(type)) {
    imatrix = onesOf.get(nPerRow) ?? new Float32Array(nPerRow).fill(1)
    onesOf.set(nPerRow, imatrix)
  }
  const dst = new Uint8Array(g.ggml_row_size(type, nPerRow) * nrows)
  if (nrows === 0) return dst
  g.raw.ggml_quantize_init(type)
  const written = g.raw.ggml_quantize_chunk(type, src, dst, 0, nrows, nPerRow, imatrix)
  if (written !== dst.length)
    throw new Error(`ggml_quantize_chunk wrote ${written} bytes of ${info.name}, expected ${dst.length}`)
  return dst
}
