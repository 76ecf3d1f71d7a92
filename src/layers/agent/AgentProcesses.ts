/**
 * Node agents as child processes of this one (`swactor node`, plain `node dist/main.js`): spawn them, read their ready
 * lines, keep their stderr's tail for fault messages, stop them (SIGTERM, then SIGKILL), and kill any still alive if
 * this process exits without closing its scopes.
 */
import { type ChildProcess, spawn } from "node:child_process"
import { randomBytes } from "node:crypto"
import { existsSync } from "node:fs"
import { dirname, join } from "node:path"
import { fileURLToPath } from "node:url"
import { Deferred, type Duration, Effect, ExecutionStrategy, Scope } from "effect"
import type { TransportAddress } from "../../domain/frames.js"
import { AgentSpawnError } from "../../services/AgentLinks.js"
import { cliEntry } from "./CliEntry.js"
import { childEnvironment, Settings } from "../config/Settings.js"
import { type Announced, clusterTokenEnv, decodeAnnounced, parentWatchEnv, readyLinePrefix } from "./ReadyLine.js"

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
  /** Whether the process has not exited yet (a stopped process still runs). */
  readonly running: () => boolean
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
  (import.meta.url.endsWith(".js")
    ? join(here, "..", "..", "main.js")
    : join(here, "..", "..", "..", "dist", "main.js"))

/** argv that runs `swactor <args>` in a fresh Node process: plain `node dist/main.js`, no loader, no wrapper. */
export const swactorCommand = (
  args: ReadonlyArray<string>
): { readonly command: string; readonly args: Array<string> } => ({
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

/** What a local agent's environment carries besides the settings: its cluster token and its parent watch. */
const agentVariables = (token: string) => ({ [clusterTokenEnv]: token, [parentWatchEnv]: "stdin" })

/** The `swactor node` arguments of local agent `index`. */
const agentArgs = (index: number, options: LocalAgentsOptions) => {
  const host = options.host ?? "127.0.0.1"
  return [
    "node",
    "--listen",
    `${host}:0`,
    // a local agent serves the command that started it, not other orchestrators' --discover
    "--announce",
    "off",
    ...(options.dataDir === undefined ? [] : ["--data-listen", join(options.dataDir, `agent-${index}.sock`)]),
    ...(options.threads === undefined ? [] : ["--threads", String(options.threads)]),
    ...(options.engine === "test" ? ["--engine", "test"] : []),
    ...(options.extraArgs?.(index) ?? [])
  ]
}

/** Where a starting agent's events go: its ready line, its exit, its stderr's tail (and ours when inherited). */
interface ChildWatch {
  readonly ready: Deferred.Deferred<Announced, AgentSpawnError>
  readonly exited: Deferred.Deferred<AgentExit>
  readonly stderr: ReturnType<typeof tailBuffer>
  readonly inherit: boolean
}

/** Reads an agent's stdout lines: the ready line completes `ready`; other lines go to our stderr when inherited. */
const readStdout = (child: ChildProcess, index: number, { ready, inherit }: ChildWatch) => {
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
}

/** Follows a started agent: a spawn error or an early exit fails `ready`, its exit completes `exited`. */
const watchChild = (child: ChildProcess, index: number, watch: ChildWatch) => {
  const { ready, exited, stderr, inherit } = watch
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
  readStdout(child, index, watch)
}

const spawnOne = (
  index: number,
  options: LocalAgentsOptions
): Effect.Effect<LocalAgent, AgentSpawnError, Scope.Scope> =>
  Effect.gen(function* () {
    const args = agentArgs(index, options)
    const { command, args: argv } =
      options.entry === undefined
        ? swactorCommand(args)
        : { command: process.execPath, args: [...options.entry, ...args] }
    if (options.entry === undefined && !existsSync(argv[0]!)) {
      return yield* new AgentSpawnError({
        index,
        message: `${argv[0]} is missing: build the package first (npm run build)`
      })
    }
    const settings = yield* Settings
    const inherit = options.inheritStderr === true || settings.debugAgents
    const exited = yield* Deferred.make<AgentExit>()
    const ready = yield* Deferred.make<Announced, AgentSpawnError>()
    const stderr = tailBuffer(8192)

    const child = yield* Effect.acquireRelease(
      Effect.try({
        try: () => {
          installExitHook()
          const child = spawn(command, argv, {
            stdio: ["pipe", "pipe", "pipe"],
            env: childEnvironment(settings, { ...options.env, ...agentVariables(options.token) })
          })
          liveChildren.add(child)
          return child
        },
        catch: (cause) => new AgentSpawnError({ index, message: `cannot start agent: ${String(cause)}` })
      }),
      (child) => stop(child, exited)
    )
    watchChild(child, index, { ready, exited, stderr, inherit })
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
      running: () => child.exitCode === null && child.signalCode === null,
      stderrTail: stderr.get
    } satisfies LocalAgent
  })

/**
 * SIGTERM (and SIGCONT: a stopped process, SIGSTOP, handles its SIGTERM only once it runs again), then SIGKILL after a
 * grace period; waits for the exit either way. The waits are interruptible regions, so their timeouts work inside this
 * uninterruptible finalizer: a process that ignores SIGTERM (hung) is killed after the grace period instead of being
 * waited for forever.
 */
const stop = (child: ChildProcess, exited: Deferred.Deferred<AgentExit>) =>
  Effect.gen(function* () {
    if (child.exitCode !== null || child.signalCode !== null) return
    child.kill("SIGTERM")
    child.kill("SIGCONT")
    const graceful = yield* Effect.interruptible(Deferred.await(exited)).pipe(
      Effect.timeout("2 seconds"),
      Effect.option
    )
    if (graceful._tag === "None") {
      child.kill("SIGKILL")
      yield* Effect.interruptible(Deferred.await(exited)).pipe(Effect.timeout("5 seconds"), Effect.ignore)
    }
    child.stdin?.destroy()
  }).pipe(Effect.uninterruptible)

/**
 * Starts `count` node agents (`swactor node`) as child processes on this machine, each on an
 * ephemeral port it announces on stdout (its data plane there too, or on a Unix socket in `dataDir`). All are killed when the scope closes (also on Ctrl-C,
 * which interrupts the main fiber), and each exits on its own if this process dies. They are stopped in parallel: n
 * hung agents take one grace period to kill, not n.
 */
export const spawnLocalAgents = (
  options: LocalAgentsOptions
): Effect.Effect<ReadonlyArray<LocalAgent>, AgentSpawnError, Scope.Scope> =>
  Effect.gen(function* () {
    const agents = yield* Scope.fork(yield* Effect.scope, ExecutionStrategy.parallel)
    return yield* Effect.forEach(
      Array.from({ length: options.count }, (_, index) => index),
      (index) => spawnOne(index, options).pipe(Scope.extend(agents)),
      { concurrency: "unbounded" }
    )
  }).pipe(Effect.withSpan("AgentProcesses.spawn", { attributes: { count: options.count } }))
