import { assert, describe, it } from "@effect/vitest"
import { Chunk, Context, Effect, Fiber, Layer, Stream } from "effect"
import { makeMemoryWorld } from "../../src/layers/agent/AgentLinksTest.js"
import * as MembershipLive from "../../src/layers/agent/MembershipLive.js"
import * as OrchestratorLive from "../../src/layers/orchestrator/OrchestratorLive.js"
import * as ServerLive from "../../src/layers/server/ServerLive.js"
import * as ModelCatalogLive from "../../src/layers/gguf/ModelCatalogLive.js"
import * as TokenizerLive from "../../src/layers/gguf/TokenizerLive.js"
import { Server, type ServeEvent } from "../../src/services/Server.js"
import { delayedTestExecutor, memoryWorldServices } from "../support/memoryWorld.js"
import { requireModel } from "../support/models.js"
import { until } from "../support/until.js"

/** A server over 3 in-memory agents, 2 stages: the third agent is a spare. */
const world = Effect.gen(function* () {
  const memory = yield* makeMemoryWorld(3).pipe(Effect.provide(delayedTestExecutor(3)))
  const server = yield* Layer.build(
    ServerLive.layer({
      model: requireModel("stories260K.gguf"),
      stages: 2,
      parallel: 4,
      // Idle agents that die are noticed by their heartbeats.
      heartbeat: { interval: "100 millis", deadline: "1 second" }
    }).pipe(Layer.provide(OrchestratorLive.layer), Layer.provide(memoryWorldServices(memory)))
  ).pipe(Effect.map(Context.get(Server)))
  yield* server.ready
  return { memory, server }
})

const textOf = (events: ReadonlyArray<ServeEvent>) =>
  events.flatMap((e) => (e._tag === "Text" ? [e.text] : [])).join("")

describe("serve: in-flight requests survive a lost agent", () => {
  // Two requests stream on the 2-stage pipeline; its second agent is killed mid-generation: both requests are
  // recovered (the spare takes the stage) and end with the text they would have had, the server stays Ready,
  // /metrics counts the recoveries and lists only the agents still alive. With every agent lost, the request in flight
  // faults and the server is Reviving (no longer a final Faulted), naming the agents it waits for.
  it.live(
    "a killed agent: every in-flight request is recovered with the same text; all lost: the server faults",
    () =>
      Effect.gen(function* () {
        const { memory, server } = yield* world
        const prompts = ["Once upon a time", "A dog"]
        const alone = []
        for (const prompt of prompts) {
          alone.push(Chunk.toReadonlyArray(yield* Stream.runCollect(server.generate({ prompt, maxTokens: 80 }))))
        }
        let texts = 0
        const fibers = yield* Effect.forEach(prompts, (prompt, i) =>
          server.generate({ prompt, maxTokens: 80 }).pipe(
            Stream.tap((e) => (i === 0 && e._tag === "Text" && ++texts === 10 ? memory.agents[1]!.kill : Effect.void)),
            Stream.runCollect,
            Effect.map(Chunk.toReadonlyArray),
            Effect.fork
          )
        )
        const together = yield* Effect.forEach(fibers, Fiber.join)
        assert.strictEqual(texts >= 10, true)
        for (let i = 0; i < prompts.length; i++) {
          assert.strictEqual(textOf(together[i]!), textOf(alone[i]!))
          const done = together[i]!.at(-1)
          assert.strictEqual(done?._tag, "Done")
        }
        const metrics = yield* server.metrics
        assert.strictEqual(metrics.recoveries, 2)
        assert.deepStrictEqual(
          metrics.agents.map((a) => a.address),
          ["mem-agent-0:7000", "mem-agent-2:7000"]
        )
        assert.deepStrictEqual(yield* server.status, { _tag: "Ready", lostAgents: ["mem-agent-1:7000"] })
        // A new request runs on the recovered placement (no fault, same text).
        const again = Chunk.toReadonlyArray(
          yield* Stream.runCollect(server.generate({ prompt: prompts[1]!, maxTokens: 80 }))
        )
        assert.strictEqual(textOf(again), textOf(alone[1]!))

        // Both agents left are killed mid-generation: nothing can host the model.
        let seen = 0
        const failed = yield* server.generate({ prompt: prompts[0]!, maxTokens: 80 }).pipe(
          Stream.tap((e) =>
            e._tag === "Text" && ++seen === 5
              ? Effect.zipRight(memory.agents[0]!.kill, memory.agents[2]!.kill)
              : Effect.void
          ),
          Stream.runDrain,
          Effect.flip
        )
        assert.match(failed.message, /no node left to host the model/)
        // With none left the server revives the pipeline (test/server/revive.test.ts): it waits for these agents, which never
        // answer again here (killed in memory, no fresh ones to start), and refuses requests meanwhile.
        const status = yield* until("the server to start reviving", server.status, (s) => s._tag === "Reviving")
        assert.strictEqual(status._tag, "Reviving")
        assert.match(status._tag === "Reviving" ? status.message : "", /every agent of the pipeline was lost/)
        assert.deepStrictEqual(status._tag === "Reviving" ? status.waitingFor.map((a) => [a.address, a.state]) : [], [
          ["mem-agent-0:7000", "lost"],
          ["mem-agent-1:7000", "lost"],
          ["mem-agent-2:7000", "lost"]
        ])
        const refused = yield* Effect.flip(Stream.runDrain(server.generate({ prompt: prompts[0]!, maxTokens: 4 })))
        assert.strictEqual(refused._tag, "ServerReviving")
      }).pipe(Effect.scoped),
    60_000
  )
})
