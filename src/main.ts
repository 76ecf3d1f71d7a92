#!/usr/bin/env node
/**
 * The `swactor` command: a thin registry of subcommands. To add one, import it from its src/cli/*Command.ts file and
 * add it to the list below.
 */
import * as Command from "@effect/cli/Command"
import * as NodeContext from "@effect/platform-node/NodeContext"
import { Cause, Effect, Exit } from "effect"
import { planCommand } from "./cli/PlanCommand.js"
import { synthCommand } from "./cli/SynthCommand.js"
import { nodeCommand } from "./cli/NodeCommand.js"
import { runCommand } from "./cli/RunCommand.js"

const swactor = Command.make("swactor").pipe(
  Command.withDescription("Run a GGUF language model across several machines as a pipeline"),
  Command.withSubcommands([
    planCommand,
    synthCommand,
    nodeCommand,
    runCommand
  ])
)

const cli = Command.run(swactor, { name: "swactor", version: "0.1.0" })

// Subcommands print their own errors in words; a failure only sets the exit code. Long-running commands handle
// SIGINT/SIGTERM/SIGHUP themselves (cli/Signals.ts: teardown, then process.exitCode = 128 + the signal), so this
// runner installs no signal listener: once the main fiber has ended (every scope closed), it exits with the code.
const keepAlive = setInterval(() => {}, 2 ** 31 - 1)
const main = Effect.runFork(cli(process.argv).pipe(Effect.provide(NodeContext.layer)))
main.addObserver((exit) => {
  clearInterval(keepAlive)
  const failed = Exit.isFailure(exit) && !Cause.isInterruptedOnly(exit.cause)
  const requested = typeof process.exitCode === "number" ? process.exitCode : 0
  process.exit(failed ? Math.max(1, requested) : requested)
})
