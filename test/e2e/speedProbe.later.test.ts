// `--speed-probe after-ready` (local agents of `swactor run`): the agent is ready before its speed probe has run;
// capacity reports no speed until then, and the measured speed once the probe is done.
import { assert, describe, it } from "@effect/vitest"
import { Chunk, Effect, Stream } from "effect"
import { run } from "../../src/api/generate.js"
import { startAgents } from "../support/e2e.js"
import { requireModel } from "../support/models.js"
import { until } from "../support/until.js"

describe("speed probe after ready", () => {
  it.live(
    "an agent started with --speed-probe after-ready reports a measured speed once the probe has run",
    () =>
      Effect.gen(function* () {
        const model = requireModel("stories260K.gguf")
        const { layer } = yield* startAgents(1, { extraArgs: () => ["--speed-probe", "after-ready"] })
        const reported = run({
          model,
          prompt: "Once upon a time",
          stages: 1,
          maxTokens: 1,
          threads: 1,
          dryRun: true
        }).pipe(
          Stream.runCollect,
          Effect.map((updates) => {
            const pool = Chunk.toReadonlyArray(updates).find((u) => u._tag === "PoolReady")
            return pool?._tag === "PoolReady" ? pool.capacity[0]?.capacity : undefined
          }),
          Effect.provide(layer)
        )
        const capacity = yield* until("the speed probe to report", reported, (c) => {
          // before the probe ends: no speed at all (placement's default), never a made-up one
          if (c?.speedSource === undefined) assert.isUndefined(c?.speedBytesPerSecond)
          return c?.speedSource !== undefined
        })
        assert.strictEqual(capacity?.speedSource, "measured")
        assert.isAbove(capacity?.speedBytesPerSecond ?? 0, 1e7)
      }).pipe(Effect.scoped),
    60_000
  )
})
