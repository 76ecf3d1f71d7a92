/**
 * bench:serve — N concurrent streaming requests to one warm swactor pipeline (the `Server` service that
 * `swactor serve` puts behind HTTP: admission, one run per request) vs node-llama-cpp serving the same N
 * streams from one process (one context, N sequences, which it batches), greedy, `tokens` tokens each.
 * Prints per N: aggregate decode tok/s (tokens after each stream's first / time from the first first token
 * to the last token), TTFT p50/p99, inter-token latency p50/p99, whether every stream equals its lone
 * reference, and each contender's CPU time per generated token (its processes' user + system time over the round:
 * this process and the stage agents for swactor, this process for node-llama-cpp, the server for llama-server).
 *
 * Default model: the synthetic 16×2048 Q8_0 llama of bench:pipeline (written once under .cache/bench).
 * Flags (or env): --model FILE, --stages 2 (BENCH_STAGES), --threads 1 per stage (BENCH_THREADS),
 * --ref-threads 2 for node-llama-cpp (BENCH_REF_THREADS), --clients 1,2,4,8 (BENCH_CLIENTS),
 * --tokens 64 (BENCH_TOKENS), --rounds 3 (BENCH_ROUNDS: rounds per N; the contenders take turns round by round, so a
 * slow spell of a shared machine falls on all of them, and each N reports its median round), --dump FILE (BENCH_DUMP:
 * every stream's start, arrival times and text as JSON, per contender, N and round), --skip-ref, --llama-server PATH (BENCH_LLAMA_SERVER): also llama.cpp's own server
 * (`-t ref-threads -np maxN`, flash attention on, F16 KV) under the same client load over HTTP (its `/completion`,
 * streamed, with ids 3–258 banned by logit_bias: a random model's lone byte tokens break its text path).
 * Then the prompt cache's figure (bench/promptCache.ts): turn 2 of a ~2,000-token conversation vs turn 1, time to
 * first token, on --cache-model (default ../shared/models/stories260K.gguf, context 2,048); --prompt-cache-only runs
 * just that, --skip-cache leaves it out; --no-token-loop: every token back through the orchestrator (B4e); --prefill-threads N (1: a stage's prompt on its own
 * thread only); --cache-rounds 3. BENCH_PROMPT_REPEAT=k: every prompt repeated k times (the
 * time to first token of a long prompt). --speculative auto|ngram: a second swactor pipeline serving with that
 * speculative mode joins the rounds ("swactor auto"), and its aggregate tok/s per N is set against the first's (issue
 * 43's target: >= 0.97x of off at N = 4 and 8), with the drafts it made and kept.
 */
import { execFileSync, spawn } from "node:child_process"
import { readdirSync, readFileSync, writeFileSync } from "node:fs"
import { dirname, resolve } from "node:path"
import { fileURLToPath } from "node:url"
import { Effect, Layer, ManagedRuntime, Stream } from "effect"
import { getLlama, LlamaLogLevel, type Token } from "node-llama-cpp"
import { generate, layerLocal } from "../src/api/generate.js"
import { serve, Server } from "../src/api/serve.js"
import type { FirstTokenPhases } from "../src/services/Server.js"
import { defaultBenchShape, ensureBenchModel } from "./benchModel.js"
import { forEachStreamedToken } from "./llamaServerStream.js"
import { fmt, median, percentile, prompts, type StreamTimes, summarize, swactorRound } from "./serveRounds.js"
import { existsSync } from "node:fs"
import { readModelFacts } from "../src/api/modelFacts.js"
import { promptCacheFigure } from "./promptCache.js"

/** The agents measure their step costs by rows while idle (StageBatcher's probe): waits for them before measuring. */
const probesDone = async (runtime: ManagedRuntime.ManagedRuntime<Server, never>) => {
  const probeStart = performance.now()
  while (performance.now() - probeStart < 60_000) {
    const m = await runtime.runPromise(Effect.flatMap(Server, (s) => s.metrics))
    if (m.agents.every((a) => (a.stepCosts ?? []).every((c) => c.probe !== "pending"))) break
    await new Promise((resolve) => setTimeout(resolve, 200))
  }
  console.log(`  step-cost probes done in ${((performance.now() - probeStart) / 1000).toFixed(1)} s`)
}

const root = resolve(dirname(fileURLToPath(import.meta.url)), "..")
const flag = (name: string): string | undefined => {
  const at = process.argv.indexOf(`--${name}`)
  return at >= 0 ? process.argv[at + 1] : undefined
}
const setting = (name: string, env: string, fallback: string) => flag(name) ?? process.env[env] ?? fallback

const cfg = {
  stages: Number(setting("stages", "BENCH_STAGES", "2")),
  threads: Number(setting("threads", "BENCH_THREADS", "1")),
  refThreads: Number(setting("ref-threads", "BENCH_REF_THREADS", "2")),
  clients: setting("clients", "BENCH_CLIENTS", "1,2,4,8").split(",").map(Number),
  tokens: Number(setting("tokens", "BENCH_TOKENS", "64")),
  rounds: Math.max(1, Number(setting("rounds", "BENCH_ROUNDS", "3"))),
  dump: flag("dump") ?? process.env["BENCH_DUMP"],
  skipRef: process.argv.includes("--skip-ref"),
  llamaServer: flag("llama-server") ?? process.env["BENCH_LLAMA_SERVER"],
  speculative: flag("speculative") as "auto" | "ngram" | undefined,
  dir: resolve(root, process.env["BENCH_DIR"] ?? ".cache/bench")
}

// Same file as bench:pipeline and bench:engine.
const ensureModel = async (): Promise<string> => {
  const given = flag("model")
  return given !== undefined ? resolve(given) : ensureBenchModel(cfg.dir, defaultBenchShape)
}

/** One side of the comparison: set up once, then serves one round of N concurrent streams at a time. */
interface Contender {
  readonly name: string
  readonly round: (n: number) => Promise<ReadonlyArray<StreamTimes>>
  readonly close: () => Promise<void>
  /** Where its work runs: this process (its CPU time counts) and these processes. */
  readonly cpu: { readonly self: boolean; readonly pids: ReadonlyArray<number> }
}

/** Clock ticks per second of /proc's CPU times. */
const clockTicks = (() => {
  try {
    return Number(execFileSync("getconf", ["CLK_TCK"], { encoding: "utf8" }).trim()) || 100
  } catch {
    return 100
  }
})()

/** The fields of /proc/PID/stat after the command name (state, ppid, ...); undefined when the process is gone. */
const statFields = (pid: number | string): Array<string> | undefined => {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, "utf8")
    return stat.slice(stat.lastIndexOf(")") + 2).split(" ")
  } catch {
    return undefined
  }
}

/** user + system CPU ms of a process, its exited threads included; 0 when it is gone. */
const processCpuMillis = (pid: number): number => {
  const fields = statFields(pid)
  return fields === undefined ? 0 : ((Number(fields[11]) + Number(fields[12])) * 1000) / clockTicks
}

/** Every live descendant of `root` (the stage agents this process spawned). */
const descendants = (root: number): Array<number> => {
  const children = new Map<number, Array<number>>()
  for (const entry of readdirSync("/proc")) {
    const fields = /^\d+$/.test(entry) ? statFields(entry) : undefined
    if (fields === undefined) continue
    const ppid = Number(fields[1])
    children.set(ppid, [...(children.get(ppid) ?? []), Number(entry)])
  }
  const out: Array<number> = []
  const visit = (pid: number) => {
    for (const c of children.get(pid) ?? []) {
      out.push(c)
      visit(c)
    }
  }
  visit(root)
  return out
}

/** A contender's CPU ms now (this process's when it counts, plus its processes'). */
const cpuMillisOf = (c: Contender): number => {
  const usage = c.cpu.self ? process.cpuUsage() : undefined
  const own = usage === undefined ? 0 : (usage.user + usage.system) / 1000
  return own + c.cpu.pids.reduce((sum, pid) => sum + processCpuMillis(pid), 0)
}

/** node-llama-cpp: the model loaded once; each round one context with N sequences (it batches them). */
const nodeLlamaCpp = async (modelPath: string): Promise<Contender> => {
  const llama = await getLlama({ gpu: false, build: "never", logLevel: LlamaLogLevel.error })
  const model = await llama.loadModel({ modelPath, gpuLayers: 0 })
  return {
    name: "node-llama-cpp",
    cpu: { self: true, pids: [] },
    round: async (n) => {
      const context = await model.createContext({
        contextSize: Math.max(512, n * 256),
        sequences: n,
        threads: cfg.refThreads,
        flashAttention: true
      })
      try {
        return await Promise.all(
          Array.from({ length: n }, async (_, i) => {
            const sequence = context.getSequence()
            const bos = model.tokens.bos
            const input: Array<Token> = [
              ...(bos !== null ? [bos] : []),
              ...model.tokenize(prompts[i % prompts.length]!)
            ]
            const start = performance.now()
            const arrivals: Array<number> = []
            const tokens: Array<Token> = []
            for await (const token of sequence.evaluate(input, { temperature: 0 })) {
              arrivals.push(performance.now())
              tokens.push(token)
              if (tokens.length >= cfg.tokens || model.isEogToken(token)) break
            }
            return { start, arrivals, text: model.detokenize(tokens) }
          })
        )
      } finally {
        await context.dispose()
      }
    },
    close: async () => {
      await model.dispose()
      await llama.dispose()
    }
  }
}

/** llama.cpp's llama-server on the same model: N concurrent streamed `/completion` requests per round. */
const llamaServer = async (binary: string, modelPath: string): Promise<Contender> => {
  const maxClients = Math.max(...cfg.clients)
  const port = 18000 + Math.floor(Math.random() * 2000)
  const child = spawn(
    binary,
    [
      "-m",
      modelPath,
      "-t",
      String(cfg.refThreads),
      "-tb",
      String(cfg.refThreads),
      "-np",
      String(maxClients),
      "-c",
      String(maxClients * 512),
      "-fa",
      "on",
      "--port",
      String(port),
      "--host",
      "127.0.0.1",
      "--no-webui"
    ],
    {
      stdio: ["ignore", "ignore", "ignore"],
      // its own ggml libraries beside it (scripts/build-llama-tools.sh): without this the build folder's rpath can load a
      // second libggml-base, and llama-server aborts at start (seen: GGML_ASSERT(prev != ggml_uncaught_exception))
      env: { ...process.env, LD_LIBRARY_PATH: dirname(resolve(binary)) }
    }
  )
  const url = `http://127.0.0.1:${port}`
  try {
    for (let i = 0; ; i++) {
      const ok = await fetch(`${url}/health`).then(
        (r) => r.ok,
        () => false
      )
      if (ok) break
      if (i > 1200 || child.exitCode !== null)
        throw new Error(`llama-server did not become ready (exit ${child.exitCode})`)
      await new Promise((r) => setTimeout(r, 100))
    }
  } catch (error) {
    child.kill("SIGTERM")
    throw error
  }
  const logitBias = Array.from({ length: 256 }, (_, i) => [i + 3, false])
  const one = async (prompt: string): Promise<StreamTimes> => {
    const start = performance.now()
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
    const arrivals: Array<number> = []
    let text = ""
    await forEachStreamedToken(response, (data) => {
      arrivals.push(performance.now())
      text += data.content ?? ""
    })
    return { start, arrivals, text }
  }
  return {
    name: "llama-server",
    cpu: { self: false, pids: child.pid === undefined ? [] : [child.pid] },
    round: (n) => Promise.all(Array.from({ length: n }, (_, i) => one(prompts[i % prompts.length]!))),
    close: async () => {
      child.kill("SIGTERM")
    }
  }
}

const phaseNames = ["tokenize", "admit", "setup", "prefillWait", "prefill", "sample", "hops"] as const

/** The first-token phases of the requests between two /metrics snapshots: ms per request. */
const phaseDelta = (before: FirstTokenPhases, after: FirstTokenPhases): Record<string, number> => {
  const requests = Math.max(1, after.requests - before.requests)
  const out: Record<string, number> = { total: ((after.totalSeconds - before.totalSeconds) * 1000) / requests }
  for (const name of phaseNames) out[name] = ((after[name] - before[name]) * 1000) / requests
  return out
}

/** The rounds so far of one contender at one N (created empty). */
const roundsAt = <A>(byName: Map<string, Map<number, Array<A>>>, name: string, n: number): Array<A> => {
  const byN = byName.get(name) ?? new Map<number, Array<A>>()
  byName.set(name, byN)
  const rounds = byN.get(n) ?? []
  byN.set(n, rounds)
  return rounds
}

/** The prompt-cache figure on --cache-model (stories260K when present: its 2,048-token context holds the conversation). */
const cacheFigure = async (fallback: () => Promise<string>) => {
  const stories = resolve(root, "../shared/models/stories260K.gguf")
  const model = flag("cache-model") ?? (existsSync(stories) ? stories : await fallback())
  const facts = await Effect.runPromise(readModelFacts(model))
  await promptCacheFigure({
    model,
    contextTokens: facts.maxSeqLen,
    stages: cfg.stages,
    threads: cfg.threads,
    rounds: Math.max(1, Number(flag("cache-rounds") ?? "3"))
  })
}

/** --prefill-threads N: PipelineOptions.prefillThreads (default: the pipeline's own, stages x threads here). */
const prefillThreadsFlag = (() => {
  const at = process.argv.indexOf("--prefill-threads")
  return at < 0 ? undefined : Number(process.argv[at + 1])
})()

const main = async () => {
  if (process.argv.includes("--prompt-cache-only")) return cacheFigure(ensureModel)
  const modelPath = await ensureModel()
  const maxClients = Math.max(...cfg.clients)
  console.log(
    `bench:serve ${modelPath}\n  swactor: ${cfg.stages} local stages x ${cfg.threads} thread(s), parallel ${maxClients}; ` +
      `node-llama-cpp: one process, ${cfg.refThreads} thread(s), one context with N sequences; ${cfg.tokens} tokens per stream, greedy; ` +
      `${cfg.rounds} round(s) per N, the contenders interleaved round by round`
  )
  const layer = serve({
    model: modelPath,
    stages: cfg.stages,
    threads: cfg.threads,
    parallel: maxClients,
    ...(process.argv.includes("--no-token-loop") ? { tokenLoop: false } : {}),
    ...(prefillThreadsFlag === undefined ? {} : { prefillThreads: prefillThreadsFlag })
  })
  const runtime = ManagedRuntime.make(layer as Layer.Layer<Server>)
  // --speculative: the same pipeline again, serving with drafts (its own agents)
  const drafting =
    cfg.speculative === undefined
      ? undefined
      : ManagedRuntime.make(
          serve({
            model: modelPath,
            stages: cfg.stages,
            threads: cfg.threads,
            parallel: maxClients,
            speculative: { mode: cfg.speculative }
          }) as Layer.Layer<Server>
        )
  const draftingName = `swactor ${cfg.speculative}`
  const contenders: Array<Contender> = []
  const results = new Map<string, Map<number, Array<ReadonlyArray<StreamTimes>>>>()
  const lone = new Map<string, string>()
  /** swactor's time to first token by phase (/metrics), per N and round: ms per request. */
  const phases = new Map<string, Map<number, Array<Record<string, number>>>>()
  /** CPU ms per generated token (prefill included), per contender, N and round. */
  const cpu = new Map<string, Map<number, Array<number>>>()
  let draftCounts = { steps: 0, drafted: 0, accepted: 0 }
  try {
    const loadStart = performance.now()
    await runtime.runPromise(Effect.flatMap(Server, (s) => s.ready))
    console.log(`  pipeline ready in ${((performance.now() - loadStart) / 1000).toFixed(1)} s`)
    await probesDone(runtime)
    for (const prompt of prompts.slice(0, maxClients)) {
      const [result] = await runtime.runPromise(
        Effect.flatMap(Server, (server) =>
          server.generate({ prompt, maxTokens: cfg.tokens, sampling: { temperature: 0 } }).pipe(
            Stream.runFold("", (text, e) => (e._tag === "Text" ? text + e.text : text)),
            Effect.map((text) => [text])
          )
        )
      )
      lone.set(prompt, result!)
    }
    // the orchestrator runs in this process, the stages in the agents it spawned (not llama-server's process)
    const agents = descendants(process.pid)
    const firstToken = () => runtime.runPromise(Effect.flatMap(Server, (s) => s.metrics)).then((m) => m.firstToken)
    contenders.push({
      name: "swactor",
      round: async (n) => {
        const before = await firstToken()
        const streams = await swactorRound(runtime, n, cfg.tokens)
        const after = await firstToken()
        roundsAt(phases, "swactor", n).push(phaseDelta(before, after))
        return streams
      },
      close: () => Promise.resolve(),
      cpu: { self: true, pids: agents }
    })
    if (drafting !== undefined) {
      await drafting.runPromise(Effect.flatMap(Server, (s) => s.ready))
      await probesDone(drafting)
      contenders.push({
        name: draftingName,
        round: (n) => swactorRound(drafting, n, cfg.tokens),
        close: () => Promise.resolve(),
        cpu: { self: true, pids: descendants(process.pid).filter((pid) => !agents.includes(pid)) }
      })
    }
    if (!cfg.skipRef) contenders.push(await nodeLlamaCpp(modelPath))
    if (cfg.llamaServer !== undefined) contenders.push(await llamaServer(cfg.llamaServer, modelPath))
    // Interleaved: every contender's round r at N runs back to back, so a slow spell of the machine hits them alike.
    for (const n of cfg.clients) {
      for (let r = 0; r < cfg.rounds; r++) {
        for (const c of contenders) {
          const cpuBefore = cpuMillisOf(c)
          const streams = await c.round(n)
          roundsAt(results, c.name, n).push(streams)
          const generated = streams.reduce((sum, s) => sum + s.arrivals.length, 0)
          roundsAt(cpu, c.name, n).push((cpuMillisOf(c) - cpuBefore) / generated)
        }
      }
    }
    if (drafting !== undefined) {
      const m = await drafting.runPromise(Effect.flatMap(Server, (s) => s.metrics))
      draftCounts = m.speculative
    }
  } finally {
    for (const c of contenders) await c.close().catch(() => undefined)
    await runtime.dispose()
    await drafting?.dispose()
  }

  console.log(
    "\nswactor time to first token by phase (/metrics' swactor_first_token_phase_seconds_total), ms per request, the median over rounds:"
  )
  console.log(`| N | ${phaseNames.join(" | ")} | total |`)
  console.log(`|---|${phaseNames.map(() => "---|").join("")}---|`)
  for (const n of cfg.clients) {
    const rounds = phases.get("swactor")?.get(n) ?? []
    const col = (name: string) => fmt(median(rounds.map((r) => r[name]!)), 1)
    console.log(`| ${n} | ${phaseNames.map(col).join(" | ")} | ${col("total")} |`)
  }

  if (cfg.dump !== undefined) {
    const out = Object.fromEntries([...results].map(([name, byN]) => [name, Object.fromEntries(byN)]))
    writeFileSync(cfg.dump, JSON.stringify(out))
    console.log(`\nstreams written to ${cfg.dump}`)
  }
  const at = (name: string, n: number) => {
    const rounds = results.get(name)?.get(n)
    return rounds === undefined ? undefined : summarize(rounds)
  }
  console.log(
    "\naggregate tok/s: the median round (min–max of the rounds); TTFT and inter-token p50/p99 (ms): over every round's " +
      "streams; p99 rd: the median of the rounds' own inter-token p99"
  )
  console.log(
    "\n| N | swactor agg tok/s | rounds | TTFT p50/p99 ms | inter-token p50/p99 ms | p99 rd | = alone | node-llama-cpp agg tok/s | rounds | TTFT p50/p99 ms | inter-token p50/p99 ms |"
  )
  console.log("|---|---|---|---|---|---|---|---|---|---|---|")
  for (const n of cfg.clients) {
    const o = at("swactor", n)!
    const same = results
      .get("swactor")!
      .get(n)!
      .every((round) => round.every((s, i) => s.text === lone.get(prompts[i % prompts.length]!)))
    const r = at("node-llama-cpp", n)
    console.log(
      `| ${n} | ${fmt(o.aggregate)} | ${o.spread} | ${fmt(o.ttft[0])} / ${fmt(o.ttft[1])} | ${fmt(o.itl[0], 2)} / ${fmt(o.itl[1], 2)} | ${fmt(o.itlP99Round)} | ${same ? "yes" : "NO"} | ` +
        `${r === undefined ? "-" : fmt(r.aggregate)} | ${r?.spread ?? "-"} | ${r === undefined ? "-" : `${fmt(r.ttft[0])} / ${fmt(r.ttft[1])}`} | ` +
        `${r === undefined ? "-" : `${fmt(r.itl[0], 2)} / ${fmt(r.itl[1], 2)}`} |`
    )
  }
  if (results.has("llama-server")) {
    console.log(
      `\nllama-server (-t ${cfg.refThreads} -np ${maxClients}, flash attention, /completion streamed, same client load):`
    )
    console.log("| N | agg tok/s | rounds | TTFT p50/p99 ms | inter-token p50/p99 ms |\n|---|---|---|---|---|")
    for (const n of cfg.clients) {
      const f = at("llama-server", n)!
      console.log(
        `| ${n} | ${fmt(f.aggregate)} | ${f.spread} | ${fmt(f.ttft[0])} / ${fmt(f.ttft[1])} | ${fmt(f.itl[0], 2)} / ${fmt(f.itl[1], 2)} |`
      )
    }
  }
  if (drafting !== undefined) {
    console.log(
      `\n${draftingName} against swactor (speculative off), same rounds: aggregate tok/s, the median round; ` +
        `every round: drafts ${draftCounts.drafted} in ${draftCounts.steps} steps, ${draftCounts.accepted} kept`
    )
    console.log("| N | off agg tok/s | drafting agg tok/s | ratio (target >= 0.97) | = alone |\n|---|---|---|---|---|")
    for (const n of cfg.clients) {
      const o = at("swactor", n)!
      const d = at(draftingName, n)!
      const same = results
        .get(draftingName)!
        .get(n)!
        .every((round) => round.every((s, i) => s.text === lone.get(prompts[i % prompts.length]!)))
      console.log(
        `| ${n} | ${fmt(o.aggregate)} | ${fmt(d.aggregate)} | ${fmt(d.aggregate / o.aggregate, 3)} | ${same ? "yes" : "NO"} |`
      )
    }
  }
  const names = contenders.map((c) => c.name)
  console.log(
    "\nCPU time per generated token, ms (all of a contender's processes, prefill included; the median round): " +
      "what each token costs the machine"
  )
  console.log(`| N | ${names.join(" | ")} |\n|---|${names.map(() => "---|").join("")}`)
  for (const n of cfg.clients) {
    console.log(`| ${n} | ${names.map((name) => fmt(median(cpu.get(name)?.get(n) ?? []))).join(" | ")} |`)
  }
  const one = at("swactor", 1)
  const four = at("swactor", 4)
  if (four !== undefined && one !== undefined) {
    const ref4 = at("node-llama-cpp", 4)
    const server4 = at("llama-server", 4)
    console.log(
      `\ntargets at N=4 (medians): aggregate ${fmt(four.aggregate / one.aggregate, 2)}x N=1 (>= 2.2)` +
        (ref4 === undefined ? "" : `, ${fmt(four.aggregate / ref4.aggregate, 2)}x node-llama-cpp (>= 1.2)`) +
        (server4 === undefined ? "" : `, ${fmt(four.aggregate / server4.aggregate, 2)}x llama-server`) +
        `, inter-token p99 ${fmt(four.itl[1] / one.itl[0], 2)}x the N=1 median (<= 2; the median round's p99: ` +
        `${fmt(four.itlP99Round / one.itl[0], 2)}x)`
    )
  }
  if (one !== undefined && cfg.clients.includes(1)) {
    // `swactor run`'s path on the same split and threads: the per-token time a lone request through serve is held to
    const gaps: Array<number> = []
    for (let r = 0; r < cfg.rounds; r++) {
      const arrivals: Array<number> = []
      await Effect.runPromise(
        generate({
          model: modelPath,
          prompt: prompts[0]!,
          stages: cfg.stages,
          threads: cfg.threads,
          maxTokens: cfg.tokens,
          sampling: { temperature: 0 }
        }).pipe(
          Stream.runForEach(() => Effect.sync(() => void arrivals.push(performance.now()))),
          Effect.provide(layerLocal())
        )
      )
      for (let i = 1; i < arrivals.length; i++) gaps.push(arrivals[i]! - arrivals[i - 1]!)
    }
    const runItl = median(gaps)
    console.log(
      `
serve N=1 inter-token p50 ${fmt(one.itl[0], 1)} ms against \`swactor run\`'s ${fmt(runItl, 1)} ms per token ` +
        `(same split, ${cfg.rounds} run(s) of ${cfg.tokens} tokens after the serve rounds): ${fmt(one.itl[0] / runItl, 3)}x (target <= 1.05)`
    )
    const server1 = at("llama-server", 1)
    if (server1 !== undefined) {
      console.log(
        `serve N=1 TTFT p50 ${fmt(one.ttft[0], 1)} ms against llama-server's ${fmt(server1.ttft[0], 1)} ms: ${fmt(one.ttft[0] / server1.ttft[0], 2)}x (target <= 1.5)`
      )
    }
  }
  if (!process.argv.includes("--skip-cache")) await cacheFigure(() => Promise.resolve(modelPath))
}

main().then(
  () => process.exit(0),
  (error: unknown) => {
    console.error(error)
    process.exit(1)
  }
)
