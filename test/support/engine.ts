/** Shared fixtures of the engine tests: splits, a pipelined greedy run of our engine, node-llama-cpp's reference. */
import { assert } from "@effect/vitest"
import { Effect, Layer } from "effect"
import { getLlama, type Llama, type LlamaModel, LlamaLogLevel, type Token } from "node-llama-cpp"
import * as StageExecutorLive from "../../src/layers/engine/StageExecutorLive.js"
import { openInProcessPipeline } from "../../src/services/InProcessPipeline.js"
import type { StageInput } from "../../src/domain/engine.js"
import { greedy, logSoftmax, makeRng } from "../../src/services/Sampler.js"
import { type LoadedStage, StageExecutor } from "../../src/services/StageExecutor.js"
import { sameBits } from "./batch.js"

/** Every split of `layers` blocks into 1..min(layers, maxStages) contiguous non-empty stages, as boundaries. */
export const allSplits = (layers: number, maxStages = 4): ReadonlyArray<ReadonlyArray<number>> => {
  const out: Array<Array<number>> = []
  const rec = (start: number, acc: Array<number>) => {
    if (start === layers) {
      if (acc.length - 1 <= maxStages) out.push([...acc])
      return
    }
    if (acc.length - 1 >= maxStages) return
    for (let end = start + 1; end <= layers; end++) rec(end, [...acc, end])
  }
  rec(0, [0])
  return out.sort((a, b) => a.length - b.length)
}

export interface EngineRun {
  readonly tokens: ReadonlyArray<number>
  /** Logits after the prompt, then after each generated token (all but the last). */
  readonly logits: ReadonlyArray<Float32Array>
}

export interface RunOptions {
  readonly threads: number
  readonly contextLength: number
}

/** Loads the split's stages and sessions (scoped): the in-process pipeline of src/services/InProcessPipeline.ts. */
export const openPipeline = (path: string, boundaries: ReadonlyArray<number>, options: RunOptions) =>
  openInProcessPipeline(path, boundaries, { threads: options.threads, contextLength: options.contextLength })

/** Greedy generation through a split: prefill the prompt in one batch, then decode token by token. */
export const greedyRun = (
  path: string,
  boundaries: ReadonlyArray<number>,
  prompt: ReadonlyArray<number>,
  nTokens: number,
  options: RunOptions
): Effect.Effect<EngineRun, unknown> =>
  Effect.scoped(
    Effect.gen(function* () {
      const { run } = yield* openPipeline(path, boundaries, options)
      const tokens: Array<number> = []
      const logits: Array<Float32Array> = []
      let last = yield* run(0, Int32Array.from(prompt))
      let pos = prompt.length
      for (let i = 0; i < nTokens; i++) {
        logits.push(last)
        const t = greedy(last)
        tokens.push(t)
        if (i + 1 < nTokens) last = yield* run(pos++, Int32Array.of(t))
      }
      return { tokens, logits }
    })
  ).pipe(Effect.provide(StageExecutorLive.layer))

let llamaPromise: Promise<Llama> | undefined
export const referenceLlama = (): Promise<Llama> =>
  (llamaPromise ??= getLlama({ gpu: false, build: "never", logLevel: LlamaLogLevel.error }))

export interface ReferenceRun {
  readonly prompt: ReadonlyArray<number>
  readonly tokens: ReadonlyArray<number>
  /** Probabilities of the first generated position, by token id (only those node-llama-cpp reports). */
  readonly firstProbabilities: ReadonlyMap<number, number>
}

export interface ReferenceOptions extends RunOptions {
  /**
   * Full-size caches for the sliding-window blocks too (node-llama-cpp's `swaFullCache`; swactor's window is a mask
   * over its caches). Default: node-llama-cpp's own, llama.cpp's capped iSWA cache.
   */
  readonly swaFullCache?: boolean
}

/**
 * node-llama-cpp's single-process reference: the prompt (text: BOS + tokenize(text); token ids: those, as they are),
 * greedy `nTokens`, and the probabilities after the prompt. Flash attention on, F16 KV cache (its defaults), explicit
 * thread count.
 */
export const referenceRun = async (
  path: string,
  text: string | ReadonlyArray<number>,
  nTokens: number,
  options: ReferenceOptions
): Promise<ReferenceRun> => {
  const llama = await referenceLlama()
  const model: LlamaModel = await llama.loadModel({ modelPath: path, gpuLayers: 0 })
  try {
    const ctx = await model.createContext({
      contextSize: options.contextLength,
      threads: options.threads,
      flashAttention: true,
      sequences: 1,
      ...(options.swaFullCache === undefined ? {} : { swaFullCache: options.swaFullCache })
    })
    try {
      const seq = ctx.getSequence()
      const bos = model.tokens.bos
      const prompt: Array<Token> =
        typeof text === "string"
          ? [...(bos !== null ? [bos] : []), ...model.tokenize(text)]
          : text.map((t) => t as Token)
      const tokens: Array<number> = []
      for await (const t of seq.evaluate(prompt, { temperature: 0 })) {
        tokens.push(t)
        if (tokens.length >= nTokens) break
      }
      await seq.clearHistory()
      const last = prompt[prompt.length - 1]!
      const res = await seq.controlledEvaluate([
        ...prompt.slice(0, -1),
        [last, { generateNext: { probabilities: true } }]
      ])
      const probs = res[res.length - 1]?.next?.probabilities
      if (probs === undefined) throw new Error("node-llama-cpp returned no probabilities")
      return { prompt, tokens, firstProbabilities: new Map(probs) }
    } finally {
      await ctx.dispose()
    }
  } finally {
    await model.dispose()
  }
}

/** `referenceRun` as an Effect. */
export const nodeLlamaReference = (
  path: string,
  text: string | ReadonlyArray<number>,
  nTokens: number,
  options: ReferenceOptions
) => Effect.promise(() => referenceRun(path, text, nTokens, options))

/**
 * Each split of `splits`: our greedy run of `ref.prompt` gives node-llama-cpp's `ref.tokens`; with `bitIdentical`
 * (the default) every split's logits are also bit-identical to the first split's. Returns the largest first-position
 * log-prob difference from node-llama-cpp's probabilities.
 */
export const splitsMatchReference = (
  path: string,
  ref: ReferenceRun,
  splits: ReadonlyArray<ReadonlyArray<number>>,
  options: RunOptions,
  { bitIdentical = true }: { readonly bitIdentical?: boolean } = {}
) =>
  Effect.gen(function* () {
    let first: EngineRun | undefined
    let maxDiff = 0
    for (const split of splits) {
      const run = yield* greedyRun(path, split, ref.prompt, ref.tokens.length, options)
      assert.deepStrictEqual(run.tokens, ref.tokens, `split ${JSON.stringify(split)}`)
      maxDiff = Math.max(maxDiff, maxLogProbDiff(logSoftmax(run.logits[0]!), ref.firstProbabilities))
      if (first === undefined) first = run
      else if (bitIdentical) {
        run.logits.forEach((l, i) => assert.isTrue(sameBits(l, first!.logits[i]!), `split ${split} position ${i}`))
      }
    }
    return maxDiff
  })

/** Largest |log p_ours - log p_ref| over the tokens node-llama-cpp gives a non-zero probability. */
export const maxLogProbDiff = (ours: Float64Array, ref: ReadonlyMap<number, number>): number => {
  let max = 0
  for (const [token, p] of ref) {
    if (!(p > 0)) continue
    const d = Math.abs(ours[token]! - Math.log(p))
    if (d > max) max = d
  }
  return max
}

/** A layer-less helper for tests that want the executor directly. */
export const liveExecutor = StageExecutorLive.layer satisfies Layer.Layer<StageExecutor>

/**
 * For each n of `counts`: n sessions of a whole-model stage prefill prompts of 2..n+1 random tokens (ids 3 ..
 * 3 + vocab), then take one decode step together in one forwardBatch; each output must be deepStrictEqual (the same
 * bits) to the same step of a lone twin session.
 */
export const decodeBatchGetsLoneBits = (
  whole: LoadedStage,
  counts: ReadonlyArray<number>,
  vocab: number,
  seed: number
) =>
  Effect.gen(function* () {
    const executor = yield* StageExecutor
    const open = () => executor.session(whole, { threads: 1, contextLength: 64 })
    const r = makeRng(seed)
    for (const n of counts) {
      const batched = yield* Effect.forEach(Array.from({ length: n }), open)
      const lone = yield* Effect.forEach(Array.from({ length: n }), open)
      const prompts = Array.from({ length: n }, (_, i) =>
        Int32Array.from({ length: 2 + i }, () => 3 + Math.floor(r() * vocab))
      )
      for (let i = 0; i < n; i++) {
        yield* batched[i]!.forward(0, { _tag: "Tokens", tokens: prompts[i]! })
        yield* lone[i]!.forward(0, { _tag: "Tokens", tokens: prompts[i]! })
      }
      const step = (i: number): StageInput => ({ _tag: "Tokens", tokens: Int32Array.of(10 + i) })
      const outs = yield* executor.forwardBatch(
        batched.map((session, i) => ({ session, startPos: 2 + i, input: step(i) }))
      )
      for (let i = 0; i < n; i++)
        assert.deepStrictEqual(outs[i], yield* lone[i]!.forward(2 + i, step(i)), `${n} sequences, #${i}`)
    }
  })
