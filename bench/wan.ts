/**
 * bench:wan (issue 25) — swactor and llama.cpp's RPC pipeline over simulated links on loopback, side by side.
 *
 * Links: `loopback` (no relay), `gbe` (1 GbE: 0.25 ms one way, 1 Gbit/s), `wifi` (3 ms one way, 200 Mbit/s). Every hop
 * of a non-loopback link crosses a relay of bench/wanRelay.ts (its own process): for swactor the orchestrator →
 * agent control links (`--nodes` at relay ports), the stage → stage activations (each agent's `--data-advertise` is
 * a relay in front of its `--data-listen`) and the last stage → orchestrator tokens (RemotePoolOptions
 * dataListen/dataAdvertise, bench-only); for llama.cpp llama-server → each ggml-rpc-server (`--rpc` at relay ports;
 * llama.cpp's RPC moves every activation through llama-server).
 * Same client shape for both: N concurrent greedy streams of `--tokens` tokens, the prompts of bench:serve (swactor
 * through its Server service with the prompt cache off; llama-server's streamed `/completion`, cache_prompt off,
 * byte tokens banned as in bench:serve). Per link × stages × contender: N=1 decode tok/s (tokens after the first /
 * time from the first to the last), TTFT (N=1, ms), N=4 and N=8 aggregate tok/s; then the issue's ratios. After each
 * swactor N=1 case, one more stream as `swactor run --timeline` runs it on the same agents and links: its per-token
 * timeline (per stage: wake-up, framing, queueing, copies, compute, send, waiting; per link), the table run prints. One thread
 * per stage (each agent / rpc-server pinned to core i mod cores with taskset); llama-server -t 1.
 * Before: the relay's own check (ping-pong RTT ≈ 2 × delay, bulk throughput ≈ the cap). After (with `wifi` in the
 * links): swactor's weight delivery of stage 0's slice (2-stage split) to an agent with an empty cache over the Wi-Fi
 * link (WeightDelivery, as bench:cluster's delivery part).
 *
 * The llama.cpp side (bench/wanLlama.ts) runs swactor's own split and is checked before it is measured: llama-server's
 * load log must show every block and the head on the rpc-servers, each server holding its blocks' weights and KV, and
 * llama-server's CPU only the embedding; then one greedy request must give single-process llama-server's tokens.
 * Every process the bench starts is killed when it ends, fails or gets SIGINT / SIGTERM / SIGHUP (bench/wanProcesses.ts).
 *
 * Usage: npm run bench:wan [-- --quick --links loopback,gbe,wifi --stages 2,4 --clients 1,4,8 --tokens 64 --rounds 1
 *        --model PATH --shape 16x2048 --skip-llama --skip-swactor --skip-delivery --greedy-check 32 --llama-tools DIR
 *        --no-pin --relay-check-only --loop-ab --speculative --draft-model PATH]
 * --quick: links loopback,wifi (gbe left out) — the issue's comparison at stages 2,4 × N 1,4,8 in about ten minutes on
 * 2 cores; any explicit flag still wins. --greedy-check N: tokens of the greedy check (0: none). --loop-ab: swactor
 * also with its token loop off ("swactor no loop": every token back through the orchestrator to stage 0).
 * --speculative: after each swactor case, one stream without drafts, with prompt lookup and with every draft refused
 * (a prediction that is always wrong), a prediction 15/16 right, and a draft model (--draft-model PATH, default the
 * model drafting for itself): decode tok/s, acceptance, and whether the text is the text without drafts.
 * Default model: a synthetic Q8_0 llama of 8 blocks × 1024 (FFN 4096, heads 16/4, vocab 32000; 190 MiB);
 * `--shape 16x2048` is the issue's reference model (the 16×2048 of bench:serve); `--shape LxH` any size of that
 * family (FFN 4×H, heads H/64, KV heads H/256). Written once under .cache/bench. llama.cpp's tools: --llama-tools DIR
 * (or BENCH_LLAMA_TOOLS) holding llama-server and ggml-rpc-server with their backends, else
 * .cache/llama-tools/build/bin (made by scripts/build-llama-tools.sh), else /tmp/llama-build/bin; none (or tools that
 * do not run): one line saying so and exit 2 before anything runs, unless --skip-llama.
 */
import { spawn } from "node:child_process"
import * as Fs from "node:fs"
import * as Net from "node:net"
import * as Os from "node:os"
import * as Path from "node:path"
import * as Readline from "node:readline"
import { Chunk, Effect, Exit, Layer, ManagedRuntime, Option, Scope, Stream } from "effect"
import { layerRemote } from "../src/api/generate.js"
import { tcpAddress } from "../src/domain/frames.js"
import { NodeId } from "../src/domain/ids.js"
import * as AgentControlRpc from "../src/layers/agent/AgentControlRpc.js"
import { generateToken, spawnLocalAgents } from "../src/layers/agent/AgentProcesses.js"
import { readGgufFile } from "../src/layers/gguf/GgufReader.js"
import { deliverWeights } from "../src/layers/orchestrator/WeightDelivery.js"
import * as PromptTokenizer from "../src/layers/server/PromptTokenizer.js"
import * as ServerLive from "../src/layers/server/ServerLive.js"
import { AgentControl } from "../src/services/AgentLinks.js"
import { type GenerateRequest, Orchestrator, type RunSummary } from "../src/services/Orchestrator.js"
import { Server } from "../src/services/Server.js"
import { renderTimeline } from "../src/services/Timeline.js"
import { type BenchShape, defaultBenchShape, ensureBenchModel } from "./benchModel.js"
import { type Contender, findLlamaTools, llamaReference, llamaRpc, type StreamTimes } from "./wanLlama.js"
import { freePort, installCleanup, pinProcess, track } from "./wanProcesses.js"

const root = Path.resolve(import.meta.dirname, "..")
const flag = (name: string): string | undefined => {
  const at = process.argv.indexOf(`--${name}`)
  return at >= 0 ? process.argv[at + 1] : undefined
}
const list = (text: string) =>
  text
    .split(",")
    .map((s) => s.trim())
    .filter((s) => s !== "")

interface Profile {
  readonly name: string
  readonly label: string
  /** One-way delay, ms; undefined: no relay (plain loopback). */
  readonly delayMs?: number
  readonly bitsPerSecond?: number
}
const profiles: Record<string, Profile> = {
  loopback: { name: "loopback", label: "loopback" },
  gbe: { name: "gbe", label: "1 GbE (0.25 ms, 1 Gbit/s)", delayMs: 0.25, bitsPerSecond: 1e9 },
  wifi: { name: "wifi", label: "Wi-Fi (3 ms, 200 Mbit/s)", delayMs: 3, bitsPerSecond: 200e6 }
}

/** --quick: the lead's run on 2 cores in about ten minutes (loopback and Wi-Fi only); explicit flags still win. */
const quick = process.argv.includes("--quick")
const cfg = {
  links: list(flag("links") ?? (quick ? "loopback,wifi" : "loopback,gbe,wifi")).map((name) => {
    const p = profiles[name]
    if (p === undefined) throw new Error(`unknown link "${name}" (links: ${Object.keys(profiles).join(", ")})`)
    return p
  }),
  stages: list(flag("stages") ?? "2,4").map(Number),
  clients: list(flag("clients") ?? "1,4,8").map(Number),
  tokens: Number(flag("tokens") ?? "64"),
  rounds: Math.max(1, Number(flag("rounds") ?? "1")),
  skipLlama: process.argv.includes("--skip-llama"),
  skipSwactor: process.argv.includes("--skip-swactor"),
  /** Tokens of the greedy check (RPC pipeline vs single-process llama-server); 0: no check. */
  greedyCheck: Number(flag("greedy-check") ?? "32"),
  skipDelivery: process.argv.includes("--skip-delivery"),
  /** Also run swactor with its token loop off (every token back through the orchestrator), as "swactor no loop". */
  loopAb: process.argv.includes("--loop-ab"),
  relayCheckOnly: process.argv.includes("--relay-check-only"),
  /** After each swactor case: one stream without drafts, with prompt lookup, and with every draft refused. */
  speculative: process.argv.includes("--speculative"),
  /** --speculative's draft-model row: this draft model (default: the bench model drafting for itself). */
  draftModel: flag("draft-model"),
  pin: !process.argv.includes("--no-pin"),
  dir: Path.resolve(root, process.env["BENCH_DIR"] ?? ".cache/bench")
}
const prompts = [
  "Once upon a time",
  "The little dog",
  "In a big forest",
  "One sunny day",
  "Tom and Sue",
  "A red ball",
  "The old man",
  "At the park"
]
/** --speculative's prompt: a sentence and its beginning again, so the text goes on quoting it (prompt lookup's case). */
const repetitivePrompt = "Once upon a time, there was a little girl. Once upon a time, there was a little"
const cores = Os.availableParallelism()
/** Tokens of the one request each contender serves before it is measured. */
const warmUpTokens = 8
const maxClients = Math.max(...cfg.clients)

/** The default shape: small enough that the whole default run takes about ten minutes on 2 cores. */
const defaultShape = "8x1024"
const shapeOf = (text: string): BenchShape => {
  const m = /^(\d+)x(\d+)$/.exec(text)
  if (m === null) throw new Error(`--shape ${text}: expected LAYERSxHIDDEN, e.g. 16x2048`)
  const hidden = Number(m[2])
  return {
    ...defaultBenchShape,
    layers: Number(m[1]),
    hidden,
    ffn: hidden * 4,
    heads: hidden / 64,
    kvHeads: Math.max(1, hidden / 256)
  }
}

// --------------------------------------------------------------------------------------------
// Relays (bench/wanRelay.ts in a child process) and small process helpers
// --------------------------------------------------------------------------------------------

interface Relays {
  /** A relay on 127.0.0.1 forwarding to `port` over `profile`'s link; its port (the target itself on loopback). */
  readonly front: (profile: Profile, port: number, listenPort?: number) => Promise<number>
  readonly close: () => void
}

const startRelays = (): Relays => {
  const child = track(
    spawn(process.execPath, ["--import", "tsx", Path.join(import.meta.dirname, "wanRelay.ts")], {
      stdio: ["pipe", "pipe", "inherit"]
    })
  )
  // Ahead of the benchmark's own processes when allowed (root): on a loaded machine a sleeping relay wakes late.
  try {
    Os.setPriority(child.pid!, -10)
  } catch {
    // unprivileged: default priority
  }
  const waiting = new Map<number, (answer: { port?: number; error?: string }) => void>()
  Readline.createInterface({ input: child.stdout! }).on("line", (line) => {
    const answer = JSON.parse(line) as { id: number; port?: number; error?: string }
    waiting.get(answer.id)?.(answer)
    waiting.delete(answer.id)
  })
  let next = 0
  return {
    front: (profile, port, listenPort) => {
      if (profile.delayMs === undefined) return Promise.resolve(port)
      const id = next++
      return new Promise((resolve, reject) => {
        waiting.set(id, (a) => (a.port !== undefined ? resolve(a.port) : reject(new Error(`relay: ${a.error}`))))
        child.stdin!.write(
          `${JSON.stringify({ id, target: { host: "127.0.0.1", port }, delayMs: profile.delayMs, bitsPerSecond: profile.bitsPerSecond, ...(listenPort === undefined ? {} : { listenPort }) })}\n`
        )
      })
    },
    close: () => {
      child.stdin!.end()
      child.kill("SIGTERM")
    }
  }
}

// --------------------------------------------------------------------------------------------
// The relay's own check: ping-pong RTT and bulk throughput through one relay per profile
// --------------------------------------------------------------------------------------------

const relayCheck = async (relays: Relays) => {
  // An echo server in this process (idle while the check runs).
  const echo = Net.createServer({ noDelay: true }, (s) => s.pipe(s))
  await new Promise<void>((r) => echo.listen(0, "127.0.0.1", r))
  const echoPort = (echo.address() as Net.AddressInfo).port
  // A sink that answers with the byte count when the sender ends.
  const sink = Net.createServer({ allowHalfOpen: true }, (s) => {
    let got = 0
    s.on("data", (c: Buffer) => (got += c.length))
    s.on("end", () => s.end(String(got)))
  })
  await new Promise<void>((r) => sink.listen(0, "127.0.0.1", r))
  const sinkPort = (sink.address() as Net.AddressInfo).port
  console.log(
    "\nrelay check (bench/wanRelay.ts): ping-pong RTT of 64-byte messages, 200 round trips; one-way bulk of 32 MiB"
  )
  console.log(
    "| link | RTT p50 ms | RTT p99 ms | expected RTT ms | throughput Mbit/s | cap Mbit/s |\n|---|---|---|---|---|---|"
  )
  for (const profile of [profiles["loopback"]!, profiles["gbe"]!, profiles["wifi"]!]) {
    const port = await relays.front(profile, echoPort)
    const rtts = await new Promise<Array<number>>((resolve, reject) => {
      const out: Array<number> = []
      const s = Net.createConnection({ host: "127.0.0.1", port, noDelay: true }, () => {
        let sent = performance.now()
        let got = 0
        s.on("data", (c: Buffer) => {
          got += c.length
          if (got < 64) return
          got -= 64
          out.push(performance.now() - sent)
          if (out.length === 200) {
            s.destroy()
            resolve(out)
            return
          }
          sent = performance.now()
          s.write(Buffer.alloc(64))
        })
        s.write(Buffer.alloc(64))
      })
      s.on("error", reject)
    })
    const sorted = rtts.slice(10).sort((a, b) => a - b)
    const bulkPort = await relays.front(profile, sinkPort)
    const bytes = 32 << 20
    const seconds = await new Promise<number>((resolve, reject) => {
      const started = performance.now()
      const s = Net.createConnection({ host: "127.0.0.1", port: bulkPort, allowHalfOpen: true }, () => {
        const block = Buffer.alloc(1 << 20)
        let left = bytes >> 20
        const write = () => {
          while (left > 0) {
            left--
            if (!s.write(block)) return void s.once("drain", write)
          }
          s.end()
        }
        write()
      })
      let answer = ""
      s.on("data", (c) => (answer += c))
      s.on("end", () =>
        Number(answer) === bytes
          ? resolve((performance.now() - started) / 1000)
          : reject(new Error(`sink got ${answer}`))
      )
      s.on("error", reject)
    })
    const p = (q: number) => sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))]!
    console.log(
      `| ${profile.label} | ${p(0.5).toFixed(3)} | ${p(0.99).toFixed(3)} | ${profile.delayMs === undefined ? "-" : `≥ ${(2 * profile.delayMs).toFixed(2)}`} | ` +
        `${((bytes * 8) / seconds / 1e6).toFixed(0)} | ${profile.bitsPerSecond === undefined ? "-" : (profile.bitsPerSecond / 1e6).toFixed(0)} |`
    )
  }
  echo.close()
  sink.close()
}

// --------------------------------------------------------------------------------------------
// Contenders: N concurrent streams per round
// --------------------------------------------------------------------------------------------

const swactor = async (
  model: string,
  profile: Profile,
  stages: number,
  relays: Relays,
  tokenLoop = true
): Promise<Contender> => {
  const scope = Effect.runSync(Scope.make())
  try {
    const token = generateToken()
    const dataPorts = await Promise.all(Array.from({ length: stages }, freePort))
    const dataFronts = await Promise.all(dataPorts.map((p) => relays.front(profile, p)))
    const agents = await Effect.runPromise(
      spawnLocalAgents({
        count: stages,
        token,
        threads: 1,
        extraArgs: (i) => [
          "--speed",
          "1e9",
          "--data-listen",
          `127.0.0.1:${dataPorts[i]!}`,
          "--data-advertise",
          `127.0.0.1:${dataFronts[i]!}`
        ]
      }).pipe(Scope.extend(scope))
    )
    const pinned = agents.map((a, i) => (cfg.pin ? pinProcess(a.pid, i % cores) : "not pinned"))
    const nodes = await Promise.all(agents.map(async (a) => `127.0.0.1:${await relays.front(profile, a.port)}`))
    const tokensPort = await freePort()
    const tokensFront = await relays.front(profile, tokensPort)
    const orchestrator = layerRemote({
      agents: nodes,
      token,
      listenHost: "127.0.0.1",
      dataListen: tcpAddress(tokensPort),
      dataAdvertise: tcpAddress(tokensFront)
    })
    const layer = ServerLive.layer({
      model,
      stages,
      threads: 1,
      parallel: maxClients,
      promptCache: { enabled: false },
      ...(tokenLoop ? {} : { tokenLoop: false })
    }).pipe(Layer.provide(orchestrator), Layer.provide(PromptTokenizer.layerWorker(model)))
    const runtime = ManagedRuntime.make(layer as Layer.Layer<Server>)
    await runtime.runPromise(Effect.flatMap(Server, (s) => s.ready))
    const one = (prompt: string, tokens = cfg.tokens) =>
      Effect.flatMap(Server, (server) =>
        Effect.suspend(() => {
          const start = performance.now()
          const arrivals: Array<number> = []
          return server.generate({ prompt, maxTokens: tokens, sampling: { temperature: 0 } }).pipe(
            Stream.runForEach((event) =>
              Effect.sync(() => {
                if (event._tag === "Text")
                  while (arrivals.length < event.completionTokens) arrivals.push(performance.now())
              })
            ),
            Effect.as<StreamTimes>({ start, arrivals })
          )
        })
      )
    const round = (n: number) =>
      runtime.runPromise(
        Effect.forEach(
          Array.from({ length: n }, (_, i) => prompts[i % prompts.length]!),
          (p) => one(p),
          { concurrency: "unbounded" }
        )
      )
    await runtime.runPromise(one(prompts[0]!, warmUpTokens)) // weights loaded, the first run's set-up done
    // one stream as `swactor run --timeline` runs it, on the same agents (their weights are cached), its tokens back
    // through a listener of its own behind the same link
    const oneStream = async (extra: Partial<GenerateRequest>): Promise<OneStream | undefined> => {
      const port = await freePort()
      const front = await relays.front(profile, port)
      const run = layerRemote({
        agents: nodes,
        token,
        listenHost: "127.0.0.1",
        dataListen: tcpAddress(port),
        dataAdvertise: tcpAddress(front)
      })
      const updates = await Effect.runPromise(
        Effect.flatMap(Orchestrator, (o) =>
          Stream.runCollect(
            o.run({
              model,
              prompt: prompts[0]!,
              stages,
              threads: 1,
              maxTokens: cfg.tokens,
              sampling: { temperature: 0 },
              ...(tokenLoop ? {} : { tokenLoop: false }),
              ...extra
            })
          )
        ).pipe(Effect.provide(run))
      )
      const finished = Chunk.findLast(updates, (u) => u._tag === "Finished")
      if (Option.isNone(finished) || finished.value._tag !== "Finished") return undefined
      const tokens = Chunk.toReadonlyArray(updates).flatMap((u) =>
        u._tag === "Token" && u.token.tokenId >= 0 ? [u.token.tokenId] : []
      )
      return { ...finished.value.summary, tokens }
    }
    const timeline = async () => {
      const t = (await oneStream({ timeline: true }))?.timeline
      return t === undefined ? ["no timeline: no decode step could be timed"] : renderTimeline(t)
    }
    return {
      round,
      timeline,
      speculation: () => speculationLines(oneStream, cfg.draftModel ?? model),
      setup: `agents --threads 1, ${pinned.join(" / ")}`,
      close: async () => {
        await runtime.dispose()
        await Effect.runPromise(Scope.close(scope, Exit.void))
      }
    }
  } catch (error) {
    await Effect.runPromise(Scope.close(scope, Exit.void))
    throw error
  }
}

/** One stream's summary and its token ids. */
type OneStream = RunSummary & { readonly tokens: ReadonlyArray<number> }

/**
 * --speculative: one stream of `repetitivePrompt` without drafts, with prompt lookup (the text quotes the prompt again,
 * as when a document is re-quoted or code edited), and with a prediction that is always wrong (every draft refused: the cost of drafting in vain), each
 * its decode tok/s, acceptance, and whether its text is the text without drafts. Best of `rounds`.
 */
const speculationLines = async (
  oneStream: (extra: Partial<GenerateRequest>) => Promise<OneStream | undefined>,
  draftModel: string
): Promise<ReadonlyArray<string>> => {
  const best = async (extra: Partial<GenerateRequest>) => {
    let top: OneStream | undefined
    for (let r = 0; r < cfg.rounds; r++) {
      const s = await oneStream(extra)
      if (s !== undefined && (top === undefined || s.decodeTokensPerSecond > top.decodeTokensPerSecond)) top = s
    }
    if (top === undefined) throw new Error("a speculation stream did not finish")
    return top
  }
  const prompt = repetitivePrompt
  const off = await best({ prompt })
  const lookup = await best({ prompt, speculative: { mode: "ngram" } })
  const predicted = Array.from({ length: cfg.tokens }, () => 3)
  const refused = await best({ prompt, speculative: { mode: "ngram", predicted } })
  // an edit that changes little (OpenAI's predicted outputs): the output itself with one token in 16 changed
  const edited = off.tokens.map((t, i) => (i % 16 === 15 ? (t + 1) % 256 : t))
  const edit = await best({ prompt, speculative: { mode: "ngram", predicted: edited } })
  // a draft model on stage 0's node (--draft-model; default the model drafting for itself: every draft kept, at the
  // cost of a whole model's forward per draft on stage 0's node)
  const drafted = await best({ prompt, speculative: { mode: "draft", draftModel } })
  const line = (name: string, s: RunSummary) => {
    const spec = s.speculative
    const rate =
      spec === undefined || spec.drafted === 0 ? "-" : `${((100 * spec.accepted) / spec.drafted).toFixed(0)}%`
    return (
      `${name}: ${fmt(s.decodeTokensPerSecond)} tok/s (${(s.decodeTokensPerSecond / off.decodeTokensPerSecond).toFixed(2)}x ` +
      `off), ${spec?.steps ?? 0} steps drafted ${spec?.drafted ?? 0} tokens, ${spec?.accepted ?? 0} kept (acceptance ${rate}), ` +
      `text ${s.text === off.text ? "same as off" : "DIFFERS from off"}`
    )
  }
  return [
    `off: ${fmt(off.decodeTokensPerSecond)} tok/s`,
    line("prompt lookup", lookup),
    line("every draft refused", refused),
    line("a prediction 15/16 right", edit),
    line(`draft model ${Path.basename(draftModel)}`, drafted)
  ]
}

// --------------------------------------------------------------------------------------------
// Figures
// --------------------------------------------------------------------------------------------

const median = (xs: ReadonlyArray<number>) =>
  xs.length === 0 ? Number.NaN : [...xs].sort((a, b) => a - b)[xs.length >> 1]!

/** Decoded tokens (after each stream's first) over the time from the earliest first token to the last token. */
const aggregate = (streams: ReadonlyArray<StreamTimes>) => {
  const firsts = streams.map((s) => s.arrivals[0] ?? Number.NaN)
  const lasts = streams.map((s) => s.arrivals.at(-1) ?? Number.NaN)
  const decoded = streams.reduce((n, s) => n + Math.max(0, s.arrivals.length - 1), 0)
  const span = (Math.max(...lasts) - Math.min(...firsts)) / 1000
  return span > 0 ? decoded / span : Number.NaN
}
const ttft = (streams: ReadonlyArray<StreamTimes>) =>
  median(streams.map((s) => (s.arrivals[0] ?? Number.NaN) - s.start))

interface Cell {
  /** Per N: the median round's aggregate tok/s. */
  readonly aggregate: Map<number, number>
  /** N=1 time to first token, ms (median round). */
  readonly ttft: number
  /** N=1 median gap between tokens, ms (over the rounds' tokens). */
  readonly gap: number
}

const measure = async (contender: Contender): Promise<Cell> => {
  const byN = new Map<number, number>()
  const ttfts: Array<number> = []
  const gaps: Array<number> = []
  for (const n of cfg.clients) {
    const rounds: Array<number> = []
    for (let r = 0; r < cfg.rounds; r++) {
      const streams = await contender.round(n)
      rounds.push(aggregate(streams))
      if (n === 1) {
        ttfts.push(ttft(streams))
        for (const s of streams) gaps.push(...s.arrivals.slice(1).map((t, i) => t - s.arrivals[i]!))
      }
    }
    byN.set(n, median(rounds))
  }
  return { aggregate: byN, ttft: median(ttfts), gap: median(gaps) }
}

const fmt = (x: number | undefined, digits = 1) => (x !== undefined && Number.isFinite(x) ? x.toFixed(digits) : "-")

// --------------------------------------------------------------------------------------------
// Weight delivery to an empty node over the Wi-Fi link
// --------------------------------------------------------------------------------------------

const delivery = (model: string, relays: Relays) =>
  Effect.gen(function* () {
    const wifi = profiles["wifi"]!
    const token = generateToken()
    const dir = Fs.mkdtempSync(Path.join(Os.tmpdir(), "swactor-bench-wan-"))
    yield* Effect.addFinalizer(() => Effect.sync(() => Fs.rmSync(dir, { recursive: true, force: true })))
    const cache = Path.join(dir, "agent-cache")
    const [agent] = yield* spawnLocalAgents({
      count: 1,
      token,
      threads: 1,
      extraArgs: () => ["--cache-dir", cache, "--slices-only", "--speed", "1e9"]
    })
    const front = yield* Effect.promise(() => relays.front(wifi, agent!.port))
    const control = yield* AgentControl.pipe(Effect.provide(AgentControlRpc.layer))
    const link = yield* control.connect({ nodeId: NodeId.make(1), address: `127.0.0.1:${front}` }, token)
    const numLayers = (yield* readGgufFile(model)).tensors.reduce((n, t) => {
      const m = /^blk\.(\d+)\./.exec(t.name)
      return m === null ? n : Math.max(n, Number(m[1]) + 1)
    }, 0)
    const input = {
      modelPath: model,
      placement: [{ stageIndex: 0, nodeId: 1 }],
      layerRanges: [[0, Math.ceil(numLayers / 2)] as const],
      outgoingDir: Path.join(dir, "outgoing"),
      linkOf: () => link
    }
    // The first delivery also does the orchestrator's one-time work (stage hash, outgoing slice); the second is timed.
    yield* deliverWeights(input, () => Effect.void)
    Fs.rmSync(cache, { recursive: true, force: true })
    const started = performance.now()
    const [sent] = yield* deliverWeights(input, () => Effect.void)
    const seconds = (performance.now() - started) / 1000
    const bytes = sent!.sentBytes
    const lineSeconds = (bytes * 8) / wifi.bitsPerSecond!
    console.log(
      `\nweight delivery over ${wifi.label} to an agent with an empty cache: stage 0 of 2 (blocks [0, ${Math.ceil(numLayers / 2)})), ` +
        `${(bytes / 2 ** 20).toFixed(1)} MiB sent (${sent!.via}) in ${seconds.toFixed(2)} s = ${((bytes * 8) / seconds / 1e6).toFixed(0)} Mbit/s; ` +
        `the link's line rate alone: ${lineSeconds.toFixed(2)} s (${(lineSeconds / seconds).toFixed(2)}× of it)`
    )
  }).pipe(Effect.scoped)

// --------------------------------------------------------------------------------------------

const main = async () => {
  installCleanup()
  const started = performance.now()
  // The tools first: a missing or broken pair is one line before anything else runs.
  const tools = cfg.skipLlama
    ? undefined
    : findLlamaTools(root, flag("llama-tools") ?? process.env["BENCH_LLAMA_TOOLS"])
  if (tools !== undefined && "error" in tools) {
    console.error(`bench:wan: ${tools.error}`)
    process.exit(2)
  }
  const bin = tools?.bin
  const model =
    flag("model") !== undefined
      ? Path.resolve(flag("model")!)
      : await ensureBenchModel(cfg.dir, shapeOf(flag("shape") ?? defaultShape))
  console.log(
    `bench:wan ${model} (${(Fs.statSync(model).size / 2 ** 20).toFixed(0)} MiB); links ${cfg.links.map((l) => l.name).join(", ")}; ` +
      `stages ${cfg.stages.join(", ")}; N ${cfg.clients.join(", ")}; ${cfg.tokens} tokens per stream, greedy; ${cfg.rounds} round(s); ` +
      `1 thread per stage${cfg.pin ? `, pinned to core i mod ${cores}` : " (not pinned)"}; load ${Os.loadavg()
        .map((x) => x.toFixed(2))
        .join(" ")}`
  )
  if (tools !== undefined) {
    console.log(
      `llama.cpp ${tools.version}, ${tools.bin}: llama-server --rpc -ngl 999 --device RPC0.. -t 1 over one ggml-rpc-server -t 1 -c per stage, ` +
        `swactor's split (equal block counts, head on the last stage)`
    )
  }
  const cacheDir = Path.join(cfg.dir, "rpc-cache")
  let reference: ReadonlyArray<number> | undefined
  if (bin !== undefined && cfg.greedyCheck > 0) {
    reference = await llamaReference(bin, model, cacheDir, prompts[0]!, cfg.greedyCheck)
    console.log(
      `greedy reference: single-process llama-server -t 1 (no repack, flash attention, F16 KV), "${prompts[0]}", ${reference.length} tokens`
    )
  }
  const greedyFailures: Array<string> = []
  const relays = startRelays()
  const cells = new Map<string, Cell>()
  const key = (link: string, stages: number, who: string) => `${link}/${stages}/${who}`
  try {
    await relayCheck(relays)
    if (cfg.relayCheckOnly) return
    for (const profile of cfg.links) {
      for (const stages of cfg.stages) {
        const runs: Array<[string, () => Promise<Contender>]> = []
        if (!cfg.skipSwactor) runs.push(["swactor", () => swactor(model, profile, stages, relays)])
        if (!cfg.skipSwactor && cfg.loopAb)
          runs.push(["swactor no loop", () => swactor(model, profile, stages, relays, false)])
        if (bin !== undefined) {
          runs.push([
            "llama.cpp",
            () =>
              llamaRpc({
                bin,
                model,
                cacheDir,
                stages,
                front: (port) => relays.front(profile, port),
                coreOf: (i) => (cfg.pin ? i % cores : undefined),
                maxClients,
                tokens: cfg.tokens,
                warmUpTokens,
                prompts,
                ...(reference === undefined ? {} : { reference })
              })
          ])
        }
        for (const [who, make] of runs) {
          const t = performance.now()
          const contender = await make()
          if (contender.setup !== undefined)
            console.log(`  ${profile.name} ${stages} stages ${who}: ${contender.setup}`)
          if (contender.greedyOk === false) greedyFailures.push(`${profile.name} ${stages} stages`)
          try {
            cells.set(key(profile.name, stages, who), await measure(contender))
            if (contender.speculation !== undefined && cfg.speculative) {
              console.log(`  ${profile.name} ${stages} stages ${who}, one stream, speculative decoding:`)
              for (const line of await contender.speculation()) console.log(`    ${line}`)
            }
            if (contender.timeline !== undefined && cfg.clients.includes(1)) {
              const lines = await contender.timeline()
              console.log(`  ${profile.name} ${stages} stages ${who}, one stream (run --timeline):`)
              for (const line of lines) console.log(`    ${line}`)
            }
          } finally {
            await contender.close()
          }
          const cell = cells.get(key(profile.name, stages, who))!
          console.log(
            `  ${profile.name} ${stages} stages ${who}: N=1 ${fmt(cell.aggregate.get(1))} tok/s (gap p50 ${fmt(cell.gap)} ms), TTFT ${fmt(cell.ttft, 0)} ms, ` +
              cfg.clients
                .filter((n) => n > 1)
                .map((n) => `N=${n} ${fmt(cell.aggregate.get(n))}`)
                .join(", ") +
              ` (${((performance.now() - t) / 1000).toFixed(0)} s)`
          )
        }
      }
    }
    if (!cfg.skipDelivery && cfg.links.some((l) => l.name === "wifi")) await Effect.runPromise(delivery(model, relays))
  } finally {
    relays.close()
  }

  const many = cfg.clients.filter((n) => n > 1)
  console.log(
    `\n| link | stages | contender | N=1 decode tok/s | N=1 token gap p50 ms | ${many.map((n) => `N=${n} agg tok/s`).join(" | ")} | TTFT ms (N=1) |`
  )
  console.log(`|---|---|---|---|---|${many.map(() => "---|").join("")}---|`)
  for (const profile of cfg.links) {
    for (const stages of cfg.stages) {
      for (const who of ["swactor", "swactor no loop", "llama.cpp"]) {
        const c = cells.get(key(profile.name, stages, who))
        if (c === undefined) continue
        console.log(
          `| ${profile.label} | ${stages} | ${who} | ${fmt(c.aggregate.get(1))} | ${fmt(c.gap)} | ${many.map((n) => fmt(c.aggregate.get(n))).join(" | ")} | ${fmt(c.ttft, 0)} |`
        )
      }
    }
  }
  // The issue's targets.
  console.log("\ntargets:")
  for (const [link, want] of [
    ["loopback", 2],
    ["wifi", 3]
  ] as const) {
    for (const stages of cfg.stages) {
      const s = cells.get(key(link, stages, "swactor"))
      const l = cells.get(key(link, stages, "llama.cpp"))
      if (s === undefined || l === undefined) continue
      for (const n of many.filter((n) => n === 4 || n === 8)) {
        const ratio = s.aggregate.get(n)! / l.aggregate.get(n)!
        console.log(
          `  ${link} ${stages} stages N=${n}: swactor ${fmt(ratio, 2)}× llama.cpp RPC (target ≥ ${want}×) ${ratio >= want ? "met" : "NOT met"}`
        )
      }
    }
  }
  const wifi4 = cells.get(key("wifi", 4, "swactor"))
  const loop4 = cells.get(key("loopback", 4, "swactor"))
  if (wifi4 !== undefined && loop4 !== undefined) {
    const ratio = wifi4.aggregate.get(1)! / loop4.aggregate.get(1)!
    console.log(
      `  swactor single-stream decode, 4 stages: Wi-Fi ${fmt(ratio, 2)}× loopback (target ≥ 0.8×) ${ratio >= 0.8 ? "met" : "NOT met"}`
    )
  }
  if (reference !== undefined) {
    console.log(
      greedyFailures.length === 0
        ? `  llama.cpp RPC greedy check: every run's ${reference.length} tokens equal single-process llama-server's`
        : `  llama.cpp RPC greedy check FAILED: ${greedyFailures.join(", ")} (see the lines above)`
    )
  }
  console.log(
    `\ntotal ${((performance.now() - started) / 1000).toFixed(0)} s; load ${Os.loadavg()
      .map((x) => x.toFixed(2))
      .join(" ")}`
  )
}

main().then(
  () => process.exit(0),
  (error: unknown) => {
    console.error(error)
    process.exit(1)
  }
)
