// bench:cluster's throttled agent (SWACTOR_BENCH_SLOWDOWN): a StageExecutor stretched to k times its forward time,
// sleeping instead of computing, and passing load/session through unchanged.
import { assert, describe, it } from "@effect/vitest"
import { Effect, Layer } from "effect"
import type { StageInfo } from "../../src/domain/engine.js"
import { agentHooks } from "../../src/layers/config/Settings.js"
import { layerSlowed } from "../../src/layers/engine/StageExecutorSlowed.js"
import { StageExecutor } from "../../src/services/StageExecutor.js"

const info = { layerStart: 0 } as unknown as StageInfo
const FORWARD_MS = 40

/** An executor whose batched forward takes FORWARD_MS of wall time and counts its calls. */
const timed = (calls: { n: number }) =>
  Layer.succeed(
    StageExecutor,
    StageExecutor.of({
      load: () => Effect.succeed({ info }),
      session: () => Effect.succeed({ info, forward: () => Effect.die("unused"), reset: Effect.void }),
      forwardBatch: () =>
        Effect.sleep(FORWARD_MS).pipe(
          Effect.as([]),
          Effect.tap(() => Effect.sync(() => calls.n++))
        )
    })
  )

describe("slowed stage executor (bench hook)", () => {
  it.live(
    "each batched forward takes k times its own time; load and session pass through",
    () =>
      Effect.gen(function* () {
        const calls = { n: 0 }
        const elapsed = (factor: number) =>
          Effect.gen(function* () {
            const executor = yield* StageExecutor
            const stage = yield* executor.load({} as never)
            assert.strictEqual(stage.info, info)
            const started = performance.now()
            yield* executor.forwardBatch([])
            return performance.now() - started
          }).pipe(
            Effect.scoped,
            Effect.provide(factor === 1 ? timed(calls) : layerSlowed(factor).pipe(Layer.provide(timed(calls))))
          )
        const plain = yield* elapsed(1)
        const slowed = yield* elapsed(3)
        assert.isBelow(plain, 2.5 * FORWARD_MS)
        assert.isAtLeast(slowed, 3 * FORWARD_MS - 5)
        assert.strictEqual(calls.n, 2)
      }),
    20_000
  )

  it("SWACTOR_BENCH_SLOWDOWN: a finite factor above 1, anything else 1", () => {
    for (const [text, factor] of [
      ["3", 3],
      ["1.5", 1.5],
      ["0.5", 1],
      ["x", 1],
      ["Infinity", 1]
    ] as const) {
      assert.strictEqual(agentHooks({ SWACTOR_BENCH_SLOWDOWN: text }).slowdown, factor, text)
    }
    assert.strictEqual(agentHooks({}).slowdown, 1)
  })
})
