import { Schema } from "effect"

/** What a stage loads: a contiguous block range of one GGUF file. */
export interface StageLoadSpec {
  readonly path: string
  readonly layerStart: number
  readonly layerEndExclusive: number
  /** Stage 0: also loads token_embd and takes token ids as input. */
  readonly isFirst: boolean
  /** Last stage: also loads output_norm + output (or tied embedding) and returns logits. */
  readonly isLast: boolean
  /**
   * "cpu" (default); "cuda" or "vulkan": the GPU of node-llama-cpp's package of that name (loaded by the process,
   * SWACTOR_GGML_PACKAGE); "auto": the GPU of the loaded package when it has one, else the CPU.
   */
  readonly backend?: Backend
  /**
   * A GPU stage: the most device memory it may use (the node's `--gpu-memory`); absent: the device's free memory. A
   * stage larger than that keeps its last blocks on the device and the rest in host memory (services/DeviceFit.ts).
   */
  readonly deviceBudgetBytes?: number
}

/** The ggml backends a stage runs on, and the package a process loads for them (`--backend`). */
export const backends = ["cpu", "cuda", "vulkan", "auto"] as const
export type Backend = (typeof backends)[number]

export interface LoadProgress {
  readonly loadedBytes: number
  readonly totalBytes: number
}

/** Device memory of a GPU stage, part by part: weights, one session's caches, compute buffer. */
export const DeviceBytes = Schema.Struct({
  weightBytes: Schema.Number,
  cacheBytes: Schema.Number,
  computeBytes: Schema.Number,
  /**
   * Measured only: the most pieces one of the stage's graphs was split into between the device and the CPU by the
   * scheduler (1: the whole graph on the device; more: blocks in host memory, or ops the device does not compute).
   */
  splits: Schema.optional(Schema.Number)
})
export type DeviceBytes = typeof DeviceBytes.Type

/**
 * A GPU stage's split (services/DeviceFit.ts): its last `blocks` blocks on the device; the device memory the fit
 * counted for them (caches at the context it planned for, the compute buffer it keeps room for) and the host memory of
 * the rest (weights and caches).
 */
export const StageDeviceSplit = Schema.Struct({
  ...DeviceBytes.fields,
  blocks: Schema.Number,
  hostBytes: Schema.Number
})
export type StageDeviceSplit = typeof StageDeviceSplit.Type

/** Facts about a loaded stage that the runtime needs. */
export interface StageInfo {
  readonly arch: string
  readonly layerStart: number
  readonly layerEndExclusive: number
  readonly numLayers: number
  readonly isFirst: boolean
  readonly isLast: boolean
  readonly hiddenDim: number
  readonly vocabSize: number
  readonly contextLength: number
  readonly eosTokenId: number
  readonly bosTokenId: number | undefined
  /** Sum of the byte sizes (from the GGUF table) of the tensors this stage holds. */
  readonly weightBytes: number
  readonly backend: string
  /**
   * A GPU stage's split (services/DeviceFit.ts): its last `blocks` blocks on the device, and the device and host bytes
   * the fit counted for them. Absent: a CPU stage.
   */
  readonly device?: StageDeviceSplit

  /**
   * KV cache bytes per cached position of one session on this stage (K and V, F16, every block of the range).
   * A session of context length c allocates ceil(c / 256) * 256 positions, so it holds that many times this.
   */
  readonly kvBytesPerToken: number
  /**
   * The part of `kvBytesPerToken` that the stage's sliding-window blocks hold, and their window: their caches are
   * capped near the window whatever the context (services/KvSize.ts `kvBytesOfStage`). Absent: none.
   */
  readonly kvWindow?: { readonly window: number; readonly bytesPerToken: number }
  /**
   * Bytes of the recurrent state one sequence holds on this stage (qwen35's DeltaNet blocks: conv + SSM state, F32),
   * constant whatever the context; those blocks count nothing in `kvBytesPerToken`. Absent: none.
   */
  readonly stateBytes?: number
}

/**
 * `verify`: a speculative step's rows (a token and the tokens drafted after it), each computed with the bits it would
 * have alone (the few-row route, Toolkit.mulMatSmall, on every stage), and on the last stage the logits of every row,
 * not only the last one's. Such calls have a graph slot of their own in the session (its decode graph survives them).
 */
export type StageInput =
  | { readonly _tag: "Tokens"; readonly tokens: Int32Array; readonly verify?: boolean }
  | { readonly _tag: "Hidden"; readonly hidden: Float32Array; readonly nTokens: number; readonly verify?: boolean }

export type StageOutput =
  | { readonly _tag: "Hidden"; readonly hidden: Float32Array; readonly nTokens: number }
  /** Logits of the last input position (length = vocabSize), or of each of `rows` rows, row after row (a `verify` input). */
  | { readonly _tag: "Logits"; readonly logits: Float32Array; readonly rows?: number }

export class ContextOverflow extends Schema.TaggedError<ContextOverflow>()("ContextOverflow", {
  position: Schema.Number,
  nTokens: Schema.Number,
  contextLength: Schema.Number
}) {}

export class EngineError extends Schema.TaggedError<EngineError>()("EngineError", {
  message: Schema.String
}) {}

/** Input that does not fit the stage (wrong kind, wrong length, out-of-range token id). */
export class InvalidStageInput extends Schema.TaggedError<InvalidStageInput>()("InvalidStageInput", {
  message: Schema.String
}) {}

export type ForwardError = ContextOverflow | EngineError | InvalidStageInput

/** A batch that cannot run as a whole: empty, sessions of different loaded stages, one session twice. */
export class InvalidBatch extends Schema.TaggedError<InvalidBatch>()("InvalidBatch", {
  message: Schema.String
}) {}

/** One item of a batch does not fit its session (nothing of the batch ran); `index` is its place in the batch. */
export class BatchItemRejected extends Schema.TaggedError<BatchItemRejected>()("BatchItemRejected", {
  index: Schema.Number,
  error: Schema.Union(ContextOverflow, InvalidStageInput)
}) {}

/** Why a batched forward failed: the batch as a whole, one item (by index), or the native computation. */
export type ForwardBatchError = InvalidBatch | BatchItemRejected | EngineError
