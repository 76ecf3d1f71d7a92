import { Schema } from "effect"

/** A metadata value as stored in a GGUF file (arrays keep their element values). */
export type GgufValue = number | bigint | string | boolean | ReadonlyArray<GgufValue>

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
