/**
 * `swactor serve`: keeps one pipeline loaded (local agents, or remote nodes) and serves an OpenAI-compatible
 * HTTP API over it until stopped (SIGINT/SIGTERM/SIGHUP: full teardown, exit 130/143/129 as for `swactor run`).
 * stderr says `listening on http://HOST:PORT` at once and `ready` once the weights are loaded. The pipeline's flags
 * and their checks are shared with `run` (cli/PipelineFlags.ts); the requests', HTTP's and API keys' are its own.
 */
import * as Command from "@effect/cli/Command"
import { readFileSync } from "node:fs"
import { Context, Effect, Layer, Option, Redacted } from "effect"
import { serve } from "../api/serve.js"
import * as HttpServe from "../layers/server/HttpServe.js"
import { clusterTokenEnv } from "../layers/agent/ReadyLine.js"
import { apiKeyFromEnv, apiKeyVariable, Settings } from "../layers/config/Settings.js"
import { Server } from "../services/Server.js"
import { atLeast, listFlag, modelFactsOf, optionalWholeNumber, UsageError, wholeNumber } from "./Flags.js"
import * as Flag from "./FlagSpec.js"
import { commandDoc, optionsOf } from "./FlagSpec.js"
import { defaultHttpLimits, hostOf, isLoopbackHost } from "../layers/server/HttpGuard.js"
import {
  checkPipelineFlags,
  checkStagesFit,
  type CheckedPipelineFlags,
  modelFlag,
  pipelineFlags,
  checkSpeculativeFlags,
  speculativeFlags,
  speculativeOf,
  pipelineOptionsOf,
  plannedStages,
  securityFlags
} from "./PipelineFlags.js"
import { defaultPlacement } from "./RunRequestFromFlags.js"
import { untilOperatorStop } from "./Signals.js"
import { apiKeyProblem } from "../services/RequestChecks.js"
import { DEFAULT_REPLAN_MARGIN } from "../services/ReplanRule.js"

/** What the flags of `swactor serve` parse into. */
type ServeArgs = Flag.ArgsOf<typeof serveFlags>

/** The environment variable holding one API key, when no --api-key-file is given (config/Settings.ts). */
const apiKeyEnv = apiKeyVariable

/**
 * The API keys: the lines of --api-key-file (blank lines and # comments skipped), else SWACTOR_API_KEY, else none.
 * A file that cannot be read, holds no key, or a key with a space or a character outside printable ASCII inside is a
 * UsageError (one line). `said` is what the listening line adds (how many keys, from where; never a key).
 */
const apiKeysOf = (file: Option.Option<string>) =>
  Effect.gen(function* () {
    let keys: Array<string>
    let source: string
    if (Option.isSome(file)) {
      source = `--api-key-file ${file.value}`
      const text = yield* Effect.try({
        try: () => readFileSync(file.value, "utf8"),
        catch: (cause) =>
          new UsageError({
            message: `${source}: cannot read it (${(cause as NodeJS.ErrnoException).code ?? String(cause)})`
          })
      })
      keys = text
        .split(/\r?\n/)
        .map((line) => line.trim())
        .filter((line) => line !== "" && !line.startsWith("#"))
      if (keys.length === 0)
        return yield* new UsageError({ message: `${source}: the file holds no key (one per line)` })
    } else {
      source = apiKeyEnv
      const key = apiKeyFromEnv()
      keys = key === undefined ? [] : [Redacted.value(key)]
    }
    // Printable ASCII only (RequestChecks.ts): a key with other characters could never match what clients send.
    for (const [i, key] of keys.entries()) {
      const problem = apiKeyProblem(key, i + 1, source)
      if (problem !== undefined) return yield* new UsageError({ message: problem })
    }
    return {
      keys: keys.map((key) => Redacted.make(key)),
      said: keys.length === 0 ? "" : ` (${keys.length} API key${keys.length === 1 ? "" : "s"} from ${source})`
    }
  })

/** Serve's own numbers and lists (requests, HTTP limits, origins and hosts), checked; each refusal one line. */
const checkServeFlags = (args: ServeArgs) =>
  Effect.gen(function* () {
    const kvBudgetMib = yield* optionalWholeNumber("kv-budget-mib", args.kvBudgetMib, 1)
    const maxPromptTokens = yield* optionalWholeNumber("max-prompt-tokens", args.maxPromptTokens, 1)
    yield* wholeNumber("port", args.port, 0)
    if (args.port > 65535) return yield* new UsageError({ message: `--port must be at most 65535, got ${args.port}` })
    yield* wholeNumber("parallel", args.parallel, 1)
    yield* atLeast("replan-margin", args.replanMargin, 0)
    yield* wholeNumber("queue", args.queue, 0)
    yield* wholeNumber("keep-alive-ms", args.keepAliveMs, 1)
    yield* wholeNumber("prompt-cache-entries", args.promptCacheEntries, 1)
    yield* atLeast("max-body-mib", args.maxBodyMib, 0.001)
    yield* wholeNumber("max-connections", args.maxConnections, 1)
    yield* wholeNumber("header-timeout-ms", args.headerTimeoutMs, 1)
    yield* wholeNumber("body-timeout-ms", args.bodyTimeoutMs, 1)
    const allowedOrigins = yield* listFlag("allowed-origins", args.allowedOrigins, (origin) =>
      origin === "*" || /^https?:\/\/[^/\s]+$/.test(origin)
        ? undefined
        : "an origin is scheme://host[:port], e.g. http://localhost:3000, or *"
    )
    const allowedHosts = yield* listFlag("allowed-hosts", args.allowedHosts, (host) =>
      /^[^\s/:]+$/.test(host) ? undefined : "a host name without scheme or port, e.g. llm.example.lan, or *"
    )
    return { kvBudgetMib, maxPromptTokens, allowedOrigins, allowedHosts }
  })

type CheckedServeFlags = Effect.Effect.Success<ReturnType<typeof checkServeFlags>>

/** The Server over its warm pipeline: the pipeline's flags (local agents, or remote ones), the requests' own. */
const serverOf = (args: ServeArgs, pipeline: CheckedPipelineFlags, own: CheckedServeFlags) =>
  serve({
    model: args.model,
    parallel: args.parallel,
    queueLimit: args.queue,
    // Nodes that lack the model file receive their stages' slices (remote nodes by default), as for `swactor run`.
    ...pipelineOptionsOf(pipeline),
    ...(Option.isSome(own.kvBudgetMib) ? { kvBudgetBytes: own.kvBudgetMib.value * 2 ** 20 } : {}),
    ...(Option.isSome(own.maxPromptTokens) ? { maxPromptTokens: own.maxPromptTokens.value } : {}),
    ...(pipeline.agents.length > 0 ? { agents: pipeline.agents, token: pipeline.token } : {}),
    ...(pipeline.discovered === undefined ? {} : { discovered: pipeline.discovered, replanMargin: args.replanMargin }),
    ...defaultPlacement(pipeline.agents),
    ...speculativeOf(args),
    ...(pipeline.agentArgs.length > 0 ? { local: { extraArgs: () => pipeline.agentArgs } } : {}),
    promptCache: { enabled: args.promptCache !== "off", maxEntries: args.promptCacheEntries }
  })

/** The HTTP front: its address, limits and keys; it says where it listens at once, and warns of an open API. */
const httpOf = (args: ServeArgs, own: CheckedServeFlags, keys: Effect.Effect.Success<ReturnType<typeof apiKeysOf>>) =>
  HttpServe.layer(
    {
      host: args.host,
      port: args.port,
      keepAliveMillis: args.keepAliveMs,
      limits: {
        maxBodyBytes: Math.round(args.maxBodyMib * 2 ** 20),
        maxConnections: args.maxConnections,
        headerTimeoutMillis: args.headerTimeoutMs,
        bodyTimeoutMillis: args.bodyTimeoutMs,
        allowedOrigins: own.allowedOrigins,
        allowedHosts: own.allowedHosts
      },
      apiKeys: keys.keys,
      onListening: ({ host, port }) => {
        process.stderr.write(`swactor serve: listening on http://${host}:${port} (loading the model)${keys.said}\n`)
        if (keys.keys.length === 0 && !isLoopbackHost(hostOf(args.host))) {
          process.stderr.write(
            `swactor serve: warning: no API key, and ${args.host} is reachable from other machines: anyone who reaches the port can use it (--api-key-file or ${apiKeyEnv})\n`
          )
        }
      }
    },
    args.model
  )

const runServe = (args: ServeArgs) =>
  Effect.gen(function* () {
    // Every flag checked before anything starts, each refusal one line naming the flag; the model's header last.
    // --discover: the discovered pool stays open for the server's life (nodes that appear later are seen).
    const pipeline = yield* checkPipelineFlags(args, true, yield* Effect.scope)
    const keys = yield* apiKeysOf(args.apiKeyFile)
    yield* checkSpeculativeFlags(args)
    const own = yield* checkServeFlags(args)
    return yield* serveChecked(args, pipeline, keys, own).pipe(Effect.provideService(Settings, pipeline.settings))
  }).pipe(Effect.scoped)

/** The server once its flags are checked, with the settings they chose (the Settings service) provided. */
const serveChecked = (
  args: ServeArgs,
  pipeline: CheckedPipelineFlags,
  keys: Effect.Effect.Success<ReturnType<typeof apiKeysOf>>,
  own: Effect.Effect.Success<ReturnType<typeof checkServeFlags>>
) =>
  Effect.gen(function* () {
    const stages = plannedStages(pipeline)
    if (stages !== undefined) yield* checkStagesFit(stages, yield* modelFactsOf(args.model))
    // Serve at once (/health says 503 while loading); a pipeline that cannot be set up ends the command (exit 1),
    // one that faults later keeps serving /health and errors honestly.
    const http = httpOf(args, own, keys)
    const context = yield* Layer.build(http.pipe(Layer.provideMerge(serverOf(args, pipeline, own))))
    const info = yield* Context.get(context, Server).ready.pipe(Effect.mapError((fault) => fault.message))
    process.stderr.write(
      `swactor serve: ready: ${info.modelId}, ${info.stageCount} stages, ${info.parallel} sequences at once\n`
    )
    return yield* Effect.never
  }).pipe(Effect.scoped)

/** `swactor serve` until an operator stops it (SIGINT/SIGTERM/SIGHUP: every stage stopped, then exit 128+n). */
export const runServeCommand = (args: ServeArgs) =>
  untilOperatorStop(runServe(args), {
    stdoutClosedStops: false,
    onStop: (stop) =>
      Effect.sync(() => {
        if (stop._tag === "Signal") {
          process.stderr.write(`swactor serve: stopped by ${stop.signal}; every stage was stopped\n`)
        }
      })
  }).pipe(
    Effect.tapError((error) =>
      Effect.sync(() => {
        process.exitCode = 1
        process.stderr.write(`swactor serve: ${typeof error === "string" ? error : error.message}\n`)
      })
    )
  )

const requests = "Requests"
const http = "HTTP limits"
const network = "Network and security"

/** The flags of `swactor serve`: what they parse into and what `--help` says of them. */
const serveFlags = {
  model: modelFlag("Model"),
  ...pipelineFlags("server"),
  ...speculativeFlags,
  ...securityFlags,
  apiKeyFile: Flag.text("api-key-file", {
    group: network,
    value: "PATH",
    text: "API keys callers must present (Authorization: Bearer or x-api-key), one per line"
  }).optional(`${apiKeyEnv}; without either, the API is open`),
  host: Flag.text("host", { group: network, value: "ADDRESS", text: "address to listen on" }).withDefault("127.0.0.1"),
  port: Flag.integer("port", { group: network, text: "port to listen on (0 = any free port)" }).withDefault(8080),
  parallel: Flag.integer("parallel", { group: requests, text: "sequences running at once" }).withDefault(4),
  replanMargin: Flag.float("replan-margin", {
    group: "Pipeline",
    text:
      "--discover: a node that joins while serving is used when the plan with it is faster per token by this " +
      "fraction (the slowest stage's time), or when the model fits only with it"
  }).withDefault(DEFAULT_REPLAN_MARGIN),
  queue: Flag.integer("queue", {
    group: requests,
    text: "requests waiting for admission at most; more get 429"
  }).withDefault(64),
  kvBudgetMib: Flag.integer("kv-budget-mib", {
    group: requests,
    text: "KV cache MiB per stage shared by running requests"
  }).optional("--parallel sequences of 4,096 tokens"),
  maxPromptTokens: Flag.integer("max-prompt-tokens", {
    group: requests,
    text: "prompt tokens a request may have at most; more get 400 (a text whose length alone says so, before tokenizing)"
  }).optional("the model's context length, at most 32768"),
  maxBodyMib: Flag.float("max-body-mib", {
    group: http,
    text: "request body MiB at most (counted while it arrives; 413 beyond)"
  }).withDefault(defaultHttpLimits.maxBodyBytes / 2 ** 20),
  maxConnections: Flag.integer("max-connections", {
    group: http,
    text: "open HTTP connections at most; more are refused at the socket"
  }).withDefault(defaultHttpLimits.maxConnections),
  headerTimeoutMs: Flag.integer("header-timeout-ms", {
    group: http,
    text: "a connection must send its request headers within this"
  }).withDefault(defaultHttpLimits.headerTimeoutMillis),
  bodyTimeoutMs: Flag.integer("body-timeout-ms", {
    group: http,
    text: "a request body must arrive whole within this (408 beyond)"
  }).withDefault(defaultHttpLimits.bodyTimeoutMillis),
  allowedOrigins: Flag.text("allowed-origins", {
    group: network,
    value: "ORIGIN,...",
    text: "origins whose web pages may call the API, with CORS: http://host:port,... or *"
  }).optional("none"),
  allowedHosts: Flag.text("allowed-hosts", {
    group: network,
    value: "HOST,...",
    text: "host names requests may be addressed to besides the listen address and loopback: name,... or *"
  }).optional("none"),
  keepAliveMs: Flag.integer("keep-alive-ms", {
    group: http,
    text: "SSE keep-alive comment interval while a stream waits"
  }).withDefault(5000),
  promptCache: Flag.choice("prompt-cache", ["on", "off"], {
    group: requests,
    text: "keep each finished request's KV on every stage; a prompt that starts with one's tokens prefills only the rest"
  }).withDefault("on"),
  promptCacheEntries: Flag.integer("prompt-cache-entries", {
    group: requests,
    text: "prompt-cache entries held at most (they also count against --kv-budget-mib)"
  }).withDefault(16)
}

/** What `swactor serve --help` says. */
export const serveDoc = commandDoc(
  "serve",
  "Serve a model over an OpenAI-compatible HTTP API from a pipeline kept loaded",
  ["Model", "Pipeline", requests, network, http],
  serveFlags,
  [
    {
      what: "two local agents on this machine; the API on http://127.0.0.1:8080/v1",
      command: "swactor serve --model model.gguf"
    },
    {
      what: `on every interface, callers with a key from the file keys, the stages on two nodes (the cluster token in ${clusterTokenEnv})`,
      command: "swactor serve --model model.gguf --host 0.0.0.0 --api-key-file keys --agents n1:7070,n2:7070"
    }
  ]
)

export const serveCommand = Command.make("serve", optionsOf(serveFlags), runServeCommand).pipe(
  Command.withDescription(serveDoc.summary)
)
