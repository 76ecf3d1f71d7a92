/**
 * Mixture-of-experts benchmark (not a test; issue 20's figures). On a synthetic qwen3moe (bench/moeModel.ts; default
 * 24 blocks, hidden 2048, 64 experts of FFN 768, 8 used, q4_k_m, ~4.3 GiB, written once under ~/.cache/swactor-bench):
 *
 * 1. decode and prefill tok/s of swactor's stage engine at 1, 2 and 4 stages (all in this process) against
 *    node-llama-cpp on the same file, 1 thread each, flash attention, F16 KV (bench/engineTiming.ts, bench:engine's
 *    loop); every configuration once per round, interleaved, the best round counts;
 * 2. `swactor serve`'s Server (one agent process per stage, BENCH_SERVE_STAGES, default the most stages of 1.) under
 *    N = 1, 4 and 8 concurrent greedy streams: aggregate decode tok/s (bench/serveRounds.ts, bench:serve's rounds);
 * 3. the peak RSS (VmHWM of /proc/PID/status) of each of those stage agents after the serve rounds, against that
 *    stage's weights + the KV its agent sized for the most concurrent sequences, with and without an idle agent's RSS.
 *
 * Then the table against the targets: decode >= 0.95x node-llama-cpp at 1 stage and >= 0.9x at 4 stages; peak RSS
 * <= 1.15x (weights + KV).
 *
 *   npm run bench:moe
 *
 * Settings (environment): the shape (bench/moeModel.ts: BENCH_LAYERS 24, BENCH_HIDDEN 2048, BENCH_HEADS 32,
 * BENCH_KV_HEADS 4, BENCH_HEAD_DIM 128, BENCH_EXPERTS 64, BENCH_EXPERTS_USED 8, BENCH_EXPERT_FFN 768, BENCH_VOCAB 32000,
 * BENCH_TYPE q4_k_m, BENCH_DIR ~/.cache/swactor-bench), BENCH_THREADS (1), BENCH_PROMPT (128), BENCH_DECODE (32),
 * BENCH_STAGES (1,2,4), BENCH_ROUNDS (2), BENCH_SERVE_STAGES, BENCH_CLIENTS (1,4,8), BENCH_SERVE_TOKENS (32),
 * BENCH_SERVE_ROUNDS (1), BENCH_SKIP (timing and/or serve: leave that part out).
 * A small shape to check it runs: BENCH_LAYERS=4 BENCH_HIDDEN=256 BENCH_HEADS=4 BENCH_KV_HEADS=2 BENCH_HEAD_DIM=64
 * BENCH_EXPERTS=8 BENCH_EXPERTS_USED=2 BENCH_EXPERT_FFN=256 BENCH_VOCAB=400.
 */
import { Effect, Layer, ManagedRuntime } from "effect"
import { loadavg } from "node:os"
import { serve, Server } from "../src/api/serve.js"
import { generateToken, type LocalAgent, spawnLocalAgents } from "../src/layers/agent/AgentProcesses.js"
import {
  benchContextLength,
  benchPrompt,
  bestFigures,
  evenSplit,
  type Figures,
  timeNodeLlamaCpp,
  timeOurs
} from "./engineTiming.js"
import { ensureMoeBenchModel, moeBenchDir, moeBenchShape } from "./moeModel.js"
import { readStatus } from "./procMemory.js"
import { fmt, median, type StreamTimes, summarize, swactorRound } from "./serveRounds.js"
import { modelHoldings } from "./stageHoldings.js"

const env = (k: string, d: string) => process.env[k] ?? d
const num = (k: string, d: number) => Number(env(k, String(d)))
const list = (k: string, d: string) => env(k, d).split(",").map(Number)

const shape = moeBenchShape()
const stages = list("BENCH_STAGES", "1,2,4")
const cfg = {
  threads: num("BENCH_THREADS", 1),
  prompt: num("BENCH_PROMPT", 128),
  decode: num("BENCH_DECODE", 32),
  stages,
  rounds: num("BENCH_ROUNDS", 2),
  serveStages: num("BENCH_SERVE_STAGES", Math.max(...stages)),
  clients: list("BENCH_CLIENTS", "1,4,8"),
  serveTokens: num("BENCH_SERVE_TOKENS", 32),
  serveRounds: num("BENCH_SERVE_ROUNDS", 1),
  skip: env("BENCH_SKIP", "").split(",")
}
const MiB = 2 ** 20
const mib = (b: number) => (Number.isFinite(b) ? (b / MiB).toFixed(0) : "-")
const load = () =>
  loadavg()
    .map((x) => x.toFixed(2))
    .join(" ")

const timingPart = async (path: string) => {
  const timing = {
    threads: cfg.threads,
    contextLength: benchContextLength(cfg.prompt, cfg.decode),
    prompt: benchPrompt(cfg.prompt, shape.vocab),
    decode: cfg.decode
  }
  let ref: Figures | undefined
  const ours = new Map<number, Figures>()
  for (let round = 0; round < cfg.rounds; round++) {
    ref = bestFigures(ref, await timeNodeLlamaCpp(path, timing))
    console.log(`  round ${round + 1}: node-llama-cpp decode ${fmt(ref.decode, 2)} tok/s (best so far)`)
    for (const s of cfg.stages) {
      const o = await timeOurs(path, evenSplit(shape.layers, s), timing)
      ours.set(s, bestFigures(ours.get(s), o))
      console.log(
        `  round ${round + 1}: swactor ${s} stage(s) decode ${fmt(o.decode, 2)}, prefill ${fmt(o.prefill, 2)} tok/s (load ${load()})`
      )
    }
  }
  return { ref: ref!, ours }
}

/** An idle stage agent's VmRSS (started as serve starts them, loading nothing): the median of 3 s of readings. */
const idleAgentRss = () =>
  Effect.runPromise(
    Effect.scoped(
      Effect.gen(function* () {
        const [agent] = yield* spawnLocalAgents({ count: 1, token: generateToken(), threads: cfg.threads })
        const readings: Array<number> = []
        for (let i = 0; i < 30; i++) {
          yield* Effect.sleep("100 millis")
          readings.push(readStatus(agent!.pid)?.rss ?? Number.NaN)
        }
        return median(readings.filter(Number.isFinite))
      })
    )
  )

const servePart = async (path: string) => {
  let agents: ReadonlyArray<LocalAgent> = []
  const maxClients = Math.max(...cfg.clients)
  const layer = serve({
    model: path,
    stages: cfg.serveStages,
    threads: cfg.threads,
    parallel: maxClients,
    local: { onStarted: (started) => (agents = started) }
  })
  const runtime = ManagedRuntime.make(layer as Layer.Layer<Server>)
  const rounds = new Map<number, Array<ReadonlyArray<StreamTimes>>>()
  try {
    const t0 = performance.now()
    await runtime.runPromise(Effect.flatMap(Server, (s) => s.ready))
    console.log(`  serve: ${cfg.serveStages} stage agents ready in ${((performance.now() - t0) / 1000).toFixed(1)} s`)
    // one warm-up request (the agents' first run; weights leave the file mapping during the second)
    await swactorRound(runtime, 1, 4)
    for (const n of cfg.clients) {
      for (let r = 0; r < cfg.serveRounds; r++) {
        const streams = await swactorRound(runtime, n, cfg.serveTokens)
        rounds.set(n, [...(rounds.get(n) ?? []), streams])
        console.log(`  serve N=${n}: ${fmt(summarize([streams]).aggregate, 2)} tok/s aggregate (load ${load()})`)
      }
    }
    const metrics = await runtime.runPromise(Effect.flatMap(Server, (s) => s.metrics))
    // each agent's peak, read while it is still running (agents[i] hosts stage i: an even local plan)
    const peaks = agents.map((a) => ({ pid: a.pid, hwm: readStatus(a.pid)?.hwm ?? Number.NaN }))
    return { rounds, metrics, peaks, maxClients }
  } finally {
    await runtime.dispose()
  }
}

const main = async () => {
  const s = shape
  console.log(
    `bench:moe: qwen3moe ${s.layers} blocks, hidden ${s.hidden}, heads ${s.heads}/${s.kvHeads} of ${s.headDim}, ${s.experts} experts ` +
      `of FFN ${s.expertFfn} (${s.expertsUsed} used), vocab ${s.vocab}, ${s.type}; threads ${cfg.threads} per side / per stage; ` +
      `prompt ${cfg.prompt}, decode ${cfg.decode}; best of ${cfg.rounds} interleaved rounds; load average ${load()}`
  )
  const path = await ensureMoeBenchModel(moeBenchDir(), s)
  const held = await modelHoldings(path, cfg.serveStages)
  console.log(`  ${path}: ${mib(held.whole.weights)} MiB of weights`)
  const timed = cfg.skip.includes("timing") ? undefined : await timingPart(path)
  const served = cfg.skip.includes("serve") ? undefined : await servePart(path)
  const idle = served === undefined ? Number.NaN : await idleAgentRss()

  console.log(`\nload average at the end: ${load()}`)
  if (timed !== undefined) {
    const r = timed.ref
    console.log(
      `\nnode-llama-cpp (1 context, 1 sequence, ${cfg.threads} thread(s), flash attention, F16 KV): decode ${fmt(r.decode, 2)} tok/s, ` +
        `prefill ${fmt(r.prefill, 2)} tok/s`
    )
    console.log(
      "| stages | decode tok/s | x node-llama-cpp | target | per CPU-s | prefill tok/s | x node-llama-cpp | per CPU-s |"
    )
    console.log("|---|---|---|---|---|---|---|---|")
    for (const n of cfg.stages) {
      const o = timed.ours.get(n)!
      const target = n === 1 ? 0.95 : n === 4 ? 0.9 : undefined
      const x = o.decode / r.decode
      console.log(
        `| ${n} | ${fmt(o.decode, 2)} | ${fmt(x, 3)} | ${target === undefined ? "-" : `>= ${target}: ${x >= target ? "met" : "MISSED"}`} | ` +
          `${fmt(o.decodeCpu / r.decodeCpu, 3)} | ${fmt(o.prefill, 2)} | ${fmt(o.prefill / r.prefill, 3)} | ${fmt(o.prefillCpu / r.prefillCpu, 3)} |`
      )
    }
  }
  if (served !== undefined) {
    const one = summarize(served.rounds.get(cfg.clients[0]!) ?? [])
    console.log(
      `\nserve: ${cfg.serveStages} stage agents x ${cfg.threads} thread(s), ${cfg.serveTokens} greedy tokens per stream, ` +
        `${cfg.serveRounds} round(s) per N (median)`
    )
    console.log(
      `| N | aggregate tok/s | x N=${cfg.clients[0]} | TTFT p50 ms | inter-token p50 / p99 ms |\n|---|---|---|---|---|`
    )
    for (const n of cfg.clients) {
      const f = summarize(served.rounds.get(n)!)
      console.log(
        `| ${n} | ${fmt(f.aggregate, 2)} | ${fmt(f.aggregate / one.aggregate, 2)} | ${fmt(f.ttft[0])} | ${fmt(f.itl[0])} / ${fmt(f.itl[1])} |`
      )
    }
    console.log(
      `\npeak RSS per stage agent (VmHWM after the serve rounds) against weights + KV (the agent's KV for one sequence x ` +
        `${served.maxClients}); an idle agent's VmRSS: ${mib(idle)} MiB; target <= 1.15x`
    )
    console.log(
      "| stage | blocks | weights MiB | KV MiB | VmHWM MiB | agent's own peak MiB | / (W + KV) | (VmHWM - idle) / (W + KV) | target |"
    )
    console.log("|---|---|---|---|---|---|---|---|---|")
    served.peaks.forEach((p, i) => {
      const h = held.perStage[i]
      const kv = (served.metrics.stages[i]?.kvBytes ?? Number.NaN) * served.maxClients
      const wkv = (h?.weights ?? Number.NaN) + kv
      const minus = (p.hwm - idle) / wkv
      console.log(
        `| ${i} | ${h?.label ?? "-"} | ${mib(h?.weights ?? Number.NaN)} | ${mib(kv)} | ${mib(p.hwm)} | ` +
          `${mib(served.metrics.stages[i]?.peakResidentBytes ?? Number.NaN)} | ${fmt(p.hwm / wkv, 3)} | ` +
          `${fmt(minus, 3)} | ${p.hwm / wkv <= 1.15 ? "met" : minus <= 1.15 ? "met less the idle agent" : "MISSED"} |`
      )
    })
  }
}

main().then(
  () => process.exit(0),
  (error: unknown) => {
    console.error(error)
    process.exit(1)
  }
)
