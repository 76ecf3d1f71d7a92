import { assert, describe, it } from "@effect/vitest"
import { Effect, Exit } from "effect"
import { defaultTestModel, testModelGreedy } from "../../src/layers/engine/StageExecutorTest.js"
import * as StageExecutorTest from "../../src/layers/engine/StageExecutorTest.js"
import { greedy } from "../../src/services/Sampler.js"
import { openInProcessPipeline } from "../../src/services/InProcessPipeline.js"
import { StageExecutor } from "../../src/services/StageExecutor.js"

const model = defaultTestModel
const path = "test-model.gguf"

const pipeline = (boundaries: ReadonlyArray<number>) => openInProcessPipeline(path, boundaries)

const generate = (boundaries: ReadonlyArray<number>, prompt: ReadonlyArray<number>, max: number) =>
  Effect.gen(function* () {
    const { run } = yield* pipeline(boundaries)
    const out: Array<number> = []
    let logits = yield* run(0, prompt)
    let pos = prompt.length
    while (out.length < max) {
      const t = greedy(logits)
      out.push(t)
      if (t === model.eosTokenId) break
      logits = yield* run(pos++, [t])
    }
    return out
  })

describe("StageExecutorTest (deterministic double)", () => {
  // The double's stream is the documented formula, the same for every split.
  it.scoped("every split yields testModelGreedy's tokens", () =>
    Effect.gen(function* () {
      const prompt = [1, 5, 9]
      const expected = testModelGreedy(model, prompt, 24)
      assert.isAtLeast(new Set(expected).size, 5)
      for (const split of [
        [0, 6],
        [0, 3, 6],
        [0, 1, 2, 6],
        [0, 1, 2, 3, 4, 5, 6]
      ]) {
        assert.deepStrictEqual(yield* generate(split, prompt, 24), expected)
      }
    }).pipe(Effect.provide(StageExecutorTest.layer))
  )

  it.scoped("reset forgets the cache; a gap, a wrong input kind and an overflow are typed errors", () =>
    Effect.gen(function* () {
      const { run, sessions } = yield* pipeline([0, 2, 6])
      const a = yield* run(0, [1, 7])
      yield* Effect.forEach(sessions, (s) => s.reset)
      assert.deepStrictEqual(yield* run(0, [1, 7]), a)
      const gap = yield* Effect.exit(sessions[0]!.forward(5, { _tag: "Tokens", tokens: Int32Array.of(3) }))
      assert.isTrue(Exit.isFailure(gap) && JSON.stringify(gap).includes("InvalidStageInput"))
      const kind = yield* Effect.exit(sessions[1]!.forward(0, { _tag: "Tokens", tokens: Int32Array.of(3) }))
      assert.isTrue(Exit.isFailure(kind) && JSON.stringify(kind).includes("InvalidStageInput"))
      const over = yield* Effect.exit(
        sessions[0]!.forward(2, { _tag: "Tokens", tokens: new Int32Array(model.contextLength) })
      )
      assert.isTrue(Exit.isFailure(over) && JSON.stringify(over).includes("ContextOverflow"))
    }).pipe(Effect.provide(StageExecutorTest.layer))
  )

  // The double's forwardBatch checks like the live one (whole batch, then each item with its index) and otherwise
  // gives each item what a lone forward gives.
  it.scoped("forwardBatch: lone outputs per item; empty, duplicate, two stages and a bad item are typed errors", () =>
    Effect.gen(function* () {
      const executor = yield* StageExecutor
      const load = (end: number) =>
        executor.load({ path, layerStart: 0, layerEndExclusive: end, isFirst: true, isLast: end === 6 })
      const whole = yield* load(6)
      const [a, b, twinA, twinB] = yield* Effect.forEach([0, 1, 2, 3], () => executor.session(whole))
      const other = yield* executor.session(yield* load(3))
      const tokens = (...t: Array<number>) => ({ _tag: "Tokens", tokens: Int32Array.from(t) }) as const
      const outs = yield* executor.forwardBatch([
        { session: a!, startPos: 0, input: tokens(1, 5) },
        { session: b!, startPos: 0, input: tokens(9) }
      ])
      assert.deepStrictEqual(outs, [yield* twinA!.forward(0, tokens(1, 5)), yield* twinB!.forward(0, tokens(9))])
      const tagOf = (exit: Exit.Exit<unknown, { readonly _tag: string }>) =>
        Exit.isFailure(exit) && exit.cause._tag === "Fail" ? exit.cause.error._tag : "no failure"
      const item = { session: a!, startPos: 2, input: tokens(3) }
      assert.strictEqual(tagOf(yield* Effect.exit(executor.forwardBatch([]))), "InvalidBatch")
      assert.strictEqual(tagOf(yield* Effect.exit(executor.forwardBatch([item, item]))), "InvalidBatch")
      assert.strictEqual(
        tagOf(yield* Effect.exit(executor.forwardBatch([item, { session: other, startPos: 0, input: tokens(3) }]))),
        "InvalidBatch"
      )
      const bad = yield* Effect.exit(
        executor.forwardBatch([item, { session: b!, startPos: 1, input: tokens(model.vocabSize) }])
      )
      assert.isTrue(Exit.isFailure(bad) && JSON.stringify(bad).includes('"index":1'))
      // nothing ran: a still holds 2 positions (3 would be a gap) and continues at 2 as its twin does
      assert.strictEqual(
        tagOf(yield* Effect.exit(executor.forwardBatch([{ session: a!, startPos: 3, input: tokens(3) }]))),
        "BatchItemRejected"
      )
      assert.deepStrictEqual(yield* executor.forwardBatch([item]), [yield* twinA!.forward(2, tokens(3))])
    }).pipe(Effect.provide(StageExecutorTest.layer))
  )
})
