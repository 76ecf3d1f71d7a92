import { type ChildProcess, spawn } from "node:child_process"
import { randomBytes } from "node:crypto"
import { existsSync, mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { dirname, join } from "node:path"
import { fileURLToPath } from "node:url"
import * as Dgram from "node:dgram"
import { Deferred, Duration, Effect, Fiber, Layer, Schema, type Scope } from "effect"
import { type TransportAddress, TransportAddress as TransportAddressSchema } from "../../domain/frames.js"
import { NodeId } from "../../domain/ids.js"
import { AgentPool, type AgentSet, InvalidRequest } from "../../services/Orchestrator.js"
import { AgentSpawnError } from "../../services/AgentLinks.js"
import { cliEntry } from "./CliEntry.js"

/**
 * The line a node agent prints on stdout once it listens:
 * `swactor-node-ready {"host":…,"port":…,"data":{"_tag":"Tcp"|"Unix",…},"pid":…}`.
 */
export const readyLinePrefix = "swactor-node-ready "
/** Environment variable that carries the cluster token to an agent (never argv: argv is world-readable). */
export const clusterTokenEnv = "SWACTOR_CLUSTER_TOKEN"
/** When "stdin", the agent exits as soon as its stdin closes (its parent died). */
export const parentWatchEnv = "SWACTOR_PARENT_WATCH"

// The error is a contract of the agent pool (src/services/AgentLinks.ts); re-exported for existing imports.
export { AgentSpawnError }

export interface AgentExit {
  readonly code: number | null
  readonly signal: string | null
}

/** One node agent running as a child process of this one. */
export interface LocalAgent {
  readonly index: number
  readonly pid: number
  readonly host: string
  readonly port: number
  /** Its data-plane listener (a Unix socket when started with `dataDir`). */
  readonly dataAddress: TransportAddress
  /** Port of its data-plane listener (0 for a Unix socket). */
  readonly dataPort: number
  /** host:port of its control plane. */
  readonly address: string
  /** Completes when the process has exited. */
  readonly exited: Effect.Effect<AgentExit>
  /** The last lines it wrote to stderr (for fault messages). */
  readonly stderrTail: () => string
}

export interface LocalAgentsOptions {
  readonly count: number
  readonly token: string
  readonly host?: string
  readonly threads?: number
  /** Stage engine for the agents ("live" ggml by default; "test" for the deterministic double). */
  readonly engine?: "live" | "test"
  /**
   * Node arguments that run the `swactor` program instead of dist/main.js (tests start agents from a fixture entry
   * with other stage executors: test/support/agentEntry.ts).
   */
  readonly entry?: ReadonlyArray<string>
  /** Extra arguments after `node` (e.g. fault-injection flags in tests). */
  readonly extraArgs?: (index: number) => ReadonlyArray<string>
  readonly env?: Readonly<Record<string, string>>
  /** How long an agent may take to print its ready line. */
  readonly startTimeout?: Duration.DurationInput
  /** Copy agents' stderr to ours (SWACTOR_DEBUG=1 does the same). */
  readonly inheritStderr?: boolean
  /**
   * Same-host data planes: each agent's data listener is the Unix socket `<dataDir>/agent-<index>.sock`
   * (see `privateSocketDir`). Default: TCP on the control host, an ephemeral port.
   */
  readonly dataDir?: string
}

/** A fresh random cluster token (hex, 256 bits). */
export const generateToken = (): string => randomBytes(32).toString("hex")

const here = dirname(fileURLToPath(import.meta.url))

/**
 * The command's entry (`dist/main.js`, scripts/build.mjs): the one this process was started through (CliEntry); else
 * two folders up from this module (dist/layers/agent/) when running as the compiled library,
 * the package's `dist/` when running from sources (tests, development: the build runs first, `npm test` and
 * `npm run swactor` do it).
 */
export const swactorMain = (): string =>
  cliEntry() ??
    (import.meta.url.endsWith(".js") ? join(here, "..", "..", "main.js") : join(here, "..", "..", "..", "dist", "main.js"))

/** argv that runs `swactor <args>` in a fresh Node process: plain `node dist/main.js`, no loader, no wrapper. */
export const swactorCommand = (args: ReadonlyArray<string>): { readonly command: string; readonly args: Array<string> } => ({
  command: process.execPath,
  args: [swactorMain(), ...args]
})

/** Every agent child still alive, killed synchronously if this process exits without closing its scopes. */
const liveChildren = new Set<ChildProcess>()
let exitHookInstalled = false
const installExitHook = () => {
  if (exitHookInstalled) return
  exitHookInstalled = true
  process.on("exit", () => {
    for (const child of liveChildren) child.kill("SIGKILL")
    for (const dir of liveDirs) rmSync(dir, { recursive: true, force: true })
  })
}

const tailBuffer = (limit: number) => {
  let text = ""
  return {
    push: (chunk: string) => {
      text = (text + chunk).slice(-limit)
    },
    get: () => text
  }
}

const spawnOne = (index: number, options: LocalAgentsOptions): Effect.Effect<LocalAgent, AgentSpawnError, Scope.Scope> =>
  Effect.gen(function*() {
    const host = options.host ?? "127.0.0.1"
    const args = [
      "node",
      "--listen",
      `${host}:0`,
      ...(options.dataDir === undefined ? [] : ["--data-listen", join(options.dataDir, `agent-${index}.sock`)]),
      ...(options.threads === undefined ? [] : ["--threads", String(options.threads)]),
      ...(options.engine === "test" ? ["--engine", "test"] : []),
      ...(options.extraArgs?.(index) ?? [])
    ]
    const { command, args: argv } = options.entry === undefined
      ? swactorCommand(args)
      : { command: process.execPath, args: [...options.entry, ...args] }
    if (options.entry === undefined && !existsSync(argv[0]!)) {
      return yield* new AgentSpawnError({ index, message: `${argv[0]} is missing: build the package first (npm run build)` })
    }
    const inherit = options.inheritStderr === true || process.env["SWACTOR_DEBUG"] === "1"
    const exited = yield* Deferred.make<AgentExit>()
    const ready = yield* Deferred.make<Announced, AgentSpawnError>()
    const stderr = tailBuffer(8192)

    const child = yield* Effect.acquireRelease(
      Effect.try({
        try: () => {
          installExitHook()
          const child = spawn(command, argv, {
            stdio: ["pipe", "pipe", "pipe"],
            env: { ...process.env, ...options.env, [clusterTokenEnv]: options.token, [parentWatchEnv]: "stdin" }
          })
          liveChildren.add(child)
          return child
        },
        catch: (cause) => new AgentSpawnError({ index, message: `cannot start agent: ${String(cause)}` })
      }),
      (child) => stop(child, exited)
    )
    child.on("error", (error) => {
      Deferred.unsafeDone(ready, Effect.fail(new AgentSpawnError({ index, message: error.message })))
    })
    child.on("exit", (code, signal) => {
      liveChildren.delete(child)
      Deferred.unsafeDone(exited, Effect.succeed({ code, signal }))
      Deferred.unsafeDone(
        ready,
        Effect.fail(
          new AgentSpawnError({
            index,
            message: `agent exited before it was ready (code ${code}, signal ${signal})\n${stderr.get()}`
          })
        )
      )
    })
    child.stderr?.setEncoding("utf8")
    child.stderr?.on("data", (chunk: string) => {
      stderr.push(chunk)
      if (inherit) process.stderr.write(`[agent ${index}] ${chunk}`)
    })
    let stdoutBuffer = ""
    child.stdout?.setEncoding("utf8")
    child.stdout?.on("data", (chunk: string) => {
      stdoutBuffer += chunk
      let newline = stdoutBuffer.indexOf("\n")
      while (newline >= 0) {
        const line = stdoutBuffer.slice(0, newline)
        stdoutBuffer = stdoutBuffer.slice(newline + 1)
        if (line.startsWith(readyLinePrefix)) {
          try {
            const announced = decodeAnnounced(JSON.parse(line.slice(readyLinePrefix.length)))
            Deferred.unsafeDone(ready, Effect.succeed(announced))
          } catch {
            Deferred.unsafeDone(ready, Effect.fail(new AgentSpawnError({ index, message: `bad ready line: ${line}` })))
          }
        } else if (inherit) {
          process.stderr.write(`[agent ${index}] ${line}\n`)
        }
        newline = stdoutBuffer.indexOf("\n")
      }
    })
    // The agent watches this pipe: when we die (even by SIGKILL) the kernel closes it and the agent exits.
    child.stdin?.on("error", () => {})

    const announced = yield* Deferred.await(ready).pipe(
      Effect.timeoutFail({
        duration: options.startTimeout ?? "60 seconds",
        onTimeout: () =>
          new AgentSpawnError({ index, message: `agent did not announce its address in time\n${stderr.get()}` })
      })
    )
    return {
      index,
      pid: child.pid ?? -1,
      host: announced.host,
      port: announced.port,
      dataAddress: announced.data,
      dataPort: announced.data._tag === "Tcp" ? announced.data.port : 0,
      address: `${announced.host}:${announced.port}`,
      exited: Deferred.await(exited),
      stderrTail: stderr.get
    } satisfies LocalAgent
  })

/** SIGTERM, then SIGKILL after a grace period; waits for the exit either way. */
const stop = (child: ChildProcess, exited: Deferred.Deferred<AgentExit>) =>
  Effect.gen(function*() {
    if (child.exitCode !== null || child.signalCode !== null) return
    child.kill("SIGTERM")
    const graceful = yield* Deferred.await(exited).pipe(Effect.timeout("2 seconds"), Effect.option)
    if (graceful._tag === "None") {
      child.kill("SIGKILL")
      yield* Deferred.await(exited).pipe(Effect.timeout("5 seconds"), Effect.ignore)
    }
    child.stdin?.destroy()
  }).pipe(Effect.uninterruptible)

/**
 * Starts `count` node agents (`swactor node`) as child processes on this machine, each on an
 * ephemeral port it announces on stdout (its data plane there too, or on a Unix socket in `dataDir`). All are killed when the scope closes (also on Ctrl-C,
 * which interrupts the main fiber), and each exits on its own if this process dies.
 */
export const spawnLocalAgents = (
  options: LocalAgentsOptions
): Effect.Effect<ReadonlyArray<LocalAgent>, AgentSpawnError, Scope.Scope> =>
  Effect.forEach(Array.from({ length: options.count }, (_, index) => index), (index) => spawnOne(index, options), {
    concurrency: "unbounded"
  }).pipe(Effect.withSpan("LocalAgents.spawn", { attributes: { count: options.count } }))

/**
 * Agent side of the orphan guard: exit when the parent's pipe on stdin closes. Call once at
 * agent start-up when `SWACTOR_PARENT_WATCH=stdin`.
 */
export const watchParentPipe = (onParentGone: () => void): void => {
  if (process.env[parentWatchEnv] !== "stdin") return
  process.stdin.on("data", () => {})
  process.stdin.on("end", onParentGone)
  process.stdin.on("close", onParentGone)
  process.stdin.on("error", onParentGone)
  process.stdin.resume()
}

const Announced = Schema.Struct({ host: Schema.String, port: Schema.Number, data: TransportAddressSchema })
type Announced = typeof Announced.Type
const decodeAnnounced = Schema.decodeUnknownSync(Announced)

/** Agent side: announce the bound addresses to the parent. */
export const announceReady = (host: string, port: number, data: TransportAddress): void => {
  process.stdout.write(`${readyLinePrefix}${JSON.stringify({ host, port, data, pid: process.pid })}\n`)
}

/** Private socket directories still present, removed synchronously if this process exits without closing its scopes. */
const liveDirs = new Set<string>()

/**
 * A fresh directory only this user can enter (mkdtemp: mode 0700) for same-host Unix sockets, removed
 * with everything in it when the scope closes (or when this process exits). Under /tmp when the
 * temp dir's path would leave no room in a socket path (about 107 bytes).
 */
export const privateSocketDir: Effect.Effect<string, AgentSpawnError, Scope.Scope> = Effect.acquireRelease(
  Effect.try({
    try: () => {
      installExitHook()
      const base = tmpdir().length > 60 ? "/tmp" : tmpdir()
      const dir = mkdtempSync(join(base, "swactor-"))
      liveDirs.add(dir)
      return dir
    },
    catch: (cause) => new AgentSpawnError({ index: -1, message: `cannot create a socket directory: ${String(cause)}` })
  }),
  (dir) =>
    Effect.sync(() => {
      liveDirs.delete(dir)
      rmSync(dir, { recursive: true, force: true })
    })
)

// ---------------------------------------------------------------------------------------------
// AgentPool layers: local child processes, or remote nodes
// ---------------------------------------------------------------------------------------------

export interface LocalPoolOptions {
  /** Default engine threads of each agent (a run may override per stage). */
  readonly threads?: number
  readonly engine?: "live" | "test"
  /** Agents when a request does not say how many stages (default 1). */
  readonly defaultStages?: number
  readonly extraArgs?: (index: number) => ReadonlyArray<string>
  readonly env?: Readonly<Record<string, string>>
  readonly inheritStderr?: boolean
  /** Start this many agents when the layer is built, for the first run of that many stages (see localAgentPool). */
  readonly prestart?: number
  /** Called with the agents once they are up (tests use it to find pids). */
  readonly onStarted?: (agents: ReadonlyArray<LocalAgent>) => void
}

/** A fresh private socket folder, token and `count` agents, as one run of a local pool uses them. */
const startLocalSet = (count: number, options: LocalPoolOptions) =>
  Effect.gen(function*() {
    const token = generateToken()
    // Every data edge of a local run stays on this machine: Unix sockets in a private directory
    // (frames through shared-memory rings where /dev/shm allows: AgentLinksLive).
    const dataDir = yield* privateSocketDir
    const agents = yield* spawnLocalAgents({
      count,
      token,
      dataDir,
      ...(options.threads === undefined ? {} : { threads: options.threads }),
      ...(options.engine === undefined ? {} : { engine: options.engine }),
      ...(options.extraArgs === undefined ? {} : { extraArgs: options.extraArgs }),
      ...(options.env === undefined ? {} : { env: options.env }),
      ...(options.inheritStderr === undefined ? {} : { inheritStderr: options.inheritStderr })
    })
    return { token, dataDir, agents }
  })

const agentSetOf = (
  { agents, dataDir, token }: Effect.Effect.Success<ReturnType<typeof startLocalSet>>,
  options: LocalPoolOptions
): AgentSet => {
  options.onStarted?.(agents)
  const nodes = agents.map((agent) => ({ nodeId: NodeId.make(agent.index + 1), address: agent.address }))
  const exited = Effect.raceAll(
    agents.map((agent, index) =>
      Effect.map(agent.exited, (exit) => ({
        node: nodes[index]!,
        reason: `agent process ${agent.pid} exited (${exit.signal === null ? `code ${exit.code}` : exit.signal})` +
          (agent.stderrTail().trim() === "" ? "" : `: ${agent.stderrTail().trim().split("\n").slice(-3).join(" | ")}`)
      }))
    )
  )
  return {
    nodes,
    token,
    listenHost: "127.0.0.1",
    dataListen: { _tag: "Unix", path: join(dataDir, "orchestrator.sock") },
    exited
  }
}

const checkedCount = (count: number) =>
  Number.isSafeInteger(count) && count >= 1
    ? Effect.succeed(count)
    : Effect.fail(new InvalidRequest({ message: `stages must be a positive whole number, got ${count}` }))

/**
 * Every run starts its own agents on this machine (one per stage) with a fresh cluster token.
 *
 * With `prestart: n` the pool starts `n` agents as soon as the layer is built, so that they boot while the
 * orchestrator reads the model's facts and vocabulary; the first run that asks for `n` stages takes them (any other
 * run starts its own). Pre-started agents live as long as the layer (one-shot programs: `swactor run`).
 */
export const localAgentPool = (options: LocalPoolOptions = {}): Layer.Layer<AgentPool> => {
  // Spares: agents that host nothing until a recovery needs them.
  const fresh = (stages: number | undefined, spares = 0) =>
    Effect.gen(function*() {
      const count = yield* checkedCount(stages ?? options.defaultStages ?? 1)
      if (!Number.isSafeInteger(spares) || spares < 0) {
        return yield* new InvalidRequest({ message: `spares must be a whole number, got ${spares}` })
      }
      return agentSetOf(yield* startLocalSet(count + spares, options), options)
    })
  if (options.prestart === undefined) return Layer.succeed(AgentPool, AgentPool.of({ acquire: fresh }))
  const prestart = options.prestart
  return Layer.scoped(
    AgentPool,
    Effect.gen(function*() {
      const early = yield* Effect.forkScoped(startLocalSet(prestart, options))
      let taken = false
      return AgentPool.of({
        acquire: (stages, spares = 0) => {
          const count = (stages ?? options.defaultStages ?? 1) + spares
          if (taken || count !== prestart) return fresh(stages, spares)
          taken = true
          return Effect.map(Fiber.join(early), (set) => agentSetOf(set, options))
        }
      })
    })
  )
}

/** The local address this machine uses to reach `host` (so remote agents can connect back). */
export const routeHostFor = (host: string): Effect.Effect<string> =>
  Effect.async<string>((resume) => {
    const socket = Dgram.createSocket(host.includes(":") ? "udp6" : "udp4")
    socket.on("error", () => {
      socket.close()
      resume(Effect.succeed("0.0.0.0"))
    })
    socket.connect(9, host, () => {
      const local = socket.address().address
      socket.close()
      resume(Effect.succeed(local))
    })
  })

export interface RemotePoolOptions {
  /** host:port of each agent's control plane. */
  readonly nodes: ReadonlyArray<string>
  readonly token: string
  /** Where the orchestrator's data listener binds (default: the local address that routes to the first node). */
  readonly listenHost?: string
}

/** Runs use the given remote agents; a run of more stages than nodes places stage i on node i mod n. */
export const remoteAgentPool = (options: RemotePoolOptions): Layer.Layer<AgentPool> =>
  Layer.succeed(
    AgentPool,
    AgentPool.of({
      acquire: () =>
        Effect.gen(function*() {
          if (options.nodes.length === 0) return yield* new InvalidRequest({ message: "no nodes given" })
          const first = options.nodes[0]!.replace(/:\d+$/, "").replace(/^\[|\]$/g, "")
          const listenHost = options.listenHost ?? (yield* routeHostFor(first))
          return {
            nodes: options.nodes.map((address, index) => ({ nodeId: NodeId.make(index + 1), address })),
            token: options.token,
            listenHost,
            exited: Effect.never
          } satisfies AgentSet
        })
    })
  )
