// serve's KV admission after the pipeline shrinks: a recovery onto fewer stages puts more blocks on each, so each
// request's KV bytes per stage, the default budget and the reservations follow the new shape.
import { assert, describe, it } from "@effect/vitest"
import { Chunk, Context, Effect, Fiber, Layer, Stream } from "effect"
import * as MembershipLive from "../../src/layers/agent/MembershipLive.js"
import { makeMemoryWorld } from "../../src/layers/agent/AgentLinksTest.js"
import * as StageExecutorTest from "../../src/layers/engine/StageExecutorTest.js"
import * as ModelCatalogLive from "../../src/layers/gguf/ModelCatalogLive.js"
import * as TokenizerLive from "../../src/layers/gguf/TokenizerLive.js"
import * as OrchestratorLive from "../../src/layers/orchestrator/OrchestratorLive.js"
import * as ServerLive from "../../src/layers/server/ServerLive.js"
import { Server, type ServerMetrics, type ServeOptions } from "../../src/services/Server.js"
import { StageExecutor } from "../../src/services/StageExecutor.js"
import { requireModel, storiesTestModel as testModel } from "../support/models.js"

/** The test engine, each forward 5 ms slower (so requests overlap a kill). */
const slowExecutor = () => {
  const base = StageExecutorTest.make(testModel)
  return Layer.succeed(StageExecutor, {
    load: base.load,
    session: base.session,
    forwardBatch: (items) => Effect.delay(base.forwardBatch(items), 5)
  })
}

/** Two agents, two stages of the 5 blocks ([0, 3) and [3, 5)): 3 blocks on the heaviest stage. */
const world = (options: Partial<ServeOptions> = {}) =>
  Effect.gen(function* () {
    const memory = yield* makeMemoryWorld(2).pipe(Effect.provide(slowExecutor()))
    const server = yield* Layer.build(
      ServerLive.layer({ model: requireModel("stories260K.gguf"), stages: 2, ...options }).pipe(
        Layer.provide(OrchestratorLive.layer),
        Layer.provide(
          Layer.mergeAll(memory.layer, TokenizerLive.layerTest, MembershipLive.layer, ModelCatalogLive.layer)
        )
      )
    ).pipe(Effect.map(Context.get(Server)))
    yield* server.ready
    return { memory, server }
  })

// 17 prompt tokens + 200: a 256-token context, no EOS before 230 tokens.
const long = { prompt: "Once upon a time", maxTokens: 200 }

/** Polls the server's metrics until `check` holds (or 20 s pass): whether it held, and the last metrics seen. */
const metricsUntil = (server: Context.Tag.Service<typeof Server>, check: (m: ServerMetrics) => boolean) =>
  Effect.gen(function* () {
    const until = Date.now() + 20_000
    while (true) {
      const metrics = yield* server.metrics
      if (check(metrics) || Date.now() > until) return { held: check(metrics), metrics }
      yield* Effect.sleep("20 millis")
    }
  })

describe("serve: KV admission after the pipeline shrinks", () => {
  // A request's KV on the heaviest stage: 3 blocks while two stages run, 5 once a recovery left one stage. With an
  // explicit budget of two 3-block sequences, two requests ran at once before the shrink; after it one reservation
  // is 5/3 as large, so a second request waits (Queued) until the first ends. The default budget (parallel
  // sequences of the model's context on the heaviest stage) grows by the same 5/3.
  it.live(
    "after a recovery onto fewer stages, reservations and the budget follow the new blocks per stage",
    () =>
      Effect.gen(function* () {
        // The default budget, and one request's 3-block reservation.
        const probe = yield* world({ parallel: 2 })
        const budget3 = (yield* probe.server.metrics).kvBudgetBytes
        const probeRun = yield* Stream.runDrain(probe.server.generate(long)).pipe(Effect.fork)
        const before = yield* metricsUntil(probe.server, (m) => m.kvReservedBytes > 0)
        const perSequence3 = before.metrics.kvReservedBytes
        yield* probe.memory.agents[1]!.kill
        const shrunk = yield* metricsUntil(probe.server, (m) => m.recoveries === 1)
        assert.isTrue(shrunk.held, "the request recovers")
        assert.strictEqual(shrunk.metrics.kvReservedBytes, (perSequence3 / 3) * 5)
        assert.strictEqual(shrunk.metrics.kvBudgetBytes, (budget3 / 3) * 5)
        yield* Fiber.join(probeRun)

        // An explicit budget of two 3-block sequences.
        const { memory, server } = yield* world({ parallel: 8, kvBudgetBytes: 2 * perSequence3 })
        const pair = yield* Effect.forEach([1, 2], () => Stream.runCollect(server.generate(long)).pipe(Effect.fork))
        const both = yield* metricsUntil(server, (m) => m.inFlight === 2)
        assert.isTrue(both.held, "two 3-block requests run at once")
        assert.strictEqual(both.metrics.queued, 0)
        yield* Effect.forEach(pair, Fiber.join)

        const first = yield* Stream.runCollect(server.generate(long)).pipe(Effect.fork)
        yield* metricsUntil(server, (m) => m.inFlight === 1)
        yield* memory.agents[1]!.kill
        const recovered = yield* metricsUntil(server, (m) => m.recoveries === 1)
        assert.isTrue(recovered.held)
        assert.strictEqual(recovered.metrics.kvReservedBytes, (perSequence3 / 3) * 5)
        assert.strictEqual(recovered.metrics.kvBudgetBytes, 2 * perSequence3)
        const second = yield* Stream.runCollect(server.generate(long)).pipe(Effect.fork)
        const waiting = yield* metricsUntil(server, (m) => m.queued === 1)
        assert.isTrue(waiting.held, "the second request waits for the first")
        assert.strictEqual(waiting.metrics.inFlight, 1)
        yield* Fiber.join(first)
        const events = Chunk.toReadonlyArray(yield* Fiber.join(second))
        assert.strictEqual(events[0]?._tag, "Queued")
        assert.strictEqual(events.at(-1)?._tag, "Done")

        // A budget of one 3-block sequence: after the shrink a waiting request can never fit; it is refused (not left
        // queued forever), and so is a new one, while the running one finishes.
        const tight = yield* world({ parallel: 8, kvBudgetBytes: perSequence3 })
        const running = yield* Stream.runCollect(tight.server.generate(long)).pipe(Effect.fork)
        yield* metricsUntil(tight.server, (m) => m.inFlight === 1)
        const queued = yield* Stream.runCollect(tight.server.generate(long)).pipe(Effect.either, Effect.fork)
        yield* metricsUntil(tight.server, (m) => m.queued === 1)
        yield* tight.memory.agents[1]!.kill
        const refused = yield* Fiber.join(queued)
        assert.isTrue(refused._tag === "Left" && refused.left._tag === "BadServeRequest", JSON.stringify(refused))
        assert.match(
          refused._tag === "Left" ? refused.left.message : "",
          /context too long: 256 tokens need \d+ bytes of KV cache per stage/
        )
        const fresh = yield* Effect.flip(Stream.runDrain(tight.server.generate(long)))
        assert.strictEqual(fresh._tag, "BadServeRequest")
        assert.strictEqual(Chunk.toReadonlyArray(yield* Fiber.join(running)).at(-1)?._tag, "Done")
      }).pipe(Effect.scoped),
    120_000
  )
})
