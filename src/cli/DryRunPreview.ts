/** What `swactor run --dry-run` prints: the nodes' reported capacity, then the placement the planner made and why. */
import type { PlacementChoice } from "../domain/plan.js"
import type { PlacementExplanation, RunUpdate } from "../services/Orchestrator.js"
import { SPEED_SPLIT_MIN_GAIN } from "../services/Placement.js"
import { gib, mib, size } from "./Units.js"
import type { DeviceShare } from "../services/DeviceFit.js"

/** `--dry-run`: the nodes' reported capacity, then the placement the planner made. */
export const renderPreview = (update: RunUpdate): string => {
  switch (update._tag) {
    case "PoolReady":
      return [
        "nodes (as reported in their heartbeat):",
        ...update.capacity.flatMap(({ capacity, node }) => [
          `  node ${node.nodeId} ${node.address}: ${capacity.hostname}, ${capacity.backend}, ${capacity.threads} threads, ` +
            `${gib(capacity.freeMemoryBytes)} free of ${gib(capacity.totalMemoryBytes)}, ${capacity.activeStages} stages hosted` +
            (capacity.speedBytesPerSecond === undefined
              ? ""
              : `, ${(capacity.speedBytesPerSecond / 1e9).toFixed(2)} GB/s ${capacity.speedSource ?? "declared"}`),
          ...(capacity.devices ?? []).map(
            (d) =>
              `    device ${d.name} (${d.description}): ${d.kind}, ${gib(d.freeBytes)} free of ${gib(d.totalBytes)}`
          )
        ])
      ].join("\n")
    case "Planned":
      return [
        `placement (run ${update.runId}):`,
        ...update.stages.map((s) => `  stage ${s.stageIndex}: blocks [${s.layers[0]}, ${s.layers[1]}) on ${s.address}`),
        ...(update.placement === undefined ? [] : explainPlacement(update.placement)),
        "dry run: nothing was provisioned"
      ].join("\n")
    case "AgentsStarted":
      return `agents: ${update.nodes.map((n) => n.address).join(", ")}`
    default:
      return ""
  }
}

/**
 * Why this placement: per stage its node's free memory and speed, its blocks, the weight bytes it stores and those it
 * reads per token (fewer for a mixture of experts: only the routed experts), its memory and expected ms per token.
 */
const explainPlacement = ({ choice, deviceShares, pool }: PlacementExplanation): ReadonlyArray<string> => [
  `${choice.intent.toLowerCase()} placement, in the planner's cost model:`,
  ...choice.stages.map((s) => {
    const node = pool.find((n) => n.nodeId === s.nodeId)
    const free = node === undefined ? "unknown" : mib(node.freeMemoryBytes)
    const speed = node === undefined ? "unknown" : `${(node.speedBytesPerSecond / 1e9).toFixed(2)} GB/s`
    return (
      `  stage ${s.stageIndex} on node ${s.nodeId} (${free} free, ${speed}): ` +
      `${s.layerEndExclusive - s.layerStart} blocks [${s.layerStart}, ${s.layerEndExclusive}), ` +
      `${mib(s.weightBytes)} weights, ${mib(s.activeBytes)} read per token, ${mib(s.memoryBytes)} with KV and buffers, ` +
      `${s.expectedMillis.toFixed(2)} ms/token`
    )
  }),
  `  expected: ${choice.latencyMillis.toFixed(2)} ms per token for one sequence, ` +
    `${choice.bottleneckMillis.toFixed(2)} ms per token at the slowest stage (pipeline throughput limit)`,
  ...speedShares(choice),
  ...(deviceShares ?? []).map(({ device, share, stageIndex }) => deviceLine(stageIndex, device, share)),
  ...(choice.stages.length < pool.length
    ? [`  ${pool.length - choice.stages.length} node(s) left out: they would slow the pipeline or cannot hold a block`]
    : [])
]

/** A GPU stage's split, as it will load: its blocks on the device, device memory by part, host memory. */
const deviceLine = (stageIndex: number, device: string, share: DeviceShare): string =>
  `  stage ${stageIndex} on ${device}: ${share.blocks} blocks on the device (the last), device ` +
  `${size(share.weightBytes + share.cacheBytes + share.computeBytes)} (weights ${size(share.weightBytes)}, ` +
  `caches ${size(share.cacheBytes)}, compute ${size(share.computeBytes)}), host ${size(share.hostBytes)}`

/** A speed placement's shares of the blocks, and why they are not (or are) the equal split. */
const speedShares = (choice: PlacementChoice): ReadonlyArray<string> => {
  if (choice.intent !== "Speed") return []
  const shares = choice.stages.map((s) => s.layerEndExclusive - s.layerStart)
  const total = shares.reduce((sum, n) => sum + n, 0)
  const equal = choice.equalSplitMillis
  const why =
    equal === undefined
      ? "the equal split does not fit the nodes' memory"
      : choice.bottleneckMillis < equal
        ? `the equal split would take ${equal.toFixed(2)} ms per token at its slowest stage`
        : `the equal split, as splitting by speed would not make the slowest stage ` +
          `${Math.round(SPEED_SPLIT_MIN_GAIN * 100)}% faster`
  // A node so slow that one block makes it the slowest stage: the stages asked for keep it, capacity may not.
  const slowest = choice.stages.find((s) => s.expectedMillis === choice.bottleneckMillis)
  const fewest =
    slowest !== undefined && choice.stages.length > 1 && slowest.layerEndExclusive - slowest.layerStart === 1
      ? [
          `  the slowest stage, on node ${slowest.nodeId}, holds one block, the fewest a stage can: ` +
            "--placement capacity may leave that node out"
        ]
      : []
  return [`  blocks by measured speed: ${shares.join(" + ")} of ${total} over the stages in order; ${why}`, ...fewest]
}
