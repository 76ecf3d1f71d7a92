/**
 * A `swactor node` entry for tests only (never built into dist/): the node command over stage executors with
 * injected faults. Agents start from it with `agentEntry` as `LocalAgentsOptions.entry`; its own flag, after the
 * node command's arguments (`extraArgs`), says which fault:
 *
 * - `--stall-load`: every stage load hangs (an agent that never becomes ready).
 *
 * Without one it is the plain node command. Logs go to stderr, as in src/main.ts.
 */
import * as Command from "@effect/cli/Command"
import * as NodeContext from "@effect/platform-node/NodeContext"
import { fileURLToPath } from "node:url"
import { Cause, Effect, Exit, Layer, Logger } from "effect"
import { makeNodeCommand, stageExecutorFor, type StageExecutorFor } from "../../src/cli/NodeCommand.js"
import { StageExecutor } from "../../src/services/StageExecutor.js"

/** Node arguments that run this file (through tsx: it is TypeScript, and not compiled). */
export const agentEntry: ReadonlyArray<string> = ["--import", "tsx", fileURLToPath(import.meta.url)]

/** The stage executor whose loads never finish. */
const stallingLoads: StageExecutorFor = (engine) =>
  Layer.effect(
    StageExecutor,
    Effect.map(StageExecutor, (executor) => ({ ...executor, load: () => Effect.never }))
  ).pipe(Layer.provide(stageExecutorFor(engine)))

const isMain = process.argv[1] === fileURLToPath(import.meta.url)
if (isMain) {
  const stall = process.argv.includes("--stall-load")
  const argv = process.argv.filter((arg) => arg !== "--stall-load")
  const swactor = Command.make("swactor").pipe(
    Command.withSubcommands([makeNodeCommand(stall ? stallingLoads : stageExecutorFor)])
  )
  const keepAlive = setInterval(() => {}, 2 ** 31 - 1)
  Effect.runFork(
    Command.run(swactor, { name: "swactor", version: "test" })(argv).pipe(
      Effect.provide(
        Layer.merge(
          NodeContext.layer,
          Logger.replace(Logger.defaultLogger, Logger.withConsoleError(Logger.stringLogger))
        )
      )
    )
  ).addObserver((exit) => {
    clearInterval(keepAlive)
    const failed = Exit.isFailure(exit) && !Cause.isInterruptedOnly(exit.cause)
    const requested = typeof process.exitCode === "number" ? process.exitCode : 0
    process.exit(failed ? Math.max(1, requested) : requested)
  })
}
