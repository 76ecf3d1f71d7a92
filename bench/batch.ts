/**
 * Batched decode benchmark (not a test): in one process, N sequences decoded with ONE forwardBatch per stage per
 * step (the weights read once for all N) against the same N sequences decoded one after another with `forward`,
 * at 1 and 2 in-process stages, on the synthetic llama model at a real shape (as bench:engine; kept under
 * BENCH_DIR). Prints aggregate decode tok/s for each N and the gain, and checks that every sequence's greedy
 * tokens are the same both ways.
 *
 *   npm run bench:batch
 *
 * Settings (environment): BENCH_THREADS (1), BENCH_TYPE (q8_0), BENCH_LAYERS (16), BENCH_HIDDEN (2048),
 * BENCH_FFN (8192), BENCH_HEADS (32), BENCH_KV_HEADS (8), BENCH_VOCAB (32000), BENCH_SEQS (1,2,4,8),
 * BENCH_STAGES (1,2), BENCH_PROMPT (16 tokens per sequence), BENCH_DECODE (32 tokens per sequence),
 * BENCH_ROUNDS (2: configurations interleaved, the best round counts), BENCH_DIR (.cache/bench).
 */
import { Effect } from "effect"
import { dirname, resolve } from "node:path"
import { fileURLToPath } from "node:url"
import type { StageInput, StageOutput } from "../src/domain/engine.js"
import type { SyntheticType } from "../src/layers/gguf/Synthetic.js"
import { ensureBenchModel } from "./benchModel.js"
import * as StageExecutorLive from "../src/layers/engine/StageExecutorLive.js"
import { greedy, makeRng } from "../src/services/Sampler.js"
import { type LoadedStage, StageExecutor, type StageSession } from "../src/services/StageExecutor.js"

const env = (k: string, d: string) => process.env[k] ?? d
const num = (k: string, d: number) => Number(env(k, String(d)))
const list = (k: string, d: string) => env(k, d).split(",").map(Number)
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
  seqs: list("BENCH_SEQS", "1,2,4,8"),
  stages: list("BENCH_STAGES", "1,2"),
  prompt: num("BENCH_PROMPT", 16),
  decode: num("BENCH_DECODE", 32),
  rounds: num("BENCH_ROUNDS", 2),
  dir: resolve(root, env("BENCH_DIR", ".cache/bench"))
}
const contextLength = Math.ceil((cfg.prompt + cfg.decode + 1) / 256) * 256
const maxSeqs = Math.max(...cfg.seqs)

/** The same file as bench:engine, so one written model serves both. */
const ensureModel = () => ensureBenchModel(cfg.dir, cfg)

const prompts = (() => {
  const r = makeRng(99)
  return Array.from({ length: maxSeqs }, () =>
    Int32Array.from({ length: cfg.prompt }, () => 3 + Math.floor(r() * (cfg.vocab - 3)))
  )
})()

interface Figures {
  /** aggregate decode tokens per second, N sequences together */
  readonly tokPerSec: number
  readonly tokens: ReadonlyArray<ReadonlyArray<number>>
}

const bench = (path: string, stagesCount: number) =>
  Effect.gen(function* () {
    const executor = yield* StageExecutor
    const bounds = Array.from({ length: stagesCount + 1 }, (_, i) => Math.round((i * cfg.layers) / stagesCount))
    const stages: Array<LoadedStage> = []
    for (let i = 0; i < stagesCount; i++) {
      stages.push(
        yield* executor.load({
          path,
          layerStart: bounds[i]!,
          layerEndExclusive: bounds[i + 1]!,
          isFirst: i === 0,
          isLast: i === stagesCount - 1
        })
      )
    }
    // per sequence, one session per stage
    const seqs: Array<Array<StageSession>> = []
    for (let s = 0; s < maxSeqs; s++) {
      seqs.push(yield* Effect.forEach(stages, (st) => executor.session(st, { threads: cfg.threads, contextLength })))
    }

    /** One step of `n` sequences (tokens at `pos`) through every stage, batched; the logits of each. */
    const stepBatched = (n: number, pos: number, tokens: ReadonlyArray<Int32Array>) =>
      Effect.gen(function* () {
        let inputs: Array<StageInput> = tokens.map((t) => ({ _tag: "Tokens", tokens: t }))
        let outs: ReadonlyArray<StageOutput> = []
        for (let si = 0; si < stagesCount; si++) {
          outs = yield* executor.forwardBatch(
            inputs.map((input, s) => ({ session: seqs[s]![si]!, startPos: pos, input }))
          )
          inputs = outs.map((o) => (o._tag === "Hidden" ? o : { _tag: "Tokens", tokens: new Int32Array(0) }))
        }
        return outs.slice(0, n).map((o) => (o._tag === "Logits" ? o.logits : new Float32Array(0)))
      })

    const stepAlone = (s: number, pos: number, tokens: Int32Array) =>
      Effect.gen(function* () {
        let input: StageInput = { _tag: "Tokens", tokens }
        for (const session of seqs[s]!) {
          const out: StageOutput = yield* session.forward(pos, input)
          if (out._tag === "Logits") return out.logits
          input = out
        }
        return yield* Effect.dieMessage("no logits")
      })

    const resetAll = Effect.forEach(seqs.flat(), (s) => s.reset, { discard: true })

    const sequential = (n: number) =>
      Effect.gen(function* () {
        yield* resetAll
        const tokens: Array<Array<number>> = []
        let millis = 0
        for (let s = 0; s < n; s++) {
          let logits = yield* stepAlone(s, 0, prompts[s]!)
          const out: Array<number> = []
          const t0 = performance.now()
          for (let i = 0; i < cfg.decode; i++) {
            out.push(greedy(logits))
            logits = yield* stepAlone(s, cfg.prompt + i, Int32Array.of(out[i]!))
          }
          millis += performance.now() - t0
          tokens.push(out)
        }
        return { tokPerSec: (n * cfg.decode * 1000) / millis, tokens } satisfies Figures
      })

    const batched = (n: number) =>
      Effect.gen(function* () {
        yield* resetAll
        // prefill: each sequence alone (not timed), the same as `sequential`
        let logits: Array<Float32Array> = []
        for (let s = 0; s < n; s++) logits.push(yield* stepAlone(s, 0, prompts[s]!))
        const tokens: Array<Array<number>> = Array.from({ length: n }, () => [])
        const t0 = performance.now()
        for (let i = 0; i < cfg.decode; i++) {
          logits.forEach((l, s) => tokens[s]!.push(greedy(l)))
          logits = yield* stepBatched(
            n,
            cfg.prompt + i,
            tokens.map((t) => Int32Array.of(t[i]!))
          )
        }
        return { tokPerSec: (n * cfg.decode * 1000) / (performance.now() - t0), tokens } satisfies Figures
      })

    // warm-up: build the graphs once
    yield* sequential(1)
    const best = new Map<string, Figures>()
    const keep = (key: string, f: Figures) => {
      const b = best.get(key)
      if (b === undefined || f.tokPerSec > b.tokPerSec) best.set(key, f)
    }
    for (let round = 0; round < cfg.rounds; round++) {
      for (const n of cfg.seqs) {
        keep(`seq${n}`, yield* sequential(n))
        keep(`bat${n}`, yield* batched(n))
      }
    }
    return best
  }).pipe(Effect.scoped)

const main = async () => {
  console.log(
    `swactor batched decode benchmark: llama ${cfg.layers} blocks, hidden ${cfg.hidden}, ffn ${cfg.ffn}, ` +
      `heads ${cfg.heads}/${cfg.kvHeads}, vocab ${cfg.vocab}, ${cfg.type}; ${cfg.threads} thread(s); ` +
      `prompt ${cfg.prompt}, decode ${cfg.decode} tokens per sequence; best of ${cfg.rounds} round(s)`
  )
  console.log("(one process, stages in-process one after another; the CPUs may be shared, figures are indicative)")
  const path = await ensureModel()
  const pad = (s: string, n: number) => s.padEnd(n)
  for (const stages of cfg.stages) {
    const best = await Effect.runPromise(bench(path, stages).pipe(Effect.provide(StageExecutorLive.layer)))
    console.log(`\n${stages} stage(s)`)
    console.log(
      `${pad("seqs", 6)}${pad("one after another tok/s", 26)}${pad("batched tok/s", 16)}${pad("gain", 8)}same tokens`
    )
    for (const n of cfg.seqs) {
      const s = best.get(`seq${n}`)!
      const b = best.get(`bat${n}`)!
      const same = JSON.stringify(s.tokens) === JSON.stringify(b.tokens)
      console.log(
        `${pad(String(n), 6)}${pad(s.tokPerSec.toFixed(2), 26)}${pad(b.tokPerSec.toFixed(2), 16)}` +
          `${pad(`${(b.tokPerSec / s.tokPerSec).toFixed(2)}x`, 8)}${same ? "yes" : "NO"}`
      )
    }
  }
}

await main()
