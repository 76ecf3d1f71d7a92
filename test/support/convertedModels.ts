/**
 * Files written by llama.cpp's own Python writer (gguf-py), shaped as llama.cpp's converter writes a family's released
 * checkpoints (test/support/convertedModels.py): the oracle side of "real converter metadata" tests, never touched by
 * swactor's writer. gguf-py comes from the llama.cpp source node-llama-cpp ships (its gitRelease.bundle, the same
 * release as its libraries), extracted once into .cache/gguf-py.
 */
import { execFileSync } from "node:child_process"
import { existsSync, mkdirSync, readdirSync, rmSync } from "node:fs"
import { basename, dirname, join } from "node:path"
import { repoRoot, requireModel } from "./models.js"

const bundle = join(repoRoot, "node_modules", "node-llama-cpp", "llama", "gitRelease.bundle")
const cacheDir = join(repoRoot, ".cache")

/** The gguf-py folder (its `gguf` package inside), extracted from the bundle on first use. */
export const ggufPyDir = (): string => {
  const dir = join(cacheDir, "gguf-py")
  if (existsSync(join(dir, "gguf", "gguf_writer.py"))) return dir
  if (!existsSync(bundle)) throw new Error(`llama.cpp's source bundle is missing at ${bundle} (npm ci first)`)
  mkdirSync(cacheDir, { recursive: true })
  const repo = join(cacheDir, "gguf-py.git")
  rmSync(repo, { recursive: true, force: true })
  rmSync(dir, { recursive: true, force: true })
  execFileSync("git", ["init", "--quiet", "--bare", repo])
  execFileSync("git", ["--git-dir", repo, "fetch", "--quiet", bundle, "HEAD"])
  const archive = execFileSync("git", ["--git-dir", repo, "archive", "FETCH_HEAD", "gguf-py"], {
    maxBuffer: 64 << 20
  })
  execFileSync("tar", ["-x", "-C", cacheDir], { input: archive })
  rmSync(repo, { recursive: true, force: true })
  if (!existsSync(join(dir, "gguf", "gguf_writer.py"))) throw new Error(`no gguf-py in ${bundle}`)
  return dir
}

/** Converter-shaped families convertedModels.py writes. */
export type ConvertedFamily =
  | "glm4moe"
  | "llama"
  | "qwen2"
  | "qwen3"
  | "qwen3moe"
  | "gemma3"
  | "gemma4"
  | "gemma4-moe"
  | "gemma4-e2b"
  | "minimax-m2"
  | "olmo2"
  | "olmo3"
  | "mistral3"
  | "deepseek2"
  | "deepseek32"
  | "deepseek32-wide"
  | "glm-dsa"
  | "glm-dsa-shared"
  | "deepseek4"
  | "deepseek4-hash3"
  | "kimi-k3"
  | "gpt-oss"
  | "qwen35"
  | "qwen35moe"

/** How writeConverted cuts a split set (convertedModels.py's SPLIT). */
export interface SplitSpec {
  /** gguf-py's own cut: at most this many tensors a part. */
  readonly maxTensors?: number
  /** Tensor names that start a new part (e.g. "blk.2.attn_norm.weight": a part from there). */
  readonly cuts?: ReadonlyArray<string>
  /** A first part with the metadata only. */
  readonly smallFirst?: boolean
}

/**
 * Writes `family` to `path` with gguf-py (tokenizer from stories260K.gguf); returns the path. `+q8_0`: matrices whose
 * rows are whole Q8_0 blocks in Q8_0. `+fused`: the routed
 * experts' gate and up as one `ffn_gate_up_exps`, as the converter writes with `--fuse-gate-up-exps`. With `split`,
 * writes a split set beside `path` (`<stem>-00001-of-0000N.gguf` …) and returns every part's path, first first.
 */
export function writeConverted(
  family: ConvertedFamily | `${ConvertedFamily}+${"fused" | "q8_0"}`,
  path: string,
  seed?: number
): string
export function writeConverted(
  family: ConvertedFamily | `${ConvertedFamily}+${"fused" | "q8_0"}`,
  path: string,
  seed: number,
  split: SplitSpec
): ReadonlyArray<string>
export function writeConverted(
  family: ConvertedFamily | `${ConvertedFamily}+${"fused" | "q8_0"}`,
  path: string,
  seed = 1,
  split?: SplitSpec
): string | ReadonlyArray<string> {
  const stem = basename(path).replace(/\.gguf$/, "")
  const isPart = (name: string) => name.startsWith(stem) && /^-\d{5}-of-\d{5}\.gguf$/.test(name.slice(stem.length))
  if (split !== undefined) {
    for (const name of readdirSync(dirname(path))) if (isPart(name)) rmSync(join(dirname(path), name))
  }
  execFileSync(
    "python3",
    [
      join(repoRoot, "test", "support", "convertedModels.py"),
      ggufPyDir(),
      family,
      path,
      requireModel("stories260K.gguf"),
      String(seed),
      ...(split === undefined ? [] : [JSON.stringify(split)])
    ],
    { stdio: ["ignore", "ignore", "pipe"] }
  )
  if (split === undefined) return path
  const parts = readdirSync(dirname(path))
    .filter(isPart)
    .sort()
    .map((name) => join(dirname(path), name))
  if (parts.length < 2) throw new Error(`gguf-py wrote ${parts.length} part(s) for ${path}, not a split set`)
  return parts
}
