import { type ChildProcess, spawn } from "node:child_process"
import { existsSync, readdirSync, readFileSync } from "node:fs"
import { Effect, Exit, Scope } from "effect"
import {
  generateToken,
  type LocalAgent,
  spawnLocalAgents,
  swactorCommand
} from "../../src/layers/agent/AgentProcesses.js"
import { clusterTokenEnv } from "../../src/layers/agent/ReadyLine.js"
import { repoRoot } from "./models.js"
import { eventLimitMillis } from "./until.js"

export interface ServeProcess {
  readonly child: ChildProcess
  readonly url: string
  /** /health statuses seen from the moment it listened until it answered 200. */
  readonly healthSeen: ReadonlyArray<number>
  readonly stderr: () => string
  readonly exited: Promise<{ code: number | null; signal: string | null }>
}

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms))

/** Starts `swactor serve` on a free port and waits until /health says 200 (polling it from the start). */
export const startServe = async (
  args: ReadonlyArray<string>,
  env: Readonly<Record<string, string>> = {},
  readyTimeoutMs = 120_000
): Promise<ServeProcess> => {
  const { args: argv, command } = swactorCommand(["serve", "--port", "0", ...args])
  const child = spawn(command, argv, {
    cwd: repoRoot,
    stdio: ["ignore", "ignore", "pipe"],
    env: { ...process.env, ...env }
  })
  let stderr = ""
  const exited = new Promise<{ code: number | null; signal: string | null }>((resolve) =>
    child.on("exit", (code, signal) => resolve({ code, signal }))
  )
  const url = await new Promise<string>((resolve, reject) => {
    const timer = setTimeout(
      () => reject(new Error(`swactor serve did not listen in time:\n${stderr}`)),
      readyTimeoutMs
    )
    child.stderr!.setEncoding("utf8")
    child.stderr!.on("data", (chunk: string) => {
      stderr += chunk
      const match = /listening on (http:\/\/[^ \n]+)/.exec(stderr)
      if (match) {
        clearTimeout(timer)
        resolve(match[1]!)
      }
    })
    child.on("exit", () => reject(new Error(`swactor serve exited:\n${stderr}`)))
  })
  const healthSeen: Array<number> = []
  const until = Date.now() + readyTimeoutMs
  while (Date.now() < until) {
    const status = await fetch(`${url}/health`).then(
      (r) => r.status,
      () => 0
    )
    if (healthSeen.at(-1) !== status) healthSeen.push(status)
    if (status === 200) break
    await sleep(25)
  }
  if (healthSeen.at(-1) !== 200) throw new Error(`swactor serve never became ready:\n${stderr}`)
  return { child, url, healthSeen, stderr: () => stderr, exited }
}

/** Ends a server a test started, if it still runs (SIGTERM: it removes its agents and socket folder), and waits for it. */
export const stopServe = async (server: ServeProcess | undefined) => {
  if (server?.child.exitCode === null && server.child.signalCode === null) server.child.kill("SIGTERM")
  await server?.exited
}

/**
 * `swactor serve --agents` over two agent processes started here as remote nodes (one stage each, one thread);
 * `close` ends the server, then the nodes.
 */
export const startServeOverNodes = async (args: ReadonlyArray<string>) => {
  const scope = Effect.runSync(Scope.make())
  const token = generateToken()
  const nodes: ReadonlyArray<LocalAgent> = await Effect.runPromise(
    spawnLocalAgents({ count: 2, token, threads: 1 }).pipe(Scope.extend(scope))
  )
  const server = await startServe([...args, "--agents", nodes.map((a) => a.address).join(",")], {
    [clusterTokenEnv]: token
  }).catch(async (error: unknown) => {
    await Effect.runPromise(Scope.close(scope, Exit.void))
    throw error
  })
  return {
    server,
    nodes,
    close: async () => {
      await stopServe(server)
      await Effect.runPromise(Scope.close(scope, Exit.void))
    }
  }
}

/** The agents' pids and active stage counts from /metrics (`headers`: an API key, when the server asks for one). */
export const agentsOf = async (url: string, headers: Record<string, string> = {}) => {
  const text = await fetch(`${url}/metrics`, { headers }).then((r) => r.text())
  return [...text.matchAll(/^swactor_agent_active_stages\{address="([^"]+)",pid="(\d+)"\} (-?\d+)$/gm)].map((m) => ({
    address: m[1]!,
    pid: Number(m[2]),
    activeStages: Number(m[3])
  }))
}

export const metricOf = async (url: string, name: string, headers: Record<string, string> = {}): Promise<number> => {
  const text = await fetch(`${url}/metrics`, { headers }).then((r) => r.text())
  const match = new RegExp(`^${name.replace(/[{}"]/g, (c) => `\\${c}`)} (\\S+)$`, "m").exec(text)
  return match === null ? Number.NaN : Number(match[1])
}

/**
 * Polls until no agent hosts a stage and nothing is in flight, for at most `withinMillis` (the caller asserts after;
 * by default the suite's generous outer limit for an event, support/until.ts).
 */
export const waitForIdle = async (
  url: string,
  headers: Record<string, string> = {},
  withinMillis = eventLimitMillis
): Promise<void> => {
  for (const until = Date.now() + withinMillis; Date.now() < until;) {
    const agents = await agentsOf(url, headers)
    if (agents.every((a) => a.activeStages === 0) && (await metricOf(url, "swactor_requests_in_flight", headers)) === 0)
      return
    await sleep(20)
  }
}

/** Raw SSE over fetch: every `data:` payload in order (comments skipped), and when each came. */
export const readSse = async (
  response: Response,
  onData?: (data: string) => void,
  onComment?: (line: string) => void
) => {
  const events: Array<{ data: string; at: number }> = []
  const reader = response.body!.getReader()
  const decoder = new TextDecoder()
  let buffer = ""
  while (true) {
    const { done, value } = await reader.read()
    if (done) break
    buffer += decoder.decode(value, { stream: true })
    let end = buffer.indexOf("\n\n")
    while (end >= 0) {
      const block = buffer.slice(0, end)
      buffer = buffer.slice(end + 2)
      for (const line of block.split("\n")) {
        if (line.startsWith("data: ")) {
          events.push({ data: line.slice(6), at: Date.now() })
          onData?.(line.slice(6))
        } else if (line.startsWith(":")) onComment?.(line)
      }
      end = buffer.indexOf("\n\n")
    }
  }
  return events
}

/** A local agent's private socket folder (from its `--data-listen DIR/agent-N.sock` argument), if it has one. */
export const socketDirOf = (pid: number): string | undefined => {
  try {
    const args = readFileSync(`/proc/${pid}/cmdline`, "utf8").split("\0")
    const at = args.indexOf("--data-listen")
    const value = at >= 0 ? args[at + 1] : undefined
    return value === undefined ? undefined : /^(.*)\/agent-\d+\.sock$/.exec(value)?.[1]
  } catch {
    return undefined
  }
}

/** Shared-memory ring files in /dev/shm that belong to any of these processes. */
export const shmFilesOf = (pids: ReadonlyArray<number>): ReadonlyArray<string> =>
  existsSync("/dev/shm")
    ? readdirSync("/dev/shm").filter((name) => pids.some((pid) => name.startsWith(`swactor-${pid}-`)))
    : []
