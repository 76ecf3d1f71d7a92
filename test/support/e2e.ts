/** Helpers for end-to-end tests with real agent processes. */
import { execFileSync } from "node:child_process"
import * as Net from "node:net"
import { Effect, type Scope } from "effect"
import { layerRemote } from "../../src/api/generate.js"
import { generateToken, type LocalAgent, type LocalAgentsOptions, spawnLocalAgents } from "../../src/layers/agent/AgentProcesses.js"

/** Starts `count` real agents (`swactor node` child processes) and an orchestrator layer over them. */
export const startAgents = (count: number, options: Partial<LocalAgentsOptions> = {}) =>
  Effect.gen(function*() {
    const token = generateToken()
    const agents = yield* spawnLocalAgents({ count, token, threads: 1, ...options })
    const layer = layerRemote({ nodes: agents.map((a) => a.address), token, listenHost: "127.0.0.1" })
    return { agents, token, layer }
  }) satisfies Effect.Effect<{ agents: ReadonlyArray<LocalAgent> }, unknown, Scope.Scope>

/** Whether a process id is alive (and not a zombie). */
export const isAlive = (pid: number): boolean => {
  try {
    const stat = execFileSync("ps", ["-o", "stat=", "-p", String(pid)], { encoding: "utf8" }).trim()
    return stat !== "" && !stat.startsWith("Z")
  } catch {
    return false
  }
}

/** Live child processes of `ppid` (from the process table). */
export const childPids = (ppid: number): ReadonlyArray<number> => {
  try {
    return execFileSync("ps", ["-o", "pid=,stat=", "--ppid", String(ppid)], { encoding: "utf8" })
      .split("\n")
      .map((line) => line.trim().split(/\s+/))
      .filter(([pid, stat]) => pid !== undefined && pid !== "" && !(stat ?? "").startsWith("Z"))
      .map(([pid]) => Number(pid))
  } catch {
    return []
  }
}

/** Waits (polling) until `check` holds or `timeoutMs` passes; returns whether it held. */
export const eventually = (check: () => boolean, timeoutMs: number) =>
  Effect.gen(function*() {
    const until = Date.now() + timeoutMs
    while (Date.now() < until) {
      if (check()) return true
      yield* Effect.sleep("50 millis")
    }
    return check()
  })

/**
 * A TCP proxy in front of a data listener that cuts the producer → consumer direction after
 * `cutAfterBytes` bytes (in the middle of a frame unless the count falls on a boundary).
 */
export const cuttingProxy = (cutAfterBytes: number) =>
  Effect.acquireRelease(
    Effect.async<{ readonly port: number; readonly setTarget: (port: number) => void; readonly cut: () => boolean; readonly server: Net.Server }>(
      (resume) => {
        let target = 0
        let cut = false
        const server = Net.createServer((client) => {
          const upstream = Net.createConnection({ host: "127.0.0.1", port: target })
          let forwarded = 0
          client.on("data", (chunk: Buffer) => {
            if (cut) return
            const room = cutAfterBytes - forwarded
            if (chunk.length < room) {
              forwarded += chunk.length
              upstream.write(chunk)
              return
            }
            cut = true
            upstream.write(chunk.subarray(0, room), () => {
              upstream.destroy()
              client.destroy()
            })
          })
          upstream.on("data", (chunk: Buffer) => client.write(chunk))
          client.on("error", () => upstream.destroy())
          upstream.on("error", () => client.destroy())
          client.on("close", () => upstream.destroy())
          upstream.on("close", () => client.destroy())
        })
        server.listen(0, "127.0.0.1", () => {
          const address = server.address() as Net.AddressInfo
          resume(Effect.succeed({ port: address.port, setTarget: (port) => (target = port), cut: () => cut, server }))
        })
      }
    ),
    ({ server }) => Effect.async<void>((resume) => void server.close(() => resume(Effect.void)))
  )
