/**
 * Engine benchmark (not a test): node-llama-cpp vs swactor's stage engine at 1, 2 and 4 stages in one process,
 * on synthetic llama models at a real shape, on synthetic gemma3 and qwen35 files (bench/archModels.ts: same
 * file for both sides), and, when BENCH_ARCHS names them, on gguf-py files of deepseek32, glm-dsa and minimax-m2
 * (bench/convertedBenchModels.ts: families swactor's writer cannot write), same thread count on both sides. Prints decode and prefill tok/s,
 * ratios ours / node-llama-cpp, and the peak RSS of each stage (run alone in a child process) vs its weights.
 * The timing loop is bench/engineTiming.ts (bench:moe's too).
 *
 *   npm run bench:engine
 *
 * Settings (environment): BENCH_THREADS (1: a shared 2-core machine collapses with 2), BENCH_TYPES (q8_0,q4_k), BENCH_LAYERS (16), BENCH_HIDDEN (2048),
 * BENCH_FFN (8192), BENCH_HEADS (32), BENCH_KV_HEADS (8), BENCH_VOCAB (32000), BENCH_PROMPT (512),
 * BENCH_DECODE (64), BENCH_STAGES (1,2,4), BENCH_ROUNDS (2: every configuration runs once per round, interleaved,
 * and the best round counts, which damps other load on the machine), BENCH_DIR (.cache/bench: models are kept),
 * BENCH_ARCHS (llama,gemma3,qwen35: the llama rows take the BENCH_* shape, the others their own shape; deepseek32,
 * glm-dsa and minimax-m2 are opt-in, one F16 row each, BENCH_TYPES ignored, stages capped at their blocks).
 */
import { Effect } from "effect"
import { execFileSync } from "node:child_process"
import { dirname, resolve } from "node:path"
import { fileURLToPath } from "node:url"
import type { StageInput } from "../src/domain/engine.js"
import { getGgml } from "../src/layers/ggml/Bindings.js"
import type { SyntheticType } from "../src/layers/gguf/Synthetic.js"
import { ensureBenchModel } from "./benchModel.js"
import { type BenchArch, benchArchShape, benchArchs, ensureArchBenchModel } from "./archModels.js"
import {
  type ConvertedBenchFamily,
  convertedBenchBlocks,
  convertedBenchFamilies,
  convertedBenchShape,
  ensureConvertedBenchModel
} from "./convertedBenchModels.js"
import * as StageExecutorLive from "../src/layers/engine/StageExecutorLive.js"
import {
  benchContextLength,
  benchPrompt,
  bestFigures,
  evenSplit,
  type Figures,
  timeNodeLlamaCpp,
  timeOurs
} from "./engineTiming.js"
import { StageExecutor } from "../src/services/StageExecutor.js"

const env = (k: string, d: string) => process.env[k] ?? d
const num = (k: string, d: number) => Number(env(k, String(d)))
const root = resolve(dirname(fileURLToPath(import.meta.url)), "..")

const cfg = {
  threads: num("BENCH_THREADS", 1),
  types: env("BENCH_TYPES", "q8_0,q4_k").split(",") as Array<SyntheticType>,
  layers: num("BENCH_LAYERS", 16),
  hidden: num("BENCH_HIDDEN", 2048),
  ffn: num("BENCH_FFN", 8192),
  heads: num("BENCH_HEADS", 32),
  kvHeads: num("BENCH_KV_HEADS", 8),
  vocab: num("BENCH_VOCAB", 32000),
  prompt: num("BENCH_PROMPT", 512),
  decode: num("BENCH_DECODE", 64),
  stages: env("BENCH_STAGES", "1,2,4").split(",").map(Number),
  rounds: num("BENCH_ROUNDS", 2),
  dir: resolve(root, env("BENCH_DIR", ".cache/bench")),
  archs: env("BENCH_ARCHS", "llama,gemma3,qwen35").split(",")
}
const contextLength = benchContextLength(cfg.prompt, cfg.decode)

const ensureModel = (type: SyntheticType) => ensureBenchModel(cfg.dir, { ...cfg, type })

/** The file of one row: its blocks and vocabulary (gemma3, qwen35: their own shape, archModels.ts). */
interface BenchFile {
  readonly label: string
  readonly path: string
  readonly layers: number
  readonly vocab: number
}

let vocab = cfg.vocab

let layers = cfg.layers

const splitOf = (stages: number) => evenSplit(layers, stages)

/** The timing loop's settings for the current file (its vocabulary). */
const timing = () => ({
  threads: cfg.threads,
  contextLength,
  prompt: benchPrompt(cfg.prompt, vocab),
  decode: cfg.decode
})

/** Child-process mode: load one stage, run a prefill and a few decode steps, report peak RSS. */
const stageRss = async (args: ReadonlyArray<string>) => {
  const [path, start, end, stagesTotal] = args
  const s = Number(start)
  const e = Number(end)
  layers = Number(stagesTotal)
  if (path === "baseline") {
    getGgml().cpuDevice()
    console.log(JSON.stringify({ maxRss: process.resourceUsage().maxRSS * 1024, weightBytes: 0 }))
    return
  }
  const result = await Effect.runPromise(
    Effect.scoped(
      Effect.gen(function* () {
        const executor = yield* StageExecutor
        const stage = yield* executor.load({
          path: path!,
          layerStart: s,
          layerEndExclusive: e,
          isFirst: s === 0,
          isLast: e === Number(stagesTotal)
        })
        const session = yield* executor.session(stage, { threads: cfg.threads, contextLength })
        const input = (n: number): StageInput =>
          stage.info.isFirst
            ? { _tag: "Tokens", tokens: new Int32Array(n).fill(5) }
            : { _tag: "Hidden", hidden: new Float32Array(n * stage.info.hiddenDim).fill(0.01), nTokens: n }
        yield* session.forward(0, input(cfg.prompt))
        for (let i = 0; i < 4; i++) yield* session.forward(cfg.prompt + i, input(1))
        return { weightBytes: stage.info.weightBytes }
      })
    ).pipe(Effect.provide(StageExecutorLive.layer))
  )
  console.log(JSON.stringify({ maxRss: process.resourceUsage().maxRSS * 1024, weightBytes: result.weightBytes }))
}

const childRss = (args: ReadonlyArray<string>): { maxRss: number; weightBytes: number } => {
  const out = execFileSync(
    process.execPath,
    [...process.execArgv, fileURLToPath(import.meta.url), "--stage-rss", ...args],
    { encoding: "utf8", stdio: ["ignore", "pipe", "ignore"], env: process.env }
  )
  const line = out
    .trim()
    .split("\n")
    .filter((l) => l.startsWith("{"))
    .pop()!
  return JSON.parse(line)
}

const mib = (b: number) => `${(b / 2 ** 20).toFixed(0)} MiB`
const pad = (s: string, n: number) => s.padEnd(n)

/** The rows' files: llama at the BENCH_* shape and the synthetic archs per type, the gguf-py families once (F16). */
const benchFiles = async (): Promise<Array<BenchFile>> => {
  const files: Array<BenchFile> = []
  for (const arch of cfg.archs) {
    if ((convertedBenchFamilies as ReadonlyArray<string>).includes(arch)) {
      const family = arch as ConvertedBenchFamily
      files.push({
        label: `${arch} (gguf-py) ${convertedBenchShape(family)}`,
        path: ensureConvertedBenchModel(cfg.dir, family),
        layers: convertedBenchBlocks(family),
        vocab: 512
      })
      continue
    }
    for (const type of cfg.types) {
      if (arch === "llama") {
        files.push({ label: type, path: await ensureModel(type), layers: cfg.layers, vocab: cfg.vocab })
      } else if ((benchArchs as ReadonlyArray<string>).includes(arch)) {
        const s = benchArchShape(arch as BenchArch)
        files.push({
          label: `${arch} ${s.layers}x${s.hidden} ffn ${s.ffn} heads ${s.heads}/${s.kvHeads} ${type}`,
          path: await ensureArchBenchModel(cfg.dir, arch as BenchArch, type),
          layers: s.layers,
          vocab: s.vocab
        })
      } else {
        throw new Error(
          `BENCH_ARCHS: ${arch} is not one of llama, ${[...benchArchs, ...convertedBenchFamilies].join(", ")}`
        )
      }
    }
  }
  return files
}

const main = async () => {
  console.log(
    `swactor engine benchmark: ${cfg.archs.join(", ")}` +
      (cfg.archs.includes("llama")
        ? ` (llama ${cfg.layers} blocks, hidden ${cfg.hidden}, ffn ${cfg.ffn}, heads ${cfg.heads}/${cfg.kvHeads}, vocab ${cfg.vocab})`
        : "") +
      `; threads ${cfg.threads} on both sides; prompt ${cfg.prompt}, decode ${cfg.decode} tokens; context ${contextLength}`
  )
  console.log(`(the machine's CPUs may be shared with other work; figures are indicative)`)
  const files = await benchFiles()
  for (const { label, path, layers: blocks, vocab: words } of files) {
    layers = blocks
    vocab = words
    const stagesOf = cfg.stages.filter((n) => n <= blocks)
    let ref: Figures | undefined
    const ours = new Map<number, Figures>()
    for (let round = 0; round < cfg.rounds; round++) {
      ref = bestFigures(ref, await timeNodeLlamaCpp(path, timing()))
      for (const stages of stagesOf)
        ours.set(stages, bestFigures(ours.get(stages), await timeOurs(path, splitOf(stages), timing())))
    }
    const r = ref!
    const f = (x: number) => x.toFixed(2)
    console.log(
      `\n${label}: node-llama-cpp decode ${f(r.decode)} tok/s (${f(r.decodeCpu)} tok/cpu-s), ` +
        `prefill ${f(r.prefill)} tok/s (${f(r.prefillCpu)} tok/cpu-s), best of ${cfg.rounds}`
    )
    console.log(
      `${pad("stages", 8)}${pad("decode tok/s", 14)}${pad("ours/nlc", 10)}${pad("per cpu-s", 11)}` +
        `${pad("prefill tok/s", 15)}${pad("ours/nlc", 10)}per cpu-s`
    )
    for (const stages of stagesOf) {
      const o = ours.get(stages)!
      console.log(
        `${pad(String(stages), 8)}${pad(f(o.decode), 14)}${pad((o.decode / r.decode).toFixed(3), 10)}` +
          `${pad((o.decodeCpu / r.decodeCpu).toFixed(3), 11)}${pad(f(o.prefill), 15)}` +
          `${pad((o.prefill / r.prefill).toFixed(3), 10)}${(o.prefillCpu / r.prefillCpu).toFixed(3)}`
      )
    }
    const maxStages = Math.max(...stagesOf)
    const split = splitOf(maxStages)
    const base = childRss(["baseline"])
    console.log(`peak RSS per stage (${maxStages} stages, each alone in a process; bare process ${mib(base.maxRss)}):`)
    for (let i = 0; i < maxStages; i++) {
      const r = childRss([path, String(split[i]), String(split[i + 1]), String(layers)])
      console.log(
        `  stage ${i} blocks [${split[i]}, ${split[i + 1]}): peak RSS ${mib(r.maxRss)}, weights ${mib(r.weightBytes)}, ` +
          `RSS - bare process ${mib(r.maxRss - base.maxRss)} = ${((r.maxRss - base.maxRss) / r.weightBytes).toFixed(2)}x its weights`
      )
    }
  }
}

if (process.argv[2] === "--stage-rss") {
  await stageRss(process.argv.slice(3))
} else {
  await main()
}
