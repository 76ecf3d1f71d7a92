/**
 * KV cache sizes: the one formula, used by the engine (KvCache.ts), the stage's StageInfo, the model catalog's layout
 * (placement, --dry-run), and the server's admission. The cache is F16 K and V per block, its cells padded to 256 as
 * llama.cpp pads n_ctx.
 */

/** Bytes of one cached K or V element (F16). */
export const KV_ELEMENT_BYTES = 2

/** Cells a cache is padded to a multiple of. */
export const KV_CELL_PADDING = 256

/** Padded KV cache length, as llama.cpp pads n_ctx. */
export const kvCacheSize = (contextLength: number): number =>
  Math.ceil(contextLength / KV_CELL_PADDING) * KV_CELL_PADDING

/** Cells attended to: llama.cpp's n_kv = min(size, max(256, pad(used, 256))). */
export const attendedCells = (kvSize: number, used: number): number =>
  Math.min(kvSize, Math.max(KV_CELL_PADDING, Math.ceil(used / KV_CELL_PADDING) * KV_CELL_PADDING))

/** KV bytes per token of one block whose K and V rows are `kWidth` and `vWidth` elements (head dim x KV heads). */
export const kvBytesPerTokenOfBlock = (kWidth: number, vWidth: number): number => KV_ELEMENT_BYTES * (kWidth + vWidth)

/** KV bytes of one sequence of `contextLength` tokens over blocks taking `bytesPerToken` together (cells padded). */
export const kvBytesOfSequence = (bytesPerToken: number, contextLength: number): number =>
  kvCacheSize(contextLength) * bytesPerToken

/**
 * Rows of one call a sliding-window cache keeps room for beyond its window (llama.cpp's n_ubatch term; swactor's
 * default prompt chunk). A longer call on a capped cache runs in pieces of at most
 * `size - window + 1` rows (KvCache.ts `maxCallRows`).
 */
const SWA_CALL_ROOM = 128

/**
 * Cells of a sliding-window block's cache: llama.cpp's iSWA size, GGML_PAD(min(n_ctx, window + n_ubatch), 256)
 * (llama-kv-cache-iswa.cpp), with swactor's call room for n_ubatch. Cells are reused ring-wise (cell = position mod
 * size); never more than the full cache.
 */
export const swaCacheSize = (contextLength: number, window: number): number =>
  Math.min(kvCacheSize(contextLength), Math.ceil((window + SWA_CALL_ROOM) / KV_CELL_PADDING) * KV_CELL_PADDING)

/** One block's KV per token and, for a sliding-window block, its window (its cache is capped; `swaCacheSize`). */
interface KvBlock {
  readonly bytesPerToken: number
  readonly window?: number | undefined
}

/**
 * KV bytes one session of `contextLength` tokens allocates on a stage (StageInfo's kvBytesPerToken, of which kvWindow's
 * part sits in capped sliding-window caches).
 */
export const kvBytesOfStage = (
  info: {
    readonly kvBytesPerToken: number
    readonly kvWindow?: { readonly window: number; readonly bytesPerToken: number }
    readonly stateBytes?: number
  },
  contextLength: number
): number => {
  const w = info.kvWindow
  // recurrent blocks (StageInfo.stateBytes): a constant state per sequence
  const state = info.stateBytes ?? 0
  return (
    state +
    (w === undefined
      ? kvBytesOfSequence(info.kvBytesPerToken, contextLength)
      : kvBytesOfBlocks(
          [
            { bytesPerToken: info.kvBytesPerToken - w.bytesPerToken },
            { bytesPerToken: w.bytesPerToken, window: w.window }
          ],
          contextLength
        ))
  )
}

/** KV bytes of one sequence of `contextLength` tokens over `blocks`: full blocks hold the context, windowed ones less. */
export const kvBytesOfBlocks = (blocks: ReadonlyArray<KvBlock>, contextLength: number): number =>
  blocks.reduce(
    (sum, b) =>
      sum +
      b.bytesPerToken * (b.window === undefined ? kvCacheSize(contextLength) : swaCacheSize(contextLength, b.window)),
    0
  )

/** What a model's blocks keep per sequence (ModelLayout's fields; engine/BlockMemory.ts derives them). */
export interface BlocksKv {
  readonly kvBytesPerToken: ReadonlyArray<number>
  readonly slidingWindow?: { readonly window: number; readonly blocks: ReadonlyArray<boolean> } | undefined
  readonly stateBytes?: ReadonlyArray<number> | undefined
}

/**
 * Bytes one sequence of `contextLength` tokens takes on a stage of blocks [start, end): each block's KV rows over its
 * cache (the padded context, or a sliding-window block's capped ring) plus its constant state. What the engine
 * allocates for such a stage (KvCache.ts), to the byte.
 */
export const kvBytesOfRange = (kv: BlocksKv, start: number, end: number, contextLength: number): number => {
  let sum = 0
  for (let il = start; il < end; il++) {
    const window = kv.slidingWindow?.blocks[il] === true ? kv.slidingWindow.window : undefined
    sum +=
      (kv.kvBytesPerToken[il] ?? 0) *
        (window === undefined ? kvCacheSize(contextLength) : swaCacheSize(contextLength, window)) +
      (kv.stateBytes?.[il] ?? 0)
  }
  return sum
}
