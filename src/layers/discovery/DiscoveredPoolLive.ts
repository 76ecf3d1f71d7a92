/**
 * The discovered pool, live (issue 39): the discovery listener (DiscoveryListener.ts) kept open for as long as its
 * scope (a `serve --discover`: the whole life of the server), and a line each time a verified node joins the set or
 * leaves it (a leave message, its announcements expired, or buried: found dead by the orchestrator), and each time two
 * live nodes announce one id (both refused, both named).
 */
import { Effect, Layer, Schedule, type Scope } from "effect"
import type { DiscoveredNode } from "../../domain/discovery.js"
import { DiscoveredPool, type DiscoveredPoolService } from "../../services/DiscoveredPool.js"
import { type ListenerOptions, makeDiscoveryListener } from "./DiscoveryListener.js"

export interface DiscoveredPoolOptions extends ListenerOptions {
  /** Where a node joining or leaving the set is said (default: nowhere). */
  readonly log?: ((line: string) => void) | undefined
  /** How often the set is compared with the one before for those lines (default 250 ms). */
  readonly watchMillis?: number | undefined
}

/** The lines of what changed between two looks at the set: nodes that joined, nodes that left. */
export const changeLines = (
  before: ReadonlyMap<string, DiscoveredNode>,
  now: ReadonlyArray<DiscoveredNode>
): ReadonlyArray<string> => {
  const ids = new Set(now.map((node) => `${node.nodeId}@${node.address}`))
  const joined = now.filter((node) => !before.has(`${node.nodeId}@${node.address}`))
  const left = [...before].filter(([key]) => !ids.has(key)).map(([, node]) => node)
  return [
    ...joined.map((node) => `swactor: node ${node.nodeId} at ${node.address} joined the discovered pool`),
    ...left.map(
      (node) =>
        `swactor: node ${node.nodeId} at ${node.address} left the discovered pool (it left, its announcements ` +
        `expired, or it was found dead)`
    )
  ]
}

/** Listens until the scope closes; fails when the port cannot be bound. */
export const make = (options: DiscoveredPoolOptions): Effect.Effect<DiscoveredPoolService, Error, Scope.Scope> =>
  Effect.gen(function* () {
    const listener = yield* makeDiscoveryListener(options)
    const log = options.log
    if (log !== undefined) {
      let known = new Map<string, DiscoveredNode>()
      let conflicts = new Set<string>()
      yield* listener.view.pipe(
        Effect.map((view) => {
          for (const line of changeLines(known, view.verified)) log(line)
          known = new Map(view.verified.map((node) => [`${node.nodeId}@${node.address}`, node]))
          // two live nodes with one id: refused, both named (once, while it lasts)
          for (const c of view.conflicts) if (!conflicts.has(c.reason)) log(`swactor: not used: ${c.reason}`)
          conflicts = new Set(view.conflicts.map((c) => c.reason))
        }),
        Effect.repeat(Schedule.spaced(options.watchMillis ?? 250)),
        Effect.forkScoped
      )
    }
    return DiscoveredPool.of({ view: listener.view, bury: listener.bury })
  })

/** The discovered pool for the life of the layer. */
export const layer = (options: DiscoveredPoolOptions): Layer.Layer<DiscoveredPool, Error> =>
  Layer.scoped(DiscoveredPool, make(options))
