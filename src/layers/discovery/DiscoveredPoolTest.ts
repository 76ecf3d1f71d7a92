/**
 * The discovered pool for tests (issue 39): a set the test sets (`set`), no socket. Burying an address takes its node
 * out until the test sets a node of a newer run (a greater `startedAt`) at it, as the live set does.
 */
import { Effect, Ref } from "effect"
import type { DiscoveredNode, DiscoveryView } from "../../domain/discovery.js"
import { DiscoveredPool, type DiscoveredPoolService } from "../../services/DiscoveredPool.js"

export interface TestDiscoveredPool {
  readonly service: DiscoveredPoolService
  /** The verified nodes from now on (a buried node's run stays out). */
  readonly set: (nodes: ReadonlyArray<DiscoveredNode>) => Effect.Effect<void>
  /** The addresses buried so far, in order. */
  readonly buried: Effect.Effect<ReadonlyArray<string>>
}

export const makeTest = (initial: ReadonlyArray<DiscoveredNode> = []): Effect.Effect<TestDiscoveredPool> =>
  Effect.gen(function* () {
    const nodes = yield* Ref.make(initial)
    const dead = yield* Ref.make(new Map<string, number>())
    const buried = yield* Ref.make<ReadonlyArray<string>>([])
    const view = Effect.gen(function* () {
      const graves = yield* Ref.get(dead)
      const live = (yield* Ref.get(nodes)).filter((n) => (graves.get(n.nodeId) ?? -Infinity) < n.startedAt)
      return { verified: live, refused: [], otherVersions: [], conflicts: [] } satisfies DiscoveryView
    })
    const bury = (address: string) =>
      Effect.gen(function* () {
        const node = (yield* view).verified.find((n) => n.address === address)
        yield* Ref.update(buried, (list) => [...list, address])
        if (node !== undefined) yield* Ref.update(dead, (map) => new Map(map).set(node.nodeId, node.startedAt))
      })
    return { service: DiscoveredPool.of({ view, bury }), set: (next) => Ref.set(nodes, next), buried: Ref.get(buried) }
  })
