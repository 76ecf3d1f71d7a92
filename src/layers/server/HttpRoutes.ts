/**
 * The HTTP front's routes over the Server in context (@effect/platform HttpRouter):
 *
 * | route | answer |
 * |---|---|
 * | GET /health | 200 `{"status":"ok"}` when ready; 503 while loading, 503 `reviving` with what it waits for while every agent is lost, 503 with the fault once the pipeline faulted |
 * | GET /v1/models | the one model served |
 * | POST /v1/completions | text completion (`stream: true`: SSE `text_completion` chunks, then `data: [DONE]`) |
 * | POST /v1/chat/completions | chat through the model's chat template (SSE `chat.completion.chunk`) |
 * | POST /v1/messages, /v1/messages/count_tokens | Anthropic's Messages API (AnthropicMessages.ts) |
 * | GET /metrics | Prometheus text (MetricsText.ts) |
 * | GET / | the console: one self-contained page (ConsolePage.ts), open without a key (it asks for one) |
 * | GET /api/status | the console's status as JSON (domain/consoleStatus.ts, ConsoleStatus.ts) |
 * | GET /api/events | the same status as server-sent events, pushed when it changes |
 *
 * and the guard every request passes first (`guarded`): the caller check, CORS, API keys, and a defect answered as a
 * 500 in the route's error shape.
 */
import { basename } from "node:path"
import { randomBytes } from "node:crypto"
import * as HttpRouter from "@effect/platform/HttpRouter"
import * as HttpServerRequest from "@effect/platform/HttpServerRequest"
import * as HttpServerResponse from "@effect/platform/HttpServerResponse"
import * as NodeHttpServerRequest from "@effect/platform-node/NodeHttpServerRequest"
import { Cause, Effect, Option, Schedule, Schema, Stream } from "effect"
import { Server, type ServeError, type ServerService, type ServerStatus } from "../../services/Server.js"
import {
  apiKeys,
  type ApiKeys,
  checkApiKey,
  checkCaller,
  checkJsonContentType,
  EdgeRefusal,
  type HttpLimits,
  parseJson,
  readBody
} from "./HttpGuard.js"
import { chatWithTools } from "./OpenAiTools.js"
import { anthropicErrorResponse, isMessagesPath, messagesRoutes } from "./AnthropicMessages.js"
import { ChatBody, CompletionBody, orUndefined, serveRequest, tokenIds } from "./OpenAiBodies.js"
import { badBody, errorResponse, faultForClient, fromServeError, HttpFailure } from "./OpenAiErrors.js"
import type { ResponseShape } from "./OpenAiChunks.js"
import { respond } from "./OpenAiWholeAnswers.js"
import { reasoningFormatOf } from "./Reasoning.js"
import { renderConnections, renderMetrics } from "./MetricsText.js"
import type { ConnectionStats } from "./HttpListener.js"
import { type HttpServeOptions, limitsOf } from "./HttpServeOptions.js"
import { type Console, makeConsole } from "./ConsoleStatus.js"
import { consolePage, consolePageHeaders } from "./ConsolePage.js"

/** What the routes share: the server, the model's name, the body reader and the answer's shape. */
interface Routes {
  readonly server: ServerService
  readonly modelName: string
  readonly keepAliveMillis: number
  readonly keys: ApiKeys
  readonly body: ReturnType<typeof bodyOf>
  readonly shape: (chat: boolean) => ResponseShape
}

/** A route's failures answered in its API's error shape. */
const handle = (
  effect: Effect.Effect<
    HttpServerResponse.HttpServerResponse,
    HttpFailure | EdgeRefusal | ServeError,
    HttpServerRequest.HttpServerRequest
  >,
  render: (failure: HttpFailure | EdgeRefusal) => HttpServerResponse.HttpServerResponse = errorResponse
) =>
  effect.pipe(
    Effect.catchAll((failure) =>
      Effect.succeed(
        render(failure instanceof HttpFailure || failure instanceof EdgeRefusal ? failure : fromServeError(failure))
      )
    )
  )

// JSON only, counted while it arrives, nested at most maxJsonDepth, then the route's schema.
const bodyOf =
  (limits: HttpLimits) =>
  <A, I>(schema: Schema.Schema<A, I>) =>
    Effect.gen(function* () {
      const request = yield* HttpServerRequest.HttpServerRequest
      const wrongType = checkJsonContentType(request.headers["content-type"])
      if (wrongType !== undefined) return yield* Effect.fail(wrongType)
      const text = yield* readBody(NodeHttpServerRequest.toIncomingMessage(request), limits)
      const json = yield* parseJson(text)
      return yield* Schema.decodeUnknown(schema, { errors: "first" })(json).pipe(Effect.mapError(badBody))
    })

/** Every agent was lost: what it waits for (each agent's state), its attempts and when the next one starts. */
const revivingHealth = (status: Extract<ServerStatus, { _tag: "Reviving" }>, inside: boolean) => {
  const iso = (millis: number) => new Date(millis).toISOString()
  const next = status.nextAttemptAtMillis === null ? 0 : Math.max(0, status.nextAttemptAtMillis - Date.now())
  return HttpServerResponse.unsafeJson(
    {
      status: "reviving",
      error: status.message,
      since: iso(status.sinceMillis),
      attempts: status.attempts,
      nextAttemptAt: status.nextAttemptAtMillis === null ? "running now" : iso(status.nextAttemptAtMillis),
      ...(inside ? { waitingFor: status.waitingFor } : {}),
      ...(status.freshAgentsAtMillis === undefined ? {} : { freshAgentsAt: iso(status.freshAgentsAtMillis) }),
      ...(status.lastAttempt === undefined || !inside ? {} : { lastAttempt: status.lastAttempt })
    },
    { status: 503, headers: { "retry-after": String(Math.max(1, Math.ceil(next / 1000))) } }
  )
}

/** GET /health */
const health = ({ keys, server }: Routes) =>
  Effect.gen(function* () {
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
        return HttpServerResponse.unsafeJson(
          { status: "error", ...(inside ? { error: status.message } : {}) },
          { status: 503 }
        )
      case "Reviving":
        return revivingHealth(status, inside)
    }
  })

/** GET /metrics */
const metrics = (server: ServerService, connections: ConnectionStats | undefined) =>
  Effect.gen(function* () {
    const status = yield* server.status
    const metrics = yield* server.metrics
    return HttpServerResponse.text(renderMetrics(metrics, status._tag.toLowerCase()) + renderConnections(connections), {
      contentType: "text/plain; version=0.0.4"
    })
  })

/** The console's event stream polls the status this often; an unchanged status sends nothing. */
const consolePollMillis = 500
/** A comment line after this many unchanged polls keeps an idle stream open. */
const consoleKeepAlivePolls = 30

/**
 * GET /api/events: the console's status as server-sent events (`event: status`), the first at once, then each time it
 * changes. A client that goes away interrupts the stream, which stops polling and counts it closed.
 */
const consoleEvents = (console: Console) =>
  Effect.sync(() => {
    let last = ""
    let quiet = 0
    const frames = Stream.repeatEffectWithSchedule(console.status, Schedule.spaced(consolePollMillis)).pipe(
      Stream.filterMap((status) => {
        const json = JSON.stringify(status)
        if (json !== last) {
          last = json
          quiet = 0
          return Option.some(`event: status\ndata: ${json}\n\n`)
        }
        quiet = (quiet + 1) % consoleKeepAlivePolls
        return quiet === 0 ? Option.some(": keep-alive\n\n") : Option.none()
      })
    )
    const body = Stream.acquireRelease(console.opened, () => console.closed).pipe(
      Stream.flatMap(() => frames),
      Stream.encodeText
    )
    return HttpServerResponse.stream(body, {
      contentType: "text/event-stream",
      headers: { "cache-control": "no-cache", "x-accel-buffering": "no" }
    })
  })

/** POST /v1/completions */
const completion = ({ body, keepAliveMillis, server, shape }: Routes) =>
  Effect.gen(function* () {
    const request = yield* body(CompletionBody)
    const prompt =
      typeof request.prompt === "string"
        ? request.prompt
        : request.prompt.length === 1 && typeof request.prompt[0] === "string"
          ? request.prompt[0]
          : request.prompt.every((p) => typeof p === "number")
            ? yield* tokenIds(request.prompt as ReadonlyArray<number>)
            : yield* Effect.fail(
                new HttpFailure(400, "invalid_request_error", "prompt must be one string or an array of token ids")
              )
    // n > 1 is bounded by the server's parallel sequences (known once it is ready)
    const parallel = (orUndefined(request.n) ?? 1) > 1 ? (yield* server.ready).parallel : 1
    const serve = yield* serveRequest(request, prompt, orUndefined(request.max_tokens) ?? 16, [], parallel)
    return yield* respond(
      server,
      shape(false),
      serve,
      request.stream === true,
      request.stream_options?.include_usage === true,
      keepAliveMillis
    )
  })

/** POST /v1/chat/completions */
const chatCompletion = ({ body, keepAliveMillis, server, shape }: Routes) =>
  Effect.gen(function* () {
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
    const maxTokens =
      orUndefined(request.max_completion_tokens) ??
      orUndefined(request.max_tokens) ??
      Math.max(1, window - chat.tokens.length - 1)
    const planned = yield* serveRequest(request, chat.tokens, maxTokens, chat.stop, ready.parallel)
    if (chat.tools?.grammar !== undefined && planned.sampling.grammar !== undefined) {
      return yield* Effect.fail(
        new HttpFailure(
          400,
          "invalid_request_error",
          "response_format / grammar cannot be combined with a tool_choice that forces a call"
        )
      )
    }
    // A tool choice that forces a call samples under its grammar (ToolCalls.ts toolGrammar).
    const serve =
      chat.tools?.grammar === undefined
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
      reasoningFormatOf(chat.template)
    )
  })

/** The HTTP routes over the Server in context. */
export const router = (options: HttpServeOptions, modelPath: string, connections?: ConnectionStats) =>
  Effect.gen(function* () {
    const server = yield* Server
    const modelName = options.modelName ?? basename(modelPath)
    const routes: Routes = {
      server,
      modelName,
      keepAliveMillis: options.keepAliveMillis ?? 5000,
      keys: apiKeys(options.apiKeys ?? []),
      body: bodyOf(limitsOf(options)),
      shape: (chat) => ({
        id: `${chat ? "chatcmpl" : "cmpl"}-${randomBytes(12).toString("hex")}`,
        created: Math.floor(Date.now() / 1000),
        model: modelName,
        chat
      })
    }
    // Anthropic's Messages API (AnthropicMessages.ts): its errors in Anthropic's shape.
    const console = yield* makeConsole(server, modelName)
    const messages = messagesRoutes({
      server,
      modelName,
      keepAliveMillis: routes.keepAliveMillis,
      body: routes.body,
      failureOf: fromServeError
    })

    return HttpRouter.empty.pipe(
      HttpRouter.get("/health", health(routes)),
      HttpRouter.get(
        "/v1/models",
        Effect.succeed(
          HttpServerResponse.unsafeJson({
            object: "list",
            data: [{ id: modelName, object: "model", created: Math.floor(Date.now() / 1000), owned_by: "swactor" }]
          })
        )
      ),
      HttpRouter.get("/metrics", metrics(server, connections)),
      HttpRouter.get(
        "/",
        Effect.succeed(HttpServerResponse.html(consolePage).pipe(HttpServerResponse.setHeaders(consolePageHeaders)))
      ),
      HttpRouter.get(
        "/api/status",
        Effect.map(console.status, (status) => HttpServerResponse.unsafeJson(status))
      ),
      HttpRouter.get("/api/events", consoleEvents(console)),
      HttpRouter.post("/v1/completions", handle(completion(routes))),
      HttpRouter.post("/v1/chat/completions", handle(chatCompletion(routes))),
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
export const guarded = (
  routes: Effect.Effect<HttpServerResponse.HttpServerResponse, unknown, HttpServerRequest.HttpServerRequest>,
  listenHost: string,
  limits: HttpLimits,
  keys: ApiKeys
) =>
  Effect.gen(function* () {
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
        : refusalResponse(
            new HttpFailure(405, "invalid_request_error", "OPTIONS is answered only for --allowed-origins")
          )
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
        return Effect.succeed(
          refusalResponse(
            new HttpFailure(500, "server_error", faultForClient(Cause.pretty(cause).split("\n")[0] ?? "a defect"))
          )
        )
      })
    )
    return cors ? HttpServerResponse.setHeaders(response, corsHeaders(origin)) : response
  })
