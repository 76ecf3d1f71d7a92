import { assert, describe, it } from "@effect/vitest"
import { Effect, Either, Stream } from "effect"
import { makeMemoryWorld } from "../../src/layers/agent/AgentLinksTest.js"
import type { RunUpdate } from "../../src/services/Orchestrator.js"
import { delayedTestExecutor, memoryOrchestrator } from "../support/memoryWorld.js"
import { requireModel } from "../support/models.js"

// A resumed generation replays the tokens it produced one decode step each (so it computes the interrupted run's
// very bits): its prompt takes about as long as those steps took. It gets a token's deadline for each replayed token
// (RunConfig.promptTimeout), so a recovery late in a generation does not time out on its own replay and lose it.

describe("recovery: a late replay within its deadline", () => {
  it.live(
    "killed at token 16 with a 400 ms token deadline: the replay (16 steps x 2 stages x 40 ms) does not time out",
    () =>
      Effect.gen(function* () {
        const memory = yield* makeMemoryWorld(3).pipe(Effect.provide(delayedTestExecutor(40)))
        const orchestrator = yield* memoryOrchestrator(memory)
        const pipeline = yield* orchestrator.pipeline({ model: requireModel("stories260K.gguf"), stages: 2 })
        const request = { prompt: "Once upon a time", maxTokens: 24, tokenTimeout: "400 millis" } as const
        const generate = (killAt?: number) =>
          Effect.gen(function* () {
            const updates: Array<RunUpdate> = []
            let killed = false
            const result = yield* pipeline.run(request).pipe(
              Stream.runForEach((u) =>
                Effect.gen(function* () {
                  updates.push(u)
                  if (killAt !== undefined && !killed && u._tag === "Token" && u.token.step === killAt) {
                    killed = true
                    yield* memory.agents[1]!.kill
                  }
                })
              ),
              Effect.either
            )
            const tokens = updates.flatMap((u) => (u._tag === "Token" && u.token.tokenId >= 0 ? [u.token.tokenId] : []))
            const finished = updates.find((u) => u._tag === "Finished")
            return { result, tokens, summary: finished?._tag === "Finished" ? finished.summary : undefined }
          })
        const reference = yield* generate()
        assert.isTrue(Either.isRight(reference.result), JSON.stringify(reference.result))
        assert.strictEqual(reference.tokens.length, 24)
        const resumed = yield* generate(16)
        assert.isTrue(Either.isRight(resumed.result), JSON.stringify(resumed.result))
        assert.strictEqual(resumed.summary!.recoveries.length, 1)
        assert.strictEqual(resumed.summary!.recoveries[0]!.resumedAt, 17)
        assert.deepStrictEqual(resumed.tokens, reference.tokens)
      }).pipe(Effect.scoped),
    60_000
  )
})
