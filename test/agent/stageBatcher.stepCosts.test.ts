/**
 * Decode micro-batch sizing from measured step costs (services/StepCosts.ts, layers/agent/StageBatcher.ts): the idle
 * probe measures a forward of 1..N one-row steps, and the batcher then cuts L decoding sequences on S stages into the
 * micro-batches whose round is least, where that beats ceil(L / S). The engine here is the deterministic double with a
 * wall-clock cost per row count shaped like ggml's measured one (rows in fours are cheap, odd counts dear). The sizing
 * cases are given their costs (a table seeded with COST, five times each): what a busy machine measures does not
 * choose the path they test; the probe's own case checks what it measured against COST from below only.
 */
import { assert, describe, it } from "@effect/vitest"
import { Deferred, Effect, Fiber, Layer } from "effect"
import type { StageInput } from "../../src/domain/engine.js"
import { emptyBatchCounters, makeStageBatcher } from "../../src/layers/agent/StageBatcher.js"
import { make as makeDouble } from "../../src/layers/engine/StageExecutorTest.js"
import { StageExecutor, type StageExecutorService, type StageSession } from "../../src/services/StageExecutor.js"
import { makeStepCosts } from "../../src/services/StepCosts.js"
import { untilTrue } from "../support/until.js"

/**
 * ms per forward by rows: about the 16×2048 Q8_0 stage's measured 70/74/149/115/180/130/…/164 ms scaled down 3.5×
 * (4 rows a little dearer, so that 6 sequences' best cut is clear of timer noise).
 */
const COST: Record<number, number> = { 1: 20, 2: 21, 3: 43, 4: 36, 5: 51, 6: 40, 7: 60, 8: 50 }

/** The double; every forwardBatch takes COST[rows] ms of wall time (plus `coldExtra` the first time a row count runs)
 * and is recorded (its sessions); the first after `gate` is armed waits for it. */
const costedExecutor = (coldExtra = 0) => {
  const base = makeDouble()
  const calls: Array<ReadonlyArray<StageSession>> = []
  const ran = new Set<number>()
  let gate: Deferred.Deferred<void> | undefined
  const service: StageExecutorService = {
    ...base,
    forwardBatch: (items) =>
      Effect.gen(function* () {
        calls.push(items.map((i) => i.session))
        const held = gate
        gate = undefined
        if (held !== undefined) yield* Deferred.await(held)
        const rows = items.reduce(
          (s, i) => s + (i.input._tag === "Tokens" ? i.input.tokens.length : i.input.nTokens),
          0
        )
        const extra = ran.has(rows) ? 0 : coldExtra
        ran.add(rows)
        yield* Effect.promise(() => new Promise((resolve) => setTimeout(resolve, (COST[rows] ?? 10 * rows) + extra)))
        return yield* base.forwardBatch(items)
      })
  }
  return { calls, arm: (d: Deferred.Deferred<void>) => (gate = d), layer: Layer.succeed(StageExecutor, service) }
}

const tokens = (...t: Array<number>): StageInput => ({ _tag: "Tokens", tokens: Int32Array.from(t) })

/**
 * `decoders` sessions each submit one decode step on a pipeline of `stages`; the first is held at the gate so the rest
 * queue behind it: the micro-batches after it show the batcher's cap. Returns their session indices.
 */
const decodeRound = (probe: "probe" | "seeded" | "none", decoders: number, stages: number, coldExtra = 0) =>
  Effect.gen(function* () {
    const ex = costedExecutor(coldExtra)
    return yield* Effect.gen(function* () {
      const executor = yield* StageExecutor
      const stage = yield* executor.load({
        path: "m",
        layerStart: 0,
        layerEndExclusive: 6,
        isFirst: true,
        isLast: true
      })
      const seeded = makeStepCosts()
      for (let i = 0; i < 5; i++)
        for (const [rows, millis] of Object.entries(COST)) seeded.observe(Number(rows), millis)
      const batcher = yield* makeStageBatcher({
        maxRows: 64,
        gatherMillis: 0,
        ...(probe === "probe" ? { stepProbe: { maxRows: 8, session: executor.session(stage) } } : {}),
        ...(probe === "seeded" ? { stepCosts: seeded } : {})
      })
      if (probe === "probe") {
        yield* untilTrue("the idle probe to finish", () => batcher.stepCosts().probe === "done")
      }
      const probeCalls = ex.calls.splice(0).map((c) => c.length)
      const sessions = yield* Effect.forEach(Array.from({ length: decoders }), () => executor.session(stage))
      const gate = yield* Deferred.make<void>()
      ex.arm(gate)
      const held = yield* Effect.fork(batcher.submit(sessions[0]!, 0, tokens(1), emptyBatchCounters(), stages))
      while (ex.calls.length === 0) yield* Effect.yieldNow()
      const rest = yield* Effect.forEach(sessions.slice(1), (s, i) =>
        Effect.fork(batcher.submit(s, 0, tokens(i + 2), emptyBatchCounters(), stages))
      )
      // every step submitted (queued behind the held one) before the gate opens
      yield* Effect.sleep("50 millis")
      yield* Deferred.succeed(gate, undefined)
      yield* Fiber.join(held)
      yield* Effect.forEach(rest, Fiber.join)
      return {
        probeCalls,
        costs: batcher.stepCosts(),
        groups: ex.calls.slice(1).map((c) => c.map((s) => sessions.indexOf(s)))
      }
    }).pipe(Effect.provide(ex.layer))
  })

describe("decode micro-batches sized from measured step costs", () => {
  it.scopedLive("the idle probe runs a warm-up then 1..8 one-row steps twice each, and records each size's cost", () =>
    Effect.gen(function* () {
      const { costs, probeCalls } = yield* decodeRound("probe", 1, 1)
      assert.deepStrictEqual(probeCalls, [1, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8])
      assert.strictEqual(costs.probe, "done")
      // rows 1 also holds the decode step of this round (held at the gate): only sizes 2..8 are the probe's alone
      for (const { millis, rows } of costs.costs.filter((c) => c.rows > 1)) {
        assert.isAtLeast(millis, COST[rows]! - 1, `rows ${rows}`)
      }
      assert.deepStrictEqual(
        costs.costs.map((c) => c.rows),
        [1, 2, 3, 4, 5, 6, 7, 8]
      )
    })
  )

  // The first forward of a batch shape costs more (ggml builds its graph then; a page fault, the other stage's probe):
  // with 80 ms more on each size's first forward, each size's estimate is still its steady cost.
  it.scopedLive("a size's slow first forward is not its cost: the probe keeps the faster of its two forwards", () =>
    Effect.gen(function* () {
      const { costs } = yield* decodeRound("probe", 1, 1, 80)
      for (const { millis, rows } of costs.costs.filter((c) => c.rows > 1)) {
        assert.isAtLeast(millis, COST[rows]! - 1, `rows ${rows}`)
        assert.isBelow(millis, COST[rows]! + 60, `rows ${rows}: the cold forward was taken as the cost`)
      }
    })
  )

  // A run's prompt must not wait behind a probe: no probe step runs while the stage has work or within quietMillis of
  // its last session; once quiet again, the probe runs whole.
  it.scopedLive(
    "work before the stage was quiet goes first: no probe step until quietMillis after it, then the whole probe",
    () =>
      Effect.gen(function* () {
        const ex = costedExecutor()
        yield* Effect.gen(function* () {
          const executor = yield* StageExecutor
          const stage = yield* executor.load({
            path: "m",
            layerStart: 0,
            layerEndExclusive: 6,
            isFirst: true,
            isLast: true
          })
          const batcher = yield* makeStageBatcher({
            maxRows: 64,
            stepProbe: { maxRows: 8, session: executor.session(stage), quietMillis: 300 }
          })
          assert.strictEqual(batcher.stepCosts().probe, "pending")
          const session = yield* executor.session(stage)
          yield* batcher.submit(session, 0, tokens(1, 2, 3), emptyBatchCounters(), 2)
          yield* batcher.submit(session, 3, tokens(4), emptyBatchCounters(), 2)
          const lastWork = performance.now()
          assert.deepStrictEqual(
            ex.calls.map((c) => c.length),
            [1, 1],
            "a probe step ran before the run's work"
          )
          yield* untilTrue("the probe to run after the work", () => batcher.stepCosts().probe === "done")
          // the session's decode step keeps the stage busy for 3 of its intervals (or 2 s), then quietMillis
          assert.isAtLeast(performance.now() - lastWork, 300)
          assert.deepStrictEqual(
            ex.calls.slice(2).map((c) => c.length),
            [1, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8]
          )
        }).pipe(Effect.provide(ex.layer))
      })
  )

  // 6 sequences on 2 stages: ceil(6 / 2) = 3 per micro-batch takes 43 + 43 a round (and 2 × 43 per trip), 4 + 2 takes
  // max(36 + 21, 2 × 36) = 72, 2 + 2 + 2 takes 3 × 21 = 63: the measured costs pick 2. Without them: ceil = 3.
  for (const costed of [true, false]) {
    it.scopedLive(
      `6 sequences on 2 stages, ${costed ? "costs known: micro-batches of 2" : "no costs: ceil(6 / 2) = 3"}`,
      () =>
        Effect.gen(function* () {
          const { costs, groups } = yield* decodeRound(costed ? "seeded" : "none", 6, 2)
          assert.deepStrictEqual(
            groups,
            costed
              ? [[1, 2], [3, 4], [5]]
              : [
                  [1, 2, 3],
                  [4, 5]
                ]
          )
          assert.deepInclude(costs.choice, { decoders: 6, stages: 2, rows: costed ? 2 : 3, defaultRows: 3 })
        })
    )
  }

  // 8 sequences on 2 stages: ceil = 4 (two micro-batches of 36 ms, 72 a round) is already the cheapest round: kept.
  it.scopedLive("8 sequences on 2 stages, costs known: ceil(8 / 2) = 4 is kept", () =>
    Effect.gen(function* () {
      const { costs, groups } = yield* decodeRound("seeded", 8, 2)
      assert.deepStrictEqual(groups, [
        [1, 2, 3, 4],
        [5, 6, 7]
      ])
      assert.deepInclude(costs.choice, { decoders: 8, stages: 2, rows: 4, defaultRows: 4 })
    })
  )
})
