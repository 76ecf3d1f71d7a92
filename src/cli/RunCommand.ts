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
import * as TokenizerLive from "../layers/gguf/TokenizerLive.js"
import { Tokenizer } from "../services/Tokenizer.js"
import { formatAddress } from "../layers/agent/AgentControlRpc.js"
import { writeSyntheticModel } from "../layers/gguf/Synthetic.js"
import { clusterTokenEnv } from "../layers/agent/ReadyLine.js"
import {
  atLeast,
  clusterToken,
  modelFactsOf,
  nodeList,
  optionalThreads,
  optionalWholeNumber,
  spares as sparesFlag,
  UsageError,
  wholeNumber,
  withShownDefault
} from "./Flags.js"
import { untilOperatorStop } from "./Signals.js"
import type {
  GenerateRequest,
  PlacementExplanation,
  PlacementRequest,
  RunSummary,
  RunUpdate,
  TokenLogprob
} from "../services/Orchestrator.js"
import { samplingFlags, type SamplingFlagArgs, samplingFromFlags } from "./SamplingFlags.js"
import { parseLayerSpec } from "../services/Placement.js"
import { contextProblem, emptyPromptMessage, fitsContext, isEmptyPrompt, stagesProblem } from "../services/RequestChecks.js"

export interface RunArgs extends SamplingFlagArgs {
  readonly model: Option.Option<string>
  readonly prompt: Option.Option<string>
  readonly promptFile: Option.Option<string>
  readonly stages: Option.Option<number>
  readonly maxTokens: number
  readonly temperature: number
  readonly topK: number
  readonly seed: Option.Option<number>
  readonly threads: Option.Option<number>
  readonly nodes: Option.Option<string>
  readonly tokenFile: Option.Option<string>
  readonly quiet: boolean
  readonly json: boolean
  readonly dryRun: boolean
  readonly placement?: "balanced" | "capacity" | "fixed" | undefined
  readonly layers?: Option.Option<string>
  /** Weight delivery: auto (to remote nodes), always (local agents too), never. */
  readonly deliverWeights?: "auto" | "always" | "never"
  readonly spares?: number
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
          case "WeightsDelivery": {
            const text = `weights for stage ${update.stageIndex} to ${update.address} ` +
              `${bar(update.totalBytes > 0 ? update.sentBytes / update.totalBytes : 1)} ` +
              `${(update.sentBytes / 2 ** 20).toFixed(1)}/${(update.totalBytes / 2 ** 20).toFixed(1)} MiB`
            if (tty) return line(text)
            return update.sentBytes === update.totalBytes ? line(text) : undefined
          }
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
    done: Effect.sync(done),
    allReady: () => stageCount > 0 && ready.size === stageCount
  }
}

const ms = (value: number) => (value >= 100 ? value.toFixed(0) : value.toFixed(2))

/**
 * Start-up phases of one `swactor run`, in milliseconds, as the command saw them (each from the end of the one before):
 * `process` launch to the command's start (Node and module loading), `checks` (flags, model metadata and vocabulary for
 * the context check), `spawn` (the orchestrator reads the model facts and tokenizer, starts or reaches the agents),
 * `pool` (control connections and the first heartbeats), `load` (plan, then every stage loaded and ready), `prefill`
 * (the prompt through the pipeline to the first token); `firstToken` is launch to first token.
 */
export interface StartupPhases {
  process: number
  checks: number
  spawn: number
  pool: number
  load: number
  prefill: number
  firstToken: number
}

/** Records when each phase ended; `performance.now()` counts from the process launch. */
export const makePhaseClock = () => {
  const marks: Partial<Record<"start" | "checked" | "spawned" | "pooled" | "ready" | "firstToken", number>> = {}
  const mark = (name: keyof typeof marks) => {
    marks[name] ??= performance.now()
  }
  const phases = (): StartupPhases | undefined => {
    const { checked, firstToken, pooled, ready, spawned, start } = marks
    if ([checked, firstToken, pooled, ready, spawned, start].some((m) => m === undefined)) return undefined
    const round = (x: number) => Math.round(x * 10) / 10
    return {
      process: round(start!),
      checks: round(checked! - start!),
      spawn: round(spawned! - checked!),
      pool: round(pooled! - spawned!),
      load: round(ready! - pooled!),
      prefill: round(firstToken! - ready!),
      firstToken: round(firstToken!)
    }
  }
  return { mark, phases }
}

export const renderPhases = (p: StartupPhases): string =>
  `start-up ${ms(p.firstToken)} ms to the first token: process ${ms(p.process)}, checks ${ms(p.checks)}, ` +
  `spawn ${ms(p.spawn)}, pool ${ms(p.pool)}, load ${ms(p.load)}, prefill ${ms(p.prefill)} ms`

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
        `compute ${ms(s.computeMillisPerToken)} ms/token, load ${ms(s.loadMillis)} ms${s.cachedWeights ? " (cached weights)" : ""}` +
        (s.peakResidentBytes > 0
          ? `; agent memory ${mib(s.residentBytes)}, peak ${mib(s.peakResidentBytes)} (KV ${size(s.kvBytes)}, compute ${
            size(s.computeBytes)
          })`
          : "")
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
  for (const s of summary.stageStragglers) {
    lines.push(
      `straggling stage ${s.stageIndex} on ${s.address}: ${s.tokens} slow token${s.tokens === 1 ? "" : "s"} ` +
        `(median ${ms(s.medianMillis)} ms, worst ${ms(s.worstMillis)} ms at #${s.worstSequence})`
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
          `${gib(capacity.freeMemoryBytes)} free of ${gib(capacity.totalMemoryBytes)}, ${capacity.activeStages} stages hosted` +
          (capacity.speedBytesPerSecond === undefined
            ? ""
            : `, ${(capacity.speedBytesPerSecond / 1e9).toFixed(2)} GB/s ${capacity.speedSource ?? "declared"}`)
        )
      ].join("\n")
    case "Planned":
      return [
        `placement (run ${update.runId}):`,
        ...update.stages.map((s) => `  stage ${s.stageIndex}: blocks [${s.layers[0]}, ${s.layers[1]}) on ${s.address}`),
        ...(update.placement === undefined ? [] : explainPlacement(update.placement)),
        "dry run: nothing was provisioned"
      ].join("\n")
    case "AgentsStarted":
      return `agents: ${update.nodes.map((n) => n.address).join(", ")}`
    default:
      return ""
  }
}

const mib = (bytes: number) => `${(bytes / 2 ** 20).toFixed(1)} MiB`
/** MiB, or KiB below one MiB. */
const size = (bytes: number) => bytes < 2 ** 20 ? `${(bytes / 1024).toFixed(1)} KiB` : mib(bytes)

/**
 * Why this placement: per stage its node's free memory and speed, its blocks, the weight bytes it stores and those it
 * reads per token (fewer for a mixture of experts: only the routed experts), its memory and expected ms per token.
 */
export const explainPlacement = ({ choice, pool }: PlacementExplanation): ReadonlyArray<string> => [
  `${choice.intent.toLowerCase()} placement, in the planner's cost model:`,
  ...choice.stages.map((s) => {
    const node = pool.find((n) => n.nodeId === s.nodeId)
    const free = node === undefined ? "unknown" : mib(node.freeMemoryBytes)
    const speed = node === undefined ? "unknown" : `${(node.speedBytesPerSecond / 1e9).toFixed(2)} GB/s`
    return `  stage ${s.stageIndex} on node ${s.nodeId} (${free} free, ${speed}): ` +
      `${s.layerEndExclusive - s.layerStart} blocks [${s.layerStart}, ${s.layerEndExclusive}), ` +
      `${mib(s.weightBytes)} weights, ${mib(s.activeBytes)} read per token, ${mib(s.memoryBytes)} with KV and buffers, ` +
      `${s.expectedMillis.toFixed(2)} ms/token`
  }),
  `  expected: ${choice.latencyMillis.toFixed(2)} ms per token for one sequence, ` +
  `${choice.bottleneckMillis.toFixed(2)} ms per token at the slowest stage (pipeline throughput limit)`,
  ...(choice.stages.length < pool.length
    ? [`  ${pool.length - choice.stages.length} node(s) left out: they would slow the pipeline or cannot hold a block`]
    : [])
]

/** The placement a command line asks for (`--placement`, `--layers`), or a usage message. */
export const placementFromArgs = (
  args: Pick<RunArgs, "placement" | "layers">
): Effect.Effect<PlacementRequest | undefined, string> => {
  const layers = args.layers !== undefined && Option.isSome(args.layers) ? args.layers.value : undefined
  if (layers !== undefined) {
    if (args.placement !== undefined && args.placement !== "fixed") {
      return Effect.fail(`--layers sets a fixed placement; it cannot be combined with --placement ${args.placement}`)
    }
    const parsed = parseLayerSpec(layers)
    return parsed._tag === "Left"
      ? Effect.fail(parsed.left.message)
      : Effect.succeed({ _tag: "Fixed", ranges: parsed.right })
  }
  if (args.placement === "fixed") return Effect.fail("--placement fixed needs --layers, e.g. --layers 0-9,10-15")
  if (args.placement === "capacity") return Effect.succeed({ _tag: "Capacity" })
  return Effect.succeed(args.placement === "balanced" ? { _tag: "Balanced" } : undefined)
}

const describeError = (error: { readonly _tag: string }): string => {
  const message = "message" in error && typeof error.message === "string" && error.message !== "" ? error.message : ""
  return message !== "" ? `${error._tag}: ${message}` : `${error._tag}: ${JSON.stringify(error)}`
}

/** The prompt: `--prompt TEXT`, `--prompt -` (stdin), or `--prompt-file PATH` (one trailing newline dropped). */
const promptText = (args: RunArgs): Effect.Effect<string, UsageError> =>
  Effect.gen(function*() {
    if (Option.isSome(args.promptFile) && Option.isSome(args.prompt)) {
      return yield* new UsageError({ message: "--prompt and --prompt-file: give one of them" })
    }
    const read = (flag: string, path: string | 0) =>
      Effect.try({
        try: () => readFileSync(path, "utf8").replace(/\r?\n$/, ""),
        catch: (cause) =>
          new UsageError({ message: `${flag}: cannot read it (${(cause as NodeJS.ErrnoException).code ?? String(cause)})` })
      })
    const text = Option.isSome(args.promptFile)
      ? yield* read(`--prompt-file ${args.promptFile.value}`, args.promptFile.value)
      : Option.isSome(args.prompt) && args.prompt.value === "-"
      ? yield* read("--prompt - (standard input)", 0)
      : Option.getOrElse(args.prompt, () => defaultPrompt)
    if (isEmptyPrompt(text)) {
      return yield* new UsageError({
        message: `${Option.isSome(args.promptFile) ? "--prompt-file" : "--prompt"}: ${emptyPromptMessage}`
      })
    }
    return text
  })

/**
 * What the model allows, checked before any agent starts, from its metadata (the GGUF header; no weights): the
 * stages against its blocks, and prompt + max tokens against its context (services/RequestChecks.ts: the same rule
 * and words as `swactor serve` and the library), instead of ~100 agents started for a plan that cannot be, or a
 * ContextOverflow fault at the end of a long generation.
 */
const checkModelFit = (model: string, prompt: string, maxTokens: number, stages: number | undefined) =>
  Effect.gen(function*() {
    const facts = yield* modelFactsOf(model)
    if (stages !== undefined) {
      const problem = stagesProblem(stages, facts.numLayers, "--stages")
      if (problem !== undefined) return yield* new UsageError({ message: problem })
    }
    // Every prompt token covers at least one byte of the text, plus BOS and a leading-space token at most: when that
    // bound fits, the (slow: node-llama-cpp) vocabulary load is left to the run itself.
    if (fitsContext(Buffer.byteLength(prompt, "utf8") + 4, maxTokens, facts.maxSeqLen)) return
    const tokenizer = yield* Effect.flatMap(Tokenizer, (t) => t.open(model))
    const problem = contextProblem(tokenizer.tokenize(prompt).length, maxTokens, facts.maxSeqLen, "--max-tokens")
    if (problem !== undefined) return yield* new UsageError({ message: problem })
  }).pipe(Effect.scoped, Effect.provide(TokenizerLive.layer))

/** Every flag of `swactor run`, checked before anything starts. */
const validate = (args: RunArgs) =>
  Effect.gen(function*() {
    const stages = yield* optionalWholeNumber("stages", args.stages, 1)
    const maxTokens = yield* wholeNumber("max-tokens", args.maxTokens, 1)
    const temperature = yield* atLeast("temperature", args.temperature, 0)
    const topK = yield* wholeNumber("top-k", args.topK, 0)
    if (args.spares !== undefined) yield* sparesFlag(args.spares)
    const seed = yield* optionalWholeNumber("seed", args.seed, 0)
    const chain = yield* samplingFromFlags(args)
    const threads = yield* optionalThreads(args.threads)
    const nodes = Option.isSome(args.nodes) ? yield* nodeList(args.nodes.value) : []
    const token = yield* clusterToken(args.tokenFile)
    if (nodes.length > 0 && token === "") {
      return yield* new UsageError({
        message: `--nodes needs the cluster token: set ${clusterTokenEnv} or pass --token-file`
      })
    }
    if (args.json && args.dryRun) return yield* new UsageError({ message: "--json and --dry-run: give one of them" })
    const placement = yield* placementFromArgs(args).pipe(Effect.mapError((message) => new UsageError({ message })))
    // A fixed placement run locally starts one agent per range.
    const localStages = placement?._tag === "Fixed" ? placement.ranges.length : 2
    const prompt = yield* promptText(args)
    return { stages, maxTokens, temperature, topK, seed, chain, threads, nodes, token, prompt, placement, localStages }
  })

/** What `--json` prints: one JSON document on stdout when the run ends (tokens, text, summary or fault). */
interface JsonReport {
  ok: boolean
  text: string
  tokens: Array<{ readonly id: number; readonly text: string; readonly logprob?: TokenLogprob }>
  summary?: RunSummary
  phases?: StartupPhases
  fault?: { readonly _tag: string; readonly message: string; readonly reason?: unknown }
  stopped?: string
}

const runRun = (args: RunArgs, json: JsonReport) =>
  Effect.gen(function*() {
    const clock = makePhaseClock()
    clock.mark("start")
    const flags = yield* validate(args)
    const { maxTokens, nodes, prompt, threads, token } = flags
    const model = Option.isSome(args.model) ? args.model.value : yield* defaultSyntheticModel
    // The agents a local run starts: one per stage (a fixed placement: one per range). Remote nodes: --stages if given.
    const plannedStages = Option.isSome(flags.stages)
      ? flags.stages.value
      : nodes.length > 0 ? undefined : flags.localStages
    yield* checkModelFit(model, prompt, maxTokens, plannedStages)
    clock.mark("checked")
    const request: GenerateRequest = {
      model,
      prompt,
      maxTokens,
      sampling: {
        temperature: flags.temperature,
        topK: flags.topK,
        ...(Option.isSome(flags.seed) ? { seed: flags.seed.value } : {}),
        ...flags.chain
      },
      ...(Option.isSome(flags.stages) ? { stages: flags.stages.value } : nodes.length > 0 ? {} : { stages: flags.localStages }),
      ...(flags.placement === undefined ? {} : { placement: flags.placement }),
      // Nodes that lack the model file receive their stages' slices (remote nodes by default; never for a dry run).
      ...(!args.dryRun && (args.deliverWeights === "always" || (args.deliverWeights !== "never" && nodes.length > 0))
        ? { deliverWeights: true }
        : {}),
      ...(Option.isSome(threads) ? { threads: threads.value } : {}),
      ...(args.dryRun ? { dryRun: true } : {}),
      ...((args.spares ?? 0) !== 0 ? { spares: args.spares! } : {})
    }
    const layer = nodes.length > 0
      ? layerRemote({ nodes, token })
      : layerLocal({
        // The agents boot while the orchestrator reads the model's facts and vocabulary.
        prestart: (request.stages ?? 2) + (request.spares ?? 0),
        // Local agents are alike (one machine, same threads): their speed probe runs after they are ready, off the
        // start-up path. A dry run explains placement with measured speeds, so there they measure first.
        ...(args.dryRun ? {} : { extraArgs: () => ["--speed-probe", "after-ready"] }),
        ...(Option.isSome(threads) ? { threads: threads.value } : {})
      })
    if (args.dryRun) {
      return yield* run(request).pipe(
        Stream.map(renderPreview),
        Stream.filter((text) => text !== ""),
        Stream.runForEach((text) => Console.log(text)),
        Effect.provide(layer)
      )
    }
    const quiet = args.quiet || args.json
    const progress = makeProgress(quiet)
    let wroteText = false
    yield* run(request).pipe(
      Stream.runForEach((update) => {
        if (update._tag === "AgentsStarted") clock.mark("spawned")
        if (update._tag === "PoolReady") clock.mark("pooled")
        if (update._tag === "Token") {
          return Effect.sync(() => {
            clock.mark("ready") // a single-stage run: every stage was ready before its token
            clock.mark("firstToken")
            const last = json.tokens[json.tokens.length - 1]
            if (update.token.tokenId < 0 && last !== undefined) {
              // the run's end flushed an incomplete character (U+FFFD): text of the last token, not a token
              json.tokens[json.tokens.length - 1] = { ...last, text: last.text + update.token.text }
            } else {
              json.tokens.push({
                id: update.token.tokenId,
                text: update.token.text,
                ...(update.token.logprob === undefined ? {} : { logprob: update.token.logprob })
              })
            }
            json.text += update.token.text
            if (args.json) return
            if (!wroteText) process.stdout.write(prompt)
            wroteText = true
            process.stdout.write(update.token.text)
          })
        }
        if (update._tag === "Finished") {
          return Effect.sync(() => {
            json.ok = true
            json.summary = update.summary
            const phases = clock.phases()
            if (phases !== undefined) json.phases = phases
            if (args.json) return
            process.stdout.write("\n")
            if (!quiet) {
              process.stderr.write(`${renderSummary(update.summary)}\n${phases === undefined ? "" : `${renderPhases(phases)}\n`}`)
            }
          })
        }
        return progress.update(update).pipe(
          Effect.tap(() => {
            if (update._tag === "StageReady" && progress.allReady()) clock.mark("ready")
          })
        )
      }),
      Effect.provide(layer),
      Effect.tapError(() => Effect.sync(() => wroteText && process.stdout.write("\n")))
    )
  })

const describeFailure = (error: { readonly _tag: string; readonly message?: unknown }): string =>
  error._tag === "UsageError" ? String(error.message) : `failed: ${describeError(error)}`

/** `swactor run` with its operator stops (signals, closed stdout): see cli/Signals.ts. */
export const runRunCommand = (args: RunArgs) => {
  const json: JsonReport = { ok: false, text: "", tokens: [] }
  const printJson = Effect.sync(() => {
    if (args.json) process.stdout.write(`${JSON.stringify(json)}\n`)
  })
  return untilOperatorStop(runRun(args, json), {
    onStop: (stop) =>
      stop._tag === "OutputClosed"
        ? Effect.void
        : Effect.sync(() => {
          json.stopped = stop.signal
          process.stderr.write(`\nswactor run: stopped by the operator (${stop.signal}); every stage was stopped\n`)
        }).pipe(Effect.zipRight(printJson))
  }).pipe(
    Effect.tap((result) => (Option.isSome(result) ? printJson : Effect.void)),
    Effect.tapError((error) =>
      Effect.sync(() => {
        json.fault = {
          _tag: error._tag,
          message: "message" in error && typeof error.message === "string" ? error.message : describeError(error),
          ...("reason" in error ? { reason: error.reason } : {})
        }
        process.stderr.write(`swactor run${error._tag === "UsageError" ? ":" : ""} ${describeFailure(error)}\n`)
      }).pipe(Effect.zipRight(printJson))
    )
  )
}

const defaultPrompt = "Once upon a time"

export const runCommand = Command.make(
  "run",
  {
    model: Options.file("model").pipe(
      Options.withDescription("GGUF model (default: a small synthetic model, written once to ~/.cache/swactor)"),
      Options.optional
    ),
    prompt: Options.text("prompt").pipe(
      Options.withDescription(`prompt text, or - to read it from standard input (default: "${defaultPrompt}")`),
      Options.optional
    ),
    promptFile: Options.file("prompt-file").pipe(Options.withDescription("read the prompt from this file"), Options.optional),
    stages: Options.integer("stages").pipe(
      Options.withDescription("pipeline stages (default: 2 local agents; with --nodes, one per node)"),
      Options.optional
    ),
    maxTokens: Options.integer("max-tokens").pipe(
      Options.withDescription("tokens to generate (prompt + max tokens must fit the model's context)"),
      withShownDefault(128)
    ),
    temperature: Options.float("temperature").pipe(Options.withDescription("0 = greedy"), withShownDefault(0)),
    topK: Options.integer("top-k").pipe(Options.withDescription("sample among the k likeliest (0 = all)"), withShownDefault(40)),
    seed: Options.integer("seed").pipe(Options.withDescription("sampling seed (same seed, same text)"), Options.optional),
    ...samplingFlags,
    threads: Options.integer("threads").pipe(
      Options.withDescription("engine threads per stage (default: every core of the node)"),
      Options.optional
    ),
    nodes: Options.text("nodes").pipe(
      Options.withDescription(`remote agents host:port,... (token from ${clusterTokenEnv} or --token-file)`),
      Options.optional
    ),
    tokenFile: Options.text("token-file").pipe(
      Options.withDescription(`file holding the cluster token (default: the ${clusterTokenEnv} environment variable)`),
      Options.optional
    ),
    quiet: Options.boolean("quiet").pipe(Options.withDescription("only the text: no progress, no summary")),
    json: Options.boolean("json").pipe(
      Options.withDescription("print one JSON document when the run ends: ok, text, tokens, summary or fault")
    ),
    dryRun: Options.boolean("dry-run").pipe(
      Options.withDescription("ask the nodes for their capacity, print the placement, provision nothing")
    ),
    placement: Options.choice("placement", ["balanced", "capacity", "fixed"]).pipe(
      Options.withDescription("balanced: equal blocks per stage; capacity: by node speed within memory; fixed: --layers"),
      Options.optional,
      Options.map(Option.getOrUndefined)
    ),
    layers: Options.text("layers").pipe(
      Options.withDescription("fixed block ranges per stage, inclusive, e.g. 0-9,10-15"),
      Options.optional
    ),
    deliverWeights: Options.choice("deliver-weights", ["auto", "always", "never"]).pipe(
      Options.withDescription(
        "send each stage's weights (a GGUF slice) to nodes that lack them: auto (remote --nodes), always, never"
      ),
      withShownDefault("auto" as const)
    ),
    spares: Options.integer("spares").pipe(
      Options.withDescription("local agents: extra agents that host nothing until a recovery needs them (at most 64)"),
      withShownDefault(0)
    )
  },
  runRunCommand
).pipe(Command.withDescription("Generate text across a pipeline of node agents (local child processes by default)"))
