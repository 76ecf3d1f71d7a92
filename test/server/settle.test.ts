/**
 * A served pipeline is long-lived: its warm-up run moves every stage's mapped weights into huge-page memory before the
 * server is ready (RunRequest.settleWeights), so no request runs from the file mapping or waits behind the move.
 */
import { assert, describe, it } from "@effect/vitest"
import { Chunk, Context, Effect, Layer, Stream } from "effect"
import { readFileSync, realpathSync } from "node:fs"
import { serve } from "../../src/api/serve.js"
import { Server } from "../../src/services/Server.js"
import { startAgents } from "../support/e2e.js"
import { requireModel } from "../support/models.js"

const settled = (text: string) => /settled: weights moved out of the file mapping/.test(text)
/** Whether a process maps the file (its weights read in place); /proc names it by its real path. */
const mapsFile = (pid: number, path: string) => readFileSync(`/proc/${pid}/maps`, "utf8").includes(realpathSync(path))

describe("serve: the warm-up settles the weights", () => {
  it.live(
    "every agent's weights left the file mapping when the server is ready, before any request; requests run after it",
    () =>
      Effect.gen(function* () {
        const model = requireModel("stories260K.gguf")
        const { agents, token } = yield* startAgents(2)
        const server = yield* Layer.build(
          serve({ model, agents: agents.map((a) => a.address), token, stages: 2, threads: 1 })
        ).pipe(Effect.map(Context.get(Server)))
        yield* server.ready
        assert.deepStrictEqual(
          agents.map((a) => settled(a.stderrTail())),
          [true, true],
          "each agent logged its move"
        )
        for (const agent of agents) assert.isFalse(mapsFile(agent.pid, model), `agent ${agent.pid} maps the file`)
        const events = Chunk.toReadonlyArray(
          yield* Stream.runCollect(server.generate({ prompt: "Once upon a time", maxTokens: 8 }))
        )
        const done = events.find((e) => e._tag === "Done")
        assert.strictEqual(done?._tag === "Done" ? done.completionTokens : -1, 8)
      }).pipe(Effect.scoped),
    120_000
  )
})
