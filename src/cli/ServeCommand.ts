/**
 * `swactor serve`: keeps one pipeline loaded (local agents, or remote nodes) and serves an OpenAI-compatible
 * HTTP API over it until stopped (SIGINT/SIGTERM: full teardown, exit code 130 as for `swactor run`).
 * stderr says `listening on http://HOST:PORT` at once and `ready` once the weights are loaded.
 */
import * as Command from "@effect/cli/Command"
import * as Options from "@effect/cli/Options"
import { readFileSync } from "node:fs"
import { Context, Effect, Layer, Option } from "effect"
import { serve } from "../api/serve.js"
import * as HttpServe from "../layers/HttpServe.js"
import { clusterTokenEnv } from "../layers/LocalAgents.js"
import { Server } from "../services/Server.js"

export interface ServeArgs {
  readonly model: string
  readonly stages: Option.Option<number>
  readonly nodes: Option.Option<string>
  readonly tokenFile: Option.Option<string>
  readonly host: string
  readonly port: number
  readonly threads: Option.Option<number>
  readonly parallel: number
  readonly queue: number
  readonly kvBudgetMib: Option.Option<number>
  readonly keepAliveMs: number
  readonly spares: number
}

/**
 * Keeps a SIGINT/SIGTERM listener while serving, so a loader that exits when none is left (tsx) does not cut
 * the teardown short; a second signal exits at once. (Same behaviour as `swactor run`'s; to be replaced by the
 * shared CLI signal helper.)
 */
const holdSignals = Effect.acquireRelease(
  Effect.sync(() => {
    let signals = 0
    const onSignal = () => {
      signals++
      if (signals > 1) process.exit(130)
    }
    process.on("SIGINT", onSignal)
    process.on("SIGTERM", onSignal)
    return onSignal
  }),
  (onSignal) =>
    Effect.sync(() => {
      process.off("SIGINT", onSignal)
      process.off("SIGTERM", onSignal)
    })
)

export const runServeCommand = (args: ServeArgs) =>
  Effect.gen(function*() {
    yield* holdSignals
    const nodes = Option.isSome(args.nodes)
      ? args.nodes.value.split(",").map((n) => n.trim()).filter((n) => n.length > 0)
      : []
    const token = Option.isSome(args.tokenFile)
      ? readFileSync(args.tokenFile.value, "utf8").trim()
      : process.env[clusterTokenEnv] ?? ""
    if (nodes.length > 0 && token === "") {
      return yield* Effect.fail(`--nodes needs the cluster token: set ${clusterTokenEnv} or pass --token-file`)
    }
    const threads = Option.getOrUndefined(args.threads)
    const server = serve({
      model: args.model,
      parallel: args.parallel,
      queueLimit: args.queue,
      ...(Option.isSome(args.stages) ? { stages: args.stages.value } : nodes.length > 0 ? {} : { stages: 2 }),
      ...(threads === undefined ? {} : { threads }),
      ...(Option.isSome(args.kvBudgetMib) ? { kvBudgetBytes: args.kvBudgetMib.value * 2 ** 20 } : {}),
      ...(nodes.length > 0 ? { nodes, token } : {}),
      ...(args.spares > 0 ? { spares: args.spares } : {})
    })
    const http = HttpServe.layer({
      host: args.host,
      port: args.port,
      keepAliveMillis: args.keepAliveMs,
      onListening: ({ host, port }) => process.stderr.write(`swactor serve: listening on http://${host}:${port} (loading the model)\n`)
    }, args.model)
    // Serve at once (/health says 503 while loading); a pipeline that cannot be set up ends the command (exit 1),
    // one that faults later keeps serving /health and errors honestly.
    yield* Effect.gen(function*() {
      const context = yield* Layer.build(http.pipe(Layer.provideMerge(server)))
      const info = yield* Context.get(context, Server).ready.pipe(Effect.mapError((fault) => fault.message))
      process.stderr.write(`swactor serve: ready: ${info.modelId}, ${info.stageCount} stages, ${info.parallel} sequences at once\n`)
      return yield* Effect.never
    }).pipe(
      Effect.scoped,
      Effect.onInterrupt(() =>
        Effect.sync(() => {
          process.exitCode = 130
          process.stderr.write("swactor serve: stopped by the operator; every stage was stopped\n")
        })
      )
    )
  }).pipe(
    Effect.scoped,
    Effect.tapError((error) => Effect.sync(() => process.stderr.write(`swactor serve: ${error}\n`)))
  )

export const serveCommand = Command.make(
  "serve",
  {
    model: Options.file("model").pipe(Options.withDescription("GGUF model (for --nodes: a path valid on every node)")),
    stages: Options.integer("stages").pipe(
      Options.withDescription("pipeline stages (local default 2; with --nodes, one per node)"),
      Options.optional
    ),
    nodes: Options.text("nodes").pipe(
      Options.withDescription(`remote agents host:port,... (token from ${clusterTokenEnv} or --token-file)`),
      Options.optional
    ),
    tokenFile: Options.text("token-file").pipe(Options.optional),
    host: Options.text("host").pipe(Options.withDefault("127.0.0.1")),
    port: Options.integer("port").pipe(Options.withDescription("0 = any free port"), Options.withDefault(8080)),
    threads: Options.integer("threads").pipe(Options.withDescription("engine threads per stage"), Options.optional),
    parallel: Options.integer("parallel").pipe(Options.withDescription("sequences running at once"), Options.withDefault(4)),
    queue: Options.integer("queue").pipe(
      Options.withDescription("requests waiting for admission at most; more get 429"),
      Options.withDefault(64)
    ),
    kvBudgetMib: Options.integer("kv-budget-mib").pipe(
      Options.withDescription("KV cache MiB per stage shared by running requests (default: --parallel sequences of 4,096 tokens)"),
      Options.optional
    ),
    keepAliveMs: Options.integer("keep-alive-ms").pipe(
      Options.withDescription("SSE keep-alive comment interval while a stream waits"),
      Options.withDefault(5000)
    ),
    spares: Options.integer("spares").pipe(
      Options.withDescription("local agents: extra agents that host nothing until a recovery needs them"),
      Options.withDefault(0)
    )
  },
  runServeCommand
).pipe(Command.withDescription("Serve a model over an OpenAI-compatible HTTP API from a pipeline kept loaded"))
