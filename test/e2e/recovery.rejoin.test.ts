import { assert, describe, it } from "@effect/vitest"
import { spawn } from "node:child_process"
import { Chunk, Context, Effect, Layer, Stream } from "effect"
import { clusterTokenEnv, parentWatchEnv, readyLinePrefix } from "../../src/layers/agent/ReadyLine.js"
import { swactorCommand } from "../../src/layers/agent/AgentProcesses.js"
import { Orchestrator, type Pipeline, type RunUpdate } from "../../src/services/Orchestrator.js"
import { isAlive, startAgents } from "../support/e2e.js"
import { requireModel } from "../support/models.js"
import { until, untilTrue } from "../support/until.js"

/** `swactor node` listening at `address` (a restart there), killed with the scope. */
const startAgentAt = (address: string, token: string) =>
  Effect.acquireRelease(
    Effect.async<{ readonly pid: number; readonly kill: () => void }, Error>((resume) => {
      const { args, command } = swactorCommand(["node", "--listen", address, "--threads", "1"])
      const child = spawn(command, args, {
        stdio: ["pipe", "pipe", "ignore"],
        env: { ...process.env, [clusterTokenEnv]: token, [parentWatchEnv]: "stdin" }
      })
      let out = ""
      child.stdout.on("data", (chunk: Buffer) => {
        out += chunk.toString()
        if (out.includes(readyLinePrefix))
          resume(Effect.succeed({ pid: child.pid!, kill: () => child.kill("SIGKILL") }))
      })
      child.on("exit", (code) => resume(Effect.fail(new Error(`agent exited with ${code}: ${out}`))))
    }),
    (agent) => Effect.sync(agent.kill)
  )

const generation = (pipeline: Pipeline) =>
  Effect.gen(function* () {
    const updates = Chunk.toReadonlyArray(
      yield* Stream.runCollect(pipeline.run({ prompt: "Once upon a time", maxTokens: 40 }))
    )
    const planned = updates.find((u): u is Extract<RunUpdate, { _tag: "Planned" }> => u._tag === "Planned")!
    return {
      addresses: planned.stages.map((s) => s.address),
      tokens: updates.flatMap((u) => (u._tag === "Token" && u.token.tokenId >= 0 ? [u.token.tokenId] : []))
    }
  })

describe("rejoin: a node restarted at its address comes back to the pool", () => {
  // A warm pipeline over 2 remote agents: one is killed (the next run plans without it: 1 stage); it restarts at
  // the same address: heartbeats resume (alive again, new pid) and the next run uses it again, same output.
  it.live(
    "kill -9, then restart at the same address: the next run uses it again",
    () =>
      Effect.gen(function* () {
        const { agents, layer, token } = yield* startAgents(2)
        const orchestrator = yield* Layer.build(layer).pipe(Effect.map(Context.get(Orchestrator)))
        const pipeline = yield* orchestrator.pipeline({
          model: requireModel("stories260K.gguf"),
          stages: 2,
          threads: 1,
          heartbeat: { interval: "200 millis", deadline: "2 seconds" }
        })
        const first = yield* generation(pipeline)
        assert.deepStrictEqual(first.addresses, [agents[0]!.address, agents[1]!.address])

        process.kill(agents[1]!.pid, "SIGKILL")
        yield* untilTrue("the killed agent to exit", () => !isAlive(agents[1]!.pid))
        // the heartbeat deadline (2 s) passes on the pipeline's own clock: wait for its membership to change
        let alive = yield* until("the pipeline to drop the killed agent", pipeline.alive, (a) => a.length === 1)
        assert.deepStrictEqual(
          alive.map((a) => a.node.address),
          [agents[0]!.address]
        )
        const without = yield* generation(pipeline)
        assert.deepStrictEqual(without.addresses, [agents[0]!.address])
        assert.deepStrictEqual(without.tokens, first.tokens)

        const restarted = yield* startAgentAt(agents[1]!.address, token)
        alive = yield* until("the restarted agent to rejoin", pipeline.alive, (a) => a.length === 2)
        assert.deepStrictEqual(
          alive.map((a) => a.pid),
          [agents[0]!.pid, restarted.pid]
        )
        const again = yield* generation(pipeline)
        assert.deepStrictEqual(again.addresses, [agents[0]!.address, agents[1]!.address])
        assert.deepStrictEqual(again.tokens, first.tokens)
      }).pipe(Effect.scoped),
    120_000
  )
})
