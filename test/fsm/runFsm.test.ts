// Port of `mod run_fsm` in spec/orchestration_guarantees.rs: black-box contract tests for the orchestrator's run FSM.
// They know only the public surface (events in; commands, lifecycle events and outcome out) through the
// OrchestratorHarness, which drives the real RunActor fiber. They assert the guarantees in
// specs/BEHAVIOR_GUARANTEES.md (G11–G18).
import { assert, describe, it } from "@effect/vitest"
import { Effect, Schema } from "effect"
import { isDeepStrictEqual } from "node:util"
import { type NodeId, RunId } from "../../src/domain/ids.js"
import { RunPlan } from "../../src/domain/plan.js"
import {
  LifecycleEvent,
  LifecycleEvents,
  RunCommand,
  type RunEvent,
  RunEvents,
  RunFaultReasons,
  StageFaultReasons
} from "../../src/domain/runEvents.js"
import { OrchestratorHarness } from "../../src/services/OrchestratorHarness.js"
import { stageNodes, testLinearPlan } from "../../src/services/Planner.js"
import { RunActor } from "../../src/services/RunFsm.js"

const runId = RunId.make(7)
const nodeId = (n: number) => n as NodeId

// A three-stage plan proves multi-stage provisioning and readiness without depending on a placement heuristic.
const committedPlan = (): RunPlan =>
  testLinearPlan(runId, [
    { stageIndex: 0, nodeId: nodeId(10) },
    { stageIndex: 1, nodeId: nodeId(11) },
    { stageIndex: 2, nodeId: nodeId(12) }
  ])

// The harness is the black-box boundary: it accepts events and records emitted commands and events.
const newRun = () => OrchestratorHarness.make({ runId, maxTokens: 4, prompt: [101, 102, 103] })

// Readiness events generated from the plan, so readiness is proven by stage identity, not command order.
const stageReadyEvents = (plan: RunPlan): Array<RunEvent> =>
  plan.stages.map((stage) => RunEvents.StageReady({ runId: plan.runId, stageIndex: stage.stageIndex }))

// Transcript positions turn ordering claims into proofs over observable output.
const positionOf = (events: ReadonlyArray<LifecycleEvent>, needle: LifecycleEvent): number => {
  const index = events.findIndex((event) => isDeepStrictEqual(event, needle))
  assert.isAtLeast(index, 0, "expected lifecycle event missing")
  return index
}

const injectedObjects = (commands: ReadonlyArray<RunCommand>) =>
  commands.flatMap((command) => (command._tag === "InjectTokenObject" ? [command.object] : []))

// Drives a run through PoolReady, the plan, both endpoints and every stage's readiness.
const startedRun = (plan: RunPlan) =>
  Effect.gen(function* () {
    const harness = yield* newRun()
    yield* harness.observe(RunEvents.PoolReady({ nodes: stageNodes(plan) }))
    yield* harness.observe(RunEvents.PlanAvailable({ plan }))
    yield* harness.observe(RunEvents.TokenInEndpointReady())
    yield* harness.observe(RunEvents.TokenOutEndpointReady())
    for (const event of stageReadyEvents(plan)) yield* harness.observe(event)
    return harness
  })

describe("run_fsm", () => {
  // This proves planning and provisioning are gated by PoolReady, and that the orchestrator provisions exactly the
  // committed stages and local token endpoints from a valid RunPlan.
  it.scoped("planning_and_provisioning_start_only_after_pool_ready", () =>
    Effect.gen(function* () {
      const plan = committedPlan()
      const harness = yield* newRun()
      yield* harness.observe(RunEvents.PlanAvailable({ plan }))

      // Without PoolReady, provisioning must not begin.
      assert.isFalse((yield* harness.commands).some((command) => command._tag === "ProvisionStage"))

      yield* harness.observe(RunEvents.PoolReady({ nodes: stageNodes(plan) }))

      // Every planned stage gets exactly one provision command.
      const provisioned = (yield* harness.commands).flatMap((command) =>
        command._tag === "ProvisionStage" ? [command.provision.stageIndex] : []
      )
      assert.deepStrictEqual(provisioned.sort(), plan.stages.map((stage) => stage.stageIndex).sort())
      assert.strictEqual(new Set(provisioned).size, provisioned.length)

      // Provisioning must not mention nodes outside the committed plan.
      const planNodes = new Set(stageNodes(plan))
      for (const command of yield* harness.commands) {
        if (command._tag === "ProvisionStage") assert.isTrue(planNodes.has(command.provision.nodeId))
      }

      // Token endpoints are created locally from the same committed plan.
      const commands = yield* harness.commands
      assert.isTrue(commands.some((command) => command._tag === "CreateTokenInEndpoint" && command.runId === runId))
      assert.isTrue(commands.some((command) => command._tag === "CreateTokenOutEndpoint" && command.runId === runId))
    })
  )

  // This proves prompt injection is blocked until every planned stage and both local token endpoints are ready.
  // Duplicate readiness must not count as a missing stage, and foreign readiness must fault or reject.
  it.scoped("readiness_barrier_controls_prompt_injection", () =>
    Effect.gen(function* () {
      const plan = committedPlan()
      const harness = yield* newRun()
      yield* harness.observe(RunEvents.PoolReady({ nodes: stageNodes(plan) }))
      yield* harness.observe(RunEvents.PlanAvailable({ plan }))

      // A duplicate StageReady for stage 0 cannot satisfy stage 1 or 2.
      yield* harness.observe(RunEvents.StageReady({ runId, stageIndex: 0 }))
      yield* harness.observe(RunEvents.StageReady({ runId, stageIndex: 0 }))
      yield* harness.observe(RunEvents.TokenInEndpointReady())
      yield* harness.observe(RunEvents.TokenOutEndpointReady())
      assert.isFalse((yield* harness.commands).some((command) => command._tag === "InjectTokenObject"))

      // Complete the remaining stage readiness facts.
      for (const event of stageReadyEvents(plan).slice(1)) yield* harness.observe(event)

      // Prompt injection is the public start signal after the full barrier.
      assert.isTrue(
        (yield* harness.commands).some(
          (command) =>
            command._tag === "InjectTokenObject" &&
            command.runId === runId &&
            command.object.step === 0 &&
            command.object.payload._tag === "Prompt" &&
            JSON.stringify(command.object.payload.tokens) === JSON.stringify([101, 102, 103])
        )
      )

      // Unknown stage readiness must not silently advance another run.
      const invalid = yield* newRun()
      yield* invalid.observe(RunEvents.PoolReady({ nodes: stageNodes(plan) }))
      yield* invalid.observe(RunEvents.PlanAvailable({ plan }))
      yield* invalid.observe(RunEvents.StageReady({ runId, stageIndex: 99 }))
      assert.isTrue(
        (yield* invalid.events).some((event) => event._tag === "RunFaulted" || event._tag === "EventRejected")
      )
    })
  )

  // This proves execution has one start signal and advances by the token feedback rule: inject step 0 first, then
  // inject k + 1 only after consuming k.
  it.scoped("execution_injects_next_step_only_after_consuming_previous_token", () =>
    Effect.gen(function* () {
      const plan = committedPlan()
      const harness = yield* startedRun(plan)

      // Step 0 must be injected first as a prompt token object.
      const initialObjects = injectedObjects(yield* harness.commands)
      assert.strictEqual(initialObjects.length, 1)
      assert.deepStrictEqual(initialObjects[0], { step: 0, payload: { _tag: "Prompt", tokens: [101, 102, 103] } })
      assert.deepStrictEqual(yield* harness.injectedSteps, [0])

      // Consuming token 0 permits injecting step 1.
      yield* harness.observe(RunEvents.TokenReceived({ step: 0, tokenId: 201, eos: false }))
      assert.deepStrictEqual(yield* harness.injectedSteps, [0, 1])
      const decodeObject = injectedObjects(yield* harness.commands).at(-1)
      assert.isDefined(decodeObject, "decode injection must be recorded")
      assert.deepStrictEqual(decodeObject, {
        step: 1,
        payload: { _tag: "Decode", tokenId: 201, sampling: { sourceStep: 0 } }
      })

      // No additional injection may happen without consuming step 1.
      yield* harness.advanceTimeMs(10)
      assert.deepStrictEqual(yield* harness.injectedSteps, [0, 1])

      // EOS stops further injection after the consumed step.
      yield* harness.observe(RunEvents.TokenReceived({ step: 1, tokenId: 2, eos: true }))
      assert.deepStrictEqual(yield* harness.injectedSteps, [0, 1])
    })
  )

  // This proves every run-level fault source records one terminal fault, and the first failure reason is retained if
  // later failures arrive.
  it.scoped("first_run_fault_reason_is_terminal_and_sticky", () =>
    Effect.gen(function* () {
      const plan = committedPlan()
      const harness = yield* startedRun(plan)

      // Inject the first failure source.
      yield* harness.observe(RunEvents.StageFault({ runId, stageIndex: 1, reason: StageFaultReasons.WorkerCrashed() }))

      // Later failures must not replace the terminal reason.
      yield* harness.observe(RunEvents.EndpointFault({ runId, endpoint: "TokenOut" }))
      yield* harness.observe(RunEvents.MembershipLost({ runId, nodeId: nodeId(11) }))

      // Exactly one terminal fault is recorded.
      const faults = (yield* harness.events).flatMap((event) => (event._tag === "RunFaulted" ? [event.reason] : []))
      assert.strictEqual(faults.length, 1)
      assert.deepStrictEqual(
        faults[0],
        RunFaultReasons.StageFault({ stageIndex: 1, reason: StageFaultReasons.WorkerCrashed() })
      )
    })
  )

  // This proves losing a planned node's membership faults the run with that node named.
  it.scoped("membership_loss_faults_run", () =>
    Effect.gen(function* () {
      const plan = committedPlan()
      const membershipLost = yield* newRun()
      yield* membershipLost.observe(RunEvents.PoolReady({ nodes: stageNodes(plan) }))
      yield* membershipLost.observe(RunEvents.PlanAvailable({ plan }))
      yield* membershipLost.observe(RunEvents.MembershipLost({ runId, nodeId: nodeId(12) }))
      assert.isTrue(
        (yield* membershipLost.events).some(
          (event) => event._tag === "RunFaulted" && event.reason._tag === "MembershipLost" && event.reason.nodeId === 12
        )
      )
    })
  )

  // This proves terminal outcomes are mutually exclusive, reject new work, and always lead into teardown for success,
  // fault, and operator stop.
  it.scoped("terminal_outcome_is_single_and_requires_teardown", () =>
    Effect.gen(function* () {
      // Complete a run by reaching EOS.
      const plan = committedPlan()
      const harness = yield* startedRun(plan)
      yield* harness.observe(RunEvents.TokenReceived({ step: 0, tokenId: 2, eos: true }))

      // Completed and Faulted are mutually exclusive public outcomes.
      const events = yield* harness.events
      assert.strictEqual(events.filter((event) => event._tag === "RunCompleted").length, 1)
      assert.strictEqual(events.filter((event) => event._tag === "RunFaulted").length, 0)

      // New token work after the terminal outcome must be rejected.
      const before = yield* harness.injectedSteps
      yield* harness.observe(RunEvents.TokenReceived({ step: 99, tokenId: 333, eos: false }))
      assert.deepStrictEqual(yield* harness.injectedSteps, before)

      // Teardown commands are emitted for every provisioned stage and the local endpoints.
      const commands = yield* harness.commands
      const stoppedStages = new Set(
        commands.flatMap((command) => (command._tag === "StopRun" ? [command.stageIndex] : []))
      )
      assert.deepStrictEqual(stoppedStages, new Set(plan.stages.map((stage) => stage.stageIndex)))
      assert.isTrue(commands.some((command) => command._tag === "TearDownTokenEndpoints"))

      const stopped = yield* newRun()
      yield* stopped.observe(RunEvents.PoolReady({ nodes: stageNodes(plan) }))
      yield* stopped.observe(RunEvents.PlanAvailable({ plan }))
      yield* stopped.observe(RunEvents.OperatorStop({ runId }))
      const stoppedEvents = yield* stopped.events
      assert.strictEqual(stoppedEvents.filter((event) => event._tag === "RunOperatorStopped").length, 1)
      assert.strictEqual(stoppedEvents.filter((event) => event._tag === "RunFaulted").length, 0)
      assert.isTrue((yield* stopped.commands).some((command) => command._tag === "TearDownTokenEndpoints"))
    })
  )

  // This proves run_torn_down is emitted exactly once and only after teardown observes every planned stage stop and
  // local endpoint stop.
  it.scoped("run_torn_down_is_emitted_once_after_teardown_terminal_state", () =>
    Effect.gen(function* () {
      // Fault a provisioned run so teardown is required.
      const plan = committedPlan()
      const harness = yield* newRun()
      yield* harness.observe(RunEvents.PoolReady({ nodes: stageNodes(plan) }))
      yield* harness.observe(RunEvents.PlanAvailable({ plan }))
      yield* harness.observe(RunEvents.StageFault({ runId, stageIndex: 0, reason: StageFaultReasons.WorkerCrashed() }))

      // StageStopped from only a prefix of stages is not enough to finish teardown.
      yield* harness.observe(RunEvents.StageStopped({ runId, stageIndex: 0 }))
      assert.isFalse((yield* harness.events).some((event) => event._tag === "RunTornDown"))

      // StageStopped for every stage still is not enough until the local endpoints stop.
      yield* harness.observe(RunEvents.StageStopped({ runId, stageIndex: 1 }))
      yield* harness.observe(RunEvents.StageStopped({ runId, stageIndex: 2 }))
      assert.isFalse((yield* harness.events).some((event) => event._tag === "RunTornDown"))
      yield* harness.observe(RunEvents.TokenEndpointsStopped())

      // The final event may now appear, exactly once.
      const events = yield* harness.events
      assert.strictEqual(events.filter((event) => event._tag === "RunTornDown").length, 1)

      // Ordering is proven over the lifecycle transcript.
      const faultPos = positionOf(
        events,
        LifecycleEvents.RunFaulted({
          runId,
          reason: RunFaultReasons.StageFault({ stageIndex: 0, reason: StageFaultReasons.WorkerCrashed() })
        })
      )
      const tornDownPos = positionOf(
        events,
        LifecycleEvents.RunTornDown({ runId, unconfirmedStages: [], endpointsConfirmed: true })
      )
      assert.isBelow(faultPos, tornDownPos)
    })
  )
})

// Behaviour beyond the seed's tests (G14, G16, G22, G23 in specs/BEHAVIOR_GUARANTEES.md).
describe("run FSM beyond the seed", () => {
  const rejections = (events: ReadonlyArray<LifecycleEvent>) =>
    events.flatMap((event) => (event._tag === "EventRejected" ? [event.reason] : []))

  it.scoped("events for another run are rejected without changing state, and recorded", () =>
    Effect.gen(function* () {
      const plan = committedPlan()
      const harness = yield* startedRun(plan)
      const before = yield* harness.state
      const other = RunId.make(8)
      const crashed = StageFaultReasons.WorkerCrashed()
      yield* harness.observe(RunEvents.StageFault({ runId: other, stageIndex: 0, reason: crashed }))
      yield* harness.observe(RunEvents.OperatorStop({ runId: other }))
      const otherPlan = testLinearPlan(other, [{ stageIndex: 0, nodeId: nodeId(10) }])
      yield* harness.observe(RunEvents.PlanAvailable({ plan: otherPlan }))
      assert.deepStrictEqual(yield* harness.state, { ...before, rejected: before.rejected + 3 })
      assert.deepStrictEqual(rejections(yield* harness.events), ["ForeignRun", "ForeignRun", "ForeignRun"])
      assert.isUndefined(yield* harness.outcome)
    })
  )

  it.scoped("a token for a step not in flight is rejected without changing state", () =>
    Effect.gen(function* () {
      const harness = yield* startedRun(committedPlan())
      const before = yield* harness.state
      yield* harness.observe(RunEvents.TokenReceived({ step: 1, tokenId: 5, eos: false }))
      assert.deepStrictEqual(yield* harness.state, { ...before, rejected: before.rejected + 1 })
      assert.deepStrictEqual(rejections(yield* harness.events), ["StepNotInFlight"])
      assert.deepStrictEqual(yield* harness.injectedSteps, [0])
    })
  )

  it.scoped("the run completes at maxTokens with every generated token, streamed as TokenAccepted", () =>
    Effect.gen(function* () {
      const harness = yield* startedRun(committedPlan())
      for (const [step, tokenId] of [
        [0, 201],
        [1, 202],
        [2, 203],
        [3, 204]
      ] as const) {
        yield* harness.observe(RunEvents.TokenReceived({ step, tokenId, eos: false }))
      }
      assert.deepStrictEqual(yield* harness.injectedSteps, [0, 1, 2, 3])
      const events = yield* harness.events
      assert.deepStrictEqual(
        events.flatMap((e) => (e._tag === "TokenAccepted" ? [[e.step, e.tokenId]] : [])),
        [
          [0, 201],
          [1, 202],
          [2, 203],
          [3, 204]
        ]
      )
      assert.deepStrictEqual(
        events.find((e) => e._tag === "RunCompleted"),
        LifecycleEvents.RunCompleted({ runId, reason: "MaxTokens", tokens: [201, 202, 203, 204] })
      )
    })
  )

  it.scoped("a token equal to the configured EOS id ends the run like eos: true, and is not a generated token", () =>
    Effect.gen(function* () {
      const plan = committedPlan()
      const harness = yield* OrchestratorHarness.make({ runId, maxTokens: 4, prompt: [101], eosTokenId: 2 })
      yield* harness.observe(RunEvents.PoolReady({ nodes: stageNodes(plan) }))
      yield* harness.observe(RunEvents.PlanAvailable({ plan }))
      yield* harness.observe(RunEvents.TokenInEndpointReady())
      yield* harness.observe(RunEvents.TokenOutEndpointReady())
      for (const event of stageReadyEvents(plan)) yield* harness.observe(event)
      yield* harness.observe(RunEvents.TokenReceived({ step: 0, tokenId: 300, eos: false }))
      yield* harness.observe(RunEvents.TokenReceived({ step: 1, tokenId: 2, eos: false }))
      assert.deepStrictEqual(yield* harness.outcome, { _tag: "Completed", reason: "Eos", tokens: [300] })
      assert.deepStrictEqual(yield* harness.injectedSteps, [0, 1])
    })
  )

  it.scoped("a pool that does not cover the plan's nodes does not provision", () =>
    Effect.gen(function* () {
      const plan = committedPlan()
      const harness = yield* newRun()
      yield* harness.observe(RunEvents.PlanAvailable({ plan }))
      yield* harness.observe(RunEvents.PoolReady({ nodes: [nodeId(10), nodeId(11)] }))
      assert.deepStrictEqual(yield* harness.commands, [])
      // PoolReady accumulates: the missing node arriving later completes the pool.
      yield* harness.observe(RunEvents.PoolReady({ nodes: [nodeId(12)] }))
      assert.strictEqual((yield* harness.commands).filter((c) => c._tag === "ProvisionStage").length, 3)
    })
  )

  it.scoped("a run stopped before provisioning is torn down at once, with nothing to stop", () =>
    Effect.gen(function* () {
      const harness = yield* newRun()
      yield* harness.observe(RunEvents.OperatorStop({ runId }))
      assert.deepStrictEqual(yield* harness.events, [
        LifecycleEvents.RunOperatorStopped({ runId }),
        LifecycleEvents.RunTornDown({ runId, unconfirmedStages: [], endpointsConfirmed: true })
      ])
      assert.deepStrictEqual(yield* harness.commands, [])
      yield* harness.observe(RunEvents.PoolReady({ nodes: [nodeId(10)] }))
      assert.deepStrictEqual(rejections(yield* harness.events), ["TornDown"])
    })
  )

  it.scoped("a stage that stops on its own while the run executes faults the run", () =>
    Effect.gen(function* () {
      const harness = yield* startedRun(committedPlan())
      yield* harness.observe(RunEvents.StageStopped({ runId, stageIndex: 2 }))
      assert.deepStrictEqual(yield* harness.outcome, {
        _tag: "Faulted",
        reason: RunFaultReasons.StageFault({ stageIndex: 2, reason: StageFaultReasons.StoppedUnexpectedly() })
      })
      // Its stop already counts for teardown.
      yield* harness.observe(RunEvents.StageStopped({ runId, stageIndex: 0 }))
      yield* harness.observe(RunEvents.StageStopped({ runId, stageIndex: 1 }))
      yield* harness.observe(RunEvents.TokenEndpointsStopped())
      assert.strictEqual((yield* harness.state).phase, "TornDown")
    })
  )

  it.scoped("a plan that is not a coherent pipeline is rejected and never provisioned", () =>
    Effect.gen(function* () {
      const plan = committedPlan()
      const truncated = new RunPlan({ ...plan, stages: plan.stages.slice(0, 2) })
      const edgeless = new RunPlan({ ...plan, edges: plan.edges.filter((edge) => edge.kind !== "TokenOut") })
      for (const bad of [truncated, edgeless]) {
        const harness = yield* newRun()
        yield* harness.observe(RunEvents.PoolReady({ nodes: stageNodes(plan) }))
        yield* harness.observe(RunEvents.PlanAvailable({ plan: bad }))
        assert.deepStrictEqual(rejections(yield* harness.events), ["InvalidPlan"])
        assert.deepStrictEqual(yield* harness.commands, [])
        // The committed plan is still accepted afterwards.
        yield* harness.observe(RunEvents.PlanAvailable({ plan }))
        assert.strictEqual((yield* harness.commands).filter((c) => c._tag === "ProvisionStage").length, 3)
      }
    })
  )

  it.effect("a config with maxTokens 0 or an empty prompt is refused", () =>
    Effect.gen(function* () {
      const zero = yield* Effect.flip(Effect.scoped(RunActor.make({ runId, maxTokens: 0, prompt: [1] })))
      assert.include(zero.message, "maxTokens 0")
      const empty = yield* Effect.flip(Effect.scoped(RunActor.make({ runId, maxTokens: 1, prompt: [] })))
      assert.include(empty.message, "prompt")
    })
  )

  it.scoped("commands and lifecycle events survive a Schema encode/decode round trip", () =>
    Effect.gen(function* () {
      const harness = yield* startedRun(committedPlan())
      yield* harness.observe(RunEvents.TokenReceived({ step: 0, tokenId: 7, eos: true }))
      const commands = yield* harness.commands
      const events = yield* harness.events
      const roundTrip = <A, I>(schema: Schema.Schema<A, I>, value: A) =>
        Schema.decodeUnknownSync(schema)(JSON.parse(JSON.stringify(Schema.encodeSync(schema)(value))))
      for (const command of commands) assert.deepStrictEqual(roundTrip(RunCommand, command), command)
      for (const event of events) assert.deepStrictEqual(roundTrip(LifecycleEvent, event), event)
      assert.isAbove(commands.length, 6)
    })
  )
})
