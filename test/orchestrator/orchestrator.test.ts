import { assert, describe, it } from "@effect/vitest"
import { Chunk, Effect, Fiber, Layer, Stream } from "effect"
import * as MembershipLive from "../../src/layers/agent/MembershipLive.js"
import * as OrchestratorLive from "../../src/layers/orchestrator/OrchestratorLive.js"
import * as StageExecutorTest from "../../src/layers/engine/StageExecutorTest.js"
import * as ModelCatalogLive from "../../src/layers/gguf/ModelCatalogLive.js"
import { ModelCatalog as ModelCatalogTag } from "../../src/services/ModelCatalog.js"
import type { ModelCatalog } from "../../src/services/ModelCatalog.js"
import * as TokenizerLive from "../../src/layers/gguf/TokenizerLive.js"
import { Orchestrator, type GenerateRequest, type RunUpdate } from "../../src/services/Orchestrator.js"
import { makeMemoryWorld } from "../../src/layers/agent/AgentLinksTest.js"
import type { StageReport } from "../../src/services/AgentLinks.js"
import { requireModel, storiesTestModel as testModel } from "../support/models.js"
import { tapReports } from "../support/memoryWorld.js"

/**
 * A catalog that claims twice the engine's context: the orchestrator's up-front check (prompt + max tokens within the
 * model's context, services/RequestChecks.ts) lets a 2,100-token prompt through, and the engine's session overflows.
 */
const claimsMoreContext = Layer.succeed(ModelCatalogTag, {
  ...ModelCatalogLive.make,
  facts: (path: string) => Effect.map(ModelCatalogLive.make.facts(path), (facts) => ({ ...facts, maxSeqLen: 4096 }))
})

/** In-memory agents and an orchestrator over them; `onReport` sees every stage report the orchestrator receives. */
const world = (
  agents: number,
  onReport?: (report: StageReport) => void,
  catalog: Layer.Layer<ModelCatalog> = ModelCatalogLive.layer
) =>
  Effect.gen(function* () {
    const memory = yield* makeMemoryWorld(agents).pipe(Effect.provide(StageExecutorTest.layerWith(testModel)))
    const links = onReport === undefined ? memory.layer : tapReports(memory, onReport)
    const orchestrator = yield* Effect.provide(
      Orchestrator,
      OrchestratorLive.layer.pipe(
        Layer.provide(Layer.mergeAll(links, TokenizerLive.layerTest, MembershipLive.layer, catalog))
      )
    )
    return { memory, orchestrator }
  })

const request = (patch: Partial<GenerateRequest> = {}): GenerateRequest => ({
  model: requireModel("stories260K.gguf"),
  prompt: "Once upon a time",
  maxTokens: 12,
  // The contract of one run: its first fault is the end.
  recovery: { maxAttempts: 0 },
  ...patch
})

const tokensOf = (updates: ReadonlyArray<RunUpdate>) =>
  updates.flatMap((u) => (u._tag === "Token" && u.token.tokenId >= 0 ? [u.token.tokenId] : []))

// The byte-level test tokenizer: BOS then byte + 3.
const promptTokens = (text: string) => [1, ...Array.from(new TextEncoder().encode(text), (b) => b + 3)]

describe("Orchestrator (in-memory agents, deterministic engine)", () => {
  // The orchestrator learns a model's facts and layout from the ModelCatalog service: with a catalog that knows a
  // path no file is at, the run plans and generates as for the real file; the live catalog refuses that path.
  it.live("model facts and layout come from the ModelCatalog service", () =>
    Effect.gen(function* () {
      const real = requireModel("stories260K.gguf")
      const elsewhere = "/models/only-in-the-catalog.gguf"
      const facts = yield* ModelCatalogLive.make.facts(real)
      const layout = yield* ModelCatalogLive.make.layout(real)
      const table = ModelCatalogLive.layerTest(
        new Map([[elsewhere, { ...facts, ggufSource: { _tag: "LocalPath" as const, path: elsewhere } }]]),
        new Map([[elsewhere, layout]])
      )
      const expected = tokensOf(
        Chunk.toReadonlyArray(yield* Stream.runCollect((yield* world(2)).orchestrator.run(request({ stages: 2 }))))
      )
      const viaTable = yield* Stream.runCollect(
        (yield* world(2, undefined, table)).orchestrator.run(request({ stages: 2, model: elsewhere }))
      )
      assert.deepStrictEqual(tokensOf(Chunk.toReadonlyArray(viaTable)), expected)
      assert.isAbove(expected.length, 0)
      const refused = yield* Effect.either(
        Stream.runCollect((yield* world(2)).orchestrator.run(request({ stages: 2, model: elsewhere })))
      )
      assert.isTrue(refused._tag === "Left" && refused.left._tag === "ModelLoadError")
    }).pipe(Effect.scoped)
  )

  // A split run produces exactly the tokens of the unsplit model, for every stage count.
  it.live("1..4 stages generate the test model's greedy tokens, then a summary", () =>
    Effect.gen(function* () {
      const expected = StageExecutorTest.testModelGreedy(testModel, promptTokens("Once upon a time"), 12).filter(
        (t) => t !== 2
      )
      for (const stages of [1, 2, 3, 4]) {
        const { orchestrator } = yield* world(stages)
        const updates = Chunk.toReadonlyArray(yield* Stream.runCollect(orchestrator.run(request({ stages }))))
        assert.deepStrictEqual(tokensOf(updates), expected, `stages=${stages}`)
        const finished = updates.at(-1)
        assert.strictEqual(finished?._tag, "Finished")
        if (finished?._tag === "Finished") {
          assert.strictEqual(finished.summary.stages.length, stages)
          assert.strictEqual(finished.summary.generatedTokens, expected.length)
        }
      }
    }).pipe(Effect.scoped)
  )

  // Planning rejections reach the caller as the planner's typed errors.
  it.live("more stages than the model has blocks is the planner's typed rejection", () =>
    Effect.gen(function* () {
      const { orchestrator } = yield* world(2)
      const error = yield* Effect.flip(Stream.runDrain(orchestrator.run(request({ stages: 9 }))))
      assert.strictEqual(error._tag, "ModelStageLayoutMismatch")
    }).pipe(Effect.scoped)
  )

  // A stage whose engine fails faults the run with that stage's reason, in words.
  it.live("an engine failure on a stage faults the run with the stage's reason", () =>
    Effect.gen(function* () {
      const { orchestrator } = yield* world(3, undefined, claimsMoreContext)
      const error = yield* Effect.flip(
        Stream.runCollect(orchestrator.run(request({ stages: 3, prompt: "x".repeat(2100), maxTokens: 1 })))
      )
      assert.strictEqual(error._tag, "RunFaulted")
      if (error._tag === "RunFaulted") {
        assert.strictEqual(error.reason._tag, "StageFault")
        assert.include(error.message, "stage 0")
        assert.include(error.message, "ContextOverflow")
      }
    }).pipe(Effect.scoped)
  )

  // One fault vocabulary: the reason a stage's agent reports is the run's fault reason, unchanged (no mapping
  // that drops or rewords it on the way).
  it.live("a stage's fault reason arrives unchanged as the run's fault", () =>
    Effect.gen(function* () {
      const faults: Array<Extract<StageReport, { _tag: "StageFault" }>> = []
      const { orchestrator } = yield* world(
        3,
        (report) => {
          if (report._tag === "StageFault") faults.push(report)
        },
        claimsMoreContext
      )
      const error = yield* Effect.flip(
        Stream.runCollect(orchestrator.run(request({ stages: 3, prompt: "x".repeat(2100), maxTokens: 1 })))
      )
      // The root cause first (stage 0's engine); the others' broken edges are its echoes.
      const reported = faults[0]!
      assert.strictEqual(reported.stageIndex, 0)
      assert.strictEqual(reported.reason._tag, "ExecutionFailed")
      assert.strictEqual(error._tag, "RunFaulted")
      if (error._tag === "RunFaulted") {
        assert.deepStrictEqual(error.reason, {
          _tag: "StageFault",
          stageIndex: reported.stageIndex,
          reason: reported.reason
        })
      }
    }).pipe(Effect.scoped)
  )

  // A dead agent (its links fail) faults the run; every stage still stops and the stream fails.
  it.live("killing an agent mid-generation faults the run and stops every stage", () =>
    Effect.gen(function* () {
      const { memory, orchestrator } = yield* world(3)
      const fiber = yield* orchestrator.run(request({ stages: 3, maxTokens: 2000, prompt: "a" })).pipe(
        Stream.filter((u) => u._tag === "Token"),
        Stream.take(3),
        Stream.runDrain,
        Effect.zipRight(memory.agents[1]!.kill),
        Effect.fork
      )
      yield* Fiber.join(fiber)
      const failing = yield* world(3)
      const run = failing.orchestrator.run(request({ stages: 3, maxTokens: 2000, prompt: "a" }))
      const error = yield* run.pipe(
        Stream.tap((u) => (u._tag === "Token" && u.token.step === 3 ? failing.memory.agents[1]!.kill : Effect.void)),
        Stream.runDrain,
        Effect.flip
      )
      assert.strictEqual(error._tag, "RunFaulted")
      if (error._tag === "RunFaulted") {
        assert.include(["StageFault", "MembershipLost"], error.reason._tag)
      }
      for (const agent of failing.memory.agents) assert.strictEqual((yield* agent.host.capacity).activeStages, 0)
    }).pipe(Effect.scoped)
  )

  // Interrupting the consumer is an operator stop with the full teardown: no stage stays hosted.
  it.live("stopping the stream early stops every stage", () =>
    Effect.gen(function* () {
      const { memory, orchestrator } = yield* world(2)
      const updates = yield* orchestrator.run(request({ stages: 2, maxTokens: 1000, prompt: "b" })).pipe(
        Stream.filter((u) => u._tag === "Token"),
        Stream.take(2),
        Stream.runCollect
      )
      assert.strictEqual(Chunk.size(updates), 2)
      for (const agent of memory.agents) assert.strictEqual((yield* agent.host.capacity).activeStages, 0)
    }).pipe(Effect.scoped)
  )

  // A second run on the same agents reuses the cached weights (no reload).
  it.live("a second run on the same agents reuses cached weights", () =>
    Effect.gen(function* () {
      const { orchestrator } = yield* world(2)
      yield* Stream.runDrain(orchestrator.run(request({ stages: 2, maxTokens: 2 })))
      const updates = Chunk.toReadonlyArray(
        yield* Stream.runCollect(orchestrator.run(request({ stages: 2, maxTokens: 2 })))
      )
      const ready = updates.filter((u) => u._tag === "StageReady")
      assert.strictEqual(ready.length, 2)
      assert.isTrue(ready.every((u) => u._tag === "StageReady" && u.cachedWeights))
    }).pipe(Effect.scoped)
  )
})
