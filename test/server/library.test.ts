import { assert, describe, it } from "@effect/vitest"
import { Chunk, Context, Effect, Fiber, Layer, Stream } from "effect"
import * as MembershipLive from "../../src/layers/agent/MembershipLive.js"
import * as OrchestratorLive from "../../src/layers/orchestrator/OrchestratorLive.js"
import * as ServerLive from "../../src/layers/server/ServerLive.js"
import * as StageExecutorTest from "../../src/layers/engine/StageExecutorTest.js"
import * as ModelCatalogLive from "../../src/layers/gguf/ModelCatalogLive.js"
import * as TokenizerLive from "../../src/layers/gguf/TokenizerLive.js"
import { makeMemoryWorld } from "../../src/layers/agent/AgentLinksTest.js"
import { Orchestrator } from "../../src/services/Orchestrator.js"
import { Server, type ServeEvent, type ServeOptions } from "../../src/services/Server.js"
import { makeStopMatcher } from "../../src/services/StopText.js"
import { delayedTestExecutor, memoryWorldServices } from "../support/memoryWorld.js"
import { requireModel, storiesTestModel as testModel } from "../support/models.js"
import { until } from "../support/until.js"

const world = (options: Partial<ServeOptions> & { readonly delayMillis?: number } = {}) =>
  Effect.gen(function* () {
    const memory = yield* makeMemoryWorld(2).pipe(Effect.provide(delayedTestExecutor(options.delayMillis ?? 0)))
    const server = yield* Layer.build(
      ServerLive.layer({ model: requireModel("stories260K.gguf"), stages: 2, ...options }).pipe(
        Layer.provide(OrchestratorLive.layer),
        Layer.provide(memoryWorldServices(memory))
      )
    ).pipe(Effect.map(Context.get(Server)))
    yield* server.ready
    return { memory, server }
  })

const promptTokens = (text: string) => [1, ...Array.from(new TextEncoder().encode(text), (b) => b + 3)]
const expected = (prompt: string, maxTokens: number) =>
  StageExecutorTest.testModelGreedy(testModel, promptTokens(prompt), maxTokens).filter((t) => t !== 2)
const textEvents = (events: ReadonlyArray<ServeEvent>) =>
  events.flatMap((e) => (e._tag === "Text" ? [e.text] : [])).join("")
const done = (events: ReadonlyArray<ServeEvent>) => events.find((e) => e._tag === "Done")

describe("Server (library, in-memory agents)", () => {
  // A warm pipeline: each request is its own run on the same agents (one provision per stage per run), and
  // concurrent requests each get the tokens of their request served alone.
  it.live("requests one after another and at once give each request's own tokens", () =>
    Effect.gen(function* () {
      const { memory, server } = yield* world({ parallel: 4 })
      const prompts = ["Once upon a time", "A dog", "The sea was", "Tom"]
      const alone = []
      for (const prompt of prompts) {
        alone.push(Chunk.toReadonlyArray(yield* Stream.runCollect(server.generate({ prompt, maxTokens: 10 }))))
      }
      const together = yield* Effect.forEach(
        prompts,
        (prompt) =>
          Stream.runCollect(server.generate({ prompt, maxTokens: 10 })).pipe(Effect.map(Chunk.toReadonlyArray)),
        {
          concurrency: "unbounded"
        }
      )
      for (let i = 0; i < prompts.length; i++) {
        assert.deepStrictEqual(textEvents(together[i]!), textEvents(alone[i]!))
        const count = done(alone[i]!)
        assert.strictEqual(count?._tag === "Done" ? count.completionTokens : -1, expected(prompts[i]!, 10).length)
      }
      // warm-up + 8 requests, 2 stages each.
      assert.strictEqual(yield* memory.provisions, 2 * (1 + 2 * prompts.length))
      const metrics = yield* server.metrics
      assert.strictEqual(metrics.requests.completed, 8)
      assert.strictEqual(metrics.inFlight, 0)
      assert.strictEqual(metrics.kvReservedBytes, 0)
    }).pipe(Effect.scoped)
  )

  // Beyond `parallel` running requests one waits in the queue; beyond the queue a request is refused (ServerBusy).
  it.live("admission: one runs, one queues, the next is refused; the queued one runs after", () =>
    Effect.gen(function* () {
      const { server } = yield* world({ parallel: 1, queueLimit: 1, delayMillis: 5 })
      const first = yield* Stream.runCollect(server.generate({ prompt: "Once", maxTokens: 40 })).pipe(Effect.fork)
      yield* until("the first request to run", server.metrics, (m) => m.inFlight === 1)
      const second = yield* Stream.runCollect(server.generate({ prompt: "Twice", maxTokens: 4 })).pipe(Effect.fork)
      yield* until("the second request to queue", server.metrics, (m) => m.queued === 1)
      const metrics = yield* server.metrics
      assert.strictEqual(metrics.inFlight, 1)
      assert.strictEqual(metrics.queued, 1)
      const refused = yield* Effect.flip(Stream.runDrain(server.generate({ prompt: "Thrice", maxTokens: 4 })))
      assert.strictEqual(refused._tag, "ServerBusy")
      assert.isTrue(refused._tag === "ServerBusy" && refused.retryAfterSeconds >= 1)
      yield* Fiber.join(first)
      const events = Chunk.toReadonlyArray(yield* Fiber.join(second))
      assert.strictEqual(events[0]?._tag, "Queued")
      const admitted = events[1]
      assert.isTrue(admitted?._tag === "Admitted" && admitted.queuedMillis > 50)
      assert.strictEqual((yield* server.metrics).requests.refused, 1)
    }).pipe(Effect.scoped)
  )

  // The KV budget, not only `parallel`, decides how many run: with room for two sequences' KV, a third waits.
  it.live("admission by KV bytes: a budget of two sequences runs two and queues the third", () =>
    Effect.gen(function* () {
      const request = { prompt: "Once", maxTokens: 60 }
      const probe = yield* world({ delayMillis: 5 })
      const first = yield* Stream.runDrain(probe.server.generate(request)).pipe(Effect.fork)
      yield* until("the probe request to reserve KV", probe.server.metrics, (m) => m.kvReservedBytes > 0)
      const perSequence = (yield* probe.server.metrics).kvReservedBytes
      assert.isAbove(perSequence, 0)
      yield* Fiber.interrupt(first)

      const { server } = yield* world({ delayMillis: 5, parallel: 8, kvBudgetBytes: 2 * perSequence })
      const fibers = yield* Effect.forEach([1, 2, 3], () => Stream.runDrain(server.generate(request)).pipe(Effect.fork))
      yield* until("two running and one queued", server.metrics, (m) => m.inFlight + m.queued === 3)
      const metrics = yield* server.metrics
      assert.strictEqual(metrics.inFlight, 2)
      assert.strictEqual(metrics.queued, 1)
      assert.strictEqual(metrics.kvReservedBytes, 2 * perSequence)
      yield* Effect.forEach(fibers, Fiber.join)
      assert.strictEqual((yield* server.metrics).requests.completed, 3)
    }).pipe(Effect.scoped)
  )

  // A request larger than the whole KV budget, or than the model's context, is a bad request (not queued forever).
  it.live("context too long and bad values are BadServeRequest", () =>
    Effect.gen(function* () {
      const { server } = yield* world({ kvBudgetBytes: 1 })
      const tooBig = yield* Effect.flip(Stream.runDrain(server.generate({ prompt: "Once", maxTokens: 4 })))
      assert.strictEqual(tooBig._tag, "BadServeRequest")
      assert.match(tooBig.message, /context too long/)
      const overContext = yield* Effect.flip(Stream.runDrain(server.generate({ prompt: "Once", maxTokens: 5000 })))
      assert.match(
        overContext.message,
        /context too long: the prompt \(5 tokens\) and 5000 new tokens \(max_tokens 5000\) do not fit the model's context of \d+ tokens/
      )
      // top_p 0 is taken (it keeps the likeliest token); above 1 is not.
      const badTopP = yield* Effect.flip(Stream.runDrain(server.generate({ prompt: "Once", sampling: { topP: 1.5 } })))
      assert.strictEqual(badTopP.message, "top_p must be between 0 and 1, got 1.5")
    }).pipe(Effect.scoped)
  )

  // Interrupting a request stops its run: every stage stops hosting it and its KV reservation is returned.
  it.live("cancelling a request frees its stages and its admission", () =>
    Effect.gen(function* () {
      const { memory, server } = yield* world({ delayMillis: 5 })
      const fiber = yield* Stream.runDrain(server.generate({ prompt: "Once", maxTokens: 200 })).pipe(Effect.fork)
      yield* until(
        "both stages to host the request",
        Effect.forEach(memory.agents, (a) => a.host.capacity),
        (all) => all.every((c) => c.activeStages === 1)
      )
      const during = yield* Effect.forEach(memory.agents, (a) => a.host.capacity)
      assert.deepStrictEqual(
        during.map((c) => c.activeStages),
        [1, 1]
      )
      yield* Fiber.interrupt(fiber)
      const after = yield* Effect.forEach(memory.agents, (a) => a.host.capacity)
      assert.deepStrictEqual(
        after.map((c) => c.activeStages),
        [0, 0]
      )
      const metrics = yield* server.metrics
      assert.strictEqual(metrics.requests.cancelled, 1)
      assert.strictEqual(metrics.kvReservedBytes, 0)
    }).pipe(Effect.scoped)
  )

  // Without recovery, losing an agent fails the requests in flight and the ones after with the fault in words;
  // status says so. (With recovery, the default: test/e2e.recovery.serve.test.ts.)
  it.live("without recovery, a lost agent faults in-flight requests and the server's status", () =>
    Effect.gen(function* () {
      const { memory, server } = yield* world({ delayMillis: 5, recovery: { maxAttempts: 0 } })
      const fiber = yield* Stream.runDrain(server.generate({ prompt: "Once", maxTokens: 200 })).pipe(Effect.fork)
      yield* until("the request to run", server.metrics, (m) => m.inFlight === 1)
      yield* memory.agents[1]!.kill
      const error = yield* Effect.flip(Fiber.join(fiber))
      assert.strictEqual(error._tag, "PipelineFaulted")
      const status = yield* server.status
      assert.strictEqual(status._tag, "Faulted")
      const later = yield* Effect.flip(Stream.runDrain(server.generate({ prompt: "Once", maxTokens: 2 })))
      assert.strictEqual(later._tag, "PipelineFaulted")
      assert.match(later.message, /mem-agent-1/)
    }).pipe(Effect.scoped)
  )
})

describe("Orchestrator.pipeline (warm pipeline)", () => {
  // Setup outlives runs: each run has its own RunId and provisions its stages on the same agents, whose
  // cached weights it reuses.
  it.live("runs on one warm pipeline reuse its agents and their cached weights, each with its own RunId", () =>
    Effect.gen(function* () {
      const memory = yield* makeMemoryWorld(2).pipe(Effect.provide(delayedTestExecutor(0)))
      const orchestrator = yield* Layer.build(
        OrchestratorLive.layer.pipe(Layer.provide(memoryWorldServices(memory)))
      ).pipe(Effect.map(Context.get(Orchestrator)))
      const progress: Array<string> = []
      const pipeline = yield* orchestrator.pipeline({ model: requireModel("stories260K.gguf"), stages: 2 }, (u) =>
        Effect.sync(() => progress.push(u._tag))
      )
      assert.deepStrictEqual(progress, ["AgentsStarted", "PoolReady"])
      const runs = []
      for (let i = 0; i < 3; i++) {
        runs.push(
          Chunk.toReadonlyArray(yield* Stream.runCollect(pipeline.run({ prompt: "Once upon a time", maxTokens: 6 })))
        )
      }
      const runIds = runs
        .map((updates) => updates.find((u) => u._tag === "Planned"))
        .map((u) => (u?._tag === "Planned" ? u.runId : -1))
      assert.strictEqual(new Set(runIds).size, 3)
      const cached = runs.map((updates) => updates.flatMap((u) => (u._tag === "StageReady" ? [u.cachedWeights] : [])))
      assert.deepStrictEqual(cached, [
        [false, false],
        [true, true],
        [true, true]
      ])
      const texts = runs.map((updates) => updates.flatMap((u) => (u._tag === "Token" ? [u.token.tokenId] : [])))
      assert.deepStrictEqual(texts[1], texts[0])
      assert.deepStrictEqual(
        texts[0]!.filter((t) => t >= 0),
        expected("Once upon a time", 6)
      )
    }).pipe(Effect.scoped)
  )
})

describe("Stop strings", () => {
  // A stop string split over several pieces is still found, and no part of it is ever released.
  it("finds a stop string across pieces and holds back only what could start one", () => {
    const m = makeStopMatcher(["The end", "\n\n"])
    const out = ["Once. Th", "e", " e", "nd was near"].map((p) => m.push(p))
    assert.deepStrictEqual(
      out.map((o) => o.text),
      ["Once. ", "", "", ""]
    )
    assert.deepStrictEqual(
      out.map((o) => o.stopped),
      [false, false, false, true]
    )
    const n = makeStopMatcher(["The end"])
    assert.deepStrictEqual(
      [n.push("The"), n.push(" fox")].map((o) => o.text),
      ["", "The fox"]
    )
    assert.strictEqual(n.push(" Th").text, " ")
    assert.strictEqual(n.flush(), "Th")
  })
})
