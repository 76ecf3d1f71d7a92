/**
 * The timing loop bench:engine and bench:moe share: one file through node-llama-cpp (one context, one sequence) and
 * through swactor's stage engine (every stage of a split in this process, InProcessPipeline), same threads, flash
 * attention and F16 KV on both sides. Each measurement: a 32-token warm-up, the prompt prefilled in one call
 * (tok/s), the cache cleared, then `decode` greedy tokens after a 16-token prompt (tok/s, from the first token on).
 */
import { Effect } from "effect"
import { getLlama, LlamaLogLevel, type Token } from "node-llama-cpp"
import * as StageExecutorLive from "../src/layers/engine/StageExecutorLive.js"
import { openInProcessPipeline } from "../src/services/InProcessPipeline.js"
import { greedy, makeRng } from "../src/services/Sampler.js"

export interface TimingSettings {
  readonly threads: number
  readonly contextLength: number
  /** The prefill prompt (its first 32 tokens warm up, its first 16 start the decode). */
  readonly prompt: ReadonlyArray<number>
  readonly decode: number
}

export interface Figures {
  readonly decode: number
  readonly prefill: number
  /** tokens per CPU-second of this process (all threads): steadier than wall time on a shared machine */
  readonly decodeCpu: number
  readonly prefillCpu: number
}

/** `n` token ids drawn from [3, vocab) with a fixed seed (the same prompt on both sides). */
export const benchPrompt = (n: number, vocab: number): Array<number> => {
  const r = makeRng(2024)
  return Array.from({ length: n }, () => 3 + Math.floor(r() * (vocab - 3)))
}

/** [0, b1, ..., layers]: `stages` near-equal ranges of blocks. */
export const evenSplit = (layers: number, stages: number): Array<number> =>
  Array.from({ length: stages + 1 }, (_, i) => Math.round((i * layers) / stages))

/** The contexts' size: prompt + decode + a margin, rounded up to 256. */
export const benchContextLength = (prompt: number, decode: number): number =>
  Math.ceil((prompt + decode + 64) / 256) * 256

/** Wall and CPU (user + system, all threads of this process) seconds since it was made. */
const stopwatch = () => {
  const w = performance.now()
  const c = process.cpuUsage()
  return () => {
    const d = process.cpuUsage(c)
    return { wall: (performance.now() - w) / 1000, cpu: (d.user + d.system) / 1e6 }
  }
}

type Lap = ReturnType<ReturnType<typeof stopwatch>>

const figuresOf = (s: TimingSettings, p: Lap, d: Lap): Figures => ({
  decode: s.decode / d.wall,
  prefill: s.prompt.length / p.wall,
  decodeCpu: s.decode / d.cpu,
  prefillCpu: s.prompt.length / p.cpu
})

/** Each figure the better of the two (rounds interleaved, the best counts: damps other load on the machine). */
export const bestFigures = (a: Figures | undefined, b: Figures): Figures =>
  a === undefined
    ? b
    : {
        decode: Math.max(a.decode, b.decode),
        prefill: Math.max(a.prefill, b.prefill),
        decodeCpu: Math.max(a.decodeCpu, b.decodeCpu),
        prefillCpu: Math.max(a.prefillCpu, b.prefillCpu)
      }

export const timeNodeLlamaCpp = async (path: string, s: TimingSettings): Promise<Figures> => {
  const llama = await getLlama({ gpu: false, build: "never", logLevel: LlamaLogLevel.error })
  const model = await llama.loadModel({ modelPath: path, gpuLayers: 0 })
  const ctx = await model.createContext({
    contextSize: s.contextLength,
    threads: s.threads,
    flashAttention: true,
    batchSize: s.prompt.length,
    sequences: 1
  })
  try {
    const seq = ctx.getSequence()
    const prompt = s.prompt as Array<Token>
    await seq.evaluateWithoutGeneratingNewTokens(prompt.slice(0, 32))
    await seq.clearHistory()
    const pw = stopwatch()
    await seq.evaluateWithoutGeneratingNewTokens(prompt)
    const p = pw()
    await seq.clearHistory()
    let n = 0
    let dw = stopwatch()
    for await (const _ of seq.evaluate(prompt.slice(0, 16), { temperature: 0 })) {
      if (n === 0) dw = stopwatch()
      if (++n > s.decode) break
    }
    return figuresOf(s, p, dw())
  } finally {
    await ctx.dispose()
    await model.dispose()
  }
}

/** `split` = [0, b1, ..., layers]: one stage per range, all in this process. */
export const timeOurs = (path: string, split: ReadonlyArray<number>, s: TimingSettings): Promise<Figures> =>
  Effect.runPromise(
    Effect.scoped(
      Effect.gen(function* () {
        const { reset, run } = yield* openInProcessPipeline(path, split, {
          threads: s.threads,
          contextLength: s.contextLength
        })
        yield* run(0, s.prompt.slice(0, 32))
        yield* reset
        const pw = stopwatch()
        yield* run(0, s.prompt)
        const p = pw()
        yield* reset
        let logits = yield* run(0, s.prompt.slice(0, 16))
        let pos = 16
        const dw = stopwatch()
        for (let i = 0; i < s.decode; i++) logits = yield* run(pos++, [greedy(logits)])
        return figuresOf(s, p, dw())
      })
    ).pipe(Effect.provide(StageExecutorLive.layer))
  )
