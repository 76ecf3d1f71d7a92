/**
 * Pipeline benchmark (not a test): decode tok/s of `swactor run` with 1, 2 and 4 local agents (the same
 * code path as the CLI: one child process per stage, frames over loopback) against node-llama-cpp in one
 * process, on a synthetic llama model at a real shape (16 blocks, hidden 2048, FFN 8192, vocab 32000,
 * Q8_0, written once with the project's GGUF writer and kept), the same thread count on both sides.
 *
 *   npm run bench:pipeline
 *
 * Settings (environment): BENCH_THREADS (1), BENCH_TYPE (q8_0), BENCH_LAYERS (16), BENCH_HIDDEN (2048),
 * BENCH_FFN (8192), BENCH_HEADS (32), BENCH_KV_HEADS (8), BENCH_VOCAB (32000), BENCH_DECODE (64),
 * BENCH_AGENTS (1,2,4), BENCH_ROUNDS (2: configurations interleaved, best round counts),
 * BENCH_DIR (.cache/bench, shared with bench:engine).
 */
import { dirname, resolve } from "node:path"
import { fileURLToPath } from "node:url"
import { Effect, Stream } from "effect"
import { getLlama, LlamaLogLevel, type Token } from "node-llama-cpp"
import { layerLocal, run } from "../src/api/generate.js"
import type { SyntheticType } from "../src/layers/gguf/Synthetic.js"
import { benchModelPath, ensureBenchModel } from "./benchModel.js"
import type { RunSummary } from "../src/services/Orchestrator.js"

const env = (k: string, d: string) => process.env[k] ?? d
const num = (k: string, d: number) => Number(env(k, String(d)))
const root = resolve(dirname(fileURLToPath(import.meta.url)), "..")

const cfg = {
  threads: num("BENCH_THREADS", 1),
  type: env("BENCH_TYPE", "q8_0") as SyntheticType,
  layers: num("BENCH_LAYERS", 16),
  hidden: num("BENCH_HIDDEN", 2048),
  ffn: num("BENCH_FFN", 8192),
  heads: num("BENCH_HEADS", 32),
  kvHeads: num("BENCH_KV_HEADS", 8),
  vocab: num("BENCH_VOCAB", 32000),
  decode: num("BENCH_DECODE", 64),
  agents: env("BENCH_AGENTS", "1,2,4").split(",").map(Number),
  rounds: num("BENCH_ROUNDS", 2),
  dir: resolve(root, env("BENCH_DIR", ".cache/bench"))
}
const prompt = "Once upon a time"

// Same file as bench:engine, so the two share the cached model.
const modelPath = benchModelPath(cfg.dir, cfg)
const ensureModel = () => ensureBenchModel(cfg.dir, cfg)

interface Result {
  readonly decode: number
  readonly tokens: ReadonlyArray<number>
  readonly summary?: RunSummary
}

/** node-llama-cpp, one process: BOS + prompt, greedy; decode rate over the tokens after the first. */
const reference = async (): Promise<Result> => {
  const llama = await getLlama({ gpu: false, build: "never", logLevel: LlamaLogLevel.error })
  const model = await llama.loadModel({ modelPath, gpuLayers: 0 })
  try {
    const ctx = await model.createContext({
      contextSize: 512,
      threads: cfg.threads,
      flashAttention: true,
      sequences: 1
    })
    try {
      const seq = ctx.getSequence()
      const bos = model.tokens.bos
      const input: Array<Token> = [...(bos !== null ? [bos] : []), ...model.tokenize(prompt)]
      const tokens: Array<number> = []
      let first = 0
      for await (const token of seq.evaluate(input, { temperature: 0 })) {
        tokens.push(token)
        if (tokens.length === 1) first = performance.now()
        if (tokens.length >= cfg.decode) break
      }
      const decode = (tokens.length - 1) / ((performance.now() - first) / 1000)
      return { decode, tokens }
    } finally {
      await ctx.dispose()
    }
  } finally {
    await model.dispose()
    await llama.dispose()
  }
}

/** `swactor run --stages N` through the library: N fresh local agent processes. */
const pipeline = (agents: number): Promise<Result> =>
  Effect.runPromise(
    Effect.gen(function* () {
      const tokens: Array<number> = []
      let summary: RunSummary | undefined
      yield* run({ model: modelPath, prompt, stages: agents, maxTokens: cfg.decode, threads: cfg.threads }).pipe(
        Stream.runForEach((update) =>
          Effect.sync(() => {
            if (update._tag === "Token" && update.token.tokenId >= 0) tokens.push(update.token.tokenId)
            if (update._tag === "Finished") summary = update.summary
          })
        ),
        Effect.provide(layerLocal({ threads: cfg.threads }))
      )
      return { decode: summary!.decodeTokensPerSecond, tokens, summary: summary! }
    })
  )

const main = async () => {
  console.log(
    `pipeline bench: llama ${cfg.layers} blocks, hidden ${cfg.hidden}, ffn ${cfg.ffn}, vocab ${cfg.vocab}, ${cfg.type}; ` +
      `${cfg.threads} thread(s) per stage and for node-llama-cpp; ${cfg.decode} tokens; best of ${cfg.rounds} rounds`
  )
  await ensureModel()
  const best = new Map<string, Result>()
  const keep = (key: string, result: Result) => {
    const previous = best.get(key)
    if (previous === undefined || result.decode > previous.decode) best.set(key, result)
  }
  for (let round = 1; round <= cfg.rounds; round++) {
    const ref = await reference()
    keep("node-llama-cpp", ref)
    console.log(`round ${round}: node-llama-cpp ${ref.decode.toFixed(2)} tok/s (${ref.tokens.length} tokens)`)
    for (const agents of cfg.agents) {
      const result = await pipeline(agents)
      keep(`swactor ${agents}`, result)
      const s = result.summary!
      console.log(
        `round ${round}: swactor run, ${agents} agent${agents === 1 ? "" : "s"}: ${result.decode.toFixed(2)} tok/s ` +
          `(${result.tokens.length} tokens; ${s.decodeMillisPerToken.toFixed(2)} ms/token = compute ` +
          `${(s.decodeMillisPerToken - s.transferMillisPerToken).toFixed(2)} + transfer ${s.transferMillisPerToken.toFixed(2)})`
      )
    }
  }
  const ref = best.get("node-llama-cpp")!
  console.log("\nbest rounds, decode tok/s (ratio to node-llama-cpp):")
  console.log(`  node-llama-cpp, 1 process: ${ref.decode.toFixed(2)}`)
  for (const agents of cfg.agents) {
    const r = best.get(`swactor ${agents}`)!
    const same = r.tokens.length === ref.tokens.length && r.tokens.every((t, i) => t === ref.tokens[i])
    console.log(
      `  swactor run, ${agents} local agent${agents === 1 ? "" : "s"}: ${r.decode.toFixed(2)} ` +
        `(${(r.decode / ref.decode).toFixed(3)}x)${same ? ", same greedy tokens" : ", tokens differ from node-llama-cpp"}`
    )
  }
  const four = best.get("swactor 4")
  if (four !== undefined) {
    const ratio = four.decode / ref.decode
    console.log(`target 4 agents >= 0.90x: ${ratio >= 0.9 ? "met" : "NOT met"} (${ratio.toFixed(3)}x)`)
  }
}

main().catch((error) => {
  console.error(error)
  process.exit(1)
})
