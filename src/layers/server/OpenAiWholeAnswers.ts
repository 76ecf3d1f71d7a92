/**
 * The answer to one OpenAI completion request: n choices (n > 1: one Server request per choice, batched like separate
 * requests; with a seed, choice i has seed + i), answered whole as one JSON (choices, tool calls, reasoning, usage) or
 * streamed (OpenAiSse.ts).
 */
import * as HttpServerResponse from "@effect/platform/HttpServerResponse"
import { Effect, Stream } from "effect"
import type { Server, ServeEvent, ServeRequest, TextLogprob } from "../../services/Server.js"
import type { ChatTool, ToolSyntax } from "../../services/Tools.js"
import { toolCallsJson } from "./OpenAiTools.js"
import { parseToolCalls } from "./ToolCalls.js"
import { type ReasoningFormat, splitReasoning } from "./Reasoning.js"
import { chatLogprobs, completionLogprobs } from "./Logprobs.js"
import { type ResponseShape, usageOf } from "./OpenAiChunks.js"
import { streamCompletion } from "./OpenAiSse.js"

/** A chat with tools: the reply's calls, in the template's syntax, become tool_calls (ToolCalls.ts). */
type ToolsOption = { readonly syntax: ToolSyntax; readonly tools: ReadonlyArray<ChatTool>; readonly parallel: boolean }

/** The usage over the choices: the prompt once, every choice's completion. */
interface Usage {
  promptTokens: number
  completionTokens: number
  cachedTokens: number
}

/** One choice answered whole from its run's events: its text (or tool calls), reasoning, logprobs and finish. */
const wholeChoice = (
  all: Iterable<ServeEvent>,
  index: number,
  usage: Usage,
  shape: ResponseShape,
  logprobsJson: (entries: ReadonlyArray<TextLogprob>, offset: number) => object | null,
  tools: ToolsOption | undefined,
  reasoningFormat: ReasoningFormat | undefined
) => {
  let text = ""
  let done: Extract<ServeEvent, { _tag: "Done" }> | undefined
  const entries: Array<TextLogprob> = []
  for (const event of all) {
    if (event._tag === "Text") {
      text += event.text
      if (event.logprobs !== undefined) entries.push(...event.logprobs)
    }
    if (event._tag === "Done") done = event
  }
  if (done !== undefined) {
    usage.promptTokens = done.promptTokens
    usage.completionTokens += done.completionTokens
    usage.cachedTokens = Math.max(usage.cachedTokens, done.cachedTokens ?? 0)
  }
  const logprobs = logprobsJson(entries, 0)
  const split = reasoningFormat === undefined ? undefined : splitReasoning(reasoningFormat, text)
  if (split !== undefined) text = split.content
  const reasoning = split === undefined || split.reasoning === "" ? {} : { reasoning_content: split.reasoning }
  const finish = done?.finishReason ?? "length"
  // Cut by max_tokens: the calls it completed, none it cut short, and finish_reason length.
  const parsed =
    tools === undefined
      ? undefined
      : parseToolCalls(text, tools.syntax, tools.tools, tools.parallel, finish === "length")
  if (parsed !== undefined && parsed.calls.length > 0) {
    return {
      index,
      message: {
        role: "assistant",
        content: parsed.content === "" ? null : parsed.content,
        ...reasoning,
        tool_calls: toolCallsJson(parsed.calls)
      },
      logprobs,
      finish_reason: finish === "length" ? finish : "tool_calls"
    }
  }
  if (parsed !== undefined) text = parsed.content
  return shape.chat
    ? { index, message: { role: "assistant", content: text, ...reasoning }, logprobs, finish_reason: finish }
    : { index, text, logprobs, finish_reason: finish }
}

export const respond = (
  server: Server["Type"],
  shape: ResponseShape,
  request: ServeRequest,
  stream: boolean,
  includeUsage: boolean,
  keepAliveMillis: number,
  // A chat with tools: the reply's calls, in the template's syntax, become tool_calls (ToolCalls.ts).
  tools?: ToolsOption,
  // a template whose replies hold reasoning (gpt-oss's harmony, MiniMax-M2's <think>): it is reasoning_content (Reasoning.ts)
  reasoningFormat?: ReasoningFormat
) =>
  Effect.gen(function* () {
    // n > 1 (serveRequest's `n`): one request per choice, batched like separate requests; with a seed, choice i has
    // seed + i (so it equals a lone request with that seed)
    const n = (request as { readonly n?: number }).n ?? 1
    const seed = request.sampling?.seed
    const requests = Array.from({ length: n }, (_, i) =>
      i === 0 || seed === undefined ? request : { ...request, sampling: { ...request.sampling, seed: seed + i } }
    )
    const wantLogprobs = request.sampling?.logprobs !== undefined
    const logprobsJson = (entries: ReadonlyArray<TextLogprob>, offset: number) =>
      !wantLogprobs ? null : shape.chat ? chatLogprobs(entries) : completionLogprobs(entries, offset)
    if (!stream) {
      const results = yield* Effect.forEach(requests, (r) => Stream.runCollect(server.generate(r)), {
        concurrency: "unbounded"
      })
      const usage: Usage = { promptTokens: 0, completionTokens: 0, cachedTokens: 0 }
      const choices = results.map((all, index) =>
        wholeChoice(all, index, usage, shape, logprobsJson, tools, reasoningFormat)
      )
      return HttpServerResponse.unsafeJson({
        id: shape.id,
        object: shape.chat ? "chat.completion" : "text_completion",
        created: shape.created,
        model: shape.model,
        choices,
        // the prompt once, every choice's completion
        usage: usageOf(usage.promptTokens, usage.completionTokens, usage.cachedTokens)
      })
    }
    return yield* streamCompletion(
      server,
      shape,
      requests,
      includeUsage,
      keepAliveMillis,
      logprobsJson,
      tools,
      reasoningFormat
    )
  })
