/**
 * Activation hop latency over the real data plane (framing + auth + window + transports).
 *
 * Two OS processes, as in a real pipeline: this process and a forked echo stage. Each iteration
 * sends one activation frame (1 token × hidden 2048 f32 = 8 KiB payload) on edge A→B; the echo
 * stage receives it and sends it back on edge B→A. hop = round trip / 2, so each hop includes
 * encode, socket write, wake-up, decode, step check and credit on both sides.
 *
 * Transports: loopback TCP, loopback TCP in TLS 1.3 (SWACTOR_TLS=always on both ends: what a link
 * between hosts pays), a Unix socket, and shared memory (a /dev/shm ring with PendingBit doorbells
 * over the Unix socket; ShmRing.ts).
 *
 * Usage: npm run bench:hop [-- --iterations 5000 --hidden 2048 --model FILE.gguf --spin 0 --only Tcp,TlsTcp]
 * (`--model`: the frame is that model's activation, a token's width as the planner counts it: readModelFacts'
 * hiddenDim, n_embd x hyper_connection.count for deepseek4.)
 * (`--spin N`: shared-memory receivers busy-poll N µs before sleeping — only useful with idle cores.)
 */
import { fork } from "node:child_process"
import { rmSync } from "node:fs"
import * as Os from "node:os"
import * as Path from "node:path"
import { Effect, Redacted } from "effect"
import { ActivationFrame, type TransportAddress } from "../src/domain/frames.js"
import type { EdgeId, RunId } from "../src/domain/ids.js"
import type { RingSpec } from "../src/domain/plan.js"
import { Settings } from "../src/layers/config/Settings.js"
import { readModelFacts } from "../src/layers/gguf/ModelCatalogLive.js"
import * as EdgeTransport from "../src/layers/transport/EdgeTransport.js"

const arg = (name: string, fallback: number) => {
  const i = process.argv.indexOf(`--${name}`)
  return i >= 0 ? Number(process.argv[i + 1]) : fallback
}
const iterations = arg("iterations", 5000)
const warmup = arg("warmup", 500)
const modelAt = process.argv.indexOf("--model")
const hidden =
  modelAt >= 0 ? (await Effect.runPromise(readModelFacts(process.argv[modelAt + 1]!))).hiddenDim : arg("hidden", 2048)
const runId = 1 as RunId
const forward = 1 as EdgeId
const back = 2 as EdgeId
const ring: RingSpec = {
  dataCapacity: 256 * 1024,
  alignment: 64,
  direction: "Egress",
  hostPinning: "Pageable",
  wakeCoalescing: "PendingBit"
}

type Transport = "Tcp" | "TlsTcp" | "Unix" | "Shm"

interface Setup {
  readonly token: string
  readonly transport: Transport
  readonly home: TransportAddress
}

/** Shared memory: busy-poll this long before sleeping on the doorbell (default 0: doorbells only). */
const spin = arg("spin", 0)
const spinFor = (transport: Transport) => (transport === "Shm" ? spin : 0)

const listenAddress = (transport: Transport, tag: string): TransportAddress =>
  transport === "Tcp" || transport === "TlsTcp"
    ? { _tag: "Tcp", host: "127.0.0.1", port: 0 }
    : { _tag: "Unix", path: Path.join(Os.tmpdir(), `swactor-hop-${process.pid}-${tag}.sock`) }

/** The echo stage: receives on `forward`, sends the same activation back on `back`. */
const echo = (setup: Setup) =>
  Effect.scoped(
    Effect.gen(function* () {
      const token = Redacted.make(setup.token)
      const listener = yield* EdgeTransport.listen({ address: listenAddress(setup.transport, "echo"), token })
      const inbound = yield* listener.register({ runId, edgeId: forward, ring, spinMicros: spinFor(setup.transport) })
      process.send!({ address: listener.address })
      yield* inbound.attached
      const sender = yield* EdgeTransport.connect({
        address: setup.home,
        token,
        runId,
        edgeId: back,
        ring,
        sharedMemory: setup.transport === "Shm"
      })
      for (;;) {
        const frames = yield* inbound.receive
        for (const f of frames) yield* sender.send(ActivationFrame({ ...(f as ActivationFrame), edgeId: back }))
      }
    })
  )

const percentile = (sorted: ReadonlyArray<number>, p: number) =>
  sorted[Math.min(sorted.length - 1, Math.floor(p * sorted.length))]!

/** Both processes: TLS on every TCP link for TlsTcp, plain otherwise (this one's Settings, the echo's environment). */
const tlsOf = (transport: Transport) => (transport === "TlsTcp" ? "always" : "off")

const measure = (transport: Transport) =>
  Effect.scoped(
    Effect.gen(function* () {
      const tokenText = "bench-token"
      const token = Redacted.make(tokenText)
      const tls = tlsOf(transport)
      const listener = yield* EdgeTransport.listen({ address: listenAddress(transport, "home"), token })
      const inbound = yield* listener.register({ runId, edgeId: back, ring, spinMicros: spinFor(transport) })
      const child = fork(process.argv[1]!, ["--echo"], { stdio: "inherit", env: { ...process.env, SWACTOR_TLS: tls } })
      yield* Effect.addFinalizer(() =>
        Effect.sync(() => {
          child.kill()
          // the killed echo process cannot remove its own Unix socket file
          if (transport === "Unix" || transport === "Shm")
            rmSync(Path.join(Os.tmpdir(), `swactor-hop-${child.pid}-echo.sock`), { force: true })
        })
      )
      child.send({ token: tokenText, transport, home: listener.address } satisfies Setup)
      const echoAddress = yield* Effect.async<TransportAddress>((resume) => {
        child.once("message", (m) => resume(Effect.succeed((m as { address: TransportAddress }).address)))
      })
      const sender = yield* EdgeTransport.connect({
        address: echoAddress,
        token,
        runId,
        edgeId: forward,
        ring,
        sharedMemory: transport === "Shm"
      })
      const payload = Float32Array.from({ length: hidden }, (_, i) => Math.cos(i))
      const rtts: Array<number> = []
      for (let i = 0; i < warmup + iterations; i++) {
        const t0 = process.hrtime.bigint()
        yield* sender.send(
          ActivationFrame({ runId, edgeId: forward, step: i, startPos: i, nTokens: 1, hiddenDim: hidden, payload })
        )
        const got = yield* inbound.take
        const t1 = process.hrtime.bigint()
        if (got.step !== i) throw new Error(`echo out of order: ${got.step} != ${i}`)
        if (i >= warmup) rtts.push(Number(t1 - t0) / 1000)
      }
      const received = yield* inbound.stats
      if (received.spins > 0)
        console.log(`  (echo receiver busy-polls: ${received.spins}, found a frame: ${received.spinHits})`)
      const sorted = [...rtts].sort((a, b) => a - b)
      return {
        transport,
        hopP50: percentile(sorted, 0.5) / 2,
        hopP99: percentile(sorted, 0.99) / 2,
        rttP50: percentile(sorted, 0.5),
        rttP99: percentile(sorted, 0.99)
      }
    })
  ).pipe(Effect.provide(Settings.layer({ tls: tlsOf(transport) })))

if (process.argv.includes("--echo")) {
  process.once("message", (setup) => {
    Effect.runPromise(echo(setup as Setup)).catch(() => process.exit(0))
  })
  process.on("disconnect", () => process.exit(0))
} else {
  const main = Effect.gen(function* () {
    console.log(
      `activation hop latency: hidden ${hidden} f32 (${hidden * 4} B payload), ${iterations} round trips after ${warmup} warm-up, ` +
        `two processes, ${Os.cpus().length} CPUs, node ${process.version}`
    )
    const names = {
      Tcp: "loopback TCP ",
      TlsTcp: "TCP in TLS1.3",
      Unix: "Unix socket  ",
      Shm: `shared memory (spin ${spin} µs)`
    } as const
    const onlyAt = process.argv.indexOf("--only")
    const only = onlyAt >= 0 ? (process.argv[onlyAt + 1] ?? "").split(",") : undefined
    const p50 = new Map<Transport, number>()
    for (const transport of ["Tcp", "TlsTcp", "Unix", "Shm"] as const) {
      if (only !== undefined && !only.includes(transport)) continue
      const r = yield* measure(transport)
      p50.set(transport, r.hopP50)
      console.log(
        `${names[transport]}  hop p50 ${r.hopP50.toFixed(1)} µs  p99 ${r.hopP99.toFixed(1)} µs` +
          `   (round trip p50 ${r.rttP50.toFixed(1)} µs, p99 ${r.rttP99.toFixed(1)} µs)`
      )
    }
    const plain = p50.get("Tcp")
    const tls = p50.get("TlsTcp")
    if (plain !== undefined && tls !== undefined) {
      console.log(`TLS hop p50 / plain TCP hop p50 = ${(tls / plain).toFixed(2)}x (target <= 1.3x)`)
    }
  })
  Effect.runPromise(main).then(
    () => process.exit(0),
    (e) => {
      console.error(e)
      process.exit(1)
    }
  )
}
