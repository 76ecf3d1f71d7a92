/**
 * Flag checks every command uses: each bad value is a `UsageError` whose message is one line naming the flag, found
 * before anything starts (no agent spawned, no model read). The flags run, serve and node share, with their checks,
 * are cli/PipelineFlags.ts.
 */
import { Data, Effect, Option } from "effect"
import { readModelFacts } from "../api/modelFacts.js"
import { ModelLoadError } from "../domain/gguf.js"

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
  Number.isFinite(value) && value >= min
    ? Effect.succeed(value)
    : fail(`--${flag} must be at least ${min}, got ${value}`)

/** The same, for an optional flag. */
export const optionalWholeNumber = (flag: string, value: Option.Option<number>, min: number) =>
  Option.isSome(value) ? Effect.asSome(wholeNumber(flag, value.value, min)) : Effect.succeedNone

/** A comma-separated list flag: each item checked by `bad` (a reason, or undefined when good); none given is []. */
export const listFlag = (
  flag: string,
  value: Option.Option<string>,
  bad: (item: string) => string | undefined
): Effect.Effect<ReadonlyArray<string>, UsageError> =>
  Effect.gen(function* () {
    if (Option.isNone(value)) return []
    const items = value.value
      .split(",")
      .map((item) => item.trim())
      .filter((item) => item !== "")
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
