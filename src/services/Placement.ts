/**
 * Placement: which node hosts which contiguous block range, from the pool's capacities (free memory, speed) and the
 * model's per-block sizes. Pure and deterministic. The result feeds `planRun` (its `placement` and `layerRanges`), so
 * every plan still passes the planner's own checks.
 *
 * Cost model (the planner's own, printed by `--dry-run`): a stage reads its active weights once per token, so its
 * time is `active bytes / node speed` (bytes per second) plus one hop; the output head counts on the last stage, the
 * embedding lookup is free. Active bytes are what a token reads: a mixture of experts' blocks read only their routed
 * experts (`ModelLayout.activeBlockBytes`), so a MoE's speed follows its active parameters while its memory follows
 * every stored byte. A stage boundary may fall between any two blocks (dense or MoE alike). The pipeline's throughput limit is its slowest stage (`bottleneckMillis`), a single
 * sequence's token takes the sum (`latencyMillis`). Memory per stage: weights + KV cache (F16, `contextTokens` cells
 * per block) + a compute-buffer reserve.
 */
import { Either } from "effect"
import type {
  LayerRange,
  ModelLayout,
  PlacedStage,
  PlacementChoice,
  PlacementIntent,
  PoolNode
} from "../domain/plan.js"
import {
  InvalidLayerRanges,
  InvalidLayerSpec,
  InvalidPlacement,
  type PlacementRejection,
  PoolMemoryTooSmall,
  StageOverMemory
} from "../domain/planErrors.js"
import { kvBytesOfRange } from "./KvSize.js"
import { cutAllowed, stageRangeProblem, stageSources } from "./KvShare.js"
import { formatLayerRanges, layerRangesProblem, partitionLayers } from "./Planner.js"

export interface PlacementOptions {
  /** KV cells reserved per block (the run's context length). */
  readonly contextTokens: number
  /** Milliseconds one stage hop adds per token (framing, socket, wake-up). Default 0.1. */
  readonly hopMillis?: number
  /** Compute buffers reserved per stage. Default: 32 MiB + 64 bytes per hidden unit per context token. */
  readonly computeBytes?: number
}

/** Speed assumed for a node that reports none: 1 GB of weights per second. */
export const DEFAULT_SPEED_BYTES_PER_SECOND = 1e9

const DEFAULT_HOP_MILLIS = 0.1

/** Compute buffers reserved per stage when the caller gives no figure. */
export const computeReserveBytes = (layout: ModelLayout, contextTokens: number) =>
  32 * 2 ** 20 + 64 * layout.hiddenDim * contextTokens

/** Parses `--layers 0-9,10-15` (inclusive ends, a lone `7` is one block) into `[start, endExclusive)` ranges. */
export const parseLayerSpec = (text: string): Either.Either<ReadonlyArray<LayerRange>, InvalidLayerSpec> => {
  const parts = text.split(",").map((part) => part.trim())
  const ranges: Array<LayerRange> = []
  for (const part of parts) {
    const match = /^(\d+)(?:-(\d+))?$/.exec(part)
    if (match === null) return Either.left(new InvalidLayerSpec({ text, reason: `"${part}" is not a block range` }))
    const start = Number(match[1])
    const last = match[2] === undefined ? start : Number(match[2])
    if (last < start) return Either.left(new InvalidLayerSpec({ text, reason: `"${part}" ends before it starts` }))
    ranges.push([start, last + 1])
  }
  return Either.right(ranges)
}

interface Costing {
  readonly weightPrefix: ReadonlyArray<number>
  /** Prefix sums of the bytes each block reads per token (stored bytes for dense blocks). */
  readonly activePrefix: ReadonlyArray<number>
  readonly kvPrefix: ReadonlyArray<number>
  readonly numLayers: number
  readonly layout: ModelLayout
  readonly contextTokens: number
  readonly computeBytes: number
  readonly hopMillis: number
}

const prefix = (values: ReadonlyArray<number>) => {
  const out = [0]
  for (const v of values) out.push(out[out.length - 1]! + v)
  return out
}

const costing = (layout: ModelLayout, options: PlacementOptions): Costing => ({
  weightPrefix: prefix(layout.blockBytes),
  activePrefix: prefix(layout.activeBlockBytes ?? layout.blockBytes),
  // KV bytes of one sequence per block: the context, or a sliding-window block's capped cache (services/KvSize.ts)
  // (cells padded as the engine pads them: kvBytesOfRange is what a stage of those blocks allocates)
  kvPrefix: prefix(layout.kvBytesPerToken.map((_, i) => kvBytesOfRange(layout, i, i + 1, options.contextTokens))),
  numLayers: layout.blockBytes.length,
  layout,
  contextTokens: options.contextTokens,
  computeBytes: options.computeBytes ?? computeReserveBytes(layout, options.contextTokens),
  hopMillis: options.hopMillis ?? DEFAULT_HOP_MILLIS
})

const weightBytesOf = (c: Costing, start: number, end: number) => {
  const blocks = c.weightPrefix[end]! - c.weightPrefix[start]!
  return blocks + (start === 0 ? c.layout.inputBytes : 0) + (end === c.numLayers ? c.layout.outputBytes : 0)
}

const memoryBytesOf = (c: Costing, start: number, end: number) =>
  weightBytesOf(c, start, end) + (c.kvPrefix[end]! - c.kvPrefix[start]!) + c.computeBytes

/** What a stage of blocks [start, end) needs: weights (with its role's embeddings / output head) + KV cache + compute. */
export const stageMemoryBytes = (layout: ModelLayout, start: number, end: number, options: PlacementOptions): number =>
  memoryBytesOf(costing(layout, options), start, end)

/**
 * Weight bytes a stage of blocks [start, end) reads per token: its blocks' active bytes, and on the last stage the
 * output head (a full matrix product); the embedding lookup reads one row, counted as nothing.
 */
const activeBytesOf = (c: Costing, start: number, end: number) =>
  c.activePrefix[end]! - c.activePrefix[start]! + (end === c.numLayers ? c.layout.outputBytes : 0)

const millisOf = (c: Costing, node: PoolNode, start: number, end: number) =>
  (activeBytesOf(c, start, end) / speedOf(node)) * 1000 + c.hopMillis

const speedOf = (node: PoolNode) =>
  Number.isFinite(node.speedBytesPerSecond) && node.speedBytesPerSecond > 0
    ? node.speedBytesPerSecond
    : DEFAULT_SPEED_BYTES_PER_SECOND

const stageOf = (c: Costing, stageIndex: number, node: PoolNode, start: number, end: number): PlacedStage => ({
  stageIndex,
  nodeId: node.nodeId,
  layerStart: start,
  layerEndExclusive: end,
  weightBytes: weightBytesOf(c, start, end),
  activeBytes: activeBytesOf(c, start, end),
  memoryBytes: memoryBytesOf(c, start, end),
  expectedMillis: millisOf(c, node, start, end)
})

const choiceOf = (intent: PlacementChoice["intent"], stages: ReadonlyArray<PlacedStage>): PlacementChoice => ({
  intent,
  stages,
  bottleneckMillis: Math.max(...stages.map((s) => s.expectedMillis)),
  latencyMillis: stages.reduce((sum, s) => sum + s.expectedMillis, 0)
})

/** The stages of `ranges`, stage i on node i of the pool (cycling), refused when a node's stages exceed its memory. */
const onPool = (
  c: Costing,
  intent: PlacementChoice["intent"],
  pool: ReadonlyArray<PoolNode>,
  ranges: ReadonlyArray<LayerRange>
): Either.Either<PlacementChoice, PlacementRejection> => {
  const stages = ranges.map(([start, end], i) => stageOf(c, i, pool[i % pool.length]!, start, end))
  for (const node of pool) {
    const mine = stages.filter((s) => s.nodeId === node.nodeId)
    // Stages of one node share its memory; each keeps its own compute buffers.
    const required = mine.reduce((sum, s) => sum + s.memoryBytes, 0)
    if (mine.length > 0 && required > node.freeMemoryBytes) {
      return Either.left(
        new StageOverMemory({
          nodeId: node.nodeId,
          stageIndices: mine.map((s) => s.stageIndex),
          requiredBytes: required,
          freeBytes: node.freeMemoryBytes
        })
      )
    }
  }
  return Either.right(choiceOf(intent, stages))
}

/**
 * The contiguous split of all blocks over `nodes` (in this order, each with at least one block) with the smallest
 * bottleneck, then the smallest latency, that keeps every node within its free memory; undefined when none fits.
 * Dynamic programming over (nodes used, blocks covered): O(nodes x blocks^2).
 */
const bestSplit = (c: Costing, nodes: ReadonlyArray<PoolNode>): ReadonlyArray<LayerRange> | undefined => {
  const n = c.numLayers
  const k = nodes.length
  if (k > n) return undefined
  type Cell = { readonly bottleneck: number; readonly latency: number; readonly from: number } | undefined
  // best[j][b]: nodes 0..j-1 cover blocks [0, b).
  const best: Array<Array<Cell>> = [[{ bottleneck: 0, latency: 0, from: -1 }, ...Array<Cell>(n).fill(undefined)]]
  for (let j = 1; j <= k; j++) {
    const node = nodes[j - 1]!
    const row: Array<Cell> = Array<Cell>(n + 1).fill(undefined)
    // The last node must end at n; earlier nodes must leave one block for each node after them.
    const minEnd = j
    const maxEnd = n - (k - j)
    for (let end = minEnd; end <= maxEnd; end++) {
      if (j === k && end !== n) continue
      let cell: Cell = undefined
      for (let start = j - 1; start < end; start++) {
        const prev = best[j - 1]![start]
        if (prev === undefined) continue
        // never between a shared KV block and the block whose cache it reads (ModelLayout.kvSources), nor between a
        // shared-indexer block and the block whose top-k it reuses (topKSources)
        if (!cutAllowed(stageSources(c.layout), start)) continue
        if (memoryBytesOf(c, start, end) > node.freeMemoryBytes) continue
        const ms = millisOf(c, node, start, end)
        const bottleneck = Math.max(prev.bottleneck, ms)
        const latency = prev.latency + ms
        if (
          cell === undefined ||
          bottleneck < cell.bottleneck ||
          (bottleneck === cell.bottleneck && latency < cell.latency)
        ) {
          cell = { bottleneck, latency, from: start }
        }
      }
      row[end] = cell
    }
    best.push(row)
  }
  if (best[k]![n] === undefined) return undefined
  const ranges: Array<LayerRange> = []
  let end = n
  for (let j = k; j >= 1; j--) {
    const from = best[j]![end]!.from
    ranges.unshift([from, end])
    end = from
  }
  return ranges
}

const better = (a: PlacementChoice, b: PlacementChoice) =>
  a.bottleneckMillis !== b.bottleneckMillis
    ? a.bottleneckMillis < b.bottleneckMillis
    : a.latencyMillis !== b.latencyMillis
      ? a.latencyMillis < b.latencyMillis
      : a.stages.length < b.stages.length

/** Pools up to this size are searched over every subset of nodes; larger ones over the fastest k, for each k. */
export const EXHAUSTIVE_POOL_LIMIT = 8

/** The node subsets (each kept in pool order) that `Capacity` considers. */
const candidateSubsets = (c: Costing, pool: ReadonlyArray<PoolNode>): ReadonlyArray<ReadonlyArray<PoolNode>> => {
  if (pool.length <= EXHAUSTIVE_POOL_LIMIT) {
    const subsets: Array<ReadonlyArray<PoolNode>> = []
    for (let mask = 1; mask < 1 << pool.length; mask++) subsets.push(pool.filter((_, i) => (mask & (1 << i)) !== 0))
    return subsets
  }
  // A node that cannot hold its smallest single block is of no use; the others join fastest first (ties by pool
  // order), so a node slow enough to hold the pipeline back even with one block can be left out.
  const smallest = Math.min(...c.layout.blockBytes.map((_, i) => memoryBytesOf(c, i, i + 1)))
  const bySpeed = pool
    .map((node, i) => ({ node, i }))
    .filter((e) => e.node.freeMemoryBytes >= smallest)
    .sort((a, b) => speedOf(b.node) - speedOf(a.node) || a.i - b.i)
  return bySpeed.map((_, k) => {
    const kept = new Set(bySpeed.slice(0, k + 1).map((e) => e.i))
    return pool.filter((_, i) => kept.has(i))
  })
}

const capacityPlacement = (
  c: Costing,
  pool: ReadonlyArray<PoolNode>
): Either.Either<PlacementChoice, PlacementRejection> => {
  let chosen: PlacementChoice | undefined
  for (const nodes of candidateSubsets(c, pool)) {
    if (nodes.length > c.numLayers) continue
    const ranges = bestSplit(c, nodes)
    if (ranges === undefined) continue
    const choice = choiceOf(
      "Capacity",
      ranges.map(([start, end], i) => stageOf(c, i, nodes[i]!, start, end))
    )
    if (chosen === undefined || better(choice, chosen)) chosen = choice
  }
  if (chosen !== undefined) return Either.right(chosen)
  return Either.left(
    new PoolMemoryTooSmall({
      requiredBytes: memoryBytesOf(c, 0, c.numLayers),
      poolFreeBytes: pool.reduce((sum, node) => sum + node.freeMemoryBytes, 0),
      largestNodeFreeBytes: Math.max(...pool.map((node) => node.freeMemoryBytes)),
      nodes: pool.length
    })
  )
}

/** The stage count refused when it cannot split the blocks into non-empty ranges. */
const stageCountProblem = (stageCount: number, numLayers: number): InvalidPlacement | undefined =>
  !Number.isSafeInteger(stageCount) || stageCount < 1 || stageCount > numLayers
    ? new InvalidPlacement({ reason: `${stageCount} stages cannot split ${numLayers} blocks into non-empty ranges` })
    : undefined

/** The equal split over `stageCount` stages, its boundaries moved off shared KV links; refused when it cannot be. */
const equalRanges = (
  layout: ModelLayout,
  stageCount: number
): Either.Either<ReadonlyArray<LayerRange>, InvalidPlacement> => {
  const numLayers = layout.blockBytes.length
  const problem = stageCountProblem(stageCount, numLayers)
  if (problem !== undefined) return Either.left(problem)
  const ranges = keepKvShared(layout, partitionLayers(numLayers, stageCount))
  if (ranges !== undefined) return Either.right(ranges)
  return Either.left(
    new InvalidPlacement({
      reason:
        `${stageCount} stages cannot split ${numLayers} blocks without separating a shared KV block from ` +
        `the block whose cache it reads (${legalCuts(layout).length} legal stage boundaries)`
    })
  )
}

/**
 * How much faster (a fraction of its ms per token) the speed split's slowest stage must be than the equal split's to
 * replace it: the speed probe's figures vary by a few percent from run to run, and alike nodes keep the equal split.
 */
export const SPEED_SPLIT_MIN_GAIN = 0.1

/**
 * `Speed`: stage i on node i of the pool (cycling), as `Balanced`, but each stage's blocks chosen by the cost model
 * (`bestSplit`: the smallest bottleneck within every node's memory), so a slower node gets fewer blocks. The equal
 * split stays when it fits and the speed split's slowest stage is not `SPEED_SPLIT_MIN_GAIN` faster; when neither
 * fits, the equal split's refusal (naming the node) is the answer.
 */
const speedPlacement = (
  c: Costing,
  pool: ReadonlyArray<PoolNode>,
  stageCount: number
): Either.Either<PlacementChoice, PlacementRejection> => {
  const problem = stageCountProblem(stageCount, c.numLayers)
  if (problem !== undefined) return Either.left(problem)
  const equal = Either.flatMap(equalRanges(c.layout, stageCount), (ranges) => onPool(c, "Speed", pool, ranges))
  const ranges = bestSplit(
    c,
    Array.from({ length: stageCount }, (_, i) => pool[i % pool.length]!)
  )
  // bestSplit keeps each stage within its node's memory; a node hosting several stages is checked on their sum here.
  const bySpeed = ranges === undefined ? undefined : Either.getOrUndefined(onPool(c, "Speed", pool, ranges))
  if (Either.isLeft(equal)) return bySpeed === undefined ? equal : Either.right(bySpeed)
  const equalSplitMillis = equal.right.bottleneckMillis
  const faster = bySpeed !== undefined && bySpeed.bottleneckMillis < equalSplitMillis * (1 - SPEED_SPLIT_MIN_GAIN)
  return Either.right({ ...(faster ? bySpeed : equal.right), equalSplitMillis })
}

/**
 * Chooses which node hosts which block range. `Balanced` and `Fixed` keep their ranges and are refused when a node's
 * stages exceed its free memory; `Speed` sizes the ranges of its stages by each node's speed within its memory;
 * `Capacity` searches for the fastest split that fits and is refused with the numbers when no split fits.
 * Deterministic: the same inputs give the same choice.
 */
export const choosePlacement = (
  intent: PlacementIntent,
  layout: ModelLayout,
  pool: ReadonlyArray<PoolNode>,
  options: PlacementOptions
): Either.Either<PlacementChoice, PlacementRejection> => {
  const numLayers = layout.blockBytes.length
  if (pool.length === 0) return Either.left(new InvalidPlacement({ reason: "the pool has no nodes" }))
  if (numLayers === 0) return Either.left(new InvalidPlacement({ reason: "the model has no blocks" }))
  if (layout.activeBlockBytes !== undefined && layout.activeBlockBytes.length !== numLayers) {
    return Either.left(
      new InvalidPlacement({
        reason: `the layout reads ${layout.activeBlockBytes.length} blocks per token but stores ${numLayers}`
      })
    )
  }
  const c = costing(layout, options)
  switch (intent._tag) {
    case "Balanced":
      return Either.flatMap(equalRanges(layout, intent.stageCount), (ranges) => onPool(c, "Balanced", pool, ranges))
    case "Speed":
      return speedPlacement(c, pool, intent.stageCount)
    case "Fixed": {
      const problem = layerRangesProblem(intent.ranges, numLayers, intent.ranges.length)
      if (problem !== undefined) {
        return Either.left(new InvalidLayerRanges({ ranges: formatLayerRanges(intent.ranges), reason: problem }))
      }
      // a range must hold every block whose KV cache its blocks read (gemma4's shared KV layers)
      for (const [start, end] of intent.ranges) {
        const shared = stageRangeProblem(layout, start, end)
        if (shared !== undefined) {
          return Either.left(new InvalidLayerRanges({ ranges: formatLayerRanges(intent.ranges), reason: shared }))
        }
      }
      return onPool(c, "Fixed", pool, intent.ranges)
    }
    case "Capacity":
      return capacityPlacement(c, pool)
  }
}

/** Block indices a stage may start at besides 0 (ModelLayout.kvSources, topKSources: not inside a linked group). */
const legalCuts = (layout: ModelLayout): ReadonlyArray<number> => {
  const sources = stageSources(layout)
  return Array.from({ length: layout.blockBytes.length - 1 }, (_, i) => i + 1).filter((c) => cutAllowed(sources, c))
}

/**
 * A balanced split moved onto legal boundaries (ModelLayout.kvSources): each boundary to the nearest legal one at or
 * below it that is above the previous boundary and leaves enough legal ones for the boundaries after it, else the first
 * legal one above the previous; undefined when there are fewer legal boundaries than cuts.
 */
const keepKvShared = (
  layout: ModelLayout,
  ranges: ReadonlyArray<LayerRange>
): ReadonlyArray<LayerRange> | undefined => {
  if (stageSources(layout) === undefined) return ranges
  const legal = legalCuts(layout)
  const wanted = ranges.length - 1
  if (legal.length < wanted) return undefined
  const cuts: Array<number> = []
  for (const [start] of ranges.slice(1)) {
    const previous = cuts[cuts.length - 1] ?? 0
    // leave enough legal boundaries above this one for the cuts still to place
    const highest = legal[legal.length - (wanted - cuts.length)]!
    const below = legal.filter((c) => c > previous && c <= Math.min(start, highest))
    const cut = below.length > 0 ? below[below.length - 1] : legal.find((c) => c > previous)
    if (cut === undefined) return undefined
    cuts.push(cut)
  }
  const bounds = [0, ...cuts, layout.blockBytes.length]
  return cuts
    .map((_, i) => [bounds[i]!, bounds[i + 1]!] as LayerRange)
    .concat([[bounds[cuts.length]!, bounds[cuts.length + 1]!]])
}

/** Stage placements and layer ranges of a choice, as `planRun` takes them. */
export const plannerPlacement = (choice: PlacementChoice) => ({
  stageCount: choice.stages.length,
  placement: {
    _tag: "FixedLinear" as const,
    stages: choice.stages.map((s) => ({ stageIndex: s.stageIndex, nodeId: s.nodeId }))
  },
  layerRanges: choice.stages.map((s): LayerRange => [s.layerStart, s.layerEndExclusive])
})
