/**
 * ggml tensor types of the pinned ggml (node-llama-cpp 3.21.1's llama.cpp build): id, name, elements per block and
 * bytes per block, exactly as `ggml_type_name` / `ggml_blck_size` / `ggml_type_size` report them from its
 * libggml-base.so. Removed ids (4, 5, 31-33, 36-38) are absent: a GGUF tensor of such a type is unsupported.
 */
export interface GgmlTypeInfo {
  readonly id: number
  readonly name: string
  /** Elements per block (1 for plain types). */
  readonly blockSize: number
  /** Bytes per block. */
  readonly typeSize: number
  readonly quantized: boolean
}

export const GgmlType = {
  F32: 0,
  F16: 1,
  Q4_0: 2,
  Q4_1: 3,
  Q5_0: 6,
  Q5_1: 7,
  Q8_0: 8,
  Q8_1: 9,
  Q2_K: 10,
  Q3_K: 11,
  Q4_K: 12,
  Q5_K: 13,
  Q6_K: 14,
  Q8_K: 15,
  IQ2_XXS: 16,
  IQ2_XS: 17,
  IQ3_XXS: 18,
  IQ1_S: 19,
  IQ4_NL: 20,
  IQ3_S: 21,
  IQ2_S: 22,
  IQ4_XS: 23,
  I8: 24,
  I16: 25,
  I32: 26,
  I64: 27,
  F64: 28,
  IQ1_M: 29,
  BF16: 30,
  TQ1_0: 34,
  TQ2_0: 35,
  MXFP4: 39,
  NVFP4: 40,
  Q1_0: 41,
  Q2_0: 42
} as const
export type GgmlType = (typeof GgmlType)[keyof typeof GgmlType]

/** GGML_TYPE_COUNT of the pinned ggml. */
export const GGML_TYPE_COUNT = 43

const entry = (id: number, name: string, blockSize: number, typeSize: number, quantized: boolean): GgmlTypeInfo => ({
  id,
  name,
  blockSize,
  typeSize,
  quantized
})

const table: ReadonlyArray<GgmlTypeInfo> = [
  entry(GgmlType.F32, "f32", 1, 4, false),
  entry(GgmlType.F16, "f16", 1, 2, false),
  entry(GgmlType.Q4_0, "q4_0", 32, 18, true),
  entry(GgmlType.Q4_1, "q4_1", 32, 20, true),
  entry(GgmlType.Q5_0, "q5_0", 32, 22, true),
  entry(GgmlType.Q5_1, "q5_1", 32, 24, true),
  entry(GgmlType.Q8_0, "q8_0", 32, 34, true),
  entry(GgmlType.Q8_1, "q8_1", 32, 36, true),
  entry(GgmlType.Q2_K, "q2_K", 256, 84, true),
  entry(GgmlType.Q3_K, "q3_K", 256, 110, true),
  entry(GgmlType.Q4_K, "q4_K", 256, 144, true),
  entry(GgmlType.Q5_K, "q5_K", 256, 176, true),
  entry(GgmlType.Q6_K, "q6_K", 256, 210, true),
  entry(GgmlType.Q8_K, "q8_K", 256, 292, true),
  entry(GgmlType.IQ2_XXS, "iq2_xxs", 256, 66, true),
  entry(GgmlType.IQ2_XS, "iq2_xs", 256, 74, true),
  entry(GgmlType.IQ3_XXS, "iq3_xxs", 256, 98, true),
  entry(GgmlType.IQ1_S, "iq1_s", 256, 50, true),
  entry(GgmlType.IQ4_NL, "iq4_nl", 32, 18, true),
  entry(GgmlType.IQ3_S, "iq3_s", 256, 110, true),
  entry(GgmlType.IQ2_S, "iq2_s", 256, 82, true),
  entry(GgmlType.IQ4_XS, "iq4_xs", 256, 136, true),
  entry(GgmlType.I8, "i8", 1, 1, false),
  entry(GgmlType.I16, "i16", 1, 2, false),
  entry(GgmlType.I32, "i32", 1, 4, false),
  entry(GgmlType.I64, "i64", 1, 8, false),
  entry(GgmlType.F64, "f64", 1, 8, false),
  entry(GgmlType.IQ1_M, "iq1_m", 256, 56, true),
  entry(GgmlType.BF16, "bf16", 1, 2, false),
  entry(GgmlType.TQ1_0, "tq1_0", 256, 54, true),
  entry(GgmlType.TQ2_0, "tq2_0", 256, 66, true),
  entry(GgmlType.MXFP4, "mxfp4", 32, 17, true),
  entry(GgmlType.NVFP4, "nvfp4", 64, 36, true),
  entry(GgmlType.Q1_0, "q1_0", 128, 18, true),
  entry(GgmlType.Q2_0, "q2_0", 64, 18, true)
]

const byId: ReadonlyArray<GgmlTypeInfo | undefined> = (() => {
  const out: Array<GgmlTypeInfo | undefined> = new Array(GGML_TYPE_COUNT).fill(undefined)
  for (const t of table) out[t.id] = t
  return out
})()

export const ggmlTypes: ReadonlyArray<GgmlTypeInfo> = table

/** The type with this id, or undefined for an unknown or removed id. */
export const ggmlTypeInfo = (id: number): GgmlTypeInfo | undefined =>
  Number.isInteger(id) && id >= 0 && id < GGML_TYPE_COUNT ? byId[id] : undefined

export const ggmlTypeName = (id: number): string => ggmlTypeInfo(id)?.name ?? `unknown(${id})`

export const ggmlTypeByName = (name: string): GgmlTypeInfo | undefined => {
  const lower = name.toLowerCase()
  return table.find((t) => t.name.toLowerCase() === lower)
}

/** A row length or shape that a ggml type cannot represent. */
export class GgmlShapeError extends Error {
  override readonly name = "GgmlShapeError"
}

const requireType = (id: number): GgmlTypeInfo => {
  const t = ggmlTypeInfo(id)
  if (t === undefined) throw new GgmlShapeError(`unknown ggml type ${id}`)
  return t
}

/**
 * Bytes of one row of `ne0` elements. Throws GgmlShapeError when ne0 is not a positive safe integer or not a
 * multiple of the type's block size, or when the result is not a safe integer.
 */
export const rowBytes = (typeId: number, ne0: number): number => {
  const t = requireType(typeId)
  if (!Number.isSafeInteger(ne0) || ne0 <= 0) throw new GgmlShapeError(`row length ${ne0} is not a positive integer`)
  if (ne0 % t.blockSize !== 0) {
    throw new GgmlShapeError(`row length ${ne0} is not a multiple of ${t.name}'s block size ${t.blockSize}`)
  }
  const bytes = (ne0 / t.blockSize) * t.typeSize
  if (!Number.isSafeInteger(bytes)) throw new GgmlShapeError(`row of ${ne0} ${t.name} elements is too large`)
  return bytes
}

/** Bytes of a whole tensor with dims in ggml order (dims[0] = ne0). Same rejections as rowBytes. */
export const tensorBytes = (typeId: number, dims: ReadonlyArray<number>): number => {
  if (dims.length === 0) throw new GgmlShapeError("a tensor needs at least one dimension")
  let bytes = rowBytes(typeId, dims[0]!)
  for (let i = 1; i < dims.length; i++) {
    const d = dims[i]!
    if (!Number.isSafeInteger(d) || d <= 0) throw new GgmlShapeError(`dimension ${i} = ${d} is not a positive integer`)
    bytes *= d
    if (!Number.isSafeInteger(bytes)) throw new GgmlShapeError(`tensor of shape [${dims.join(", ")}] is too large`)
  }
  return bytes
}
