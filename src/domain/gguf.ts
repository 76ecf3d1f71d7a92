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
  /** The part of a split set holding the tensor (index into `GgufFile.parts`); absent: the file itself. */
  readonly part?: number
}

/** One file of a split GGUF set (`<prefix>-00002-of-00005.gguf`): `split.no` is its index in `GgufFile.parts`. */
export interface GgufPart {
  readonly path: string
  readonly fileSize: number
  readonly dataOffset: number
  readonly tensorCount: number
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
  /**
   * Every part of a split set, in `split.no` order (the first is `path`, whose metadata this file carries); absent for
   * a single file. A tensor's `offset` is then into its own part's file.
   */
  readonly parts?: ReadonlyArray<GgufPart>
}

/** The file holding `tensor`'s bytes: its part of a split set, or the file itself. */
export const tensorFilePath = (file: GgufFile, tensor: GgufTensorInfo): string =>
  tensor.part === undefined ? file.path : (file.parts?.[tensor.part]?.path ?? file.path)

/** The size of the file holding `tensor`'s bytes. */
export const tensorFileSize = (file: GgufFile, tensor: GgufTensorInfo): number =>
  tensor.part === undefined ? file.fileSize : (file.parts?.[tensor.part]?.fileSize ?? file.fileSize)

/** Every file of the model: the parts of a split set, or the one file. */
export const modelFilePaths = (file: GgufFile): ReadonlyArray<string> => file.parts?.map((p) => p.path) ?? [file.path]

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
