/**
 * The request bodies of OpenAI's /v1/completions and /v1/chat/completions (Schema, checked before anything runs) and
 * the Server request a body asks for: its sampling fields, log-probs, n and structured output (OpenAiSampling.ts),
 * stop strings and max tokens.
 */
import { Effect, Schema } from "effect"
import type { ServeRequest } from "../../services/Server.js"
import { ChatMessageBody, ToolFields } from "./OpenAiTools.js"
import { OpenAiSamplingFields, openAiSampling } from "./OpenAiSampling.js"
import { HttpFailure } from "./OpenAiErrors.js"

const Num = Schema.optional(Schema.NullOr(Schema.Number))
const SamplingFields = {
  model: Schema.optional(Schema.String),
  max_tokens: Num,
  temperature: Num,
  top_p: Num,
  top_k: Num,
  min_p: Num,
  seed: Num,
  n: Num,
  stop: Schema.optional(Schema.NullOr(Schema.Union(Schema.String, Schema.Array(Schema.String)))),
  stream: Schema.optional(Schema.NullOr(Schema.Boolean)),
  stream_options: Schema.optional(
    Schema.NullOr(Schema.Struct({ include_usage: Schema.optional(Schema.NullOr(Schema.Boolean)) }))
  ),
  ...OpenAiSamplingFields
}

export const CompletionBody = Schema.Struct({
  ...SamplingFields,
  prompt: Schema.Union(Schema.String, Schema.Array(Schema.String), Schema.Array(Schema.Number))
})
export type CompletionBody = typeof CompletionBody.Type

export const ChatBody = Schema.Struct({
  ...SamplingFields,
  max_completion_tokens: Num,
  ...ToolFields,
  messages: Schema.NonEmptyArray(ChatMessageBody)
})
export type ChatBody = typeof ChatBody.Type

export const orUndefined = <A>(value: A | null | undefined): A | undefined => (value === null ? undefined : value)

export const serveRequest = (
  body: CompletionBody | ChatBody,
  prompt: ServeRequest["prompt"],
  maxTokens: number | undefined,
  extraStop: ReadonlyArray<string> = [],
  parallel = 1
) =>
  Effect.gen(function* () {
    const stop =
      body.stop === undefined || body.stop === null ? [] : typeof body.stop === "string" ? [body.stop] : body.stop
    // Sampling fields, log-probs, n and structured output (OpenAiSampling.ts): a problem is a 400 naming the field.
    const { sampling, n } = yield* openAiSampling(body, { chat: "messages" in body, parallel }).pipe(
      Effect.mapError((message) => new HttpFailure(400, "invalid_request_error", message))
    )
    return {
      prompt,
      ...(maxTokens === undefined ? {} : { maxTokens }),
      sampling,
      stop: [...stop, ...extraStop],
      n
    } satisfies ServeRequest & { readonly n: number }
  })

/** Token ids as given: whole numbers ≥ 0 (their range against the vocabulary is the Server's check). */
export const tokenIds = (ids: ReadonlyArray<number>): Effect.Effect<ReadonlyArray<number>, HttpFailure> => {
  const at = ids.findIndex((id) => !Number.isSafeInteger(id) || id < 0)
  return at < 0
    ? Effect.succeed(ids)
    : Effect.fail(
        new HttpFailure(
          400,
          "invalid_request_error",
          `prompt[${at}]: a token id must be a whole number ≥ 0, got ${ids[at]}`
        )
      )
}
