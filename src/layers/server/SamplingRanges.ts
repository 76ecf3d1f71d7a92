/**
 * The documented range of every numeric sampling field of the HTTP APIs, in one table: OpenAI's /v1/completions and
 * /v1/chat/completions (with the llama-server fields they also take) and Anthropic's /v1/messages. The routes check a
 * body against it before anything else of its sampling (`rangeProblem`); test/server/samplingRanges.test.ts sends each
 * field just outside and just inside its range through a real server.
 *
 * | field | routes | range |
 * |---|---|---|
 * | max_tokens | all | whole ≥ 1 (the context checks the rest) |
 * | max_completion_tokens | chat | whole ≥ 1 |
 * | temperature | OpenAI / Anthropic | 0–2 / 0–1 |
 * | top_p | all | 0–1 |
 * | top_k | all | whole ≥ 0 (0 = off) |
 * | min_p, typical_p | OpenAI | 0–1 |
 * | seed | OpenAI | whole, ±(2^53 − 1) (-1: random) |
 * | n | OpenAI | whole ≥ 1 (at most the server's `parallel`: OpenAiSampling.ts) |
 * | presence_penalty, frequency_penalty | OpenAI | -2–2 |
 * | repeat_penalty | OpenAI | above 0, at most 100 (1 = off) |
 * | repeat_last_n, dry_penalty_last_n | OpenAI | whole ≥ -1 (-1: the whole context) |
 * | dry_multiplier, dry_base, dry_allowed_length | OpenAI | 0–100, 1–100, whole 1–1,000,000 |
 * | xtc_probability, xtc_threshold | OpenAI | 0–1 |
 * | logprobs | completions | whole 0–20 (a boolean too) |
 * | top_logprobs | chat | whole 0–20 |
 *
 * A field out of range is one line naming it (`temperature must be between 0 and 1, got 1.01`); the route answers it
 * as a 400 invalid_request_error in its API's error shape.
 */

/** The routes, by the API they speak. */
export type SamplingRoute = "completions" | "chat" | "messages"

export interface SamplingRange {
  readonly field: string
  readonly routes: ReadonlyArray<SamplingRoute>
  readonly min: number
  readonly max: number
  /** A whole number. */
  readonly integer: boolean
  /** `min` itself is out of range (repeat_penalty: above 0). */
  readonly aboveMin?: boolean
}

const openAi: ReadonlyArray<SamplingRoute> = ["completions", "chat"]
const all: ReadonlyArray<SamplingRoute> = ["completions", "chat", "messages"]
const unit = { min: 0, max: 1, integer: false }

/** The most log-probability alternatives a token may report. */
export const maxTopLogprobs = 20

export const samplingRanges: ReadonlyArray<SamplingRange> = [
  { field: "max_tokens", routes: all, min: 1, max: Infinity, integer: true },
  { field: "max_completion_tokens", routes: ["chat"], min: 1, max: Infinity, integer: true },
  { field: "temperature", routes: openAi, min: 0, max: 2, integer: false },
  { field: "temperature", routes: ["messages"], ...unit },
  { field: "top_p", routes: all, ...unit },
  { field: "top_k", routes: all, min: 0, max: Infinity, integer: true },
  { field: "min_p", routes: openAi, ...unit },
  { field: "typical_p", routes: openAi, ...unit },
  {
    field: "seed",
    routes: openAi,
    min: -Number.MAX_SAFE_INTEGER,
    max: Number.MAX_SAFE_INTEGER,
    integer: true
  },
  { field: "n", routes: openAi, min: 1, max: Infinity, integer: true },
  { field: "presence_penalty", routes: openAi, min: -2, max: 2, integer: false },
  { field: "frequency_penalty", routes: openAi, min: -2, max: 2, integer: false },
  { field: "repeat_penalty", routes: openAi, min: 0, max: 100, integer: false, aboveMin: true },
  { field: "repeat_last_n", routes: openAi, min: -1, max: Infinity, integer: true },
  { field: "dry_multiplier", routes: openAi, min: 0, max: 100, integer: false },
  { field: "dry_base", routes: openAi, min: 1, max: 100, integer: false },
  { field: "dry_allowed_length", routes: openAi, min: 1, max: 1_000_000, integer: true },
  { field: "dry_penalty_last_n", routes: openAi, min: -1, max: Infinity, integer: true },
  { field: "xtc_probability", routes: openAi, ...unit },
  { field: "xtc_threshold", routes: openAi, ...unit },
  { field: "logprobs", routes: ["completions"], min: 0, max: maxTopLogprobs, integer: true },
  { field: "top_logprobs", routes: ["chat"], min: 0, max: maxTopLogprobs, integer: true }
]

const describe = (range: SamplingRange): string => {
  const whole = range.integer ? "a whole number " : ""
  if (range.aboveMin === true) return `${whole}above ${range.min} and at most ${range.max}`
  if (range.max === Infinity) return `${whole}≥ ${range.min}`
  return `${whole}between ${range.min} and ${range.max}`
}

/** The problem with one value against its range, in one line naming the field; undefined when it is in range. */
const outOfRange = (range: SamplingRange, value: number): string | undefined =>
  Number.isFinite(value) &&
  (range.aboveMin === true ? value > range.min : value >= range.min) &&
  value <= range.max &&
  (!range.integer || Number.isInteger(value))
    ? undefined
    : `${range.field} must be ${describe(range)}, got ${value}`

/**
 * The first numeric sampling field of `body` outside its range on `route`, as `{ field, message }`; undefined when all
 * are in range. Fields absent, null or not numbers are left to the body's schema and the route's own checks.
 */
export const rangeProblem = (
  route: SamplingRoute,
  body: object
): { readonly field: string; readonly message: string } | undefined => {
  const values = body as Readonly<Record<string, unknown>>
  for (const range of samplingRanges) {
    const value = values[range.field]
    if (!range.routes.includes(route) || typeof value !== "number") continue
    const message = outOfRange(range, value)
    if (message !== undefined) return { field: range.field, message }
  }
  return undefined
}
