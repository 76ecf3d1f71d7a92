import { Schema } from "effect"

/**
 * A metadata value as stored in a GGUF file (arrays keep their element values). 8-, 16- and 32-bit integers and
 * floats are numbers, 64-bit integers are bigints, strings are decoded as UTF-8.
 */
export type GgufValue = number | bigint | string | boolean | ReadonlyArray<GgufValue>

/** GGUF metadata value types (enum gguf_type). */
export const GgufValueType = {
  UINT8: 0,
  INT8: 1,
  UINT16: 2,
  INT16: 3,
  UINT32: 4,
  INT32: 5,
  FLOAT32: 6,
  BOOL: 7,
  STRING: 8,
  ARRAY: 9,
  UINT64: 10,
  INT64: 11,
  FLOAT64: 12
} as const
export type GgufValueType = (typeof GgufValueType)[keyof typeof GgufValueType]

/** The stored type of one metadata value; `itemType` is set for arrays. */
export interface GgufValueKind {
  readonly type: GgufValueType
  readonly itemType?: GgufValueType
}

/** One entry of the GGUF tensor table, validated against the file. */
export interface GgufTensorInfo {
  readonly name: string
  /** ggml type id (GGML_TYPE_*). */
  readonly type: number
  /** ggml order: dims[0] = ne0 (innermost). */
  readonly dims: ReadonlyArray<number>
  /** Absolute byte offset of the tensor data in the file. */
  readonly offset: number
  /** Bytes of tensor data (from ggml's type size / block size). */
  readonly byteSize: number
}

export interface GgufFile {
  readonly path: string
  readonly version: number
  readonly alignment: number
  /** Absolute offset of the tensor-data section. */
  readonly dataOffset: number
  readonly fileSize: number
  readonly metadata: ReadonlyMap<string, GgufValue>
  /** The stored GGUF type of every metadata value (same keys as `metadata`, in file order). */
  readonly metadataTypes: ReadonlyMap<string, GgufValueKind>
  readonly tensors: ReadonlyArray<GgufTensorInfo>
  readonly tensorsByName: ReadonlyMap<string, GgufTensorInfo>
}

export const ModelLoadReason = Schema.Literal(
  "Io",
  "NotGguf",
  "Truncated",
  "UnsupportedVersion",
  "InvalidMetadata",
  "UnsupportedArchitecture",
  "UnsupportedTensorType",
  "MissingTensor",
  "TensorShapeMismatch",
  "TensorTypeMismatch",
  "OffsetOutOfBounds",
  "InvalidLayerRange",
  "BackendUnavailable"
)
export type ModelLoadReason = typeof ModelLoadReason.Type

/** A model file that cannot be loaded; `message` names the offending value. */
export class ModelLoadError extends Schema.TaggedError<ModelLoadError>()("ModelLoadError", {
  path: Schema.String,
  reason: ModelLoadReason,
  message: Schema.String
}) {}
