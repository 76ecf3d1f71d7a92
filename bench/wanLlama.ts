/**
 * bench:wan's llama.cpp contender: llama-server --rpc over one ggml-rpc-server per stage, each behind a relay.
 *
 * - The tools: found (--llama-tools DIR, BENCH_LLAMA_TOOLS, .cache/llama-tools/build/bin, /tmp/llama-build/bin) and
 *   run once (`llama-server --version`) before anything is measured; a missing or broken pair is one line.
 * - The split is swactor's own Balanced split (Planner.partitionLayers: equal block counts, the output head on the
 *   last stage). llama.cpp counts the output head as layer n of n+1 and gives layer i to the first device whose
 *   cumulative --tensor-split share exceeds i/(n+1) (src/llama-model.cpp); the shares put each boundary half a layer
 *   below the block boundary wanted. `--device RPC0..` with `-ngl 999` offloads every block and the output head; the
 *   token embedding stays on llama-server's CPU, as llama.cpp always keeps the input layer (a row lookup). `-fit off`:
 *   nothing is re-fitted behind the bench's back.
 * - After load the bench reads llama-server's own log (-lv 4) and refuses to measure unless every block and the head
 *   were offloaded, llama-server's CPU holds only the embedding's bytes and no KV cache, and each rpc-server's weights
 *   and KV cache are its blocks' (from the GGUF's tensor sizes).
 * - Each ggml-rpc-server runs `-t 1` and is pinned to core i mod cores (read back from /proc); llama-server `-t 1`,
 *   not pinned (like swactor's orchestrator, the bench process).
 * - Greedy check: the tokens of one greedy request through the RPC pipeline are compared with single-process
 *   llama-server's for the same prompt, model and settings (flash attention on, F16 KV, 1 thread, weight repacking
 *   off: ggml-rpc-server's CPU device uses plain buffers, so both run the same kernels).
 */
import { type ChildProcess, spawn, spawnSync } from "node:child_process"
import * as Fs from "node:fs"
import * as Path from "node:path"
import { Effect } from "effect"
import { readGgufFile } from "../src/layers/gguf/GgufReader.js"
import { partitionLayers } from "../src/services/Planner.js"
import { forEachStreamedToken } from "./llamaServerStream.js"
import { freePort, pinProcess, stopAll, track, waitForPort } from "./wanProcesses.js"

export interface StreamTimes {
  readonly start: number
  readonly arrivals: ReadonlyArray<number>
}

export interface Contender {
  readonly round: (n: number) => Promise<ReadonlyArray<StreamTimes>>
  readonly close: () => Promise<void>
  /** One line on how the contender was set up and checked (llama.cpp: split, pinning, greedy check). */
  readonly setup?: string
  /** false when the greedy check failed. */
  readonly greedyOk?: boolean
  /** One stream's per-token timeline (swactor: `run --timeline` on the same agents), as table lines. */
  readonly timeline?: () => Promise<ReadonlyArray<string>>
  /** swactor: one stream with speculative decoding off, by prompt lookup, and with every draft refused (--speculative). */
  readonly speculation?: () => Promise<ReadonlyArray<string>>
}

/** The llama.cpp tools to use, or one line saying why there are none. */
export const findLlamaTools = (
  root: string,
  explicit: string | undefined
): { readonly bin: string; readonly version: string } | { readonly error: string } => {
  const dirs =
    explicit !== undefined ? [explicit] : [Path.join(root, ".cache/llama-tools/build/bin"), "/tmp/llama-build/bin"]
  const has = (d: string, tool: string) => {
    try {
      Fs.accessSync(Path.join(d, tool), Fs.constants.X_OK)
      return true
    } catch {
      return false
    }
  }
  const bin = dirs.find((d) => has(d, "llama-server") && has(d, "ggml-rpc-server"))
  if (bin === undefined) {
    return {
      error:
        `llama.cpp tools not found: no executable llama-server and ggml-rpc-server in ${dirs.join(" or ")}; ` +
        `build them with scripts/build-llama-tools.sh (or pass --llama-tools DIR, or --skip-llama)`
    }
  }
  // Built with GGML_BACKEND_DL: the backends are loaded from the tools' own folder at start.
  const files = Fs.readdirSync(bin)
  if (!files.includes("libggml-rpc.so") || !files.some((f) => /^libggml-cpu.*\.so$/.test(f))) {
    return {
      error: `llama.cpp tools in ${bin} lack their backends (libggml-rpc.so, libggml-cpu*.so beside them); rebuild them with scripts/build-llama-tools.sh`
    }
  }
  const run = spawnSync(Path.join(bin, "llama-server"), ["--version"], {
    env: { ...process.env, LD_LIBRARY_PATH: bin },
    encoding: "utf8",
    timeout: 30_000
  })
  const said = `${run.stdout ?? ""}${run.stderr ?? ""}`
  const version = /version: .*/.exec(said)
  if (run.status === 0 && version !== null) return { bin, version: version[0] }
  const why = said.trim().split("\n").at(-1) || (run.error?.message ?? `exit ${run.status ?? run.signal}`)
  return {
    error: `llama.cpp tools in ${bin} do not run (llama-server --version: ${why}); rebuild them with scripts/build-llama-tools.sh`
  }
}

const envOf = (bin: string, cacheDir: string) => ({ ...process.env, LD_LIBRARY_PATH: bin, LLAMA_CACHE: cacheDir })

/** Byte-valued tokens banned in every request, as bench:serve does (the synthetic model's byte tokens). */
const logitBias = Array.from({ length: 256 }, (_, i) => [i + 3, false])

/** Context cells per llama-server slot: the prompt plus `tokens`, rounded up to 256. */
const slotContext = (tokens: number) => 256 * Math.ceil((tokens + 64) / 256)

interface LlamaServer {
  readonly url: string
  readonly child: ChildProcess
  /** The first 256 KiB of its log (the load), then nothing. */
  readonly loadLog: () => string
  readonly tail: () => string
}

const startLlamaServer = async (
  bin: string,
  env: NodeJS.ProcessEnv,
  args: ReadonlyArray<string>
): Promise<LlamaServer> => {
  const port = await freePort()
  const child = track(
    spawn(
      Path.join(bin, "llama-server"),
      [...args, "--port", String(port), "--host", "127.0.0.1", "--no-webui", "-lv", "4"],
      {
        env,
        stdio: ["ignore", "pipe", "pipe"]
      }
    )
  )
  let head = ""
  let tail = ""
  const onData = (c: Buffer) => {
    const text = String(c)
    if (head.length < 256 << 10) head += text
    tail = (tail + text).slice(-4000)
  }
  child.stdout!.on("data", onData)
  child.stderr!.on("data", onData)
  const url = `http://127.0.0.1:${port}`
  for (let i = 0; ; i++) {
    if (
      await fetch(`${url}/health`).then(
        (r) => r.ok,
        () => false
      )
    )
      break
    if (i > 3000 || child.exitCode !== null) {
      await stopAll([child])
      throw new Error(`llama-server did not become ready (exit ${child.exitCode}):\n${tail}`)
    }
    await new Promise((r) => setTimeout(r, 100))
  }
  return { url, child, loadLog: () => head, tail: () => tail }
}

/** One greedy request's token ids (not streamed). */
const greedyTokens = async (url: string, prompt: string, tokens: number): Promise<ReadonlyArray<number>> => {
  const response = await fetch(`${url}/completion`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({
      prompt,
      n_predict: tokens,
      temperature: 0,
      cache_prompt: false,
      return_tokens: true,
      logit_bias: logitBias
    })
  })
  if (!response.ok) throw new Error(`llama-server /completion: HTTP ${response.status} ${await response.text()}`)
  const body = (await response.json()) as { tokens?: ReadonlyArray<number> }
  if (body.tokens === undefined || body.tokens.length === 0)
    throw new Error("llama-server /completion returned no token ids (return_tokens)")
  return body.tokens
}

/** Single-process llama-server's greedy tokens for `prompt`: the reference of every RPC run's greedy check. */
export const llamaReference = async (bin: string, model: string, cacheDir: string, prompt: string, tokens: number) => {
  const server = await startLlamaServer(bin, envOf(bin, cacheDir), [
    "-m",
    model,
    "-ngl",
    "0",
    "--no-repack",
    "-fit",
    "off",
    "-t",
    "1",
    "-tb",
    "1",
    "-np",
    "1",
    "-c",
    String(slotContext(tokens)),
    "-fa",
    "on"
  ])
  try {
    return await greedyTokens(server.url, prompt, tokens)
  } finally {
    await stopAll([server.child])
  }
}

// --------------------------------------------------------------------------------------------
// Where llama.cpp put the weights: its log against the GGUF's tensor sizes
// --------------------------------------------------------------------------------------------

interface ModelBytes {
  readonly numLayers: number
  /** Bytes of each block's tensors (blk.i.*). */
  readonly block: ReadonlyArray<number>
  /** Tensors that are neither blocks nor the output head (the embedding): llama.cpp keeps them on the CPU. */
  readonly input: number
  /** output.weight + output_norm.weight, or the embedding again when the head is tied. */
  readonly output: number
}

const modelBytes = async (model: string): Promise<ModelBytes> => {
  const file = await Effect.runPromise(readGgufFile(model))
  const block: Array<number> = []
  let input = 0
  let output = 0
  for (const t of file.tensors) {
    const m = /^blk\.(\d+)\./.exec(t.name)
    if (m !== null) block[Number(m[1])] = (block[Number(m[1])] ?? 0) + t.byteSize
    else if (t.name.startsWith("output")) output += t.byteSize
    else input += t.byteSize
  }
  if (!file.tensorsByName.has("output.weight")) output += file.tensorsByName.get("token_embd.weight")?.byteSize ?? 0
  return { numLayers: block.length, block: Array.from(block, (b) => b ?? 0), input, output }
}

/** --tensor-split shares giving device k exactly blocks `ranges[k]` (and the output head to the last device). */
const tensorSplitFor = (ranges: ReadonlyArray<readonly [number, number]>): ReadonlyArray<number> =>
  ranges.map(([start, end], k) => {
    const lower = k === 0 ? 0 : start - 0.5
    const upper = k === ranges.length - 1 ? ranges.at(-1)![1] + 1 : end - 0.5
    return upper - lower
  })

const mib = (bytes: number) => bytes / 2 ** 20
const near = (gotMib: number, wantBytes: number) => Math.abs(gotMib - mib(wantBytes)) <= 0.01 * mib(wantBytes) + 0.05

/** Checks llama-server's load log; returns a one-line summary, or throws naming what is not where it should be. */
const checkPlacement = (
  log: string,
  bytes: ModelBytes,
  ranges: ReadonlyArray<readonly [number, number]>,
  endpoints: ReadonlyArray<string>
): string => {
  const problems: Array<string> = []
  const offloaded = /offloaded (\d+)\/(\d+) layers to GPU/.exec(log)
  const want = bytes.numLayers + 1
  if (offloaded === null || Number(offloaded[1]) !== want || Number(offloaded[2]) !== want) {
    problems.push(
      `offloaded ${offloaded === null ? "?" : `${offloaded[1]}/${offloaded[2]}`} layers, want ${want}/${want}`
    )
  }
  // Model buffers: "CPU_Mapped model buffer size = X MiB", "RPC0[127.0.0.1:PORT] model buffer size = X MiB".
  let cpuMib = 0
  const rpcModel = new Map<string, number>()
  for (const m of log.matchAll(/load_tensors:\s+(\S+) model buffer size =\s*([\d.]+) MiB/g)) {
    const at = /\[(.+)\]$/.exec(m[1]!)
    if (m[1]!.startsWith("CPU")) cpuMib += Number(m[2])
    else if (at !== null) rpcModel.set(at[1]!, (rpcModel.get(at[1]!) ?? 0) + Number(m[2]))
  }
  if (!near(cpuMib, bytes.input))
    problems.push(
      `llama-server's CPU holds ${cpuMib.toFixed(2)} MiB of weights, want the embedding's ${mib(bytes.input).toFixed(2)}`
    )
  if (/llama_kv_cache:\s+CPU KV buffer/.test(log)) problems.push("llama-server's CPU holds a KV buffer")
  const kvTotal = /llama_kv_cache: size =\s*([\d.]+) MiB \(\s*\d+ cells,\s*(\d+) layers/.exec(log)
  const rpcKv = new Map<string, number>()
  for (const m of log.matchAll(/llama_kv_cache:\s+\S+\[(.+)\] KV buffer size =\s*([\d.]+) MiB/g))
    rpcKv.set(m[1]!, Number(m[2]))
  const parts = ranges.map(([start, end], k) => {
    const endpoint = endpoints[k]!
    const want = bytes.block.slice(start, end).reduce((a, b) => a + b, 0) + (k === ranges.length - 1 ? bytes.output : 0)
    const got = rpcModel.get(endpoint)
    if (got === undefined || !near(got, want))
      problems.push(
        `${endpoint} holds ${got?.toFixed(2) ?? "no"} MiB of weights, want ${mib(want).toFixed(2)} (blocks [${start}, ${end}))`
      )
    const kv = rpcKv.get(endpoint)
    if (kvTotal !== null) {
      const wantKv = (Number(kvTotal[1]) * (end - start)) / Number(kvTotal[2])
      if (kv === undefined || Math.abs(kv - wantKv) > 0.011)
        problems.push(`${endpoint} KV ${kv ?? "none"} MiB, want ${wantKv.toFixed(2)} (${end - start} blocks)`)
    } else problems.push("no KV cache size line in llama-server's log")
    return `[${start},${end})${k === ranges.length - 1 ? "+head" : ""} ${got?.toFixed(1) ?? "?"} MiB`
  })
  // The compute graph's pieces: the embedding lookup on llama-server's CPU, then one per rpc-server (head on the last).
  const splits = /graph splits = (\d+)/.exec(log)?.[1] ?? "?"
  if (splits !== String(ranges.length + 1))
    problems.push(
      `the graph has ${splits} splits, want ${ranges.length + 1} (the lookup on the CPU + one per rpc-server)`
    )
  if (problems.length > 0)
    throw new Error(`llama.cpp did not place the model as the bench asked: ${problems.join("; ")}`)
  return `rpc-servers ${parts.join(", ")}; llama-server CPU: embedding only (${cpuMib.toFixed(1)} MiB), no KV; graph splits ${splits}`
}

// --------------------------------------------------------------------------------------------

export interface LlamaRpcOptions {
  readonly bin: string
  readonly model: string
  readonly cacheDir: string
  readonly stages: number
  /** The relay in front of a port (the port itself on plain loopback). */
  readonly front: (port: number) => Promise<number>
  /** Core for stage i, or undefined: not pinned. */
  readonly coreOf: (i: number) => number | undefined
  readonly maxClients: number
  readonly tokens: number
  readonly warmUpTokens: number
  readonly prompts: ReadonlyArray<string>
  /** Single-process llama-server's greedy tokens for prompts[0] (llamaReference), compared after warm-up. */
  readonly reference?: ReadonlyArray<number>
}

export const llamaRpc = async (o: LlamaRpcOptions): Promise<Contender> => {
  const children: Array<ChildProcess> = []
  const env = envOf(o.bin, o.cacheDir)
  const close = () => stopAll(children)
  try {
    const bytes = await modelBytes(o.model)
    const ranges = partitionLayers(bytes.numLayers, o.stages)
    const rpcFronts: Array<number> = []
    const pinned: Array<string> = []
    for (let i = 0; i < o.stages; i++) {
      const port = await freePort()
      // -c: tensors cached by hash on the server's side, so a later load sends hashes, not weights, over the link.
      const child = track(
        spawn(Path.join(o.bin, "ggml-rpc-server"), ["-H", "127.0.0.1", "-p", String(port), "-t", "1", "-c"], {
          env,
          stdio: ["ignore", "ignore", "pipe"]
        })
      )
      children.push(child)
      let tail = ""
      child.stderr!.on("data", (c) => (tail = (tail + String(c)).slice(-2000)))
      await waitForPort(port, child, "ggml-rpc-server", () => tail)
      const core = o.coreOf(i)
      pinned.push(core === undefined ? "not pinned" : pinProcess(child.pid!, core))
      rpcFronts.push(await o.front(port))
    }
    const endpoints = rpcFronts.map((p) => `127.0.0.1:${p}`)
    const server = await startLlamaServer(o.bin, env, [
      "-m",
      o.model,
      "--rpc",
      endpoints.join(","),
      "--device",
      endpoints.map((_, i) => `RPC${i}`).join(","),
      "-ngl",
      "999",
      "-ts",
      tensorSplitFor(ranges).join(","),
      "-fit",
      "off",
      "-t",
      "1",
      "-tb",
      "1",
      "-np",
      String(o.maxClients),
      "-c",
      String(o.maxClients * slotContext(o.tokens)),
      "-fa",
      "on"
    ])
    children.push(server.child)
    const placement = checkPlacement(server.loadLog(), bytes, ranges, endpoints)
    const one = async (prompt: string, tokens = o.tokens): Promise<StreamTimes> => {
      const start = performance.now()
      const response = await fetch(`${server.url}/completion`, {
        method: "POST",
        headers: { "content-type": "application/json" },
        body: JSON.stringify({
          prompt,
          n_predict: tokens,
          temperature: 0,
          stream: true,
          cache_prompt: false,
          logit_bias: logitBias
        })
      })
      const arrivals: Array<number> = []
      await forEachStreamedToken(response, () => void arrivals.push(performance.now()))
      return { start, arrivals }
    }
    const round = (n: number) => Promise.all(Array.from({ length: n }, (_, i) => one(o.prompts[i % o.prompts.length]!)))
    await one(o.prompts[0]!, o.warmUpTokens)
    let greedy = "greedy check skipped"
    let greedyOk: boolean | undefined
    if (o.reference !== undefined) {
      const got = await greedyTokens(server.url, o.prompts[0]!, o.reference.length)
      const at = o.reference.findIndex((t, i) => got[i] !== t)
      greedyOk = at < 0 && got.length === o.reference.length
      greedy = greedyOk
        ? `greedy ${got.length} tokens = single-process llama-server`
        : `greedy DIFFERS from single-process llama-server at token ${at < 0 ? got.length : at} (${got[at] ?? "end"} vs ${o.reference[at] ?? "end"})`
    }
    const setup = `${placement}; rpc-servers -t 1, ${pinned.join(" / ")}; ${greedy}`
    return { round, close, setup, ...(greedyOk === undefined ? {} : { greedyOk }) }
  } catch (error) {
    await close()
    throw error
  }
}
