// The per-token timeline of one stream (`swactor run --timeline`): the pure aggregation of the stages' step reports
// (services/Timeline.ts), and a real orchestrator over two stage hosts where one stage is slowed: the time it adds
// shows in that stage's compute column, and nowhere else.
import { assert, describe, it } from "@effect/vitest"
import { Chunk, Effect, Layer, Stream } from "effect"
import type { StepTimeline } from "../../src/domain/controlRpc.js"
import { makeMemoryWorld } from "../../src/layers/agent/AgentLinksTest.js"
import * as StageExecutorTest from "../../src/layers/engine/StageExecutorTest.js"
import type { RunSummary, RunUpdate } from "../../src/services/Orchestrator.js"
import { StageExecutor } from "../../src/services/StageExecutor.js"
import { buildTimeline, renderTimeline, timelineComponents } from "../../src/services/Timeline.js"
import { memoryOrchestrator } from "../support/memoryWorld.js"
import { requireModel, storiesTestModel } from "../support/models.js"

/**
 * A step of a stage that takes `busy` ms from its frame's arrival at `arrivedAt`: 0.1 decode, 0.2 wake, 0.3 queue,
 * 0.4 copies, then compute, 0.5 encode and 0.6 send (2.1 ms besides compute); handed off at its end.
 */
const step = (k: number, arrivedAt: number, busy: number): StepTimeline => ({
  step: k,
  arrivedAt,
  decodeMillis: 0.1,
  wakeMillis: 0.2,
  queueMillis: 0.3,
  copyMillis: 0.4,
  computeMillis: busy - 2.1,
  encodeMillis: 0.5,
  sendMillis: 0.6,
  handOffAt: arrivedAt + busy,
  doneAt: arrivedAt + busy
})

/**
 * A steady two-stage ring with a token loop: stage 0 busy 3 ms, link 1 ms, stage 1 busy 5 ms, loop link 1 ms: a token
 * every 10 ms; stage 1's token reaches the orchestrator 2 ms after its hand-off.
 */
const ring = (steps: number, clocks: readonly [string, string] = ["host", "host"]) => {
  const s0: Array<StepTimeline> = []
  const s1: Array<StepTimeline> = []
  const arrived = new Map<number, number>()
  for (let k = 1; k <= steps; k++) {
    const t = 1000 + 10 * k
    s0.push(step(k, t, 3))
    s1.push(step(k, t + 4, 5))
    arrived.set(k, t + 9 + 2)
  }
  return {
    stages: [
      { stageIndex: 1, clock: clocks[1], steps: s1 },
      { stageIndex: 0, clock: clocks[0], steps: s0 }
    ],
    orchestrator: { clock: "host", tokenArrivedAt: arrived, injectedAt: new Map<number, number>() },
    tokenLoop: true
  }
}

const close = (actual: number, expected: number, what: string) => assert.approximately(actual, expected, 1e-9, what)

describe("the per-token timeline", () => {
  it("splits each stage's token into its parts and the links between, adding up to the token's wall time", () => {
    const t = buildTimeline(ring(20))!
    // step 1 has no step before it: 19 tokens timed
    assert.strictEqual(t.tokens, 19)
    close(t.wallMillis.mean, 10, "a token every 10 ms")
    assert.deepStrictEqual(
      t.stages.map((s) => s.stageIndex),
      [0, 1]
    )
    const [s0, s1] = t.stages
    close(s0!.components.compute.mean, 0.9, "stage 0 compute")
    close(s1!.components.compute.mean, 2.9, "stage 1 compute")
    close(s0!.components.framing.mean, 0.6, "decode + encode")
    close(s0!.components.waiting.mean, 7, "stage 0 idle while the rest of the ring works")
    close(s1!.components.waiting.mean, 5, "stage 1 idle")
    close(s0!.components.compute.share, 0.09, "share of the wall time")
    // every stage's parts add up to the token's wall time
    for (const s of t.stages) close(s.totalMillis.mean, 10, `stage ${s.stageIndex} total`)
    assert.deepStrictEqual(
      t.links.map((l) => [l.from, l.to, l.onPath, l.millis.mean]),
      [
        ["stage 0", "stage 1", true, 1],
        ["stage 1", "stage 0", true, 1],
        ["stage 1", "orchestrator", false, 2]
      ]
    )
    close(t.pathMillis!.mean, 10, "stages + links on the path")
    assert.strictEqual(t.note, undefined)
    const table = renderTimeline(t).join("\n")
    for (const c of timelineComponents) assert.include(table, c)
    assert.include(table, "link stage 1 → stage 0")
  })

  it("takes percentiles over the tokens: one slow step shows in p95, not in the median", () => {
    const input = ring(41)
    const s1 = input.stages[0]!.steps as Array<StepTimeline>
    // step 30 of stage 1 computes 20 ms longer: its hand-off and everything after it on the ring moves by 20 ms
    const slow = (e: StepTimeline): StepTimeline =>
      e.step < 30
        ? e
        : e.step === 30
          ? { ...e, computeMillis: e.computeMillis + 20, handOffAt: e.handOffAt + 20, doneAt: e.doneAt + 20 }
          : e
    input.stages[0] = { ...input.stages[0]!, steps: s1.map(slow) }
    const t = buildTimeline(input)!
    const compute = t.stages[1]!.components.compute
    close(compute.p50, 2.9, "median")
    assert.isAbove(compute.mean, 2.9)
    // 40 tokens: the 95th percentile is the 38th smallest, still a normal step; the slow one is the max
    close(compute.p95, 2.9, "p95 of 40 values with one outlier")
  })

  it("does not measure links whose ends are on different clocks, and says which", () => {
    const t = buildTimeline(ring(10, ["host", "other machine"]))!
    // only stage 0 shares the orchestrator's clock: no link touches it alone
    assert.deepStrictEqual(t.links, [])
    assert.strictEqual(t.pathMillis, undefined)
    assert.include(t.note!, "stage 0 → stage 1")
    assert.include(t.note!, "stage 1 → stage 0")
    // the stages' own parts still add up
    for (const s of t.stages) close(s.totalMillis.mean, 10, `stage ${s.stageIndex} total`)
  })

  it("without a token loop, the path goes through the orchestrator: its links and its turn", () => {
    const input = ring(10)
    const injected = new Map<number, number>()
    const arrived = new Map<number, number>()
    // stage 1 hands off at t + 9; the orchestrator has it at t + 9.5, sends the next at t + 9.75; stage 0 gets it at t + 10
    for (let k = 1; k <= 10; k++) {
      arrived.set(k, 1000 + 10 * k + 9.5)
      injected.set(k, 1000 + 10 * (k - 1) + 9.75)
    }
    const t = buildTimeline({
      ...input,
      orchestrator: { clock: "host", tokenArrivedAt: arrived, injectedAt: injected },
      tokenLoop: false
    })!
    assert.deepStrictEqual(
      t.links.map((l) => [l.from, l.to, l.millis.mean]),
      [
        ["stage 0", "stage 1", 1],
        ["stage 1", "orchestrator", 0.5],
        ["orchestrator", "stage 0", 0.25]
      ]
    )
    close(t.orchestratorMillis!.mean, 0.25, "the orchestrator's turn")
    close(t.pathMillis!.mean, 10, "the path through the orchestrator")
  })

  it("times nothing when no step has its predecessor on every stage", () => {
    assert.strictEqual(buildTimeline(ring(1)), undefined)
  })
})

const SLOW_MILLIS = 40

/** The test engine; the stage whose blocks start at `slowLayerStart` takes SLOW_MILLIS longer on every forward. */
const slowStageExecutor = (slowLayerStart: number) => {
  const base = StageExecutorTest.make(storiesTestModel)
  return Layer.succeed(StageExecutor, {
    load: base.load,
    session: base.session,
    forwardBatch: (items) =>
      items.some((item) => item.session.info.layerStart === slowLayerStart)
        ? Effect.delay(base.forwardBatch(items), SLOW_MILLIS)
        : base.forwardBatch(items)
  })
}

const summaryOf = (updates: ReadonlyArray<RunUpdate>): RunSummary => {
  const finished = updates.find((u) => u._tag === "Finished")
  assert.strictEqual(finished?._tag, "Finished")
  return (finished as Extract<RunUpdate, { _tag: "Finished" }>).summary
}

describe("the timeline of a run", () => {
  // Two stage hosts (in-memory links, the deterministic engine), stage 1 (blocks [3, 5)) slowed by 40 ms on every
  // forward: its compute column carries those 40 ms; its other parts and stage 0's compute stay small, and stage 0
  // waits for it.
  it.live(
    "a stage slowed by N ms shows N ms in its own compute column and nowhere else",
    () =>
      Effect.gen(function* () {
        const memory = yield* makeMemoryWorld(2).pipe(Effect.provide(slowStageExecutor(3)))
        const orchestrator = yield* memoryOrchestrator(memory)
        const updates = Chunk.toReadonlyArray(
          yield* Stream.runCollect(
            orchestrator.run({
              model: requireModel("stories260K.gguf"),
              prompt: "Once upon a time",
              stages: 2,
              maxTokens: 24,
              timeline: true
            })
          )
        )
        const t = summaryOf(updates).timeline
        assert.isDefined(t)
        assert.strictEqual(t!.tokens, 22)
        const [s0, s1] = t!.stages
        assert.deepStrictEqual([s0!.stageIndex, s1!.stageIndex], [0, 1])
        assert.isAtLeast(s1!.components.compute.p50, SLOW_MILLIS)
        assert.isBelow(s1!.components.compute.p50, SLOW_MILLIS + 15)
        assert.isBelow(s0!.components.compute.p50, 10)
        for (const c of ["wake", "framing", "queueing", "copies", "send"] as const) {
          assert.isBelow(s1!.components[c].p50, 10, `stage 1 ${c}`)
          assert.isBelow(s0!.components[c].p50, 10, `stage 0 ${c}`)
        }
        assert.isAtLeast(s0!.components.waiting.p50, SLOW_MILLIS, "stage 0 waits for the slow stage")
        assert.isBelow(s1!.components.waiting.p50, 10, "the slow stage hardly waits")
        // the in-memory links: both stages in this process, on one clock
        assert.deepStrictEqual(
          t!.links.map((l) => `${l.from} → ${l.to}`),
          ["stage 0 → stage 1", "stage 1 → stage 0", "stage 1 → orchestrator"]
        )
      }).pipe(Effect.scoped),
    60_000
  )
})
