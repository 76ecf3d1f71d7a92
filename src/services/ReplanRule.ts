/**
 * When a server re-plans onto the nodes of its discovered pool (issue 39), pure: the plan those nodes would get (the
 * placement the pipeline asked for, over the nodes in the order a new pipeline takes them) against the plan serving
 * now. Better is: the model fits now where it did not, or the slowest stage's milliseconds per token (placement's
 * cost, services/Placement.ts: the pipeline's throughput limit) are lower by more than `margin` (a fraction).
 */
import { Either } from "effect"
import type { DiscoveredNode } from "../domain/discovery.js"
import { NodeId } from "../domain/ids.js"
import type { ModelLayout, PlacementChoice, PlacementIntent, PoolNode } from "../domain/plan.js"
import type { PlacementRejection } from "../domain/planErrors.js"
import type { PlacementExplanation, PlacementRequest } from "./Orchestrator.js"
import { choosePlacement, DEFAULT_SPEED_BYTES_PER_SECOND } from "./Placement.js"

/** The margin `serve --replan-margin` defaults to: a plan 20 % faster per token replaces the one serving. */
export const DEFAULT_REPLAN_MARGIN = 0.2

/** What the plan serving now is, as the pipeline was set up. */
export interface ServingPlan {
  readonly explanation: PlacementExplanation
  readonly layout: ModelLayout
  readonly contextTokens: number
  /** Its agents' control addresses, by their node ids in the plan. */
  readonly addresses: ReadonlyMap<number, string>
}

/** The intent a new pipeline of `count` nodes would place with (the stage count follows the nodes unless fixed). */
const intentOf = (request: PlacementRequest | undefined, stages: number | undefined, count: number): PlacementIntent =>
  request?._tag === "Capacity"
    ? { _tag: "Capacity" }
    : request?._tag === "Fixed"
      ? { _tag: "Fixed", ranges: request.ranges }
      : { _tag: request?._tag === "Speed" ? "Speed" : "Balanced", stageCount: stages ?? count }

/**
 * The plan the discovered nodes would get: node i (from 1, in the pool's order, as a new pipeline numbers them) with
 * what it reported when the serving pipeline was set up if it serves now (its free memory before its stages loaded,
 * its speed), else what it announced (its free memory) at the serving nodes' lowest speed (an announcement carries
 * none; a node not measured yet is not taken for faster than the ones measured).
 */
export const candidatePlan = (
  serving: ServingPlan,
  nodes: ReadonlyArray<DiscoveredNode>,
  request: PlacementRequest | undefined,
  stages: number | undefined
): Either.Either<PlacementChoice, PlacementRejection> => {
  const reported = new Map(
    serving.explanation.pool.flatMap((p) => {
      const address = serving.addresses.get(p.nodeId)
      return address === undefined ? [] : [[address, p] as const]
    })
  )
  const speeds = serving.explanation.pool.map((p) => p.speedBytesPerSecond)
  const unknownSpeed = speeds.length === 0 ? DEFAULT_SPEED_BYTES_PER_SECOND : Math.min(...speeds)
  const pool = nodes.map((node, i): PoolNode => ({
    nodeId: NodeId.make(i + 1),
    freeMemoryBytes: reported.get(node.address)?.freeMemoryBytes ?? node.resources.freeMemoryBytes,
    speedBytesPerSecond: reported.get(node.address)?.speedBytesPerSecond ?? unknownSpeed
  }))
  return choosePlacement(intentOf(request, stages, nodes.length), serving.layout, pool, {
    contextTokens: serving.contextTokens
  })
}

export interface ReplanJudgement {
  readonly better: boolean
  /** Why, in words (for the server's log line). */
  readonly words: string
}

const ms = (millis: number) => `${millis.toPrecision(3)} ms`

/** Whether `candidate` should replace `current` (undefined: nothing fits now). */
export const judgeReplan = (
  current: PlacementChoice | undefined,
  candidate: Either.Either<PlacementChoice, PlacementRejection>,
  margin: number
): ReplanJudgement => {
  if (Either.isLeft(candidate))
    return { better: false, words: `the nodes' plan does not fit: ${candidate.left.message}` }
  const next = candidate.right
  if (current === undefined) return { better: true, words: `the model fits now (${next.stages.length} stages)` }
  const gain = 1 - next.bottleneckMillis / current.bottleneckMillis
  const words =
    `the slowest stage ${ms(current.bottleneckMillis)} per token on ${current.stages.length} stages, ` +
    `${ms(next.bottleneckMillis)} on ${next.stages.length} (${(gain * 100).toFixed(0)} % less; the margin is ` +
    `${(margin * 100).toFixed(0)} %)`
  return { better: gain > margin, words }
}
