/**
 * GPU decode benchmark (issue 42; not a test): swactor's one GPU stage against node-llama-cpp's GPU build on the same
 * synthetic llama, the same prompt, context and token count, in the same run. scripts/device-check.sh runs it.
 *
 *   npx tsx bench/gpuDecode.ts --backend cuda                 # a 7B-class llama (32 x 4096, FFN 11008, Q4_0)
 *   npx tsx bench/gpuDecode.ts --backend vulkan --size small  # 4 x 256: a rehearsal on lavapipe (a CPU)
 *   npx tsx bench/gpuDecode.ts --size 7b --prepare            # only write the model (the script overlaps it)
 *
 * The model is written once by `swactor synth` (seed 1, its command run in this process) into BENCH_GPU_DIR (default
 * the system's temporary folder, swactor-gpu-decode/) and reused while its file is there. node-llama-cpp
 * (bench/gpuDecodeReference.mjs, a process of its own) runs with every block and the head on the device (gpuLayers
 * max), flash attention, F16 KV; swactor runs `swactor run --stages 1 --backend B --json` (the same settings are its
 * own). Both greedy, the same thread count (every core). --rounds rounds (3; 5 for small), each a fresh process of each
 * side, alternating, so a change in the machine's load hits both; the best of each counts. Decode tok/s is the tokens
 * after the first over the time from the first token to the last, as swactor's run summary counts it. Prints one line
 * with both rates and ours / theirs, and exits 1 when the ratio is under --min-ratio (0.9). Also says whether the two
 * greedy streams are the same (not a condition: the parity tests are test/gpu, run by the same script).
 */
import { Effect, Exit } from "effect"
import { execFile } from "node:child_process"
import { existsSync, mkdirSync, renameSync, statSync } from "node:fs"
import { availableParallelism, tmpdir } from "node:os"
import { dirname, join, resolve } from "node:path"
import { fileURLToPath } from "node:url"
import { promisify } from "node:util"
import { runSynthCli } from "../test/support/synthCli.js"

const exec = promisify(execFile)
const root = resolve(dirname(fileURLToPath(import.meta.url)), "..")
const main = join(root, "dist", "main.js")
const PROMPT = "Once upon a time"

interface Size {
  readonly layers: number
  readonly hidden: number
  readonly ffn: number
  readonly heads: number
  readonly vocab: number
  readonly type: string
  readonly context: number
  readonly tokens: number
}

/** 7b: Llama-2-7B's shape in Q4_0 (3.6 GiB); small: a file lavapipe decodes at a few tokens a second. */
const sizes: Readonly<Record<string, Size>> = {
  "7b": { layers: 32, hidden: 4096, ffn: 11008, heads: 32, vocab: 32000, type: "q4_0", context: 2048, tokens: 128 },
  small: { layers: 4, hidden: 256, ffn: 768, heads: 4, vocab: 32000, type: "q4_0", context: 512, tokens: 32 }
}

const flag = (name: string, fallback: string): string => {
  const at = process.argv.indexOf(`--${name}`)
  return at >= 0 && at + 1 < process.argv.length ? process.argv[at + 1]! : fallback
}

const backend = flag("backend", "cuda")
const sizeName = flag("size", "7b")
const size = sizes[sizeName]
if (size === undefined) throw new Error(`--size ${sizeName}: expected ${Object.keys(sizes).join(" or ")}`)
const tokens = Number(flag("tokens", String(size.tokens)))
const rounds = Number(flag("rounds", sizeName === "small" ? "5" : "3"))
const minRatio = Number(flag("min-ratio", "0.9"))
const threads = availableParallelism()
const dir = resolve(process.env["BENCH_GPU_DIR"] ?? join(tmpdir(), "swactor-gpu-decode"))
const modelPath = join(
  dir,
  `llama-${size.layers}x${size.hidden}-ffn${size.ffn}-v${size.vocab}-c${size.context}-${size.type}.gguf`
)

const seconds = (since: number) => ((performance.now() - since) / 1000).toFixed(1)

/** Writes the model unless its file is there (written to a .partial name first, so a killed write is not reused). */
const ensureModel = async (): Promise<void> => {
  if (existsSync(modelPath)) {
    console.log(`model ${modelPath} (${(statSync(modelPath).size / 2 ** 30).toFixed(2)} GiB), already written`)
    return
  }
  mkdirSync(dir, { recursive: true })
  const start = performance.now()
  const partial = `${modelPath}.partial`
  const shape = ["--layers", size.layers, "--hidden", size.hidden, "--ffn", size.ffn, "--heads", size.heads]
  const file = ["--vocab", size.vocab, "--context-length", size.context, "--type", size.type, "--seed", 1]
  // in this process (the CLI's own command through tsx), not dist/: the check's test run rebuilds dist/ meanwhile
  const exit = await Effect.runPromise(
    runSynthCli(["--arch", "llama", ...[...shape, ...file].map(String), "-o", partial])
  )
  if (!Exit.isSuccess(exit)) throw new Error(`swactor synth ${modelPath}: ${String(exit)}`)
  renameSync(partial, modelPath)
  const gib = statSync(modelPath).size / 2 ** 30
  console.log(`model ${modelPath} (${gib.toFixed(2)} GiB) written in ${seconds(start)} s by swactor synth`)
}

interface Measured {
  readonly tokens: ReadonlyArray<number>
  readonly decodeTokensPerSecond: number
}

const nodeLlamaCpp = async (): Promise<Measured> => {
  const script = join(root, "bench", "gpuDecodeReference.mjs")
  const args = [backend, modelPath, PROMPT, tokens, size.context, threads, 1].map(String)
  const { stdout } = await exec(process.execPath, [script, ...args], { cwd: root, maxBuffer: 1 << 26 })
  const out = JSON.parse(stdout.trim().split("\n").at(-1)!) as Measured & { gpu: string | false; loadMillis: number }
  if (out.gpu !== backend) throw new Error(`node-llama-cpp ran on ${String(out.gpu)}, not ${backend}`)
  return out
}

const swactorOnce = async (): Promise<Measured> => {
  const args = ["run", "--model", modelPath, "--prompt", PROMPT, "--max-tokens", String(tokens)]
  const rest = ["--threads", String(threads), "--stages", "1", "--backend", backend, "--json"]
  const { stdout } = await exec(process.execPath, [main, ...args, ...rest], { cwd: root, maxBuffer: 1 << 26 })
  const out = JSON.parse(stdout.trim().split("\n").at(-1)!) as {
    tokens: Array<{ id: number }>
    summary: { decodeTokensPerSecond: number; stages: Array<{ backend?: string }> }
  }
  const where = out.summary.stages.map((s) => s.backend).join(",")
  if (where !== backend) throw new Error(`swactor's stage computed on ${where}, not ${backend}`)
  return { tokens: out.tokens.map((t) => t.id), decodeTokensPerSecond: out.summary.decodeTokensPerSecond }
}

const faster = (a: Measured | undefined, b: Measured) =>
  a === undefined || b.decodeTokensPerSecond > a.decodeTokensPerSecond ? b : a

/** Rounds alternate between the two (each a fresh process), so a change in the machine's load hits both alike. */
const alternating = async () => {
  let theirs: Measured | undefined
  let ours: Measured | undefined
  for (let r = 0; r < rounds; r++) {
    let start = performance.now()
    const t = await nodeLlamaCpp()
    const tookTheirs = seconds(start)
    start = performance.now()
    const o = await swactorOnce()
    console.log(
      `round ${r + 1}: node-llama-cpp ${t.decodeTokensPerSecond.toFixed(2)} tok/s (${tookTheirs} s with its load), ` +
        `swactor ${o.decodeTokensPerSecond.toFixed(2)} tok/s (${seconds(start)} s with its start and load)`
    )
    theirs = faster(theirs, t)
    ours = faster(ours, o)
  }
  return { theirs: theirs!, ours: ours! }
}

const sameStream = (a: ReadonlyArray<number>, b: ReadonlyArray<number>): string => {
  const at = a.findIndex((t, i) => t !== b[i])
  if (at < 0 && a.length === b.length) return "the same greedy tokens"
  return `greedy tokens differ from token ${at < 0 ? Math.min(a.length, b.length) : at}`
}

const benchmark = async () => {
  await ensureModel()
  if (process.argv.includes("--prepare")) return 0
  const { theirs, ours } = await alternating()
  const ratio = ours.decodeTokensPerSecond / theirs.decodeTokensPerSecond
  const pass = ratio >= minRatio
  console.log(
    `gpu decode ${backend} ${sizeName} (${size.layers}x${size.hidden} ${size.type}, ${tokens} tokens, context ` +
      `${size.context}, ${threads} threads): swactor ${ours.decodeTokensPerSecond.toFixed(2)} tok/s, node-llama-cpp ` +
      `${theirs.decodeTokensPerSecond.toFixed(2)} tok/s, ratio ${ratio.toFixed(3)} (needs >= ${minRatio}): ` +
      `${pass ? "pass" : "FAIL"}; ${sameStream(ours.tokens, theirs.tokens)}`
  )
  return pass ? 0 : 1
}

process.exitCode = await benchmark()
