/**
 * The flags of `swactor run`: their options, the arguments they parse into, and the checks every flag passes before
 * anything starts (numbers, sampling, nodes and cluster token, placement, the prompt).
 */
import { readFileSync } from "node:fs"
import { Effect, Option } from "effect"
import { clusterTokenEnv } from "../layers/agent/ReadyLine.js"
import type { PlacementRequest } from "../services/Orchestrator.js"
import { parseLayerSpec } from "../services/Placement.js"
import { emptyPromptMessage, isEmptyPrompt } from "../services/RequestChecks.js"
import {
  agentList,
  agentsFlag,
  atLeast,
  backendFlag,
  clusterToken,
  deliverWeightsFlag,
  localBackendArgs,
  optionalPrefillThreads,
  optionalThreads,
  optionalWholeNumber,
  prefillThreadsFlag,
  spares as checkSpares,
  sparesFlag,
  threadsFlag,
  tlsFlag,
  tlsMode,
  tokenFileFlag,
  tokenLoopFlag,
  UsageError,
  wholeNumber
} from "./Flags.js"
import * as Flag from "./FlagSpec.js"
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
/** Local agents a run starts without --stages or --agents. */
const defaultLocalStages = 2

/** The flags of `swactor run`: what they parse into and what `--help` says of them. */
export const runFlags = {
  model: Flag.modelPath("model", { group: "Model and prompt", text: "GGUF model" }).optional(
    "a small synthetic model, written once to ~/.cache/swactor"
  ),
  prompt: Flag.text("prompt", {
    group: "Model and prompt",
    text: "prompt text, or - to read it from standard input"
  }).optional(JSON.stringify(defaultPrompt)),
  promptFile: Flag.file("prompt-file", {
    group: "Model and prompt",
    text: "read the prompt from this file"
  }).optional(),
  stages: Flag.integer("stages", { group: "Pipeline", text: "pipeline stages" }).optional(
    `${defaultLocalStages} local agents; with --agents, one per agent`
  ),
  maxTokens: Flag.integer("max-tokens", {
    group: "Sampling",
    text: "tokens to generate (prompt + max tokens must fit the model's context)"
  }).withDefault(128),
  temperature: Flag.float("temperature", { group: "Sampling", text: "0 = greedy" }).withDefault(0),
  topK: Flag.integer("top-k", { group: "Sampling", text: "sample among the k likeliest (0 = all)" }).withDefault(40),
  seed: Flag.integer("seed", { group: "Sampling", text: "sampling seed (same seed, same text)" }).optional(
    "a random one"
  ),
  ...samplingFlags,
  threads: threadsFlag("Pipeline"),
  agents: agentsFlag,
  tls: tlsFlag,
  backend: backendFlag("Pipeline", " of the local agents"),
  tokenFile: tokenFileFlag,
  quiet: Flag.boolean("quiet", { group: "Output", text: "only the text: no progress, no summary" }),
  json: Flag.boolean("json", {
    group: "Output",
    text: "print one JSON document when the run ends: ok, text, tokens, summary or fault"
  }),
  dryRun: Flag.boolean("dry-run", {
    group: "Output",
    text: "ask the nodes for their capacity, print the placement, provision nothing"
  }),
  placement: Flag.choice("placement", ["balanced", "capacity", "fixed"], {
    group: "Pipeline",
    text: "balanced: equal blocks per stage; capacity: by node speed within memory; fixed: --layers"
  })
    .optional("balanced; fixed with --layers")
    .map(Option.getOrUndefined),
  layers: Flag.text("layers", {
    group: "Pipeline",
    value: "RANGES",
    text: "fixed block ranges per stage, inclusive, e.g. 0-9,10-15"
  }).optional(),
  deliverWeights: deliverWeightsFlag,
  tokenLoop: tokenLoopFlag("orchestrator"),
  prefillThreads: prefillThreadsFlag,
  spares: sparesFlag
}

/** The headings of `swactor run --help`, in order. */
export const runGroups = ["Model and prompt", "Pipeline", "Sampling", "Network and security", "Output"]

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
    if (args.spares !== undefined) yield* checkSpares(args.spares)
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
    const localStages = placement?._tag === "Fixed" ? placement.ranges.length : defaultLocalStages
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
