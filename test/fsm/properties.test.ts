// Property tests of the run FSM over random event sequences and time (G11–G22 in specs/BEHAVIOR_GUARANTEES.md): the
// pure transition function is folded over each sequence and its whole transcript is checked; then the same sequence
// is replayed through the real RunActor (OrchestratorHarness, TestClock) and must produce the same transcript.
import { assert, describe, it } from "@effect/vitest"
import { Effect, Either, FastCheck as fc, TestContext } from "effect"
import { type NodeId, RunId } from "../../src/domain/ids.js"
import {
  isTerminalEvent,
  type LifecycleEvent,
  type RunCommand,
  type RunConfig,
  type RunEvent,
  RunEvents,
  StageFaultReasons
} from "../../src/domain/runEvents.js"
import { OrchestratorHarness } from "../../src/services/OrchestratorHarness.js"
import { stageNodes, testLinearPlan } from "../../src/services/Planner.js"
import { expire, initialState, resolveConfig, type RunState, type Step, transition } from "../../src/services/RunFsm.js"

const runId = RunId.make(7)
const foreignRunId = RunId.make(8)
const refs = [0, 1, 2].map((stageIndex) => ({ stageIndex, nodeId: (10 + stageIndex) as NodeId }))
const plan = testLinearPlan(runId, refs)
const foreignPlan = testLinearPlan(foreignRunId, refs)
const node = (n: number) => n as NodeId

type Op =
  | { readonly _tag: "Event"; readonly event: RunEvent }
  /** A token for whatever step is in flight when it is applied (resolved against the pure state). */
  | { readonly _tag: "TokenForInFlight"; readonly tokenId: number; readonly eos: boolean }
  | { readonly _tag: "Advance"; readonly ms: number }

const ev = (event: RunEvent): Op => ({ _tag: "Event", event })
const stageIndexArb = fc.integer({ min: 0, max: 3 })

const opArb: fc.Arbitrary<Op> = fc.oneof(
  { weight: 3, arbitrary: fc.constant(ev(RunEvents.PoolReady({ nodes: stageNodes(plan) }))) },
  {
    weight: 1,
    arbitrary: fc.constantFrom(node(10), node(13)).map((n) => ev(RunEvents.PoolReady({ nodes: [n] })))
  },
  { weight: 3, arbitrary: fc.constant(ev(RunEvents.PlanAvailable({ plan }))) },
  { weight: 1, arbitrary: fc.constant(ev(RunEvents.PlanAvailable({ plan: foreignPlan }))) },
  { weight: 6, arbitrary: stageIndexArb.map((stageIndex) => ev(RunEvents.StageReady({ runId, stageIndex }))) },
  { weight: 1, arbitrary: fc.constant(ev(RunEvents.StageReady({ runId: foreignRunId, stageIndex: 0 }))) },
  { weight: 2, arbitrary: fc.constant(ev(RunEvents.TokenInEndpointReady())) },
  { weight: 2, arbitrary: fc.constant(ev(RunEvents.TokenOutEndpointReady())) },
  {
    weight: 10,
    arbitrary: fc.record({ tokenId: fc.constantFrom(2, 100, 101, 102), eos: fc.boolean() }).map(({ eos, tokenId }) => ({
      _tag: "TokenForInFlight" as const,
      tokenId,
      eos: eos && tokenId === 101
    }))
  },
  {
    weight: 2,
    arbitrary: fc
      .integer({ min: 0, max: 5 })
      .map((step) => ev(RunEvents.TokenReceived({ step, tokenId: 100, eos: false })))
  },
  {
    weight: 1,
    arbitrary: stageIndexArb.map((stageIndex) =>
      ev(RunEvents.StageFault({ runId, stageIndex, reason: StageFaultReasons.WorkerCrashed() }))
    )
  },
  {
    weight: 1,
    arbitrary: fc
      .constantFrom("TokenIn" as const, "TokenOut" as const)
      .map((endpoint) => ev(RunEvents.EndpointFault({ runId, endpoint })))
  },
  {
    weight: 1,
    arbitrary: fc.integer({ min: 10, max: 13 }).map((n) => ev(RunEvents.MembershipLost({ runId, nodeId: node(n) })))
  },
  { weight: 1, arbitrary: fc.constantFrom(runId, foreignRunId).map((id) => ev(RunEvents.OperatorStop({ runId: id }))) },
  { weight: 4, arbitrary: stageIndexArb.map((stageIndex) => ev(RunEvents.StageStopped({ runId, stageIndex }))) },
  { weight: 2, arbitrary: fc.constant(ev(RunEvents.TokenEndpointsStopped())) },
  {
    weight: 3,
    arbitrary: fc.constantFrom(1, 999, 1_000, 5_000, 60_000, 130_000).map((ms) => ({ _tag: "Advance" as const, ms }))
  }
)

const configArb: fc.Arbitrary<RunConfig> = fc
  .record({
    maxTokens: fc.integer({ min: 1, max: 6 }),
    eos: fc.boolean(),
    short: fc.boolean()
  })
  .map(({ eos, maxTokens, short }) => ({
    runId,
    maxTokens,
    prompt: [101, 102, 103],
    ...(eos ? { eosTokenId: 2 } : {}),
    ...(short ? { readinessTimeout: "5 seconds", tokenTimeout: "1 second", teardownTimeout: "2 seconds" } : {})
  }))

interface Entry {
  readonly op: Op
  /** The concrete event applied (TokenForInFlight resolved), if the op was an event. */
  readonly event: RunEvent | undefined
  readonly now: number
  /** The state after deadlines up to `now` fired, before the event. */
  readonly before: Step
  readonly step: Step
}

/** Folds the pure FSM over the ops, keeping every step. */
const fold = (config: RunConfig, ops: ReadonlyArray<Op>) => {
  let state: RunState = initialState(Either.getOrThrow(resolveConfig(config)))
  let now = 0
  const entries: Array<Entry> = []
  for (const op of ops) {
    if (op._tag === "Advance") {
      now += op.ms
      const step = expire(state, now)
      entries.push({ op, event: undefined, now, before: step, step })
      state = step.state
      continue
    }
    const event =
      op._tag === "Event"
        ? op.event
        : RunEvents.TokenReceived({ step: state.inFlight ?? state.injected.length, tokenId: op.tokenId, eos: op.eos })
    const before = expire(state, now)
    const step = transition(state, event, now)
    entries.push({ op, event, now, before, step })
    state = step.state
  }
  return entries
}

type Output =
  { readonly kind: "command"; readonly value: RunCommand } | { readonly kind: "event"; readonly value: LifecycleEvent }

const outputsOf = (step: Step): Array<Output> => [
  ...step.commands.map((value) => ({ kind: "command" as const, value })),
  ...step.events.map((value) => ({ kind: "event" as const, value }))
]

const checkInvariants = (config: RunConfig, entries: ReadonlyArray<Entry>) => {
  const resolved = Either.getOrThrow(resolveConfig(config))
  const events = entries.flatMap((e) => e.step.events)
  const commands = entries.flatMap((e) => e.step.commands)

  // At most one terminal outcome.
  const terminals = events.filter(isTerminalEvent)
  assert.isAtMost(terminals.length, 1, "more than one terminal outcome")
  const terminalEntry = entries.findIndex((e) => e.step.events.some(isTerminalEvent))

  // Injected steps are 0, 1, 2, ... with no gaps or repeats; k + 1 only after TokenAccepted k; none after the
  // terminal outcome; 0 only once every provisioned stage and both endpoints are ready.
  let expectedStep = 0
  let terminalSeen = false
  const accepted = new Set<number>()
  for (const entry of entries) {
    for (const event of entry.step.events) if (isTerminalEvent(event)) terminalSeen = true
    // A step that consumes k (TokenAccepted k) may inject k + 1 in the same step.
    for (const event of entry.step.events) if (event._tag === "TokenAccepted") accepted.add(event.step)
    for (const command of entry.step.commands) {
      if (command._tag !== "InjectTokenObject") continue
      assert.isFalse(terminalSeen, "injection after a terminal outcome")
      const { payload, step } = command.object
      assert.strictEqual(step, expectedStep, "injected steps must be 0, 1, 2, ...")
      if (step === 0) {
        assert.strictEqual(payload._tag, "Prompt")
        const s = entry.step.state
        assert.isTrue(s.tokenInReady && s.tokenOutReady, "prompt before both endpoints were ready")
        assert.isTrue(s.provisioned.length === 3 && s.provisioned.every((p) => s.readyStages.includes(p.stageIndex)))
      } else {
        assert.isTrue(accepted.has(step - 1), `step ${step} injected before ${step - 1} was consumed`)
        assert.deepStrictEqual(payload, {
          _tag: "Decode",
          tokenId: payload._tag === "Decode" ? payload.tokenId : -1,
          sampling: { sourceStep: step - 1 }
        })
      }
      expectedStep++
    }
  }
  assert.isAtMost(expectedStep, resolved.maxTokens)

  // The barrier passes in the very step that completes it: no state waits in Provisioning with everything ready.
  for (const entry of entries) {
    const s = entry.step.state
    const allReady =
      s.provisioned.length > 0 &&
      s.provisioned.every((p) => s.readyStages.includes(p.stageIndex)) &&
      s.tokenInReady &&
      s.tokenOutReady
    assert.isFalse(s.phase === "Provisioning" && allReady, "every stage and both endpoints ready, prompt not injected")
  }

  // Provisioning: one ProvisionStage per planned stage, only to plan nodes, only after PoolReady and the plan.
  const provisions = commands.flatMap((c) => (c._tag === "ProvisionStage" ? [c.provision] : []))
  assert.include([0, 3], provisions.length)
  if (provisions.length === 3) {
    assert.deepStrictEqual(
      provisions.map((p) => [p.stageIndex, p.nodeId]),
      refs.map((r) => [r.stageIndex, r.nodeId])
    )
    const at = entries.findIndex((e) => e.step.commands.some((c) => c._tag === "ProvisionStage"))
    const seen = entries.slice(0, at + 1).map((e) => e.event?._tag)
    assert.include(seen, "PoolReady")
    assert.include(seen, "PlanAvailable")
  }

  // Rejected events change nothing but the rejection count; foreign-run events are always rejected as such.
  for (const entry of entries) {
    if (entry.event === undefined) continue
    const rejected = entry.step.events.filter((e) => e._tag === "EventRejected")
    const foreign =
      "runId" in entry.event
        ? entry.event.runId !== runId
        : entry.event._tag === "PlanAvailable" && entry.event.plan.runId !== runId
    if (foreign) assert.strictEqual(rejected[0]?._tag === "EventRejected" && rejected[0].reason, "ForeignRun")
    if (rejected.length === 0) continue
    const before = entry.before
    assert.deepStrictEqual(entry.step.state, { ...before.state, rejected: before.state.rejected + 1 })
    assert.deepStrictEqual(entry.step.commands, before.commands)
    assert.strictEqual(entry.step.events.length, before.events.length + 1)
  }

  // After the terminal outcome: StopRun for every provisioned stage and TearDownTokenEndpoints iff endpoints exist.
  if (terminalEntry >= 0) {
    const after = entries.slice(terminalEntry).flatMap((e) => e.step.commands)
    const stops = after.flatMap((c) => (c._tag === "StopRun" ? [c.stageIndex] : []))
    assert.deepStrictEqual(
      stops,
      provisions.map((p) => p.stageIndex)
    )
    assert.strictEqual(after.filter((c) => c._tag === "TearDownTokenEndpoints").length, provisions.length > 0 ? 1 : 0)
    assert.strictEqual(commands.filter((c) => c._tag === "StopRun").length, stops.length)
  } else {
    assert.isFalse(commands.some((c) => c._tag === "StopRun" || c._tag === "TearDownTokenEndpoints"))
  }

  // RunTornDown at most once, after the terminal outcome, listing exactly the stages whose stop was not confirmed;
  // with anything unconfirmed only once the teardown deadline has passed.
  const tornDown = events.filter((e) => e._tag === "RunTornDown")
  assert.isAtMost(tornDown.length, 1, "RunTornDown more than once")
  const tornDownEntry = entries.findIndex((e) => e.step.events.some((x) => x._tag === "RunTornDown"))
  if (tornDownEntry >= 0) {
    assert.isAtLeast(tornDownEntry, terminalEntry)
    assert.isAtLeast(terminalEntry, 0)
    const outputs = outputsOf(entries[tornDownEntry]!.step)
    const terminalPos = outputs.findIndex((o) => o.kind === "event" && isTerminalEvent(o.value))
    const tornPos = outputs.findIndex((o) => o.kind === "event" && o.value._tag === "RunTornDown")
    if (tornDownEntry === terminalEntry) assert.isBelow(terminalPos, tornPos)
    const confirmed = new Set<number>()
    let endpointsStopped = false
    for (const entry of entries.slice(0, tornDownEntry + 1)) {
      const e = entry.event
      if (e === undefined || entry.step.events.some((x) => x._tag === "EventRejected")) continue
      if (e._tag === "StageStopped") confirmed.add(e.stageIndex)
      if (e._tag === "TokenEndpointsStopped") endpointsStopped = true
    }
    const done = tornDown[0]!
    assert.isTrue(done._tag === "RunTornDown")
    if (done._tag !== "RunTornDown") return
    assert.deepStrictEqual(
      done.unconfirmedStages,
      provisions.map((p) => p.stageIndex).filter((i) => !confirmed.has(i))
    )
    assert.strictEqual(done.endpointsConfirmed, provisions.length === 0 || endpointsStopped)
    if (done.unconfirmedStages.length > 0 || !done.endpointsConfirmed) {
      // The terminal outcome happened no earlier than the time reached before its step (a deadline inside an
      // Advance fires at its own time).
      const terminalNoEarlierThan = terminalEntry > 0 ? entries[terminalEntry - 1]!.now : 0
      assert.isAtLeast(entries[tornDownEntry]!.now, terminalNoEarlierThan + resolved.teardownTimeoutMs)
    }
  }

  // A completed run generated at most maxTokens tokens, exactly maxTokens when that was the reason.
  for (const t of terminals) {
    if (t._tag !== "RunCompleted") continue
    if (t.reason === "MaxTokens") assert.strictEqual(t.tokens.length, resolved.maxTokens)
    else assert.isBelow(t.tokens.length, resolved.maxTokens)
  }
}

// The five readiness facts, given in any order and any subset by the third branch below, so that the barrier is
// reached with TokenOut missing and with stage 0 the last to be ready (a plain random walk almost never gets there).
const readinessOps: ReadonlyArray<Op> = [
  ev(RunEvents.TokenInEndpointReady()),
  ev(RunEvents.TokenOutEndpointReady()),
  ...refs.map((r) => ev(RunEvents.StageReady({ runId, stageIndex: r.stageIndex })))
]

// Sequences that reach execution often: a valid start, then random ops.
const opsArb = fc.oneof(
  fc.array(opArb, { maxLength: 40 }),
  fc
    .array(opArb, { maxLength: 30 })
    .map((tail) => [
      ev(RunEvents.PoolReady({ nodes: stageNodes(plan) })),
      ev(RunEvents.PlanAvailable({ plan })),
      ev(RunEvents.TokenInEndpointReady()),
      ev(RunEvents.TokenOutEndpointReady()),
      ...refs.map((r) => ev(RunEvents.StageReady({ runId, stageIndex: r.stageIndex }))),
      ...tail
    ]),
  fc
    .tuple(fc.shuffledSubarray([...readinessOps]), fc.array(opArb, { maxLength: 20 }))
    .map(([readies, tail]) => [
      ev(RunEvents.PoolReady({ nodes: stageNodes(plan) })),
      ev(RunEvents.PlanAvailable({ plan })),
      ...readies,
      ...tail
    ])
)

/** Readiness states the barrier must handle; the generator is checked to reach each of them. */
const barrierStates = (entries: ReadonlyArray<Entry>): Array<string> => {
  const seen: Array<string> = []
  for (const entry of entries) {
    const s = entry.step.state
    const allStagesReady =
      s.provisioned.length === 3 && s.provisioned.every((p) => s.readyStages.includes(p.stageIndex))
    if (s.phase === "Provisioning" && allStagesReady && s.tokenInReady && !s.tokenOutReady) {
      seen.push("all stages and TokenIn ready, TokenOut not")
    }
    const startedBy = entry.step.events.some((e) => e._tag === "RunStarted") ? entry.event : undefined
    if (startedBy?._tag === "StageReady" && startedBy.stageIndex === 0) seen.push("stage 0 the last ready")
    if (startedBy?._tag === "TokenOutEndpointReady") seen.push("TokenOut the last ready")
  }
  return seen
}

describe("run FSM properties", () => {
  it("for any event sequence: one terminal outcome at most, ordered injections, teardown after every stop", () =>
    fc.assert(
      fc.property(configArb, opsArb, (config, ops) => checkInvariants(config, fold(config, ops))),
      {
        numRuns: 400,
        seed: 0x5eed01
      }
    ))

  it("the sequences reach every terminal kind, both ways of tearing down and the barrier's edge cases", () => {
    // Guards the generator: the invariants above are only as good as the states the sequences reach.
    const seen = new Set<string>()
    fc.assert(
      fc.property(configArb, opsArb, (config, ops) => {
        for (const entry of fold(config, ops)) {
          for (const e of entry.step.events) {
            if (isTerminalEvent(e)) seen.add(e._tag === "RunCompleted" ? `RunCompleted:${e.reason}` : e._tag)
            if (e._tag === "RunTornDown") {
              seen.add(e.unconfirmedStages.length === 0 ? "TornDown:clean" : "TornDown:deadline")
            }
          }
        }
        for (const state of barrierStates(fold(config, ops))) seen.add(state)
      }),
      { numRuns: 400, seed: 42 }
    )
    const kinds = [
      "RunCompleted:Eos",
      "RunCompleted:MaxTokens",
      "RunFaulted",
      "RunOperatorStopped",
      "TornDown:clean",
      "TornDown:deadline",
      "all stages and TokenIn ready, TokenOut not",
      "stage 0 the last ready",
      "TokenOut the last ready"
    ]
    for (const kind of kinds) {
      assert.isTrue(seen.has(kind), `no generated sequence reached ${kind}`)
    }
  })

  it("the RunActor fiber publishes exactly the transcript of the pure transition function", () =>
    fc.assert(
      fc.asyncProperty(configArb, opsArb, (config, ops) =>
        Effect.runPromise(
          Effect.gen(function* () {
            const entries = fold(config, ops)
            const harness = yield* OrchestratorHarness.make(config)
            for (const entry of entries) {
              if (entry.op._tag === "Advance") yield* harness.advanceTimeMs(entry.op.ms)
              else yield* harness.observe(entry.event!)
            }
            assert.deepStrictEqual(
              yield* harness.commands,
              entries.flatMap((e) => e.step.commands)
            )
            assert.deepStrictEqual(
              yield* harness.events,
              entries.flatMap((e) => e.step.events)
            )
            assert.deepStrictEqual(yield* harness.state, entries.at(-1)?.step.state ?? (yield* harness.state))
          }).pipe(Effect.scoped, Effect.provide(TestContext.TestContext))
        )
      ),
      { numRuns: 40, seed: 0x5eed02 }
    ))
})
