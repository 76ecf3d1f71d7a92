/**
 * A completion streamed as server-sent events: OpenAI's chunks (`data: {...}`) as the choices' text comes, with tool
 * calls as delta.tool_calls (ToolCalls.ts; each call whole, once complete) and the reasoning (harmony's analysis
 * channel, MiniMax-M2's `<think>`) as delta.reasoning_content (Reasoning.ts), then each choice's finish, the usage when asked for, and `data: [DONE]`. A refusal before the first event is
 * answered with its status instead; a failure after it ends the stream with an `error` event and `data: [DONE]`. A
 * comment line keeps an idle stream open.
 */
import * as HttpServerResponse from "@effect/platform/HttpServerResponse"
import { Chunk, Effect, Exit, Option, Scope, Stream } from "effect"
import type { Server, ServeError, ServeEvent, ServeRequest, TextLogprob } from "../../services/Server.js"
import type { ChatTool, ToolSyntax } from "../../services/Tools.js"
import { toolCallDelta } from "./OpenAiTools.js"
import { toolCallStream, type ToolCallPiece } from "./ToolCalls.js"
import { type ReasoningFormat, type ReasoningPiece, reasoningStream } from "./Reasoning.js"
import { entriesLength } from "./Logprobs.js"
import { completionChunk, type ResponseShape, usageOf } from "./OpenAiChunks.js"
import { errorJson, fromServeError } from "./OpenAiErrors.js"

const encoder = new TextEncoder()
const sse = (data: unknown) => encoder.encode(`data: ${typeof data === "string" ? data : JSON.stringify(data)}\n\n`)

/** A chat's tools: their syntax, the tools, and whether several calls may come in one reply. */
type ToolsOption =
  { readonly syntax: ToolSyntax; readonly tools: ReadonlyArray<ChatTool>; readonly parallel: boolean } | undefined

/** Each choice's own state. With tools: text that might start a call is held back; calls go out as delta.tool_calls. */
const choiceState = (tools: ToolsOption, reasoning: ReasoningFormat | undefined) => ({
  roleSent: false,
  calls: tools === undefined ? undefined : toolCallStream(tools.syntax, tools.tools, tools.parallel),
  reasoning: reasoning === undefined ? undefined : reasoningStream(reasoning),
  callCount: 0,
  // completions' text_offset so far
  offset: 0
})

/** What the stream's chunks are made from: the answer's shape, its choices' states and the usage so far. */
interface SseState {
  readonly shape: ResponseShape
  readonly choiceCount: number
  readonly includeUsage: boolean
  readonly logprobsJson: (entries: ReadonlyArray<TextLogprob>, offset: number) => object | null
  readonly choices: ReadonlyArray<ReturnType<typeof choiceState>>
  finished: number
  promptTokens: number
  completionTokens: number
  cachedTokens: number
}

// a call goes out whole once it is complete (ToolCalls.ts): one chunk with its index, id, type, name and arguments
const toolChunks = (state: SseState, index: number, piece: ToolCallPiece) => {
  const { shape } = state
  const c = state.choices[index]!
  return [
    ...(piece.content === ""
      ? []
      : [sse(completionChunk(shape, { index, text: piece.content, role: !c.roleSent, finish: null }))]),
    ...piece.calls.map((call) =>
      sse(completionChunk(shape, { index, finish: null, delta: toolCallDelta(c.callCount++, call) }))
    )
  ]
}

// reasoning as delta.reasoning_content, the rest on as content (through the tools' parser with tools)
const reasoningChunks = (state: SseState, index: number, piece: ReasoningPiece) => {
  const { shape } = state
  const c = state.choices[index]!
  return [
    ...(piece.reasoning === ""
      ? []
      : [sse(completionChunk(shape, { index, finish: null, delta: { reasoning_content: piece.reasoning } }))]),
    ...(c.calls !== undefined
      ? toolChunks(state, index, c.calls.push(piece.content))
      : piece.content === ""
        ? []
        : [sse(completionChunk(shape, { index, text: piece.content, role: !c.roleSent, finish: null }))])
  ]
}

/** A choice is done: its held-back pieces, its finish, and (the last one, when asked for) the usage. */
const doneChunks = (state: SseState, index: number, event: Extract<ServeEvent, { _tag: "Done" }>) => {
  const { shape } = state
  const c = state.choices[index]!
  state.finished++
  state.promptTokens = event.promptTokens
  state.completionTokens += event.completionTokens
  state.cachedTokens = Math.max(state.cachedTokens, event.cachedTokens ?? 0)
  // Cut by max_tokens: the calls it completed went out, one it cut short does not, and the finish says length.
  return [
    ...(c.reasoning === undefined ? [] : reasoningChunks(state, index, c.reasoning.end())),
    ...(c.calls === undefined ? [] : toolChunks(state, index, c.calls.end(event.finishReason === "length"))),
    sse(
      completionChunk(shape, {
        index,
        finish: c.callCount > 0 && event.finishReason !== "length" ? "tool_calls" : event.finishReason
      })
    ),
    ...(state.includeUsage && state.finished === state.choiceCount
      ? [
          sse({
            id: shape.id,
            object: shape.chat ? "chat.completion.chunk" : "text_completion",
            created: shape.created,
            model: shape.model,
            choices: [],
            usage: usageOf(state.promptTokens, state.completionTokens, state.cachedTokens)
          })
        ]
      : [])
  ]
}

/** One choice's event as SSE chunks. */
const eventChunks = (state: SseState, index: number, event: ServeEvent): ReadonlyArray<Uint8Array> => {
  const { shape } = state
  const c = state.choices[index]!
  switch (event._tag) {
    case "Queued":
      return []
    case "Admitted":
      if (!shape.chat) return []
      c.roleSent = true
      return [sse(completionChunk(shape, { index, text: "", role: true, finish: null }))]
    case "Text": {
      const entries = event.logprobs ?? []
      const logprobs = state.logprobsJson(entries, c.offset)
      c.offset += entriesLength(entries)
      if (c.reasoning !== undefined) return reasoningChunks(state, index, c.reasoning.push(event.text))
      if (c.calls !== undefined) return toolChunks(state, index, c.calls.push(event.text))
      return [sse(completionChunk(shape, { index, text: event.text, role: !c.roleSent, finish: null, logprobs }))]
    }
    case "Done":
      return doneChunks(state, index, event)
  }
}

/**
 * The choices' events, their first pulled now: refusals come before the first event (the caller answers them with a
 * status). Once accepted, the response is SSE; `scope` holds the runs until the stream ends.
 */
const pulledFirst = (events: Stream.Stream<{ index: number; event: ServeEvent }, ServeError>) =>
  Effect.gen(function* () {
    const scope = yield* Scope.make()
    const pull = yield* Stream.toPull(events).pipe(Scope.extend(scope))
    const first = yield* pull.pipe(
      Effect.catchAll((end) =>
        Option.isNone(end)
          ? Effect.succeed(Chunk.empty<{ index: number; event: ServeEvent }>())
          : Effect.fail(end.value)
      ),
      Effect.onExit((exit) => (Exit.isSuccess(exit) ? Effect.void : Scope.close(scope, exit)))
    )
    return { scope, all: Stream.concat(Stream.fromChunk(first), Stream.repeatEffectChunkOption(pull)) }
  })

/** The choices' runs (one request each) as one SSE response. */
export const streamCompletion = (
  server: Server["Type"],
  shape: ResponseShape,
  requests: ReadonlyArray<ServeRequest>,
  includeUsage: boolean,
  keepAliveMillis: number,
  logprobsJson: (entries: ReadonlyArray<TextLogprob>, offset: number) => object | null,
  tools: ToolsOption,
  reasoning: ReasoningFormat | undefined
) =>
  Effect.gen(function* () {
    const events = Stream.mergeAll(
      requests.map((r, index) => server.generate(r).pipe(Stream.map((event) => ({ index, event })))),
      { concurrency: "unbounded" }
    )
    // Refusals come before the first event: answer them with a status. Once accepted, the response is SSE.
    const { all, scope } = yield* pulledFirst(events)
    const state: SseState = {
      shape,
      choiceCount: requests.length,
      includeUsage,
      logprobsJson,
      choices: requests.map(() => choiceState(tools, reasoning)),
      finished: 0,
      promptTokens: 0,
      completionTokens: 0,
      cachedTokens: 0
    }
    const body = all.pipe(
      Stream.mapConcat(({ event, index }) => eventChunks(state, index, event)),
      Stream.concat(Stream.make(sse("[DONE]"))),
      Stream.catchAll((error) => Stream.make(sse(errorJson(fromServeError(error))), sse("[DONE]"))),
      Stream.merge(
        Stream.tick(`${keepAliveMillis} millis`).pipe(Stream.drop(1), Stream.as(encoder.encode(": keep-alive\n\n"))),
        {
          haltStrategy: "left"
        }
      ),
      Stream.ensuring(Scope.close(scope, Exit.void))
    )
    return HttpServerResponse.stream(body, {
      contentType: "text/event-stream",
      headers: { "cache-control": "no-cache", connection: "keep-alive", "x-accel-buffering": "no" }
    })
  })
