/**
 * DSA long-context decode benchmark (not a test), issue 40: how decode time per token grows with the context for
 * DeepSeek sparse attention, where each block's lightning indexer scores every cached position and attention reads
 * only the top-k of them. Two deepseek32 files written by llama.cpp's gguf-py (bench/dsaModel.py: DeepSeek-V3.2's
 * proportions at hidden 1024, 2 blocks plus the MTP block, F16), identical but for `deepseek32.attention.indexer.top_k`:
 * "sparse" (BENCH_TOP_K, 512) and "dense" (65536: past any context, every cached position read). Both run through
 * swactor's stage engine, one stage, in this process. For each context the cache of each file is filled to that
 * length (prompt prefilled in chunks, the fill continuing from the previous context), then `decode` greedy tokens are
 * timed per round, rounds alternating between the files; the best round counts. Prints ms/token at each context, the
 * growth from the first to the last context, and growth_sparse / growth_dense (issue 40's target: at most 0.5).
 *
 *   npm run bench:dsa
 *
 * Settings (environment): BENCH_THREADS (1), BENCH_PREFILL_THREADS (the fill's threads; BENCH_THREADS),
 * BENCH_CONTEXTS (1024,4096,16384), BENCH_TOP_K (512), BENCH_DECODE (8 tokens a round), BENCH_ROUNDS (3),
 * BENCH_CHUNK (512: tokens per prefill call), BENCH_DIR (.cache/bench: the files are kept), BENCH_NLC (0; 1: also
 * node-llama-cpp on the same files, same threads, as the anchor: columns "sparse nlc" and "dense nlc").
 */
import { Effect } from "effect"
import { dirname, resolve } from "node:path"
import { fileURLToPath } from "node:url"
import * as StageExecutorLive from "../src/layers/engine/StageExecutorLive.js"
import { type InProcessPipeline, openInProcessPipeline } from "../src/services/InProcessPipeline.js"
import { greedy } from "../src/services/Sampler.js"
import { getLlama, LlamaLogLevel, type Token } from "node-llama-cpp"
import { convertedBenchBlocks, ensureConvertedBenchModel } from "./convertedBenchModels.js"
import { benchPrompt } from "./engineTiming.js"

const env = (k: string, d: string) => process.env[k] ?? d
const num = (k: string, d: number) => Number(env(k, String(d)))
const root = resolve(dirname(fileURLToPath(import.meta.url)), "..")

const cfg = {
  threads: num("BENCH_THREADS", 1),
  prefillThreads: num("BENCH_PREFILL_THREADS", num("BENCH_THREADS", 1)),
  contexts: env("BENCH_CONTEXTS", "1024,4096,16384").split(",").map(Number),
  topK: num("BENCH_TOP_K", 512),
  decode: num("BENCH_DECODE", 8),
  rounds: num("BENCH_ROUNDS", 3),
  chunk: num("BENCH_CHUNK", 512),
  dir: resolve(root, env("BENCH_DIR", ".cache/bench")),
  nlc: env("BENCH_NLC", "0") === "1"
}
const denseTopK = 65536
const VOCAB = 512

/** One side of the table: fills its cache to a length, times a round of decode (ms per token). */
interface Side {
  readonly name: string
  readonly fillTo: (length: number) => Effect.Effect<void, unknown>
  readonly round: Effect.Effect<number, unknown>
  fillSeconds: number
}

const secondsSince = (t: number) => (performance.now() - t) / 1000

/** swactor's engine, one stage: the prompt prefilled `chunk` tokens a call, then greedy tokens. */
const oursSide = (name: string, pipe: InProcessPipeline, prompt: ReadonlyArray<number>): Side => {
  let filled = 0
  let logits: Float32Array = new Float32Array(0)
  const side: Side = {
    name,
    fillSeconds: 0,
    fillTo: (length) =>
      Effect.gen(function* () {
        const t = performance.now()
        while (filled < length) {
          const n = Math.min(cfg.chunk, length - filled)
          logits = yield* pipe.run(filled, prompt.slice(filled, filled + n))
          filled += n
        }
        side.fillSeconds += secondsSince(t)
      }),
    round: Effect.gen(function* () {
      const t = performance.now()
      for (let i = 0; i < cfg.decode; i++) logits = yield* pipe.run(filled++, [greedy(logits)])
      return (secondsSince(t) * 1000) / cfg.decode
    })
  }
  return side
}

/** node-llama-cpp on the same file (one context, one sequence, same threads, flash attention): the anchor. */
const nlcSide = (name: string, path: string, contextLength: number, prompt: ReadonlyArray<number>) =>
  Effect.gen(function* () {
    const llama = yield* Effect.promise(() => getLlama({ gpu: false, build: "never", logLevel: LlamaLogLevel.error }))
    const model = yield* Effect.acquireRelease(
      Effect.promise(() => llama.loadModel({ modelPath: path, gpuLayers: 0 })),
      (m) => Effect.promise(() => m.dispose())
    )
    const ctx = yield* Effect.acquireRelease(
      Effect.promise(() =>
        model.createContext({
          contextSize: contextLength,
          threads: cfg.threads,
          flashAttention: true,
          batchSize: cfg.chunk,
          sequences: 1
        })
      ),
      (c) => Effect.promise(() => c.dispose())
    )
    const seq = ctx.getSequence()
    let filled = 0
    const side: Side = {
      name,
      fillSeconds: 0,
      fillTo: (length) =>
        Effect.promise(async () => {
          const t = performance.now()
          if (filled < length)
            await seq.evaluateWithoutGeneratingNewTokens(prompt.slice(filled, length) as Array<Token>)
          filled = Math.max(filled, length)
          side.fillSeconds += secondsSince(t)
        }),
      round: Effect.promise(async () => {
        // one token a call (greedy generation stops at the first end-of-generation token these random weights pick,
        // so the prompt's tokens are fed instead; the call skips the output head: 0.5M of ~50M multiply-adds a token)
        const t = performance.now()
        for (let i = 0; i < cfg.decode; i++) {
          await seq.evaluateWithoutGeneratingNewTokens([prompt[filled % prompt.length]!] as Array<Token>)
          filled++
        }
        return (secondsSince(t) * 1000) / cfg.decode
      })
    }
    return side
  })

const measure = Effect.gen(function* () {
  const top = Math.max(...cfg.contexts)
  const contextLength = Math.ceil((top + cfg.decode * cfg.rounds * cfg.contexts.length + 64) / 256) * 256
  const prompt = benchPrompt(top, VOCAB)
  const sides: Array<Side> = []
  for (const [name, topK] of [
    ["sparse", cfg.topK],
    ["dense", denseTopK]
  ] as const) {
    const path = ensureConvertedBenchModel(cfg.dir, "deepseek32", topK)
    const pipe = yield* openInProcessPipeline(path, [0, convertedBenchBlocks("deepseek32")], {
      threads: cfg.threads,
      prefillThreads: cfg.prefillThreads,
      contextLength
    })
    sides.push(oursSide(name, pipe, prompt))
    if (cfg.nlc) sides.push(yield* nlcSide(`${name} nlc`, path, contextLength, prompt))
  }
  const rows: Array<{ context: number; ms: Array<number> }> = []
  for (const context of cfg.contexts) {
    for (const side of sides) yield* side.fillTo(context)
    const ms = sides.map(() => Infinity)
    for (let round = 0; round < cfg.rounds; round++) {
      for (let i = 0; i < sides.length; i++) ms[i] = Math.min(ms[i]!, yield* sides[i]!.round)
    }
    rows.push({ context, ms })
    console.log(
      `  context ${context}: ` +
        sides
          .map((x, i) => `${x.name} ${ms[i]!.toFixed(2)} ms/token (fills so far ${x.fillSeconds.toFixed(0)} s)`)
          .join(", ")
    )
  }
  return { rows, names: sides.map((x) => x.name) }
})

const main = async () => {
  console.log(
    `swactor DSA decode benchmark: deepseek32 (gguf-py, bench/dsaModel.py) ${convertedBenchBlocks("deepseek32")} blocks ` +
      `x hidden 1024, 16 heads, kv_lora 512, indexer 16x128; sparse top-k ${cfg.topK}, dense top-k ${denseTopK}; ` +
      `threads ${cfg.threads} (fill ${cfg.prefillThreads}); ${cfg.decode} tokens a round, best of ${cfg.rounds}`
  )
  console.log(`(the machine's CPUs may be shared with other work; figures are indicative)`)
  const { rows, names } = await Effect.runPromise(Effect.scoped(measure).pipe(Effect.provide(StageExecutorLive.layer)))
  const pad = (x: string) => x.padEnd(21)
  console.log(`\n${pad("context")}${names.map((n) => pad(`${n} ms/token`)).join("")}sparse / dense`)
  const [sparse, dense] = [names.indexOf("sparse"), names.indexOf("dense")]
  for (const { context, ms } of rows) {
    console.log(
      `${pad(String(context))}${ms.map((m) => pad(m.toFixed(2))).join("")}${(ms[sparse]! / ms[dense]!).toFixed(3)}`
    )
  }
  const first = rows[0]!
  const last = rows[rows.length - 1]!
  const growth = (i: number) => last.ms[i]! - first.ms[i]!
  console.log(`\ngrowth ${first.context} -> ${last.context} (ms/token):`)
  for (let i = 0; i < names.length; i++) {
    console.log(`  ${names[i]}: +${growth(i).toFixed(2)} (x${(last.ms[i]! / first.ms[i]!).toFixed(2)})`)
  }
  for (const suffix of ["", " nlc"]) {
    const [a, b] = [names.indexOf(`sparse${suffix}`), names.indexOf(`dense${suffix}`)]
    if (a < 0) continue
    console.log(
      `growth_sparse / growth_dense${suffix === "" ? "" : " (node-llama-cpp)"} = ${(growth(a) / growth(b)).toFixed(3)}` +
        (suffix === "" ? " (issue 40's target: <= 0.5)" : "")
    )
  }
}

await main()
