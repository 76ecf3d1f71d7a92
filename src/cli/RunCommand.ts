/**
 * `swactor run`: generates text across a pipeline of node agents. Without --nodes it starts one
 * agent process per stage on this machine and runs the same distributed path over loopback.
 * Streams the text to stdout; progress and the summary go to stderr.
 */
import * as Command from "@effect/cli/Command"
import * as Options from "@effect/cli/Options"
import { existsSync, mkdirSync, readFileSync, renameSync } from "node:fs"
import * as Os from "node:os"
import { join } from "node:path"
import { Console, Effect, Option, Stream } from "effect"
import { layerLocal, layerRemote, run } from "../api/generate.js"
import { formatAddress } from "../layers/AgentControlRpc.js"
import { writeSyntheticModel } from "../layers/gguf/Synthetic.js"
import { clusterTokenEnv } from "../layers/LocalAgents.js"
import type { GenerateError, GenerateRequest, RunSummary, RunUpdate } from "../services/Orchestrator.js"

export interface RunArgs {
  readonly model: Option.Option<string>
  readonly prompt: string
  readonly stages: Option.Option<number>
  readonly maxTokens: number
  readonly temperature: number
  readonly topK: number
  readonly seed: Option.Option<number>
  readonly threads: Option.Option<number>
  readonly nodes: Option.Option<string>
  readonly tokenFile: Option.Option<string>
  readonly quiet: boolean
  readonly dryRun: boolean
  readonly spares: number
}

const cacheDir = () => join(process.env["XDG_CACHE_HOME"] ?? join(Os.homedir(), ".cache"), "swactor")

/** The small model `swactor run` uses when no --model is given: written once with the synthetic GGUF writer. */
export const defaultSyntheticModel = Effect.gen(function*() {
  const dir = cacheDir()
  const path = join(dir, "synthetic-llama-4x256-q8_0-v1.gguf")
  if (existsSync(path)) {
    yield* Console.error(`swactor run: no --model given; using the cached synthetic model ${path} (random weights: the text is noise)`)
    return path
  }
  mkdirSync(dir, { recursive: true })
  yield* Console.error(`swactor run: no --model given; writing a small synthetic llama model (random weights) to ${path} ...`)
  // Written under a temporary name and renamed, so an interrupted write never looks cached.
  const partial = `${path}.partial-${process.pid}`
  yield* writeSyntheticModel({
    path: partial,
    arch: "llama",
    layers: 4,
    hidden: 256,
    ffn: 768,
    heads: 4,
    kvHeads: 4,
    vocab: 512,
    contextLength: 1024,
    type: "q8_0",
    seed: 1
  })
  renameSync(partial, path)
  return path
})

const bar = (fraction: number, width = 20) => {
  const filled = Math.round(Math.max(0, Math.min(1, fraction)) * width)
  return `[${"#".repeat(filled)}${"-".repeat(width - filled)}]`
}

/** Renders start-up progress on stderr: one line rewritten in place on a terminal, plain lines otherwise. */
const makeProgress = (quiet: boolean) => {
  const tty = process.stderr.isTTY === true
  const loading = new Map<number, number>()
  const ready = new Set<number>()
  let stageCount = 0
  let open = false
  const line = (text: string) => {
    if (quiet) return
    if (tty) {
      process.stderr.write(`\r\x1b[2K${text}`)
      open = true
    } else process.stderr.write(`${text}\n`)
  }
  const done = () => {
    if (open) process.stderr.write("\n")
    open = false
  }
  const render = () => {
    const fraction = stageCount === 0
      ? 0
      : [...Array(stageCount).keys()].reduce((sum, i) => sum + (ready.has(i) ? 1 : loading.get(i) ?? 0), 0) / stageCount
    return `loading ${stageCount} stage${stageCount === 1 ? "" : "s"} ${bar(fraction)} ${ready.size}/${stageCount} ready`
  }
  return {
    update: (update: RunUpdate) =>
      Effect.sync(() => {
        switch (update._tag) {
          case "AgentsStarted":
            return line(`agents: ${update.nodes.map((n) => n.address).join(", ")}`) ?? (tty ? undefined : undefined)
          case "Planned":
            stageCount = update.stages.length
            if (!tty && !quiet) {
              for (const s of update.stages) line(`stage ${s.stageIndex}: blocks [${s.layers[0]}, ${s.layers[1]}) on ${s.address}`)
            }
            return line(render())
          case "StageLoading":
            loading.set(update.stageIndex, update.totalBytes > 0 ? update.loadedBytes / update.totalBytes : 0)
            return tty ? line(render()) : undefined
          case "StageReady":
            ready.add(update.stageIndex)
            line(render())
            if (ready.size === stageCount) done()
            return
          case "Recovering":
            done()
            ready.clear()
            loading.clear()
            process.stderr.write(
              `\nswactor run: recovering (attempt ${update.attempt}) after ${update.resumedAt} tokens: ${update.reason}\n`
            )
            return
          case "Recovered":
            done()
            process.stderr.write(
              `swactor run: recovered in ${ms(update.recovery.millis)} ms on ${
                update.recovery.stages.map((s) => `stage ${s.stageIndex} [${s.layers[0]}, ${s.layers[1]}) ${s.address}`).join(", ")
              }\n`
            )
            return
          default:
            return
        }
      }),
    done: Effect.sync(done)
  }
}

const ms = (value: number) => (value >= 100 ? value.toFixed(0) : value.toFixed(2))

export const renderSummary = (summary: RunSummary): string => {
  const lines = [
    `${summary.generatedTokens} tokens (${summary.outcome === "Eos" ? "end of sequence" : "max tokens"}), ` +
    `prompt ${summary.promptTokens} tokens`,
    `time to first token ${ms(summary.timeToFirstTokenMillis)} ms (prefill through the pipeline ${ms(summary.prefillMillis)} ms)`,
    `decode ${summary.decodeTokensPerSecond.toFixed(1)} tok/s (${ms(summary.decodeMillisPerToken)} ms per token: ` +
    `compute ${ms(summary.decodeMillisPerToken - summary.transferMillisPerToken)} ms, transfer ${ms(summary.transferMillisPerToken)} ms)`
  ]
  for (const s of summary.stages) {
    lines.push(
      `  stage ${s.stageIndex} blocks [${s.layers[0]}, ${s.layers[1]}) on ${s.address} (data ${formatAddress(s.dataAddress)}): ` +
        `compute ${ms(s.computeMillisPerToken)} ms/token, load ${ms(s.loadMillis)} ms${s.cachedWeights ? " (cached weights)" : ""}`
    )
  }
  if (summary.recoveries.length > 0) {
    lines.push(`recoveries: ${summary.recoveries.length}`)
    for (const r of summary.recoveries) {
      lines.push(`  attempt ${r.attempt} after ${r.resumedAt} tokens, ${ms(r.millis)} ms: ${r.reason}`)
    }
  }
  if (summary.stragglers.length > 0) {
    lines.push(
      `stragglers: ${summary.stragglers.length} slow tokens (${
        summary.stragglers.slice(0, 5).map((s) => `#${s.sequence} ${ms(s.latencyMillis)} ms vs median ${ms(s.medianMillis)} ms`).join(", ")
      }${summary.stragglers.length > 5 ? ", ..." : ""})`
    )
  }
  return lines.join("\n")
}

const gib = (bytes: number) => `${(bytes / 2 ** 30).toFixed(1)} GiB`

/** `--dry-run`: the nodes' reported capacity, then the placement the planner made. */
const renderPreview = (update: RunUpdate): string => {
  switch (update._tag) {
    case "PoolReady":
      return [
        "nodes (as reported in their heartbeat):",
        ...update.capacity.map(({ capacity, node }) =>
          `  node ${node.nodeId} ${node.address}: ${capacity.hostname}, ${capacity.backend}, ${capacity.threads} threads, ` +
          `${gib(capacity.freeMemoryBytes)} free of ${gib(capacity.totalMemoryBytes)}, ${capacity.activeStages} stages hosted`
        )
      ].join("\n")
    case "Planned":
      return [
        `placement (run ${update.runId}):`,
        ...update.stages.map((s) => `  stage ${s.stageIndex}: blocks [${s.layers[0]}, ${s.layers[1]}) on ${s.address}`),
        "dry run: nothing was provisioned"
      ].join("\n")
    case "AgentsStarted":
      return `agents: ${update.nodes.map((n) => n.address).join(", ")}`
    default:
      return ""
  }
}

const describeError = (error: GenerateError): string => {
  const message = "message" in error && typeof error.message === "string" && error.message !== "" ? error.message : ""
  return message !== "" ? `${error._tag}: ${message}` : `${error._tag}: ${JSON.stringify(error)}`
}

/**
 * Keeps a SIGINT/SIGTERM listener registered while a run is in flight: the Effect runtime interrupts the
 * run on the first signal (operator stop, then the full teardown), and a loader that exits the process when
 * no listener is left (tsx) must not cut that teardown short. A second signal exits at once.
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
    // A reader that went away (`swactor run ... | head`) is a closed stream: an operator stop, as Ctrl-C is,
    // instead of an EPIPE crash.
    let stdoutClosed = false
    const onStdoutError = (error: NodeJS.ErrnoException) => {
      if (error.code !== "EPIPE" || stdoutClosed) return
      stdoutClosed = true
      process.kill(process.pid, "SIGINT")
    }
    process.stdout.on("error", onStdoutError)
    return { onSignal, onStdoutError }
  }),
  ({ onSignal, onStdoutError }) =>
    Effect.sync(() => {
      process.off("SIGINT", onSignal)
      process.off("SIGTERM", onSignal)
      process.stdout.off("error", onStdoutError)
    })
)

export const runRunCommand = (args: RunArgs) =>
  Effect.gen(function*() {
    yield* holdSignals
    const model = Option.isSome(args.model) ? args.model.value : yield* defaultSyntheticModel
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
    const request: GenerateRequest = {
      model,
      prompt: args.prompt,
      maxTokens: args.maxTokens,
      sampling: {
        temperature: args.temperature,
        topK: args.topK,
        ...(Option.isSome(args.seed) ? { seed: args.seed.value } : {})
      },
      ...(Option.isSome(args.stages) ? { stages: args.stages.value } : nodes.length > 0 ? {} : { stages: 2 }),
      ...(threads === undefined ? {} : { threads }),
      ...(args.dryRun ? { dryRun: true } : {}),
      ...(args.spares > 0 ? { spares: args.spares } : {})
    }
    if (args.dryRun) {
      return yield* run(request).pipe(
        Stream.map(renderPreview),
        Stream.filter((text) => text !== ""),
        Stream.runForEach((text) => Console.log(text)),
        Effect.provide(nodes.length > 0 ? layerRemote({ nodes, token }) : layerLocal(threads === undefined ? {} : { threads })),
        Effect.tapError((error) => Console.error(`swactor run --dry-run failed: ${describeError(error)}`))
      )
    }
    const progress = makeProgress(args.quiet)
    let wroteText = false
    yield* run(request).pipe(
      Stream.runForEach((update) => {
        if (update._tag === "Token") {
          return Effect.sync(() => {
            if (!wroteText) process.stdout.write(args.prompt)
            wroteText = true
            process.stdout.write(update.token.text)
          })
        }
        if (update._tag === "Finished") {
          return Effect.sync(() => {
            process.stdout.write("\n")
            if (!args.quiet) process.stderr.write(`${renderSummary(update.summary)}\n`)
          })
        }
        return progress.update(update)
      }),
      Effect.onInterrupt(() =>
        Effect.sync(() => {
          process.exitCode = 130
          process.stderr.write("\nswactor run: stopped by the operator; every stage was stopped\n")
        })
      ),
      Effect.provide(
        nodes.length > 0
          ? layerRemote({ nodes, token })
          : layerLocal(threads === undefined ? {} : { threads })
      ),
      Effect.tapError((error) =>
        Effect.sync(() => {
          if (wroteText) process.stdout.write("\n")
          process.stderr.write(`swactor run failed: ${describeError(error)}\n`)
        })
      )
    )
  }).pipe(
    Effect.scoped,
    Effect.tapError((error) => (typeof error === "string" ? Console.error(`swactor run: ${error}`) : Effect.void))
  )

export const runCommand = Command.make(
  "run",
  {
    model: Options.file("model").pipe(
      Options.withDescription("GGUF model (default: a small synthetic model, written once to ~/.cache/swactor)"),
      Options.optional
    ),
    prompt: Options.text("prompt").pipe(Options.withDefault("Once upon a time")),
    stages: Options.integer("stages").pipe(
      Options.withDescription("pipeline stages (local default 2; with --nodes, one per node)"),
      Options.optional
    ),
    maxTokens: Options.integer("max-tokens").pipe(Options.withDefault(128)),
    temperature: Options.float("temperature").pipe(Options.withDescription("0 = greedy"), Options.withDefault(0)),
    topK: Options.integer("top-k").pipe(Options.withDefault(40)),
    seed: Options.integer("seed").pipe(Options.withDescription("sampling seed (same seed, same text)"), Options.optional),
    threads: Options.integer("threads").pipe(Options.withDescription("engine threads per stage"), Options.optional),
    nodes: Options.text("nodes").pipe(
      Options.withDescription(`remote agents host:port,... (token from ${clusterTokenEnv} or --token-file)`),
      Options.optional
    ),
    tokenFile: Options.text("token-file").pipe(Options.optional),
    quiet: Options.boolean("quiet").pipe(Options.withDescription("only the text: no progress, no summary")),
    dryRun: Options.boolean("dry-run").pipe(
      Options.withDescription("ask the nodes for their capacity, print the placement, provision nothing")
    ),
    spares: Options.integer("spares").pipe(
      Options.withDescription("local agents: extra agents that host nothing until a recovery needs them"),
      Options.withDefault(0)
    )
  },
  runRunCommand
).pipe(Command.withDescription("Generate text across a pipeline of node agents (local child processes by default)"))
