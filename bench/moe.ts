/**
 * Mixture-of-experts benchmark (not a test): a synthetic qwen3moe, node-llama-cpp vs swactor's stage engine at 1, 2
 * and 4 stages in one process, same thread count on both sides. Prints decode and prefill tok/s, ours / node-llama-cpp,
 * and the peak RSS of each stage (run alone in a child process) beside its weights.
 *
 *   npm run bench:moe
 *
 * Settings (environment): BENCH_THREADS (1), BENCH_TYPE (q8_0), BENCH_LAYERS (8), BENCH_HIDDEN (1024), BENCH_FFN (2048),
 * BENCH_HEADS (16), BENCH_KV_HEADS (4), BENCH_EXPERTS (32), BENCH_EXPERTS_USED (4), BENCH_EXPERT_FFN (512),
 * BENCH_VOCAB (32000), BENCH_PROMPT (256), BENCH_DECODE (64), BENCH_STAGES (1,2,4), BENCH_ROUNDS (2: best round
 * counts), BENCH_DIR (.cache/bench: the model is kept). The default (~430 MiB at q8_0) is sized for a workstation;
 * on a shared machine pass a small shape (e.g. BENCH_LAYERS=4 BENCH_HIDDEN=256 BENCH_FFN=512 BENCH_EXPERTS=8
 * BENCH_EXPERTS_USED=2 BENCH_EXPERT_FFN=128 BENCH_VOCAB=400).
 */
import { Effect } from "effect"
import { execFileSync } from "node:child_process"
import { existsSync, mkdirSync } from "node:fs"
import { dirname, join, resolve } from "node:path"
import { fileURLToPath } from "node:url"
import { getLlama, LlamaLogLevel, type Token } from "node-llama-cpp"
import type { StageInput } from "../src/domain/engine.js"
import { getGgml } from "../src/layers/ggml/Bindings.js"
import { type SyntheticType, writeSyntheticModel } from "../src/layers/gguf/Synthetic.js"
import { StageExecutorLive } from "../src/layers/engine/StageExecutorLive.js"
import { openInProcessPipeline } from "../src/services/InProcessPipeline.js"
import { greedy, makeRng } from "../src/services/Sampler.js"
import { StageExecutor } from "../src/services/StageExecutor.js"

const env = (k: string, d: string) => process.env[k] ?? d
const num = (k: string, d: number) => Number(env(k, String(d)))
const root = resolve(dirname(fileURLToPath(import.meta.url)), "..")

const cfg = {
  threads: num("BENCH_THREADS", 1),
  type: env("BENCH_TYPE", "q8_0") as SyntheticType,
  layers: num("BENCH_LAYERS", 8),
  hidden: num("BENCH_HIDDEN", 1024),
  ffn: num("BENCH_FFN", 2048),
  heads: num("BENCH_HEADS", 16),
  kvHeads: num("BENCH_KV_HEADS", 4),
  experts: num("BENCH_EXPERTS", 32),
  expertsUsed: num("BENCH_EXPERTS_USED", 4),
  expertFfn: num("BENCH_EXPERT_FFN", 512),
  vocab: num("BENCH_VOCAB", 32000),
  prompt: num("BENCH_PROMPT", 256),
  decode: num("BENCH_DECODE", 64),
  stages: env("BENCH_STAGES", "1,2,4").split(",").map(Number),
  rounds: num("BENCH_ROUNDS", 2),
  dir: resolve(root, env("BENCH_DIR", ".cache/bench"))
}
const contextLength = Math.ceil((cfg.prompt + cfg.decode + 64) / 256) * 256

const ensureModel = async (): Promise<string> => {
  const c = cfg
  const path = join(
    c.dir,
    `qwen3moe-${c.layers}x${c.hidden}-ffn${c.ffn}-e${c.experts}k${c.expertsUsed}f${c.expertFfn}-v${c.vocab}-${c.type}.gguf`
  )
  if (existsSync(path)) return path
  mkdirSync(c.dir, { recursive: true })
  const s = await Effect.runPromise(writeSyntheticModel({
    path,
    arch: "qwen3moe",
    layers: c.layers,
    hidden: c.hidden,
    ffn: c.ffn,
    heads: c.heads,
    kvHeads: c.kvHeads,
    vocab: c.vocab,
    contextLength: 4096,
    type: c.type,
    seed: 1,
    experts: c.experts,
    expertsUsed: c.expertsUsed,
    expertFfn: c.expertFfn
  }))
  console.log(`wrote ${path}: ${(s.bytes / 2 ** 20).toFixed(0)} MiB in ${s.seconds.toFixed(1)} s`)
  return path
}

const promptTokens = (n: number) => {
  const r = makeRng(2024)
  return Array.from({ length: n }, () => 3 + Math.floor(r() * (cfg.vocab - 3)))
}

const splitOf = (stages: number): Array<number> =>
  Array.from({ length: stages + 1 }, (_, i) => Math.round((i * cfg.layers) / stages))

interface Figures {
  readonly decode: number
  readonly prefill: number
}

const seconds = (t0: number) => (performance.now() - t0) / 1000

const benchNodeLlamaCpp = async (path: string): Promise<Figures> => {
  const llama = await getLlama({ gpu: false, build: "never", logLevel: LlamaLogLevel.error })
  const model = await llama.loadModel({ modelPath: path, gpuLayers: 0 })
  const ctx = await model.createContext({
    contextSize: contextLength,
    threads: cfg.threads,
    flashAttention: true,
    batchSize: cfg.prompt,
    sequences: 1
  })
  try {
    const seq = ctx.getSequence()
    const prompt = promptTokens(cfg.prompt) as Array<Token>
    await seq.evaluateWithoutGeneratingNewTokens(prompt.slice(0, 32))
    await seq.clearHistory()
    const p0 = performance.now()
    await seq.evaluateWithoutGeneratingNewTokens(prompt)
    const prefill = cfg.prompt / seconds(p0)
    await seq.clearHistory()
    let n = 0
    let d0 = performance.now()
    for await (const _ of seq.evaluate(prompt.slice(0, 16), { temperature: 0 })) {
      if (n === 0) d0 = performance.now()
      if (++n > cfg.decode) break
    }
    return { decode: cfg.decode / seconds(d0), prefill }
  } finally {
    await ctx.dispose()
    await model.dispose()
  }
}

const benchOurs = (path: string, stages: number): Promise<Figures> =>
  Effect.runPromise(Effect.scoped(Effect.gen(function*() {
    const { reset, run } = yield* openInProcessPipeline(path, splitOf(stages), { threads: cfg.threads, contextLength })
    const prompt = promptTokens(cfg.prompt)
    yield* run(0, prompt.slice(0, 32))
    yield* reset
    const p0 = performance.now()
    yield* run(0, prompt)
    const prefill = cfg.prompt / seconds(p0)
    yield* reset
    let logits = yield* run(0, prompt.slice(0, 16))
    let pos = 16
    const d0 = performance.now()
    for (let i = 0; i < cfg.decode; i++) logits = yield* run(pos++, [greedy(logits)])
    return { decode: cfg.decode / seconds(d0), prefill }
  })).pipe(Effect.provide(StageExecutorLive)))

/** Child-process mode: load one stage (or nothing: "baseline"), prefill and decode a little, report peak RSS. */
const stageRss = async (args: ReadonlyArray<string>) => {
  const [path, start, end] = args
  if (path === "baseline") {
    getGgml().cpuDevice()
    console.log(JSON.stringify({ maxRss: process.resourceUsage().maxRSS * 1024, weightBytes: 0 }))
    return
  }
  const s = Number(start)
  const e = Number(end)
  const weightBytes = await Effect.runPromise(Effect.scoped(Effect.gen(function*() {
    const executor = yield* StageExecutor
    const stage = yield* executor.load({ path: path!, layerStart: s, layerEndExclusive: e, isFirst: s === 0, isLast: e === cfg.layers })
    const session = yield* executor.session(stage, { threads: cfg.threads, contextLength })
    const input = (n: number): StageInput =>
      stage.info.isFirst
        ? { _tag: "Tokens", tokens: new Int32Array(n).fill(5) }
        : { _tag: "Hidden", hidden: new Float32Array(n * stage.info.hiddenDim).fill(0.01), nTokens: n }
    yield* session.forward(0, input(cfg.prompt))
    for (let i = 0; i < 4; i++) yield* session.forward(cfg.prompt + i, input(1))
    return stage.info.weightBytes
  })).pipe(Effect.provide(StageExecutorLive)))
  console.log(JSON.stringify({ maxRss: process.resourceUsage().maxRSS * 1024, weightBytes }))
}

const childRss = (args: ReadonlyArray<string>): { maxRss: number; weightBytes: number } => {
  const out = execFileSync(process.execPath, [...process.execArgv, fileURLToPath(import.meta.url), "--stage-rss", ...args], {
    encoding: "utf8",
    stdio: ["ignore", "pipe", "ignore"],
    env: process.env
  })
  return JSON.parse(out.trim().split("\n").filter((l) => l.startsWith("{")).pop()!)
}

const mib = (b: number) => `${(b / 2 ** 20).toFixed(1)} MiB`

const main = async () => {
  const c = cfg
  console.log(
    `swactor MoE benchmark: qwen3moe ${c.layers} blocks, hidden ${c.hidden}, ${c.experts} experts of ${c.expertFfn} ` +
      `(${c.expertsUsed} used), heads ${c.heads}/${c.kvHeads}, vocab ${c.vocab}, ${c.type}; threads ${c.threads} on both ` +
      `sides; prompt ${c.prompt}, decode ${c.decode}; best of ${c.rounds} rounds (the CPUs may be shared: indicative)`
  )
  const path = await ensureModel()
  let ref: Figures = { decode: 0, prefill: 0 }
  const ours = new Map<number, Figures>()
  const best = (a: Figures | undefined, b: Figures): Figures =>
    a === undefined ? b : { decode: Math.max(a.decode, b.decode), prefill: Math.max(a.prefill, b.prefill) }
  for (let round = 0; round < c.rounds; round++) {
    ref = best(ref, await benchNodeLlamaCpp(path))
    for (const stages of c.stages) ours.set(stages, best(ours.get(stages), await benchOurs(path, stages)))
  }
  const f = (x: number) => x.toFixed(1)
  console.log(`node-llama-cpp: decode ${f(ref.decode)} tok/s, prefill ${f(ref.prefill)} tok/s`)
  for (const stages of c.stages) {
    const o = ours.get(stages)!
    console.log(
      `swactor ${stages} stage(s): decode ${f(o.decode)} tok/s (${(o.decode / ref.decode).toFixed(2)}x), ` +
        `prefill ${f(o.prefill)} tok/s (${(o.prefill / ref.prefill).toFixed(2)}x)`
    )
  }
  const maxStages = Math.max(...c.stages)
  const split = splitOf(maxStages)
  const base = childRss(["baseline"])
  console.log(`peak RSS per stage (${maxStages} stages, each alone in a process; bare process ${mib(base.maxRss)}):`)
  for (let i = 0; i < maxStages; i++) {
    const r = childRss([path, String(split[i]), String(split[i + 1])])
    console.log(`  stage ${i} blocks [${split[i]}, ${split[i + 1]}): peak RSS ${mib(r.maxRss)}, weights ${mib(r.weightBytes)}`)
  }
}

if (process.argv[2] === "--stage-rss") {
  await stageRss(process.argv.slice(3))
} else {
  await main()
}
