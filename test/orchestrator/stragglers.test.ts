// Per-stage straggler detection: stages report their decode steps' times while the run goes on, and a step over
// 4× that stage's own recent median is pinned on that stage (summary, `StageStraggler` updates, serve's /metrics).
import { assert, describe, it } from "@effect/vitest"
import { Chunk, Context, Effect, Layer, Stream } from "effect"
import { renderSummary } from "../../src/cli/RunSummaryText.js"
import * as MembershipLive from "../../src/layers/agent/MembershipLive.js"
import { makeMemoryWorld } from "../../src/layers/agent/AgentLinksTest.js"
import * as StageExecutorTest from "../../src/layers/engine/StageExecutorTest.js"
import * as ModelCatalogLive from "../../src/layers/gguf/ModelCatalogLive.js"
import * as TokenizerLive from "../../src/layers/gguf/TokenizerLive.js"
import * as OrchestratorLive from "../../src/layers/orchestrator/OrchestratorLive.js"
import * as HttpServe from "../../src/layers/server/HttpServe.js"
import * as ServerLive from "../../src/layers/server/ServerLive.js"
import { Orchestrator, type RunSummary, type RunUpdate } from "../../src/services/Orchestrator.js"
import { Server } from "../../src/services/Server.js"
import { StageExecutor } from "../../src/services/StageExecutor.js"
import { makeStageStragglerDetector } from "../../src/services/StageStragglers.js"
import { requireModel, storiesTestModel as testModel } from "../support/models.js"

const SLOW_MILLIS = 400

/** The test engine; the stage whose blocks start at `slowLayerStart` takes SLOW_MILLIS longer at `slowPositions`. */
const slowStageExecutor = (slowLayerStart: number, slowPositions: ReadonlySet<number>) => {
  const base = StageExecutorTest.make(testModel)
  return Layer.succeed(StageExecutor, {
    load: base.load,
    session: base.session,
    // The agents' stage batcher runs every stage's work through forwardBatch.
    forwardBatch: (items) =>
      items.some((item) => item.session.info.layerStart === slowLayerStart && slowPositions.has(item.startPos))
        ? Effect.delay(base.forwardBatch(items), SLOW_MILLIS)
        : base.forwardBatch(items)
  })
}

// "Once upon a time" is 17 tokens with BOS: decode step k runs at position 16 + k.
const prompt = "Once upon a time"
const positionOf = (step: number) => 16 + step
const slowSteps = [14, 24, 34]
// Scheduling noise on a shared, loaded machine (a CI runner with other test files beside) is not what these tests are
// about: only steps 200 ms over the median count.
const rule = { minExcessMillis: 200 }

const orchestratorWorld = (slowLayerStart: number) =>
  Effect.gen(function* () {
    const memory = yield* makeMemoryWorld(3).pipe(
      Effect.provide(slowStageExecutor(slowLayerStart, new Set(slowSteps.map(positionOf))))
    )
    return yield* Effect.provide(
      Orchestrator,
      OrchestratorLive.layer.pipe(
        Layer.provide(
          Layer.mergeAll(memory.layer, TokenizerLive.layerTest, MembershipLive.layer, ModelCatalogLive.layer)
        )
      )
    )
  })

const summaryOf = (updates: ReadonlyArray<RunUpdate>): RunSummary => {
  const finished = updates.find((u) => u._tag === "Finished")
  assert.strictEqual(finished?._tag, "Finished")
  return (finished as Extract<RunUpdate, { _tag: "Finished" }>).summary
}

describe("per-stage stragglers", () => {
  // The detector judges each stage against its own history: a slow step of one stage names that stage only, not
  // before the stage has 8 steps, and a steady stage, however slow, is no straggler.
  it("the detector names the stage over 4× its own recent median, after its minimum sample count", () => {
    const detector = makeStageStragglerDetector()
    const steady = (from: number, n: number, millis: number) =>
      Array.from({ length: n }, (_, i) => ({ step: from + i, computeMillis: millis, sendMillis: 0.1 }))
    // Stage 0 is slow throughout (50 ms a step): no straggler. Stage 1 is fast, with one 30 ms step.
    assert.deepStrictEqual(detector.add(0, "a:1", steady(1, 20, 50)), [])
    assert.deepStrictEqual(detector.add(1, "b:1", steady(1, 12, 1)), [])
    const found = detector.add(1, "b:1", [{ step: 13, computeMillis: 30, sendMillis: 0 }, ...steady(14, 4, 1)])
    assert.deepStrictEqual(found, [{ stageIndex: 1, address: "b:1", step: 13, millis: 30, medianMillis: 1.1 }])
    assert.deepStrictEqual(detector.stragglers(), [
      { stageIndex: 1, address: "b:1", tokens: 1, medianMillis: 1.1, worstMillis: 30, worstStep: 13 }
    ])
    // The same slow step among a stage's first 8 is not judged (too few samples for a median).
    const early = makeStageStragglerDetector()
    assert.deepStrictEqual(early.add(2, "c:1", [...steady(1, 7, 1), { step: 8, computeMillis: 30, sendMillis: 0 }]), [])
    // Over 4× but by less than 5 ms: scheduling noise, not a straggler.
    assert.deepStrictEqual(early.add(2, "c:1", [{ step: 9, computeMillis: 5, sendMillis: 0 }]), [])
  })

  // A real orchestrator over three stage hosts (in-memory links, the deterministic engine): the middle stage is
  // slowed on three decode steps; the summary and the live updates name that stage, and only it, with the count,
  // its median and its worst step.
  it.live(
    "a stage slowed on some steps is the one named, in the summary and as it happens",
    () =>
      Effect.gen(function* () {
        const orchestrator = yield* orchestratorWorld(2)
        const updates = Chunk.toReadonlyArray(
          yield* Stream.runCollect(
            orchestrator.run({
              model: requireModel("stories260K.gguf"),
              prompt,
              stages: 3,
              // 39 decode steps: reports go out per 16 steps, so step 34's comes with the stage's last one, at its stop.
              maxTokens: 40,
              stragglers: rule
            })
          )
        )
        const summary = summaryOf(updates)
        assert.deepStrictEqual(
          summary.stages.map((s) => s.layers),
          [
            [0, 2],
            [2, 4],
            [4, 5]
          ]
        )
        const live = updates.flatMap((u) => (u._tag === "StageStraggler" ? [u.straggler] : []))
        assert.deepStrictEqual(
          live.map((s) => [s.stageIndex, s.step]),
          slowSteps.map((q) => [1, q])
        )
        assert.strictEqual(summary.stageStragglers.length, 1)
        const [stage] = summary.stageStragglers
        assert.strictEqual(stage!.stageIndex, 1)
        assert.strictEqual(stage!.address, summary.stages[1]!.address)
        assert.strictEqual(stage!.tokens, slowSteps.length)
        assert.isAtLeast(stage!.worstMillis, SLOW_MILLIS)
        assert.include(slowSteps, stage!.worstStep)
        assert.isBelow(stage!.medianMillis, 20)
        // `swactor run` prints it under the summary.
        assert.include(renderSummary(summary), `straggling stage 1 on ${stage!.address}: 3 slow tokens (median `)
        // Every stage reported its steps (median per stage in the summary).
        for (const s of summary.stages) assert.isAbove(s.medianTokenMillis, 0, `stage ${s.stageIndex}`)
      }).pipe(Effect.scoped),
    60_000
  )

  // serve counts each stage's straggling steps as they happen: /metrics has a counter per stage label, and only the
  // slowed stage's is above zero.
  it.live(
    "serve's /metrics counts straggling steps per stage",
    () =>
      Effect.gen(function* () {
        const memory = yield* makeMemoryWorld(2).pipe(
          // Two stages of 5 blocks: [0, 3) and [3, 5); the second is slowed.
          Effect.provide(slowStageExecutor(3, new Set(slowSteps.map(positionOf))))
        )
        const server = yield* Layer.build(
          ServerLive.layer({ model: requireModel("stories260K.gguf"), stages: 2, stragglers: rule }).pipe(
            Layer.provide(OrchestratorLive.layer),
            Layer.provide(
              Layer.mergeAll(memory.layer, TokenizerLive.layerTest, MembershipLive.layer, ModelCatalogLive.layer)
            )
          )
        ).pipe(Effect.map(Context.get(Server)))
        yield* server.ready
        yield* Stream.runDrain(server.generate({ prompt, maxTokens: 50 }))
        const metrics = yield* server.metrics
        assert.deepStrictEqual(
          metrics.stages.map((s) => [s.stageIndex, s.stragglerTokens]),
          [
            [0, 0],
            [1, slowSteps.length]
          ]
        )
        const text = HttpServe.renderMetrics(metrics, "ready")
        assert.include(text, `swactor_stage_straggler_tokens_total{stage="1"} ${slowSteps.length}`)
        assert.include(text, `swactor_stage_straggler_tokens_total{stage="0"} 0`)
      }).pipe(Effect.scoped),
    60_000
  )
})
