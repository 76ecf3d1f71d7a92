// The library's two entries (issue 37, "a public API by namespace"): the main entry (src/index.ts, package "swactor")
// exports what a user runs and serves with by name and the contracts under it as namespaces, and no test double,
// harness or wire internal (Framing, ShmRing); those doubles and harnesses are in src/testing.ts ("swactor/testing").
import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import * as Swactor from "../../src/index.js"
import * as SwactorTesting from "../../src/testing.js"
import { DataPlane } from "../../src/services/AgentLinks.js"
import { OrchestratorHarness } from "../../src/services/OrchestratorHarness.js"
import { StageExecutor } from "../../src/services/StageExecutor.js"
import { Tokenizer } from "../../src/services/Tokenizer.js"
import * as StageExecutorTest from "../../src/layers/engine/StageExecutorTest.js"

const names = (entry: object) => new Set(Object.keys(entry))

describe("library entry (swactor)", () => {
  it("exports the user's API by name", () => {
    for (const f of [
      Swactor.generate,
      Swactor.run,
      Swactor.complete,
      Swactor.createClient,
      Swactor.layerLocal,
      Swactor.layerRemote,
      Swactor.serve,
      Swactor.completion,
      Swactor.readModelFacts,
      Swactor.spawnLocalAgents,
      Swactor.startNodeAgent,
      Swactor.generateToken
    ]) {
      assert.isFunction(f)
    }
    assert.strictEqual(Swactor.RunFaulted.name, "RunFaulted")
    assert.strictEqual(Swactor.ModelLoadError.name, "ModelLoadError")
    assert.strictEqual(Swactor.Server.key, "swactor/Server")
    assert.strictEqual(Swactor.Settings.key, "swactor/Settings")
    assert.strictEqual(
      Effect.runSync(
        Effect.map(Swactor.Settings, (s) => s.tls).pipe(Effect.provide(Swactor.Settings.layer({ tls: "off" })))
      ),
      "off"
    )
  })

  it("groups the contracts as namespaces: plan, planner, run FSM, GGUF, engine, transport, pools, HTTP", () => {
    assert.isFunction(Swactor.Plan.planRun)
    assert.isFunction(Swactor.Plan.deriveStageProvision)
    assert.isFunction(Swactor.Plan.alignUp)
    assert.isDefined(Swactor.Plan.RunId)
    assert.strictEqual(Swactor.Plan.MissingStage, Swactor.MissingStage)
    assert.isFunction(Swactor.RunFsm.transition)
    assert.isFunction(Swactor.RunFsm.RunActor.make)
    assert.isFunction(Swactor.RunFsm.RunEvents.PoolReady)
    assert.isFunction(Swactor.Gguf.readGgufFile)
    assert.isFunction(Swactor.Gguf.writeGgufFile)
    assert.strictEqual(Swactor.Gguf.ModelLoadError, Swactor.ModelLoadError)
    assert.strictEqual(Swactor.Engine.StageExecutor, StageExecutor)
    assert.isDefined(Swactor.Engine.StageExecutorLive.layer)
    assert.strictEqual(Swactor.Engine.Tokenizer, Tokenizer)
    assert.strictEqual(Swactor.Transport.DataPlane, DataPlane)
    assert.strictEqual(Swactor.Transport.DataPlane.key, "swactor/DataPlane")
    assert.isFunction(Swactor.Transport.EdgeTransport.listen)
    assert.isFunction(Swactor.Transport.EdgeTransport.connect)
    assert.isFunction(Swactor.AgentPools.layerLocal)
    assert.isFunction(Swactor.HttpServe.layer)
  })

  it("does not flatten the internals: no test double, harness, TestClock helper, Framing or ShmRing", () => {
    const main = names(Swactor)
    for (const internal of [
      "OrchestratorHarness",
      "StageExecutorTest",
      "TokenizerTest",
      "ModelCatalogTest",
      "AgentLinksTest",
      "Synthetic",
      "writeSyntheticModel",
      "layerTest",
      "byteTokenizer",
      "testLinearPlan",
      "Framing",
      "ShmRing",
      "makeStageHost",
      // formerly flattened module contents: now only inside their namespace
      "planRun",
      "RunActor",
      "readGgufFile",
      "StageExecutor",
      "DataPlane"
    ]) {
      assert.isFalse(main.has(internal), `the main entry exports ${internal}`)
    }
    const nested = [Swactor.Plan, Swactor.RunFsm, Swactor.Gguf, Swactor.Engine, Swactor.Transport]
    for (const ns of nested) {
      for (const internal of [
        "OrchestratorHarness",
        "StageExecutorTest",
        "layerTest",
        "testLinearPlan",
        "Framing",
        "ShmRing"
      ]) {
        assert.isFalse(names(ns).has(internal), `a namespace of the main entry exports ${internal}`)
      }
    }
    assert.isFalse(names(Swactor.Engine.StageExecutorLive).has("layerTest"))
  })
})

describe("testing entry (swactor/testing)", () => {
  it("exports the test doubles and harnesses", () => {
    assert.strictEqual(SwactorTesting.OrchestratorHarness, OrchestratorHarness)
    assert.strictEqual(SwactorTesting.StageExecutorTest.layer, StageExecutorTest.layer)
    assert.isFunction(SwactorTesting.StageExecutorTest.layerWith)
    assert.isDefined(SwactorTesting.TokenizerTest.layer)
    assert.strictEqual(SwactorTesting.TokenizerTest.byteTokenizer.tokenize("A")[1], 65 + 3)
    assert.isFunction(SwactorTesting.ModelCatalogTest.layer)
    assert.isFunction(SwactorTesting.AgentLinksTest.makeMemoryWorld)
    assert.isFunction(SwactorTesting.Synthetic.writeSyntheticModel)
    assert.isFunction(SwactorTesting.testLinearPlan)
  })

  it.scoped("its OrchestratorHarness drives the main entry's run FSM on the TestClock", () =>
    Effect.gen(function* () {
      const runId = Swactor.Plan.RunId.make(1)
      const plan = SwactorTesting.testLinearPlan(runId, [{ stageIndex: 0, nodeId: Swactor.Plan.NodeId.make(10) }])
      const harness = yield* SwactorTesting.OrchestratorHarness.make({ runId, maxTokens: 4, prompt: [101] })
      yield* harness.observe(Swactor.RunFsm.RunEvents.PoolReady({ nodes: Swactor.Plan.stageNodes(plan) }))
      yield* harness.observe(Swactor.RunFsm.RunEvents.PlanAvailable({ plan }))
      assert.isAbove((yield* harness.commands).length, 0)
      assert.isUndefined(yield* harness.outcome)
      // Nothing reports ready: the readiness deadline (120 s by default) ends the run.
      yield* harness.advanceTimeMs(121_000)
      assert.isDefined(yield* harness.outcome)
    })
  )
})
