// A local pool that starts its agents when the layer is built (P8 in specs/BEHAVIOR_GUARANTEES.md): they boot while
// the orchestrator reads the model, the first run of that many stages takes them, other runs start their own, and
// closing the layer stops them.
import { assert, describe, it } from "@effect/vitest"
import { Context, Effect, Exit, Layer, Scope } from "effect"
import * as AgentPools from "../../src/layers/agent/AgentPools.js"
import { type LocalAgent } from "../../src/layers/agent/AgentProcesses.js"
import { AgentPool } from "../../src/services/Orchestrator.js"
import { childPids, eventually, isAlive } from "../support/e2e.js"

describe("localAgentPool prestart", () => {
  it.live(
    "agents start with the layer; the first run of that size takes them; closing the layer stops them",
    () =>
      Effect.gen(function* () {
        const started: Array<ReadonlyArray<LocalAgent>> = []
        const scope = yield* Scope.make()
        const context = yield* Layer.buildWithScope(
          AgentPools.layerLocal({
            prestart: 2,
            engine: "test",
            threads: 1,
            onStarted: (agents) => started.push(agents)
          }),
          scope
        )
        const pool = Context.get(context, AgentPool)
        // Before any run asked: two agent processes are booting or up (the pool spawned them on its own).
        assert.isTrue(yield* eventually(() => childPids(process.pid).length >= 2))
        const early = yield* Effect.gen(function* () {
          const runScope = yield* Scope.make()
          const set = yield* pool.acquire(2).pipe(Scope.extend(runScope))
          const other = yield* pool.acquire(1).pipe(Scope.extend(runScope))
          return { set, other, runScope }
        })
        assert.strictEqual(early.set.nodes.length, 2)
        assert.strictEqual(early.other.nodes.length, 1)
        assert.strictEqual(started.length, 2)
        const [prestarted, fresh] = started as [ReadonlyArray<LocalAgent>, ReadonlyArray<LocalAgent>]
        assert.strictEqual(prestarted.length, 2)
        assert.notDeepEqual(
          prestarted.map((a) => a.pid),
          fresh.map((a) => a.pid)
        )
        // The run's scope owns only its fresh agents; the pre-started ones belong to the layer.
        yield* Scope.close(early.runScope, Exit.void)
        assert.isTrue(yield* eventually(() => fresh.every((a) => !isAlive(a.pid))))
        assert.isTrue(prestarted.every((a) => isAlive(a.pid)))
        yield* Scope.close(scope, Exit.void)
        assert.isTrue(yield* eventually(() => prestarted.every((a) => !isAlive(a.pid))))
      }),
    60_000
  )
})
