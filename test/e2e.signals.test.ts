// Operator signals to the long-running commands (G-signals in specs/BEHAVIOR_GUARANTEES.md): `swactor run` launched
// through the package's bin (plain `node dist/main.js`, no wrapper: the pid we signal is the orchestrator) stops
// mid-generation on SIGTERM / SIGHUP with the same teardown as Ctrl-C, exits 128 + the signal number within 2 s and
// leaves no agent process, no socket folder in /tmp and no ring file in /dev/shm; `swactor node` exits 143 on
// SIGTERM; a closed stdout (`| head`) stops the run quietly with exit 0.
import { describe, expect, it } from "vitest"
import { spawn } from "node:child_process"
import { existsSync, readdirSync, readFileSync } from "node:fs"
import { join } from "node:path"
import { Effect } from "effect"
import { generateToken } from "../src/layers/agent/AgentProcesses.js"
import { childPids, eventually, isAlive } from "./support/e2e.js"
import { repoRoot, requireModel } from "./support/models.js"

/** The `swactor` bin as the package declares it (package.json "bin"). */
const bin = join(repoRoot, (JSON.parse(readFileSync(join(repoRoot, "package.json"), "utf8")) as { bin: { swactor: string } }).bin.swactor)

const argsOf = (pid: number): string => {
  try {
    return readFileSync(`/proc/${pid}/cmdline`, "utf8").split("\0").join(" ")
  } catch {
    return ""
  }
}

const shmFilesOf = (pids: ReadonlyArray<number>) =>
  existsSync("/dev/shm")
    ? readdirSync("/dev/shm").filter((name) => pids.some((pid) => name.startsWith(`swactor-${pid}-`)))
    : []

interface Stopped {
  readonly code: number | null
  readonly signal: string | null
  readonly stderr: string
  readonly waitedMs: number
  readonly agents: ReadonlyArray<number>
  readonly socketDir: string | undefined
  readonly orchestrator: number
}

/** Starts `swactor run` (2 local stages) through the bin; once tokens flow, sends `signal` to its pid. */
const runThenSignal = (signal: NodeJS.Signals) =>
  new Promise<Stopped>((resolve, reject) => {
    const child = spawn(process.execPath, [
      bin, "run", "--model", requireModel("stories260K.gguf"), "--stages", "2", "--max-tokens", "400", "--threads", "1"
    ], { cwd: repoRoot, stdio: ["ignore", "pipe", "pipe"] })
    let stderr = ""
    let signalledAt = 0
    let agents: ReadonlyArray<number> = []
    let socketDir: string | undefined
    let seen = 0
    child.stderr.on("data", (chunk) => (stderr += chunk))
    child.stdout.on("data", (chunk: Buffer) => {
      seen += chunk.length
      // mid-generation: past the prompt, a few tokens in
      if (signalledAt !== 0 || seen < 40) return
      agents = childPids(child.pid!)
      socketDir = agents.map(argsOf).map((a) => /--data-listen (\S+)\/agent-\d+\.sock/.exec(a)?.[1]).find((d) => d !== undefined)
      signalledAt = Date.now()
      child.kill(signal)
    })
    child.on("error", reject)
    child.on("exit", (code, sig) =>
      resolve({
        code,
        signal: sig,
        stderr,
        waitedMs: Date.now() - signalledAt,
        agents,
        socketDir,
        orchestrator: child.pid!
      }))
  })

const expectCleanStop = async (result: Stopped, exitCode: number, signal: string) => {
  const context = `exit ${result.code} ${result.signal}: ${result.stderr}`
  expect(result.agents.length, `agents under the signalled pid: ${context}`).toBe(2)
  expect(result.socketDir, "agents listen in a private socket folder").toMatch(/^\/tmp\/swactor-|swactor-/)
  expect(result.code, context).toBe(exitCode)
  expect(result.waitedMs, context).toBeLessThan(2000)
  expect(result.stderr).toContain(`stopped by the operator (${signal})`)
  // The teardown ran before the exit: no agent left, no socket folder, no ring file of any of these processes.
  expect(result.agents.filter(isAlive)).toEqual([])
  expect(existsSync(result.socketDir!)).toBe(false)
  expect(shmFilesOf([result.orchestrator, ...result.agents])).toEqual([])
}

describe("operator signals", () => {
  it("SIGTERM to swactor run (the bin's pid) mid-generation: exit 143 within 2 s, nothing left behind", async () => {
    await expectCleanStop(await runThenSignal("SIGTERM"), 143, "SIGTERM")
  }, 60_000)

  it("SIGHUP to swactor run mid-generation: exit 129 within 2 s, nothing left behind", async () => {
    await expectCleanStop(await runThenSignal("SIGHUP"), 129, "SIGHUP")
  }, 60_000)

  it("SIGTERM to swactor node: exit 143 within 2 s", async () => {
    const child = spawn(process.execPath, [bin, "node", "--listen", "127.0.0.1:0", "--engine", "test"], {
      cwd: repoRoot,
      stdio: ["ignore", "pipe", "pipe"],
      env: { ...process.env, SWACTOR_CLUSTER_TOKEN: generateToken() }
    })
    let stderr = ""
    child.stderr.on("data", (chunk) => (stderr += chunk))
    await new Promise<void>((resolve) => child.stdout.on("data", (chunk) => String(chunk).includes("swactor-node-ready") && resolve()))
    const signalledAt = Date.now()
    child.kill("SIGTERM")
    const code = await new Promise<number | null>((resolve) => child.on("exit", (c) => resolve(c)))
    expect(code, stderr).toBe(143)
    expect(Date.now() - signalledAt).toBeLessThan(2000)
    expect(stderr).toContain("stopped by SIGTERM")
  }, 60_000)

  it("a closed stdout (| head) stops the run quietly: exit 0, no agent left", async () => {
    const child = spawn(process.execPath, [
      bin, "run", "--model", requireModel("stories260K.gguf"), "--stages", "2", "--max-tokens", "400", "--threads", "1"
    ], { cwd: repoRoot, stdio: ["ignore", "pipe", "pipe"] })
    let stderr = ""
    let agents: ReadonlyArray<number> = []
    child.stderr.on("data", (chunk) => (stderr += chunk))
    child.stdout.once("data", () => {
      agents = childPids(child.pid!)
      child.stdout.destroy()
    })
    const code = await new Promise<number | null>((resolve) => child.on("exit", (c) => resolve(c)))
    expect(code, stderr).toBe(0)
    expect(stderr).not.toMatch(/EPIPE|Error|stopped by the operator/)
    expect(agents.length).toBe(2)
    expect(await Effect.runPromise(eventually(() => agents.every((pid) => !isAlive(pid)), 2000))).toBe(true)
  }, 60_000)
})
