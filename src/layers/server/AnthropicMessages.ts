/**
 * Anthropic's Messages API on `swactor serve` (what Claude Code and the Anthropic SDKs speak):
 *
 * | route | answer |
 * |---|---|
 * | POST /v1/messages | a message (`stream: true`: SSE `message_start`, `content_block_start`, `ping`, `content_block_delta`…, `content_block_stop`, `message_delta`, `message_stop`) |
 * | POST /v1/messages/count_tokens | `{"input_tokens": N}`: the prompt tokens the same body would generate from |
 *
 * The conversation goes through the model's chat template (`Server.formatChat`, as /v1/chat/completions does), so a
 * greedy message has the tokens of the same greedy chat completion. Tools map onto ToolCalls.ts as the OpenAI route's
 * do: `tools` (input_schema as the parameters), `tool_choice` (`any` = required, `tool` = that one, `none`),
 * `tool_use` blocks as the assistant's calls, `tool_result` blocks as tool messages; calls in the reply become
 * `tool_use` blocks (streamed as `input_json_delta`) with stop_reason `tool_use`. Errors are Anthropic's
 * `{"type":"error","error":{"type","message"}}`; a stream that fails after it started ends with an `error` event.
 * A client that goes away interrupts the handler, which cancels the run (as on the OpenAI routes).
 */
import { randomBytes } from "node:crypto"
import type * as HttpServerRequest from "@effect/platform/HttpServerRequest"
import * as HttpServerResponse from "@effect/platform/HttpServerResponse"
import { Chunk, Effect, Exit, Option, Schema, Scope, Stream } from "effect"
import type { ServeError, ServeEvent, ServeRequest, ServerService } from "../../services/Server.js"
import type { ChatMessage, FormattedChat } from "../../services/Tokenizer.js"
import type { ChatTool, ChatToolCall, ChatToolOptions, ToolChoice, ToolSyntax } from "../../services/Tools.js"
import { clip, EdgeRefusal } from "./HttpGuard.js"
import { rangeProblem } from "./SamplingRanges.js"
import { parseToolCalls, toolCallStream, type ToolCallPiece } from "./ToolCalls.js"
import {
  type ReasoningFormat,
  type ReasoningPiece,
  reasoningFormatOf,
  reasoningStream,
  splitReasoning
} from "./Reasoning.js"

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
  /** "custom" or absent: a function of the client's; Anthropic's server tools (web search, code execution…) are refused. */
  type: Schema.optional(Schema.NullOr(Schema.String)),
  name: Schema.String,
  description: Schema.optional(Schema.NullOr(Schema.String)),
  input_schema: Schema.Record({ key: Schema.String, value: Schema.Unknown })
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

/**
 * `POST /v1/messages`; other fields (metadata, thinking, service_tier…) are ignored. The numbers' ranges (max_tokens,
 * temperature, top_p, top_k) are SamplingRanges.ts's.
 */
export const MessagesBody = Schema.Struct({
  ...ConversationFields,
  max_tokens: Schema.Number,
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

const namePattern = /^[a-zA-Z0-9_-]{1,64}$/

const toolsOf = (body: Conversation): ReadonlyArray<ChatTool> | EdgeRefusal => {
  const tools: Array<ChatTool> = []
  for (const [i, tool] of (body.tools ?? []).entries()) {
    const at = `tools.${i}`
    if (tool.type !== undefined && tool.type !== null && tool.type !== "custom") {
      return refuse(
        `${at}.type: "${tool.type.slice(0, 40)}" is one of Anthropic's server tools, not supported here (only the client's own tools)`
      )
    }
    if (!namePattern.test(tool.name)) return refuse(`${at}.name must be 1 to 64 letters, digits, _ or -`)
    const before = tools.findIndex((t) => t.name === tool.name)
    if (before >= 0) return refuse(`${at}.name: "${tool.name}" is already the name of tools.${before}`)
    tools.push({
      name: tool.name,
      ...(typeof tool.description === "string" ? { description: tool.description } : {}),
      parameters: tool.input_schema
    })
  }
  return tools
}

const choiceOf = (body: Conversation, tools: ReadonlyArray<ChatTool>): ToolChoice | EdgeRefusal => {
  const choice = body.tool_choice
  if (choice === undefined || choice === null) return tools.length > 0 ? "auto" : "none"
  if (choice.type === "none" || choice.type === "auto") return choice.type
  if (tools.length === 0) return refuse(`tool_choice: "${choice.type}" needs tools`)
  if (choice.type === "any") return "required"
  if (choice.name === undefined || choice.name === "") return refuse('tool_choice.name is required with type "tool"')
  if (!tools.some((t) => t.name === choice.name))
    return refuse(`tool_choice.name: no tool named "${choice.name.slice(0, 64)}" in tools`)
  return { name: choice.name }
}

/** The conversation for the model's template, and its tool options (undefined: no tools, no calls in the history). */
export interface AnthropicChat {
  readonly messages: ReadonlyArray<ChatMessage>
  readonly tools: ChatToolOptions | undefined
}

type ConversationMessage = Conversation["messages"][number]
type ContentBlock = Exclude<ConversationMessage["content"], string>[number]

/** A user's tool_result block as a tool message answering a call of an earlier assistant message. */
const toolResultOf = (
  block: Extract<ContentBlock, { type: "tool_result" }>,
  at: string,
  callIds: ReadonlySet<string>
): ChatMessage | EdgeRefusal => {
  if (!callIds.has(block.tool_use_id)) {
    return refuse(
      `${at}.tool_use_id: "${block.tool_use_id.slice(0, 64)}" matches no tool_use of an earlier assistant message`
    )
  }
  let content = ""
  if (typeof block.content === "string") content = block.content
  else {
    for (const [k, part] of (block.content ?? []).entries()) {
      if (part.type !== "text")
        return refuse(`${at}.content.${k}: ${part.type === "image" ? "images" : "documents"} are not supported`)
      content += part.text
    }
  }
  return {
    role: "tool",
    toolCallId: block.tool_use_id,
    content: block.is_error === true ? `Error: ${content}` : content
  }
}

/**
 * Message `i`'s blocks as chat messages: its tool results first, then its text (an assistant's with its calls, whose
 * ids join `callIds` for later messages' results).
 */
const blocksOf = (
  message: ConversationMessage & { readonly content: ReadonlyArray<ContentBlock> },
  i: number,
  callIds: Set<string>
): ReadonlyArray<ChatMessage> | EdgeRefusal => {
  let text = ""
  const calls: Array<ChatToolCall> = []
  const results: Array<ChatMessage> = []
  for (const [j, block] of message.content.entries()) {
    const at = `messages.${i}.content.${j}`
    switch (block.type) {
      case "text":
        text += block.text
        break
      case "image":
        return refuse(`${at}: images are not supported`)
      case "document":
        return refuse(`${at}: documents are not supported`)
      case "tool_use":
        if (message.role !== "assistant") return refuse(`${at}: tool_use blocks belong in assistant messages`)
        calls.push({ id: block.id, name: block.name, arguments: JSON.stringify(block.input) })
        break
      case "tool_result": {
        if (message.role !== "user") return refuse(`${at}: tool_result blocks belong in user messages`)
        const result = toolResultOf(block, at, callIds)
        if (result instanceof EdgeRefusal) return result
        results.push(result)
        break
      }
      case "thinking":
      case "redacted_thinking":
        break
    }
  }
  for (const call of calls) callIds.add(call.id)
  const out: Array<ChatMessage> = [...results]
  if (message.role === "assistant")
    out.push({ role: "assistant", content: text, ...(calls.length > 0 ? { toolCalls: calls } : {}) })
  else if (results.length === 0 || text !== "") out.push({ role: "user", content: text })
  return out
}

/**
 * The conversation as chat messages for the model's template: `system` (a string or text blocks, joined) first, then
 * each message's text blocks joined; an assistant's `tool_use` blocks are its calls, a user's `tool_result` blocks are
 * tool messages (before the user's text), each answering a call of an earlier assistant message. Refused (400) with
 * the field named: images and documents, server tools, a tool choice naming no tool, results of no call, and a last
 * message from the assistant (a prefill the template cannot continue).
 */
export const chatOf = (body: Conversation): Effect.Effect<AnthropicChat, EdgeRefusal> =>
  Effect.suspend(() => {
    const tools = toolsOf(body)
    if (tools instanceof EdgeRefusal) return Effect.fail(tools)
    const choice = choiceOf(body, tools)
    if (choice instanceof EdgeRefusal) return Effect.fail(choice)
    const out: Array<ChatMessage> = []
    const system =
      body.system === undefined || body.system === null
        ? ""
        : typeof body.system === "string"
          ? body.system
          : body.system.map((block) => block.text).join("")
    if (system !== "") out.push({ role: "system", content: system })
    const callIds = new Set<string>()
    for (const [i, message] of body.messages.entries()) {
      if (typeof message.content === "string") {
        out.push({ role: message.role, content: message.content })
        continue
      }
      const messages = blocksOf({ ...message, content: message.content }, i, callIds)
      if (messages instanceof EdgeRefusal) return Effect.fail(messages)
      out.push(...messages)
    }
    if (body.messages[body.messages.length - 1]!.role === "assistant") {
      return Effect.fail(
        refuse(
          `messages.${body.messages.length - 1}: the last message must be the user's (continuing an assistant message is not supported)`
        )
      )
    }
    const used = tools.length > 0 || out.some((m) => m.role === "tool" || m.toolCalls !== undefined)
    return Effect.succeed({
      messages: out,
      tools: used
        ? { tools, choice, ...(body.tool_choice?.disable_parallel_tool_use === true ? { parallel: false } : {}) }
        : undefined
    })
  })

type StopReason = "end_turn" | "max_tokens" | "stop_sequence" | "tool_use"

/**
 * Why a generation ended, in Anthropic's words: max tokens (also when the reply called tools before it was cut), the
 * reply called tools, a stop sequence of the request's own, or the model's turn ended.
 */
export const stopReasonOf = (
  done: Extract<ServeEvent, { _tag: "Done" }>,
  stopSequences: ReadonlyArray<string>,
  called = false
): { readonly stop_reason: StopReason; readonly stop_sequence: string | null } =>
  done.finishReason === "length"
    ? { stop_reason: "max_tokens", stop_sequence: null }
    : called
      ? { stop_reason: "tool_use", stop_sequence: null }
      : done.stopText !== undefined && stopSequences.includes(done.stopText)
        ? { stop_reason: "stop_sequence", stop_sequence: done.stopText }
        : { stop_reason: "end_turn", stop_sequence: null }

// --- errors ---

/** A refusal as the OpenAI routes answer it (OpenAiErrors.ts HttpFailure, HttpGuard's EdgeRefusal). */
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

/**
 * A generation's usage in Anthropic's terms: `input_tokens` the prompt tokens prefilled, `cache_read_input_tokens` those
 * whose KV came from the prompt cache (their sum is the prompt, what count_tokens counts).
 */
const usageOf = (done: Extract<ServeEvent, { _tag: "Done" }>) => {
  const cached = done.cachedTokens ?? 0
  return {
    input_tokens: done.promptTokens - cached,
    output_tokens: done.completionTokens,
    cache_read_input_tokens: cached
  }
}

/** A reply's content so far: text and calls (ToolCalls.ts), or all text when the chat has no tools; its reasoning. */
interface Piece {
  readonly content: string
  readonly calls: ReadonlyArray<ChatToolCall>
  readonly reasoning?: string
}

/** Calls in Anthropic's shape: a `toolu_` id of its own, the arguments as an object. */
const toolUseOf = (call: ChatToolCall) => ({
  type: "tool_use" as const,
  id: `toolu_${randomBytes(12).toString("hex")}`,
  name: call.name,
  input: JSON.parse(call.arguments) as unknown
})

/** The model's reasoning as a thinking block (this server signs nothing: an empty signature). */
const thinkingOf = (thinking: string) => ({ type: "thinking" as const, thinking, signature: "" })

/**
 * The SSE events of a reply's content blocks as its pieces come: the reasoning in a thinking block (`thinking_delta`),
 * a text block opened at the first text after a call or the reasoning (or at the start), each call one `tool_use` block
 * (`input_json_delta` with its whole arguments), blocks numbered in order and each stopped before the next starts.
 */
export const contentBlocks = (textOpen: boolean) => {
  let index = textOpen ? 0 : -1
  let open: "text" | "thinking" | undefined = textOpen ? "text" : undefined
  let calls = 0
  const start = (kind: "text" | "thinking", out: Array<Uint8Array>) => {
    if (open === kind) return
    if (open !== undefined) out.push(event("content_block_stop", { index }))
    index++
    open = kind
    const content_block = kind === "text" ? { type: "text", text: "" } : thinkingOf("")
    out.push(event("content_block_start", { index, content_block }))
  }
  return {
    get calls() {
      return calls
    },
    push: (piece: Piece): Array<Uint8Array> => {
      const out: Array<Uint8Array> = []
      if (piece.reasoning !== undefined && piece.reasoning !== "") {
        start("thinking", out)
        out.push(event("content_block_delta", { index, delta: { type: "thinking_delta", thinking: piece.reasoning } }))
      }
      if (piece.content !== "") {
        start("text", out)
        out.push(event("content_block_delta", { index, delta: { type: "text_delta", text: piece.content } }))
      }
      for (const call of piece.calls) {
        if (open !== undefined) out.push(event("content_block_stop", { index }))
        open = undefined
        index++
        calls++
        const { id, name } = toolUseOf(call)
        out.push(
          event("content_block_start", { index, content_block: { type: "tool_use", id, name, input: {} } }),
          event("content_block_delta", { index, delta: { type: "input_json_delta", partial_json: call.arguments } }),
          event("content_block_stop", { index })
        )
      }
      return out
    },
    /** The last block stopped (an empty text block when the reply had none). */
    end: (): Array<Uint8Array> =>
      open !== undefined
        ? [event("content_block_stop", { index })]
        : index < 0
          ? [
              event("content_block_start", { index: 0, content_block: { type: "text", text: "" } }),
              event("content_block_stop", { index: 0 })
            ]
          : []
  }
}

type ReplyTools = { readonly syntax: ToolSyntax; readonly tools: ReadonlyArray<ChatTool> } | undefined

/** A whole reply: its reasoning (Reasoning.ts), then its text and calls (ToolCalls.ts; `cut` by max_tokens). */
export const wholeReply = (
  text: string,
  tools: ReplyTools,
  reasoning: ReasoningFormat | undefined,
  cut: boolean
): Piece => {
  const split = reasoning === undefined ? { reasoning: "", content: text } : splitReasoning(reasoning, text)
  const parsed =
    tools === undefined
      ? { content: split.content, calls: [] }
      : parseToolCalls(split.content, tools.syntax, tools.tools, true, cut)
  return { ...parsed, reasoning: split.reasoning }
}

/** A reply as it streams, split as `wholeReply` splits it (the pieces add up to the whole reply's). */
export const replyStream = (tools: ReplyTools, reasoning: ReasoningFormat | undefined) => {
  const calls = tools === undefined ? undefined : toolCallStream(tools.syntax, tools.tools)
  const thinking = reasoning === undefined ? undefined : reasoningStream(reasoning)
  const pieceOf = (split: ReasoningPiece, end: (() => ToolCallPiece) | undefined): Piece => {
    const piece = calls === undefined ? { content: split.content, calls: [] } : calls.push(split.content)
    const rest = end?.() ?? { content: "", calls: [] }
    return { reasoning: split.reasoning, content: piece.content + rest.content, calls: [...piece.calls, ...rest.calls] }
  }
  return {
    push: (text: string): Piece => pieceOf(thinking?.push(text) ?? { reasoning: "", content: text }, undefined),
    end: (cut: boolean): Piece =>
      pieceOf(thinking?.end() ?? { reasoning: "", content: "" }, calls === undefined ? undefined : () => calls.end(cut))
  }
}

/** The conversation checked and converted (chatOf), then rendered through the model's template. */
const formattedOf = (server: ServerService, body: Conversation) =>
  Effect.flatMap(chatOf(body), (chat) =>
    Effect.map(server.formatChat(chat.messages, chat.tools), (formatted) => ({ chat, formatted }))
  )

/** The message's own fields, the same in a whole answer and in message_start. */
interface MessageHead {
  readonly id: string
  readonly type: string
  readonly role: string
  readonly model: string
}

/** The reply as one JSON message: its thinking, text and tool_use blocks, why it stopped and its usage. */
const wholeAnswer = (
  events: Stream.Stream<ServeEvent, ServeError>,
  message: MessageHead,
  tools: ReplyTools,
  reasoning: ReasoningFormat | undefined,
  stopSequences: ReadonlyArray<string>,
  promptTokens: number
) =>
  Effect.gen(function* () {
    let text = ""
    let done: Extract<ServeEvent, { _tag: "Done" }> | undefined
    for (const e of yield* Stream.runCollect(events)) {
      if (e._tag === "Text") text += e.text
      if (e._tag === "Done") done = e
    }
    // Cut by max_tokens: the calls it completed, none it cut short (ToolCalls.ts).
    const reply = wholeReply(text, tools, reasoning, done === undefined || done.finishReason === "length")
    return HttpServerResponse.unsafeJson({
      ...message,
      content: [
        ...(reply.reasoning === undefined || reply.reasoning === "" ? [] : [thinkingOf(reply.reasoning)]),
        ...(reply.content !== "" || reply.calls.length === 0 ? [{ type: "text", text: reply.content }] : []),
        ...reply.calls.map(toolUseOf)
      ],
      ...(done === undefined
        ? { stop_reason: "max_tokens", stop_sequence: null }
        : stopReasonOf(done, stopSequences, reply.calls.length > 0)),
      usage:
        done === undefined
          ? { input_tokens: promptTokens, output_tokens: 0, cache_read_input_tokens: 0 }
          : usageOf(done)
    })
  })

/**
 * The run's events, their first pulled now: refusals (busy, loading, bad values) come before the first event and are
 * answered with a status. Once the first event came, the answer is SSE; `scope` holds the run until the stream ends.
 */
const pulledFirst = (events: Stream.Stream<ServeEvent, ServeError>) =>
  Effect.gen(function* () {
    const scope = yield* Scope.make()
    const pull = yield* Stream.toPull(events).pipe(Scope.extend(scope))
    const first = yield* pull.pipe(
      Effect.catchAll((end) =>
        Option.isNone(end) ? Effect.succeed(Chunk.empty<ServeEvent>()) : Effect.fail(end.value)
      ),
      Effect.onExit((exit) => (Exit.isSuccess(exit) ? Effect.void : Scope.close(scope, exit)))
    )
    return { scope, all: Stream.concat(Stream.fromChunk(first), Stream.repeatEffectChunkOption(pull)) }
  })

/** The reply as Anthropic's SSE: message_start, its content blocks as they come, message_delta and message_stop. */
const streamedAnswer = <E>(
  options: MessagesRoutesOptions<E>,
  events: Stream.Stream<ServeEvent, ServeError>,
  message: MessageHead,
  tools: ReplyTools,
  reasoning: ReasoningFormat | undefined,
  stopSequences: ReadonlyArray<string>,
  promptTokens: number
) =>
  Effect.gen(function* () {
    const { all, scope } = yield* pulledFirst(events)
    // Without tools the text block opens at once (Anthropic's order: message_start, content_block_start, ping); with
    // tools the first block is whatever the reply starts with.
    const blocks = contentBlocks(tools === undefined && reasoning === undefined)
    const reply = replyStream(tools, reasoning)
    const head = [
      event("message_start", {
        message: {
          ...message,
          content: [],
          stop_reason: null,
          stop_sequence: null,
          usage: { input_tokens: promptTokens, output_tokens: 0, cache_read_input_tokens: 0 }
        }
      }),
      ...(tools === undefined && reasoning === undefined
        ? [event("content_block_start", { index: 0, content_block: { type: "text", text: "" } })]
        : []),
      event("ping", {})
    ]
    const sse = all.pipe(
      Stream.mapConcat((e): ReadonlyArray<Uint8Array> => {
        switch (e._tag) {
          case "Queued":
          case "Admitted":
            return []
          case "Text":
            return blocks.push(reply.push(e.text))
          case "Done":
            return [
              ...blocks.push(reply.end(e.finishReason === "length")),
              ...blocks.end(),
              event("message_delta", { delta: stopReasonOf(e, stopSequences, blocks.calls > 0), usage: usageOf(e) }),
              event("message_stop", {})
            ]
        }
      }),
      Stream.catchAll((error) =>
        Stream.make(encoder.encode(`event: error\ndata: ${JSON.stringify(errorJson(options.failureOf(error)))}\n\n`))
      ),
      (rest) => Stream.concat(Stream.fromIterable(head), rest),
      Stream.merge(
        Stream.tick(`${options.keepAliveMillis} millis`).pipe(Stream.drop(1), Stream.as(event("ping", {}))),
        {
          haltStrategy: "left"
        }
      ),
      Stream.ensuring(Scope.close(scope, Exit.void))
    )
    return HttpServerResponse.stream(sse, {
      contentType: "text/event-stream",
      headers: { "cache-control": "no-cache", connection: "keep-alive", "x-accel-buffering": "no" }
    })
  })

/** The request the server runs for a Messages body: its prompt, max tokens, sampling and stop strings. */
const serveRequestOf = (
  body: typeof MessagesBody.Type,
  chat: FormattedChat,
  maxTokens: number,
  stopSequences: ReadonlyArray<string>
): ServeRequest => {
  const topP = orUndefined(body.top_p)
  const topK = orUndefined(body.top_k)
  return {
    prompt: chat.tokens,
    maxTokens,
    sampling: {
      temperature: orUndefined(body.temperature) ?? 1,
      ...(topK === undefined ? {} : { topK }),
      ...(topP === undefined ? {} : { topP }),
      // A tool choice that forces a call samples under its grammar (ToolCalls.ts toolGrammar).
      ...(chat.tools?.grammar === undefined ? {} : { grammar: { text: chat.tools.grammar } })
    },
    stop: [...stopSequences, ...chat.stop]
  }
}

/** POST /v1/messages */
const create = <E>(options: MessagesRoutesOptions<E>) =>
  Effect.gen(function* () {
    const { server } = options
    const body = yield* options.body(MessagesBody)
    // Each number within Anthropic's documented range (SamplingRanges.ts), before anything else.
    const outside = rangeProblem("messages", body)
    if (outside !== undefined) return yield* Effect.fail(refuse(outside.message))
    const { chat: conversation, formatted: chat } = yield* formattedOf(server, body)
    const ready = yield* server.ready
    // max_tokens is a ceiling (agents ask for tens of thousands): at most what fits the window the chat route gives a
    // request without a limit (4,096 tokens, or the model's context when smaller), so a request's KV stays bounded.
    const window = Math.min(ready.model.maxSeqLen, Math.max(4096, chat.tokens.length + 256))
    const maxTokens = Math.min(body.max_tokens, Math.max(1, window - chat.tokens.length - 1))
    const stopSequences = (body.stop_sequences ?? []).filter((s) => s !== "")
    const request = serveRequestOf(body, chat, maxTokens, stopSequences)
    // With tools, the reply's calls in the template's syntax (ToolCalls.ts).
    const tools: ReplyTools =
      chat.tools === undefined || conversation.tools === undefined
        ? undefined
        : { syntax: chat.tools.syntax, tools: conversation.tools.tools }
    // The reply's reasoning (gpt-oss's harmony, MiniMax-M2's <think>) as thinking blocks (Reasoning.ts).
    const reasoning = reasoningFormatOf(chat.template)
    const message: MessageHead = {
      id: `msg_${randomBytes(12).toString("hex")}`,
      type: "message",
      role: "assistant",
      model: options.modelName
    }
    const events = server.generate(request)
    return body.stream !== true
      ? yield* wholeAnswer(events, message, tools, reasoning, stopSequences, chat.tokens.length)
      : yield* streamedAnswer(options, events, message, tools, reasoning, stopSequences, chat.tokens.length)
  })

/** The handlers of POST /v1/messages and POST /v1/messages/count_tokens over a Server. */
export const messagesRoutes = <E>(options: MessagesRoutesOptions<E>) => {
  const countTokens = Effect.gen(function* () {
    const body = yield* options.body(CountTokensBody)
    const { formatted: chat } = yield* formattedOf(options.server, body)
    return HttpServerResponse.unsafeJson({ input_tokens: chat.tokens.length })
  })
  return { create: create(options), countTokens }
}
