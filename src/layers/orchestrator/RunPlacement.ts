/**
 * The orchestrator's placement step: from the request's intent, the model's layout and the pool's heartbeat answers,
 * which node hosts which block range. The orchestrator calls `placementFor` once per run, after the pool is ready,
 * and `nodesToAwait` before, to know whose capacity it needs.
 */
import { Effect, Either } from "effect"
import type { NodeId } from "../../domain/ids.js"
import type { LayerRange, ModelLayout, PlacementIntent, PoolNode, StagePlacement } from "../../domain/plan.js"
import type { PlacementRejection } from "../../domain/planErrors.js"
import type { ModelLoadError } from "../../domain/gguf.js"
import type { NodeCapacity, NodeEndpoint } from "../../services/Membership.js"
import type { PlacementExplanation, PlacementRequest } from "../../services/Orchestrator.js"
import { choosePlacement, DEFAULT_SPEED_BYTES_PER_SECOND, plannerPlacement } from "../../services/Placement.js"
import { deviceShare, stageBytesOfLayout } from "../../services/DeviceFit.js"

export interface PlacementFor {
  readonly stages: ReadonlyArray<StagePlacement>
  readonly layerRanges: ReadonlyArray<LayerRange>
  readonly explanation: PlacementExplanation
  /** The model's per-block bytes it was costed with (recovery re-plans with them). */
  readonly layout: ModelLayout
}

/** The stage count a request's placement implies before any node answered (capacity decides later). */
export const requestedStageCount = (placement: PlacementRequest | undefined, stages: number): number =>
  placement?._tag === "Fixed" ? placement.ranges.length : stages

/** The nodes whose capacity the placement needs: all of them for `Capacity`, else those hosting stage 0..n-1. */
export const nodesToAwait = (
  placement: PlacementRequest | undefined,
  nodes: ReadonlyArray<NodeEndpoint>,
  stageCount: number
): ReadonlyArray<NodeId> =>
  placement?._tag === "Capacity"
    ? nodes.map((n) => n.nodeId)
    : [...new Set(Array.from({ length: stageCount }, (_, i) => nodes[i % nodes.length]!.nodeId))]

/**
 * The device a node's GPU stages compute on, as the engine picks it (ggml/Bindings.ts gpuDeviceIndex: the first
 * discrete GPU, else the first integrated one), when its backend is not the CPU; undefined otherwise.
 */
const stageDevice = (capacity: NodeCapacity | undefined) => {
  if (capacity === undefined || capacity.backend === "cpu") return undefined
  const devices = capacity.devices ?? []
  return devices.find((d) => d.kind === "gpu") ?? devices.find((d) => d.kind === "igpu")
}

/** A heartbeat answer as placement sees it (declared or measured speed; unknown speed = the default). */
export const poolNodeOf = (nodeId: NodeId, capacity: NodeCapacity): PoolNode => ({
  nodeId,
  freeMemoryBytes: capacity.freeMemoryBytes,
  speedBytesPerSecond: capacity.speedBytesPerSecond ?? DEFAULT_SPEED_BYTES_PER_SECOND
})

/**
 * Chooses the run's placement. `Balanced` (the default) gives stage i of `stageCount` to node i (cycling) with equal
 * ranges, as before; `Speed` the same stages with ranges sized by the nodes' reported speeds (services/Placement.ts);
 * every intent is refused, typed, when a node's stages exceed its reported free memory.
 */
export const placementFor = (args: {
  readonly request: PlacementRequest | undefined
  /** The model's per-block sizes (ModelCatalog.layout). */
  readonly layout: ModelLayout
  readonly nodes: ReadonlyArray<NodeEndpoint>
  readonly capacity: ReadonlyMap<NodeId, NodeCapacity>
  readonly stageCount: number
  readonly contextTokens: number
  /** The model's context (ModelFacts.maxSeqLen): a GPU stage's split is planned at it (DeviceFit.devicePlanContext). */
  readonly modelContext?: number
}): Effect.Effect<PlacementFor, PlacementRejection | ModelLoadError> =>
  Effect.gen(function* () {
    const layout = args.layout
    const intent: PlacementIntent =
      args.request?._tag === "Capacity"
        ? { _tag: "Capacity" }
        : args.request?._tag === "Fixed"
          ? { _tag: "Fixed", ranges: args.request.ranges }
          : { _tag: args.request?._tag === "Speed" ? "Speed" : "Balanced", stageCount: args.stageCount }
    // Nodes that did not answer (not needed by a balanced or fixed placement) are not candidates.
    const pool = args.nodes.flatMap((node) => {
      const reported = args.capacity.get(node.nodeId)
      return reported === undefined ? [] : [poolNodeOf(node.nodeId, reported)]
    })
    // Balanced, speed and fixed cycle stage i onto the i-th node of the whole pool, as the planner's callers always did.
    const ordered =
      intent._tag === "Capacity"
        ? pool
        : args.nodes.map(
            (node) =>
              pool.find((p) => p.nodeId === node.nodeId) ?? {
                nodeId: node.nodeId,
                freeMemoryBytes: Number.MAX_SAFE_INTEGER,
                speedBytesPerSecond: DEFAULT_SPEED_BYTES_PER_SECOND
              }
          )
    const choice = yield* Either.match(
      choosePlacement(intent, layout, ordered, { contextTokens: args.contextTokens }),
      {
        onLeft: Effect.fail,
        onRight: Effect.succeed
      }
    )
    const { layerRanges, placement } = plannerPlacement(choice)
    const deviceShares = choice.stages.flatMap((s) => {
      const device = stageDevice(args.capacity.get(s.nodeId))
      if (device === undefined) return []
      const bytes = stageBytesOfLayout(
        layout,
        s.layerStart,
        s.layerEndExclusive,
        args.modelContext ?? args.contextTokens
      )
      const budget = Math.min(device.freeBytes, device.limitBytes ?? Number.POSITIVE_INFINITY)
      return [{ stageIndex: s.stageIndex, device: device.name, share: deviceShare(bytes, budget) }]
    })
    return { stages: placement.stages, layerRanges, explanation: { choice, pool, deviceShares }, layout }
  })
