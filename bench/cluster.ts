/**
 * Real clusters (issue 10), three figures on one machine over loopback:
 *
 * 1. Weight delivery: the time to deliver the whole model as one stage's GGUF slice to an agent with an empty cache
 *    (`--slices-only`: it cannot read the file) by the byte stream (src/layers/gguf/SliceStream.ts: check, pipe with
 *    the agent's running SHA-256, finish), against copying the same bytes over a raw TCP socket into a file in another
 *    process (what `nc` would do), side by side, `--repeat` times each (median). The orchestrator's one-time work
 *    (stage hash, writing the outgoing slice and its SHA-256; remembered for later runs) is printed apart. Target ≥ 0.8×.
 * 2. Placement: decode tok/s with three local agents of `--threads` each (default a third of the cores, so they do
 *    not starve one another), one throttled `--slowdown` times (default 3; SWACTOR_BENCH_SLOWDOWN: each forward sleeps
 *    (k − 1) × its compute time, and the agent's measured speed is divided by k), `balanced` vs `capacity` placement
 *    (capacity uses the speeds the agents measured at start).
 * 3. TLS hop p50 vs plain TCP: runs bench/hop.ts `--only Tcp,TlsTcp`.
 *
 * Usage: npm run bench:cluster [-- --parts delivery,placement,hop --model PATH --tokens 32 --threads 2 --slowdown 3 --repeat 3
 *        --hop-iterations 5000 --skip placement]
 * Environment: SWACTOR_BENCH_PARTS, SWACTOR_BENCH_MODEL (a path, or a file name in SWACTOR_MODELS_DIR), SWACTOR_BENCH_CACHE
 * (where the default model is written once; default .cache/bench). Default model: the 16×2048 Q8_0 bench model.
 * A tiny check: --model stories260K.gguf --tokens 4 --hop-iterations 200 --repeat 1.
 */
import { spawn } from "node:child_process"
import * as Fs from "node:fs"
import * as Net from "node:net"
import * as Os from "node:os"
import * as Path from "node:path"
import { Chunk, Effect, Stream } from "effect"
import { layerRemote, run } from "../src/api/generate.js"
import { NodeId } from "../src/domain/ids.js"
import * as AgentControlRpc from "../src/layers/agent/AgentControlRpc.js"
import { Settings } from "../src/layers/config/Settings.js"
import { readGgufFile } from "../src/layers/gguf/GgufReader.js"
import { generateToken, spawnLocalAgents } from "../src/layers/agent/AgentProcesses.js"
import { deliverWeights } from "../src/layers/orchestrator/WeightDelivery.js"
import { AgentControl } from "../src/services/AgentLinks.js"
import type { PlacementRequest, RunUpdate } from "../src/services/Orchestrator.js"
import { defaultBenchShape, ensureBenchModel } from "./benchModel.js"

const arg = (name: string): string | undefined => {
  const i = process.argv.indexOf(`--${name}`)
  return i >= 0 ? process.argv[i + 1] : undefined
}
const tokens = Number(arg("tokens") ?? 32)
const threads = Number(arg("threads") ?? Math.max(1, Math.floor(Os.availableParallelism() / 3)))
const slowdown = Number(arg("slowdown") ?? 3)
const hopIterations = arg("hop-iterations") ?? "5000"
const repeat = Math.max(1, Number(arg("repeat") ?? 3))
const list = (text: string | undefined) =>
  (text ?? "")
    .split(",")
    .map((s) => s.trim())
    .filter((s) => s !== "")
const allParts = ["delivery", "placement", "hop"] as const
const chosen = list(arg("parts") ?? process.env["SWACTOR_BENCH_PARTS"])
const skip = new Set(list(arg("skip")))
for (const part of [...chosen, ...skip]) {
  if (!(allParts as ReadonlyArray<string>).includes(part))
    throw new Error(`unknown part "${part}" (parts: ${allParts.join(", ")})`)
}
const parts = new Set(allParts.filter((p) => (chosen.length === 0 || chosen.includes(p)) && !skip.has(p)))
const median = (xs: ReadonlyArray<number>) => [...xs].sort((a, b) => a - b)[xs.length >> 1]!

/** A model path, or a file name looked up in SWACTOR_MODELS_DIR (default ../shared/models). */
const resolveModel = (name: string): string => {
  if (Fs.existsSync(name)) return name
  const inModels = Path.join(
    process.env["SWACTOR_MODELS_DIR"] ?? Path.join(process.cwd(), "..", "shared", "models"),
    name
  )
  if (Fs.existsSync(inModels)) return inModels
  throw new Error(`no model at ${name} nor ${inModels}`)
}
const mib = (bytes: number) => bytes / 2 ** 20

/** Seconds to copy `path` over a raw loopback TCP socket into a file written by another process. */
const rawCopySeconds = (path: string, dir: string) =>
  new Promise<number>((resolve, reject) => {
    const size = Fs.statSync(path).size
    const target = Path.join(dir, "raw-copy")
    const script = `
      const net = require("node:net"), fs = require("node:fs")
      const server = net.createServer({ allowHalfOpen: true }, (s) => {
        const out = fs.createWriteStream(${JSON.stringify(target)})
        let got = 0
        s.on("data", (c) => { got += c.length; if (!out.write(c)) { s.pause(); out.once("drain", () => s.resume()) } })
        s.on("end", () => out.end(() => { s.end(String(got)); server.close() }))
      })
      server.listen(0, "127.0.0.1", () => console.log(server.address().port))`
    const child = spawn(process.execPath, ["-e", script], { stdio: ["ignore", "pipe", "inherit"] })
    child.stdout.once("data", (data: Buffer) => {
      const started = performance.now()
      const socket = Net.createConnection({ host: "127.0.0.1", port: Number(String(data).trim()) }, () => {
        Fs.createReadStream(path, { highWaterMark: 4 << 20 }).pipe(socket, { end: true })
      })
      let answer = ""
      socket.on("data", (c) => (answer += c))
      socket.on("end", () => {
        const seconds = (performance.now() - started) / 1000
        Number(answer) === size ? resolve(seconds) : reject(new Error(`raw copy got ${answer} of ${size} bytes`))
      })
      socket.on("error", reject)
    })
    child.on("error", reject)
  })

const delivery = (model: string, dir: string) =>
  Effect.gen(function* () {
    const token = generateToken()
    const cache = Path.join(dir, "agent-cache")
    const tlsCache = Path.join(dir, "agent-cache-tls")
    const outgoingDir = Path.join(dir, "outgoing")
    const control = yield* AgentControl.pipe(Effect.provide(AgentControlRpc.layer))
    // TLS always on both ends (the agent's environment, this process's Settings) encrypts loopback too: the byte
    // stream as it runs between hosts.
    const withTls = (tls: boolean) => Effect.provide(Settings.layer({ tls: tls ? "always" : "auto" }))
    /** An agent with an empty cache that cannot read the model, and the control link to it. */
    const agentAt = (cacheDir: string, tls: boolean) =>
      Effect.gen(function* () {
        const [agent] = yield* spawnLocalAgents({
          count: 1,
          token,
          threads: 1,
          extraArgs: () => ["--cache-dir", cacheDir, "--slices-only", "--speed", "1e9"],
          env: { SWACTOR_TLS: tls ? "always" : "auto" }
        })
        return yield* control.connect({ nodeId: NodeId.make(1), address: agent!.address }, token)
      }).pipe(withTls(tls))
    const link = yield* agentAt(cache, false)
    const tlsLink = yield* agentAt(tlsCache, true)
    const numLayers = (yield* readGgufFile(model)).tensors.reduce((n, t) => {
      const m = /^blk\.(\d+)\./.exec(t.name)
      return m === null ? n : Math.max(n, Number(m[1]) + 1)
    }, 0)
    const input = {
      modelPath: model,
      placement: [{ stageIndex: 0, nodeId: 1 }],
      layerRanges: [[0, numLayers] as const],
      outgoingDir
    }
    // Cold: the orchestrator hashes the stage's tensors, writes its outgoing slice and the slice's SHA-256 (all kept for
    // later runs), then sends it.
    Fs.rmSync(outgoingDir, { recursive: true, force: true })
    const coldStart = performance.now()
    const [cold] = yield* deliverWeights({ ...input, linkOf: () => link }, () => Effect.void)
    const coldSeconds = (performance.now() - coldStart) / 1000
    const slice = Path.join(outgoingDir, `${cold!.hash}.gguf`)
    const bytes = Fs.statSync(slice).size
    const deliveries: Array<number> = []
    const encrypted: Array<number> = []
    const raws: Array<number> = []
    /** Seconds to deliver the slice to the agent with an emptied cache (it holds nothing; every byte crosses). */
    const deliverOnce = (tls: boolean) =>
      Effect.gen(function* () {
        Fs.rmSync(tls ? tlsCache : cache, { recursive: true, force: true })
        const started = performance.now()
        const [sent] = yield* deliverWeights({ ...input, linkOf: () => (tls ? tlsLink : link) }, () => Effect.void)
        const seconds = (performance.now() - started) / 1000
        if (sent!.via !== "Sent" || sent!.sentBytes !== bytes)
          throw new Error(`delivery sent ${sent!.sentBytes} of ${bytes} bytes`)
        return seconds
      }).pipe(withTls(tls))
    for (let i = 0; i < repeat; i++) {
      deliveries.push(yield* deliverOnce(false))
      raws.push(yield* Effect.promise(() => rawCopySeconds(slice, dir)))
      Fs.rmSync(Path.join(dir, "raw-copy"), { force: true })
      encrypted.push(yield* deliverOnce(true))
    }
    const seconds = median(deliveries)
    const raw = median(raws)
    const tlsSeconds = median(encrypted)
    const rate = (s: number) => `${(mib(bytes) / s).toFixed(0)} MiB/s`
    console.log(
      `delivery: ${mib(bytes).toFixed(1)} MiB slice, median of ${repeat} (each: ${deliveries.map((s) => s.toFixed(2)).join(", ")} s vs raw ${raws.map((s) => s.toFixed(2)).join(", ")} s)`
    )
    console.log(
      `  to an empty node (check, byte stream with the agent's SHA-256, finish): ${seconds.toFixed(2)} s, ${rate(seconds)}`
    )
    console.log(
      `  raw socket copy of the same bytes into a file:                        ${raw.toFixed(2)} s, ${rate(raw)}`
    )
    console.log(`  ratio ${(raw / seconds).toFixed(2)}× of raw (target ≥ 0.8×)`)
    console.log(
      `  the same delivery in TLS 1.3 (as between hosts; SWACTOR_TLS=always): ${tlsSeconds.toFixed(2)} s, ${rate(tlsSeconds)}, ` +
        `${(raw / tlsSeconds).toFixed(2)}× of the raw plain copy (each: ${encrypted.map((s) => s.toFixed(2)).join(", ")} s)`
    )
    console.log(
      `  first delivery with the orchestrator's one-time work (stage hash, outgoing slice, its SHA-256): ${coldSeconds.toFixed(2)} s`
    )
  }).pipe(Effect.scoped)

const placement = (model: string) =>
  Effect.gen(function* () {
    const token = generateToken()
    // Agent 0 is throttled (`slowdown` times slower); each measures its speed at start (the throttled one's divided).
    const throttled = yield* spawnLocalAgents({
      count: 1,
      token,
      threads,
      env: { SWACTOR_BENCH_SLOWDOWN: String(slowdown) }
    })
    const agents = [...throttled, ...(yield* spawnLocalAgents({ count: 2, token, threads }))]
    const layer = layerRemote({ agents: agents.map((a) => a.address), token, listenHost: "127.0.0.1" })
    const decode = (request: PlacementRequest) =>
      Stream.runCollect(
        run({ model, prompt: "Once upon a time", stages: 3, maxTokens: tokens, placement: request })
      ).pipe(
        Effect.map(Chunk.toReadonlyArray),
        Effect.provide(layer),
        Effect.map((updates: ReadonlyArray<RunUpdate>) => {
          const planned = updates.find((u) => u._tag === "Planned")
          const finished = updates.find((u) => u._tag === "Finished")
          const pool = updates.find((u) => u._tag === "PoolReady")
          // Agents by index, the throttled one starred.
          const name = (address: string) => {
            const i = agents.findIndex((a) => a.address === address)
            return `A${i}${i === 0 ? "*" : ""}`
          }
          const speeds =
            pool?._tag === "PoolReady"
              ? pool.capacity
                  .map(
                    ({ capacity, node }) =>
                      `${name(node.address)} ${capacity.speedBytesPerSecond === undefined ? "?" : (capacity.speedBytesPerSecond / 1e9).toFixed(2)} GB/s`
                  )
                  .join(", ")
              : "?"
          return {
            speeds,
            layers:
              planned?._tag === "Planned"
                ? planned.stages.map((s) => `${name(s.address)}[${s.layers[0]},${s.layers[1]})`).join(" ")
                : "?",
            tps: finished?._tag === "Finished" ? finished.summary.decodeTokensPerSecond : Number.NaN
          }
        })
      )
    const rates: Array<number> = []
    for (const [name, request] of [
      ["balanced", { _tag: "Balanced" }],
      ["capacity", { _tag: "Capacity" }]
    ] as const) {
      // One warm-up run loads the weights; the second is measured.
      yield* decode(request)
      const { layers, speeds, tps } = yield* decode(request)
      rates.push(tps)
      console.log(
        `placement ${name}: ${tps.toFixed(1)} tok/s decode, blocks ${layers} (speeds ${speeds}; A0 throttled ${slowdown}×)`
      )
    }
    console.log(`placement capacity / balanced = ${(rates[1]! / rates[0]!).toFixed(2)}× decode tok/s`)
  }).pipe(Effect.scoped)

const hop = () =>
  new Promise<void>((resolve, reject) => {
    const child = spawn(
      process.execPath,
      [
        "--import",
        "tsx",
        Path.join(import.meta.dirname, "hop.ts"),
        "--only",
        "Tcp,TlsTcp",
        "--iterations",
        hopIterations
      ],
      { stdio: "inherit" }
    )
    child.on("exit", (code) => (code === 0 ? resolve() : reject(new Error(`bench/hop.ts exited ${code}`))))
  })

const main = Effect.gen(function* () {
  const named = arg("model") ?? process.env["SWACTOR_BENCH_MODEL"]
  const model =
    named !== undefined
      ? resolveModel(named)
      : yield* Effect.promise(() =>
          ensureBenchModel(
            process.env["SWACTOR_BENCH_CACHE"] ?? Path.join(process.cwd(), ".cache", "bench"),
            defaultBenchShape
          )
        )
  const dir = Fs.mkdtempSync(Path.join(Os.tmpdir(), "swactor-bench-cluster-"))
  console.log(
    `model ${model} (${mib(Fs.statSync(model).size).toFixed(1)} MiB), parts ${[...parts].join(",")}, ${tokens} tokens, ` +
      `${threads} threads per agent`
  )
  yield* Effect.gen(function* () {
    if (parts.has("delivery")) yield* delivery(model, dir)
    if (parts.has("placement")) yield* placement(model)
    if (parts.has("hop")) yield* Effect.promise(hop)
  }).pipe(Effect.ensuring(Effect.sync(() => Fs.rmSync(dir, { recursive: true, force: true }))))
})

Effect.runPromise(main).then(
  () => process.exit(0),
  (error) => {
    console.error(error)
    process.exit(1)
  }
)
