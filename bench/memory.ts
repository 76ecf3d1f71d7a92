/**
 * bench:memory — resident memory of each stage process of a warm swactor pipeline through load, settle and serving,
 * as ratios to what it holds (its weights, its KV cache), beside node-llama-cpp (in a child process of its own) and,
 * given a path, llama.cpp's llama-server on the same file with the same context and threads. Prints figures; asserts
 * nothing.
 *
 *   npm run bench:memory
 *   npm run bench:memory -- --llama-server /path/to/llama-server --stages 3 --tokens 64
 *
 * swactor: the `Server` of `swactor serve` (bench:serve's way: the orchestrator in this process, one agent process
 * per stage). Its set-up run loads every stage ("load"); round 1 is the pipeline's second run, so each stage moves its
 * mapped weights to huge-page memory 1.5 s into it (NativeWeights.moveOutOfMapping; SWACTOR_MMAP_MOVE=1 forces the
 * move on the first run, =0 never moves): the phase "round 1 + settle" lasts until no agent maps the model file any
 * more; the later rounds are settled serving. node-llama-cpp and llama-server: load, round 1, the later rounds.
 * Each round: `clients` concurrent greedy requests of `tokens` tokens each (token-id prompts).
 *
 * Figures, per process, from /proc/PID/status: VmHWM (the kernel's peak; reset through /proc/PID/clear_refs at each
 * phase's start, so each phase has its own and the peak is the largest of them), VmRSS sampled every `sample-ms` on a
 * worker thread (its highest reading per phase, split into RssAnon / RssFile / RssShmem), and the steady VmRSS,
 * read halfway through the last round's decode (settled, sequences live). A process's RSS includes Node/V8's own
 * baseline: an idle agent (started as a stage agent is, loading nothing) and an idle node-llama-cpp process (after
 * getLlama, no model) are measured too, and the ratios are printed again with that baseline subtracted.
 *
 * Weights: a stage's GGUF tensor bytes (StageInfo.weightBytes, from StageLayout); KV: the KV cache of the round's
 * sequences, clients x context x kvBytesPerToken (StageInfo: F16 K and V of the stage's blocks), the whole model's for
 * the references (which get the same total context and sequences). Compute buffers: the planner's reserve per stage
 * (Placement.computeReserveBytes) for swactor; what llama.cpp logs ("compute buffer size") for the references.
 *
 * Flags (or env): --model FILE (default the synthetic llama the benches share, written once under BENCH_DIR,
 * .cache/bench; its shape: --layers 16 --hidden 2048 --ffn 8192 --heads 32 --kv-heads 8 --vocab 32000 --type q8_0,
 * BENCH_LAYERS ...), --stages 2 (BENCH_STAGES), --threads 1 per stage (BENCH_THREADS), --ref-threads (BENCH_REF_THREADS,
 * default stages x threads), --clients 2 (BENCH_CLIENTS), --tokens 32 (BENCH_TOKENS), --rounds 2 (BENCH_ROUNDS, at least
 * 2), --context N (BENCH_CONTEXT: cells per sequence; the prompt is made long enough that swactor sizes each request's
 * KV so, ceil((prompt + tokens + 1) / 256) * 256; default: a 16-token prompt), --sample-ms 20 (BENCH_SAMPLE_MS),
 * --settle-timeout 180 s (BENCH_SETTLE_TIMEOUT), --skip-ref, --llama-server PATH (BENCH_LLAMA_SERVER or LLAMA_SERVER).
 */
import { spawn, type ChildProcess } from "node:child_process"
import { mkdirSync, realpathSync, writeFileSync } from "node:fs"
import { dirname, join, resolve } from "node:path"
import { createInterface } from "node:readline"
import { fileURLToPath } from "node:url"
import { Effect, Layer, ManagedRuntime, Stream } from "effect"
import { serve, Server } from "../src/api/serve.js"
import { generateToken, type LocalAgent, spawnLocalAgents } from "../src/layers/agent/AgentProcesses.js"
import type { SyntheticType } from "../src/layers/gguf/Synthetic.js"
import { runContextLength } from "../src/layers/orchestrator/RunWorld.js"
import { computeReserveBytes } from "../src/services/Placement.js"
import { defaultBenchShape, ensureBenchModel } from "./benchModel.js"
import { forEachStreamedToken } from "./llamaServerStream.js"
import { modelHoldings } from "./stageHoldings.js"
import {
  mapsFile,
  type MemStatus,
  type PhaseFigures,
  phaseTracker,
  type PhaseTracker,
  readStatus,
  type Sampler,
  startSampler
} from "./procMemory.js"

const root = resolve(dirname(fileURLToPath(import.meta.url)), "..")
const flag = (name: string): string | undefined => {
  const at = process.argv.indexOf(`--${name}`)
  return at >= 0 ? process.argv[at + 1] : undefined
}
const setting = (name: string, env: string, fallback: string) => flag(name) ?? process.env[env] ?? fallback
const numberSetting = (name: string, env: string, fallback: number) => Number(setting(name, env, String(fallback)))

const stages = numberSetting("stages", "BENCH_STAGES", 2)
const threads = numberSetting("threads", "BENCH_THREADS", 1)
const cfg = {
  stages,
  threads,
  refThreads: numberSetting("ref-threads", "BENCH_REF_THREADS", stages * threads),
  clients: numberSetting("clients", "BENCH_CLIENTS", 2),
  tokens: numberSetting("tokens", "BENCH_TOKENS", 32),
  rounds: Math.max(2, numberSetting("rounds", "BENCH_ROUNDS", 2)),
  context: flag("context") ?? process.env["BENCH_CONTEXT"],
  sampleMs: numberSetting("sample-ms", "BENCH_SAMPLE_MS", 20),
  settleTimeoutS: numberSetting("settle-timeout", "BENCH_SETTLE_TIMEOUT", 180),
  skipRef: process.argv.includes("--skip-ref"),
  llamaServer: flag("llama-server") ?? process.env["BENCH_LLAMA_SERVER"] ?? process.env["LLAMA_SERVER"],
  dir: resolve(root, process.env["BENCH_DIR"] ?? ".cache/bench"),
  shape: {
    layers: numberSetting("layers", "BENCH_LAYERS", defaultBenchShape.layers),
    hidden: numberSetting("hidden", "BENCH_HIDDEN", defaultBenchShape.hidden),
    ffn: numberSetting("ffn", "BENCH_FFN", defaultBenchShape.ffn),
    heads: numberSetting("heads", "BENCH_HEADS", defaultBenchShape.heads),
    kvHeads: numberSetting("kv-heads", "BENCH_KV_HEADS", defaultBenchShape.kvHeads),
    vocab: numberSetting("vocab", "BENCH_VOCAB", defaultBenchShape.vocab),
    type: setting("type", "BENCH_TYPE", defaultBenchShape.type) as SyntheticType
  }
}

const MiB = 2 ** 20
const mib = (b: number) => (Number.isFinite(b) ? (b / MiB).toFixed(0) : "-")
const ratio = (a: number, b: number) => (Number.isFinite(a) && Number.isFinite(b) && b > 0 ? (a / b).toFixed(2) : "-")
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms))

/** One process's figures, as the table prints them. */
interface ProcessResult {
  readonly name: string
  readonly pid: number
  readonly phases: ReadonlyArray<PhaseFigures>
  readonly steady: MemStatus | undefined
  readonly weights: number
  readonly kv: number
  readonly compute: { readonly bytes: number; readonly source: string } | undefined
  /** The baseline subtracted in the "- base" columns (an idle process of its kind); undefined: none. */
  readonly base: { readonly bytes: number; readonly name: string } | undefined
  readonly note?: string
}

/**
 * A phase's peak: its VmHWM, or the sampler's highest VmRSS where that is higher (the kernel's RSS counters are
 * approximate, batched per CPU, so the two can differ by a little either way).
 */
const phasePeak = (p: PhaseFigures) => Math.max(...[p.hwm, p.sampled?.rss ?? Number.NaN].filter(Number.isFinite))
const peakOf = (phases: ReadonlyArray<PhaseFigures>) => Math.max(...phases.map(phasePeak))

/** Line events ({"event": ...} JSON) of a child's stdout, awaited one kind at a time; rejects when it exits. */
const childEvents = (child: ChildProcess, what: string) => {
  const queue: Array<Record<string, unknown>> = []
  const waiters: Array<() => void> = []
  let exited: string | undefined
  let stderr = ""
  child.stderr?.on("data", (chunk) => (stderr = (stderr + String(chunk)).slice(-4000)))
  createInterface({ input: child.stdout! }).on("line", (line) => {
    if (!line.startsWith("{")) return
    queue.push(JSON.parse(line) as Record<string, unknown>)
    waiters.splice(0).forEach((w) => w())
  })
  child.on("exit", (code, signal) => {
    exited = `${what} exited (${signal ?? `code ${code}`}): ${stderr.trim().split("\n").slice(-5).join(" | ")}`
    waiters.splice(0).forEach((w) => w())
  })
  const next = async (event: string): Promise<Record<string, unknown>> => {
    for (;;) {
      const at = queue.findIndex((e) => e["event"] === event)
      if (at >= 0) return queue.splice(at, 1)[0]!
      if (exited !== undefined) throw new Error(exited)
      await new Promise<void>((r) => waiters.push(r))
    }
  }
  return { next, stderr: () => stderr }
}

/**
 * llama.cpp's own buffer lines ("llama_kv_cache: CPU KV buffer size = 16.00 MiB"): per kind (model, KV, compute) the
 * sum over its buffers, each buffer's last line counting (a buffer reserved again is logged again).
 */
const llamaCppBuffers = (lines: ReadonlyArray<string>) => {
  const last = new Map<string, { kind: string; bytes: number }>()
  for (const line of lines) {
    const m = /([\w.]+)\s+(model|KV|compute) buffer size\s*=\s*([\d.]+) MiB/.exec(line)
    if (m !== null) last.set(`${m[1]} ${m[2]}`, { kind: m[2]!, bytes: Number(m[3]) * MiB })
  }
  const sum = (kind: string) =>
    [...last.values()]
      .filter((b) => b.kind === kind)
      .reduce((a, b) => (Number.isNaN(a) ? b.bytes : a + b.bytes), Number.NaN)
  return { model: sum("model"), kv: sum("KV"), compute: sum("compute") }
}

// --- the node-llama-cpp reference: a child process of its own ------------------------------------------------------

/** load (or only getLlama when idle), then one round per "round" line on stdin; "exit" ends it. */
const referenceScript = `
import { createInterface } from "node:readline"
const cfg = JSON.parse(process.argv[2])
const say = (o) => process.stdout.write(JSON.stringify(o) + "\\n")
const commands = createInterface({ input: process.stdin })[Symbol.asyncIterator]()
const command = async () => (await commands.next()).value ?? "exit"
const { getLlama, LlamaLogLevel } = await import("node-llama-cpp")
const llama = await getLlama({
  gpu: false, build: "never", logLevel: LlamaLogLevel.info,
  logger: (_level, message) => { if (/buffer size/.test(message)) say({ event: "log", line: message.trim() }) }
})
if (cfg.idle) {
  say({ event: "loaded" })
  await command()
  process.exit(0)
}
const model = await llama.loadModel({ modelPath: cfg.model, gpuLayers: 0 })
const context = await model.createContext({
  contextSize: cfg.contextSize, sequences: cfg.prompts.length, threads: cfg.threads, flashAttention: true
})
say({ event: "loaded", contextSize: context.contextSize, batchSize: context.batchSize })
while ((await command()) === "round") {
  let tokens = 0
  await Promise.all(cfg.prompts.map(async (prompt, i) => {
    const sequence = context.getSequence()
    let n = 0
    for await (const token of sequence.evaluate(prompt, { temperature: 0 })) {
      n++
      if (i === 0 && n === Math.ceil(cfg.tokens / 2)) say({ event: "mid" })
      if (n >= cfg.tokens || model.isEogToken(token)) break
    }
    if (i === 0 && n < Math.ceil(cfg.tokens / 2)) say({ event: "mid" })
    tokens += n
    await sequence.dispose()
  }))
  say({ event: "round", tokens })
}
process.exit(0)
`

const startReference = (args: object) => {
  // A file inside the repository, not `node -e`: node-llama-cpp tests its binary in a child started with this
  // process's arguments, and `import "node-llama-cpp"` must resolve (as bench:startup does).
  mkdirSync(join(root, ".cache"), { recursive: true })
  const script = join(root, ".cache", "memory-reference.mjs")
  writeFileSync(script, referenceScript)
  const child = spawn(process.execPath, [script, JSON.stringify(args)], { cwd: root, stdio: ["pipe", "pipe", "pipe"] })
  return { child, events: childEvents(child, "node-llama-cpp reference") }
}

// --- the run ------------------------------------------------------------------------------------------------------

interface Plan {
  readonly model: string
  /** Cells per sequence (what swactor allocates per request). */
  readonly contextPerSequence: number
  /** Each client's prompt (token ids, BOS first). */
  readonly prompts: ReadonlyArray<ReadonlyArray<number>>
}

/** An idle process's reading with the median VmRSS of 3 s of readings every 100 ms (V8's heap comes and goes). */
const idleStatus = async (pid: number): Promise<MemStatus | undefined> => {
  const readings: Array<MemStatus> = []
  for (let i = 0; i < 30; i++) {
    await sleep(100)
    const s = readStatus(pid)
    if (s !== undefined) readings.push(s)
  }
  return readings.sort((a, b) => a.rss - b.rss)[Math.floor(readings.length / 2)]
}

/** Idle baselines: an agent as stages are started, loading nothing; node-llama-cpp after getLlama, no model. */
const idleBaselines = async (sampler: Sampler) => {
  const tracker = phaseTracker(sampler)
  const refTracker = phaseTracker(sampler)
  const agent = await Effect.runPromise(
    Effect.scoped(
      Effect.gen(function* () {
        const [one] = yield* spawnLocalAgents({ count: 1, token: generateToken(), threads: cfg.threads })
        tracker.track([one!.pid])
        const status = yield* Effect.promise(() => idleStatus(one!.pid))
        yield* Effect.promise(() => tracker.cut("idle 3 s"))
        return { pid: one!.pid, status }
      })
    )
  )
  const ref = startReference({ idle: true })
  refTracker.track([ref.child.pid!])
  await ref.events.next("loaded")
  const refStatus = await idleStatus(ref.child.pid!)
  await refTracker.cut("idle 3 s")
  ref.child.stdin!.end("exit\n")
  return {
    agent: { ...agent, phases: tracker.phases(agent.pid) },
    reference: { pid: ref.child.pid!, status: refStatus, phases: refTracker.phases(ref.child.pid!) },
    resetsWorked: tracker.resetsWorked && refTracker.resetsWorked
  }
}

const swactorRun = async (plan: Plan, tracker: PhaseTracker) => {
  let agents: ReadonlyArray<LocalAgent> = []
  const layer = serve({
    model: plan.model,
    stages: cfg.stages,
    threads: cfg.threads,
    parallel: cfg.clients,
    local: {
      onStarted: (started) => {
        agents = started
        tracker.track(started.map((a) => a.pid))
      }
    }
  })
  const runtime = ManagedRuntime.make(layer as Layer.Layer<Server>)
  const mappedAtLoad = new Map<number, boolean>()
  let settleSeconds = Number.NaN
  let steady = new Map<number, MemStatus | undefined>()
  const tokensPerRound: Array<number> = []
  try {
    const t0 = performance.now()
    await runtime.runPromise(Effect.flatMap(Server, (s) => s.ready))
    console.log(
      `  swactor: pipeline ready in ${((performance.now() - t0) / 1000).toFixed(1)} s (agents ${agents.map((a) => a.pid).join(", ")})`
    )
    for (const a of agents) mappedAtLoad.set(a.pid, mapsFile(a.pid, plan.model))
    await tracker.cut("load")
    const round = (onMid?: () => void) =>
      runtime
        .runPromise(
          Effect.flatMap(Server, (server) =>
            Effect.forEach(
              plan.prompts,
              (prompt, i) => {
                let midDone = false
                return server.generate({ prompt, maxTokens: cfg.tokens, sampling: { temperature: 0 } }).pipe(
                  Stream.runFold(0, (n, e) => {
                    if (e._tag !== "Text") return n
                    if (i === 0 && !midDone && e.completionTokens >= Math.ceil(cfg.tokens / 2)) {
                      midDone = true
                      onMid?.()
                    }
                    return e.completionTokens
                  })
                )
              },
              { concurrency: "unbounded" }
            )
          )
        )
        .then((counts) => tokensPerRound.push(counts.reduce((a, b) => a + b, 0)))
    const roundStart = performance.now()
    await round()
    // the move runs in the background after round 1 began: wait until no agent maps the file (or the timeout)
    const deadline = performance.now() + cfg.settleTimeoutS * 1000
    const mapping = () => agents.filter((a) => mappedAtLoad.get(a.pid) === true && mapsFile(a.pid, plan.model))
    while (mapping().length > 0 && performance.now() < deadline) await sleep(50)
    const stillMapped = mapping().map((a) => a.pid)
    settleSeconds = stillMapped.length === 0 ? (performance.now() - roundStart) / 1000 : Number.NaN
    await tracker.cut("round 1 + settle")
    for (let r = 2; r <= cfg.rounds; r++) {
      await round(
        r === cfg.rounds ? () => (steady = new Map(agents.map((a) => [a.pid, readStatus(a.pid)]))) : undefined
      )
    }
    await tracker.cut(`rounds 2-${cfg.rounds}`)
    return { agents, mappedAtLoad, settleSeconds, stillMapped, steady, tokensPerRound }
  } finally {
    await runtime.dispose()
  }
}

const referenceRun = async (plan: Plan, tracker: PhaseTracker) => {
  const ref = startReference({
    model: plan.model,
    // node-llama-cpp's contextSize is per sequence (each sequence gets its own cells): the same cells as swactor's
    contextSize: plan.contextPerSequence,
    threads: cfg.refThreads,
    tokens: cfg.tokens,
    prompts: plan.prompts
  })
  const pid = ref.child.pid!
  tracker.track([pid])
  try {
    const loaded = await ref.events.next("loaded")
    await tracker.cut("load")
    let steady: MemStatus | undefined
    const tokensPerRound: Array<number> = []
    for (let r = 1; r <= cfg.rounds; r++) {
      ref.child.stdin!.write("round\n")
      await ref.events.next("mid")
      if (r === cfg.rounds) steady = readStatus(pid)
      tokensPerRound.push(Number((await ref.events.next("round"))["tokens"]))
      if (r === 1) await tracker.cut("round 1")
    }
    await tracker.cut(`rounds 2-${cfg.rounds}`)
    const logs: Array<string> = []
    for (;;) {
      const e = await Promise.race([ref.events.next("log"), sleep(10).then(() => undefined)])
      if (e === undefined) break
      logs.push(String(e["line"]))
    }
    return {
      pid,
      steady,
      tokensPerRound,
      contextSize: Number(loaded["contextSize"]) * cfg.clients,
      buffers: llamaCppBuffers(logs)
    }
  } finally {
    ref.child.stdin!.end("exit\n")
  }
}

const llamaServerRun = async (binary: string, plan: Plan, tracker: PhaseTracker) => {
  const port = 18000 + Math.floor(Math.random() * 2000)
  const contextSize = plan.contextPerSequence * cfg.clients
  const child = spawn(
    binary,
    [
      "-m",
      plan.model,
      "-c",
      String(contextSize),
      "-np",
      String(cfg.clients),
      "-t",
      String(cfg.refThreads),
      "-tb",
      String(cfg.refThreads),
      "-fa",
      "on",
      "--port",
      String(port),
      "--host",
      "127.0.0.1",
      "--no-webui",
      // verbosity 4: its buffer sizes are logged at that level only
      "-lv",
      "4"
    ],
    { stdio: ["ignore", "pipe", "pipe"] }
  )
  const pid = child.pid!
  tracker.track([pid])
  const logs: Array<string> = []
  const tail: Array<string> = []
  for (const out of [child.stdout!, child.stderr!]) {
    createInterface({ input: out }).on("line", (line) => {
      if (/buffer size/.test(line)) logs.push(line)
      tail.push(line)
      tail.splice(0, Math.max(0, tail.length - 5))
    })
  }
  const url = `http://127.0.0.1:${port}`
  try {
    for (let i = 0; ; i++) {
      if (
        await fetch(`${url}/health`).then(
          (r) => r.ok,
          () => false
        )
      )
        break
      if (i > 3000 || child.exitCode !== null) {
        throw new Error(`llama-server did not become ready (exit ${child.exitCode}): ${tail.join(" | ")}`)
      }
      await sleep(50)
    }
    await tracker.cut("load")
    // ids 3-258 banned: a random model's lone byte tokens break llama-server's text path (as in bench:serve)
    const logitBias = Array.from({ length: 256 }, (_, i) => [i + 3, false])
    const one = async (prompt: ReadonlyArray<number>, onMid?: () => void): Promise<number> => {
      const response = await fetch(`${url}/completion`, {
        method: "POST",
        headers: { "content-type": "application/json" },
        body: JSON.stringify({
          prompt,
          n_predict: cfg.tokens,
          temperature: 0,
          stream: true,
          cache_prompt: false,
          logit_bias: logitBias
        })
      })
      let n = 0
      await forEachStreamedToken(response, () => {
        if (++n === Math.ceil(cfg.tokens / 2)) onMid?.()
      })
      return n
    }
    let steady: MemStatus | undefined
    const tokensPerRound: Array<number> = []
    for (let r = 1; r <= cfg.rounds; r++) {
      const mid = r === cfg.rounds ? () => (steady = readStatus(pid)) : undefined
      const counts = await Promise.all(plan.prompts.map((p, i) => one(p, i === 0 ? mid : undefined)))
      tokensPerRound.push(counts.reduce((a, b) => a + b, 0))
      if (r === 1) await tracker.cut("round 1")
    }
    await tracker.cut(`rounds 2-${cfg.rounds}`)
    return { pid, steady, tokensPerRound, contextSize, buffers: llamaCppBuffers(logs) }
  } finally {
    child.kill("SIGTERM")
  }
}

// --- printing ---------------------------------------------------------------------------------------------------

const cell = (s: string, n: number) => s.padStart(n)
const NAME = 28

const printPhases = (results: ReadonlyArray<ProcessResult>) => {
  console.log(
    "\nper phase (MiB): VmHWM = the kernel's peak in the phase; sampled = the highest VmRSS read (anon / file / shmem at " +
      "that reading, and when in the phase); end = VmRSS at the phase's end"
  )
  const head =
    `${"process".padEnd(NAME)}${"phase".padEnd(20)}${cell("s", 6)}${cell("VmHWM", 8)}${cell("sampled", 9)}` +
    `${cell("anon", 7)}${cell("file", 7)}${cell("shm", 5)}${cell("at s", 7)}${cell("end", 7)}${cell("reads", 7)}`
  console.log(head)
  console.log("-".repeat(head.length))
  for (const r of results) {
    for (const p of r.phases) {
      const s = p.sampled
      console.log(
        `${r.name.padEnd(NAME)}${p.phase.padEnd(20)}${cell(p.seconds.toFixed(1), 6)}${cell(mib(p.hwm), 8)}` +
          `${cell(mib(s?.rss ?? Number.NaN), 9)}${cell(mib(s?.anon ?? Number.NaN), 7)}${cell(mib(s?.file ?? Number.NaN), 7)}` +
          `${cell(mib(s?.shmem ?? Number.NaN), 5)}${cell(s === undefined ? "-" : (s.atMs / 1000).toFixed(1), 7)}` +
          `${cell(mib(p.end?.rss ?? Number.NaN), 7)}${cell(String(p.passes), 7)}`
      )
    }
  }
}

const printTable = (results: ReadonlyArray<ProcessResult>) => {
  console.log(
    "\nfinal table (MiB; ratios x): peak = VmHWM over every phase (or a higher sampled VmRSS); steady = VmRSS halfway through the last round's decode; " +
      "W = weights, KV = the round's KV cache; '- base' = the same with the idle baseline of its kind subtracted from peak and steady"
  )
  const head =
    `${"process".padEnd(NAME)}${cell("W", 6)}${cell("KV", 5)}${cell("peak", 6)}${cell("steady", 7)}` +
    `${cell("peak/W", 8)}${cell("pk/(W+KV)", 10)}${cell("stdy/W", 8)}${cell("st/(W+KV)", 10)} |` +
    `${cell("base", 5)}${cell("peak/W", 8)}${cell("pk/(W+KV)", 10)}${cell("stdy/W", 8)}${cell("st/(W+KV)", 10)}  (- base)`
  console.log(head)
  console.log("-".repeat(head.length))
  for (const r of results) {
    const peak = peakOf(r.phases)
    const steady = r.steady?.rss ?? Number.NaN
    const b = r.base?.bytes ?? Number.NaN
    const wkv = r.weights + r.kv
    console.log(
      `${r.name.padEnd(NAME)}${cell(mib(r.weights), 6)}${cell(mib(r.kv), 5)}${cell(mib(peak), 6)}${cell(mib(steady), 7)}` +
        `${cell(ratio(peak, r.weights), 8)}${cell(ratio(peak, wkv), 10)}${cell(ratio(steady, r.weights), 8)}${cell(ratio(steady, wkv), 10)} |` +
        `${cell(mib(b), 5)}${cell(ratio(peak - b, r.weights), 8)}${cell(ratio(peak - b, wkv), 10)}` +
        `${cell(ratio(steady - b, r.weights), 8)}${cell(ratio(steady - b, wkv), 10)}` +
        (r.note === undefined ? "" : `  ${r.note}`)
    )
  }
}

const printTarget = (results: ReadonlyArray<ProcessResult>) => {
  console.log(
    "\ntarget: peak <= 1.15x (weights + KV + compute buffers), per process, its idle baseline's VmRSS subtracted where " +
      "there is one (swactor's compute buffers are not visible from outside: the planner's reserve stands in, and the " +
      "ratio to weights + KV alone is given too)"
  )
  for (const r of results) {
    if (r.compute === undefined) continue
    const worst = r.phases.reduce((a, p) => (phasePeak(p) > phasePeak(a) ? p : a), r.phases[0]!)
    const need = r.weights + r.kv + r.compute.bytes
    const minus = peakOf(r.phases) - (r.base?.bytes ?? 0)
    console.log(
      `  ${r.name.padEnd(NAME)} ${ratio(minus, need)}x of ${mib(need)} MiB (W ${mib(r.weights)} + KV ${mib(r.kv)} + compute ` +
        `${mib(r.compute.bytes)}, ${r.compute.source}; ${ratio(minus, r.weights + r.kv)}x of W + KV alone)` +
        `${r.base === undefined ? ", no baseline subtracted" : ""}; peak in "${worst.phase}": ` +
        `${minus / need <= 1.15 ? "within" : "over"} 1.15x`
    )
  }
}

// --- main -------------------------------------------------------------------------------------------------------

const main = async () => {
  const given = flag("model")
  const model = realpathSync(given !== undefined ? resolve(given) : await ensureBenchModel(cfg.dir, cfg.shape))
  const held = await modelHoldings(model, cfg.stages)
  const promptLength = cfg.context === undefined ? 16 : Math.max(16, Number(cfg.context) - cfg.tokens - 1)
  const contextPerSequence = runContextLength(held.hp.nCtxTrain, promptLength, cfg.tokens)
  const prompts = Array.from({ length: cfg.clients }, (_, c) => [
    held.hp.bosTokenId ?? 1,
    ...Array.from({ length: promptLength - 1 }, (_, i) => 259 + ((i * 7919 + c * 104729) % (held.hp.nVocab - 259)))
  ])
  const plan: Plan = { model, contextPerSequence, prompts }
  const computeReserve = computeReserveBytes(held.layout, contextPerSequence * cfg.clients)
  console.log(
    `bench:memory ${model}\n  ${held.hp.nLayer} blocks, hidden ${held.hp.nEmbd}, ${mib(held.whole.weights)} MiB of weights; ` +
      `swactor ${cfg.stages} local stages x ${cfg.threads} thread(s); node-llama-cpp / llama-server ${cfg.refThreads} thread(s); ` +
      `${cfg.rounds} rounds of ${cfg.clients} concurrent requests x ${cfg.tokens} tokens (prompt ${promptLength} tokens); ` +
      `${contextPerSequence} KV cells per sequence (${contextPerSequence * cfg.clients} in all); /proc sampled every ${cfg.sampleMs} ms; ` +
      `SWACTOR_MMAP_MOVE=${process.env["SWACTOR_MMAP_MOVE"] ?? "(unset: settle from the second run)"}`
  )
  const sampler = startSampler(cfg.sampleMs)
  const results: Array<ProcessResult> = []
  /** A llama.cpp contender's row: the whole model's weights and KV, its compute buffers from llama.cpp's log. */
  const llamaCppRow = (
    name: string,
    r: { readonly pid: number; readonly steady: MemStatus | undefined; readonly buffers: { readonly compute: number } },
    t: PhaseTracker,
    base: ProcessResult["base"]
  ): ProcessResult => ({
    name,
    pid: r.pid,
    phases: t.phases(r.pid),
    steady: r.steady,
    weights: held.whole.weights,
    kv: cfg.clients * contextPerSequence * held.whole.kvPerToken,
    compute: Number.isFinite(r.buffers.compute) ? { bytes: r.buffers.compute, source: "llama.cpp's log" } : undefined,
    base
  })
  try {
    const idle = await idleBaselines(sampler)
    const agentBase = idle.agent.status?.rss ?? Number.NaN
    const refBase = idle.reference.status?.rss ?? Number.NaN
    console.log(
      `  idle agent (pid ${idle.agent.pid}, loaded nothing; the median of 3 s after its ready line): VmRSS ${mib(agentBase)} MiB, VmHWM ` +
        `${mib(peakOf(idle.agent.phases))} MiB; idle node-llama-cpp process (after getLlama, no model, likewise): VmRSS ${mib(refBase)} MiB` +
        (idle.resetsWorked ? "" : "; /proc/PID/clear_refs refused: every phase's VmHWM is the peak since start")
    )

    const tracker = phaseTracker(sampler)
    const s = await swactorRun(plan, tracker)
    console.log(
      `  swactor: tokens per round ${s.tokensPerRound.join(", ")}; ` +
        (s.stillMapped.length > 0
          ? `still mapping the model after ${cfg.settleTimeoutS} s: agents ${s.stillMapped.join(", ")}`
          : [...s.mappedAtLoad.values()].some((m) => m)
            ? `settled (no agent maps the model file) ${s.settleSeconds.toFixed(1)} s after round 1 began`
            : "no agent mapped the model file when the load phase ended (weights copied at load, or moved already)")
    )
    s.agents.forEach((a, i) => {
      const h = held.perStage[i]
      const kv = h === undefined ? 0 : cfg.clients * contextPerSequence * h.kvPerToken
      results.push({
        name: h === undefined ? `swactor spare agent ${i}` : `swactor stage ${i} ${h.label}`,
        pid: a.pid,
        phases: tracker.phases(a.pid),
        steady: s.steady.get(a.pid),
        weights: h?.weights ?? 0,
        kv,
        compute: h === undefined ? undefined : { bytes: computeReserve, source: "the planner's reserve" },
        base: { bytes: agentBase, name: "idle agent" },
        ...(s.mappedAtLoad.get(a.pid) === true ? {} : { note: "(model file not mapped after load)" })
      })
    })
    if (!cfg.skipRef) {
      const t = phaseTracker(sampler)
      const r = await referenceRun(plan, t)
      console.log(
        `  node-llama-cpp: ${r.contextSize} KV cells (${cfg.clients} sequences), tokens per round ${r.tokensPerRound.join(", ")}; llama.cpp's buffers: ` +
          `model ${mib(r.buffers.model)} MiB, KV ${mib(r.buffers.kv)} MiB, compute ${mib(r.buffers.compute)} MiB`
      )
      results.push(llamaCppRow("node-llama-cpp", r, t, { bytes: refBase, name: "idle node-llama-cpp" }))
    }
    if (cfg.llamaServer !== undefined) {
      const t = phaseTracker(sampler)
      const r = await llamaServerRun(cfg.llamaServer, plan, t)
      console.log(
        `  llama-server: -c ${r.contextSize} -np ${cfg.clients}, tokens per round ${r.tokensPerRound.join(", ")}; its buffers: ` +
          `model ${mib(r.buffers.model)} MiB, KV ${mib(r.buffers.kv)} MiB, compute ${mib(r.buffers.compute)} MiB`
      )
      results.push(llamaCppRow("llama-server", r, t, undefined))
    }
    results.push(
      {
        name: "idle agent (baseline)",
        pid: idle.agent.pid,
        phases: idle.agent.phases,
        steady: idle.agent.status,
        weights: Number.NaN,
        kv: Number.NaN,
        compute: undefined,
        base: undefined
      },
      {
        name: "idle node-llama-cpp (base)",
        pid: idle.reference.pid,
        phases: idle.reference.phases,
        steady: idle.reference.status,
        weights: Number.NaN,
        kv: Number.NaN,
        compute: undefined,
        base: undefined
      }
    )
  } finally {
    await sampler.close()
  }

  printPhases(results)
  const stageRows = results.filter((r) => r.name.startsWith("swactor stage"))
  const sum = (f: (r: ProcessResult) => number) => stageRows.reduce((a, r) => a + f(r), 0)
  const table = [...results]
  if (stageRows.length > 1) {
    // every stage's own peak added up (an upper bound of their peaks at one time), against the whole model
    table.splice(stageRows.length, 0, {
      name: "swactor, stages summed",
      pid: 0,
      phases: [
        { phase: "all", seconds: 0, hwm: sum((r) => peakOf(r.phases)), sampled: undefined, end: undefined, passes: 0 }
      ],
      steady: {
        rss: sum((r) => r.steady?.rss ?? Number.NaN),
        hwm: Number.NaN,
        anon: Number.NaN,
        file: Number.NaN,
        shmem: Number.NaN
      },
      weights: sum((r) => r.weights),
      kv: sum((r) => r.kv),
      compute: undefined,
      base: { bytes: sum((r) => r.base?.bytes ?? Number.NaN), name: "one idle agent per stage" }
    })
  }
  printTable(table)
  // a transient the kernel's peak missed, beyond its counters' slack
  const missed = results.filter((r) => r.phases.some((p) => (p.sampled?.rss ?? 0) > p.hwm + MiB))
  if (missed.length > 0)
    console.log(`(a sampled VmRSS above the phase's VmHWM: ${missed.map((r) => r.name).join(", ")})`)
  printTarget(table)
  if (held.fileTensorBytes !== held.whole.weights) {
    console.log(
      `(the file holds ${mib(held.fileTensorBytes)} MiB of tensors; the stages load ${mib(held.whole.weights)} MiB)`
    )
  }
}

main().then(
  () => process.exit(0),
  (error: unknown) => {
    console.error(error)
    process.exit(1)
  }
)
