/**
 * Flag checks shared by the commands: each bad value is a `UsageError` whose message is one line naming the flag,
 * found before anything starts (no agent spawned, no model read).
 */
import * as Options from "@effect/cli/Options"
import { readFileSync } from "node:fs"
import { Data, Effect, Option } from "effect"
import { readModelFacts } from "../api/modelFacts.js"
import { ModelLoadError } from "../domain/gguf.js"
import { parseAddress } from "../layers/agent/AgentControlRpc.js"
import { clusterTokenEnv } from "../layers/agent/ReadyLine.js"
import { clusterTokenProblem, minTokenLength, sparesProblem, threadsProblem } from "../services/RequestChecks.js"

/** A flag with a value the command cannot use; `message` names the flag. */
export class UsageError extends Data.TaggedError("UsageError")<{ readonly message: string }> {}

const fail = (message: string) => Effect.fail(new UsageError({ message }))

/** A whole number of at least `min` (`--threads 0` is refused, not passed on to crash an agent). */
export const wholeNumber = (flag: string, value: number, min: number): Effect.Effect<number, UsageError> =>
  Number.isSafeInteger(value) && value >= min
    ? Effect.succeed(value)
    : fail(`--${flag} must be a whole number of at least ${min}, got ${value}`)

/** A finite number of at least `min`. */
export const atLeast = (flag: string, value: number, min: number): Effect.Effect<number, UsageError> =>
  Number.isFinite(value) && value >= min ? Effect.succeed(value) : fail(`--${flag} must be at least ${min}, got ${value}`)

/** The same, for an optional flag. */
export const optionalWholeNumber = (flag: string, value: Option.Option<number>, min: number) =>
  Option.isSome(value) ? Effect.asSome(wholeNumber(flag, value.value, min)) : Effect.succeedNone

/** The shortest cluster token a node accepts. */
export { minTokenLength }

/** `--threads`: a whole number the stage engine accepts, 1 to 512 (services/RequestChecks.ts), when given. */
export const optionalThreads = (value: Option.Option<number>): Effect.Effect<Option.Option<number>, UsageError> => {
  if (Option.isNone(value)) return Effect.succeedNone
  const problem = threadsProblem(value.value, "--threads")
  return problem === undefined ? Effect.succeed(value) : fail(problem)
}

/** `--spares`: local spare agents, 0 to 64 (services/RequestChecks.ts), checked before any agent starts. */
export const spares = (value: number): Effect.Effect<number, UsageError> => {
  const problem = sparesProblem(value, "--spares")
  return problem === undefined ? Effect.succeed(value) : fail(problem)
}

/**
 * The cluster token: the file named by `--token-file` (trimmed), else SWACTOR_CLUSTER_TOKEN, else "" (none). A file
 * that cannot be read, a token shorter than 16 characters or one with under 64 bits of estimated entropy (repeated or
 * sequential characters: services/RequestChecks.ts) is a UsageError naming where it came from and how to make one.
 */
export const clusterToken = (tokenFile: Option.Option<string>): Effect.Effect<string, UsageError> =>
  Effect.gen(function*() {
    let token: string
    let source: string
    if (Option.isSome(tokenFile)) {
      source = `--token-file ${tokenFile.value}`
      token = yield* Effect.try({
        try: () => readFileSync(tokenFile.value, "utf8").trim(),
        catch: (cause) =>
          new UsageError({
            message: `--token-file ${tokenFile.value}: cannot read it (${
              (cause as NodeJS.ErrnoException).code ?? String(cause)
            })`
          })
      })
      if (token === "") return yield* fail(`--token-file ${tokenFile.value}: the file is empty`)
    } else {
      source = clusterTokenEnv
      token = process.env[clusterTokenEnv]?.trim() ?? ""
      if (token === "") return ""
    }
    const problem = clusterTokenProblem(token, source)
    if (problem !== undefined) return yield* fail(problem)
    return token
  })

/** `--nodes host:port,host:port`: at least one, each host:port. */
export const nodeList = (text: string): Effect.Effect<ReadonlyArray<string>, UsageError> =>
  Effect.gen(function*() {
    const nodes = text.split(",").map((n) => n.trim()).filter((n) => n.length > 0)
    if (nodes.length === 0) return yield* fail(`--nodes "${text}" names no node: give host:port,host:port,...`)
    for (const node of nodes) {
      const address = parseAddress(node)
      if (address === undefined || address._tag !== "Tcp") {
        return yield* fail(`--nodes: "${node}" is not host:port`)
      }
    }
    return nodes
  })

/** A comma-separated list flag: each item checked by `bad` (a reason, or undefined when good); none given is []. */
export const listFlag = (
  flag: string,
  value: Option.Option<string>,
  bad: (item: string) => string | undefined
): Effect.Effect<ReadonlyArray<string>, UsageError> =>
  Effect.gen(function*() {
    if (Option.isNone(value)) return []
    const items = value.value.split(",").map((item) => item.trim()).filter((item) => item !== "")
    for (const item of items) {
      const reason = bad(item)
      if (reason !== undefined) return yield* fail(`--${flag}: "${item}" is not valid: ${reason}`)
    }
    return items
  })

/**
 * The model's facts from its GGUF header, for checks before anything starts. A file that is no model stays a
 * ModelLoadError (its tag is what `run --json` reports), its message naming the file.
 */
export const modelFactsOf = (model: string) =>
  readModelFacts(model).pipe(
    Effect.mapError((error) =>
      error.message.includes(model) ? error : new ModelLoadError({ ...error, message: `${model}: ${error.message}` })
    )
  )

/** `Options.withDefault` that also says the default in `--help`. */
export const withShownDefault = <B>(value: B, shown: string = String(value)) =>
<A>(self: Options.Options<A>): Options.Options<A | B> =>
  self.pipe(Options.withDescription(`(default: ${shown})`), Options.withDefault(value))
