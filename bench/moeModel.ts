/**
 * bench:moe's synthetic qwen3moe: one file per shape and type under the bench directory (default
 * ~/.cache/swactor-bench), written once with a fixed seed and kept. The default is issue 20's shape: 24 blocks,
 * hidden 2048, heads 32/4 of 128, 64 experts of FFN 768 with 8 used, vocab 32000, q4_k_m (llama.cpp's mixed recipe:
 * Q4_K, with Q6_K for attn_v and ffn_down_exps in use_more_bits blocks and for the output head), about 4.3 GiB.
 * Its values are swactor synth's (N(0, 1/sqrt(fan_in)), seed 1) except the expert tensors' (repeatFirstChunk).
 */
import { existsSync, mkdirSync, renameSync } from "node:fs"
import { homedir } from "node:os"
import { join } from "node:path"
import { Effect } from "effect"
import { tensorBytes } from "../src/domain/ggmlTypes.js"
import { type GgufTensorSpec, writeGgufFile } from "../src/layers/gguf/GgufWriter.js"
import { syntheticModelSpec, type SyntheticType } from "../src/layers/gguf/Synthetic.js"

export interface MoeBenchShape {
  readonly layers: number
  readonly hidden: number
  readonly heads: number
  readonly kvHeads: number
  readonly headDim: number
  readonly experts: number
  readonly expertsUsed: number
  readonly expertFfn: number
  readonly vocab: number
  readonly type: SyntheticType
}

const env = (k: string, d: string) => process.env[k] ?? d
const num = (k: string, d: number) => Number(env(k, String(d)))

/** The shape from BENCH_* (defaults: issue 20's). */
export const moeBenchShape = (): MoeBenchShape => ({
  layers: num("BENCH_LAYERS", 24),
  hidden: num("BENCH_HIDDEN", 2048),
  heads: num("BENCH_HEADS", 32),
  kvHeads: num("BENCH_KV_HEADS", 4),
  headDim: num("BENCH_HEAD_DIM", 128),
  experts: num("BENCH_EXPERTS", 64),
  expertsUsed: num("BENCH_EXPERTS_USED", 8),
  expertFfn: num("BENCH_EXPERT_FFN", 768),
  vocab: num("BENCH_VOCAB", 32000),
  type: env("BENCH_TYPE", "q4_k_m") as SyntheticType
})

export const moeBenchDir = (): string => env("BENCH_DIR", join(homedir(), ".cache", "swactor-bench"))

/** The model's path, written first (minutes at the default shape) when it is not there yet. */
export const ensureMoeBenchModel = async (dir: string, s: MoeBenchShape): Promise<string> => {
  const path = join(
    dir,
    `qwen3moe-${s.layers}x${s.hidden}-h${s.heads}k${s.kvHeads}d${s.headDim}-e${s.experts}k${s.expertsUsed}f${s.expertFfn}-v${s.vocab}-${s.type}.gguf`
  )
  if (existsSync(path)) return path
  mkdirSync(dir, { recursive: true })
  process.stdout.write(`writing ${path} (once; it is kept) ... `)
  const partial = `${path}.partial`
  const spec = syntheticModelSpec({
    path: partial,
    arch: "qwen3moe",
    layers: s.layers,
    hidden: s.hidden,
    ffn: s.expertFfn,
    heads: s.heads,
    kvHeads: s.kvHeads,
    headDim: s.headDim,
    vocab: s.vocab,
    contextLength: 4096,
    type: s.type,
    seed: 1,
    experts: s.experts,
    expertsUsed: s.expertsUsed,
    expertFfn: s.expertFfn
  })
  const started = performance.now()
  const w = await Effect.runPromise(
    writeGgufFile(partial, {
      metadata: spec.metadata,
      tensors: spec.tensors.map((t) => (t.name.endsWith("_exps.weight") ? repeatFirstChunk(t) : t))
    })
  )
  renameSync(partial, path)
  console.log(`${(w.bytes / 2 ** 30).toFixed(2)} GiB in ${((performance.now() - started) / 1000).toFixed(0)} s`)
  return path
}

/**
 * The stacked expert tensors: their first chunk of random rows (whole rows, 2^22 values), repeated to fill the tensor.
 * Generating and quantizing every value of the default shape's 7 G expert weights took about 20 CPU-minutes here; the
 * speed of a matrix product does not depend on the values, and every expert still has its own bytes at its own address.
 */
const repeatFirstChunk = (t: GgufTensorSpec): GgufTensorSpec => ({
  ...t,
  data: () => {
    const whole = t.data()
    const first = whole instanceof Uint8Array ? whole : whole[Symbol.iterator]().next().value!
    const total = tensorBytes(t.type, t.dims)
    return (function* () {
      for (let done = 0; done < total; done += first.length)
        yield first.subarray(0, Math.min(first.length, total - done))
    })()
  }
})
