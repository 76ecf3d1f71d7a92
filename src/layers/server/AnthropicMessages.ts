/**
 * Anthropic's Messages API on `swactor serve` (what Claude Code and the Anthropic SDKs speak):
 *
 * | route | answer |
 * |---|---|
 * | POST /v1/messages | a message (`stream: true`: SSE `message_start`, `content_block_start`, `ping`, `content_block_delta`…, `content_block_stop`, `message_delta`, `message_stop`) |
 * | POST /v1/messages/count_tokens | `{"input_tokens": N}`: the prompt tokens the same body would generate from |
 *
 * The conversation goes through the model's chat template (`Server.formatChat`, as /v1/chat/completions does), so a
 * greedy message has the tokens of the same greedy chat completion. Errors are Anthropic's
 * `{"type":"error","error":{"type","message"}}`; a stream that fails after it started ends with an `error` event.
 * A client that goes away interrupts the handler, which cancels the run (as on the OpenAI routes).
 */
import { randomBytes } from "node:crypto"
import type * as HttpServerRequest from "@effect/platform/HttpServerRequest"
import * as HttpServerResponse from "@effect/platform/HttpServerResponse"
import { Chunk, Effect, Exit, Option, Schema, Scope, Stream } from "effect"
import type { ServeError, ServeEvent, ServeRequest, ServerService } from "../../services/Server.js"
import type { ChatMessage } from "../../services/Tokenizer.js"
import { clip, EdgeRefusal } from "./HttpGuard.js"

// --- bodies ---

const Num = Schema.optional(Schema.NullOr(Schema.Number))
const TextBlock = Schema.Struct({ type: Schema.Literal("text"), text: Schema.String })
/** Accepted by the schema so that the refusal can say in words what is not supported. */
const MediaBlock = Schema.Struct({ type: Schema.Literal("image", "document") })
const ToolUseBlock = Schema.Struct({
  type: Schema.Literal("tool_use"),
  id: Schema.String,
  name: Schema.String,
  input: Schema.Record({ key: Schema.String, value: Schema.Unknown })
})
const ToolResultBlock = Schema.Struct({
  type: Schema.Literal("tool_result"),
  tool_use_id: Schema.String,
  content: Schema.optional(Schema.Union(Schema.String, Schema.Array(Schema.Union(TextBlock, MediaBlock)))),
  is_error: Schema.optional(Schema.Boolean)
})
/** The model's earlier reasoning sent back in the history: this server never writes it, and leaves it out. */
const ThinkingBlock = Schema.Struct({ type: Schema.Literal("thinking", "redacted_thinking") })
const ContentBlock = Schema.Union(TextBlock, MediaBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock)

const Tool = Schema.Struct({
  name: Schema.String,
  description: Schema.optional(Schema.String),
  input_schema: Schema.optional(Schema.Record({ key: Schema.String, value: Schema.Unknown }))
})
const ToolChoice = Schema.Struct({
  type: Schema.Literal("auto", "any", "tool", "none"),
  name: Schema.optional(Schema.String),
  disable_parallel_tool_use: Schema.optional(Schema.Boolean)
})

const ConversationFields = {
  model: Schema.optional(Schema.String),
  messages: Schema.NonEmptyArray(
    Schema.Struct({
      role: Schema.Literal("user", "assistant"),
      content: Schema.Union(Schema.String, Schema.Array(ContentBlock))
    })
  ),
  system: Schema.optional(Schema.NullOr(Schema.Union(Schema.String, Schema.Array(TextBlock)))),
  tools: Schema.optional(Schema.NullOr(Schema.Array(Tool))),
  tool_choice: Schema.optional(Schema.NullOr(ToolChoice))
}

/** `POST /v1/messages`; other fields (metadata, thinking, service_tier…) are ignored. */
export const MessagesBody = Schema.Struct({
  ...ConversationFields,
  max_tokens: Schema.Int.pipe(Schema.greaterThanOrEqualTo(1)),
  temperature: Num,
  top_p: Num,
  top_k: Num,
  stop_sequences: Schema.optional(Schema.NullOr(Schema.Array(Schema.String))),
  stream: Schema.optional(Schema.NullOr(Schema.Boolean)),
  metadata: Schema.optional(Schema.Unknown)
})
export type MessagesBody = typeof MessagesBody.Type

/** `POST /v1/messages/count_tokens`: the conversation without the generation's settings. */
export const CountTokensBody = Schema.Struct(ConversationFields)
type Conversation = typeof CountTokensBody.Type

// --- conversion ---

const refuse = (message: string) => new EdgeRefusal(400, "invalid_request_error", clip(message), null)

/**
 * The conversation as chat messages for the model's template: `system` (a string or text blocks, joined) first, then
 * each message's text blocks joined. Refused (400) with the field named: images and documents, tool definitions and
 * tool blocks (not supported yet), and a last message from the assistant (a prefill the template cannot continue).
 */
export const chatMessagesOf = (body: Conversation): Effect.Effect<ReadonlyArray<ChatMessage>, EdgeRefusal> =>
  Effect.suspend(() => {
    if (body.tools !== undefined && body.tools !== null && body.tools.length > 0) {
      return Effect.fail(refuse("tools: tools are not supported yet on /v1/messages"))
    }
    const out: Array<ChatMessage> = []
    const system = body.system === undefined || body.system === null
      ? ""
      : typeof body.system === "string"
      ? body.system
      : body.system.map((block) => block.text).join("")
    if (system !== "") out.push({ role: "system", content: system })
    for (const [i, message] of body.messages.entries()) {
      if (typeof message.content === "string") {
        out.push({ role: message.role, content: message.content })
        continue
      }
      let text = ""
      for (const [j, block] of message.content.entries()) {
        const at = `messages.${i}.content.${j}`
        switch (block.type) {
          case "text":
            text += block.text
            break
          case "image":
            return Effect.fail(refuse(`${at}: images are not supported`))
          case "document":
            return Effect.fail(refuse(`${at}: documents are not supported`))
          case "tool_use":
          case "tool_result":
            return Effect.fail(refuse(`${at}: ${block.type} blocks are not supported yet on /v1/messages`))
          case "thinking":
          case "redacted_thinking":
            break
        }
      }
      out.push({ role: message.role, content: text })
    }
    if (body.messages[body.messages.length - 1]!.role === "assistant") {
      return Effect.fail(
        refuse(`messages.${body.messages.length - 1}: the last message must be the user's (continuing an assistant message is not supported)`)
      )
    }
    return Effect.succeed(out)
  })

type StopReason = "end_turn" | "max_tokens" | "stop_sequence"

/** Why a generation ended, in Anthropic's words: a stop sequence of the request's own, max tokens, or the model's turn ended. */
export const stopReasonOf = (
  done: Extract<ServeEvent, { _tag: "Done" }>,
  stopSequences: ReadonlyArray<string>
): { readonly stop_reason: StopReason; readonly stop_sequence: string | null } =>
  done.finishReason === "length"
    ? { stop_reason: "max_tokens", stop_sequence: null }
    : done.stopSequence !== undefined && stopSequences.includes(done.stopSequence)
    ? { stop_reason: "stop_sequence", stop_sequence: done.stopSequence }
    : { stop_reason: "end_turn", stop_sequence: null }

// --- errors ---

/** A refusal as the OpenAI routes answer it (HttpServe's failures, HttpGuard's EdgeRefusal). */
export interface RouteFailure {
  readonly status: number
  readonly type: string
  readonly message: string
  readonly code: string | null
  readonly retryAfter?: number | undefined
}

/**
 * A refusal in Anthropic's terms: the status kept, its error type by status (401 authentication_error, 403
 * permission_error, 404 not_found_error, 413 request_too_large, 5xx api_error, other 4xx invalid_request_error), except
 * that a full admission queue is 529 overloaded_error (Anthropic's status for "busy, retry later").
 */
const anthropicFailure = (failure: RouteFailure): { readonly status: number; readonly type: string } => {
  if (failure.code === "queue_full") return { status: 529, type: "overloaded_error" }
  switch (failure.status) {
    case 401:
      return { status: 401, type: "authentication_error" }
    case 403:
      return { status: 403, type: "permission_error" }
    case 404:
      return { status: 404, type: "not_found_error" }
    case 413:
      return { status: 413, type: "request_too_large" }
    default:
      return { status: failure.status, type: failure.status >= 500 ? "api_error" : "invalid_request_error" }
  }
}

const errorJson = (failure: RouteFailure) => ({
  type: "error",
  error: { type: anthropicFailure(failure).type, message: clip(failure.message) }
})

/** The answer to a refused /v1/messages request: Anthropic's error body, with Retry-After when there is one. */
export const anthropicErrorResponse = (failure: RouteFailure) =>
  HttpServerResponse.unsafeJson(errorJson(failure), {
    status: anthropicFailure(failure).status,
    headers: {
      ...(failure.retryAfter === undefined ? {} : { "retry-after": String(failure.retryAfter) }),
      // A body refused before it was read whole: the connection is not reused.
      ...(failure.status === 413 || failure.status === 408 ? { connection: "close" } : {})
    }
  })

/** The paths answered in Anthropic's shape (also their refusals at the edge: API key, caller). */
export const isMessagesPath = (path: string) => path === "/v1/messages" || path.startsWith("/v1/messages/")

// --- routes ---

export interface MessagesRoutesOptions<E> {
  readonly server: ServerService
  readonly modelName: string
  /** A `ping` event on an open stream while no other comes (the OpenAI routes' keep-alive). */
  readonly keepAliveMillis: number
  /** The request's body decoded with a schema after the edge checks (content type, size, depth). */
  readonly body: <A, I>(schema: Schema.Schema<A, I>) => Effect.Effect<A, E, HttpServerRequest.HttpServerRequest>
  /** A server error as the OpenAI routes answer it (status, words, Retry-After; a fault's details to the log). */
  readonly failureOf: (error: ServeError) => RouteFailure
}

const encoder = new TextEncoder()
const event = (type: string, data: Record<string, unknown>) =>
  encoder.encode(`event: ${type}\ndata: ${JSON.stringify({ type, ...data })}\n\n`)

const orUndefined = <A>(value: A | null | undefined): A | undefined => (value === null ? undefined : value)

/** The handlers of POST /v1/messages and POST /v1/messages/count_tokens over a Server. */
export const messagesRoutes = <E>(options: MessagesRoutesOptions<E>) => {
  const { server } = options
  const formatted = (body: Conversation) => Effect.flatMap(chatMessagesOf(body), server.formatChat)

  const create = Effect.gen(function*() {
    const body = yield* options.body(MessagesBody)
    const chat = yield* formatted(body)
    const ready = yield* server.ready
    // max_tokens is a ceiling (agents ask for tens of thousands): at most what fits the window the chat route gives a
    // request without a limit (4,096 tokens, or the model's context when smaller), so a request's KV stays bounded.
    const window = Math.min(ready.model.maxSeqLen, Math.max(4096, chat.tokens.length + 256))
    const maxTokens = Math.min(body.max_tokens, Math.max(1, window - chat.tokens.length - 1))
    const stopSequences = (body.stop_sequences ?? []).filter((s) => s !== "")
    const topP = orUndefined(body.top_p)
    const topK = orUndefined(body.top_k)
    const request: ServeRequest = {
      prompt: chat.tokens,
      maxTokens,
      sampling: {
        temperature: orUndefined(body.temperature) ?? 1,
        ...(topK === undefined ? {} : { topK }),
        ...(topP === undefined ? {} : { topP })
      },
      stop: [...stopSequences, ...chat.stop]
    }
    const message = {
      id: `msg_${randomBytes(12).toString("hex")}`,
      type: "message",
      role: "assistant",
      model: options.modelName
    }
    const events = server.generate(request)

    if (body.stream !== true) {
      let text = ""
      let done: Extract<ServeEvent, { _tag: "Done" }> | undefined
      for (const e of yield* Stream.runCollect(events)) {
        if (e._tag === "Text") text += e.text
        if (e._tag === "Done") done = e
      }
      return HttpServerResponse.unsafeJson({
        ...message,
        content: [{ type: "text", text }],
        ...(done === undefined ? { stop_reason: "max_tokens", stop_sequence: null } : stopReasonOf(done, stopSequences)),
        usage: { input_tokens: done?.promptTokens ?? chat.tokens.length, output_tokens: done?.completionTokens ?? 0 }
      })
    }

    // Refusals (busy, loading, bad values) come before the first event: they are answered with a status. Once the
    // first event came, the answer is SSE.
    const scope = yield* Scope.make()
    const pull = yield* Stream.toPull(events).pipe(Scope.extend(scope))
    const first = yield* pull.pipe(
      Effect.catchAll((end) => (Option.isNone(end) ? Effect.succeed(Chunk.empty<ServeEvent>()) : Effect.fail(end.value))),
      Effect.onExit((exit) => (Exit.isSuccess(exit) ? Effect.void : Scope.close(scope, exit)))
    )
    const head = [
      event("message_start", {
        message: {
          ...message,
          content: [],
          stop_reason: null,
          stop_sequence: null,
          usage: { input_tokens: chat.tokens.length, output_tokens: 0 }
        }
      }),
      event("content_block_start", { index: 0, content_block: { type: "text", text: "" } }),
      event("ping", {})
    ]
    const sse = Stream.concat(Stream.fromChunk(first), Stream.repeatEffectChunkOption(pull)).pipe(
      Stream.mapConcat((e): ReadonlyArray<Uint8Array> => {
        switch (e._tag) {
          case "Queued":
          case "Admitted":
            return []
          case "Text":
            return e.text === "" ? [] : [event("content_block_delta", { index: 0, delta: { type: "text_delta", text: e.text } })]
          case "Done":
            return [
              event("content_block_stop", { index: 0 }),
              event("message_delta", {
                delta: stopReasonOf(e, stopSequences),
                usage: { input_tokens: e.promptTokens, output_tokens: e.completionTokens }
              }),
              event("message_stop", {})
            ]
        }
      }),
      Stream.catchAll((error) => Stream.make(encoder.encode(`event: error\ndata: ${JSON.stringify(errorJson(options.failureOf(error)))}\n\n`))),
      (rest) => Stream.concat(Stream.fromIterable(head), rest),
      Stream.merge(Stream.tick(`${options.keepAliveMillis} millis`).pipe(Stream.drop(1), Stream.as(event("ping", {}))), {
        haltStrategy: "left"
      }),
      Stream.ensuring(Scope.close(scope, Exit.void))
    )
    return HttpServerResponse.stream(sse, {
      contentType: "text/event-stream",
      headers: { "cache-control": "no-cache", connection: "keep-alive", "x-accel-buffering": "no" }
    })
  })

  const countTokens = Effect.gen(function*() {
    const body = yield* options.body(CountTokensBody)
    const chat = yield* formatted(body)
    return HttpServerResponse.unsafeJson({ input_tokens: chat.tokens.length })
  })

  return { create, countTokens }
}
