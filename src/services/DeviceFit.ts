/**
 * How much of a stage a GPU holds: the one rule, used by the engine when it loads a GPU stage
 * (layers/engine/StageExecutorLive.ts) and by `--dry-run` when it shows a stage's device and host memory.
 *
 * Like llama.cpp's `-ngl`, a stage larger than its device's budget keeps its *last* blocks on the device, with the
 * tensors its blocks share and the output head, and its earlier blocks in host memory, where the CPU runs them (the
 * stage's scheduler copies the hidden rows across once, at the split). The input tables (token embeddings) go to the
 * device only when every block does. A block counts its weights and one session's caches (KV, recurrent state) at the
 * context the stage is planned for; the device also keeps room for a compute buffer (`computeEstimate`).
 */

import type { ModelLayout } from "../domain/plan.js"
import { kvBytesOfRange, kvCacheSize } from "./KvSize.js"

/**
 * The context a GPU stage's split is planned for: the model's, at most this (what a stage's session opens with when a
 * request does not say; a run's shorter context then leaves room to spare).
 */
export const DEVICE_PLAN_CONTEXT = 4096

/** The planned context of a model whose context is `modelContext`. */
export const devicePlanContext = (modelContext: number): number => Math.min(modelContext, DEVICE_PLAN_CONTEXT)

/** One block's memory: its weights, and one session's caches at the planned context. */
export interface BlockBytes {
  readonly weightBytes: number
  readonly cacheBytes: number
}

/** A stage's memory, part by part, as the fit reads it. */
export interface StageBytes {
  readonly blocks: ReadonlyArray<BlockBytes>
  /** The first stage's input tables (token embeddings, per-layer tables); 0 on a later stage. */
  readonly inputBytes: number
  /** Tensors every block reads, and the last stage's output head (norm, projection); on the device with any block. */
  readonly headBytes: number
  /** The device's compute buffer while any block is on it. */
  readonly computeBytes: number
  /**
   * Weights that stay in host memory wherever their block is: the device does not compute their products (a type it
   * lacks; the engine asks its `supports_op`). Not in `blocks`, `inputBytes` or `headBytes`. Absent: none.
   */
  readonly pinnedHostBytes?: number
}

/** Where a stage's memory goes. */
export interface DeviceShare {
  /** Blocks on the device: the stage's last `blocks` (0: the stage computes on the CPU alone). */
  readonly blocks: number
  /** Weights in device memory. */
  readonly weightBytes: number
  /** One session's caches in device memory, at the planned context. */
  readonly cacheBytes: number
  /** The compute buffer kept free on the device beside them (0 when no block is there). */
  readonly computeBytes: number
  /** Weights and one session's caches in host memory. */
  readonly hostBytes: number
}

const bytesOf = (b: BlockBytes) => b.weightBytes + b.cacheBytes

/** The stage's memory split for a device that may use `budgetBytes` (its free memory, or the node's `--gpu-memory`). */
export const deviceShare = (stage: StageBytes, budgetBytes: number): DeviceShare => {
  const n = stage.blocks.length
  const total = stage.blocks.reduce((s, b) => s + bytesOf(b), 0) + stage.inputBytes + stage.headBytes
  const all = total + stage.computeBytes <= budgetBytes
  let k = 0
  let onDevice = stage.headBytes + (all ? stage.inputBytes : 0)
  while (k < n && onDevice + bytesOf(stage.blocks[n - 1 - k]!) + stage.computeBytes <= budgetBytes) {
    onDevice += bytesOf(stage.blocks[n - 1 - k]!)
    k++
  }
  const pinned = stage.pinnedHostBytes ?? 0
  if (k === 0) return { blocks: 0, weightBytes: 0, cacheBytes: 0, computeBytes: 0, hostBytes: total + pinned }
  const mine = stage.blocks.slice(n - k)
  const cacheBytes = mine.reduce((s, b) => s + b.cacheBytes, 0)
  return {
    blocks: k,
    weightBytes: onDevice - cacheBytes,
    cacheBytes,
    computeBytes: stage.computeBytes,
    hostBytes: total - onDevice + pinned
  }
}

/**
 * A stage of blocks [start, end) of a model as the catalog's layout gives it (what `--dry-run` and the plan see before
 * any node loads it); the engine counts the same from the tensors it loads (layers/engine/DeviceSplit.ts).
 */
export const stageBytesOfLayout = (
  layout: ModelLayout,
  start: number,
  end: number,
  modelContext: number
): StageBytes => {
  const context = devicePlanContext(modelContext)
  const blocks: Array<BlockBytes> = []
  for (let il = start; il < end; il++) {
    blocks.push({ weightBytes: layout.blockBytes[il]!, cacheBytes: kvBytesOfRange(layout, il, il + 1, context) })
  }
  return {
    blocks,
    inputBytes: start === 0 ? layout.inputBytes : 0,
    headBytes: end === layout.blockBytes.length ? layout.outputBytes : 0,
    computeBytes: computeEstimate(layout.hiddenDim, kvCacheSize(context))
  }
}

/** Rows of the largest call a stage's compute buffer is kept for: a prompt chunk (the stage batcher's default). */
export const COMPUTE_ROWS = 512

/**
 * The compute buffer a GPU stage's device needs, estimated for its largest call, a prompt chunk of COMPUTE_ROWS rows:
 * a few activations per row live at once (counted as 32 floats per hidden unit: the FFN's and attention's rows are
 * wider than the hidden row; the allocator reuses memory between ops), plus the F16 attention mask over `contextCells`
 * cells copied to the device. From facts the model layout holds, so `--dry-run` and the loading stage count the same.
 * Measured on lavapipe: stories260K, a 512-row prompt at 1024 cells, 1.85 MB allocated, 2.1 MB estimated.
 */
export const computeEstimate = (hiddenDim: number, contextCells: number): number =>
  COMPUTE_ROWS * (32 * hiddenDim + 2 * contextCells)
