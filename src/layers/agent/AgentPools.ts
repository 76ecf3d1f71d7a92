/**
 * The `AgentPool` layers: local agents (child processes on this machine, one per stage, Unix sockets in a private
 * folder) or remote nodes (their control addresses and the cluster token).
 */
import { join } from "node:path"
import * as Dgram from "node:dgram"
import { Effect, Fiber, Layer } from "effect"
import { NodeId } from "../../domain/ids.js"
import type { TransportAddress } from "../../domain/frames.js"
import { AgentPool, type AgentSet, InvalidRequest } from "../../services/Orchestrator.js"
import { generateToken, type LocalAgent, spawnLocalAgents } from "./AgentProcesses.js"
import { privateSocketDir } from "./SocketDir.js"
import { clusterTokenProblem, sparesProblem } from "../../services/RequestChecks.js"

export interface LocalPoolOptions {
  /** Default engine threads of each agent (a run may override per stage). */
  readonly threads?: number
  readonly engine?: "live" | "test"
  /** Agents when a request does not say how many stages (default 1). */
  readonly defaultStages?: number
  readonly extraArgs?: (index: number) => ReadonlyArray<string>
  readonly env?: Readonly<Record<string, string>>
  readonly inheritStderr?: boolean
  /** Start this many agents when the layer is built, for the first run of that many stages (see layerLocal). */
  readonly prestart?: number
  /** Called with the agents once they are up (tests use it to find pids). */
  readonly onStarted?: (agents: ReadonlyArray<LocalAgent>) => void
}

/** A fresh private socket folder, token and `count` agents, as one run of a local pool uses them. */
const startLocalSet = (count: number, options: LocalPoolOptions) =>
  Effect.gen(function* () {
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
        reason:
          `agent process ${agent.pid} exited (${exit.signal === null ? `code ${exit.code}` : exit.signal})` +
          (agent.stderrTail().trim() === "" ? "" : `: ${agent.stderrTail().trim().split("\n").slice(-3).join(" | ")}`)
      }))
    )
  )
  return {
    nodes,
    token,
    listenHost: "127.0.0.1",
    dataListen: { _tag: "Unix", path: join(dataDir, "orchestrator.sock") },
    exited,
    processRunning: (node) => agents[nodes.findIndex((n) => n.nodeId === node.nodeId)]?.running() ?? false
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
export const layerLocal = (options: LocalPoolOptions = {}): Layer.Layer<AgentPool> => {
  // Spares: agents that host nothing until a recovery needs them.
  const fresh = (stages: number | undefined, spares = 0) =>
    Effect.gen(function* () {
      const count = yield* checkedCount(stages ?? options.defaultStages ?? 1)
      const badSpares = sparesProblem(spares)
      if (badSpares !== undefined) return yield* new InvalidRequest({ message: badSpares })
      return agentSetOf(yield* startLocalSet(count + spares, options), options)
    })
  if (options.prestart === undefined) return Layer.succeed(AgentPool, AgentPool.of({ acquire: fresh }))
  const prestart = options.prestart
  return Layer.scoped(
    AgentPool,
    Effect.gen(function* () {
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
  readonly agents: ReadonlyArray<string>
  readonly token: string
  /**
   * The nodes now (`serve --discover`: the discovered pool's addresses), read by each pipeline set up (a re-plan's
   * too); `agents` when it gives none.
   */
  readonly current?: Effect.Effect<ReadonlyArray<string>> | undefined
  /** Where the orchestrator's data listener binds (default: the local address that routes to the first node). */
  readonly listenHost?: string
  /**
   * Bench-only (bench:wan): the orchestrator's data listener at this address, and the address the last stage is told to
   * send tokens to (a relay in front of it). Both unset by default: an ephemeral port on `listenHost`, sent as is.
   */
  readonly dataListen?: TransportAddress
  readonly dataAdvertise?: TransportAddress
}

/** Runs use the given remote agents; a run of more stages than nodes places stage i on node i mod n. */
export const layerRemote = (options: RemotePoolOptions): Layer.Layer<AgentPool> =>
  Layer.succeed(
    AgentPool,
    AgentPool.of({
      acquire: () =>
        Effect.gen(function* () {
          const now = options.current === undefined ? [] : yield* options.current
          const agents = now.length > 0 ? now : options.agents
          if (agents.length === 0) return yield* new InvalidRequest({ message: "no nodes given" })
          // The same strength rule as the command line's (services/RequestChecks.ts), before any node is contacted.
          const weak = clusterTokenProblem(
            options.token,
            "the remote pool's token option (default: SWACTOR_CLUSTER_TOKEN)"
          )
          if (weak !== undefined) return yield* new InvalidRequest({ message: weak })
          const first = agents[0]!.replace(/:\d+$/, "").replace(/^\[|\]$/g, "")
          const listenHost = options.listenHost ?? (yield* routeHostFor(first))
          return {
            nodes: agents.map((address, index) => ({ nodeId: NodeId.make(index + 1), address })),
            token: options.token,
            listenHost,
            ...(options.dataListen === undefined ? {} : { dataListen: options.dataListen }),
            ...(options.dataAdvertise === undefined ? {} : { dataAdvertise: options.dataAdvertise }),
            exited: Effect.never
          } satisfies AgentSet
        })
    })
  )
