/**
 * bench:wan's child processes (the relay, ggml-rpc-server, llama-server): every one is tracked and killed when the
 * bench exits, however it exits (normal end, thrown error, Ctrl-C / SIGTERM / SIGHUP). swactor's agents are killed by
 * AgentProcesses' own exit hook, which the signal handlers here reach through `process.exit`. Only a SIGKILL of the
 * bench itself leaves them behind. Also: free ports, waiting for a port, and pinning a process's threads to one core
 * with the pinning read back from /proc.
 */
import { type ChildProcess, execFileSync } from "node:child_process"
import * as Fs from "node:fs"
import * as Net from "node:net"

const live = new Set<ChildProcess>()
let installed = false

/** Kills every tracked child on exit, and turns SIGINT / SIGTERM / SIGHUP into an exit (so exit hooks run). */
export const installCleanup = () => {
  if (installed) return
  installed = true
  process.on("exit", () => {
    for (const child of live) child.kill("SIGKILL")
  })
  for (const [signal, code] of [
    ["SIGINT", 130],
    ["SIGTERM", 143],
    ["SIGHUP", 129]
  ] as const) {
    process.on(signal, () => {
      console.error(`\nbench:wan: ${signal}: stopping the ${live.size} process(es) it started and its agents`)
      process.exit(code)
    })
  }
}

/** Tracks `child` until it exits. */
export const track = <C extends ChildProcess>(child: C): C => {
  live.add(child)
  child.once("exit", () => live.delete(child))
  return child
}

/** SIGTERM, then SIGKILL after `graceMs`; resolves when every one has exited. */
export const stopAll = async (children: ReadonlyArray<ChildProcess>, graceMs = 5000) => {
  const running = children.filter((c) => c.exitCode === null && c.signalCode === null)
  for (const c of running) c.kill("SIGTERM")
  await Promise.all(
    running.map(
      (c) =>
        new Promise<void>((resolve) => {
          const timer = setTimeout(() => c.kill("SIGKILL"), graceMs)
          c.once("exit", () => {
            clearTimeout(timer)
            resolve()
          })
          if (c.exitCode !== null || c.signalCode !== null) {
            clearTimeout(timer)
            resolve()
          }
        })
    )
  )
}

export const freePort = () =>
  new Promise<number>((resolve, reject) => {
    const server = Net.createServer()
    server.once("error", reject)
    server.listen(0, "127.0.0.1", () => {
      const { port } = server.address() as Net.AddressInfo
      server.close(() => resolve(port))
    })
  })

export const waitForPort = async (port: number, child: ChildProcess, what: string, tail: () => string = () => "") => {
  for (let i = 0; ; i++) {
    const ok = await new Promise<boolean>((resolve) => {
      const s = Net.createConnection({ host: "127.0.0.1", port }, () => {
        s.destroy()
        resolve(true)
      })
      s.on("error", () => resolve(false))
    })
    if (ok) return
    if (child.exitCode !== null || i > 600) {
      throw new Error(
        `${what} did not start listening on ${port} (exit ${child.exitCode}): ${tail().trim().split("\n").slice(-3).join(" | ")}`
      )
    }
    await new Promise((r) => setTimeout(r, 100))
  }
}

/** What /proc says about a process's threads: how many, and the distinct allowed-CPU lists among them. */
export const threadAffinity = (pid: number): { readonly threads: number; readonly cpus: ReadonlyArray<string> } => {
  try {
    const tasks = Fs.readdirSync(`/proc/${pid}/task`)
    const cpus = new Set<string>()
    for (const t of tasks) {
      const status = Fs.readFileSync(`/proc/${pid}/task/${t}/status`, "utf8")
      const m = /^Cpus_allowed_list:\s*(\S+)/m.exec(status)
      if (m !== null) cpus.add(m[1]!)
    }
    return { threads: tasks.length, cpus: [...cpus] }
  } catch {
    return { threads: 0, cpus: [] }
  }
}

/**
 * Pins every thread of `pid` to `core` (taskset -a) and reads it back; returns what /proc shows ("core 1", or why
 * not). Threads started after the call keep the process's mask, so they are pinned too.
 */
export const pinProcess = (pid: number, core: number): string => {
  try {
    execFileSync("taskset", ["-a", "-cp", String(core), String(pid)], { stdio: "ignore" })
  } catch (error) {
    return `not pinned (taskset: ${(error as Error).message.split("\n")[0]})`
  }
  const { threads, cpus } = threadAffinity(pid)
  return cpus.length === 1 && cpus[0] === String(core)
    ? `core ${core} (${threads} thread${threads === 1 ? "" : "s"})`
    : `pinning to ${core} not applied (threads allow ${cpus.join(" / ")})`
}
