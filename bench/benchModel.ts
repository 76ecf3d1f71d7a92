/**
 * The synthetic llama model every benchmark shares: one file per shape and type under the bench
 * directory (`.cache/bench` by default), written once with a fixed seed and kept.
 */
import { existsSync, mkdirSync } from "node:fs"
import { join } from "node:path"
import { Effect } from "effect"
import { type SyntheticType, writeSyntheticModel } from "../src/layers/gguf/Synthetic.js"

export interface BenchShape {
  readonly layers: number
  readonly hidden: number
  readonly ffn: number
  readonly heads: number
  readonly kvHeads: number
  readonly vocab: number
  readonly type: SyntheticType
}

/** The real-shape default: 16 blocks, hidden 2048, FFN 8192, heads 32/8, vocab 32000, Q8_0. */
export const defaultBenchShape: BenchShape = {
  layers: 16,
  hidden: 2048,
  ffn: 8192,
  heads: 32,
  kvHeads: 8,
  vocab: 32000,
  type: "q8_0"
}

export const benchModelPath = (dir: string, s: BenchShape): string =>
  join(dir, `llama-${s.layers}x${s.hidden}-ffn${s.ffn}-v${s.vocab}-${s.type}.gguf`)

/** The model's path, written first (a few minutes for the full shape) when it is not there yet. */
export const ensureBenchModel = async (dir: string, shape: BenchShape): Promise<string> => {
  const path = benchModelPath(dir, shape)
  if (existsSync(path)) return path
  mkdirSync(dir, { recursive: true })
  process.stdout.write(`writing ${path} (once; it is kept) ... `)
  const s = await Effect.runPromise(
    writeSyntheticModel({ path, arch: "llama", contextLength: 4096, seed: 1, ...shape })
  )
  console.log(`${(s.bytes / 2 ** 20).toFixed(0)} MiB in ${s.seconds.toFixed(1)} s`)
  return path
}
