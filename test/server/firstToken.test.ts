import { assert, describe, it } from "@effect/vitest"
import { Context, Effect, Layer, Stream } from "effect"
import * as OrchestratorLive from "../../src/layers/orchestrator/OrchestratorLive.js"
import * as ServerLive from "../../src/layers/server/ServerLive.js"
import { makeMemoryWorld } from "../../src/layers/agent/AgentLinksTest.js"
import { renderMetrics } from "../../src/layers/server/HttpServe.js"
import { Server, type ServeOptions } from "../../src/services/Server.js"
import { delayedTestExecutor, memoryWorldServices } from "../support/memoryWorld.js"
import { requireModel } from "../support/models.js"

// The time to first token split into its phases (/metrics): known engine delays and a known admission wait must show
// up in the phases they belong to, and the phases add up to the whole.

const world = (delayMillis: number, options: Partial<ServeOptions> = {}) =>
  Effect.gen(function* () {
    const memory = yield* makeMemoryWorld(2).pipe(Effect.provide(delayedTestExecutor(delayMillis)))
    const server = yield* Layer.build(
      ServerLive.layer({
        model: requireModel("stories260K.gguf"),
        stages: 2,
        promptCache: { enabled: false },
        ...options
      }).pipe(Layer.provide(OrchestratorLive.layer), Layer.provide(memoryWorldServices(memory)))
    ).pipe(Effect.map(Context.get(Server)))
    yield* server.ready
    return server
  })

describe("time to first token by phase (/metrics)", () => {
  it.live(
    "engine delays land in prefill per stage, a queue wait in admit, and the phases add up to the whole",
    () =>
      Effect.scoped(
        Effect.gen(function* () {
          const delay = 60
          const server = yield* world(delay, { parallel: 1 })
          const started = performance.now()
          // one at a time: the second waits in admission for the whole first request (5 tokens, 2 stages)
          const requests = ["Once upon a time", "A dog"].map((prompt) =>
            Stream.runDrain(server.generate({ prompt, maxTokens: 5 }))
          )
          yield* Effect.forEach(requests, (r) => r, { concurrency: "unbounded" })
          const wall = (performance.now() - started) / 1000
          const m = yield* server.metrics
          const f = m.firstToken
          assert.strictEqual(f.requests, 2)
          const phases = [f.tokenize, f.admit, f.setup, f.prefillWait, f.prefill, f.sample, f.hops]
          for (const p of phases) assert.isAtLeast(p, 0)
          assert.closeTo(
            phases.reduce((a, b) => a + b, 0),
            f.totalSeconds,
            1e-6
          )
          assert.isBelow(f.totalSeconds, 2 * wall)
          // 2 requests x 2 stages x one prompt micro-batch of >= 60 ms each
          assert.isAtLeast(f.prefill, (4 * delay) / 1000 - 0.005)
          for (const stage of m.stages) {
            assert.isAtLeast(stage.prefillSeconds, (2 * delay) / 1000 - 0.005, `stage ${stage.stageIndex}`)
            assert.isAtMost(stage.prefillSeconds, f.prefill)
          }
          assert.strictEqual(m.stages.length, 2)
          // the second request waited for the first one's 5 steps on 2 stages (>= 10 micro-batches of 60 ms)
          assert.isAtLeast(f.admit, (10 * delay) / 1000 - 0.01)
          const text = renderMetrics(m, "ready")
          assert.match(text, /^swactor_first_token_seconds_count 2$/m)
          for (const phase of ["tokenize", "admit", "setup", "prefill_wait", "prefill", "sample", "hops"]) {
            assert.match(
              text,
              new RegExp(`^swactor_first_token_phase_seconds_total\\{phase="${phase}"\\} [0-9.e-]+$`, "m")
            )
          }
          assert.match(text, /^swactor_stage_prefill_seconds_total\{stage="1"\} [0-9.e-]+$/m)
          assert.match(text, /^swactor_stage_prefill_wait_seconds_total\{stage="0"\} [0-9.e-]+$/m)
        })
      ),
    60_000
  )
})
