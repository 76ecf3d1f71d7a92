/**
 * A Stop that overtakes its stage's Provision (the orchestrator runs a run's commands concurrently, so a run torn
 * down while it provisions can send Stop first): the real agent remembers it, and the Provision that follows answers
 * StageStopped at once instead of loading and hosting the stage until the orchestrator's teardown deadline (chaos
 * runs saw a kill during loading take 10 s to recover through this race).
 */
import { assert, describe, it } from "@effect/vitest"
import { Chunk, Duration, Effect, Stream } from "effect"
import type { NodeId, RunId } from "../../src/domain/ids.js"
import * as AgentControlRpc from "../../src/layers/agent/AgentControlRpc.js"
import { AgentControl } from "../../src/services/AgentLinks.js"
import { startAgents, stories260KProvision } from "../support/e2e.js"
import { requireModel } from "../support/models.js"

describe("agent: a Stop before its Provision", () => {
  it.live(
    "the Provision that follows reports StageStopped at once and hosts nothing",
    () =>
      Effect.gen(function* () {
        const { agents, token } = yield* startAgents(1)
        const control = yield* AgentControl
        const link = yield* control.connect({ nodeId: 1 as NodeId, address: agents[0]!.address }, token)
        const path = requireModel("stories260K.gguf")
        yield* link.stop(77 as RunId, 0)
        const reports = yield* Stream.runCollect(link.provision(stories260KProvision(77 as RunId, path, 1))).pipe(
          Effect.timeoutFail({
            duration: Duration.seconds(5),
            onTimeout: () => new Error("the stage was hosted anyway")
          })
        )
        assert.deepStrictEqual(
          Chunk.toReadonlyArray(reports).map((r) => r._tag),
          ["StageStopped"]
        )
        assert.strictEqual((yield* link.capacity).activeStages, 0)
      }).pipe(Effect.scoped, Effect.provide(AgentControlRpc.layer)),
    60_000
  )
})
