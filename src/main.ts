#!/usr/bin/env node
/**
 * The `swactor` command: a thin registry of subcommands. To add one, add a loader for its src/cli/*Command.ts file
 * to `subcommands` below.
 */
import { isMainThread, workerData } from "node:worker_threads"
import * as Command from "@effect/cli/Command"
import * as NodeContext from "@effect/platform-node/NodeContext"
import { Cause, type Console, Effect, Exit, Layer, Logger } from "effect"
import { type About, beforeCommand } from "./cli/CommandLine.js"

// Each subcommand's module is imported only when it is the one asked for (an agent never loads the HTTP server,
// the tokenizer or the synthetic-model writer: start-up time is paid by every local agent); `--help` or an unknown
// word loads them all, so the help and the error list every command. Each loader gives the command and its help
// (cli/FlagSpec.ts), in the order the top-level help lists them.
const subcommands = {
  run: () => import("./cli/RunCommand.js").then((m) => [m.runCommand, m.runDoc] as const),
  serve: () => import("./cli/ServeCommand.js").then((m) => [m.serveCommand, m.serveDoc] as const),
  node: () => import("./cli/NodeCommand.js").then((m) => [m.nodeCommand, m.nodeDoc] as const),
  invite: () => import("./cli/InviteCommand.js").then((m) => [m.inviteCommand, m.inviteDoc] as const),
  plan: () => import("./cli/PlanCommand.js").then((m) => [m.planCommand, m.planDoc] as const),
  synth: () => import("./cli/SynthCommand.js").then((m) => [m.synthCommand, m.synthDoc] as const)
} as const

const version = "0.1.0"
const about: About = {
  version,
  summary: "run a GGUF language model across several machines as a pipeline",
  examples: [
    {
      what: "generate on two local agents (a small synthetic model when --model is not given)",
      command: 'swactor run --prompt "Once upon a time"'
    },
    { what: "serve an OpenAI-compatible API on port 8080", command: "swactor serve --model model.gguf --port 8080" },
    { what: "a command's flags", command: "swactor run --help" }
  ]
}
// The help and a command line that cannot be parsed are this program's (cli/CommandLine.ts: one line naming the
// flag, the nearest name for a slip); anything else goes to @effect/cli, which parses again and runs the command.
// Subcommands print their own errors in words; a failure only sets the exit code (1). Long-running commands handle
// SIGINT/SIGTERM/SIGHUP themselves (cli/Signals.ts: teardown, then process.exitCode = 128 + the signal), so this
// runner installs no signal listener: once the main fiber has ended (every scope closed), it exits with the code.
// Logs (warnings of a node agent, for one) go to stderr: stdout carries only a command's output. Colour and
// terminal codes (@effect/cli's messages, --version's) only reach a terminal: `NO_COLOR`, a pipe or a file get plain text.
const ansi = /\x1b\[[0-9;?]*[A-Za-z]/g
const plainUnlessTerminal = (console: Console.Console, stream: NodeJS.WriteStream): Console.Console["log"] =>
  stream.isTTY === true && process.env["NO_COLOR"] === undefined
    ? console.log
    : (...args) => console.log(...args.map((arg) => (typeof arg === "string" ? arg.replace(ansi, "") : arg)))
const withPlainConsole = <A, E, R>(effect: Effect.Effect<A, E, R>) =>
  Effect.consoleWith((console) => {
    const log = plainUnlessTerminal(console, process.stdout)
    const toStderr = plainUnlessTerminal({ ...console, log: console.error }, process.stderr)
    return Effect.withConsole(effect, { ...console, log, info: log, error: toStderr, warn: toStderr })
  })

// No top-level await: the build bundles this file as CommonJS (scripts/build.mjs: a V8 code cache needs a vm.Script).
const main = async () => {
  // A worker thread of this bundle: `swactor serve`'s tokenizer (layers/server/PromptTokenizer.ts starts it here).
  if (!isMainThread && (workerData as Record<string, unknown> | null)?.["swactorTokenizeWorker"] !== undefined) {
    await import("./layers/server/TokenizeWorker.js")
    return
  }
  const asked = process.argv[2]
  const loaded = await Promise.all(
    asked !== undefined && Object.hasOwn(subcommands, asked)
      ? [subcommands[asked as keyof typeof subcommands]()]
      : Object.values(subcommands).map((load) => load())
  )
  const [first, ...rest] = loaded.map(([command]) => command)
  const swactor = Command.make("swactor").pipe(
    Command.withDescription(about.summary),
    Command.withSubcommands([first!, ...rest])
  )
  const cli = Command.run(swactor, { name: "swactor", version })
  const docs = loaded.map(([, doc]) => doc)
  const keepAlive = setInterval(() => {}, 2 ** 31 - 1)
  const fiber = Effect.runFork(
    beforeCommand(swactor, about, docs, process.argv.slice(2)).pipe(
      Effect.flatMap((toRun) => (toRun ? cli(process.argv) : Effect.void)),
      withPlainConsole,
      Effect.provide(
        Layer.merge(
          NodeContext.layer,
          Logger.replace(Logger.defaultLogger, Logger.withConsoleError(Logger.stringLogger))
        )
      )
    )
  )
  fiber.addObserver((exit) => {
    clearInterval(keepAlive)
    const failed = Exit.isFailure(exit) && !Cause.isInterruptedOnly(exit.cause)
    const requested = typeof process.exitCode === "number" ? process.exitCode : 0
    process.exit(failed ? Math.max(1, requested) : requested)
  })
}
void main()
