/**
 * What `swactor` does with its command line before a command runs: `--help` (and no arguments at all) prints this
 * program's help (cli/Help.ts); a command line @effect/cli cannot parse is refused in one line, a mistyped flag or
 * command with the nearest name ("did you mean --model?"), exit code 1 like every refused flag. Anything else is
 * left to @effect/cli to run (the command, or one of its own options: --version, --completions, --log-level).
 *
 * @effect/cli stays the parser: its parse of the command line says whether help was asked for, which argument it
 * could not place (the first of its leftover) or which command it did not know; this module only words the outcome.
 */
import * as CliConfig from "@effect/cli/CliConfig"
import * as Descriptor from "@effect/cli/CommandDescriptor"
import * as HelpDoc from "@effect/cli/HelpDoc"
import { Console, Data, Effect, Either } from "effect"
import type { CommandDoc, FlagDoc } from "./FlagSpec.js"
import { commandHelp, helpWidth, topHelp } from "./Help.js"

/** A command line refused before any command runs (its message is printed already). */
export class CommandLineError extends Data.TaggedError("CommandLineError")<{ readonly message: string }> {}

/** The distance between two names: insertions, deletions, substitutions and swaps of neighbours, one each. */
export const editDistance = (a: string, b: string): number => {
  const d = Array.from({ length: a.length + 1 }, (_, i) =>
    Array.from({ length: b.length + 1 }, (_, j) => (i === 0 ? j : j === 0 ? i : 0))
  )
  for (let i = 1; i <= a.length; i++) {
    for (let j = 1; j <= b.length; j++) {
      const cost = a[i - 1] === b[j - 1] ? 0 : 1
      d[i]![j] = Math.min(d[i - 1]![j]! + 1, d[i]![j - 1]! + 1, d[i - 1]![j - 1]! + cost)
      if (i > 1 && j > 1 && a[i - 1] === b[j - 2] && a[i - 2] === b[j - 1]) {
        d[i]![j] = Math.min(d[i]![j]!, d[i - 2]![j - 2]! + 1)
      }
    }
  }
  return d[a.length]![b.length]!
}

/**
 * The candidate nearest to `typed` (dashes aside), when near enough to be a slip: one edit for names of up to 4
 * characters, two up to 8, three beyond. The first of equally near ones.
 */
export const nearest = (typed: string, candidates: ReadonlyArray<string>): string | undefined => {
  const bare = (name: string) => name.replace(/^-+/, "").toLowerCase()
  const word = bare(typed)
  const limit = word.length <= 4 ? 1 : word.length <= 8 ? 2 : 3
  let best: { readonly name: string; readonly distance: number } | undefined
  for (const name of candidates) {
    const distance = editDistance(word, bare(name))
    if (distance <= limit && (best === undefined || distance < best.distance)) best = { name, distance }
  }
  return best?.name
}

/** The names a flag answers to, as typed: `--agents`, `--nodes`; `--output`, `-o`. */
const namesOf = (flag: FlagDoc): ReadonlyArray<string> => [
  `--${flag.name}`,
  ...flag.aliases.map((alias) => (alias.length === 1 ? `-${alias}` : `--${alias}`))
]

/** The names a command's flags answer to, and `--help`. */
const flagNames = (doc: CommandDoc): ReadonlyArray<string> => [...doc.flags.flatMap(namesOf), "--help"]

/** Why @effect/cli left `leftover` unplaced, in words: the first of it is the argument it could not place. */
const leftoverProblem = (doc: CommandDoc, leftover: ReadonlyArray<string>): string => {
  const head = leftover[0]!
  if (!head.startsWith("-")) {
    return `unexpected argument "${head}": ${doc.name} takes flags only (swactor ${doc.name} --help lists them)`
  }
  const name = head.replace(/=.*$/, "")
  const known = doc.flags.find((flag) => namesOf(flag).includes(name))
  if (known !== undefined) {
    return leftover.length === 1 && known.value !== undefined && name === head
      ? `${name} needs a value (${known.value})`
      : `--${known.name} is given more than once`
  }
  return unknownFlag(doc, name)
}

/** A flag `doc` does not have, with the nearest one it has. */
const unknownFlag = (doc: CommandDoc, name: string): string => {
  const near = nearest(name, flagNames(doc))
  return (
    `unknown flag ${name} ` +
    (near === undefined ? `(swactor ${doc.name} --help lists the flags)` : `(did you mean ${near}?)`)
  )
}

/** A command @effect/cli does not know, in words. */
const commandProblem = (word: string, commands: ReadonlyArray<CommandDoc>): string => {
  const names = commands.map((command) => command.name)
  if (word.startsWith("-")) {
    const near = nearest(word, ["--help", "--version"])
    return near !== undefined
      ? `unknown flag ${word} (did you mean ${near}?)`
      : `${word} before a command: swactor <COMMAND> [OPTIONS], the command one of ${names.join(", ")}`
  }
  const near = nearest(word, names)
  return (
    `unknown command ${word} ` + (near === undefined ? `(commands: ${names.join(", ")})` : `(did you mean ${near}?)`)
  )
}

const ansi = /\x1b\[[0-9;?]*[A-Za-z]/g

/** The name a command line gave a flag, as typed (`--nodes`, `-o`), and the value after it, when it took one. */
const givenValues = (doc: CommandDoc, args: ReadonlyArray<string>) =>
  args.flatMap((arg, i) => {
    const [name, inline] = arg.includes("=") ? [arg.slice(0, arg.indexOf("=")), arg.slice(arg.indexOf("=") + 1)] : [arg]
    const flag = doc.flags.find((f) => namesOf(f).includes(name!))
    const value = inline ?? args[i + 1]
    return flag === undefined || flag.value === undefined || value === undefined ? [] : [{ flag, value }]
  })

/**
 * @effect/cli's message for a command line it could not parse, on one line and naming the flag where it does not:
 * a value that is no number or no choice, a flag without its value, a required flag missing. Any other message is
 * passed on as it is.
 */
const parseProblem = (doc: CommandDoc | undefined, args: ReadonlyArray<string>, error: HelpDoc.HelpDoc): string => {
  const message = HelpDoc.toAnsiText(error).replace(ansi, "").replace(/\s+/g, " ").trim()
  if (doc === undefined) return message
  // @effect/cli's own correction, on a first flag near a required one: named here with the nearest of all the flags.
  const corrected = /^The flag '(.*?)' is not recognized/.exec(message)
  if (corrected !== null) return unknownFlag(doc, corrected[1]!)
  const given = givenValues(doc, args.slice(1))
  const number = /^'(.*)' is not a (integer|float)$/.exec(message)
  if (number !== null) {
    const culprit = given.find(({ value }) => value === number[1])
    const what = number[2] === "integer" ? "a whole number" : "a number"
    if (culprit !== undefined) return `--${culprit.flag.name}: "${number[1]}" is not ${what}`
  }
  if (message.startsWith("Expected one of the following cases")) {
    const culprit = given.find(({ flag, value }) => flag.choices !== undefined && !flag.choices.includes(value))
    if (culprit !== undefined) {
      return `--${culprit.flag.name}: "${culprit.value}" is not one of ${culprit.flag.choices!.join(", ")}`
    }
  }
  const missing = /^Expected (to find option|a value following option): '(--[\w-]+)'$/.exec(message)
  const flag = missing === null ? undefined : doc.flags.find((f) => `--${f.name}` === missing[2])
  if (missing !== null && flag !== undefined) {
    const usage = `--${flag.name}${flag.value === undefined ? "" : " " + flag.value}`
    return missing[1] === "to find option" ? `${usage} is required` : `--${flag.name} needs a value (${flag.value})`
  }
  return message
}

/** What `swactor` says about itself in its help. */
export interface About {
  readonly version: string
  readonly summary: string
  readonly examples: CommandDoc["examples"]
}

/**
 * Prints the help, or refuses the command line in one line on stderr (failing with a CommandLineError), or says `true`:
 * @effect/cli is to run it. `args` are the arguments after the program (process.argv.slice(2)).
 */
export const beforeCommand = (
  root: { readonly descriptor: Descriptor.Command<unknown> },
  about: About,
  commands: ReadonlyArray<CommandDoc>,
  args: ReadonlyArray<string>
) =>
  Effect.gen(function* () {
    const word = args[0]
    const doc = commands.find((command) => command.name === word)
    const refuse = (message: string) =>
      Console.error(`swactor${doc === undefined ? "" : " " + doc.name}: ${message}`).pipe(
        Effect.zipRight(Effect.fail(new CommandLineError({ message })))
      )
    const printHelp = Console.log(
      doc === undefined
        ? topHelp(about, commands, helpWidth(process.stdout))
        : commandHelp(doc, helpWidth(process.stdout))
    ).pipe(Effect.as(false))
    const parsed = yield* Effect.either(
      Descriptor.parse(root.descriptor, ["swactor", ...args], CliConfig.defaultConfig)
    )
    if (Either.isLeft(parsed)) {
      return yield* parsed.left._tag === "CommandMismatch" && doc === undefined && word !== undefined
        ? refuse(commandProblem(word, commands))
        : refuse(parseProblem(doc, args, parsed.left.error))
    }
    const directive = parsed.right
    if (directive._tag === "BuiltIn") return directive.option._tag === "ShowHelp" ? yield* printHelp : true
    if (args.length === 0) return yield* printHelp
    return directive.leftover.length > 0 && doc !== undefined
      ? yield* refuse(leftoverProblem(doc, directive.leftover))
      : true
  })
