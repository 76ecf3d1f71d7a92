/**
 * The flags of `swactor run`: their options, the arguments they parse into, and the checks every flag passes before
 * anything starts (numbers, sampling, nodes and cluster token, placement, the prompt).
 */
import * as Options from "@effect/cli/Options"
import { readFileSync } from "node:fs"
import { Effect, Option } from "effect"
import { clusterTokenEnv } from "../layers/agent/ReadyLine.js"
import type { PlacementRequest } from "../services/Orchestrator.js"
import { parseLayerSpec } from "../services/Placement.js"
import { emptyPromptMessage, isEmptyPrompt } from "../services/RequestChecks.js"
import {
  atLeast,
  backendOption,
  clusterToken,
  localBackendArgs,
  agentList,
  optionalPrefillThreads,
  prefillThreadsFlag,
  optionalThreads,
  optionalWholeNumber,
  spares as sparesFlag,
  tlsFlag,
  tlsMode,
  UsageError,
  wholeNumber,
  withShownDefault
} from "./Flags.js"
import { samplingFlags, type SamplingFlagArgs, samplingFromFlags } from "./SamplingFlags.js"

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
  readonly agents: Option.Option<string>
  readonly tokenFile: Option.Option<string>
  readonly quiet: boolean
  readonly json: boolean
  readonly dryRun: boolean
  readonly placement?: "balanced" | "capacity" | "fixed" | undefined
  readonly layers?: Option.Option<string>
  /** Weight delivery: auto (to remote nodes), always (local agents too), never. */
  readonly deliverWeights?: "auto" | "always" | "never"
  /** --token-loop on|off: the last stage sends each token straight to stage 0 (PipelineOptions.tokenLoop). */
  readonly tokenLoop?: "on" | "off"
  /** --prefill-threads N (PipelineOptions.prefillThreads). */
  readonly prefillThreads?: Option.Option<number>
  readonly spares?: number
  /** --tls auto|always|off (else SWACTOR_TLS): the links of this run's agents. */
  readonly tls?: Option.Option<"auto" | "always" | "off">
  /** --backend cpu|cuda|auto: the local agents' backend (else SWACTOR_GGML_PACKAGE picks their package; CPU stages). */
  readonly backend?: Option.Option<"cpu" | "cuda" | "auto">
}

const defaultPrompt = "Once upon a time"

/** The options of `swactor run`. */
export const runFlags = {
  model: Options.file("model").pipe(
    Options.withDescription("GGUF model (default: a small synthetic model, written once to ~/.cache/swactor)"),
    Options.optional
  ),
  prompt: Options.text("prompt").pipe(
    Options.withDescription(`prompt text, or - to read it from standard input (default: "${defaultPrompt}")`),
    Options.optional
  ),
  promptFile: Options.file("prompt-file").pipe(
    Options.withDescription("read the prompt from this file"),
    Options.optional
  ),
  stages: Options.integer("stages").pipe(
    Options.withDescription("pipeline stages (default: 2 local agents; with --agents, one per node)"),
    Options.optional
  ),
  maxTokens: Options.integer("max-tokens").pipe(
    Options.withDescription("tokens to generate (prompt + max tokens must fit the model's context)"),
    withShownDefault(128)
  ),
  temperature: Options.float("temperature").pipe(Options.withDescription("0 = greedy"), withShownDefault(0)),
  topK: Options.integer("top-k").pipe(
    Options.withDescription("sample among the k likeliest (0 = all)"),
    withShownDefault(40)
  ),
  seed: Options.integer("seed").pipe(Options.withDescription("sampling seed (same seed, same text)"), Options.optional),
  ...samplingFlags,
  threads: Options.integer("threads").pipe(
    Options.withDescription("engine threads per stage (default: every core of the node)"),
    Options.optional
  ),
  agents: Options.text("agents").pipe(
    Options.withAlias("nodes"),
    Options.withDescription(`agents host:port,... (alias --nodes; token from ${clusterTokenEnv} or --token-file)`),
    Options.optional
  ),
  tls: tlsFlag,
  backend: backendOption(" of the local agents"),
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
      "send each stage's weights (a GGUF slice) to nodes that lack them: auto (remote --agents), always, never"
    ),
    withShownDefault("auto" as const)
  ),
  tokenLoop: Options.choice("token-loop", ["on", "off"]).pipe(
    Options.withDescription(
      "the last stage sends each token straight to stage 0 as well as back (on), or only back to the orchestrator (off)"
    ),
    withShownDefault("on" as const)
  ),
  prefillThreads: prefillThreadsFlag,
  spares: Options.integer("spares").pipe(
    Options.withDescription("local agents: extra agents that host nothing until a recovery needs them (at most 64)"),
    withShownDefault(0)
  )
}

/** The placement a command line asks for (`--placement`, `--layers`), or a usage message. */
const placementFromArgs = (
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

const promptText = (args: RunArgs): Effect.Effect<string, UsageError> =>
  Effect.gen(function* () {
    if (Option.isSome(args.promptFile) && Option.isSome(args.prompt)) {
      return yield* new UsageError({ message: "--prompt and --prompt-file: give one of them" })
    }
    const read = (flag: string, path: string | 0) =>
      Effect.try({
        try: () => readFileSync(path, "utf8").replace(/\r?\n$/, ""),
        catch: (cause) =>
          new UsageError({
            message: `${flag}: cannot read it (${(cause as NodeJS.ErrnoException).code ?? String(cause)})`
          })
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

/** Every flag of `swactor run`, checked before anything starts. */
export const validateRunFlags = (args: RunArgs) =>
  Effect.gen(function* () {
    const stages = yield* optionalWholeNumber("stages", args.stages, 1)
    const maxTokens = yield* wholeNumber("max-tokens", args.maxTokens, 1)
    const temperature = yield* atLeast("temperature", args.temperature, 0)
    const topK = yield* wholeNumber("top-k", args.topK, 0)
    if (args.spares !== undefined) yield* sparesFlag(args.spares)
    const seed = yield* optionalWholeNumber("seed", args.seed, 0)
    const chain = yield* samplingFromFlags(args)
    const threads = yield* optionalThreads(args.threads)
    const prefillThreads = yield* optionalPrefillThreads(args.prefillThreads)
    const nodes = Option.isSome(args.agents) ? yield* agentList(args.agents.value) : []
    const token = yield* clusterToken(args.tokenFile)
    yield* tlsMode(args.tls ?? Option.none())
    const agentArgs = yield* localBackendArgs(args.backend ?? Option.none(), nodes.length > 0)
    if (nodes.length > 0 && token === "") {
      return yield* new UsageError({
        message: `--agents needs the cluster token: set ${clusterTokenEnv} or pass --token-file`
      })
    }
    if (args.json && args.dryRun) return yield* new UsageError({ message: "--json and --dry-run: give one of them" })
    const placement = yield* placementFromArgs(args).pipe(Effect.mapError((message) => new UsageError({ message })))
    // A fixed placement run locally starts one agent per range.
    const localStages = placement?._tag === "Fixed" ? placement.ranges.length : 2
    const prompt = yield* promptText(args)
    return {
      stages,
      maxTokens,
      temperature,
      topK,
      seed,
      chain,
      threads,
      prefillThreads,
      nodes,
      token,
      prompt,
      placement,
      localStages,
      agentArgs
    }
  })

/** The flags of a run once checked. */
export type CheckedRunFlags = Effect.Effect.Success<ReturnType<typeof validateRunFlags>>
