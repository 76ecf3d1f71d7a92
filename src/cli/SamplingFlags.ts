/**
 * `swactor run`'s flags for llama.cpp's sampler chain (penalties, logit bias, grammar, log-probs), besides
 * --temperature, --top-k and --seed: declared once here, turned into SamplingOptions with one-line errors naming the
 * flag. The library checks the values again against the model (services/RequestChecks.ts samplingPolicyProblem).
 */
import { readFileSync } from "node:fs"
import { Effect, Option } from "effect"
import type { SamplingOptions } from "../services/Orchestrator.js"
import { maxLogprobs } from "../services/RequestChecks.js"
import { defaultPenaltyLastN } from "../services/Sampler.js"
import { UsageError } from "./Flags.js"
import * as Flag from "./FlagSpec.js"

const group = "Sampling"

export const samplingFlags = {
  topP: Flag.float("top-p", { group, text: "nucleus sampling: keep this much probability mass (1 = off)" }).optional(
    "off"
  ),
  minP: Flag.float("min-p", { group, text: "drop tokens under this fraction of the likeliest (0 = off)" }).optional(
    "off"
  ),
  repeatPenalty: Flag.float("repeat-penalty", {
    group,
    text: "divide the logits of recent tokens by this (1 = off)"
  }).optional("off"),
  presencePenalty: Flag.float("presence-penalty", {
    group,
    text: "subtract this from the logits of recent tokens (0 = off)"
  }).optional("off"),
  frequencyPenalty: Flag.float("frequency-penalty", {
    group,
    text: "subtract this per occurrence of a recent token (0 = off)"
  }).optional("off"),
  penaltyLastN: Flag.integer("penalty-last-n", {
    group,
    text: "recent tokens the penalties look at (-1: the whole context)"
  }).optional(String(defaultPenaltyLastN)),
  logitBias: Flag.text("logit-bias", {
    group,
    value: "ID=BIAS,...",
    text: "added to token logits (BIAS -inf bans the token)"
  }).optional(),
  grammarFile: Flag.file("grammar-file", {
    group,
    text: "a GBNF grammar (llama.cpp's) the output must follow, rule root"
  }).optional(),
  logprobs: Flag.integer("logprobs", {
    group: "Output",
    text: `with --json: each token's log-probability and this many alternatives (0-${maxLogprobs})`
  }).optional()
}

export type SamplingFlagArgs = {
  readonly [K in keyof typeof samplingFlags]?: Option.Option<
    (typeof samplingFlags)[K] extends Flag.Flag<Option.Option<infer A>> ? A : never
  >
}

const fail = (message: string) => Effect.fail(new UsageError({ message }))

const finiteFlag = (
  flag: string,
  value: Option.Option<number> | undefined,
  min = -Infinity,
  max = Infinity,
  what = `a number from ${min} to ${max}`
) =>
  value === undefined || Option.isNone(value)
    ? Effect.succeed(undefined)
    : Number.isFinite(value.value) && value.value >= min && value.value <= max
      ? Effect.succeed(value.value)
      : fail(`--${flag} must be ${what}, got ${value.value}`)

const parseBias = (text: string) =>
  Effect.forEach(
    text.split(",").filter((s) => s.trim() !== ""),
    (entry) => {
      const m = /^\s*(\d+)\s*=\s*(-?inf|[-+]?\d*\.?\d+(?:e[-+]?\d+)?)\s*$/i.exec(entry)
      if (m === null) return fail(`--logit-bias takes ID=BIAS,... (BIAS a number or -inf), got "${entry.trim()}"`)
      const bias = /^-inf$/i.test(m[2]!) ? -Infinity : Number(m[2])
      if (m[2]!.toLowerCase() === "inf")
        return fail("--logit-bias: +inf is no bias (use a large number, or -inf to ban)")
      return Effect.succeed({ tokenId: Number(m[1]), bias })
    }
  )

/** The sampling options the flags ask for (only those given). */
export const samplingFromFlags = (args: SamplingFlagArgs): Effect.Effect<Partial<SamplingOptions>, UsageError> =>
  Effect.gen(function* () {
    const topP = yield* finiteFlag("top-p", args.topP, 0, 1)
    const minP = yield* finiteFlag("min-p", args.minP, 0, 1)
    const repeatPenalty = yield* finiteFlag(
      "repeat-penalty",
      args.repeatPenalty,
      Number.MIN_VALUE,
      100,
      "above 0 and at most 100 (1 = off)"
    )
    const presencePenalty = yield* finiteFlag("presence-penalty", args.presencePenalty, -100, 100)
    const frequencyPenalty = yield* finiteFlag("frequency-penalty", args.frequencyPenalty, -100, 100)
    const penaltyLastN = yield* finiteFlag(
      "penalty-last-n",
      args.penaltyLastN,
      -1,
      Infinity,
      "-1 (the whole context) or more"
    )
    const logprobs = yield* finiteFlag("logprobs", args.logprobs, 0, maxLogprobs)
    const logitBias =
      args.logitBias !== undefined && Option.isSome(args.logitBias) ? yield* parseBias(args.logitBias.value) : undefined
    let grammar: SamplingOptions["grammar"]
    if (args.grammarFile !== undefined && Option.isSome(args.grammarFile)) {
      const path = args.grammarFile.value
      const text = yield* Effect.try({
        try: () => readFileSync(path, "utf8"),
        catch: (e) => new UsageError({ message: `--grammar-file: cannot read ${path}: ${String(e)}` })
      })
      grammar = { text }
    }
    return {
      ...(topP === undefined ? {} : { topP }),
      ...(minP === undefined ? {} : { minP }),
      ...(repeatPenalty === undefined ? {} : { repeatPenalty }),
      ...(presencePenalty === undefined ? {} : { presencePenalty }),
      ...(frequencyPenalty === undefined ? {} : { frequencyPenalty }),
      ...(penaltyLastN === undefined ? {} : { penaltyLastN }),
      ...(logprobs === undefined ? {} : { logprobs }),
      ...(logitBias === undefined ? {} : { logitBias }),
      ...(grammar === undefined ? {} : { grammar })
    }
  })
