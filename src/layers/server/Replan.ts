/**
 * Nodes joining a running `serve --discover` (issue 39). While a pipeline serves, the discovered pool is looked at
 * every `everyMillis`: an agent whose announcements stopped and that does not answer is lost at once; an agent the
 * pipeline lost is buried there (so that no announcement of that run brings it back; restarted, it is heard again);
 * and when nodes the pipeline lacks appear, the plan over the pool is judged against
 * the one serving (services/ReplanRule.ts: the model fits now, or the slowest stage is faster by the margin). A better
 * plan is set up as a new pipeline beside the serving one and warmed up; then the next request runs on it, the
 * requests running finish on the pipeline they started on (nothing moved, so nothing is lost or altered), and that
 * pipeline is closed once it has no run left. A set of nodes is judged once.
 */
import { Clock, Effect, Either, Exit, Scope } from "effect"
import type { DiscoveredNode } from "../../domain/discovery.js"
import type { Pipeline, PlacementRequest } from "../../services/Orchestrator.js"
import type { DiscoveredPoolService } from "../../services/DiscoveredPool.js"
import { candidatePlan, DEFAULT_REPLAN_MARGIN, judgeReplan, type ServingPlan } from "../../services/ReplanRule.js"
import { errorWords, type Generation } from "./Revival.js"

/** What a re-plan works with: the pool, the margin, the pipeline's placement request, and the lifecycle's steps. */
export interface ReplanContext {
  readonly discovered: DiscoveredPoolService
  readonly margin: number | undefined
  readonly placement: PlacementRequest | undefined
  readonly stages: number | undefined
  readonly log: (line: string) => void
  readonly openGeneration: (parent: Scope.Scope) => Effect.Effect<Generation, { readonly _tag: string }>
  readonly warmUp: (pipeline: Pipeline) => Effect.Effect<void, { readonly _tag: string }>
  readonly observePipeline: (pipeline: Pipeline) => Effect.Effect<void>
  /** How often the pool is looked at (default 250 ms). */
  readonly everyMillis?: number
}

/** What the watch remembers across pipelines: the sets of nodes judged, the lost agents buried (until up again). */
export interface ReplanMemory {
  readonly judged: Set<string>
  readonly buried: Set<string>
}

export const makeReplanMemory = (): ReplanMemory => ({ judged: new Set(), buried: new Set() })

/**
 * A node unheard for this long has missed two announcements (one a second): it is probed, before its announcements
 * expire (5 s), so a node killed leaves the pool in about this plus the probe's second.
 */
const QUIET_MILLIS = 2500

/**
 * An agent whose announcements stopped (it left, they expired, or none for QUIET_MILLIS) and that does not answer a
 * probe either is lost now, without waiting for its heartbeat deadline or their expiry (a node killed). Each agent
 * newly lost is buried in the pool; one that answers again is forgotten (a later loss buries it again).
 */
const followPool = (ctx: ReplanContext, memory: ReplanMemory, pipeline: Pipeline) =>
  Effect.gen(function* () {
    const now = yield* Clock.currentTimeMillis
    const heard = new Set(
      (yield* ctx.discovered.view).verified
        .filter((node) => now - node.heardAtMillis <= QUIET_MILLIS)
        .map((node) => node.address)
    )
    for (const member of yield* pipeline.members) {
      const address = member.agent.node.address
      if (member.state !== "lost" && !heard.has(address) && pipeline.markLost !== undefined) {
        const answers = yield* member.agent.capacity.pipe(Effect.timeout("1 second"), Effect.isSuccess)
        if (!answers)
          yield* pipeline.markLost(
            member.agent.node.nodeId,
            "its announcements stopped (it left, or they expired) and it does not answer"
          )
        continue
      }
      if (member.state === "up") memory.buried.delete(address)
      if (member.state !== "lost" || memory.buried.has(address)) continue
      memory.buried.add(address)
      yield* ctx.discovered.bury(address)
    }
  })

/**
 * The plan serving now: the pipeline's own while none of its agents is lost, else the plan its agents still alive
 * would get (undefined: the model does not fit on them), as the runs after a loss plan on the survivors.
 */
const currentPlan = (
  ctx: ReplanContext,
  serving: ServingPlan,
  pipeline: Pipeline,
  heard: ReadonlyArray<DiscoveredNode>
) =>
  Effect.map(pipeline.members, (members) => {
    if (members.every((m) => m.state !== "lost")) return serving.explanation.choice
    const alive = new Set(members.filter((m) => m.state !== "lost").map((m) => m.agent.node.address))
    const survivors = heard.filter((node) => alive.has(node.address))
    return survivors.length === 0
      ? undefined
      : Either.getOrUndefined(candidatePlan(serving, survivors, ctx.placement, ctx.stages))
  })

/** The pool's nodes when they make a better plan than `pipeline`'s (judged once per set), else undefined. */
const judgePool = (ctx: ReplanContext, memory: ReplanMemory, pipeline: Pipeline) =>
  Effect.gen(function* () {
    const view = yield* ctx.discovered.view
    const agents = new Set(pipeline.agents.map((a) => a.node.address))
    const fresh = view.verified.filter((node) => !agents.has(node.address))
    const key = poolKey(view.verified)
    // a node just started is judged from its second announcement on: a twin with its id (a copied state folder) that
    // started beside it is heard by then, and both are refused instead
    const settled = fresh.every((node) => node.counter >= 1)
    if (fresh.length === 0 || !settled || pipeline.placed === undefined || memory.judged.has(key)) return undefined
    memory.judged.add(key)
    const serving = {
      ...pipeline.placed,
      addresses: new Map(pipeline.agents.map((a) => [a.node.nodeId as number, a.node.address]))
    }
    const candidate = candidatePlan(serving, view.verified, ctx.placement, ctx.stages)
    const current = yield* currentPlan(ctx, serving, pipeline, view.verified)
    const judgement = judgeReplan(current, candidate, ctx.margin ?? DEFAULT_REPLAN_MARGIN)
    const names = fresh.map((node) => node.address).join(", ")
    ctx.log(
      `swactor serve: ${names} joined: ${judgement.better ? "re-planning" : "the plan stays"}: ${judgement.words}`
    )
    return judgement.better ? view.verified : undefined
  })

/** Completes once the pool makes a better plan than `generation`'s (burying the agents it loses meanwhile). */
export const betterPlan = (
  ctx: ReplanContext,
  memory: ReplanMemory,
  generation: Generation
): Effect.Effect<ReadonlyArray<DiscoveredNode>> =>
  Effect.gen(function* () {
    while (true) {
      yield* followPool(ctx, memory, generation.pipeline)
      const nodes = yield* judgePool(ctx, memory, generation.pipeline)
      if (nodes !== undefined) return nodes
      yield* Effect.sleep(ctx.everyMillis ?? 250)
    }
  })

/** Closes `old` once no run is left on it (two looks half a second apart, so a request just admitted has started). */
const drain = (old: Generation) =>
  Effect.gen(function* () {
    let idleLooks = 0
    while (idleLooks < 2) {
      yield* Effect.sleep(500)
      idleLooks = (old.pipeline.activeRuns?.() ?? 0) === 0 ? idleLooks + 1 : 0
    }
    yield* Scope.close(old.scope, Exit.void)
  })

/**
 * A new pipeline over the pool, warmed up; `serveOn` puts it in service; the old one drains in `parent`. The old
 * one is returned when the new one cannot be set up or warmed (the pool is judged again when it changes).
 */
export const replanOnto = (
  ctx: ReplanContext,
  parent: Scope.Scope,
  old: Generation,
  serveOn: (pipeline: Pipeline) => Effect.Effect<void>
): Effect.Effect<Generation> =>
  Effect.gen(function* () {
    const opened = yield* Effect.either(ctx.openGeneration(parent))
    if (Either.isLeft(opened)) {
      ctx.log(`swactor serve: re-planning failed, serving on as before: ${errorWords(opened.left)}`)
      return old
    }
    const fresh = opened.right
    yield* ctx.observePipeline(fresh.pipeline)
    const warmed = yield* Effect.either(ctx.warmUp(fresh.pipeline))
    if (Either.isLeft(warmed)) {
      yield* Scope.close(fresh.scope, Exit.void)
      ctx.log(`swactor serve: re-planning failed, serving on as before: ${errorWords(warmed.left)}`)
      return old
    }
    yield* serveOn(fresh.pipeline)
    ctx.log(
      `swactor serve: re-planned onto ${fresh.pipeline.agents.length} nodes ` +
        `(${fresh.pipeline.agents.map((a) => a.node.address).join(", ")}), ${fresh.pipeline.stageCount} stages; ` +
        `the requests running finish on the plan before`
    )
    yield* Effect.forkIn(drain(old), parent)
    return fresh
  })

/** A placement refused for memory: more nodes may make the model fit. */
const memoryRefusals = new Set(["StageOverMemory", "PoolMemoryTooSmall"])

const poolKey = (nodes: ReadonlyArray<DiscoveredNode>) =>
  nodes.map((node) => `${node.nodeId}@${node.address}/${node.startedAt}`).join(",")

/**
 * The first pipeline over the discovered pool: while the model does not fit on its nodes (a placement refused for
 * memory), the server says so, stays loading, and tries again each time the pool changes (a node joins, leaves or
 * restarts); any other failure is the setup's.
 */
export const openWhenItFits = (
  ctx: ReplanContext,
  parent: Scope.Scope
): Effect.Effect<Generation, { readonly _tag: string }> =>
  Effect.gen(function* () {
    while (true) {
      const before = poolKey((yield* ctx.discovered.view).verified)
      const opened = yield* Effect.either(ctx.openGeneration(parent))
      if (Either.isRight(opened)) return opened.right
      if (!memoryRefusals.has(opened.left._tag)) return yield* Effect.fail(opened.left)
      ctx.log(
        `swactor serve: the model does not fit on the discovered nodes (${errorWords(opened.left)}); ` +
          `waiting for more nodes`
      )
      while (poolKey((yield* ctx.discovered.view).verified) === before) yield* Effect.sleep(ctx.everyMillis ?? 250)
    }
  })
