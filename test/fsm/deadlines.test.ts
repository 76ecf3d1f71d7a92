// Deadlines of the run FSM (G19–G21 in specs/BEHAVIOR_GUARANTEES.md), on the real RunActor fiber and Effect's
// TestClock.
import { assert, describe, it } from "@effect/vitest"
import { Effect, Fiber, TestClock } from "effect"
import { type NodeId, RunId } from "../../src/domain/ids.js"
import type { RunPlan } from "../../src/domain/plan.js"
import { type RunConfig, RunEvents, RunFaultReasons, StageFaultReasons } from "../../src/domain/runEvents.js"
import { OrchestratorHarness } from "../../src/services/OrchestratorHarness.js"
import { stageNodes, testLinearPlan } from "../../src/services/Planner.js"
import { RunActor } from "../../src/services/RunFsm.js"

const runId = RunId.make(7)
const plan: RunPlan = testLinearPlan(
  runId,
  [0, 1, 2].map((stageIndex) => ({ stageIndex, nodeId: (10 + stageIndex) as NodeId }))
)
const config: RunConfig = { runId, maxTokens: 4, prompt: [101, 102, 103] }

const provisioned = (overrides: Partial<RunConfig> = {}) =>
  Effect.gen(function* () {
    const harness = yield* OrchestratorHarness.make({ ...config, ...overrides })
    yield* harness.observe(RunEvents.PoolReady({ nodes: stageNodes(plan) }))
    yield* harness.observe(RunEvents.PlanAvailable({ plan }))
    return harness
  })

const started = (overrides: Partial<RunConfig> = {}) =>
  Effect.gen(function* () {
    const harness = yield* provisioned(overrides)
    yield* harness.observe(RunEvents.TokenInEndpointReady())
    yield* harness.observe(RunEvents.TokenOutEndpointReady())
    for (const stage of plan.stages) {
      yield* harness.observe(RunEvents.StageReady({ runId, stageIndex: stage.stageIndex }))
    }
    return harness
  })

const faults = (harness: OrchestratorHarness) =>
  Effect.map(harness.events, (events) => events.flatMap((e) => (e._tag === "RunFaulted" ? [e.reason] : [])))

describe("run FSM deadlines", () => {
  // G19: stages and endpoints not ready within the readiness deadline (default 120 s) fault the run, naming what is
  // missing.
  it.scoped("readiness deadline faults the run naming the missing stages and endpoints", () =>
    Effect.gen(function* () {
      const harness = yield* provisioned()
      yield* harness.observe(RunEvents.StageReady({ runId, stageIndex: 0 }))
      yield* harness.observe(RunEvents.TokenInEndpointReady())

      yield* harness.advanceTimeMs(119_999)
      assert.deepStrictEqual(yield* faults(harness), [])

      yield* harness.advanceTimeMs(1)
      assert.deepStrictEqual(yield* faults(harness), [
        RunFaultReasons.ReadinessTimeout({ missingStages: [1, 2], missingEndpoints: ["TokenOut"] })
      ])
      assert.deepStrictEqual(yield* harness.injectedSteps, [])
      // The fault leads into teardown like any other terminal outcome.
      const stops = (yield* harness.commands).flatMap((c) => (c._tag === "StopRun" ? [c.stageIndex] : []))
      assert.deepStrictEqual(stops, [0, 1, 2])
    })
  )

  it.scoped("the readiness deadline is configurable and stops counting once the run starts", () =>
    Effect.gen(function* () {
      const harness = yield* provisioned({ readinessTimeout: "5 seconds" })
      yield* harness.advanceTimeMs(4_000)
      yield* harness.observe(RunEvents.TokenInEndpointReady())
      yield* harness.observe(RunEvents.TokenOutEndpointReady())
      for (const stage of plan.stages) {
        yield* harness.observe(RunEvents.StageReady({ runId, stageIndex: stage.stageIndex }))
      }
      yield* harness.advanceTimeMs(2_000)
      assert.deepStrictEqual(yield* faults(harness), [])
      assert.deepStrictEqual(yield* harness.injectedSteps, [0])

      const late = yield* provisioned({ readinessTimeout: "5 seconds" })
      yield* late.advanceTimeMs(5_000)
      assert.deepStrictEqual(yield* faults(late), [
        RunFaultReasons.ReadinessTimeout({ missingStages: [0, 1, 2], missingEndpoints: ["TokenIn", "TokenOut"] })
      ])
    })
  )

  // G20: no token for the injected step within the token deadline (default 60 s) faults the run; each injection
  // restarts the deadline.
  it.scoped("token deadline faults the run naming the step in flight", () =>
    Effect.gen(function* () {
      const harness = yield* started()
      yield* harness.advanceTimeMs(59_999)
      yield* harness.observe(RunEvents.TokenReceived({ step: 0, tokenId: 201, eos: false }))
      yield* harness.advanceTimeMs(59_999)
      assert.deepStrictEqual(yield* faults(harness), [])
      assert.deepStrictEqual(yield* harness.injectedSteps, [0, 1])

      yield* harness.advanceTimeMs(1)
      assert.deepStrictEqual(yield* faults(harness), [RunFaultReasons.TokenTimeout({ step: 1 })])

      // The late token is new work after the terminal outcome: rejected, nothing injected.
      yield* harness.observe(RunEvents.TokenReceived({ step: 1, tokenId: 202, eos: false }))
      assert.deepStrictEqual(yield* harness.injectedSteps, [0, 1])
      const rejected = (yield* harness.events).filter((e) => e._tag === "EventRejected")
      assert.strictEqual(rejected.at(-1)?._tag === "EventRejected" && rejected.at(-1)?.reason, "AlreadyTerminal")
    })
  )

  // A resumed generation's prompt replays its produced tokens one decode step each: its own deadline (promptTimeout),
  // while every later step keeps the token deadline.
  it.scoped("the prompt's deadline (promptTimeout) is its own; later steps keep the token deadline", () =>
    Effect.gen(function* () {
      const harness = yield* started({ tokenTimeout: "1 second", promptTimeout: "5 seconds" })
      yield* harness.advanceTimeMs(4_999)
      yield* harness.observe(RunEvents.TokenReceived({ step: 0, tokenId: 201, eos: false }))
      assert.deepStrictEqual(yield* faults(harness), [])
      yield* harness.advanceTimeMs(1_000)
      assert.deepStrictEqual(yield* faults(harness), [RunFaultReasons.TokenTimeout({ step: 1 })])

      const late = yield* started({ tokenTimeout: "1 second", promptTimeout: "5 seconds" })
      yield* late.advanceTimeMs(5_000)
      assert.deepStrictEqual(yield* faults(late), [RunFaultReasons.TokenTimeout({ step: 0 })])
    })
  )

  it.scoped("a token that arrives at its deadline loses to the deadline", () =>
    Effect.gen(function* () {
      const harness = yield* started({ tokenTimeout: "1 second" })
      yield* TestClock.adjust("1 second")
      yield* harness.observe(RunEvents.TokenReceived({ step: 0, tokenId: 201, eos: false }))
      assert.deepStrictEqual(yield* faults(harness), [RunFaultReasons.TokenTimeout({ step: 0 })])
      assert.deepStrictEqual(yield* harness.injectedSteps, [0])
    })
  )

  // G21: stops not confirmed within the teardown deadline (default 10 s) end teardown anyway: RunTornDown lists the
  // unconfirmed stages, so a dead node cannot hang teardown forever.
  it.scoped("teardown deadline emits RunTornDown listing the unconfirmed stages", () =>
    Effect.gen(function* () {
      const harness = yield* started()
      yield* harness.observe(RunEvents.StageFault({ runId, stageIndex: 1, reason: StageFaultReasons.WorkerCrashed() }))
      yield* harness.observe(RunEvents.StageStopped({ runId, stageIndex: 0 }))
      yield* harness.advanceTimeMs(9_999)
      assert.isFalse((yield* harness.events).some((e) => e._tag === "RunTornDown"))

      yield* harness.advanceTimeMs(1)
      const tornDown = (yield* harness.events).filter((e) => e._tag === "RunTornDown")
      assert.deepStrictEqual(tornDown, [
        {
          _tag: "RunTornDown",
          runId,
          unconfirmedStages: [1, 2],
          endpointsConfirmed: false
        }
      ])

      // A stop confirmed after teardown ended changes nothing: still one RunTornDown.
      yield* harness.observe(RunEvents.StageStopped({ runId, stageIndex: 1 }))
      yield* harness.advanceTimeMs(60_000)
      assert.strictEqual((yield* harness.events).filter((e) => e._tag === "RunTornDown").length, 1)
    })
  )

  it.scoped("the actor's outcome and tornDown resolve through the Clock", () =>
    Effect.gen(function* () {
      const actor = yield* RunActor.make({ ...config, readinessTimeout: "30 seconds", teardownTimeout: "2 seconds" })
      const outcome = yield* Effect.fork(actor.outcome)
      const tornDown = yield* Effect.fork(actor.tornDown)
      yield* actor.send(RunEvents.PoolReady({ nodes: stageNodes(plan) }))
      yield* actor.send(RunEvents.PlanAvailable({ plan }))
      yield* TestClock.adjust("31 seconds")
      assert.deepStrictEqual(yield* Fiber.join(outcome), {
        _tag: "Faulted",
        reason: RunFaultReasons.ReadinessTimeout({
          missingStages: [0, 1, 2],
          missingEndpoints: ["TokenIn", "TokenOut"]
        })
      })
      yield* TestClock.adjust("2 seconds")
      const done = yield* Fiber.join(tornDown)
      assert.deepStrictEqual(done.unconfirmedStages, [0, 1, 2])
      assert.strictEqual((yield* actor.state).phase, "TornDown")
    })
  )
})
