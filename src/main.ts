#!/usr/bin/env node
/**
 * The `swactor` command: a thin registry of subcommands. To add one, import it from its src/cli/*Command.ts file and
 * add it to the list below.
 */
import * as Command from "@effect/cli/Command"
import * as NodeContext from "@effect/platform-node/NodeContext"
import * as NodeRuntime from "@effect/platform-node/NodeRuntime"
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

// Subcommands print their own errors in words; a failure only sets the exit code. The default teardown exits 0
// when the program was interrupted (Ctrl-C); a command that set process.exitCode (130 after an operator stop)
// keeps it.
const teardown = <E, A>(exit: Exit.Exit<E, A>, onExit: (code: number) => void) => {
  const failed = Exit.isFailure(exit) && !Cause.isInterruptedOnly(exit.cause)
  const requested = typeof process.exitCode === "number" ? process.exitCode : 0
  onExit(failed ? Math.max(1, requested) : requested)
}

cli(process.argv).pipe(Effect.provide(NodeContext.layer), NodeRuntime.runMain({ disableErrorReporting: true, teardown }))
