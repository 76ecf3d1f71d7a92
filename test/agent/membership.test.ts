import { assert, describe, it } from "@effect/vitest"
import { Effect, Exit, Fiber, Option, TestClock } from "effect"
import { NodeId } from "../../src/domain/ids.js"
import * as MembershipLive from "../../src/layers/agent/MembershipLive.js"
import { Membership, NodeCapacity, NodeEndpoint } from "../../src/services/Membership.js"

const node = (id: number) => NodeEndpoint.make({ nodeId: NodeId.make(id), address: `10.0.0.${id}:7000` })
const capacity = NodeCapacity.make({
  freeMemoryBytes: 8e9,
  totalMemoryBytes: 16e9,
  threads: 4,
  backend: "cpu",
  hostname: "test",
  activeStages: 0
})
const answers = { _tag: "Answers", capacity } as const
const heartbeat = { interval: "1 second", deadline: "5 seconds" } as const

// Canonical fixture: a pool of three nodes that all answer; each test changes one node's behaviour.
const world = (behaviours: ReadonlyArray<readonly [number, MembershipLive.TestNodeBehaviour]>) =>
  Effect.gen(function* () {
    const nodes = yield* MembershipLive.makeTestNodes(new Map(behaviours.map(([id, b]) => [NodeId.make(id), b])))
    const membership = yield* Effect.provide(Membership, MembershipLive.layer)
    const pool = yield* membership.watch([node(1), node(2), node(3)], nodes.probe, heartbeat)
    return { nodes, pool }
  })

describe("Membership", () => {
  // PoolReady: the nodes a plan needs are ready as soon as each has answered one heartbeat,
  // and the report carries each node's capacity.
  it.scoped("the pool is ready once every needed node answers", () =>
    Effect.gen(function* () {
      const { pool } = yield* world([
        [1, answers],
        [2, answers],
        [3, { _tag: "Hangs" }]
      ])
      const ready = yield* pool.awaitReady([NodeId.make(1), NodeId.make(2)], "10 seconds")
      assert.deepStrictEqual([...ready.keys()], [NodeId.make(1), NodeId.make(2)])
      assert.strictEqual(ready.get(NodeId.make(1))?.threads, 4)
    })
  )

  // A needed node that never answers makes readiness fail after the deadline, naming the node.
  it.scoped("a needed node that never answers fails readiness after its deadline", () =>
    Effect.gen(function* () {
      const { pool } = yield* world([
        [1, answers],
        [2, { _tag: "Refuses", message: "bad cluster token" }],
        [3, answers]
      ])
      const fiber = yield* Effect.fork(pool.awaitReady([NodeId.make(1), NodeId.make(2)], "30 seconds"))
      yield* TestClock.adjust("29 seconds")
      assert.isTrue(Option.isNone(yield* Fiber.poll(fiber)))
      yield* TestClock.adjust("1 second")
      const exit = yield* Fiber.await(fiber)
      assert.isTrue(Exit.isFailure(exit))
      const error = yield* Effect.flip(Fiber.join(fiber))
      assert.strictEqual(error._tag, "PoolNotReady")
      assert.deepStrictEqual(
        error.missing.map((n) => n.nodeId),
        [NodeId.make(2)]
      )
      assert.include(error.lastError, "bad cluster token")
    })
  )

  // MembershipLost: a node that stops answering is lost once the deadline passes since its last
  // answer — not before — and the loss names the node.
  it.scoped("a node that misses heartbeats past the deadline is lost, not before", () =>
    Effect.gen(function* () {
      const { nodes, pool } = yield* world([
        [1, answers],
        [2, answers],
        [3, answers]
      ])
      yield* pool.awaitReady([NodeId.make(1), NodeId.make(2), NodeId.make(3)], "10 seconds")
      const lost = yield* Effect.fork(pool.firstLost)
      yield* nodes.set(NodeId.make(2), { _tag: "Hangs" })
      yield* TestClock.adjust("4 seconds")
      assert.isTrue(Option.isNone(yield* Fiber.poll(lost)))
      yield* TestClock.adjust("3 seconds")
      const first = yield* Fiber.join(lost)
      assert.strictEqual(first.node.nodeId, NodeId.make(2))
      assert.include(first.reason, "deadline 5000 ms")
    })
  )

  // A dropped control connection is an immediate loss, and the first reason sticks.
  it.scoped("markLost is immediate and the first reason sticks", () =>
    Effect.gen(function* () {
      const { pool } = yield* world([
        [1, answers],
        [2, answers],
        [3, answers]
      ])
      yield* pool.markLost(NodeId.make(3), "control connection closed")
      yield* pool.markLost(NodeId.make(3), "later reason")
      const first = yield* pool.firstLost
      assert.strictEqual(first.reason, "control connection closed")
      const status = (yield* pool.status).get(NodeId.make(3))
      assert.strictEqual(status?._tag, "Lost")
    })
  )
})
