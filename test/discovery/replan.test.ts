// Re-planning onto nodes that join a running serve (issue 39), without a server: the rule (a plan over the pool
// replaces the one serving when the model fits only with it, or its slowest stage is faster by more than the margin),
// the watch over a test discovered pool (a lost agent buried once; an agent whose announcements stopped and that does
// not answer lost at once; a set of nodes judged once; the better pool's nodes handed back), and the live pool's
// lines when a node joins and when it is buried.
import { assert, describe, it } from "@effect/vitest"
import { Context, Effect, Either, Exit, Fiber, Layer, Redacted, Scope } from "effect"
import type { DiscoveredNode } from "../../src/domain/discovery.js"
import { NodeId } from "../../src/domain/ids.js"
import type { ModelLayout, PlacementChoice } from "../../src/domain/plan.js"
import type { NodeCapacity } from "../../src/services/Membership.js"
import type { Pipeline, PipelineMember } from "../../src/services/Orchestrator.js"
import { AgentUnavailable } from "../../src/services/AgentLinks.js"
import { DiscoveredPool } from "../../src/services/DiscoveredPool.js"
import { candidatePlan, judgeReplan, type ServingPlan } from "../../src/services/ReplanRule.js"
import { choosePlacement } from "../../src/services/Placement.js"
import { betterPlan, makeReplanMemory, type ReplanContext } from "../../src/layers/server/Replan.js"
import * as DiscoveredPoolTest from "../../src/layers/discovery/DiscoveredPoolTest.js"
import * as DiscoveredPoolLive from "../../src/layers/discovery/DiscoveredPoolLive.js"
import { makeAnnouncer } from "../../src/layers/discovery/Announcer.js"

const mib = 2 ** 20
/** Eight blocks of 64 MiB: a stage's time is its weights over the node's speed. */
const layout: ModelLayout = {
  blockBytes: Array.from({ length: 8 }, () => 64 * mib),
  kvBytesPerToken: Array.from({ length: 8 }, () => 0),
  inputBytes: 0,
  outputBytes: 0,
  hiddenDim: 64
}

const node = (address: string, freeGiB = 8, startedAt = 1, counter = 1): DiscoveredNode => ({
  nodeId: `id-${address}`,
  address,
  from: `${address.split(":")[0]}:5000`,
  startedAt,
  counter,
  resources: { totalMemoryBytes: 16 * 2 ** 30, freeMemoryBytes: freeGiB * 2 ** 30, cores: 4, backend: "cpu" },
  // heard for ever: never quiet, never expired
  heardAtMillis: Number.MAX_SAFE_INTEGER,
  expiresAtMillis: Number.MAX_SAFE_INTEGER
})

/** The plan serving on `addresses` (Speed over their pool, 1 GB/s each). */
const servingOn = (addresses: ReadonlyArray<string>): ServingPlan => {
  const pool = addresses.map((_, i) => ({
    nodeId: NodeId.make(i + 1),
    freeMemoryBytes: 8 * 2 ** 30,
    speedBytesPerSecond: 1e9
  }))
  const choice = Either.getOrThrow(
    choosePlacement({ _tag: "Speed", stageCount: addresses.length }, layout, pool, { contextTokens: 256 })
  )
  return {
    explanation: { choice, pool },
    layout,
    contextTokens: 256,
    addresses: new Map(addresses.map((a, i) => [i + 1, a]))
  }
}

describe("the re-plan rule", () => {
  it("a third node makes the slowest stage a third faster: over a 20 % margin, not over 40 %", () => {
    const serving = servingOn(["10.0.0.1:7000", "10.0.0.2:7000"])
    const pool = [node("10.0.0.1:7000"), node("10.0.0.2:7000"), node("10.0.0.3:7000")]
    const candidate = candidatePlan(serving, pool, { _tag: "Speed" }, undefined)
    assert.strictEqual(Either.getOrThrow(candidate).stages.length, 3)
    const at20 = judgeReplan(serving.explanation.choice, candidate, 0.2)
    assert.isTrue(at20.better, at20.words)
    assert.match(at20.words, /on 2 stages, .* on 3 \(\d+ % less; the margin is 20 %\)/)
    assert.isFalse(judgeReplan(serving.explanation.choice, candidate, 0.4).better)
    // the same nodes again: nothing to gain
    const same = candidatePlan(serving, pool.slice(0, 2), { _tag: "Speed" }, undefined)
    assert.isFalse(judgeReplan(serving.explanation.choice, same, 0).better)
  })

  it("a plan that does not fit is never better; one that fits where nothing did is", () => {
    const serving = servingOn(["10.0.0.1:7000"])
    const tiny = candidatePlan(serving, [node("10.0.0.9:7000", 0.01)], { _tag: "Balanced" }, undefined)
    assert.isTrue(Either.isLeft(tiny))
    assert.isFalse(judgeReplan(serving.explanation.choice, tiny, 0).better)
    const fits = candidatePlan(serving, [node("10.0.0.9:7000")], { _tag: "Balanced" }, undefined)
    const judged = judgeReplan(undefined as PlacementChoice | undefined, fits, 0.2)
    assert.isTrue(judged.better)
    assert.include(judged.words, "the model fits now")
  })
})

const capacity = { freeMemoryBytes: 8 * 2 ** 30 } as unknown as NodeCapacity

/** A pipeline stand-in on `addresses`: members' states set by the test, `answers` says who answers a probe. */
const pipelineOn = (serving: ServingPlan, addresses: ReadonlyArray<string>) => {
  const states = new Map<string, PipelineMember["state"]>(addresses.map((a) => [a, "up"]))
  const answers = new Set(addresses)
  const lost: Array<string> = []
  const agents = addresses.map((address, i) => ({
    node: { nodeId: NodeId.make(i + 1), address },
    pid: i + 1,
    dataAddress: { _tag: "Tcp" as const, host: "127.0.0.1", port: 1 },
    capacity: Effect.suspend(() =>
      answers.has(address)
        ? Effect.succeed(capacity)
        : Effect.fail(new AgentUnavailable({ address, message: "refused" }))
    )
  }))
  const pipeline = {
    agents,
    members: Effect.sync(() =>
      agents.map((agent) => ({ agent, state: states.get(agent.node.address)!, detail: "", exited: false }))
    ),
    placed: serving,
    markLost: (nodeId: number) =>
      Effect.sync(() => {
        const address = agents[nodeId - 1]!.node.address
        states.set(address, "lost")
        lost.push(address)
      })
  } as unknown as Pipeline
  return { pipeline, states, answers, lost }
}

describe("the watch over the discovered pool", () => {
  it.live("buries a lost agent once, loses one whose announcements stopped, hands back a better pool once", () =>
    Effect.gen(function* () {
      const a = "10.0.0.1:7000"
      const b = "10.0.0.2:7000"
      const c = "10.0.0.3:7000"
      const test = yield* DiscoveredPoolTest.makeTest([node(a), node(b)])
      const world = pipelineOn(servingOn([a, b]), [a, b])
      const lines: Array<string> = []
      const ctx = {
        discovered: test.service,
        margin: 0.2,
        placement: { _tag: "Speed" },
        stages: undefined,
        log: (line: string) => lines.push(line),
        everyMillis: 10
      } as unknown as ReplanContext
      const memory = makeReplanMemory()
      const generation = { pipeline: world.pipeline, scope: yield* Scope.make() }
      const watch = yield* Effect.fork(betterPlan(ctx, memory, generation))
      // a's connection lost: buried once, however long it stays lost
      world.states.set(a, "lost")
      yield* Effect.sleep(100)
      assert.deepStrictEqual(yield* test.buried, [a])
      // b stops announcing and does not answer: lost now
      world.answers.delete(b)
      yield* test.set([node(a)])
      yield* Effect.sleep(100)
      assert.deepStrictEqual(world.lost, [b])
      // a node at its first announcement is not judged yet (a twin of its id may be starting beside it)
      yield* test.set([node(a, 8, 2), node(b, 8, 2), node(c, 8, 1, 0)])
      yield* Effect.sleep(100)
      assert.deepStrictEqual(lines, [])
      // a restarted (a newer run) and a new node c: three nodes, a third faster per token
      yield* test.set([node(a, 8, 2), node(b, 8, 2), node(c)])
      world.answers.add(b)
      const nodes = yield* watch.await.pipe(
        Effect.flatMap(Exit.match({ onSuccess: Effect.succeed, onFailure: Effect.die }))
      )
      assert.deepStrictEqual(
        nodes.map((n) => n.address),
        [a, b, c]
      )
      assert.strictEqual(lines.length, 1)
      assert.match(lines[0]!, /10\.0\.0\.3:7000 joined: re-planning: /)
    })
  )
})

describe("a node gone quiet", () => {
  // Announcements come every second and expire after 5 s: a node unheard for over 2.5 s is probed before they expire,
  // so a node killed leaves the pool in about 2.5 s plus the probe, not 5 s; one that still answers is kept.
  it.live("unheard for 3 s, not yet expired: lost when it does not answer its probe, kept when it does", () =>
    Effect.gen(function* () {
      const a = "10.0.0.1:7000"
      const b = "10.0.0.2:7000"
      const quiet = (address: string) => ({ ...node(address), heardAtMillis: Date.now() - 3000 })
      const test = yield* DiscoveredPoolTest.makeTest([quiet(a), quiet(b)])
      const world = pipelineOn(servingOn([a, b]), [a, b])
      world.answers.delete(b)
      const ctx = {
        discovered: test.service,
        margin: 0.2,
        placement: { _tag: "Speed" },
        stages: undefined,
        log: () => {},
        everyMillis: 10
      } as unknown as ReplanContext
      const generation = { pipeline: world.pipeline, scope: yield* Scope.make() }
      const watch = yield* Effect.fork(betterPlan(ctx, makeReplanMemory(), generation))
      yield* Effect.sleep(100)
      assert.deepStrictEqual(world.lost, [b])
      assert.strictEqual(world.states.get(a), "up")
      yield* Fiber.interrupt(watch)
    })
  )
})

describe("the live discovered pool", () => {
  it.live("says when a node joins and when it is buried; the buried run's announcements do not bring it back", () =>
    Effect.gen(function* () {
      const token = Redacted.make("a-cluster-token-9f3b27c1d4e5")
      const port = 21000 + ((process.pid + 9000) % 20000)
      const lines: Array<string> = []
      const context = yield* Layer.build(
        DiscoveredPoolLive.layer({
          token,
          port,
          interfaces: { only: ["lo"] },
          log: (line) => lines.push(line),
          watchMillis: 20
        })
      )
      const pool = Context.get(context, DiscoveredPool)
      const resources = () => ({ totalMemoryBytes: 8e9, freeMemoryBytes: 4e9, cores: 4, backend: "cpu" })
      yield* makeAnnouncer({
        token,
        nodeId: "node-a",
        address: "127.0.0.1:7001",
        resources,
        interfaces: { only: ["lo"] },
        port,
        intervalMillis: 50
      })
      const seen = (pattern: RegExp) =>
        Effect.gen(function* () {
          for (let i = 0; i < 100 && !lines.some((l) => pattern.test(l)); i++) yield* Effect.sleep(50)
          return lines.filter((l) => pattern.test(l)).length
        })
      assert.strictEqual(yield* seen(/node node-a at 127\.0\.0\.1:7001 joined the discovered pool/), 1)
      yield* pool.bury("127.0.0.1:7001")
      assert.strictEqual(yield* seen(/node node-a at 127\.0\.0\.1:7001 left the discovered pool/), 1)
      // it keeps announcing (the same run): still out
      yield* Effect.sleep(400)
      assert.deepStrictEqual((yield* pool.view).verified, [])
      assert.strictEqual(lines.length, 2, lines.join("\n"))
    }).pipe(Effect.scoped)
  )
})
