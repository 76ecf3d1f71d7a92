/**
 * A completion streamed as server-sent events: OpenAI's chunks (`data: {...}`) as the choices' text comes, with tool
 * calls as delta.tool_calls (ToolCalls.ts; each call whole, once complete) and the reasoning (harmony's analysis
 * channel, MiniMax-M2's `<think>`) as delta.reasoning_content (Reasoning.ts), then each choice's finish, the usage when asked for, and `data: [DONE]`. A refusal before the first event is
 * answered with its status instead; a failure after it ends the stream with an `error` event and `data: [DONE]`. A
 * comment line keeps an idle stream open.
 */
import * as HttpServerResponse from "@effect/platform/HttpServerResponse"
import { Chunk, Effect, Exit, Option, Scope, Stream } from "effect"
import type { Server, ServeEvent, ServeRequest, TextLogprob } from "../../services/Server.js"
import type { ChatTool, ToolSyntax } from "../../services/Tools.js"
import { toolCallDelta } from "./OpenAiTools.js"
import { toolCallStream, type ToolCallPiece } from "./ToolCalls.js"
import { type ReasoningFormat, type ReasoningPiece, reasoningStream } from "./Reasoning.js"
import { entriesLength } from "./Logprobs.js"
import { completionChunk, type ResponseShape, usageOf } from "./OpenAiChunks.js"
import { errorJson, fromServeError } from "./OpenAiErrors.js"

const encoder = new TextEncoder()
const sse = (data: unknown) => encoder.encode(`data: ${typeof data === "string" ? data : JSON.stringify(data)}\n\n`)

/** The choices' runs (one request each) as one SSE response. */
export const streamCompletion = (
  server: Server["Type"],
  shape: ResponseShape,
  requests: ReadonlyArray<ServeRequest>,
  includeUsage: boolean,
  keepAliveMillis: number,
  logprobsJson: (entries: ReadonlyArray<TextLogprob>, offset: number) => object | null,
  tools:
    { readonly syntax: ToolSyntax; readonly tools: ReadonlyArray<ChatTool>; readonly parallel: boolean } | undefined,
  reasoning: ReasoningFormat | undefined
) =>
  Effect.gen(function* () {
    const events = Stream.mergeAll(
      requests.map((r, index) => server.generate(r).pipe(Stream.map((event) => ({ index, event })))),
      { concurrency: "unbounded" }
    )
    // Refusals come before the first event: answer them with a status. Once accepted, the response is SSE.
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
    const all = Stream.concat(Stream.fromChunk(first), Stream.repeatEffectChunkOption(pull))
    // Each choice's own state. With tools: text that might start a call is held back; calls go out as delta.tool_calls.
    const choices = requests.map(() => ({
      roleSent: false,
      calls: tools === undefined ? undefined : toolCallStream(tools.syntax, tools.tools, tools.parallel),
      reasoning: reasoning === undefined ? undefined : reasoningStream(reasoning),
      callCount: 0,
      // completions' text_offset so far
      offset: 0
    }))
    let finished = 0
    let promptTokens = 0
    let completionTokens = 0
    let cachedTokens = 0
    // a call goes out whole once it is complete (ToolCalls.ts): one chunk with its index, id, type, name and arguments
    const toolChunks = (index: number, piece: ToolCallPiece) => {
      const c = choices[index]!
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
    const reasoningChunks = (index: number, piece: ReasoningPiece) => {
      const c = choices[index]!
      return [
        ...(piece.reasoning === ""
          ? []
          : [sse(completionChunk(shape, { index, finish: null, delta: { reasoning_content: piece.reasoning } }))]),
        ...(c.calls !== undefined
          ? toolChunks(index, c.calls.push(piece.content))
          : piece.content === ""
            ? []
            : [sse(completionChunk(shape, { index, text: piece.content, role: !c.roleSent, finish: null }))])
      ]
    }
    const body = all.pipe(
      Stream.mapConcat(({ index, event }): ReadonlyArray<Uint8Array> => {
        const c = choices[index]!
        switch (event._tag) {
          case "Queued":
            return []
          case "Admitted":
            if (!shape.chat) return []
            c.roleSent = true
            return [sse(completionChunk(shape, { index, text: "", role: true, finish: null }))]
          case "Text": {
            const entries = event.logprobs ?? []
            const logprobs = logprobsJson(entries, c.offset)
            c.offset += entriesLength(entries)
            if (c.reasoning !== undefined) return reasoningChunks(index, c.reasoning.push(event.text))
            if (c.calls !== undefined) return toolChunks(index, c.calls.push(event.text))
            return [sse(completionChunk(shape, { index, text: event.text, role: !c.roleSent, finish: null, logprobs }))]
          }
          case "Done":
            finished++
            promptTokens = event.promptTokens
            completionTokens += event.completionTokens
            cachedTokens = Math.max(cachedTokens, event.cachedTokens ?? 0)
            // Cut by max_tokens: the calls it completed went out, one it cut short does not, and the finish says length.
            return [
              ...(c.reasoning === undefined ? [] : reasoningChunks(index, c.reasoning.end())),
              ...(c.calls === undefined ? [] : toolChunks(index, c.calls.end(event.finishReason === "length"))),
              sse(
                completionChunk(shape, {
                  index,
                  finish: c.callCount > 0 && event.finishReason !== "length" ? "tool_calls" : event.finishReason
                })
              ),
              ...(includeUsage && finished === requests.length
                ? [
                    sse({
                      id: shape.id,
                      object: shape.chat ? "chat.completion.chunk" : "text_completion",
                      created: shape.created,
                      model: shape.model,
                      choices: [],
                      usage: usageOf(promptTokens, completionTokens, cachedTokens)
                    })
                  ]
                : [])
            ]
        }
      }),
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
