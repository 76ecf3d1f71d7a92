/** Helpers for end-to-end tests with real agent processes. */
import { execFileSync, spawn } from "node:child_process"
import * as Net from "node:net"
import { Effect, type Scope } from "effect"
import { layerRemote } from "../../src/api/generate.js"
import { ProvisionRequest } from "../../src/domain/controlRpc.js"
import { tcpAddress, type TransportAddress } from "../../src/domain/frames.js"
import type { EdgeId, NodeId, PortId, RoleId, RunId } from "../../src/domain/ids.js"
import { ProvisionStage, type RingSpec } from "../../src/domain/plan.js"
import {
  generateToken,
  type LocalAgent,
  type LocalAgentsOptions,
  spawnLocalAgents,
  swactorMain
} from "../../src/layers/agent/AgentProcesses.js"
import { repoRoot } from "./models.js"
import { eventLimitMillis } from "./until.js"

/** Starts `count` real agents (`swactor node` child processes) and an orchestrator layer over them. */
export const startAgents = (count: number, options: Partial<LocalAgentsOptions> = {}) =>
  Effect.gen(function* () {
    const token = generateToken()
    const agents = yield* spawnLocalAgents({ count, token, threads: 1, ...options })
    const layer = layerRemote({ agents: agents.map((a) => a.address), token, listenHost: "127.0.0.1" })
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

/**
 * Waits (polling) until `check` holds or `timeoutMs` passes; returns whether it held. The default limit is the
 * suite's generous outer limit for an event (support/until.ts): only an event that never comes reaches it.
 */
export const eventually = (check: () => boolean, timeoutMs = eventLimitMillis) =>
  Effect.gen(function* () {
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
    Effect.async<{
      readonly port: number
      readonly setTarget: (port: number) => void
      readonly cut: () => boolean
      readonly server: Net.Server
    }>((resume) => {
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
    }),
    ({ server }) => Effect.async<void>((resume) => void server.close(() => resume(Effect.void)))
  )

/**
 * A `swactor node` child process with the test engine on an ephemeral loopback port (`args` added to its command line,
 * `logLevel` given as swactor's `--log-level`): its control port and data address (from its ready line), what it wrote
 * so far, and `stop` (SIGTERM, then its exit). Rejects with its output when it exits before its ready line.
 */
export const startTestNode = async (
  options: { readonly args?: ReadonlyArray<string>; readonly logLevel?: string } = {}
) => {
  const child = spawn(
    process.execPath,
    [
      swactorMain(),
      ...(options.logLevel === undefined ? [] : ["--log-level", options.logLevel]),
      "node",
      "--listen",
      "127.0.0.1:0",
      "--engine",
      "test",
      ...(options.args ?? [])
    ],
    {
      cwd: repoRoot,
      stdio: ["ignore", "pipe", "pipe"],
      env: { ...process.env, SWACTOR_CLUSTER_TOKEN: generateToken() }
    }
  )
  let stdout = ""
  let stderr = ""
  child.stderr.on("data", (chunk) => (stderr += chunk))
  const { port, data } = await new Promise<{ port: number; data: TransportAddress }>((resolve, reject) => {
    child.stdout.on("data", (chunk) => {
      stdout += chunk
      const ready = /swactor-node-ready (\{.*\})/.exec(stdout)
      if (ready !== null) resolve(JSON.parse(ready[1]!) as { port: number; data: TransportAddress })
    })
    child.on("exit", (code) => reject(new Error(`swactor node exited (${code}) before its ready line:\n${stderr}`)))
  })
  return {
    port,
    data,
    stdout: () => stdout,
    stderr: () => stderr,
    stop: async () => {
      child.kill("SIGTERM")
      if (child.exitCode === null && child.signalCode === null)
        await new Promise((resolve) => child.on("exit", resolve))
    }
  }
}

/** A connection that speaks no handshake (40 bytes of "A"): the node refuses it; resolves once it is closed. */
export const refusedConnection = (port: number) =>
  new Promise<void>((resolve) => {
    const socket = Net.createConnection({ host: "127.0.0.1", port }, () => socket.write(Buffer.alloc(40, 0x41)))
    socket.on("error", () => {})
    socket.on("close", () => resolve())
  })

const provisionRing: RingSpec = {
  dataCapacity: 1 << 20,
  alignment: 64,
  direction: "Egress",
  hostPinning: "Pageable",
  wakeCoalescing: "PendingBit"
}

/**
 * A provision of all 5 blocks of stories260K (at `path`) as one stage, as the orchestrator would send it; its outbound
 * address is one nobody listens on (a stage that really started would retry it until stopped).
 */
export const stories260KProvision = (runId: RunId, path: string, threads: number) =>
  new ProvisionRequest({
    provision: new ProvisionStage({
      runId,
      nodeId: 1 as NodeId,
      stageIndex: 0,
      stageCount: 1,
      layerStart: 0,
      layerEndExclusive: 5,
      ggufSource: { _tag: "LocalPath", path },
      tokenizer: { _tag: "EmbeddedInGguf" },
      model: {
        modelId: "stories260K",
        ggufSource: { _tag: "LocalPath", path },
        numLayers: 5,
        hiddenDim: 64,
        dtypeFamily: "Float",
        dtypeWidthBytes: 4,
        maxSeqLen: 512,
        eosTokenId: 2,
        tokenizer: { _tag: "EmbeddedInGguf" }
      },
      runtime: { roleId: 0 as RoleId, inputPort: "in" as PortId, outputPort: "out" as PortId, sampling: null },
      inbound: {
        edgeId: 0 as EdgeId,
        kind: "TokenIn",
        peer: { _tag: "Orchestrator", nodeId: 0 as NodeId },
        ring: provisionRing
      },
      outbound: {
        edgeId: 1 as EdgeId,
        kind: "TokenOut",
        peer: { _tag: "Orchestrator", nodeId: 0 as NodeId },
        ring: provisionRing
      }
    }),
    outboundAddress: tcpAddress(9, "127.0.0.1"),
    threads,
    contextLength: 256
  })
