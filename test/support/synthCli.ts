/** `swactor synth ARGS` run in process through the CLI's own command (its parsing, defaults and checks): the exit. */
import * as Command from "@effect/cli/Command"
import * as NodeContext from "@effect/platform-node/NodeContext"
import { Effect } from "effect"
import { synthCommand } from "../../src/cli/SynthCommand.js"

const cli = Command.run(Command.make("swactor").pipe(Command.withSubcommands([synthCommand])), {
  name: "swactor",
  version: "test"
})

export const runSynthCli = (args: ReadonlyArray<string>) =>
  cli(["node", "swactor", "synth", ...args]).pipe(Effect.provide(NodeContext.layer), Effect.exit)
