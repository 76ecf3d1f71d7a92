/**
 * Start-up benchmark (not a test): launch → first token of `swactor run` as a user starts it (a fresh
 * `node dist/main.js run` process (the bin: the bundle with its code cache), local agents), beside node-llama-cpp's launch → load → first token in one fresh
 * process, on the same file. Configurations: stories260K with 1 and 3 stages, and the synthetic 16×2048 Q8_0 llama
 * (cached under .cache/bench with bench:engine / bench:pipeline) with 1 and 4 stages.
 *
 *   npm run bench:startup
 *
 * Settings (environment): BENCH_ONLY (all | stories | synthetic), BENCH_ROUNDS (3: configurations interleaved, the
 * best round counts), BENCH_THREADS (1), BENCH_DIR (.cache/bench), SWACTOR_MODELS_DIR (../shared/models).
 * Prints, per configuration, the launch → first token time seen from outside, swactor's own phase split (process,
 * checks, spawn, pool, load, prefill) and the ratio to node-llama-cpp.
 */
import { spawn } from "node:child_process"
import { existsSync, mkdirSync, writeFileSync } from "node:fs"
import { availableParallelism, loadavg } from "node:os"
import { dirname, join, resolve } from "node:path"
import { fileURLToPath } from "node:url"
import { benchModelPath, defaultBenchShape, ensureBenchModel } from "./benchModel.js"

const env = (k: string, d: string) => process.env[k] ?? d
const root = resolve(dirname(fileURLToPath(import.meta.url)), "..")
const only = env("BENCH_ONLY", "all")
const rounds = Number(env("BENCH_ROUNDS", "3"))
const threads = Number(env("BENCH_THREADS", "1"))
const benchDir = resolve(root, env("BENCH_DIR", ".cache/bench"))
const modelsDir = resolve(root, env("SWACTOR_MODELS_DIR", "../shared/models"))
const main = join(root, "dist", "main.js")
const prompt = "Once upon a time"

// Same file and shape as bench:engine / bench:pipeline, so the cached model is shared.
const syntheticPath = benchModelPath(benchDir, defaultBenchShape)
const ensureSynthetic = () => ensureBenchModel(benchDir, defaultBenchShape)

interface Measured {
  readonly firstTokenMs: number
  readonly detail: string
}

/** Runs `node args`; resolves at exit with the time of the first stdout byte after launch and the output. */
const launch = (args: ReadonlyArray<string>) =>
  new Promise<{ firstOutputMs: number; stdout: string; stderr: string; code: number | null }>(
    (resolvePromise, reject) => {
      const started = performance.now()
      const child = spawn(process.execPath, args, { cwd: root, stdio: ["ignore", "pipe", "pipe"] })
      let firstOutputMs = Number.NaN
      let stdout = ""
      let stderr = ""
      child.stdout.on("data", (chunk) => {
        if (Number.isNaN(firstOutputMs)) firstOutputMs = performance.now() - started
        stdout += chunk
      })
      child.stderr.on("data", (chunk) => (stderr += chunk))
      child.on("error", reject)
      child.on("exit", (code) => resolvePromise({ firstOutputMs, stdout, stderr, code }))
    }
  )

/** `swactor run` as the CLI: the first stdout byte is the prompt written with the first token. */
const swactorRun = async (model: string, stages: number): Promise<Measured> => {
  const ran = await launch([
    main,
    "run",
    "--model",
    model,
    "--stages",
    String(stages),
    "--max-tokens",
    "1",
    "--threads",
    String(threads),
    "--prompt",
    prompt
  ])
  if (ran.code !== 0) throw new Error(`swactor run exited ${ran.code}: ${ran.stderr}`)
  const phases = /start-up .*$/m.exec(ran.stderr)?.[0] ?? "(no phase line)"
  return { firstTokenMs: ran.firstOutputMs, detail: phases }
}

/** node-llama-cpp in one fresh process: import, load (CPU), context, BOS + prompt, first greedy token. */
const referenceScript = (model: string) => `
const t0 = performance.now()
const { getLlama, LlamaLogLevel } = await import("node-llama-cpp")
const llama = await getLlama({ gpu: false, build: "never", logLevel: LlamaLogLevel.error })
const t1 = performance.now()
const model = await llama.loadModel({ modelPath: ${JSON.stringify(model)}, gpuLayers: 0 })
const ctx = await model.createContext({ contextSize: 512, threads: ${threads}, sequences: 1 })
const t2 = performance.now()
const seq = ctx.getSequence()
const bos = model.tokens.bos
for await (const token of seq.evaluate([...(bos !== null ? [bos] : []), ...model.tokenize(${JSON.stringify(prompt)})], { temperature: 0 })) {
  process.stdout.write("token " + token + " in-process: import " + (t1 - t0).toFixed(0) + " ms, load+context " + (t2 - t1).toFixed(0) + " ms, first token " + (performance.now() - t2).toFixed(0) + " ms\\n")
  break
}
process.exit(0)
`

const reference = async (model: string): Promise<Measured> => {
  // A file, not `node -e`: node-llama-cpp tests its binary in a child started with this process's arguments.
  // Inside the repository, so that `import "node-llama-cpp"` resolves (BENCH_DIR may be elsewhere).
  mkdirSync(join(root, ".cache"), { recursive: true })
  const script = join(root, ".cache", "startup-reference.mjs")
  writeFileSync(script, referenceScript(model))
  const ran = await launch([script])
  if (ran.code !== 0) throw new Error(`node-llama-cpp reference exited ${ran.code}: ${ran.stderr}`)
  return { firstTokenMs: ran.firstOutputMs, detail: ran.stdout.trim() }
}

interface Config {
  readonly name: string
  readonly model: () => string
  readonly stages: ReadonlyArray<number>
}

const configs: ReadonlyArray<Config> = [
  ...(only === "all" || only === "stories"
    ? [{ name: "stories260K", model: () => join(modelsDir, "stories260K.gguf"), stages: [1, 3] }]
    : []),
  ...(only === "all" || only === "synthetic"
    ? [{ name: "16x2048 Q8_0", model: () => syntheticPath, stages: [1, 4] }]
    : [])
]

const best = new Map<string, Measured>()
const keep = (key: string, m: Measured) => {
  const previous = best.get(key)
  if (previous === undefined || m.firstTokenMs < previous.firstTokenMs) best.set(key, m)
}

if (!existsSync(main)) throw new Error(`${main} is missing: npm run build first`)
if (configs.some((c) => c.name !== "stories260K")) await ensureSynthetic()
// The figures are only as quiet as the machine: its load average is printed beside them.
const load = () =>
  loadavg()
    .map((l) => l.toFixed(2))
    .join(" ")
console.log(
  `start-up: launch → first token, best of ${rounds} rounds, ${threads} thread(s) per stage; ` +
    `${availableParallelism()} cores, load average ${load()} before`
)
for (let round = 0; round < rounds; round++) {
  for (const config of configs) {
    keep(`${config.name} node-llama-cpp`, await reference(config.model()))
    for (const stages of config.stages)
      keep(`${config.name} swactor ${stages}`, await swactorRun(config.model(), stages))
  }
}
for (const config of configs) {
  const ref = best.get(`${config.name} node-llama-cpp`)!
  console.log(`\n${config.name}`)
  console.log(`  node-llama-cpp, one process: ${ref.firstTokenMs.toFixed(0)} ms (${ref.detail})`)
  for (const stages of config.stages) {
    const m = best.get(`${config.name} swactor ${stages}`)!
    console.log(
      `  swactor run, ${stages} stage${stages === 1 ? "" : "s"}: ${m.firstTokenMs.toFixed(0)} ms ` +
        `(${(m.firstTokenMs / ref.firstTokenMs).toFixed(2)}x node-llama-cpp) ${m.detail}`
    )
  }
}
console.log(`\nload average ${load()} after`)
