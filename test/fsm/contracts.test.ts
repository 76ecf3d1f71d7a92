// Contract tests of the run FSM that name each refusal and each fault path (G15, G16, G19–G22 in
// specs/BEHAVIOR_GUARANTEES.md). They fold the pure `transition` over a short event list from a canonical start and
// change one fact at a time, so a failure names the broken contract.
import { assert, describe, it } from "@effect/vitest"
import { Effect, Either, TestClock } from "effect"
import { type NodeId, RunId } from "../../src/domain/ids.js"
import {
  type LifecycleEvent,
  type RejectionReason,
  type RunConfig,
  type RunEvent,
  RunEvents,
  RunFaultReasons,
  StageFaultReasons
} from "../../src/domain/runEvents.js"
import { OrchestratorHarness } from "../../src/services/OrchestratorHarness.js"
import { stageNodes, testLinearPlan } from "../../src/services/Planner.js"
import { expire, initialState, resolveConfig, type RunState, type Step, transition } from "../../src/services/RunFsm.js"

const runId = RunId.make(7)
const node = (n: number) => n as NodeId
const plan = testLinearPlan(
  runId,
  [0, 1, 2].map((stageIndex) => ({ stageIndex, nodeId: node(10 + stageIndex) }))
)
const config: RunConfig = { runId, maxTokens: 4, prompt: [101, 102, 103] }

const pool = RunEvents.PoolReady({ nodes: stageNodes(plan) })
const planned = RunEvents.PlanAvailable({ plan })
const ready: ReadonlyArray<RunEvent> = [
  RunEvents.TokenInEndpointReady(),
  RunEvents.TokenOutEndpointReady(),
  ...plan.stages.map((s) => RunEvents.StageReady({ runId, stageIndex: s.stageIndex }))
]
const crash = (stageIndex: number) =>
  RunEvents.StageFault({ runId, stageIndex, reason: StageFaultReasons.WorkerCrashed() })

/** Folds the pure FSM over `events`, all at time `now`; returns the final state and everything emitted. */
const fold = (events: ReadonlyArray<RunEvent>, now = 0, overrides: Partial<RunConfig> = {}) => {
  let state: RunState = initialState(Either.getOrThrow(resolveConfig({ ...config, ...overrides })))
  const steps: Array<Step> = []
  for (const event of events) {
    const step = transition(state, event, now)
    steps.push(step)
    state = step.state
  }
  return {
    state,
    steps,
    events: steps.flatMap((s) => s.events),
    commands: steps.flatMap((s) => s.commands)
  }
}

/** Applies `event` to the state reached by `prefix` and checks it is refused for `reason`, changing nothing else. */
const assertRejected = (prefix: ReadonlyArray<RunEvent>, event: RunEvent, reason: RejectionReason) => {
  const { state } = fold(prefix)
  const step = transition(state, event, 0)
  assert.deepStrictEqual(step.events, [{ _tag: "EventRejected", runId, event, reason }] satisfies Array<LifecycleEvent>)
  assert.deepStrictEqual(step.commands, [])
  assert.deepStrictEqual(step.state, { ...state, rejected: state.rejected + 1 })
}

const terminals = (events: ReadonlyArray<LifecycleEvent>) =>
  events.filter((e) => e._tag === "RunFaulted" || e._tag === "RunCompleted" || e._tag === "RunOperatorStopped")

describe("run FSM refusals by name (G22)", () => {
  it("UnknownStage: readiness, a fault or a stop for a stage index outside the plan", () => {
    assertRejected([pool, planned], RunEvents.StageReady({ runId, stageIndex: 3 }), "UnknownStage")
    assertRejected([pool, planned], crash(7), "UnknownStage")
    assertRejected(
      [pool, planned, RunEvents.OperatorStop({ runId })],
      RunEvents.StageStopped({ runId, stageIndex: 3 }),
      "UnknownStage"
    )
    // Without a plan no stage index is known.
    assertRejected([pool], RunEvents.StageReady({ runId, stageIndex: 0 }), "UnknownStage")
  })

  it("NotProvisioned: readiness, faults or stops before provisioning", () => {
    // The plan is known but the pool does not cover it, so nothing is provisioned yet.
    assertRejected([planned], RunEvents.StageReady({ runId, stageIndex: 0 }), "NotProvisioned")
    assertRejected([planned], RunEvents.TokenInEndpointReady(), "NotProvisioned")
    assertRejected([planned], RunEvents.TokenOutEndpointReady(), "NotProvisioned")
    assertRejected([planned], RunEvents.EndpointFault({ runId, endpoint: "TokenIn" }), "NotProvisioned")
    assertRejected([planned], RunEvents.TokenEndpointsStopped(), "NotProvisioned")
    assertRejected([planned], RunEvents.StageStopped({ runId, stageIndex: 1 }), "NotProvisioned")
  })

  it("NodeNotInRun: losing a node that is neither in the plan nor in the pool", () => {
    assertRejected([pool, planned], RunEvents.MembershipLost({ runId, nodeId: node(99) }), "NodeNotInRun")
    assertRejected([], RunEvents.MembershipLost({ runId, nodeId: node(10) }), "NodeNotInRun")
  })

  it("Duplicate: a readiness or stop fact observed twice", () => {
    const provisioned = [pool, planned]
    const stage1 = RunEvents.StageReady({ runId, stageIndex: 1 })
    assertRejected([...provisioned, stage1], stage1, "Duplicate")
    assertRejected([...provisioned, RunEvents.TokenInEndpointReady()], RunEvents.TokenInEndpointReady(), "Duplicate")
    assertRejected([...provisioned, RunEvents.TokenOutEndpointReady()], RunEvents.TokenOutEndpointReady(), "Duplicate")
    const stopped = [
      ...provisioned,
      RunEvents.OperatorStop({ runId }),
      RunEvents.StageStopped({ runId, stageIndex: 0 })
    ]
    assertRejected(stopped, RunEvents.StageStopped({ runId, stageIndex: 0 }), "Duplicate")
    const endpointsStopped = [...provisioned, RunEvents.OperatorStop({ runId }), RunEvents.TokenEndpointsStopped()]
    assertRejected(endpointsStopped, RunEvents.TokenEndpointsStopped(), "Duplicate")
  })

  it("PlanAlreadyCommitted: a second plan, even an identical one, before or after provisioning", () => {
    assertRejected([planned], planned, "PlanAlreadyCommitted")
    assertRejected([pool, planned], planned, "PlanAlreadyCommitted")
    const other = testLinearPlan(runId, [{ stageIndex: 0, nodeId: node(10) }])
    assertRejected([pool, planned], RunEvents.PlanAvailable({ plan: other }), "PlanAlreadyCommitted")
  })
})

describe("run FSM faults (G15, G16)", () => {
  it("every fault after the first is recorded as AlreadyTerminal and never replaces the reason", () => {
    const first = crash(1)
    const later: ReadonlyArray<RunEvent> = [
      crash(2),
      RunEvents.EndpointFault({ runId, endpoint: "TokenOut" }),
      RunEvents.MembershipLost({ runId, nodeId: node(12) }),
      RunEvents.OperatorStop({ runId }),
      RunEvents.TokenReceived({ step: 0, tokenId: 5, eos: false })
    ]
    const run = fold([pool, planned, ...ready, first, ...later])
    assert.deepStrictEqual(terminals(run.events), [
      { _tag: "RunFaulted", runId, reason: RunFaultReasons.StageFault({ stageIndex: 1, reason: first.reason }) }
    ])
    const rejected = run.events.flatMap((e) => (e._tag === "EventRejected" ? [[e.event, e.reason]] : []))
    assert.deepStrictEqual(
      rejected,
      later.map((event) => [event, "AlreadyTerminal"])
    )
    assert.deepStrictEqual(run.state.outcome, {
      _tag: "Faulted",
      reason: RunFaultReasons.StageFault({ stageIndex: 1, reason: first.reason })
    })
  })

  it("an EndpointFault as the first fault faults the run and tears everything down", () => {
    const run = fold([pool, planned, ...ready, RunEvents.EndpointFault({ runId, endpoint: "TokenOut" })])
    assert.deepStrictEqual(terminals(run.events), [
      { _tag: "RunFaulted", runId, reason: RunFaultReasons.EndpointFault({ endpoint: "TokenOut" }) }
    ])
    const teardown = run.steps.at(-1)!.commands
    assert.deepStrictEqual(
      teardown.map((c) => (c._tag === "StopRun" ? `StopRun ${c.stageIndex}@${c.nodeId}` : c._tag)),
      ["StopRun 0@10", "StopRun 1@11", "StopRun 2@12", "TearDownTokenEndpoints"]
    )
    // Also before the run started, as soon as the endpoints exist.
    const early = fold([pool, planned, RunEvents.EndpointFault({ runId, endpoint: "TokenIn" })])
    assert.deepStrictEqual(early.state.outcome, {
      _tag: "Faulted",
      reason: RunFaultReasons.EndpointFault({ endpoint: "TokenIn" })
    })
  })

  it("losing a pool node the plan does not use only shrinks the pool", () => {
    const wide = RunEvents.PoolReady({ nodes: [node(10), node(11), node(12), node(13)] })
    // While executing: no event, no command, only the pool changes.
    const before = fold([wide, planned, ...ready])
    const step = transition(before.state, RunEvents.MembershipLost({ runId, nodeId: node(13) }), 0)
    assert.deepStrictEqual(step.events, [])
    assert.deepStrictEqual(step.commands, [])
    assert.deepStrictEqual(step.state, { ...before.state, pool: [node(10), node(11), node(12)] })
    // Losing it again is now NodeNotInRun.
    const again = transition(step.state, RunEvents.MembershipLost({ runId, nodeId: node(13) }), 0)
    assert.strictEqual(again.events[0]?._tag === "EventRejected" && again.events[0].reason, "NodeNotInRun")
    // Before the plan: a lost node no longer counts towards covering the plan.
    const uncovered = fold([wide, RunEvents.MembershipLost({ runId, nodeId: node(12) }), planned])
    assert.strictEqual(uncovered.state.phase, "Waiting")
    assert.isFalse(uncovered.commands.some((c) => c._tag === "ProvisionStage"))
    // Losing the plan's own node, by contrast, faults the run.
    const lost = fold([wide, planned, RunEvents.MembershipLost({ runId, nodeId: node(11) })])
    assert.deepStrictEqual(lost.state.outcome, {
      _tag: "Faulted",
      reason: RunFaultReasons.MembershipLost({ nodeId: node(11) })
    })
  })
})

describe("run FSM deadline faults are stamped at the deadline (G19–G21)", () => {
  const short: Partial<RunConfig> = { readinessTimeout: "30 seconds", teardownTimeout: "10 seconds" }

  // A readiness fault observed late (the next event comes at 31 s) still happens at 30 s, so teardown counts from
  // 30 s: RunTornDown at 40 s, not 41 s.
  it("a readiness fault applied at t=31 s starts the teardown deadline from t=30 s", () => {
    const provisioned = fold([pool, planned], 0, short)
    const late = transition(provisioned.state, RunEvents.TokenInEndpointReady(), 31_000)
    assert.strictEqual(late.events[0]?._tag, "RunFaulted")
    assert.deepStrictEqual(late.state.deadline, { _tag: "Teardown", at: 40_000 })
    assert.isFalse(expire(late.state, 39_999).events.some((e) => e._tag === "RunTornDown"))
    assert.deepStrictEqual(expire(late.state, 40_000).events, [
      { _tag: "RunTornDown", runId, unconfirmedStages: [0, 1, 2], endpointsConfirmed: false }
    ])
    // Both deadlines already passed when the event arrives: the fault and RunTornDown, in one step, before it.
    const veryLate = transition(provisioned.state, RunEvents.TokenInEndpointReady(), 41_000)
    assert.deepStrictEqual(
      veryLate.events.map((e) => e._tag),
      ["RunFaulted", "RunTornDown", "EventRejected"]
    )
  })

  it("a token fault applied late starts the teardown deadline from the token deadline", () => {
    const started = fold([pool, planned, ...ready], 0, { ...short, tokenTimeout: "5 seconds" })
    const late = expire(started.state, 6_000)
    assert.deepStrictEqual(late.events, [
      { _tag: "RunFaulted", runId, reason: RunFaultReasons.TokenTimeout({ step: 0 }) }
    ])
    assert.deepStrictEqual(late.state.deadline, { _tag: "Teardown", at: 15_000 })
  })

  // The same through the actor: it sleeps until each deadline, so RunTornDown comes exactly 10 s after the fault.
  it.scoped("through the actor, RunTornDown comes one teardown timeout after the readiness deadline", () =>
    Effect.gen(function* () {
      const harness = yield* OrchestratorHarness.make({ ...config, ...short })
      yield* harness.observe(pool)
      yield* harness.observe(planned)
      yield* harness.advanceTimeMs(30_000)
      assert.strictEqual((yield* harness.events).at(-1)?._tag, "RunFaulted")
      yield* harness.advanceTimeMs(9_999)
      assert.notStrictEqual((yield* harness.events).at(-1)?._tag, "RunTornDown")
      yield* harness.advanceTimeMs(1)
      assert.strictEqual((yield* harness.events).at(-1)?._tag, "RunTornDown")
      assert.strictEqual(yield* TestClock.currentTimeMillis, 40_000)
    })
  )
})
