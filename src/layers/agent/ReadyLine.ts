/**
 * The parent–child protocol of a node agent started by this machine (`swactor node` as a child process): the ready
 * line it prints once it listens, the environment that carries its cluster token, and the orphan guard (it exits when
 * its parent's pipe on stdin closes). Both sides use this module: the agent (src/cli/NodeCommand.ts) and the spawner
 * (AgentProcesses.ts).
 */
import { Schema } from "effect"
import { type TransportAddress, TransportAddress as TransportAddressSchema } from "../../domain/frames.js"
import { clusterTokenVariable, parentWatchVariable } from "../config/Settings.js"

/**
 * The line a node agent prints on stdout once it listens:
 * `swactor-node-ready {"host":…,"port":…,"data":{"_tag":"Tcp"|"Unix",…},"pid":…}`.
 */
export const readyLinePrefix = "swactor-node-ready "
/** Environment variable that carries the cluster token to an agent (never argv: argv is world-readable). */
export const clusterTokenEnv = clusterTokenVariable
/** When "stdin", the agent exits as soon as its stdin closes (its parent died). */
export const parentWatchEnv = parentWatchVariable

/**
 * Agent side of the orphan guard: exit when the parent's pipe on stdin closes. Call once at
 * agent start-up; it watches when `watches` (`SWACTOR_PARENT_WATCH=stdin`, the Settings service's `watchesParent`).
 */
export const watchParentPipe = (watches: boolean, onParentGone: () => void): void => {
  if (!watches) return
  process.stdin.on("data", () => {})
  process.stdin.on("end", onParentGone)
  process.stdin.on("close", onParentGone)
  process.stdin.on("error", onParentGone)
  process.stdin.resume()
}

/** What the ready line carries. */
export const Announced = Schema.Struct({ host: Schema.String, port: Schema.Number, data: TransportAddressSchema })
export type Announced = typeof Announced.Type
export const decodeAnnounced = Schema.decodeUnknownSync(Announced)

/** Agent side: announce the bound addresses to the parent. */
export const announceReady = (host: string, port: number, data: TransportAddress): void => {
  process.stdout.write(`${readyLinePrefix}${JSON.stringify({ host, port, data, pid: process.pid })}\n`)
}
