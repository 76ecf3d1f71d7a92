/**
 * A parent process for the orphan test: starts two agents, prints their pids as JSON, then waits
 * forever (the test kills it with SIGKILL). Plain Node over the compiled package (dist/), as a user's program runs it.
 */
import { Effect } from "effect"
import { generateToken, spawnLocalAgents } from "../../dist/index.js"

Effect.runFork(
  Effect.scoped(
    Effect.gen(function* () {
      const agents = yield* spawnLocalAgents({ count: 2, token: generateToken(), threads: 1 })
      process.stdout.write(`${JSON.stringify(agents.map((a) => a.pid))}\n`)
      return yield* Effect.never
    })
  )
)
