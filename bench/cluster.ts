/**
 * Real clusters (issue 10), three figures on one machine over loopback:
 *
 * 1. Weight delivery: the time to deliver the whole model as one stage's GGUF slice to an agent with an empty cache
 *    (`--slices-only`: it cannot read the file; hashes, control-plane chunks and the agent's verification included)
 *    against copying the same bytes over a raw TCP socket into a file in another process. Target ≥ 0.8×.
 * 2. Placement: decode tok/s with three local agents, one throttled (`--threads 1`, the others `--threads N`),
 *    `balanced` vs `capacity` placement (capacity uses the speeds the agents measured at start).
 * 3. TLS hop p50 vs plain TCP: runs bench/hop.ts `--only Tcp,TlsTcp`.
 *
 * Usage: npm run bench:cluster [-- --model PATH --tokens 32 --threads 2 --hop-iterations 5000 --skip placement,hop]
 * Default model: the 16×2048 Q8_0 bench model (written once). A tiny check: --model stories260K.gguf --tokens 4.
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
import { readGgufFile } from "../src/layers/gguf/GgufReader.js"
import { generateToken, spawnLocalAgents } from "../src/layers/agent/LocalAgents.js"
import { deliverWeights } from "../src/layers/orchestrator/WeightDelivery.js"
import { AgentControl } from "../src/services/AgentLinks.js"
import type { PlacementRequest, RunUpdate } from "../src/services/Orchestrator.js"
import { defaultBenchShape, ensureBenchModel } from "./benchModel.js"

const arg = (name: string): string | undefined => {
  const i = process.argv.indexOf(`--${name}`)
  return i >= 0 ? process.argv[i + 1] : undefined
}
const tokens = Number(arg("tokens") ?? 32)
const threads = Number(arg("threads") ?? Math.max(2, Math.floor(Os.availableParallelism() / 3)))
const hopIterations = arg("hop-iterations") ?? "5000"
const skip = new Set((arg("skip") ?? "").split(",").filter((s) => s !== ""))
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
  Effect.gen(function*() {
    const token = generateToken()
    const cache = Path.join(dir, "agent-cache")
    const outgoingDir = Path.join(dir, "outgoing")
    const [agent] = yield* spawnLocalAgents({
      count: 1,
      token,
      threads: 1,
      extraArgs: () => ["--cache-dir", cache, "--slices-only", "--speed", "1e9"]
    })
    const control = yield* AgentControl.pipe(Effect.provide(AgentControlRpc.layer))
    const link = yield* control.connect({ nodeId: NodeId.make(1), address: agent!.address }, token)
    const numLayers = (yield* readGgufFile(model)).tensors.reduce((n, t) => {
      const m = /^blk\.(\d+)\./.exec(t.name)
      return m === null ? n : Math.max(n, Number(m[1]) + 1)
    }, 0)
    const input = { modelPath: model, placement: [{ stageIndex: 0, nodeId: 1 }], layerRanges: [[0, numLayers] as const], outgoingDir }
    // Warm: the orchestrator writes its outgoing slice once (kept between runs), sent to a first cache, then dropped.
    yield* deliverWeights({ ...input, linkOf: () => link }, () => Effect.void)
    Fs.rmSync(cache, { recursive: true, force: true })
    const started = performance.now()
    const [sent] = yield* deliverWeights({ ...input, linkOf: () => link }, () => Effect.void)
    const seconds = (performance.now() - started) / 1000
    const raw = yield* Effect.promise(() => rawCopySeconds(Path.join(outgoingDir, `${sent!.hash}.gguf`), dir))
    console.log(
      `delivery: ${mib(sent!.sentBytes).toFixed(1)} MiB to an empty node in ${seconds.toFixed(2)} s ` +
        `(${(mib(sent!.sentBytes) / seconds).toFixed(0)} MiB/s, hashes and verification included); raw socket copy ` +
        `${raw.toFixed(2)} s (${(mib(sent!.sentBytes) / raw).toFixed(0)} MiB/s): ${(raw / seconds).toFixed(2)}× of raw (target ≥ 0.8×)`
    )
  }).pipe(Effect.scoped)

const placement = (model: string) =>
  Effect.gen(function*() {
    const token = generateToken()
    // Agent 0 is throttled: one thread; the others `threads` each. Each measures its speed at start.
    const throttled = yield* spawnLocalAgents({ count: 1, token, threads: 1 })
    const agents = [...throttled, ...(yield* spawnLocalAgents({ count: 2, token, threads }))]
    const layer = layerRemote({ nodes: agents.map((a) => a.address), token, listenHost: "127.0.0.1" })
    const decode = (request: PlacementRequest) =>
      Stream.runCollect(run({ model, prompt: "Once upon a time", stages: 3, maxTokens: tokens, placement: request })).pipe(
        Effect.map(Chunk.toReadonlyArray),
        Effect.provide(layer),
        Effect.map((updates: ReadonlyArray<RunUpdate>) => {
          const planned = updates.find((u) => u._tag === "Planned")
          const finished = updates.find((u) => u._tag === "Finished")
          return {
            layers: planned?._tag === "Planned" ? planned.stages.map((s) => `[${s.layers[0]},${s.layers[1]})`).join(" ") : "?",
            tps: finished?._tag === "Finished" ? finished.summary.decodeTokensPerSecond : Number.NaN
          }
        })
      )
    for (const [name, request] of [["balanced", { _tag: "Balanced" }], ["capacity", { _tag: "Capacity" }]] as const) {
      // One warm-up run loads the weights; the second is measured.
      yield* decode(request)
      const { layers, tps } = yield* decode(request)
      console.log(`placement ${name}: ${tps.toFixed(1)} tok/s decode, blocks ${layers} (agent 0 throttled to 1 thread)`)
    }
  }).pipe(Effect.scoped)

const hop = () =>
  new Promise<void>((resolve, reject) => {
    const child = spawn(
      process.execPath,
      ["--import", "tsx", Path.join(import.meta.dirname, "hop.ts"), "--only", "Tcp,TlsTcp", "--iterations", hopIterations],
      { stdio: "inherit" }
    )
    child.on("exit", (code) => (code === 0 ? resolve() : reject(new Error(`bench/hop.ts exited ${code}`))))
  })

const main = Effect.gen(function*() {
  const model = arg("model") ?? (yield* Effect.promise(() => ensureBenchModel(Path.join(process.cwd(), ".cache", "bench"), defaultBenchShape)))
  const dir = Fs.mkdtempSync(Path.join(Os.tmpdir(), "swactor-bench-cluster-"))
  console.log(`model ${model} (${mib(Fs.statSync(model).size).toFixed(1)} MiB), ${tokens} tokens, ${threads} threads per agent`)
  yield* Effect.gen(function*() {
    if (!skip.has("delivery")) yield* delivery(model, dir)
    if (!skip.has("placement")) yield* placement(model)
    if (!skip.has("hop")) yield* Effect.promise(hop)
  }).pipe(Effect.ensuring(Effect.sync(() => Fs.rmSync(dir, { recursive: true, force: true }))))
})

Effect.runPromise(main).then(
  () => process.exit(0),
  (error) => {
    console.error(error)
    process.exit(1)
  }
)
