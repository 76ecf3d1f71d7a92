/**
 * Files written by llama.cpp's own Python writer (gguf-py), shaped as llama.cpp's converter writes a family's released
 * checkpoints (test/support/convertedModels.py): the oracle side of "real converter metadata" tests, never touched by
 * swactor's writer. gguf-py comes from the llama.cpp source node-llama-cpp ships (its gitRelease.bundle, the same
 * release as its libraries), extracted once into .cache/gguf-py.
 */
import { execFileSync } from "node:child_process"
import { existsSync, mkdirSync, rmSync } from "node:fs"
import { join } from "node:path"
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
  | "mistral3"
  | "deepseek2"
  | "gpt-oss"
  | "qwen35"
  | "qwen35moe"

/**
 * Writes `family` to `path` with gguf-py (tokenizer from stories260K.gguf); returns the path. `+fused`: the routed
 * experts' gate and up as one `ffn_gate_up_exps`, as the converter writes with `--fuse-gate-up-exps`.
 */
export const writeConverted = (
  family: ConvertedFamily | `${ConvertedFamily}+fused`,
  path: string,
  seed = 1
): string => {
  execFileSync(
    "python3",
    [
      join(repoRoot, "test", "support", "convertedModels.py"),
      ggufPyDir(),
      family,
      path,
      requireModel("stories260K.gguf"),
      String(seed)
    ],
    { stdio: ["ignore", "ignore", "pipe"] }
  )
  return path
}
