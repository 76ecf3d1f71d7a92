/**
 * KV sizing for the server's admission: the KV bytes one request of n tokens takes on the heaviest stage, as the
 * pipeline is planned now (blocks per stage, sliding-window caps, per-block widths, DeltaNet state), from the model's
 * attention facts read from its GGUF metadata. The formulas are services/KvSize.ts; this module reads the facts and
 * follows the pipeline's shape (more blocks on a stage after a recovery onto fewer stages, fewer when a node rejoins).
 *
 * The facts are read from the metadata (head counts, key and value lengths), as admission always has: ModelCatalog's
 * layout sizes KV from the K and V tensors' widths instead, and sizing admission from it would first need proof that
 * both give the same bytes for every architecture (latent attention, gemma4's shared KV, DeltaNet state).
 */
import { Effect } from "effect"
import * as Gguf from "../gguf/GgufReader.js"
import type { GgufFile } from "../../domain/gguf.js"
import { kvBytesOfBlocks, kvBytesOfSequence, kvBytesPerTokenOfBlock } from "../../services/KvSize.js"
import { slidingWindowOf, type SlidingWindowLayout } from "../gguf/SlidingWindow.js"
import { trunkBlockCount } from "../gguf/TrunkBlocks.js"

/**
 * KV cache bytes one sequence of `contextLength` tokens takes on the heaviest stage (services/KvSize.ts). With
 * sliding-window blocks (their caches capped) and the planned stages' blocks known: the most any planned stage takes;
 * else `layersPerStage` blocks holding the whole context.
 */
export const kvBytesPerSequence = (
  shape: {
    readonly layersPerStage: number
    readonly kvBytesPerBlockToken: number
    /** Per block, when blocks differ (gemma4 31B: its own head size and KV heads); kvBytesPerBlockToken is their most. */
    readonly kvBytesPerBlock?: ReadonlyArray<number> | undefined
    readonly slidingWindow?: SlidingWindowLayout | undefined
    readonly ranges?: ReadonlyArray<readonly [number, number]>
    /** DeltaNet blocks (qwen35): which blocks keep a constant state per sequence instead of KV, and its bytes. */
    readonly recurrent?: RecurrentLayout | undefined
  },
  contextLength: number
): number => {
  const sw = shape.slidingWindow
  const rec = shape.recurrent
  if (rec !== undefined) {
    const perToken = kvBytesOfSequence(shape.kvBytesPerBlockToken, contextLength)
    // stages unknown: every block of a stage as the heavier of the two kinds
    if (shape.ranges === undefined || shape.ranges.length === 0)
      return shape.layersPerStage * Math.max(perToken, rec.stateBytes)
    return Math.max(
      ...shape.ranges.map(([start, end]) => {
        let sum = 0
        for (let il = start; il < end; il++) sum += rec.blocks[il] === true ? rec.stateBytes : perToken
        return sum
      })
    )
  }
  const perBlock = shape.kvBytesPerBlock
  if ((sw === undefined && perBlock === undefined) || shape.ranges === undefined || shape.ranges.length === 0) {
    return kvBytesOfSequence(shape.layersPerStage * shape.kvBytesPerBlockToken, contextLength)
  }
  return Math.max(
    ...shape.ranges.map(([start, end]) =>
      kvBytesOfBlocks(
        Array.from({ length: end - start }, (_, i) => ({
          bytesPerToken: perBlock?.[start + i] ?? shape.kvBytesPerBlockToken,
          ...(sw?.blocks[start + i] === true ? { window: sw.window } : {})
        })),
        contextLength
      )
    )
  )
}

/** Which blocks are DeltaNet blocks (qwen35, qwen35moe) and the state bytes one sequence holds in each. */
interface RecurrentLayout {
  readonly blocks: ReadonlyArray<boolean>
  readonly stateBytes: number
}

/** qwen35's DeltaNet blocks from its metadata (`ssm.*`, `full_attention_interval`, default 4); undefined: none. */
const recurrentOf = (file: GgufFile, arch: string, blocks: number) =>
  Effect.gen(function* () {
    const u32 = (key: string) => Gguf.getOptional(file, `${arch}.${key}`, Gguf.getU32)
    const kernel = yield* u32("ssm.conv_kernel")
    const state = yield* u32("ssm.state_size")
    const groups = yield* u32("ssm.group_count")
    const heads = yield* u32("ssm.time_step_rank")
    if (kernel === undefined || state === undefined || groups === undefined || heads === undefined) return undefined
    const interval = (yield* u32("full_attention_interval")) ?? 4
    if (interval === 0) return undefined
    const layout: RecurrentLayout = {
      blocks: Array.from({ length: blocks }, (_, il) => (il + 1) % interval !== 0),
      stateBytes: 4 * ((kernel - 1) * (2 * state * groups + state * heads) + state * state * heads)
    }
    return layout
  })

/** KV bytes per token per block, from the GGUF's attention facts, and the blocks that slide (capped caches). */
export const readKvBytesPerBlockToken = (path: string) =>
  Effect.gen(function* () {
    const file = yield* Gguf.readGgufFile(path)
    const arch = yield* Gguf.getArchitecture(file)
    // the trunk: MTP blocks (`nextn_predict_layers`: glm4moe, qwen35) are never placed nor decoded (TrunkBlocks.ts)
    const blocks = yield* trunkBlockCount(file, arch)
    const slidingWindow = slidingWindowOf(file, arch, blocks)
    const perBlock = arch === "gemma4" ? yield* gemma4KvBytesPerBlock(file, blocks, slidingWindow) : undefined
    return {
      bytes: perBlock === undefined ? yield* kvBytesPerBlockTokenOf(file, arch) : Math.max(...perBlock),
      ...(perBlock === undefined ? {} : { perBlock }),
      slidingWindow,
      recurrent: arch === "qwen35" || arch === "qwen35moe" ? yield* recurrentOf(file, arch, blocks) : undefined
    }
  })

/**
 * gemma4's KV bytes per token of each block (archs/gemma4.ts): sliding-window blocks' head size `key_length_swa`,
 * global ones `key_length`, `head_count_kv` one count per block or one for all; K and V rows of equal width.
 */
const gemma4KvBytesPerBlock = (file: GgufFile, blocks: number, sw: SlidingWindowLayout | undefined) =>
  Effect.gen(function* () {
    const u32 = (key: string) => Gguf.getOptional(file, `gemma4.${key}`, Gguf.getU32)
    const heads = yield* Gguf.getU32(file, "gemma4.attention.head_count")
    const hidden = yield* Gguf.getU32(file, "gemma4.embedding_length")
    const head = (yield* u32("attention.key_length")) ?? Math.floor(hidden / heads)
    const headSwa = (yield* u32("attention.key_length_swa")) ?? head
    const kvKey = "gemma4.attention.head_count_kv"
    const kvHeads = Array.isArray(file.metadata.get(kvKey))
      ? yield* Gguf.getNumberArray(file, kvKey)
      : Array.from({ length: blocks }, () => 0).fill((yield* u32("attention.head_count_kv")) ?? heads)
    return Array.from({ length: blocks }, (_, il) => {
      const width = (sw?.blocks[il] === true ? headSwa : head) * (kvHeads[il] ?? 0)
      return kvBytesPerTokenOfBlock(width, width)
    })
  })

const kvBytesPerBlockTokenOf = (file: GgufFile, arch: string) =>
  Effect.gen(function* () {
    const hidden = yield* Gguf.getU32(file, `${arch}.embedding_length`)
    const heads = yield* Gguf.getU32(file, `${arch}.attention.head_count`)
    const kvHeads = (yield* Gguf.getOptional(file, `${arch}.attention.head_count_kv`, Gguf.getU32)) ?? heads
    const keyLength =
      (yield* Gguf.getOptional(file, `${arch}.attention.key_length`, Gguf.getU32)) ?? Math.floor(hidden / heads)
    const valueLength = (yield* Gguf.getOptional(file, `${arch}.attention.value_length`, Gguf.getU32)) ?? keyLength
    // latent attention (deepseek2): one cached K row (latent + RoPE part), V is a view of it
    if (file.metadata.has(`${arch}.attention.kv_lora_rank`)) return kvBytesPerTokenOfBlock(keyLength * kvHeads, 0)
    return kvBytesPerTokenOfBlock(keyLength * kvHeads, valueLength * kvHeads)
  })
/** The KV budget per stage and what a context of n tokens takes on the heaviest stage, as the pipeline is now. */
export interface KvSizing {
  readonly budget: () => number
  readonly bytes: (contextLength: number) => number
}

/** The model's KV facts (readKvBytesPerBlockToken). */
type KvFacts = Effect.Effect.Success<ReturnType<typeof readKvBytesPerBlockToken>>

/**
 * The sizing of a pipeline whose shape is learnt as it goes: the model's KV facts once read (`model`), its context
 * and an even split of its blocks once it is set up (`pipeline`), each run's planned stages (`planned`). Without
 * `budgetBytes`, the budget is `parallel` sequences of min(context, 4096) tokens.
 */
export const make = (budgetBytes: number | undefined, parallel: number) => {
  // The pipeline's shape as its runs were last planned: the most blocks on one stage (more after a recovery onto
  // fewer stages, fewer again when a node rejoins). KV bytes per request and the default budget follow it.
  const shape: {
    layersPerStage: number
    kvBytesPerBlockToken: number
    kvBytesPerBlock?: ReadonlyArray<number> | undefined
    maxSeqLen: number
    slidingWindow?: SlidingWindowLayout | undefined
    ranges?: ReadonlyArray<readonly [number, number]>
    recurrent?: RecurrentLayout | undefined
  } = { layersPerStage: 0, kvBytesPerBlockToken: 0, maxSeqLen: 0 }
  return {
    budget: () => budgetBytes ?? parallel * kvBytesPerSequence(shape, Math.min(shape.maxSeqLen, 4096)),
    bytes: (contextLength: number) => kvBytesPerSequence(shape, contextLength),
    model: (kv: KvFacts) => {
      shape.kvBytesPerBlockToken = kv.bytes
      shape.kvBytesPerBlock = kv.perBlock
      shape.slidingWindow = kv.slidingWindow
      shape.recurrent = kv.recurrent
    },
    /** The pipeline's shape before its first run is planned (the warm-up's plan refines it). */
    pipeline: (model: { readonly maxSeqLen: number; readonly numLayers: number }, stageCount: number) => {
      shape.maxSeqLen = model.maxSeqLen
      shape.layersPerStage = Math.ceil(model.numLayers / stageCount)
    },
    /** A run was planned over these stages' block ranges; true when the sizes changed (its heaviest stage differs). */
    planned: (stages: ReadonlyArray<{ readonly layers: readonly [number, number] }>): boolean => {
      const layers = Math.max(...stages.map((s) => s.layers[1] - s.layers[0]))
      const before = kvBytesPerSequence(shape, shape.maxSeqLen)
      shape.ranges = stages.map((s) => [s.layers[0], s.layers[1]] as const)
      if (layers === shape.layersPerStage && kvBytesPerSequence(shape, shape.maxSeqLen) === before) return false
      shape.layersPerStage = layers
      return true
    }
  }
}
