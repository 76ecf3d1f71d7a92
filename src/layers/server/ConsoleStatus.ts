/**
 * The console's status (domain/consoleStatus.ts), derived from what the server already knows: its status (Loading,
 * Ready with the agents lost, Reviving with each agent's state, Faulted), its metrics snapshot (MetricsRecorder.ts:
 * the counters, each live agent's capacity, the set-up's capacity and loading, the plan) and the model it serves.
 * Nothing is measured here: the tokens per second are the completion-token counter's rise over the last seconds.
 */
import { Effect, Ref } from "effect"
import type { ConsoleNode, ConsoleStatus } from "../../domain/consoleStatus.js"
import type { ServerInfo, ServerMetrics, ServerService, ServerStatus } from "../../services/Server.js"

/** How far back the tokens per second look. */
const rateWindowMillis = 5000

const unknownResources = { memoryUsedBytes: null, memoryTotalBytes: null, cores: null, backend: null }

/** A node's memory, cores and backend: as it answered now, else as it reported when the pool was ready. */
const resourcesOf = (metrics: ServerMetrics, address: string) => {
  const live = metrics.agents.find((a) => a.address === address)?.capacity
  const c = live ?? metrics.setup?.nodes.find((n) => n.address === address)?.capacity
  return c === undefined
    ? unknownResources
    : {
        memoryUsedBytes: Math.max(0, c.totalMemoryBytes - c.freeMemoryBytes),
        memoryTotalBytes: c.totalMemoryBytes,
        cores: c.threads,
        backend: c.backend
      }
}

/** Loading: the share of the weight bytes of the node's stages loaded so far (null: none reported). */
const progressOf = (metrics: ServerMetrics, address: string): number | null => {
  const stages = new Set((metrics.plan?.stages ?? []).filter((s) => s.address === address).map((s) => s.stageIndex))
  let loaded = 0
  let total = 0
  for (const l of metrics.setup?.loading ?? []) {
    if (!stages.has(l.stageIndex)) continue
    loaded += l.done ? l.totalBytes : l.loadedBytes
    total += l.totalBytes
  }
  for (const w of metrics.weights ?? []) {
    if (w.address !== address) continue
    loaded += w.bytes
    total += w.totalBytes
  }
  return total > 0 ? Math.min(1, loaded / total) : null
}

/** Every node the server knows of: the pool's, the plan's, the live agents', the lost and those it waits for. */
const addressesOf = (status: ServerStatus, metrics: ServerMetrics) => {
  const all = [
    ...(metrics.setup?.nodes.map((n) => n.address) ?? []),
    ...(metrics.plan?.stages.map((s) => s.address) ?? []),
    ...metrics.agents.map((a) => a.address),
    ...(status._tag === "Ready" ? (status.lostAgents ?? []) : []),
    ...(status._tag === "Reviving" ? status.waitingFor.map((a) => a.address) : [])
  ]
  return [...new Set(all)]
}

/** A node's state as the server's status says it. */
const stateOf = (
  status: ServerStatus,
  metrics: ServerMetrics,
  address: string
): Pick<ConsoleNode, "state" | "progress" | "detail"> => {
  switch (status._tag) {
    case "Loading":
      return { state: "loading", progress: progressOf(metrics, address), detail: "" }
    case "Ready":
      return (status.lostAgents ?? []).includes(address)
        ? { state: "lost", progress: null, detail: "lost: the pipeline runs without it" }
        : { state: "ready", progress: null, detail: "" }
    case "Reviving": {
      const agent = status.waitingFor.find((a) => a.address === address)
      return agent === undefined || agent.state === "up" || agent.state === "waiting"
        ? { state: "reviving", progress: null, detail: agent?.detail ?? status.message }
        : { state: "lost", progress: null, detail: agent.detail }
    }
    case "Faulted":
      return { state: "lost", progress: null, detail: status.message }
  }
}

/** The status from the server's status, metrics and model, with the tokens per second given. */
export const consoleStatusOf = (
  status: ServerStatus,
  metrics: ServerMetrics,
  model: { readonly id: string; readonly info: ServerInfo | undefined },
  live: { readonly tokensPerSecond: number; readonly eventStreams: number }
): ConsoleStatus => ({
  status:
    status._tag === "Loading"
      ? "loading"
      : status._tag === "Ready"
        ? "ready"
        : status._tag === "Reviving"
          ? "reviving"
          : "faulted",
  detail: status._tag === "Reviving" || status._tag === "Faulted" ? status.message : "",
  nodes: addressesOf(status, metrics).map((address) => {
    const state = stateOf(status, metrics, address)
    // a lost node's last figures would be stale: none shown
    return { address, ...state, ...(state.state === "lost" ? unknownResources : resourcesOf(metrics, address)) }
  }),
  plan: {
    contextTokens: metrics.plan?.contextTokens ?? 0,
    stages: (metrics.plan?.stages ?? []).map((s) => ({ ...s, layers: [s.layers[0], s.layers[1]] as const }))
  },
  live: {
    tokensPerSecond: live.tokensPerSecond,
    timeToFirstTokenSeconds:
      metrics.firstToken.requests === 0 ? null : metrics.firstToken.totalSeconds / metrics.firstToken.requests,
    inFlight: metrics.inFlight,
    queued: metrics.queued,
    recoveries: metrics.recoveries,
    revivals: metrics.revivals,
    completed: metrics.requests.completed,
    completionTokens: metrics.completionTokens,
    eventStreams: live.eventStreams
  },
  models: [
    {
      id: model.id,
      layers: model.info?.model.numLayers ?? null,
      contextLength: model.info?.model.maxSeqLen ?? null
    }
  ]
})

/**
 * The console's status, read at most every 250 ms however many pages ask (a snapshot asks each live agent for its
 * capacity), with the tokens per second from the completion-token counter's samples of the last 5 s; and the count of
 * event streams open (`stream` around each).
 */
export const makeConsole = (server: ServerService, modelId: string) =>
  Effect.gen(function* () {
    const samples: Array<{ at: number; tokens: number }> = []
    const streams = yield* Ref.make(0)
    let cached: { at: number; status: ConsoleStatus } | undefined
    const read = Effect.gen(function* () {
      const at = performance.now()
      const status = yield* server.status
      const metrics = yield* server.metrics
      const info = status._tag === "Ready" ? yield* Effect.option(server.ready) : undefined
      samples.push({ at, tokens: metrics.completionTokens })
      while (samples.length > 1 && at - samples[0]!.at > rateWindowMillis) samples.shift()
      const first = samples[0]!
      const seconds = (at - first.at) / 1000
      const tokensPerSecond = seconds > 0 ? (metrics.completionTokens - first.tokens) / seconds : 0
      return consoleStatusOf(
        status,
        metrics,
        { id: modelId, info: info?._tag === "Some" ? info.value : undefined },
        { tokensPerSecond, eventStreams: yield* Ref.get(streams) }
      )
    })
    return {
      status: Effect.suspend(() =>
        cached !== undefined && performance.now() - cached.at < 250
          ? Effect.succeed(cached.status)
          : Effect.tap(read, (status) => Effect.sync(() => (cached = { at: performance.now(), status })))
      ),
      /** An event stream opened; closed by the returned effect (its finalizer). */
      opened: Effect.zipRight(
        Ref.update(streams, (n) => n + 1),
        Effect.sync(() => (cached = undefined))
      ),
      closed: Effect.zipRight(
        Ref.update(streams, (n) => n - 1),
        Effect.sync(() => (cached = undefined))
      )
    }
  })

export type Console = Effect.Effect.Success<ReturnType<typeof makeConsole>>
