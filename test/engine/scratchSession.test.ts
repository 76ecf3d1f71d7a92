// A scratch session (the batcher's step-cost probe, SessionOptions.scratch) holds memory like any other, but it is not
// a run's: the agent's tally of open sessions and their bytes (heldSessionBytes, /metrics' swactor_agent_open_sessions)
// leaves it out, so a probe that runs while /metrics is read never shows as a leaked session.
import { assert, describe, it } from "@effect/vitest"
import { Effect, Scope, Exit } from "effect"
import { heldSessionBytes } from "../../src/layers/engine/KvCache.js"
import * as StageExecutorLive from "../../src/layers/engine/StageExecutorLive.js"
import { StageExecutor } from "../../src/services/StageExecutor.js"
import { requireModel } from "../support/models.js"

describe("scratch sessions are left out of the open-session tally", () => {
  it.scoped("a run's session counts (and its bytes) until closed; a scratch session never does", () =>
    Effect.gen(function* () {
      const executor = yield* StageExecutor
      const stage = yield* executor.load({
        path: requireModel("stories260K.gguf"),
        layerStart: 0,
        layerEndExclusive: 5,
        isFirst: true,
        isLast: true
      })
      const before = heldSessionBytes()
      const runScope = yield* Scope.make()
      yield* Scope.extend(executor.session(stage, { contextLength: 64, threads: 1 }), runScope)
      const withRun = heldSessionBytes()
      assert.strictEqual(withRun.sessions, before.sessions + 1)
      assert.isAbove(withRun.cacheBytes, before.cacheBytes)
      const scratchScope = yield* Scope.make()
      const scratch = yield* Scope.extend(
        executor.session(stage, { contextLength: 64, threads: 1, scratch: true }),
        scratchScope
      )
      assert.deepStrictEqual(heldSessionBytes(), withRun)
      // it computes like any session
      const out = yield* scratch.forward(0, { _tag: "Tokens", tokens: Int32Array.of(1, 2) })
      assert.strictEqual(out._tag, "Logits")
      yield* Scope.close(scratchScope, Exit.void)
      assert.deepStrictEqual(heldSessionBytes(), withRun)
      yield* Scope.close(runScope, Exit.void)
      assert.deepStrictEqual(heldSessionBytes(), before)
    }).pipe(Effect.provide(StageExecutorLive.layer))
  )
})
