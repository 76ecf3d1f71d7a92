/**
 * The sampling fields of OpenAI's and llama-server's completion requests, checked and mapped to SamplingOptions. Every
 * numeric field's range is in SamplingRanges.ts's table, checked first; then what a range cannot say:
 *
 * | field | also | SamplingOptions |
 * |---|---|---|
 * | temperature | default 1; 0 = greedy | temperature |
 * | top_p, min_p, typical_p, top_k | | topP, minP, typicalP, topK |
 * | seed | -1: random | seed |
 * | presence_penalty, frequency_penalty, repeat_penalty, repeat_last_n | | presencePenalty, frequencyPenalty, repeatPenalty, penaltyLastN |
 * | dry_multiplier, dry_base, dry_allowed_length, dry_penalty_last_n, dry_sequence_breakers | ≤ 64 strings | dry |
 * | xtc_probability, xtc_threshold | | xtc |
 * | logit_bias | `{"token id": bias}` with bias -100–100 (-100 bans), or llama-server's `[[id, bias or false]]` | logitBias |
 * | logprobs, top_logprobs | chat: a boolean + the count; completions: the count | logprobs |
 * | n | at most the server's `parallel` | (one request per choice) |
 *
 * Each problem is one line naming the field (`presence_penalty must be between -2 and 2, got 3`).
 */
import { Effect, Schema } from "effect"
import type { SamplingOptions } from "../../services/Orchestrator.js"
import { rangeProblem } from "./SamplingRanges.js"
import { type ResponseFormat, StructuredOutputFields, structuredOutputGrammar } from "./StructuredOutput.js"

const Num = Schema.optional(Schema.NullOr(Schema.Number))

/** The fields beside OpenAI's basic ones (temperature, top_p, top_k, min_p, seed, n: OpenAiBodies.ts SamplingFields). */
export const OpenAiSamplingFields = {
  typical_p: Num,
  presence_penalty: Num,
  frequency_penalty: Num,
  repeat_penalty: Num,
  repeat_last_n: Num,
  dry_multiplier: Num,
  dry_base: Num,
  dry_allowed_length: Num,
  dry_penalty_last_n: Num,
  dry_sequence_breakers: Schema.optional(Schema.NullOr(Schema.Array(Schema.String))),
  xtc_probability: Num,
  xtc_threshold: Num,
  logit_bias: Schema.optional(
    Schema.NullOr(
      Schema.Union(
        Schema.Record({ key: Schema.String, value: Schema.Number }),
        Schema.Array(
          Schema.Tuple(Schema.Union(Schema.Number, Schema.String), Schema.Union(Schema.Number, Schema.Boolean))
        )
      )
    )
  ),
  logprobs: Schema.optional(Schema.NullOr(Schema.Union(Schema.Boolean, Schema.Number))),
  top_logprobs: Num,
  ...StructuredOutputFields
}

type Nullable<A> = A | null | undefined
/** What the mapping reads of a body (both routes' bodies have it). */
export interface OpenAiSamplingBody {
  readonly temperature?: Nullable<number>
  readonly top_p?: Nullable<number>
  readonly top_k?: Nullable<number>
  readonly min_p?: Nullable<number>
  readonly seed?: Nullable<number>
  readonly n?: Nullable<number>
  readonly typical_p?: Nullable<number>
  readonly presence_penalty?: Nullable<number>
  readonly frequency_penalty?: Nullable<number>
  readonly repeat_penalty?: Nullable<number>
  readonly repeat_last_n?: Nullable<number>
  readonly dry_multiplier?: Nullable<number>
  readonly dry_base?: Nullable<number>
  readonly dry_allowed_length?: Nullable<number>
  readonly dry_penalty_last_n?: Nullable<number>
  readonly dry_sequence_breakers?: Nullable<ReadonlyArray<string>>
  readonly xtc_probability?: Nullable<number>
  readonly xtc_threshold?: Nullable<number>
  readonly logit_bias?: Nullable<
    { readonly [key: string]: number } | ReadonlyArray<readonly [number | string, number | boolean]>
  >
  readonly logprobs?: Nullable<boolean | number>
  readonly top_logprobs?: Nullable<number>
  readonly response_format?: typeof ResponseFormat.Type | null | undefined
  readonly grammar?: Nullable<string>
  readonly json_schema?: unknown
}

export interface OpenAiSampling {
  readonly sampling: SamplingOptions
  /** Choices to generate (each its own request; seeds seed + i). */
  readonly n: number
}

const value = <A>(x: Nullable<A>): A | undefined => (x === null ? undefined : x)

/** The request's sampling settings, or the first problem with them in one line naming the field. */
export const openAiSampling = (
  body: OpenAiSamplingBody,
  route: { readonly chat: boolean; readonly parallel: number }
): Effect.Effect<OpenAiSampling, string> =>
  Effect.gen(function* () {
    // Every numeric field against its documented range (SamplingRanges.ts), first.
    const outside = rangeProblem(route.chat ? "chat" : "completions", body)
    if (outside !== undefined) return yield* Effect.fail(outside.message)
    const problems: Array<string> = []
    const temperature = value(body.temperature) ?? 1
    const topP = value(body.top_p)
    const topK = value(body.top_k)
    const minP = value(body.min_p)
    const typicalP = value(body.typical_p)
    const rawSeed = value(body.seed)
    const seed = rawSeed === -1 ? undefined : rawSeed
    const presencePenalty = value(body.presence_penalty)
    const frequencyPenalty = value(body.frequency_penalty)
    const repeatPenalty = value(body.repeat_penalty)
    const penaltyLastN = value(body.repeat_last_n)
    const dryMultiplier = value(body.dry_multiplier)
    const dryBase = value(body.dry_base)
    const dryAllowedLength = value(body.dry_allowed_length)
    const dryLastN = value(body.dry_penalty_last_n)
    const breakers = value(body.dry_sequence_breakers)
    if (breakers !== undefined) {
      if (breakers.length > 64) problems.push(`dry_sequence_breakers holds at most 64 strings, got ${breakers.length}`)
      breakers.forEach((b, i) => {
        if (b.length === 0 || b.length > 256 || b.includes("\u0000")) {
          problems.push(`dry_sequence_breakers[${i}] must be a non-empty string of at most 256 characters without NUL`)
        }
      })
    }
    const xtcProbability = value(body.xtc_probability)
    const xtcThreshold = value(body.xtc_threshold)
    const logitBias = biases(value(body.logit_bias), problems)
    const logprobs = logprobCount(body, route.chat, problems)
    const n = value(body.n) ?? 1
    if (n > route.parallel) {
      problems.push(`n must be at most ${route.parallel} (the server's parallel sequences), got ${n}`)
    }
    if (problems.length > 0) return yield* Effect.fail(problems[0]!)
    const grammar = yield* structuredOutputGrammar(body)
    const dry =
      dryMultiplier === undefined || dryMultiplier === 0
        ? undefined
        : {
            multiplier: dryMultiplier,
            ...(dryBase === undefined ? {} : { base: dryBase }),
            ...(dryAllowedLength === undefined ? {} : { allowedLength: dryAllowedLength }),
            ...(dryLastN === undefined ? {} : { penaltyLastN: dryLastN }),
            ...(breakers === undefined ? {} : { sequenceBreakers: breakers })
          }
    const sampling: SamplingOptions = {
      temperature,
      ...(topK === undefined ? {} : { topK }),
      ...(topP === undefined ? {} : { topP }),
      ...(minP === undefined ? {} : { minP }),
      ...(seed === undefined ? {} : { seed }),
      ...(typicalP === undefined ? {} : { typicalP }),
      ...(repeatPenalty === undefined ? {} : { repeatPenalty }),
      ...(presencePenalty === undefined ? {} : { presencePenalty }),
      ...(frequencyPenalty === undefined ? {} : { frequencyPenalty }),
      ...(penaltyLastN === undefined ? {} : { penaltyLastN }),
      ...(dry === undefined ? {} : { dry }),
      ...(xtcProbability === undefined || xtcProbability === 0
        ? {}
        : { xtc: { probability: xtcProbability, threshold: xtcThreshold ?? 0.1 } }),
      ...(logitBias.length === 0 ? {} : { logitBias }),
      ...(grammar === undefined ? {} : { grammar }),
      ...(logprobs === undefined ? {} : { logprobs })
    }
    return { sampling, n }
  })

/** OpenAI's logit_bias map (or llama-server's pair list): token ids as whole numbers, biases -100–100 (-100 and false ban). */
const biases = (
  raw: OpenAiSamplingBody["logit_bias"],
  problems: Array<string>
): ReadonlyArray<{ readonly tokenId: number; readonly bias: number }> => {
  if (raw === undefined || raw === null) return []
  const pairs: ReadonlyArray<readonly [number | string, number | boolean]> = Array.isArray(raw)
    ? (raw as ReadonlyArray<readonly [number | string, number | boolean]>)
    : Object.entries(raw)
  const out: Array<{ tokenId: number; bias: number }> = []
  for (const [key, bias] of pairs) {
    const id = typeof key === "number" ? key : /^(0|[1-9][0-9]{0,9})$/.test(key) ? Number(key) : NaN
    if (!Number.isSafeInteger(id) || id < 0) {
      problems.push(`logit_bias: ${JSON.stringify(key)} is not a token id (a whole number ≥ 0)`)
      continue
    }
    if (bias === false || bias === -100) {
      out.push({ tokenId: id, bias: -Infinity })
    } else if (typeof bias !== "number" || !Number.isFinite(bias) || bias < -100 || bias > 100) {
      problems.push(`logit_bias[${JSON.stringify(String(key))}] must be between -100 and 100 (or false), got ${bias}`)
    } else {
      out.push({ tokenId: id, bias })
    }
  }
  return out
}

/** Chat: `logprobs: true` with `top_logprobs` (its range: SamplingRanges.ts); completions: `logprobs`. Undefined: none asked for. */
const logprobCount = (body: OpenAiSamplingBody, chat: boolean, problems: Array<string>): number | undefined => {
  const logprobs = value(body.logprobs)
  const top = value(body.top_logprobs)
  if (chat) {
    if (typeof logprobs === "number") {
      problems.push("logprobs must be a boolean on /v1/chat/completions (top_logprobs gives the count)")
      return undefined
    }
    if (top !== undefined && logprobs !== true) {
      problems.push("top_logprobs needs logprobs: true")
      return undefined
    }
    return logprobs === true ? (top ?? 0) : undefined
  }
  if (top !== undefined) {
    problems.push("top_logprobs is a chat field: on /v1/completions logprobs gives the count")
    return undefined
  }
  if (typeof logprobs === "boolean") return logprobs ? 0 : undefined
  return logprobs
}
