/**
 * The OpenAI-compatible HTTP front of a Server (@effect/platform HttpRouter on Node's HTTP server):
 *
 * | route | answer |
 * |---|---|
 * | GET /health | 200 `{"status":"ok"}` when ready; 503 while loading, 503 `reviving` with what it waits for while every agent is lost, 503 with the fault once the pipeline faulted |
 * | GET /v1/models | the one model served |
 * | POST /v1/completions | text completion (`stream: true`: SSE `text_completion` chunks, then `data: [DONE]`) |
 * | POST /v1/chat/completions | chat through the model's chat template (SSE `chat.completion.chunk`) |
 * | GET /metrics | Prometheus text |
 *
 * Errors are OpenAI's `{"error":{"message","type","param","code"}}`: 400 bad body, 429 + Retry-After when the
 * admission queue is full, 503 + Retry-After while loading, 500 with the fault in words. A stream that fails
 * after it started ends with an `error` event and `data: [DONE]`. A client that goes away interrupts its
 * handler, which cancels the run (its stages stop, its KV is freed).
 */
import { createServer, type Server as NodeServer } from "node:http"
import type { Socket } from "node:net"
import { basename } from "node:path"
import { randomBytes } from "node:crypto"
import * as HttpRouter from "@effect/platform/HttpRouter"
import * as HttpServer from "@effect/platform/HttpServer"
import * as HttpServerRequest from "@effect/platform/HttpServerRequest"
import * as HttpServerResponse from "@effect/platform/HttpServerResponse"
import * as NodeHttpServer from "@effect/platform-node/NodeHttpServer"
import * as NodeHttpServerRequest from "@effect/platform-node/NodeHttpServerRequest"
import { Cause, Chunk, Effect, Exit, Layer, Option, ParseResult, type Redacted, Schema, Scope, Stream } from "effect"
import {
  type FinishReason,
  Server,
  type ServeError,
  type ServeEvent,
  type ServeRequest,
  type ServerMetrics,
  type TextLogprob
} from "../../services/Server.js"
import {
  apiKeys,
  type ApiKeys,
  checkApiKey,
  checkCaller,
  checkJsonContentType,
  clip,
  declaredTooLarge,
  defaultHttpLimits,
  EdgeRefusal,
  type HttpLimits,
  parseJson,
  readBody,
  withoutAddresses
} from "./HttpGuard.js"
import { ChatMessageBody, chatWithTools, toolCallDelta, toolCallsJson, ToolFields } from "./OpenAiTools.js"
import { toolCallStream, parseToolCalls, type ToolCallPiece } from "./ToolCalls.js"
import { harmonyStream, type HarmonyPiece, splitHarmony } from "./Harmony.js"
import type { ChatTool, ToolSyntax } from "../../services/Tools.js"
import { anthropicErrorResponse, isMessagesPath, messagesRoutes } from "./AnthropicMessages.js"
import { OpenAiSamplingFields, openAiSampling } from "./OpenAiSampling.js"
import { chatLogprobs, completionLogprobs, entriesLength } from "./Logprobs.js"

// --- bodies ---

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
  stream_options: Schema.optional(Schema.NullOr(Schema.Struct({ include_usage: Schema.optional(Schema.NullOr(Schema.Boolean)) }))),
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

// --- errors ---

class HttpFailure {
  constructor(
    readonly status: number,
    readonly type: string,
    readonly message: string,
    readonly code: string | null = null,
    readonly retryAfter?: number
  ) {}
}

const errorJson = (failure: HttpFailure | EdgeRefusal) => ({
  error: { message: clip(failure.message), type: failure.type, param: null, code: failure.code }
})

const errorResponse = (failure: HttpFailure | EdgeRefusal) =>
  HttpServerResponse.unsafeJson(errorJson(failure), {
    status: failure.status,
    headers: {
      ...(failure instanceof HttpFailure && failure.retryAfter !== undefined ? { "retry-after": String(failure.retryAfter) } : {}),
      // A body refused before it was read whole: the connection is not reused (what is left of the body is never read).
      ...(failure.status === 413 || failure.status === 408 ? { connection: "close" } : {})
    }
  })

/** A server-side fault in words for the client, without agents' addresses; the whole message goes to the log. */
const faultForClient = (message: string): string => {
  const reference = randomBytes(4).toString("hex")
  process.stderr.write(`swactor serve: request failed [${reference}]: ${message}\n`)
  return `${withoutAddresses(message)} [log reference ${reference}]`
}

const fromServeError = (error: ServeError): HttpFailure => {
  switch (error._tag) {
    case "BadServeRequest":
      return new HttpFailure(400, "invalid_request_error", error.message)
    case "ServerBusy":
      return new HttpFailure(429, "rate_limit_error", error.message, "queue_full", error.retryAfterSeconds)
    case "ServerLoading":
      return new HttpFailure(503, "server_error", error.message, "loading", 5)
    case "ServerReviving":
      return new HttpFailure(503, "server_error", error.message, "reviving", error.retryAfterSeconds)
    case "PipelineFaulted":
      return new HttpFailure(500, "server_error", faultForClient(`the pipeline faulted: ${error.message}`), "pipeline_faulted")
    default:
      return new HttpFailure(500, "server_error", faultForClient(String((error as { message?: unknown }).message ?? error)))
  }
}

/** A body that does not fit the route's schema: each issue with its path, each clipped (a bad value is not echoed whole). */
const badBody = (error: ParseResult.ParseError) =>
  new HttpFailure(
    400,
    "invalid_request_error",
    clip(`bad request body: ${
      ParseResult.ArrayFormatter.formatErrorSync(error)
        .slice(0, 4)
        .map((issue) => `${issue.path.length > 0 ? `${issue.path.join(".")}: ` : ""}${clip(issue.message, 160)}`)
        .join("; ")
    }`)
  )

// --- requests ---

const orUndefined = <A>(value: A | null | undefined): A | undefined => (value === null ? undefined : value)

const serveRequest = (
  body: CompletionBody | ChatBody,
  prompt: ServeRequest["prompt"],
  maxTokens: number | undefined,
  extraStop: ReadonlyArray<string> = [],
  parallel = 1
) =>
  Effect.gen(function*() {
    const stop = body.stop === undefined || body.stop === null ? [] : typeof body.stop === "string" ? [body.stop] : body.stop
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
const tokenIds = (ids: ReadonlyArray<number>): Effect.Effect<ReadonlyArray<number>, HttpFailure> => {
  const at = ids.findIndex((id) => !Number.isSafeInteger(id) || id < 0)
  return at < 0
    ? Effect.succeed(ids)
    : Effect.fail(new HttpFailure(400, "invalid_request_error", `prompt[${at}]: a token id must be a whole number ≥ 0, got ${ids[at]}`))
}

// --- responses ---

const encoder = new TextEncoder()
const sse = (data: unknown) => encoder.encode(`data: ${typeof data === "string" ? data : JSON.stringify(data)}\n\n`)

interface Shape {
  readonly id: string
  readonly created: number
  readonly model: string
  readonly chat: boolean
}

const chunk = (
  shape: Shape,
  choice: {
    text?: string
    role?: boolean
    finish: FinishReason | "tool_calls" | null
    delta?: object
    // n > 1: the choice's index; with log-probs: the entries of this chunk's tokens (Logprobs.ts)
    index?: number
    logprobs?: object | null
  }
) =>
  shape.chat
    ? {
      id: shape.id,
      object: "chat.completion.chunk",
      created: shape.created,
      model: shape.model,
      choices: [{
        index: choice.index ?? 0,
        delta: choice.finish !== null
          ? {}
          : choice.delta ?? { ...(choice.role === true ? { role: "assistant" } : {}), content: choice.text ?? "" },
        logprobs: choice.logprobs ?? null,
        finish_reason: choice.finish
      }]
    }
    : {
      id: shape.id,
      object: "text_completion",
      created: shape.created,
      model: shape.model,
      choices: [{ index: choice.index ?? 0, text: choice.text ?? "", logprobs: choice.logprobs ?? null, finish_reason: choice.finish }]
    }

/** OpenAI's usage object; `cachedTokens`: prompt tokens the prompt cache held (the most any choice's run reused). */
const usageOf = (promptTokens: number, completionTokens: number, cachedTokens: number) => ({
  prompt_tokens: promptTokens,
  completion_tokens: completionTokens,
  total_tokens: promptTokens + completionTokens,
  prompt_tokens_details: { cached_tokens: cachedTokens }
})

export interface HttpServeOptions {
  readonly host?: string
  readonly port?: number
  /** Comment lines on an open SSE stream while no event comes (default 5 s). */
  readonly keepAliveMillis?: number
  /** Called with the bound address once listening. */
  readonly onListening?: (address: { readonly host: string; readonly port: number }) => void
  /** The model's name in responses (default: the file's name). */
  readonly modelName?: string
  /** Body, connection and caller limits (HttpGuard.ts; defaults there). */
  readonly limits?: Partial<HttpLimits>
  /** API keys a caller must present (Authorization: Bearer, or x-api-key) on every route but /health; none: open. */
  readonly apiKeys?: ReadonlyArray<Redacted.Redacted<string>>
}

/** The limits with their defaults filled in. */
export const limitsOf = (options: HttpServeOptions): HttpLimits => ({ ...defaultHttpLimits, ...options.limits })

const respond = (
  server: Server["Type"],
  shape: Shape,
  request: ServeRequest,
  stream: boolean,
  includeUsage: boolean,
  keepAliveMillis: number,
  // A chat with tools: the reply's calls, in the template's syntax, become tool_calls (ToolCalls.ts).
  tools?: { readonly syntax: ToolSyntax; readonly tools: ReadonlyArray<ChatTool>; readonly parallel: boolean },
  // gpt-oss's harmony template: the analysis channel is reasoning_content, the final channel content (Harmony.ts)
  harmony = false
) =>
  Effect.gen(function*() {
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
      const results = yield* Effect.forEach(requests, (r) => Stream.runCollect(server.generate(r)), { concurrency: "unbounded" })
      let promptTokens = 0
      let completionTokens = 0
      let cachedTokens = 0
      const choices = results.map((all, index) => {
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
          promptTokens = done.promptTokens
          completionTokens += done.completionTokens
          cachedTokens = Math.max(cachedTokens, done.cachedTokens ?? 0)
        }
        const logprobs = logprobsJson(entries, 0)
        const split = harmony ? splitHarmony(text) : undefined
        if (split !== undefined) text = split.content
        const reasoning = split === undefined || split.reasoning === "" ? {} : { reasoning_content: split.reasoning }
        const parsed = tools === undefined ? undefined : parseToolCalls(text, tools.syntax, tools.tools, tools.parallel)
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
            finish_reason: "tool_calls"
          }
        }
        if (parsed !== undefined) text = parsed.content
        const finish = done?.finishReason ?? "length"
        return shape.chat
          ? { index, message: { role: "assistant", content: text, ...reasoning }, logprobs, finish_reason: finish }
          : { index, text, logprobs, finish_reason: finish }
      })
      return HttpServerResponse.unsafeJson({
        id: shape.id,
        object: shape.chat ? "chat.completion" : "text_completion",
        created: shape.created,
        model: shape.model,
        choices,
        // the prompt once, every choice's completion
        usage: usageOf(promptTokens, completionTokens, cachedTokens)
      })
    }
    const events = Stream.mergeAll(
      requests.map((r, index) => server.generate(r).pipe(Stream.map((event) => ({ index, event })))),
      { concurrency: "unbounded" }
    )
    // Refusals come before the first event: answer them with a status. Once accepted, the response is SSE.
    const scope = yield* Scope.make()
    const pull = yield* Stream.toPull(events).pipe(Scope.extend(scope))
    const first = yield* pull.pipe(
      Effect.catchAll((end) => (Option.isNone(end) ? Effect.succeed(Chunk.empty<{ index: number; event: ServeEvent }>()) : Effect.fail(end.value))),
      Effect.onExit((exit) => (Exit.isSuccess(exit) ? Effect.void : Scope.close(scope, exit)))
    )
    const all = Stream.concat(Stream.fromChunk(first), Stream.repeatEffectChunkOption(pull))
    // Each choice's own state. With tools: text that might start a call is held back; calls go out as delta.tool_calls.
    const choices = requests.map(() => ({
      roleSent: false,
      calls: tools === undefined ? undefined : toolCallStream(tools.syntax, tools.tools, tools.parallel),
      harmony: harmony ? harmonyStream() : undefined,
      callCount: 0,
      // completions' text_offset so far
      offset: 0
    }))
    let finished = 0
    let promptTokens = 0
    let completionTokens = 0
    let cachedTokens = 0
    // calls stream as they are written (ToolCalls.ts): a call's first chunk has its index, id, type and name, the
    // next ones fragments of its arguments
    const toolChunks = (index: number, piece: ToolCallPiece) => {
      const c = choices[index]!
      c.callCount += piece.calls.length
      return [
        ...(piece.content === "" ? [] : [sse(chunk(shape, { index, text: piece.content, role: !c.roleSent, finish: null }))]),
        ...piece.deltas.map((delta) => sse(chunk(shape, { index, finish: null, delta: toolCallDelta(delta) })))
      ]
    }
    // harmony: reasoning as delta.reasoning_content, the rest on as content (through the tools' parser with tools)
    const harmonyChunks = (index: number, piece: HarmonyPiece) => {
      const c = choices[index]!
      return [
        ...(piece.reasoning === "" ? [] : [sse(chunk(shape, { index, finish: null, delta: { reasoning_content: piece.reasoning } }))]),
        ...(c.calls !== undefined
          ? toolChunks(index, c.calls.push(piece.content))
          : piece.content === ""
          ? []
          : [sse(chunk(shape, { index, text: piece.content, role: !c.roleSent, finish: null }))])
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
            return [sse(chunk(shape, { index, text: "", role: true, finish: null }))]
          case "Text": {
            const entries = event.logprobs ?? []
            const logprobs = logprobsJson(entries, c.offset)
            c.offset += entriesLength(entries)
            if (c.harmony !== undefined) return harmonyChunks(index, c.harmony.push(event.text))
            if (c.calls !== undefined) return toolChunks(index, c.calls.push(event.text))
            return [sse(chunk(shape, { index, text: event.text, role: !c.roleSent, finish: null, logprobs }))]
          }
          case "Done":
            finished++
            promptTokens = event.promptTokens
            completionTokens += event.completionTokens
            cachedTokens = Math.max(cachedTokens, event.cachedTokens ?? 0)
            return [
              ...(c.harmony === undefined ? [] : harmonyChunks(index, c.harmony.end())),
              ...(c.calls === undefined ? [] : toolChunks(index, c.calls.end())),
              sse(chunk(shape, { index, finish: c.callCount > 0 ? "tool_calls" : event.finishReason })),
              ...(includeUsage && finished === requests.length
                ? [sse({
                  id: shape.id,
                  object: shape.chat ? "chat.completion.chunk" : "text_completion",
                  created: shape.created,
                  model: shape.model,
                  choices: [],
                  usage: usageOf(promptTokens, completionTokens, cachedTokens)
                })]
                : [])
            ]
        }
      }),
      Stream.concat(Stream.make(sse("[DONE]"))),
      Stream.catchAll((error) => Stream.make(sse(errorJson(fromServeError(error))), sse("[DONE]"))),
      Stream.merge(Stream.tick(`${keepAliveMillis} millis`).pipe(Stream.drop(1), Stream.as(encoder.encode(": keep-alive\n\n"))), {
        haltStrategy: "left"
      }),
      Stream.ensuring(Scope.close(scope, Exit.void))
    )
    return HttpServerResponse.stream(body, {
      contentType: "text/event-stream",
      headers: { "cache-control": "no-cache", connection: "keep-alive", "x-accel-buffering": "no" }
    })
  })

/** The prompt cache's counters and gauges (entries in LRU order: `lru="0"` is evicted first). */
const renderPromptCache = (
  c: NonNullable<ServerMetrics["promptCache"]>,
  metric: (name: string, type: string, help: string, samples: ReadonlyArray<[string, number]>) => void
) => {
  metric("swactor_prompt_cache_hits_total", "counter", "Requests whose prompt started after a held prefix's KV", [["", c.hits]])
  metric("swactor_prompt_cache_misses_total", "counter", "Requests with the prompt cache on that prefilled every token", [["", c.misses]])
  metric("swactor_prompt_cache_evictions_total", "counter", "Prompt-cache entries dropped for memory or the entry bound", [["", c.evictions]])
  metric("swactor_prompt_cache_cached_tokens_total", "counter", "Prompt tokens not prefilled (their KV reused)", [["", c.cachedTokens]])
  metric("swactor_prompt_cache_entries", "gauge", "Prompt-cache entries held", [["", c.entries]])
  metric("swactor_prompt_cache_bytes", "gauge", "KV bytes per stage the prompt-cache entries hold", [["", c.bytes]])
  metric(
    "swactor_prompt_cache_entry_tokens",
    "gauge",
    "Tokens each entry holds, by least-recently-used rank",
    c.lru.map((e, rank): [string, number] => [`{entry="${e.entry}",lru="${rank}"}`, e.tokens])
  )
}

/** The Prometheus text of a metrics snapshot. */
export const renderMetrics = (m: ServerMetrics, status: string): string => {
  const lines: Array<string> = []
  const metric = (name: string, type: string, help: string, samples: ReadonlyArray<[string, number]>) => {
    lines.push(`# HELP ${name} ${help}`, `# TYPE ${name} ${type}`)
    for (const [labels, value] of samples) lines.push(`${name}${labels} ${value}`)
  }
  metric("swactor_up", "gauge", "1 when the pipeline is ready", [[`{status="${status}"}`, status === "ready" ? 1 : 0]])
  metric("swactor_requests_total", "counter", "Requests by outcome", [
    ['{outcome="completed"}', m.requests.completed],
    ['{outcome="cancelled"}', m.requests.cancelled],
    ['{outcome="failed"}', m.requests.failed],
    ['{outcome="refused"}', m.requests.refused]
  ])
  metric("swactor_prompt_tokens_total", "counter", "Prompt tokens of admitted requests", [["", m.promptTokens]])
  metric("swactor_completion_tokens_total", "counter", "Generated tokens", [["", m.completionTokens]])
  metric("swactor_recoveries_total", "counter", "Generations resumed after their run faulted", [["", m.recoveries]])
  metric("swactor_pipeline_revivals_total", "counter", "Times the server served again after every agent was lost", [["", m.revivals]])
  metric("swactor_pipeline_revival_attempts_total", "counter", "Attempts to revive a pipeline whose agents were all lost", [["", m.revivalAttempts]])
  metric("swactor_straggler_tokens_total", "counter", "Decoded tokens over 4x the recent median", [["", m.stragglers]])
  metric("swactor_requests_in_flight", "gauge", "Requests running", [["", m.inFlight]])
  metric("swactor_requests_queued", "gauge", "Requests waiting for admission", [["", m.queued]])
  metric("swactor_kv_reserved_bytes", "gauge", "KV bytes per stage reserved by running requests", [["", m.kvReservedBytes]])
  metric("swactor_kv_budget_bytes", "gauge", "KV bytes per stage admission may reserve", [["", m.kvBudgetBytes]])
  if (m.promptCache !== undefined) renderPromptCache(m.promptCache, metric)
  const perStage = (value: (s: ServerMetrics["stages"][number]) => number) =>
    m.stages.map((s): [string, number] => [`{stage="${s.stageIndex}"}`, value(s)])
  metric("swactor_stage_compute_seconds_total", "counter", "Engine time per stage (completed requests)", perStage((s) => s.computeSeconds))
  const f = m.firstToken
  metric("swactor_first_token_seconds_sum", "counter", "Time to first token, summed over completed requests", [["", f.totalSeconds]])
  metric("swactor_first_token_seconds_count", "counter", "Completed requests that got a first token", [["", f.requests]])
  metric(
    "swactor_first_token_phase_seconds_total",
    "counter",
    "Time to first token by phase, summed over completed requests (tokenize, admit, setup: sessions opened, prefill_wait: " +
      "in the stages' batchers, prefill: engine, sample, hops: the rest)",
    (
      [
        ["tokenize", f.tokenize],
        ["admit", f.admit],
        ["setup", f.setup],
        ["prefill_wait", f.prefillWait],
        ["prefill", f.prefill],
        ["sample", f.sample],
        ["hops", f.hops]
      ] as const
    ).map(([phase, seconds]): [string, number] => [`{phase="${phase}"}`, seconds])
  )
  metric("swactor_stage_prefill_seconds_total", "counter", "Engine time on prompts per stage (completed requests)", perStage((s) => s.prefillSeconds))
  metric(
    "swactor_stage_prefill_wait_seconds_total",
    "counter",
    "Time prompts waited in the stage's batcher (completed requests)",
    perStage((s) => s.prefillWaitSeconds)
  )
  metric(
    "swactor_stage_transfer_seconds_total",
    "counter",
    "Decode time outside the engines, shared per stage (completed requests)",
    perStage((s) => s.transferSeconds)
  )
  metric("swactor_stage_decode_tokens_total", "counter", "Decode steps per stage (completed requests)", perStage((s) => s.decodeTokens))
  metric(
    "swactor_stage_micro_batches_total",
    "counter",
    "Micro-batches that carried a completed request's work, summed over requests (rows / this = mean batch rows)",
    perStage((s) => s.microBatches)
  )
  metric("swactor_stage_batch_rows_total", "counter", "Rows of those micro-batches, summed over requests", perStage((s) => s.batchRows))
  metric("swactor_stage_max_batch_sequences", "gauge", "Most sequences seen in one micro-batch", perStage((s) => s.maxBatchSequences))
  metric("swactor_stage_compute_buffer_bytes", "gauge", "The stage's compute buffers, measured by its agent", perStage((s) => s.computeBytes))
  metric("swactor_stage_kv_bytes", "gauge", "KV cache bytes of one sequence on the stage, sliding-window caches capped", perStage((s) => s.kvBytes))
  metric(
    "swactor_stage_resident_bytes",
    "gauge",
    "Resident memory of the stage's agent process, measured at its last completed request",
    perStage((s) => s.residentBytes)
  )
  metric(
    "swactor_stage_peak_resident_bytes",
    "gauge",
    "Peak resident memory (VmHWM) of the stage's agent process",
    perStage((s) => s.peakResidentBytes)
  )
  metric(
    "swactor_stage_straggler_tokens_total",
    "counter",
    "Decode steps on which the stage took over 4x its own recent median",
    perStage((s) => s.stragglerTokens)
  )
  metric(
    "swactor_agent_active_stages",
    "gauge",
    "Stages each agent hosts now (-1: no answer)",
    m.agents.map((a) => [`{address="${a.address}",pid="${a.pid}"}`, a.activeStages])
  )
  const sessionsOf = (value: (s: NonNullable<ServerMetrics["agents"][number]["openSessions"]>) => number) =>
    m.agents.flatMap((a): Array<[string, number]> =>
      a.openSessions === undefined ? [] : [[`{address="${a.address}",pid="${a.pid}"}`, value(a.openSessions)]]
    )
  const stepCostsOf = <A>(f: (label: string, entry: NonNullable<ServerMetrics["agents"][number]["stepCosts"]>[number]) => ReadonlyArray<A>) =>
    m.agents.flatMap((a) =>
      (a.stepCosts ?? []).flatMap((entry) =>
        f(`address="${a.address}",pid="${a.pid}",layers="${entry.layers[0]}-${entry.layers[1]}"`, entry)
      )
    )
  metric(
    "swactor_agent_step_ms",
    "gauge",
    "Measured decode step (ms) of each agent's loaded block range, by rows per micro-batch (idle probe and served steps)",
    stepCostsOf((label, e): Array<[string, number]> => e.costs.map((c) => [`{${label},rows="${c.rows}"}`, c.millis]))
  )
  metric(
    "swactor_agent_decode_batch_rows",
    "gauge",
    "Rows per decode micro-batch the agent's batcher chose last from the measured step costs (see _default_rows)",
    stepCostsOf((label, e): Array<[string, number]> => e.choice === undefined ? [] : [[`{${label}}`, e.choice.rows]])
  )
  metric(
    "swactor_agent_decode_batch_default_rows",
    "gauge",
    "ceil(decoding sequences / pipeline stages): the rows per decode micro-batch without measured costs",
    stepCostsOf((label, e): Array<[string, number]> => e.choice === undefined ? [] : [[`{${label}}`, e.choice.defaultRows]])
  )
  metric(
    "swactor_agent_decoding_sequences",
    "gauge",
    "Sequences decoding through the agent's block range at its batcher's last choice",
    stepCostsOf((label, e): Array<[string, number]> => e.choice === undefined ? [] : [[`{${label}}`, e.choice.decoders]])
  )
  metric("swactor_agent_open_sessions", "gauge", "Stage sessions open in each agent's process now", sessionsOf((s) => s.sessions))
  metric(
    "swactor_agent_state_bytes",
    "gauge",
    "DeltaNet (recurrent) state bytes held by each agent's open sessions now",
    sessionsOf((s) => s.stateBytes)
  )
  metric(
    "swactor_agent_cache_bytes",
    "gauge",
    "KV cache and DeltaNet state bytes held by each agent's open sessions now",
    sessionsOf((s) => s.cacheBytes)
  )
  return `${lines.join("\n")}\n`
}

/** The Prometheus text of the HTTP front's connection counts (none without them). */
const renderConnections = (c: ConnectionStats | undefined): string =>
  c === undefined ? "" : [
    "# HELP swactor_http_connections_open HTTP connections open now",
    "# TYPE swactor_http_connections_open gauge",
    `swactor_http_connections_open ${c.open}`,
    "# HELP swactor_http_connections_refused_total Connections closed at once: the limit was reached and every open one was busy",
    "# TYPE swactor_http_connections_refused_total counter",
    `swactor_http_connections_refused_total ${c.refused}`,
    "# HELP swactor_http_connections_dropped_total Connections closed before they sent a request (header timeout, or room for a new one)",
    "# TYPE swactor_http_connections_dropped_total counter",
    `swactor_http_connections_dropped_total ${c.dropped}`,
    ""
  ].join("\n")

/** The HTTP routes over the Server in context. */
export const router = (options: HttpServeOptions, modelPath: string, connections?: ConnectionStats) =>
  Effect.gen(function*() {
    const server = yield* Server
    const modelName = options.modelName ?? basename(modelPath)
    const keepAliveMillis = options.keepAliveMillis ?? 5000
    const shape = (chat: boolean): Shape => ({
      id: `${chat ? "chatcmpl" : "cmpl"}-${randomBytes(12).toString("hex")}`,
      created: Math.floor(Date.now() / 1000),
      model: modelName,
      chat
    })
    const limits = limitsOf(options)
    const keys = apiKeys(options.apiKeys ?? [])
    const handle = (
      effect: Effect.Effect<HttpServerResponse.HttpServerResponse, HttpFailure | EdgeRefusal | ServeError, HttpServerRequest.HttpServerRequest>,
      render: (failure: HttpFailure | EdgeRefusal) => HttpServerResponse.HttpServerResponse = errorResponse
    ) =>
      effect.pipe(
        Effect.catchAll((failure) =>
          Effect.succeed(render(failure instanceof HttpFailure || failure instanceof EdgeRefusal ? failure : fromServeError(failure)))
        )
      )
    // JSON only, counted while it arrives, nested at most maxJsonDepth, then the route's schema.
    const body = <A, I>(schema: Schema.Schema<A, I>) =>
      Effect.gen(function*() {
        const request = yield* HttpServerRequest.HttpServerRequest
        const wrongType = checkJsonContentType(request.headers["content-type"])
        if (wrongType !== undefined) return yield* Effect.fail(wrongType)
        const text = yield* readBody(NodeHttpServerRequest.toIncomingMessage(request), limits)
        const json = yield* parseJson(text)
        return yield* Schema.decodeUnknown(schema, { errors: "first" })(json).pipe(Effect.mapError(badBody))
      })
    // Anthropic's Messages API (AnthropicMessages.ts): its errors in Anthropic's shape.
    const messages = messagesRoutes({ server, modelName, keepAliveMillis, body, failureOf: fromServeError })

    return HttpRouter.empty.pipe(
      HttpRouter.get(
        "/health",
        Effect.gen(function*() {
          const status = yield* server.status
          // /health is open to anyone when the server has API keys; the pipeline's inside (agents' addresses, what a
          // fault said) only to callers with a key.
          const request = yield* HttpServerRequest.HttpServerRequest
          const inside = checkApiKey(request.headers, "/v1/models", keys) === undefined
          switch (status._tag) {
            case "Ready":
              return HttpServerResponse.unsafeJson({
                status: "ok",
                ...(status.lostAgents === undefined || !inside ? {} : { lostAgents: status.lostAgents })
              })
            case "Loading":
              return HttpServerResponse.unsafeJson({ status: "loading" }, { status: 503, headers: { "retry-after": "5" } })
            case "Faulted":
              return HttpServerResponse.unsafeJson({ status: "error", ...(inside ? { error: status.message } : {}) }, { status: 503 })
            case "Reviving": {
              // Every agent was lost: what it waits for (each agent's state), its attempts and when the next one starts.
              const iso = (millis: number) => new Date(millis).toISOString()
              const next = status.nextAttemptAtMillis === null ? 0 : Math.max(0, status.nextAttemptAtMillis - Date.now())
              return HttpServerResponse.unsafeJson({
                status: "reviving",
                error: status.message,
                since: iso(status.sinceMillis),
                attempts: status.attempts,
                nextAttemptAt: status.nextAttemptAtMillis === null ? "running now" : iso(status.nextAttemptAtMillis),
                ...(inside ? { waitingFor: status.waitingFor } : {}),
                ...(status.freshAgentsAtMillis === undefined ? {} : { freshAgentsAt: iso(status.freshAgentsAtMillis) }),
                ...(status.lastAttempt === undefined || !inside ? {} : { lastAttempt: status.lastAttempt })
              }, { status: 503, headers: { "retry-after": String(Math.max(1, Math.ceil(next / 1000))) } })
            }
          }
        })
      ),
      HttpRouter.get(
        "/v1/models",
        Effect.succeed(HttpServerResponse.unsafeJson({
          object: "list",
          data: [{ id: modelName, object: "model", created: Math.floor(Date.now() / 1000), owned_by: "swactor" }]
        }))
      ),
      HttpRouter.get(
        "/metrics",
        Effect.gen(function*() {
          const status = yield* server.status
          const metrics = yield* server.metrics
          return HttpServerResponse.text(renderMetrics(metrics, status._tag.toLowerCase()) + renderConnections(connections), {
            contentType: "text/plain; version=0.0.4"
          })
        })
      ),
      HttpRouter.post(
        "/v1/completions",
        handle(Effect.gen(function*() {
          const request = yield* body(CompletionBody)
          const prompt = typeof request.prompt === "string"
            ? request.prompt
            : request.prompt.length === 1 && typeof request.prompt[0] === "string"
            ? request.prompt[0]
            : request.prompt.every((p) => typeof p === "number")
            ? yield* tokenIds(request.prompt as ReadonlyArray<number>)
            : yield* Effect.fail(new HttpFailure(400, "invalid_request_error", "prompt must be one string or an array of token ids"))
          // n > 1 is bounded by the server's parallel sequences (known once it is ready)
          const parallel = (orUndefined(request.n) ?? 1) > 1 ? (yield* server.ready).parallel : 1
          const serve = yield* serveRequest(request, prompt, orUndefined(request.max_tokens) ?? 16, [], parallel)
          return yield* respond(server, shape(false), serve, request.stream === true, request.stream_options?.include_usage === true, keepAliveMillis)
        }))
      ),
      HttpRouter.post(
        "/v1/chat/completions",
        handle(Effect.gen(function*() {
          const receivedAt = performance.now()
          const request = yield* body(ChatBody)
          // Messages and tools checked (OpenAiTools.ts): a problem is a 400 naming the field.
          const checked = chatWithTools(request)
          if (typeof checked === "string") return yield* Effect.fail(new HttpFailure(400, "invalid_request_error", checked))
          const chat = yield* server.formatChat(checked.messages, checked.tools)
          const ready = yield* server.ready
          // Without a limit: up to a window of 4,096 tokens (or the model's context, when smaller), so the KV a chat
          // reserves does not grow with the model's maximum context.
          const window = Math.min(ready.model.maxSeqLen, Math.max(4096, chat.tokens.length + 256))
          const maxTokens = orUndefined(request.max_completion_tokens) ?? orUndefined(request.max_tokens) ??
            Math.max(1, window - chat.tokens.length - 1)
          const planned = yield* serveRequest(request, chat.tokens, maxTokens, chat.stop, ready.parallel)
          if (chat.tools?.grammar !== undefined && planned.sampling.grammar !== undefined) {
            return yield* Effect.fail(
              new HttpFailure(400, "invalid_request_error", "response_format / grammar cannot be combined with a tool_choice that forces a call")
            )
          }
          // A tool choice that forces a call samples under its grammar (ToolCalls.ts toolGrammar).
          const serve = chat.tools?.grammar === undefined
            ? { ...planned, receivedAt }
            : { ...planned, receivedAt, sampling: { ...planned.sampling, grammar: { text: chat.tools.grammar } } }
          return yield* respond(
            server,
            shape(true),
            serve,
            request.stream === true,
            request.stream_options?.include_usage === true,
            keepAliveMillis,
            chat.tools === undefined || checked.tools === undefined
              ? undefined
              : { syntax: chat.tools.syntax, tools: checked.tools.tools, parallel: checked.tools.parallel !== false },
            chat.template === "Harmony"
          )
        }))
      ),
      HttpRouter.post("/v1/messages", handle(messages.create, anthropicErrorResponse)),
      HttpRouter.post("/v1/messages/count_tokens", handle(messages.countTokens, anthropicErrorResponse)),
      Effect.succeed
    )
  }).pipe(Effect.flatten)

const corsHeaders = (origin: string) => ({
  "access-control-allow-origin": origin,
  "access-control-allow-methods": "GET, POST, OPTIONS",
  "access-control-allow-headers": "authorization, content-type, x-api-key",
  "access-control-max-age": "600",
  vary: "origin"
})

/**
 * Every request passes the caller check first (Host against the listen address, Origin against `--allowed-origins`);
 * an allowed cross-origin page gets CORS headers and its preflight answered, none otherwise. A defect in a handler
 * is a 500 in OpenAI's shape (the detail in the log), never an empty answer.
 */
const guarded = (
  routes: Effect.Effect<HttpServerResponse.HttpServerResponse, unknown, HttpServerRequest.HttpServerRequest>,
  listenHost: string,
  limits: HttpLimits,
  keys: ApiKeys
) =>
  Effect.gen(function*() {
    const request = yield* HttpServerRequest.HttpServerRequest
    const path = new URL(request.url, "http://x").pathname
    // Refusals in the shape of the route's API: Anthropic's on /v1/messages, OpenAI's elsewhere.
    const refusalResponse = isMessagesPath(path) ? anthropicErrorResponse : errorResponse
    const refusal = checkCaller(request.headers, listenHost, limits)
    if (refusal !== undefined) return refusalResponse(refusal)
    const origin = request.headers["origin"]
    const cors = origin !== undefined && (limits.allowedOrigins.includes("*") || limits.allowedOrigins.includes(origin))
    if (request.method === "OPTIONS") {
      return cors
        ? HttpServerResponse.empty({ status: 204, headers: corsHeaders(origin) })
        : refusalResponse(new HttpFailure(405, "invalid_request_error", "OPTIONS is answered only for --allowed-origins"))
    }
    const unauthorized = checkApiKey(request.headers, path, keys)
    if (unauthorized !== undefined) {
      const answer = refusalResponse(unauthorized)
      return cors ? HttpServerResponse.setHeaders(answer, corsHeaders(origin)) : answer
    }
    const response = yield* routes.pipe(
      Effect.catchAllCause((cause) => {
        if (Cause.isInterruptedOnly(cause)) return Effect.failCause(cause as Cause.Cause<never>)
        const failure = Cause.failureOption(cause)
        if (Option.isSome(failure) && (failure.value as { _tag?: unknown })._tag === "RouteNotFound") {
          return Effect.succeed(refusalResponse(new HttpFailure(404, "invalid_request_error", "no such route")))
        }
        return Effect.succeed(refusalResponse(new HttpFailure(500, "server_error", faultForClient(Cause.pretty(cause).split("\n")[0] ?? "a defect"))))
      })
    )
    return cors ? HttpServerResponse.setHeaders(response, corsHeaders(origin)) : response
  })

/** The HTTP server could not listen (address in use, not permitted, no such address): one line that says so. */
export class ListenError extends Schema.TaggedError<ListenError>()("ListenError", { message: Schema.String }) {}

const listenError = (host: string, port: number, cause: unknown) => {
  const code = (cause as NodeJS.ErrnoException | undefined)?.code
  const why = code === "EADDRINUSE"
    ? "the address is in use (another server listens there; pick another --port, or 0 for any free one)"
    : code === "EACCES"
    ? "not permitted (ports below 1024 need privileges)"
    : code === "EADDRNOTAVAIL"
    ? "this machine has no such address (--host)"
    : (cause as Error | undefined)?.message ?? String(cause)
  return new ListenError({ message: `cannot listen on ${host}:${port}: ${why}${code === undefined ? "" : ` (${code})`}` })
}

/** The HTTP front's connection counts, for /metrics. */
export interface ConnectionStats {
  open: number
  /** Connections closed at once: the limit was reached and none was silent. */
  refused: number
  /** Silent connections (no request yet) closed: to make room for a new one, or past the header timeout. */
  dropped: number
}

/**
 * Node's HTTP server with the connection limits. At most `maxConnections` are open: a new one past the limit takes the
 * place of the oldest connection that has not sent a request for 250 ms (a quarter of the header timeout when
 * shorter), so idle connections cannot lock callers out; it is closed at once when there is none such (a burst that
 * fills every place within 250 ms is refused until then). A connection must send its first request's headers within
 * `headerTimeoutMillis` (Node's own `headersTimeout` covers headers that trickle; a silent connection is closed here);
 * a request must be received whole within the body timeout (Node's `requestTimeout` backs up readBody's own, which
 * answers in OpenAI's shape). `Expect: 100-continue` with a Content-Length over the limit is refused before the body
 * is sent.
 */
const makeNodeServer = (limits: HttpLimits, stats: ConnectionStats): NodeServer => {
  const server = createServer({ headersTimeout: limits.headerTimeoutMillis, requestTimeout: limits.bodyTimeoutMillis + 5_000 })
  server.keepAliveTimeout = 5_000
  const open = new Set<Socket>()
  // Connections that have not sent a request yet, oldest first, with their header timers and when they came.
  const silent = new Map<Socket, { readonly timer: NodeJS.Timeout; readonly at: number }>()
  // A silent connection younger than this may be a caller whose headers are on their way: it is not dropped for room.
  const graceMillis = Math.min(250, limits.headerTimeoutMillis / 4)
  const spoke = (socket: Socket) => {
    const entry = silent.get(socket)
    if (entry === undefined) return
    clearTimeout(entry.timer)
    silent.delete(socket)
  }
  const drop = (socket: Socket) => {
    spoke(socket)
    open.delete(socket)
    stats.open = open.size
    stats.dropped++
    socket.destroy()
  }
  server.on("connection", (socket: Socket) => {
    if (open.size >= limits.maxConnections) {
      const oldest = silent.entries().next()
      if (oldest.done === true || performance.now() - oldest.value[1].at < graceMillis) {
        stats.refused++
        socket.destroy()
        return
      }
      drop(oldest.value[0])
    }
    open.add(socket)
    stats.open = open.size
    const timer = setTimeout(() => drop(socket), limits.headerTimeoutMillis)
    timer.unref()
    silent.set(socket, { timer, at: performance.now() })
    socket.once("close", () => {
      spoke(socket)
      open.delete(socket)
      stats.open = open.size
    })
  })
  server.prependListener("request", (request) => spoke(request.socket))
  server.on("checkContinue", (request, response) => {
    spoke(request.socket)
    const refusal = declaredTooLarge(request.headers["content-length"], limits.maxBodyBytes)
    if (refusal === undefined) {
      response.writeContinue()
      server.emit("request", request, response)
      return
    }
    response.writeHead(413, { "content-type": "application/json", connection: "close" })
    response.end(JSON.stringify(errorJson(refusal)))
  })
  return server
}

/**
 * Serves the routes on Node's HTTP server until the scope closes; open connections are cut on close (their
 * runs are cancelled), so shutting down never waits on a client. Fails with a ListenError when it cannot listen.
 */
export const layer = (options: HttpServeOptions, modelPath: string): Layer.Layer<never, ListenError, Server> => {
  const limits = limitsOf(options)
  const host = options.host ?? "127.0.0.1"
  const port = options.port ?? 8080
  let nodeServer: NodeServer | undefined
  const connections: ConnectionStats = { open: 0, refused: 0, dropped: 0 }
  const evaluate = () => (nodeServer = makeNodeServer(limits, connections))
  const app = Layer.unwrapEffect(
    Effect.map(router(options, modelPath, connections), (routes) => HttpServer.serve(guarded(routes, host, limits, apiKeys(options.apiKeys ?? []))))
  )
  const announce = Layer.scopedDiscard(
    Effect.gen(function*() {
      const server = yield* HttpServer.HttpServer
      yield* Effect.addFinalizer(() => Effect.sync(() => nodeServer?.closeAllConnections()))
      if (server.address._tag === "TcpAddress") options.onListening?.({ host: server.address.hostname, port: server.address.port })
    })
  )
  return Layer.mergeAll(app, announce).pipe(
    Layer.provide(
      NodeHttpServer.layer(evaluate, { port, host }).pipe(Layer.mapError((error) => listenError(host, port, error.cause)))
    )
  )
}

