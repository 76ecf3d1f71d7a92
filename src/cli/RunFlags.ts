/**
 * The flags of `swactor run`: their options, the arguments they parse into, and the checks every flag passes before
 * anything starts (the pipeline's, shared with serve: cli/PipelineFlags.ts; then numbers, sampling, placement, the
 * prompt).
 */
import { readFileSync } from "node:fs"
import { Effect, Option } from "effect"
import type { PlacementRequest } from "../services/Orchestrator.js"
import { parseLayerSpec } from "../services/Placement.js"
import { emptyPromptMessage, isEmptyPrompt } from "../services/RequestChecks.js"
import { atLeast, optionalWholeNumber, UsageError, wholeNumber } from "./Flags.js"
import * as Flag from "./FlagSpec.js"
import {
  checkPipelineFlags,
  defaultLocalStages,
  modelFlag,
  pipelineFlags,
  securityFlags,
  speculativeFlags,
  checkSpeculativeFlags
} from "./PipelineFlags.js"
import { samplingFlags, samplingFromFlags } from "./SamplingFlags.js"

const defaultPrompt = "Once upon a time"

/** The flags of `swactor run`: what they parse into and what `--help` says of them. */
export const runFlags = {
  model: modelFlag("Model and prompt").optional("a small synthetic model, written once to ~/.cache/swactor"),
  prompt: Flag.text("prompt", {
    group: "Model and prompt",
    text: "prompt text, or - to read it from standard input"
  }).optional(JSON.stringify(defaultPrompt)),
  promptFile: Flag.file("prompt-file", {
    group: "Model and prompt",
    text: "read the prompt from this file"
  }).optional(),
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
  ...pipelineFlags("orchestrator"),
  placement: Flag.choice("placement", ["balanced", "capacity", "fixed"], {
    group: "Pipeline",
    text:
      "balanced: equal blocks per stage; capacity: by node speed within memory, maybe on fewer nodes; " +
      "fixed: --layers"
  })
    .optional("with --agents, the stages' blocks by node speed within memory; else balanced")
    .map(Option.getOrUndefined),
  layers: Flag.text("layers", {
    group: "Pipeline",
    value: "RANGES",
    text: "fixed block ranges per stage, inclusive, e.g. 0-9,10-15"
  }).optional(),
  ...speculativeFlags,
  ...securityFlags,
  quiet: Flag.boolean("quiet", { group: "Output", text: "only the text: no progress, no summary" }),
  json: Flag.boolean("json", {
    group: "Output",
    text: "print one JSON document when the run ends: ok, text, tokens, summary or fault"
  }),
  dryRun: Flag.boolean("dry-run", {
    group: "Output",
    text: "ask the nodes for their capacity, print the placement, provision nothing"
  }),
  timeline: Flag.boolean("timeline", {
    group: "Output",
    text:
      "time every decoded token on every stage and link (waiting, wake-ups, framing, queueing, copies, compute, " +
      "send): a table after the summary, the summary's timeline with --json"
  })
}

/** What the flags of `swactor run` parse into. */
export type RunArgs = Flag.ArgsOf<typeof runFlags>

/** The headings of `swactor run --help`, in order. */
export const runGroups = ["Model and prompt", "Pipeline", "Sampling", "Network and security", "Output"]

/** The placement a command line asks for (`--placement`, `--layers`), or a usage message. */
const placementFromArgs = (
  args: Pick<RunArgs, "placement" | "layers">
): Effect.Effect<PlacementRequest | undefined, string> => {
  const layers = Option.getOrUndefined(args.layers)
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

/** Every flag of `swactor run`, checked before anything starts: the pipeline's (cli/PipelineFlags.ts), then its own. */
export const validateRunFlags = (args: RunArgs) =>
  Effect.gen(function* () {
    const pipeline = yield* checkPipelineFlags(args)
    yield* checkSpeculativeFlags(args)
    const maxTokens = yield* wholeNumber("max-tokens", args.maxTokens, 1)
    const temperature = yield* atLeast("temperature", args.temperature, 0)
    const topK = yield* wholeNumber("top-k", args.topK, 0)
    const seed = yield* optionalWholeNumber("seed", args.seed, 0)
    const chain = yield* samplingFromFlags(args)
    if (args.json && args.dryRun) return yield* new UsageError({ message: "--json and --dry-run: give one of them" })
    const placement = yield* placementFromArgs(args).pipe(Effect.mapError((message) => new UsageError({ message })))
    // A fixed placement run locally starts one agent per range.
    const localStages = placement?._tag === "Fixed" ? placement.ranges.length : defaultLocalStages
    const prompt = yield* promptText(args)
    return { pipeline, maxTokens, temperature, topK, seed, chain, prompt, placement, localStages }
  })

/** The flags of a run once checked. */
export type CheckedRunFlags = Effect.Effect.Success<ReturnType<typeof validateRunFlags>>
