import { assert, describe, it } from "@effect/vitest"
import { Effect, Exit } from "effect"
import { defaultTestModel, StageExecutorTest, testModelGreedy } from "../src/layers/StageExecutorTest.js"
import { greedy } from "../src/services/Sampler.js"
import { openInProcessPipeline } from "../src/services/InProcessPipeline.js"

const model = defaultTestModel
const path = "test-model.gguf"

const pipeline = (boundaries: ReadonlyArray<number>) => openInProcessPipeline(path, boundaries)

const generate = (boundaries: ReadonlyArray<number>, prompt: ReadonlyArray<number>, max: number) =>
  Effect.gen(function*() {
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
    Effect.gen(function*() {
      const prompt = [1, 5, 9]
      const expected = testModelGreedy(model, prompt, 24)
      assert.isAtLeast(new Set(expected).size, 5)
      for (const split of [[0, 6], [0, 3, 6], [0, 1, 2, 6], [0, 1, 2, 3, 4, 5, 6]]) {
        assert.deepStrictEqual(yield* generate(split, prompt, 24), expected)
      }
    }).pipe(Effect.provide(StageExecutorTest)))

  it.scoped("reset forgets the cache; a gap, a wrong input kind and an overflow are typed errors", () =>
    Effect.gen(function*() {
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
    }).pipe(Effect.provide(StageExecutorTest)))
})
