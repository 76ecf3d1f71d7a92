/**
 * KV sizing for the server's admission: the KV bytes one request of n tokens takes on the heaviest stage, as the
 * pipeline is planned now (blocks per stage, sliding-window caps, per-block widths, DeltaNet state). The model's
 * per-block facts are the catalog's layout (ModelCatalogLive.readModelLayout), which the engine's own block plan
 * derives (engine/BlockMemory.ts): admission, placement and the stages size the same bytes. The formula is
 * services/KvSize.ts `kvBytesOfRange`; this module follows the pipeline's shape (more blocks on a stage after a
 * recovery onto fewer stages, fewer when a node rejoins).
 */
import { type BlocksKv, kvBytesOfRange } from "../../services/KvSize.js"

type Ranges = ReadonlyArray<readonly [number, number]>

/** The model's per-block KV facts, and (from its catalog layout) its weight bytes per block, embeddings and head. */
type ModelBlocks = BlocksKv & {
  readonly blockBytes?: ReadonlyArray<number>
  readonly inputBytes?: number
  readonly outputBytes?: number
}

/** KV cache bytes one sequence of `contextLength` tokens takes on the heaviest of the stages over `ranges`. */
export const kvBytesPerSequence = (kv: BlocksKv, ranges: Ranges, contextLength: number): number =>
  Math.max(0, ...ranges.map(([start, end]) => kvBytesOfRange(kv, start, end, contextLength)))

/** `numLayers` blocks cut into stages of `layersPerStage` (the last may hold fewer). */
const evenRanges = (numLayers: number, layersPerStage: number): Ranges => {
  const ranges: Array<readonly [number, number]> = []
  for (let start = 0; layersPerStage > 0 && start < numLayers; start += layersPerStage)
    ranges.push([start, Math.min(numLayers, start + layersPerStage)])
  return ranges
}

/** The KV budget per stage and what a context of n tokens takes on the heaviest stage, as the pipeline is now. */
export interface KvSizing {
  readonly budget: () => number
  readonly bytes: (contextLength: number) => number
}

/**
 * The sizing of a pipeline whose shape is learnt as it goes: the model's per-block facts once read (`model`), its
 * context and an even split of its blocks once it is set up (`pipeline`), each run's planned stages (`planned`).
 * Without `budgetBytes`, the budget is `parallel` sequences of min(context, 4096) tokens.
 */
export const make = (budgetBytes: number | undefined, parallel: number) => {
  // The pipeline's shape as its runs were last planned (more blocks on one stage after a recovery onto fewer stages,
  // fewer again when a node rejoins). KV bytes per request and the default budget follow it.
  const shape: { kv: ModelBlocks; maxSeqLen: number; ranges: Ranges } = {
    kv: { kvBytesPerToken: [] },
    maxSeqLen: 0,
    ranges: []
  }
  const bytes = (contextLength: number) => kvBytesPerSequence(shape.kv, shape.ranges, contextLength)
  return {
    budget: () => budgetBytes ?? parallel * bytes(Math.min(shape.maxSeqLen, 4096)),
    bytes,
    /** The model's per-block facts (its catalog layout). */
    model: (kv: ModelBlocks) => {
      shape.kv = kv
    },
    /** The context a sequence is sized for by default: min(the model's context, 4096) tokens. */
    contextTokens: () => Math.min(shape.maxSeqLen, 4096),
    /**
     * A stage of blocks [start, end): its weight bytes (with the embeddings on the first stage and the output head on
     * the last, as placement counts them) and the KV bytes one sequence of `contextTokens()` takes on it.
     */
    stageBytes: (start: number, end: number) => {
      const blocks = shape.kv.blockBytes ?? []
      const weights = blocks.slice(start, end).reduce((sum, b) => sum + b, 0)
      return {
        weightBytes:
          weights +
          (start === 0 ? (shape.kv.inputBytes ?? 0) : 0) +
          (end === blocks.length ? (shape.kv.outputBytes ?? 0) : 0),
        kvBytes: kvBytesOfRange(shape.kv, start, end, Math.min(shape.maxSeqLen, 4096))
      }
    },
    /** The pipeline's shape before its first run is planned (the warm-up's plan refines it). */
    pipeline: (model: { readonly maxSeqLen: number; readonly numLayers: number }, stageCount: number) => {
      shape.maxSeqLen = model.maxSeqLen
      shape.ranges = evenRanges(model.numLayers, Math.ceil(model.numLayers / stageCount))
    },
    /** A run was planned over these stages' block ranges; true when the sizes changed (its heaviest stage differs). */
    planned: (stages: ReadonlyArray<{ readonly layers: readonly [number, number] }>): boolean => {
      const most = (ranges: Ranges) => Math.max(0, ...ranges.map(([start, end]) => end - start))
      const layersBefore = most(shape.ranges)
      const before = bytes(shape.maxSeqLen)
      shape.ranges = stages.map((s) => [s.layers[0], s.layers[1]] as const)
      return most(shape.ranges) !== layersBefore || bytes(shape.maxSeqLen) !== before
    }
  }
}
