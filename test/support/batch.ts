/**
 * Shared fixtures of the batched-forward tests (engine.batch, engine.paths): the stages of a split, one sequence run
 * alone with `forward`, and a schedule of sequences run together with one `forwardBatch` per stage per step.
 */
import { assert } from "@effect/vitest"
import { Effect, type Scope } from "effect"
import type { StageInput, StageOutput } from "../../src/domain/engine.js"
import type { SyntheticModelOptions } from "../../src/layers/gguf/Synthetic.js"
import { greedy } from "../../src/services/Sampler.js"
import { type LoadedStage, StageExecutor } from "../../src/services/StageExecutor.js"

/** One sequence of a schedule: its prompt, the batch step it joins at, how many tokens it generates. */
export interface SeqPlan {
  readonly prompt: ReadonlyArray<number>
  readonly start: number
  readonly steps: number
  /** Prefill the prompt in chunks of this many tokens, one chunk per batch step (default: the whole prompt). */
  readonly chunk?: number
  /**
   * Prefill the prompt in a batch of its own (one item, as alone) at its start step, before the step's shared batch;
   * the sequence then joins the shared batches with its first decode step. Default false: the prompt (or its first
   * chunk) is an item of the step's shared batch.
   */
  readonly prefillAlone?: boolean
}

export interface SeqResult {
  readonly tokens: ReadonlyArray<number>
  /** Logits each token was picked from. */
  readonly logits: ReadonlyArray<Float32Array>
}

/** One forwardBatch (the same items on every stage) a sequence took part in. */
export interface BatchCall {
  /** Sequences in the batch. */
  readonly items: number
  /** Rows of the batch: the tokens of all its items. */
  readonly rows: number
  /** Every item fed one token (a decode step of each). */
  readonly decodeOnly: boolean
}

export interface BatchedSeqResult extends SeqResult {
  /** Every batch the sequence took part in, in order. */
  readonly calls: ReadonlyArray<BatchCall>
  /** For each of `logits`: the index in `calls` of the batch that produced it. */
  readonly logitsCall: ReadonlyArray<number>
}

/** Loads the stages of a split (boundaries [0, b1, ..., nLayers]) once, for every sequence. */
export const loadSplit = (path: string, boundaries: ReadonlyArray<number>) =>
  Effect.gen(function* () {
    const executor = yield* StageExecutor
    const stages: Array<LoadedStage> = []
    for (let i = 0; i + 1 < boundaries.length; i++) {
      stages.push(
        yield* executor.load({
          path,
          layerStart: boundaries[i]!,
          layerEndExclusive: boundaries[i + 1]!,
          isFirst: i === 0,
          isLast: i + 2 === boundaries.length
        })
      )
    }
    return stages
  })

/** One session per stage (scoped), 1 thread. */
export const openSessions = (stages: ReadonlyArray<LoadedStage>, contextLength: number) =>
  Effect.gen(function* () {
    const executor = yield* StageExecutor
    return yield* Effect.forEach(stages, (s) => executor.session(s, { threads: 1, contextLength }))
  })

/**
 * One sequence alone: the prompt in one `forward` (or in the plan's chunks: chunking alone changes the numerics of
 * attention and matrix products), then one `forward` per generated token, stage after stage.
 */
export const runAlone = (
  stages: ReadonlyArray<LoadedStage>,
  plan: SeqPlan,
  contextLength: number
): Effect.Effect<SeqResult, unknown, StageExecutor | Scope.Scope> =>
  Effect.gen(function* () {
    const sessions = yield* openSessions(stages, contextLength)
    const through = (pos: number, tokens: ReadonlyArray<number>) =>
      Effect.gen(function* () {
        let input: StageInput = { _tag: "Tokens", tokens: Int32Array.from(tokens) }
        for (const s of sessions) {
          const out: StageOutput = yield* s.forward(pos, input)
          if (out._tag === "Logits") return out.logits
          input = out
        }
        return yield* Effect.dieMessage("no logits")
      })
    const tokens: Array<number> = []
    const logits: Array<Float32Array> = []
    const chunk = plan.chunk ?? plan.prompt.length
    let last: Float32Array = new Float32Array(0)
    for (let p = 0; p < plan.prompt.length; p += chunk) last = yield* through(p, plan.prompt.slice(p, p + chunk))
    let pos = plan.prompt.length
    while (tokens.length < plan.steps) {
      logits.push(last)
      tokens.push(greedy(last))
      if (tokens.length < plan.steps) last = yield* through(pos++, [tokens[tokens.length - 1]!])
    }
    return { tokens, logits }
  })

/**
 * All sequences together: at every step ONE forwardBatch per stage over every live sequence (a prompt or a prompt
 * chunk for those prefilling, one token for those decoding; a `prefillAlone` prompt first in a batch of its own).
 * Returns each sequence's tokens and batches, the largest number of sequences one batch carried, the row counts of
 * the decode-only batches of several sequences, and whether some batch mixed prefill and decode.
 */
export const runBatched = (stages: ReadonlyArray<LoadedStage>, plans: ReadonlyArray<SeqPlan>, contextLength: number) =>
  Effect.gen(function* () {
    const executor = yield* StageExecutor
    const seqs = yield* Effect.forEach(plans, (plan) =>
      Effect.map(openSessions(stages, contextLength), (sessions) => ({
        plan,
        sessions,
        pos: 0,
        tokens: [] as Array<number>,
        logits: [] as Array<Float32Array>,
        calls: [] as Array<BatchCall>,
        logitsCall: [] as Array<number>
      }))
    )
    type Seq = (typeof seqs)[number]
    let maxLive = 0
    let mixed = false
    const decodeRows = new Set<number>()
    const feedOf = (s: Seq) => {
      if (s.pos < s.plan.prompt.length) {
        const n = Math.min(s.plan.chunk ?? s.plan.prompt.length, s.plan.prompt.length - s.pos)
        return s.plan.prompt.slice(s.pos, s.pos + n)
      }
      return [s.tokens[s.tokens.length - 1]!]
    }
    /** One forwardBatch per stage over `live`, fed `feeds`. */
    const batch = (live: ReadonlyArray<Seq>, feeds: ReadonlyArray<ReadonlyArray<number>>) =>
      Effect.gen(function* () {
        const call: BatchCall = {
          items: live.length,
          rows: feeds.reduce((n, f) => n + f.length, 0),
          decodeOnly: feeds.every((f) => f.length === 1)
        }
        if (feeds.some((f) => f.length > 1) && feeds.some((f) => f.length === 1)) mixed = true
        if (call.decodeOnly && call.items > 1) decodeRows.add(call.rows)
        let inputs: Array<StageInput> = feeds.map((f) => ({ _tag: "Tokens", tokens: Int32Array.from(f) }))
        for (let si = 0; si < stages.length; si++) {
          const outs = yield* executor.forwardBatch(
            live.map((s, i) => ({ session: s.sessions[si]!, startPos: s.pos, input: inputs[i]! }))
          )
          assert.strictEqual(outs.length, live.length)
          inputs = outs.map((o) => {
            if (o._tag === "Hidden") return o
            return { _tag: "Tokens", tokens: new Int32Array(0) }
          })
          if (si === stages.length - 1) {
            live.forEach((s, i) => {
              const out = outs[i]!
              assert.strictEqual(out._tag, "Logits")
              s.calls.push(call)
              s.pos += feeds[i]!.length
              if (out._tag === "Logits" && s.pos >= s.plan.prompt.length) {
                s.logits.push(out.logits)
                s.logitsCall.push(s.calls.length - 1)
                s.tokens.push(greedy(out.logits))
              }
            })
          }
        }
      })
    for (let step = 0; seqs.some((s) => s.tokens.length < s.plan.steps); step++) {
      for (const s of seqs) {
        if (s.plan.prefillAlone === true && s.plan.start === step && s.pos < s.plan.prompt.length) {
          yield* batch([s], [feedOf(s)])
        }
      }
      const live = seqs.filter(
        (s) =>
          s.plan.start <= step &&
          s.tokens.length < s.plan.steps &&
          !(s.plan.prefillAlone === true && s.plan.start === step)
      )
      if (live.length === 0) continue
      maxLive = Math.max(maxLive, live.length)
      yield* batch(live, live.map(feedOf))
    }
    return {
      results: seqs.map((s): BatchedSeqResult => ({
        tokens: s.tokens,
        logits: s.logits,
        calls: s.calls,
        logitsCall: s.logitsCall
      })),
      maxLive,
      mixed,
      decodeRows
    }
  })

/**
 * For each split of `splits` (its stages loaded once): every plan run alone (`runAlone`) and all together
 * (`runBatched`); all sequences share one batch at some step, some batch mixes prefill and decode, the streams hold at
 * least 8 distinct tokens, and each sequence's batched tokens equal its lone ones (with `bitIdentical`, its logits
 * too, bit for bit). Returns the largest logit difference between the batched and the lone runs.
 */
export const batchedEqualsAlone = (
  path: string,
  splits: ReadonlyArray<ReadonlyArray<number>>,
  plans: ReadonlyArray<SeqPlan>,
  contextLength: number,
  {
    bitIdentical = false,
    roundingFlips = false
  }: {
    readonly bitIdentical?: boolean
    /**
     * Where batched logits are not bit-identical to the lone ones (a route other than the exact one-row kernel), a
     * greedy token may differ where the lone top-2 gap is within what the logits differ by there (gap <= 2 x their
     * largest difference): such a stream is compared up to that flip, and flips may cut at most half the tokens.
     */
    readonly roundingFlips?: boolean
  } = {}
) =>
  Effect.gen(function* () {
    let maxDiff = 0
    let compared = 0
    let total = 0
    for (const split of splits) {
      yield* Effect.scoped(
        Effect.gen(function* () {
          const stages = yield* loadSplit(path, split)
          const alone = yield* Effect.forEach(plans, (p) => Effect.scoped(runAlone(stages, p, contextLength)))
          const batched = yield* runBatched(stages, plans, contextLength)
          assert.strictEqual(
            batched.maxLive,
            plans.length,
            `all ${plans.length} sequences were in one batch at some step`
          )
          assert.isTrue(batched.mixed, "some batch mixed prefill and decode")
          assert.isAtLeast(new Set(alone.flatMap((a) => a.tokens)).size, 8, "the streams are not trivial")
          plans.forEach((_, i) => {
            const lone = alone[i]!
            const both = batched.results[i]!
            total += lone.tokens.length
            for (let j = 0; j < lone.tokens.length; j++) {
              const diff = maxAbsDiff(lone.logits[j]!, both.logits[j]!)
              maxDiff = Math.max(maxDiff, diff)
              if (bitIdentical)
                assert.isTrue(sameBits(lone.logits[j]!, both.logits[j]!), `split ${split} seq ${i} pos ${j}`)
              if (both.tokens[j] !== lone.tokens[j] && roundingFlips) {
                assert.isAtMost(topTwoGap(lone.logits[j]!), 2 * diff, `split ${split} sequence ${i}: a flip at ${j}`)
                break
              }
              assert.strictEqual(both.tokens[j], lone.tokens[j], `split ${split} sequence ${i} position ${j}`)
              compared++
            }
          })
        })
      )
    }
    if (roundingFlips) {
      console.log(`batched vs alone: ${compared} of ${total} tokens compared (the rest after a rounding flip)`)
      assert.isAtLeast(compared, 0.5 * total, "rounding flips cut more than half the streams")
    }
    return maxDiff
  })

/** The first position whose logits' two largest are within `margin` (the stream's length when none is). */
export const firstNearTie = (logits: ReadonlyArray<Float32Array>, margin: number): number => {
  const at = logits.findIndex((l) => topTwoGap(l) < margin)
  return at < 0 ? logits.length : at
}

/** The gap between the largest and second-largest logit. */
const topTwoGap = (l: Float32Array): number => {
  let first = -Infinity
  let second = -Infinity
  for (const v of l) {
    if (v > first) {
      second = first
      first = v
    } else if (v > second) second = v
  }
  return first - second
}

export const maxAbsDiff = (a: Float32Array, b: Float32Array) => {
  let m = 0
  for (let i = 0; i < a.length; i++) m = Math.max(m, Math.abs(a[i]! - b[i]!))
  return m
}

/** The same float bits (NaN payloads included). */
export const sameBits = (a: Float32Array, b: Float32Array) => {
  if (a.length !== b.length) return false
  const x = new Uint32Array(a.buffer, a.byteOffset, a.length)
  const y = new Uint32Array(b.buffer, b.byteOffset, b.length)
  return x.every((v, i) => v === y[i])
}

/** The small synthetic model the batched-execution tests share: 4 blocks of 256, 4 heads (2 KV), vocabulary 400. */
export const smallSynthetic = (
  path: string,
  arch: SyntheticModelOptions["arch"],
  type: SyntheticModelOptions["type"],
  contextLength: number
): SyntheticModelOptions => ({
  path,
  arch,
  layers: 4,
  hidden: 256,
  ffn: 512,
  heads: 4,
  kvHeads: 2,
  vocab: 400,
  contextLength,
  type,
  seed: 5
})
