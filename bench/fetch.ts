/**
 * Fetch benchmark (not a test; issue 38, Proof): time to ready of a cold `swactor serve --model hf:…` on 2 nodes whose
 * weights come from a hub behind a 200 Mbit/s link, each node with its own link to the hub.
 *
 *   npm run bench:fetch
 *
 * The hub is the tests' fake one (test/support/testHub.ts: real HTTP servers on loopback, never the internet), in this
 * process, serving a synthetic llama (cached under .cache/bench) as `hf:bench/synth-GGUF:Q8_0`, its CDN throttled to
 * the link rate. The throttle paces each CDN response on its own, and a swactor node fetches its ranges one request at
 * a time, so each node sees a link of its own at that rate (as two machines, each with its own 200 Mbit/s line).
 *
 * Each round: a cold start (`node dist/main.js serve --model hf:… --stages 2 --threads 1 --port 0`, a fresh empty
 * XDG_CACHE_HOME), timed from spawn to serve's `ready` line (it says `listening on` at once, before loading), then a
 * warm start over the same cache (nothing to fetch: start-up + load, the "load time"), which must fetch 0 bytes.
 * Figures:
 * - expected = the largest stage slice's bytes ÷ link rate + warm time (the slices come down in parallel);
 * - whole file = the model's bytes ÷ link rate + warm time: llama.cpp's `-hf` downloads the whole file on every machine;
 * - target: cold ≤ 1.15 × expected.
 *
 * Settings (environment): BENCH_LAYERS (8), BENCH_HIDDEN (1536), BENCH_FFN (4096), BENCH_HEADS (12), BENCH_KV_HEADS
 * (4), BENCH_VOCAB (32000), BENCH_TYPE (q8_0), BENCH_LINK_MBIT (200), BENCH_STAGES (2), BENCH_ROUNDS (1), BENCH_DIR
 * (.cache/bench), BENCH_TIMEOUT_S (600, per start), BENCH_VERBOSE (1: serve's and its agents' stderr, timed).
 */
import { type ChildProcess, spawn } from "node:child_process"
import { mkdtempSync, rmSync, statSync } from "node:fs"
import { availableParallelism, loadavg, tmpdir } from "node:os"
import { basename, dirname, join, resolve } from "node:path"
import { fileURLToPath } from "node:url"
import { Effect } from "effect"
import type { GgufFile } from "../src/domain/gguf.js"
import { readGgufFile } from "../src/layers/gguf/GgufReader.js"
import { sliceTensors } from "../src/layers/gguf/GgufSlice.js"
import type { SyntheticType } from "../src/layers/gguf/Synthetic.js"
import { startTestHub, type HubRequest, type TestHub } from "../test/support/testHub.js"
import { type BenchShape, ensureBenchModel } from "./benchModel.js"

const env = (k: string, d: string) => process.env[k] ?? d
const num = (k: string, d: number) => {
  const v = Number(env(k, String(d)))
  if (!Number.isFinite(v) || v <= 0) throw new Error(`${k} must be a positive number, got ${process.env[k]}`)
  return v
}
const root = resolve(dirname(fileURLToPath(import.meta.url)), "..")
const main = join(root, "dist", "main.js")
const REPO = "bench/synth-GGUF"
const NAME = `hf:${REPO}:Q8_0`
const TARGET = 1.15

interface Settings {
  readonly shape: BenchShape
  readonly linkMbit: number
  readonly stages: number
  readonly rounds: number
  readonly benchDir: string
  readonly timeoutMs: number
}

const settingsOf = (): Settings => ({
  shape: {
    layers: num("BENCH_LAYERS", 8),
    hidden: num("BENCH_HIDDEN", 1536),
    ffn: num("BENCH_FFN", 4096),
    heads: num("BENCH_HEADS", 12),
    kvHeads: num("BENCH_KV_HEADS", 4),
    vocab: num("BENCH_VOCAB", 32000),
    type: env("BENCH_TYPE", "q8_0") as SyntheticType
  },
  linkMbit: num("BENCH_LINK_MBIT", 200),
  stages: num("BENCH_STAGES", 2),
  rounds: num("BENCH_ROUNDS", 1),
  benchDir: resolve(root, env("BENCH_DIR", ".cache/bench")),
  timeoutMs: num("BENCH_TIMEOUT_S", 600) * 1000
})

// ---------------------------------------------------------------------------------------------------------------
// One start of `swactor serve`
// ---------------------------------------------------------------------------------------------------------------

interface Start {
  readonly listeningMs: number
  readonly readyMs: number
  /** serve's stderr (the agents' too: SWACTOR_DEBUG=1), each line with its time since spawn. */
  readonly lines: ReadonlyArray<{ readonly ms: number; readonly text: string }>
}

/** Processes still running, ended on the way out whatever happens. */
const running = new Set<ChildProcess>()

const stop = (child: ChildProcess) =>
  new Promise<void>((done) => {
    if (child.exitCode !== null || child.signalCode !== null) return done()
    const kill = setTimeout(() => child.kill("SIGKILL"), 20_000)
    child.once("exit", () => {
      clearTimeout(kill)
      done()
    })
    child.kill("SIGTERM")
  })

/** Spawns serve, resolves at its `ready` line with the times, then stops it (SIGTERM) and waits for its exit. */
const startServe = async (s: Settings, hub: TestHub, cache: string, sample?: (ms: number) => void): Promise<Start> => {
  const started = performance.now()
  const sampler = setInterval(() => sample?.(performance.now() - started), 50)
  const child = spawn(
    process.execPath,
    [main, "serve", "--model", NAME, "--stages", String(s.stages), "--threads", "1", "--port", "0"],
    {
      cwd: root,
      stdio: ["ignore", "ignore", "pipe"],
      env: { ...process.env, HF_ENDPOINT: hub.endpoint(), XDG_CACHE_HOME: cache, SWACTOR_DEBUG: "1" }
    }
  )
  running.add(child)
  child.once("exit", () => running.delete(child))
  const lines: Array<{ ms: number; text: string }> = []
  let pending = ""
  let listeningMs = Number.NaN
  try {
    const readyMs = await new Promise<number>((ok, fail) => {
      const timer = setTimeout(() => fail(new Error(`not ready in ${s.timeoutMs / 1000} s`)), s.timeoutMs)
      child.on("error", fail)
      child.on("exit", (code, signal) => {
        clearTimeout(timer)
        fail(new Error(`serve exited before it was ready (${signal ?? `code ${code}`}): ${lastLines(lines)}`))
      })
      child.stderr!.setEncoding("utf8")
      child.stderr!.on("data", (chunk: string) => {
        const ms = performance.now() - started
        pending += chunk
        const parts = pending.split("\n")
        pending = parts.pop() ?? ""
        for (const text of parts) {
          lines.push({ ms, text })
          if (Number.isNaN(listeningMs) && text.includes("swactor serve: listening on")) listeningMs = ms
          if (text.includes("swactor serve: ready:")) {
            clearTimeout(timer)
            ok(ms)
          }
        }
      })
    })
    return { listeningMs, readyMs, lines }
  } finally {
    clearInterval(sampler)
    await stop(child)
  }
}

const lastLines = (lines: ReadonlyArray<{ text: string }>) =>
  lines
    .slice(-3)
    .map((l) => l.text.trim())
    .join(" | ") || "(no stderr)"

// ---------------------------------------------------------------------------------------------------------------
// What each stage needed and what each fetched
// ---------------------------------------------------------------------------------------------------------------

interface Stage {
  readonly blocks: readonly [number, number]
  /** The stage's tensor bytes (its slice without the GGUF header). */
  readonly sliceBytes: number
  /** [start, end) file offsets of its tensors. */
  readonly spans: ReadonlyArray<readonly [number, number]>
}

/** The split serve's agents loaded ("blocks [a, b) load from …", "fetched blocks [a, b) …"), else an even one. */
const splitOf = (lines: Start["lines"], layers: number, stages: number): Array<readonly [number, number]> => {
  const seen = new Map<string, readonly [number, number]>()
  for (const { text } of lines) {
    for (const m of text.matchAll(/blocks \[(\d+), (\d+)\) (?:load from|of )/g)) {
      seen.set(`${m[1]},${m[2]}`, [Number(m[1]), Number(m[2])])
    }
  }
  const split = [...seen.values()].sort((a, b) => a[0] - b[0])
  const covers = split.length === stages && split.every((b, i) => b[0] === (i === 0 ? 0 : split[i - 1]![1]))
  if (covers && split.at(-1)![1] === layers) return split
  return Array.from({ length: stages }, (_, i) => [
    Math.round((i * layers) / stages),
    Math.round(((i + 1) * layers) / stages)
  ])
}

const stagesOf = (file: GgufFile, split: ReadonlyArray<readonly [number, number]>, layers: number): Array<Stage> =>
  split.map((blocks) => {
    const tensors = sliceTensors(file, { layerStart: blocks[0], layerEndExclusive: blocks[1], numLayers: layers })
    return {
      blocks,
      sliceBytes: tensors.reduce((n, t) => n + t.byteSize, 0),
      spans: tensors.map((t) => [t.offset, t.offset + t.byteSize] as const)
    }
  })

/** CDN body bytes and requests by what they were for: a stage's tensors (by the range's first byte), else headers. */
const attribute = (requests: ReadonlyArray<HubRequest>, stages: ReadonlyArray<Stage>) => {
  const perStage = stages.map(() => ({ bytes: 0, requests: 0 }))
  const headers = { bytes: 0, requests: 0 }
  const hubRequests = requests.filter((r) => r.host === "hub").length
  for (const r of requests) {
    if (r.host !== "cdn") continue
    const start = Number(/^bytes=(\d+)-/.exec(r.range ?? "")?.[1] ?? Number.NaN)
    const owner = stages.findIndex((st) => st.spans.some(([a, b]) => start >= a && start < b))
    const slot = owner < 0 ? headers : perStage[owner]!
    slot.bytes += r.bytes
    slot.requests += 1
  }
  return { perStage, headers, hubRequests }
}

/** The CDN log sampled during a start: each range request's first byte and body bytes so far, at `ms`. */
type Samples = Array<{ readonly ms: number; readonly ranges: ReadonlyArray<readonly [number, number]> }>

const sampleInto = (samples: Samples, hub: TestHub) => (ms: number) =>
  samples.push({
    ms,
    ranges: hub
      .requests()
      .filter((r) => r.host === "cdn")
      .map((r) => [Number(/^bytes=(\d+)-/.exec(r.range ?? "")?.[1] ?? Number.NaN), r.bytes] as const)
  })

/** When each stage's bytes flowed: the first sample with any, the first with all of them (50 ms resolution). */
const flowOf = (samples: Samples, stage: Stage) => {
  const bytesAt = (ranges: ReadonlyArray<readonly [number, number]>) =>
    ranges.reduce((n, [start, bytes]) => (stage.spans.some(([a, b]) => start >= a && start < b) ? n + bytes : n), 0)
  const first = samples.find((x) => bytesAt(x.ranges) > 0)?.ms
  const last = samples.find((x) => bytesAt(x.ranges) >= stage.sliceBytes)?.ms
  return { first, last }
}

/** A start's milestones from its stderr: the last node to reach each (the pipeline waits for the slowest). */
const timeline = (start: Start, flows: ReadonlyArray<{ first: number | undefined; last: number | undefined }> = []) => {
  const lastOf = (pattern: RegExp) => {
    const times = start.lines.filter((l) => pattern.test(l.text)).map((l) => l.ms)
    return times.length === 0 ? undefined : Math.max(...times)
  }
  const firsts = flows.flatMap((f) => (f.first === undefined ? [] : [f.first]))
  const lasts = flows.flatMap((f) => (f.last === undefined ? [] : [f.last]))
  const steps: Array<[string, number | undefined]> = [
    ["listening", start.listeningMs],
    ["nodes up", lastOf(/swactor node: control /)],
    ["first slice byte", firsts.length === 0 ? undefined : Math.min(...firsts)],
    ["last slice byte", lasts.length === 0 ? undefined : Math.max(...lasts)],
    ["slices written and hashed", lastOf(/fetched blocks \[/)],
    ["loading", lastOf(/ load from /)],
    ["settled", lastOf(/ settled: /)],
    ["ready", start.readyMs]
  ]
  return steps.flatMap(([what, ms]) => (ms === undefined ? [] : [`${what} ${sec(ms)}`])).join(", ")
}

/** The agents' own account: "fetched blocks [a, b) of … from the hub: N bytes in T s", and when it was logged. */
const fetchesLogged = (lines: Start["lines"]) =>
  lines.flatMap(({ ms, text }) => {
    const m = /fetched blocks \[(\d+), (\d+)\) of \S+ from the hub: (\d+) bytes in ([\d.]+) s/.exec(text)
    return m === null ? [] : [{ blocks: `[${m[1]}, ${m[2]})`, bytes: Number(m[3]), seconds: Number(m[4]), atMs: ms }]
  })

// ---------------------------------------------------------------------------------------------------------------
// Rounds and figures
// ---------------------------------------------------------------------------------------------------------------

const mb = (bytes: number) => `${(bytes / 1e6).toFixed(1)} MB`
const sec = (ms: number) => `${(ms / 1000).toFixed(2)} s`

interface Round {
  readonly coldMs: number
  readonly warmMs: number
  readonly expectedMs: number
  readonly wholeFileMs: number
}

const oneRound = async (
  s: Settings,
  hub: TestHub,
  file: GgufFile,
  modelBytes: number,
  scratch: string,
  index: number
): Promise<Round> => {
  const rate = (s.linkMbit * 1e6) / 8
  const cache = mkdtempSync(join(scratch, `round-${index}-`))
  hub.reset()
  const samples: Samples = []
  const cold = await startServe(s, hub, cache, sampleInto(samples, hub))
  const coldBytes = hub.bytesServed()
  const coldRequests = hub.requests()
  hub.reset()
  const warm = await startServe(s, hub, cache)
  const warmBytes = hub.bytesServed()
  const warmAsked = hub.requests().filter((r) => !r.path.includes("/manifests/")).length

  const stages = stagesOf(file, splitOf(cold.lines, s.shape.layers, s.stages), s.shape.layers)
  const largest = Math.max(...stages.map((st) => st.sliceBytes))
  const expectedMs = (largest / rate) * 1000 + warm.readyMs
  const wholeFileMs = (modelBytes / rate) * 1000 + warm.readyMs
  const got = attribute(coldRequests, stages)

  console.log(`\nround ${index + 1}`)
  if (process.env.BENCH_VERBOSE === "1") {
    for (const [what, start] of [
      ["cold", cold],
      ["warm", warm]
    ] as const) {
      for (const l of start.lines) console.log(`  ${what} ${sec(l.ms)} ${l.text}`)
    }
  }
  console.log(
    `  cold: ready in ${sec(cold.readyMs)} (listening at ${sec(cold.listeningMs)}); ` +
      `fetched ${mb(coldBytes)} of a ${mb(modelBytes)} model (${((coldBytes / modelBytes) * 100).toFixed(1)}%)`
  )
  const flows = stages.map((st) => flowOf(samples, st))
  console.log(`    timeline: ${timeline(cold, flows)}`)
  stages.forEach((st, i) => {
    const g = got.perStage[i]!
    console.log(
      `    stage ${i}: blocks [${st.blocks[0]}, ${st.blocks[1]}), slice ${mb(st.sliceBytes)} ` +
        `(${sec((st.sliceBytes / rate) * 1000)} at the link rate); fetched ${mb(g.bytes)} ` +
        `(${(g.bytes / st.sliceBytes).toFixed(3)}×) in ${g.requests} range request(s)`
    )
    const flow = flows[i]!
    if (flow.first !== undefined && flow.last !== undefined) {
      const seconds = (flow.last - flow.first) / 1000
      console.log(
        `      its bytes flowed from ${sec(flow.first)} to ${sec(flow.last)} ` +
          `(${((g.bytes * 8) / 1e6 / seconds).toFixed(0)} Mbit/s)`
      )
    }
  })
  console.log(
    `    headers and the rest: ${mb(got.headers.bytes)} in ${got.headers.requests} CDN request(s); ` +
      `${got.hubRequests} hub request(s) (manifest, resolve)`
  )
  for (const f of fetchesLogged(cold.lines)) {
    console.log(
      `    node of blocks ${f.blocks} says: ${mb(f.bytes)} in ${f.seconds.toFixed(1)} s (opening the model, ` +
        `download, slice written and hashed: ${((f.bytes * 8) / 1e6 / f.seconds).toFixed(0)} Mbit/s overall), ` +
        `logged at ${sec(f.atMs)}`
    )
  }
  console.log(
    `  warm: ready in ${sec(warm.readyMs)} (listening at ${sec(warm.listeningMs)}); fetched ${warmBytes} bytes, ` +
      `${warmAsked} request(s) besides the manifest`
  )
  console.log(`    timeline: ${timeline(warm)}`)
  console.log(
    `  expected (largest slice ${mb(largest)} ÷ ${s.linkMbit} Mbit/s + warm): ${sec(expectedMs)}; ` +
      `cold / expected = ${(cold.readyMs / expectedMs).toFixed(3)}× (target ≤ ${TARGET}×)`
  )
  console.log(
    `  whole file on every machine (llama.cpp -hf: ${mb(modelBytes)} ÷ ${s.linkMbit} Mbit/s + warm): ` +
      `${sec(wholeFileMs)}; whole file / cold = ${(wholeFileMs / cold.readyMs).toFixed(2)}×`
  )
  if (warmBytes !== 0 || warmAsked !== 0) {
    throw new Error(`the warm start fetched ${warmBytes} bytes in ${warmAsked} request(s) besides the manifest`)
  }
  return { coldMs: cold.readyMs, warmMs: warm.readyMs, expectedMs, wholeFileMs }
}

const summary = (rounds: ReadonlyArray<Round>) => {
  if (rounds.length < 2) return
  const best = rounds.reduce((a, b) => (b.coldMs / b.expectedMs < a.coldMs / a.expectedMs ? b : a))
  const worst = rounds.reduce((a, b) => (b.coldMs / b.expectedMs > a.coldMs / a.expectedMs ? b : a))
  console.log(
    `\n${rounds.length} rounds: cold / expected ${(best.coldMs / best.expectedMs).toFixed(3)}× best, ` +
      `${(worst.coldMs / worst.expectedMs).toFixed(3)}× worst (target ≤ ${TARGET}×); cold ` +
      rounds.map((r) => sec(r.coldMs)).join(", ") +
      "; warm " +
      rounds.map((r) => sec(r.warmMs)).join(", ")
  )
}

const benchmark = async (s: Settings, scratch: string, hubs: Array<TestHub>) => {
  const local = await ensureBenchModel(s.benchDir, s.shape)
  const file = await Effect.runPromise(readGgufFile(local))
  const modelBytes = statSync(local).size
  const hub = await startTestHub({
    repos: { [REPO]: { files: { [basename(local)]: local }, manifests: { Q8_0: basename(local) } } }
  })
  hubs.push(hub)
  hub.throttle((s.linkMbit * 1e6) / 8)
  console.log(
    `bench:fetch: ${NAME} = ${basename(local)} (${mb(modelBytes)}), serve on ${s.stages} local nodes, 1 thread each; ` +
      `hub on loopback, its CDN paced at ${s.linkMbit} Mbit/s per response: a node fetches its ranges one request ` +
      `at a time, so each node has its own ${s.linkMbit} Mbit/s link to the hub`
  )
  console.log(
    `machine: ${availableParallelism()} CPUs, load ${loadavg()
      .map((l) => l.toFixed(1))
      .join(" ")}; ${new Date().toISOString()}`
  )
  const rounds: Array<Round> = []
  for (let i = 0; i < s.rounds; i++) rounds.push(await oneRound(s, hub, file, modelBytes, scratch, i))
  summary(rounds)
}

const mainProgram = async () => {
  const scratch = mkdtempSync(join(tmpdir(), "swactor-bench-fetch-"))
  const hubs: Array<TestHub> = []
  const cleanUp = async () => {
    await Promise.all([...running].map(stop))
    await Promise.all(hubs.map((h) => h.close()))
    rmSync(scratch, { recursive: true, force: true })
  }
  const interrupted = (signal: NodeJS.Signals) => {
    console.error(`bench:fetch: stopped by ${signal}`)
    void cleanUp().finally(() => process.exit(1))
  }
  process.once("SIGINT", interrupted)
  process.once("SIGTERM", interrupted)
  try {
    await benchmark(settingsOf(), scratch, hubs)
    await cleanUp()
  } catch (error) {
    await cleanUp()
    console.error(`bench:fetch: failed: ${error instanceof Error ? error.message : String(error)}`)
    process.exit(1)
  }
}

await mainProgram()
