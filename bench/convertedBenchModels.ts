/**
 * Mid-size files written by llama.cpp's own gguf-py (bench/dsaModel.py) for families swactor's synthetic writer cannot
 * write: deepseek32 (DeepSeek-V3.2) and glm-dsa (GLM-5) with DeepSeek-V3.2's proportions scaled to hidden 1024, and
 * minimax-m2. One file per family and indexer top-k under the bench directory, written once with a fixed seed and kept.
 */
import { execFileSync } from "node:child_process"
import { existsSync, mkdirSync, renameSync, statSync } from "node:fs"
import { dirname, join } from "node:path"
import { fileURLToPath } from "node:url"
import { ggufPyDir } from "../test/support/convertedModels.js"
import { requireModel } from "../test/support/models.js"

export type ConvertedBenchFamily = "deepseek32" | "glm-dsa" | "minimax-m2"

export const convertedBenchFamilies: ReadonlyArray<ConvertedBenchFamily> = ["deepseek32", "glm-dsa", "minimax-m2"]

/** Transformer blocks the engine runs (deepseek32 and glm-dsa: the MTP block the converter appends is left out). */
export const convertedBenchBlocks = (family: ConvertedBenchFamily): number => (family === "minimax-m2" ? 3 : 2)

/** A row label's shape (bench/dsaModel.py's). */
export const convertedBenchShape = (family: ConvertedBenchFamily): string =>
  family === "minimax-m2"
    ? "3x1024 heads 8/2 of 128, 16 experts of 512 (4 used), vocab 512, f16"
    : "2x1024 (+MTP) heads 16, kv_lora 512, indexer 16x128 top-k 2048, 1 dense + 1 routed block, vocab 512, f16"

/** The file's path, written first (gguf-py, seconds) when it is not there yet. */
export const ensureConvertedBenchModel = (dir: string, family: ConvertedBenchFamily, topK = 2048): string => {
  const path = join(dir, `converted-${family}${family === "minimax-m2" ? "" : `-topk${topK}`}-1024-f16.gguf`)
  if (existsSync(path)) return path
  mkdirSync(dir, { recursive: true })
  process.stdout.write(`writing ${path} with gguf-py (once; it is kept) ... `)
  const script = join(dirname(fileURLToPath(import.meta.url)), "dsaModel.py")
  const partial = `${path}.partial`
  execFileSync("python3", [script, ggufPyDir(), family, partial, requireModel("stories260K.gguf"), String(topK), "1"], {
    stdio: ["ignore", "ignore", "inherit"]
  })
  renameSync(partial, path)
  console.log(`${(statSync(path).size / 2 ** 20).toFixed(0)} MiB`)
  return path
}
