/**
 * The agent's stage batcher (layers/agent/StageBatcher.ts) over the deterministic StageExecutor double, with a recording
 * wrapper that can hold the first micro-batch at a gate so that the following ones are built deterministically.
 */
import { assert, describe, it } from "@effect/vitest"
import { Deferred, Effect, Exit, Fiber, Layer } from "effect"
import { EngineError, type StageInput, type StageOutput } from "../../src/domain/engine.js"
import { emptyBatchCounters, makeStageBatcher } from "../../src/layers/agent/StageBatcher.js"
import { make as makeDouble } from "../../src/layers/engine/StageExecutorTest.js"
import { StageExecutor, type StageExecutorService, type StageSession } from "../../src/services/StageExecutor.js"

interface Recorded {
  readonly sessions: ReadonlyArray<StageSession>
  readonly startPos: ReadonlyArray<number>
  readonly lengths: ReadonlyArray<number>
}

const lengthOf = (input: StageInput) => (input._tag === "Tokens" ? input.tokens.length : input.nTokens)

/** The double, recording every forwardBatch; the first call waits for `gate`; batches with a poisoned session fail. */
const recordingExecutor = (gate: Deferred.Deferred<void>, poisoned: Set<StageSession> = new Set()) => {
  const base = makeDouble()
  const calls: Array<Recorded> = []
  const service: StageExecutorService = {
    ...base,
    forwardBatch: (items) =>
      Effect.gen(function* () {
        const first = calls.length === 0
        calls.push({
          sessions: items.map((i) => i.session),
          startPos: items.map((i) => i.startPos),
          lengths: items.map((i) => lengthOf(i.input))
        })
        if (first) yield* Deferred.await(gate)
        if (items.some((i) => poisoned.has(i.session))) {
          return yield* new EngineError({ message: "injected: native computation failed" })
        }
        return yield* base.forwardBatch(items)
      })
  }
  return { calls, layer: Layer.succeed(StageExecutor, service) }
}

const tokens = (...t: Array<number>): StageInput => ({ _tag: "Tokens", tokens: Int32Array.from(t) })

/** A later stage's input: `n` positions of the double's hidden state (token, position, 0...). */
const hidden = (token: number, n: number, dim = 8): StageInput => {
  const h = new Float32Array(n * dim)
  for (let i = 0; i < n; i++) {
    h[i * dim] = token + i
    h[i * dim + 1] = i
  }
  return { _tag: "Hidden", hidden: h, nTokens: n }
}

/** The double, recording every forwardBatch's sessions; each batch takes `millis` of wall time. */
const slowExecutor = (millis: number) => {
  const base = makeDouble()
  const calls: Array<ReadonlyArray<StageSession>> = []
  const service: StageExecutorService = {
    ...base,
    forwardBatch: (items) =>
      Effect.gen(function* () {
        calls.push(items.map((i) => i.session))
        yield* Effect.promise(() => new Promise((resolve) => setTimeout(resolve, millis)))
        return yield* base.forwardBatch(items)
      })
  }
  return { calls, layer: Layer.succeed(StageExecutor, service) }
}

/** A stage of the double and `n` sessions on it, plus `n` lone twin sessions for reference outputs. */
const setup = (n: number, isLast: boolean, isFirst = true) =>
  Effect.gen(function* () {
    const executor = yield* StageExecutor
    const stage = yield* executor.load({
      path: "m",
      layerStart: isFirst ? 0 : 3,
      layerEndExclusive: isLast ? 6 : 3,
      isFirst,
      isLast
    })
    const open = () => executor.session(stage)
    const sessions = yield* Effect.forEach(Array.from({ length: n }), open)
    const twins = yield* Effect.forEach(Array.from({ length: n }), open)
    return { sessions, twins }
  })

describe("stage batcher", () => {
  // Work submitted while a micro-batch runs goes into the next one together; each caller gets its lone output.
  it.scoped("pending work of several sequences runs as one forwardBatch; outputs equal lone forwards", () =>
    Effect.gen(function* () {
      const gate = yield* Deferred.make<void>()
      const { calls, layer } = recordingExecutor(gate)
      yield* Effect.gen(function* () {
        const batcher = yield* makeStageBatcher({ maxRows: 64, prefillChunk: 16 })
        const { sessions, twins } = yield* setup(4, true)
        const counters = sessions.map(() => emptyBatchCounters())
        // sequence 0 holds the gate; 1..3 queue behind it
        const first = yield* Effect.fork(batcher.submit(sessions[0]!, 0, tokens(1, 2, 3), counters[0]!))
        while (calls.length === 0) yield* Effect.yieldNow()
        const inputs = [tokens(1, 5), tokens(2, 5, 9), tokens(3, 5, 9, 11)]
        const rest = yield* Effect.forEach([1, 2, 3], (i) =>
          Effect.fork(batcher.submit(sessions[i]!, 0, inputs[i - 1]!, counters[i]!))
        )
        yield* Effect.yieldNow()
        yield* Deferred.succeed(gate, undefined)
        const outs: Array<StageOutput> = [yield* Fiber.join(first), ...(yield* Effect.forEach(rest, Fiber.join))]
        assert.strictEqual(calls.length, 2)
        assert.deepStrictEqual(calls[1]!.sessions, sessions.slice(1))
        assert.deepStrictEqual(calls[1]!.lengths, [2, 3, 4])
        const expected = [
          yield* twins[0]!.forward(0, tokens(1, 2, 3)),
          ...(yield* Effect.forEach([1, 2, 3], (i) => twins[i]!.forward(0, inputs[i - 1]!)))
        ]
        assert.deepStrictEqual(outs, expected)
        assert.deepStrictEqual(
          counters.map((c) => c.maxBatchSequences),
          [1, 3, 3, 3]
        )
        assert.deepStrictEqual(
          counters.map((c) => c.batchRows),
          [3, 9, 9, 9]
        )
      }).pipe(Effect.provide(layer))
    })
  )

  // A prompt of 10 tokens with chunks of 4 runs as [0,4) [4,8) [8,10), one chunk per micro-batch; a decode step
  // submitted with it runs in the first micro-batch and returns before the prompt is done. The caller gets all 10
  // hidden rows, equal to the prompt run alone in one call.
  it.scoped("a long prompt is prefilled in fixed chunks; a decode step submitted beside it does not wait for it", () =>
    Effect.gen(function* () {
      const gate = yield* Deferred.make<void>()
      const { calls, layer } = recordingExecutor(gate)
      yield* Effect.gen(function* () {
        // maxRows 5: a decode row and a 4-token chunk fit together, never two chunks
        const batcher = yield* makeStageBatcher({ maxRows: 5, prefillChunk: 4 })
        const { sessions, twins } = yield* setup(3, false)
        const [a, b, c] = sessions as [StageSession, StageSession, StageSession]
        const counters = [emptyBatchCounters(), emptyBatchCounters(), emptyBatchCounters()]
        const prompt = tokens(3, 1, 4, 1, 5, 9, 2, 6, 5, 3)
        const done: Array<string> = []
        const held = yield* Effect.fork(batcher.submit(a, 0, tokens(7), counters[0]!))
        while (calls.length === 0) yield* Effect.yieldNow()
        const long = yield* Effect.fork(
          batcher.submit(b, 0, prompt, counters[1]!).pipe(Effect.tap(() => done.push("b")))
        )
        const decode = yield* Effect.fork(
          batcher.submit(c, 0, tokens(8), counters[2]!).pipe(Effect.tap(() => done.push("c")))
        )
        yield* Effect.yieldNow()
        yield* Deferred.succeed(gate, undefined)
        yield* Fiber.join(held)
        const out = yield* Fiber.join(long)
        yield* Fiber.join(decode)
        const bCalls = calls.filter((r) => r.sessions.includes(b))
        assert.deepStrictEqual(
          bCalls.map((r) => r.startPos[r.sessions.indexOf(b)]),
          [0, 4, 8]
        )
        assert.deepStrictEqual(
          bCalls.map((r) => r.lengths[r.sessions.indexOf(b)]),
          [4, 4, 2]
        )
        assert.deepStrictEqual(bCalls[0]!.sessions, [c, b], "the decode step rides with the first chunk")
        assert.deepStrictEqual(done, ["c", "b"])
        for (const r of calls)
          assert.isAtMost(
            r.lengths.reduce((sum, n) => sum + n, 0),
            5
          )
        assert.deepStrictEqual(out, yield* twins[1]!.forward(0, prompt))
        assert.strictEqual(counters[1]!.prefillChunks, 3)
      }).pipe(Effect.provide(layer))
    })
  )

  // One run's bad input fails that run only: nothing of the batch ran, the others run in the next micro-batch.
  it.scoped("faults stay per sequence: a rejected item fails only its caller", () =>
    Effect.gen(function* () {
      const gate = yield* Deferred.make<void>()
      const { calls, layer } = recordingExecutor(gate)
      yield* Effect.gen(function* () {
        const batcher = yield* makeStageBatcher({})
        const { sessions, twins } = yield* setup(3, true)
        const held = yield* Effect.fork(batcher.submit(sessions[0]!, 0, tokens(1), emptyBatchCounters()))
        while (calls.length === 0) yield* Effect.yieldNow()
        const fibers = yield* Effect.forEach(
          [
            batcher.submit(sessions[1]!, 0, tokens(2, 3), emptyBatchCounters()),
            batcher.submit(sessions[2]!, 0, tokens(9999), emptyBatchCounters()) // outside the vocabulary
          ],
          (e) => Effect.fork(Effect.exit(e))
        )
        yield* Effect.yieldNow()
        yield* Deferred.succeed(gate, undefined)
        yield* Fiber.join(held)
        const [ok, rejected] = yield* Effect.forEach(fibers, Fiber.join)
        assert.deepStrictEqual(ok, Exit.succeed(yield* twins[1]!.forward(0, tokens(2, 3))))
        assert.isTrue(
          rejected !== undefined && Exit.isFailure(rejected) && JSON.stringify(rejected).includes("InvalidStageInput")
        )
        assert.deepStrictEqual(
          calls.slice(1).map((r) => r.sessions),
          [[sessions[2]!, sessions[1]!], [sessions[1]!]]
        )
      }).pipe(Effect.provide(layer))
    })
  )

  // When a batched computation fails, every item is retried alone: only the culprit fails.
  it.scoped("faults stay per sequence: a failing batched computation is retried item by item", () =>
    Effect.gen(function* () {
      const gate = yield* Deferred.make<void>()
      const poisoned = new Set<StageSession>()
      const { calls, layer } = recordingExecutor(gate, poisoned)
      yield* Effect.gen(function* () {
        const batcher = yield* makeStageBatcher({})
        const { sessions, twins } = yield* setup(3, true)
        poisoned.add(sessions[2]!)
        const held = yield* Effect.fork(batcher.submit(sessions[0]!, 0, tokens(1), emptyBatchCounters()))
        while (calls.length === 0) yield* Effect.yieldNow()
        const fibers = yield* Effect.forEach(
          [
            batcher.submit(sessions[1]!, 0, tokens(2, 3), emptyBatchCounters()),
            batcher.submit(sessions[2]!, 0, tokens(4), emptyBatchCounters())
          ],
          (e) => Effect.fork(Effect.exit(e))
        )
        yield* Effect.yieldNow()
        yield* Deferred.succeed(gate, undefined)
        yield* Fiber.join(held)
        const [ok, failed] = yield* Effect.forEach(fibers, Fiber.join)
        assert.deepStrictEqual(ok, Exit.succeed(yield* twins[1]!.forward(0, tokens(2, 3))))
        assert.isTrue(failed !== undefined && Exit.isFailure(failed) && JSON.stringify(failed).includes("injected"))
        assert.deepStrictEqual(
          calls.slice(1).map((r) => r.sessions.length),
          [2, 1, 1]
        )
      }).pipe(Effect.provide(layer))
    })
  )

  // A caller interrupted while its work waits (its run stopped) is dropped before it runs.
  it.scoped("an interrupted caller's pending work never runs", () =>
    Effect.gen(function* () {
      const gate = yield* Deferred.make<void>()
      const { calls, layer } = recordingExecutor(gate)
      yield* Effect.gen(function* () {
        const batcher = yield* makeStageBatcher({})
        const { sessions } = yield* setup(3, true)
        const held = yield* Effect.fork(batcher.submit(sessions[0]!, 0, tokens(1), emptyBatchCounters()))
        while (calls.length === 0) yield* Effect.yieldNow()
        const gone = yield* Effect.fork(batcher.submit(sessions[1]!, 0, tokens(2), emptyBatchCounters()))
        const kept = yield* Effect.fork(batcher.submit(sessions[2]!, 0, tokens(3), emptyBatchCounters()))
        yield* Effect.yieldNow()
        yield* Fiber.interrupt(gone)
        yield* Deferred.succeed(gate, undefined)
        yield* Fiber.join(held)
        yield* Fiber.join(kept)
        assert.isFalse(calls.some((r) => r.sessions.includes(sessions[1]!)))
        assert.isTrue(calls.some((r) => r.sessions.includes(sessions[2]!)))
      }).pipe(Effect.provide(layer))
    })
  )

  // Four sequences decoding through a 2-stage pipeline: micro-batches of ceil(4 / 2) = 2 decode steps, so that
  // while one group is on this stage the other can be on the next. Alone in a 1-stage pipeline they travel as one.
  for (const [stages, expected] of [
    [2, [[1, 2], [3]]],
    [1, [[1, 2, 3]]]
  ] as const) {
    it.scoped(`${stages} pipeline stage(s): at most ceil(decoding / stages) decode steps per micro-batch`, () =>
      Effect.gen(function* () {
        const gate = yield* Deferred.make<void>()
        const { calls, layer } = recordingExecutor(gate)
        yield* Effect.gen(function* () {
          const batcher = yield* makeStageBatcher({ maxRows: 64 })
          const { sessions, twins } = yield* setup(4, true)
          const held = yield* Effect.fork(batcher.submit(sessions[0]!, 0, tokens(1), emptyBatchCounters(), stages))
          while (calls.length === 0) yield* Effect.yieldNow()
          const rest = yield* Effect.forEach([1, 2, 3], (i) =>
            Effect.fork(batcher.submit(sessions[i]!, 0, tokens(i + 1), emptyBatchCounters(), stages))
          )
          yield* Effect.yieldNow()
          yield* Deferred.succeed(gate, undefined)
          yield* Fiber.join(held)
          const outs = yield* Effect.forEach(rest, Fiber.join)
          assert.deepStrictEqual(
            calls.slice(1).map((r) => r.sessions.map((s) => sessions.indexOf(s))),
            expected.map((g) => [...g])
          )
          assert.deepStrictEqual(outs, yield* Effect.forEach([1, 2, 3], (i) => twins[i]!.forward(0, tokens(i + 1))))
        }).pipe(Effect.provide(layer))
      })
    )
  }

  // Groups stay formed: four sequences decoding on 2 stages form micro-batches of 2. When one of a pair comes back
  // alone, the batcher waits (at most its last decode micro-batch's time) for the other instead of running a
  // one-row step and leaving its partner for the next: without the wait the pairs drift apart into single rows.
  for (const [gatherMillis, expected] of [
    [250, [[0, 1]]],
    [0, [[0], [1]]]
  ] as const) {
    it.live(
      `gatherMillis ${gatherMillis}: a decode step arriving 15 ms after its partner ${gatherMillis > 0 ? "joins it" : "runs on its own"}`,
      () =>
        Effect.gen(function* () {
          const { calls, layer } = slowExecutor(200)
          yield* Effect.gen(function* () {
            const batcher = yield* makeStageBatcher({ maxRows: 64, gatherMillis })
            const { sessions } = yield* setup(4, true)
            const step = (i: number, pos: number) =>
              batcher.submit(sessions[i]!, pos, tokens(i + 1), emptyBatchCounters(), 2)
            // one round of all four: micro-batches of 2 (measures a decode micro-batch: ~200 ms)
            yield* Effect.forEach([0, 1, 2, 3], (i) => step(i, 0), { concurrency: "unbounded" })
            const before = calls.length
            const a = yield* Effect.fork(step(0, 1))
            yield* Effect.sleep("15 millis")
            const b = yield* Effect.fork(step(1, 1))
            yield* Fiber.join(a)
            yield* Fiber.join(b)
            assert.deepStrictEqual(
              calls.slice(before).map((c) => c.map((s) => sessions.indexOf(s))),
              expected.map((g) => [...g])
            )
          }).pipe(Effect.scoped, Effect.provide(layer))
        })
    )
  }

  // Requests sent together prefill together: a prompt that wakes an idle first stage waits (at most
  // promptGatherMillis) for the prompts of the sessions opened beside it (here 5 ms apart), so all three share one
  // micro-batch and then decode in step. Sessions nobody expects are not waited for. Sessions not opened yet are
  // waited for when the first one's `expect` announced them (`arriving`: the server's requests still on their way).
  const gatherCases = [
    [100, true, 0, [[0, 1, 2]]],
    [0, true, 0, [[0], [1, 2]]],
    [100, false, 0, [[0], [1, 2]]],
    [100, false, 2, [[0, 1, 2]]],
    [100, false, 1, [[0, 1], [2]]]
  ] as const
  for (const [promptGatherMillis, announced, arriving, expected] of gatherCases) {
    it.live(
      `promptGatherMillis ${promptGatherMillis}, sessions ${announced ? "expected" : "not expected"}, ${arriving} announced as arriving: three prompts sent 5 ms apart ${expected.length === 1 ? "prefill in one micro-batch" : "split"}`,
      () =>
        Effect.gen(function* () {
          const { calls, layer } = slowExecutor(100)
          yield* Effect.gen(function* () {
            const batcher = yield* makeStageBatcher({ maxRows: 64, promptGatherMillis })
            const { sessions } = yield* setup(3, true)
            if (announced) yield* Effect.forEach(sessions, (session) => batcher.expect(session))
            else if (arriving > 0) yield* batcher.expect(sessions[0]!, arriving)
            const fibers = []
            for (const i of [0, 1, 2]) {
              fibers.push(
                yield* Effect.fork(batcher.submit(sessions[i]!, 0, tokens(i + 1, 7, 9), emptyBatchCounters(), 2))
              )
              yield* Effect.sleep("5 millis")
            }
            yield* Effect.forEach(fibers, Fiber.join)
            assert.deepStrictEqual(
              calls.map((c) => c.map((s) => sessions.indexOf(s))),
              expected.map((g) => [...g])
            )
          }).pipe(Effect.scoped, Effect.provide(layer))
        })
    )
  }

  // Nothing due, no wait: a lone prompt (its own session opened, nothing else opened or announced) starts at once,
  // with no timer in its way (the fastest of 5 lone prompts, so a busy machine's hiccup does not decide it); an
  // opened session whose prompt never comes holds it for promptGatherMillis.
  it.live("a lone prompt, no other session opened or announced: its micro-batch starts at once", () =>
    Effect.gen(function* () {
      const { calls, layer } = slowExecutor(1)
      yield* Effect.gen(function* () {
        const batcher = yield* makeStageBatcher({ promptGatherMillis: 1000 })
        const { sessions } = yield* setup(5, true)
        const waits: Array<number> = []
        for (const session of sessions) {
          yield* Effect.scoped(
            Effect.gen(function* () {
              yield* batcher.expect(session)
              const start = performance.now()
              yield* batcher.submit(session, 0, tokens(1, 7, 9), emptyBatchCounters(), 2)
              waits.push(performance.now() - start)
            })
          )
        }
        assert.strictEqual(calls.length, 5)
        assert.isBelow(Math.min(...waits), 10, `waited ${waits.map((w) => w.toFixed(1)).join(", ")} ms`)
      }).pipe(Effect.scoped, Effect.provide(layer))
    })
  )

  it.live("a lone prompt, another session opened: its micro-batch starts after promptGatherMillis (1000 ms)", () =>
    Effect.gen(function* () {
      const { calls, layer } = slowExecutor(1)
      yield* Effect.gen(function* () {
        const batcher = yield* makeStageBatcher({ promptGatherMillis: 1000 })
        const { sessions } = yield* setup(2, true)
        yield* batcher.expect(sessions[1]!)
        const start = performance.now()
        yield* batcher.submit(sessions[0]!, 0, tokens(1, 7, 9), emptyBatchCounters(), 2)
        const waited = performance.now() - start
        assert.strictEqual(calls.length, 1)
        assert.isAtLeast(waited, 900, `waited ${waited} ms`)
        assert.isBelow(waited, 5000, `waited ${waited} ms`)
      }).pipe(Effect.scoped, Effect.provide(layer))
    })
  )

  // The prompt gather re-reads what it waits for: a session announced by the first one's `expect` and opened during
  // the gather is waited for; its prompt 80 ms later shares the micro-batch. Unannounced, the first runs alone.
  for (const arriving of [1, 0]) {
    it.live(
      `a session ${arriving > 0 ? "announced" : "not announced"} and opened 10 ms into the first prompt's gather: ${arriving > 0 ? "its prompt, 80 ms later, shares the micro-batch" : "the first prompt runs alone"}`,
      () =>
        Effect.gen(function* () {
          const { calls, layer } = slowExecutor(5)
          yield* Effect.gen(function* () {
            const batcher = yield* makeStageBatcher({ promptGatherMillis: 1000 })
            const { sessions } = yield* setup(2, true)
            yield* batcher.expect(sessions[0]!, arriving)
            const first = yield* Effect.fork(batcher.submit(sessions[0]!, 0, tokens(1, 7), emptyBatchCounters(), 2))
            yield* Effect.sleep("10 millis")
            yield* batcher.expect(sessions[1]!)
            yield* Effect.sleep("70 millis")
            yield* batcher.submit(sessions[1]!, 0, tokens(2, 7), emptyBatchCounters(), 2)
            yield* Fiber.join(first)
            assert.deepStrictEqual(
              calls.map((c) => c.map((s) => sessions.indexOf(s))),
              arriving > 0 ? [[0, 1]] : [[0], [1]]
            )
          }).pipe(Effect.scoped, Effect.provide(layer))
        })
    )
  }

  // An announcement that does not come true holds one gather (at most promptGatherMillis), then is forgotten: the
  // next lone prompt does not wait for it.
  it.live("announced sessions that never open hold the first prompt at most promptGatherMillis, and no later one", () =>
    Effect.gen(function* () {
      const { calls, layer } = slowExecutor(1)
      yield* Effect.gen(function* () {
        const batcher = yield* makeStageBatcher({ promptGatherMillis: 300 })
        const { sessions } = yield* setup(2, true)
        yield* batcher.expect(sessions[0]!, 2)
        let start = performance.now()
        yield* batcher.submit(sessions[0]!, 0, tokens(1, 7), emptyBatchCounters(), 2)
        const first = performance.now() - start
        start = performance.now()
        yield* batcher.submit(sessions[1]!, 0, tokens(2, 7), emptyBatchCounters(), 2)
        const second = performance.now() - start
        assert.strictEqual(calls.length, 2)
        assert.isAtLeast(first, 250, `first waited ${first} ms`)
        assert.isBelow(first, 3000, `first waited ${first} ms`)
        assert.isBelow(second, 200, `second waited ${second} ms`)
      }).pipe(Effect.scoped, Effect.provide(layer))
    })
  )

  it.live("a decode step that arrives during a prompt's gather ends the wait: both run at once", () =>
    Effect.gen(function* () {
      const { calls, layer } = slowExecutor(5)
      yield* Effect.gen(function* () {
        const batcher = yield* makeStageBatcher({ promptGatherMillis: 2000 })
        const { sessions } = yield* setup(3, true)
        yield* batcher.expect(sessions[1]!) // never submits: the prompt alone would wait 2000 ms
        const start = performance.now()
        const prompt = yield* Effect.fork(batcher.submit(sessions[0]!, 0, tokens(1, 7), emptyBatchCounters(), 2))
        yield* Effect.sleep("20 millis")
        yield* batcher.submit(sessions[2]!, 0, tokens(3), emptyBatchCounters(), 2)
        yield* Fiber.join(prompt)
        const waited = performance.now() - start
        assert.deepStrictEqual(
          calls.map((c) => c.map((s) => sessions.indexOf(s))),
          [[2, 0]]
        )
        assert.isBelow(waited, 1000, `waited ${waited} ms`)
      }).pipe(Effect.scoped, Effect.provide(layer))
    })
  )

  // A later stage gathers too: the activations of prompts that stage 0 prefilled together reach it a few ms apart
  // (measured: within 10 ms), and its sessions were all opened at provisioning, so it waits only for those.
  const laterCases = [
    [true, [[0, 1, 2]]],
    [false, [[0], [1, 2]]]
  ] as const
  for (const [announced, expected] of laterCases) {
    it.live(
      `a later stage, sessions ${announced ? "expected" : "not expected"}: three prompt activations sent 5 ms apart ${expected.length === 1 ? "prefill in one micro-batch" : "split"}`,
      () =>
        Effect.gen(function* () {
          const { calls, layer } = slowExecutor(100)
          yield* Effect.gen(function* () {
            const batcher = yield* makeStageBatcher({ maxRows: 64, promptGatherMillis: 100 })
            const { sessions } = yield* setup(3, true, false)
            if (announced) yield* Effect.forEach(sessions, (session) => batcher.expect(session))
            const fibers = []
            for (const i of [0, 1, 2]) {
              fibers.push(
                yield* Effect.fork(batcher.submit(sessions[i]!, 0, hidden(i + 1, 3), emptyBatchCounters(), 2))
              )
              yield* Effect.sleep("5 millis")
            }
            yield* Effect.forEach(fibers, Fiber.join)
            assert.deepStrictEqual(
              calls.map((c) => c.map((s) => sessions.indexOf(s))),
              expected.map((g) => [...g])
            )
          }).pipe(Effect.scoped, Effect.provide(layer))
        })
    )
  }

  // Sequences that prefilled together decode in groups from their first step: a finished prompt counts its session
  // among the decoders, so the first decode step that arrives waits for its partner instead of running alone.
  it.live("after prompts that prefilled together, the first decode steps (5 ms apart, 2 stages) go in pairs", () =>
    Effect.gen(function* () {
      const { calls, layer } = slowExecutor(60)
      yield* Effect.gen(function* () {
        const batcher = yield* makeStageBatcher({ maxRows: 64, promptGatherMillis: 0, activeWindowMillis: 100 })
        const { sessions } = yield* setup(5, true)
        // a decode-only micro-batch first (the gather wait is bounded by its time), then that decoder goes silent
        yield* batcher.submit(sessions[4]!, 0, tokens(5), emptyBatchCounters(), 2)
        yield* Effect.sleep("150 millis")
        yield* Effect.forEach(
          [0, 1, 2, 3],
          (i) => batcher.submit(sessions[i]!, 0, tokens(i + 1, 7), emptyBatchCounters(), 2),
          {
            concurrency: "unbounded"
          }
        )
        const before = calls.length
        const fibers = []
        for (const i of [0, 1, 2, 3]) {
          fibers.push(yield* Effect.fork(batcher.submit(sessions[i]!, 2, tokens(i + 1), emptyBatchCounters(), 2)))
          yield* Effect.sleep("5 millis")
        }
        yield* Effect.forEach(fibers, Fiber.join)
        assert.deepStrictEqual(
          calls.slice(0, before).map((c) => c.map((s) => sessions.indexOf(s))),
          [[4], [0, 1, 2, 3]]
        )
        assert.deepStrictEqual(
          calls.slice(before).map((c) => c.map((s) => sessions.indexOf(s))),
          [
            [0, 1],
            [2, 3]
          ]
        )
      }).pipe(Effect.scoped, Effect.provide(layer))
    })
  )

  // A burst of prompts beside running decode steps is spread out: the first chunk always joins (no prompt starves),
  // more only within promptRowsBesideDecode rows, so the decoding sequence's next token does not wait for all of it.
  it.scoped(
    "beside a decode step: the first prompt chunk plus prompt rows up to promptRowsBesideDecode; the rest next",
    () =>
      Effect.gen(function* () {
        const gate = yield* Deferred.make<void>()
        const { calls, layer } = recordingExecutor(gate)
        yield* Effect.gen(function* () {
          const batcher = yield* makeStageBatcher({ maxRows: 64, promptRowsBesideDecode: 16 })
          const { sessions } = yield* setup(5, true)
          const eight = (k: number) => tokens(...Array.from({ length: 8 }, (_, i) => k + i))
          const held = yield* Effect.fork(batcher.submit(sessions[4]!, 0, eight(40), emptyBatchCounters()))
          while (calls.length === 0) yield* Effect.yieldNow()
          const decode = yield* Effect.fork(batcher.submit(sessions[0]!, 0, tokens(1), emptyBatchCounters()))
          const prompts = yield* Effect.forEach([1, 2, 3], (i) =>
            Effect.fork(batcher.submit(sessions[i]!, 0, eight(10 * i), emptyBatchCounters()))
          )
          yield* Effect.yieldNow()
          yield* Deferred.succeed(gate, undefined)
          yield* Fiber.join(held)
          yield* Fiber.join(decode)
          yield* Effect.forEach(prompts, Fiber.join)
          assert.deepStrictEqual(
            calls.slice(1).map((r) => ({ seqs: r.sessions.map((x) => sessions.indexOf(x)), lengths: r.lengths })),
            [
              { seqs: [0, 1, 2], lengths: [1, 8, 8] },
              { seqs: [3], lengths: [8] }
            ]
          )
        }).pipe(Effect.provide(layer))
      })
  )
})
