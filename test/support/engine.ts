/** Shared fixtures of the engine tests: splits, a pipelined greedy run of our engine, node-llama-cpp's reference. */
import { Effect, Layer } from "effect"
import { getLlama, type Llama, type LlamaModel, LlamaLogLevel, type Token } from "node-llama-cpp"
import { StageExecutorLive } from "../../src/layers/engine/StageExecutorLive.js"
import { greedy } from "../../src/services/Sampler.js"
import { openInProcessPipeline } from "../../src/services/InProcessPipeline.js"
import type { StageExecutor } from "../../src/services/StageExecutor.js"

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
    Effect.gen(function*() {
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
  ).pipe(Effect.provide(StageExecutorLive))

let llamaPromise: Promise<Llama> | undefined
export const referenceLlama = (): Promise<Llama> =>
  llamaPromise ??= getLlama({ gpu: false, build: "never", logLevel: LlamaLogLevel.error })

export interface ReferenceRun {
  readonly prompt: ReadonlyArray<number>
  readonly tokens: ReadonlyArray<number>
  /** Probabilities of the first generated position, by token id (only those node-llama-cpp reports). */
  readonly firstProbabilities: ReadonlyMap<number, number>
}

/**
 * node-llama-cpp's single-process reference: BOS + tokenize(text), greedy `nTokens`, and the probabilities
 * after the prompt. Flash attention on, F16 KV cache (its defaults), explicit thread count.
 */
export const referenceRun = async (
  path: string,
  text: string,
  nTokens: number,
  options: RunOptions
): Promise<ReferenceRun> => {
  const llama = await referenceLlama()
  const model: LlamaModel = await llama.loadModel({ modelPath: path, gpuLayers: 0 })
  try {
    const ctx = await model.createContext({
      contextSize: options.contextLength,
      threads: options.threads,
      flashAttention: true,
      sequences: 1
    })
    try {
      const seq = ctx.getSequence()
      const bos = model.tokens.bos
      const prompt: Array<Token> = [...(bos !== null ? [bos] : []), ...model.tokenize(text)]
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
export const liveExecutor = StageExecutorLive satisfies Layer.Layer<StageExecutor>
