/**
 * The server's metrics: counters of requests and tokens, per stage what completed requests cost (engine, transfer,
 * batches, memory), the time to first token by phase (Server.ts FirstTokenPhases), and a snapshot (Server.metrics)
 * that adds the admission's gauges, the prompt cache's and each live agent's capacity. MetricsText.ts renders it.
 */
import { Effect } from "effect"
import type { Pipeline, RunSummary, RunUpdate } from "../../services/Orchestrator.js"
import type { ServerMetrics, StageMetrics } from "../../services/Server.js"

/** When a completed request arrived, was queued, admitted, its stages ready and its first token out (performance.now). */
interface FirstTokenTimes {
  readonly receivedAt: number
  readonly queuedAt: number
  readonly admittedAt: number
  readonly readyAt: number
  readonly firstAt: number
}

/** The latest report of each stage's weights on their way (start-up and revival updates). */
const makeWeightsRecorder = () => {
  const weights = new Map<string, NonNullable<ServerMetrics["weights"]>[number]>()
  return {
    observe: (update: RunUpdate) => {
      if (update._tag !== "WeightsDelivery") return
      weights.set(`${update.stageIndex}|${update.address}`, {
        stageIndex: update.stageIndex,
        address: update.address,
        source: update.source === "Hub" ? "hub" : "orchestrator",
        bytes: update.sentBytes,
        totalBytes: update.totalBytes
      })
    },
    snapshot: (): Pick<ServerMetrics, "weights"> => (weights.size === 0 ? {} : { weights: [...weights.values()] })
  }
}

/**
 * The pipeline's set-up and plan as its updates pass: each node's capacity when the pool was ready, each stage's
 * weights loaded so far, and the stages of the latest plan (with their bytes from the KV sizing's layout).
 */
const makePlanRecorder = () => {
  const nodes = new Map<string, NonNullable<ServerMetrics["setup"]>["nodes"][number]>()
  const loading = new Map<number, { stageIndex: number; loadedBytes: number; totalBytes: number; done: boolean }>()
  let planned: Extract<RunUpdate, { _tag: "Planned" }>["stages"] = []
  return {
    observe: (update: RunUpdate) => {
      if (update._tag === "PoolReady")
        for (const c of update.capacity) nodes.set(c.node.address, { address: c.node.address, capacity: c.capacity })
      if (update._tag === "Planned" && update.stages.length > 0) planned = update.stages
      if (update._tag === "StageLoading") {
        const done = loading.get(update.stageIndex)?.done ?? false
        loading.set(update.stageIndex, { ...update, done })
      }
      if (update._tag === "StageReady") {
        const was = loading.get(update.stageIndex)
        loading.set(update.stageIndex, {
          stageIndex: update.stageIndex,
          loadedBytes: was?.totalBytes ?? 0,
          totalBytes: was?.totalBytes ?? 0,
          done: true
        })
      }
    },
    snapshot: (sizing: PlanSizing | undefined): Pick<ServerMetrics, "plan" | "setup"> => ({
      ...(nodes.size === 0 && loading.size === 0
        ? {}
        : { setup: { nodes: [...nodes.values()], loading: [...loading.values()] } }),
      ...(planned.length === 0 || sizing === undefined
        ? {}
        : {
            plan: {
              contextTokens: sizing.contextTokens(),
              stages: planned.map((s) => ({ ...s, ...sizing.stageBytes(s.layers[0], s.layers[1]) }))
            }
          })
    })
  }
}

/** The bytes of a planned stage (KvSizing.ts). */
interface PlanSizing {
  readonly contextTokens: () => number
  readonly stageBytes: (start: number, end: number) => { readonly weightBytes: number; readonly kvBytes: number }
}

/** The server's counters, as requests complete (ServerMetrics without the gauges read at snapshot time). */
const newCounts = () => ({
  completed: 0,
  cancelled: 0,
  failed: 0,
  refused: 0,
  promptTokens: 0,
  completionTokens: 0,
  recoveries: 0,
  speculative: { steps: 0, drafted: 0, accepted: 0 },
  stragglers: 0,
  revivals: 0,
  revivalAttempts: 0,
  inFlight: 0,
  stages: new Map<number, { -readonly [K in Exclude<keyof StageMetrics, "stageIndex">]: StageMetrics[K] }>(),
  firstToken: {
    requests: 0,
    totalSeconds: 0,
    tokenize: 0,
    admit: 0,
    setup: 0,
    prefillWait: 0,
    prefill: 0,
    sample: 0,
    hops: 0
  }
})

type Counts = ReturnType<typeof newCounts>

/** The stage's counters, made at its first report. */
const stageOf = (counts: Counts, stageIndex: number) => {
  const m = counts.stages.get(stageIndex) ?? {
    computeSeconds: 0,
    transferSeconds: 0,
    decodeTokens: 0,
    microBatches: 0,
    batchRows: 0,
    maxBatchSequences: 0,
    stragglerTokens: 0,
    computeBytes: 0,
    residentBytes: 0,
    peakResidentBytes: 0,
    kvBytes: 0,
    prefillSeconds: 0,
    prefillWaitSeconds: 0
  }
  counts.stages.set(stageIndex, m)
  return m
}

/** A finished run's per-stage costs: engine, transfer, batches and (when measured) memory. */
const recordStages = (counts: Counts, update: Extract<RunUpdate, { _tag: "Finished" }>) => {
  const decodeSteps = Math.max(0, update.summary.generatedTokens - 1)
  for (const s of update.summary.stages) {
    const m = stageOf(counts, s.stageIndex)
    m.computeSeconds += (s.prefillComputeMillis + s.computeMillisPerToken * decodeSteps) / 1000
    m.transferSeconds += (update.summary.transferMillisPerToken * decodeSteps) / 1000 / update.summary.stages.length
    m.decodeTokens += decodeSteps
    m.microBatches += s.microBatches
    m.batchRows += s.batchRows
    m.maxBatchSequences = Math.max(m.maxBatchSequences, s.maxBatchSequences)
    if (s.residentBytes > 0) {
      m.computeBytes = s.computeBytes
      m.residentBytes = s.residentBytes
      m.peakResidentBytes = Math.max(m.peakResidentBytes, s.peakResidentBytes)
      m.kvBytes = s.kvBytes
    }
  }
}

/** A completed request's time to first token, split into its phases (FirstTokenPhases); per stage its prefill. */
const recordFirstToken = (counts: Counts, summary: RunSummary, at: FirstTokenTimes) => {
  const f = counts.firstToken
  let onStages = 0
  let wait = 0
  let sample = 0
  for (const s of summary.stages) {
    const m = stageOf(counts, s.stageIndex)
    m.prefillSeconds += (s.prefillComputeMillis - s.prefillWaitMillis) / 1000
    m.prefillWaitSeconds += s.prefillWaitMillis / 1000
    onStages += s.prefillComputeMillis
    wait += s.prefillWaitMillis
    sample += s.firstSampleMillis
  }
  f.requests++
  f.totalSeconds += (at.firstAt - at.receivedAt) / 1000
  f.tokenize += (at.queuedAt - at.receivedAt) / 1000
  f.admit += (at.admittedAt - at.queuedAt) / 1000
  f.setup += (at.readyAt - at.admittedAt) / 1000
  f.prefillWait += wait / 1000
  f.prefill += (onStages - wait) / 1000
  f.sample += sample / 1000
  f.hops += Math.max(0, at.firstAt - at.readyAt - onStages - sample) / 1000
}

/** A run's update as it counts: recoveries, stragglers, and a finished run's stages and first token. */
const record = (counts: Counts, update: RunUpdate, firstToken: () => FirstTokenTimes | undefined) => {
  if (update._tag === "Recovered") counts.recoveries++
  if (update._tag === "StageStraggler") stageOf(counts, update.straggler.stageIndex).stragglerTokens++
  if (update._tag === "Finished") {
    counts.stragglers += update.summary.stragglers.length
    const spec = update.summary.speculative
    if (spec !== undefined) {
      counts.speculative.steps += spec.steps
      counts.speculative.drafted += spec.drafted
      counts.speculative.accepted += spec.accepted
    }
    recordStages(counts, update)
    const at = firstToken()
    if (at !== undefined) recordFirstToken(counts, update.summary, at)
  }
}

/** Each live agent's capacity, asked with a 1 s timeout (-1 active stages: no answer). */
const agentsOf = (up: Pipeline) =>
  Effect.gen(function* () {
    return yield* Effect.forEach(
      yield* up.alive,
      (agent) =>
        agent.capacity.pipe(
          Effect.timeout("1 second"),
          Effect.map((c) => ({
            address: agent.node.address,
            pid: agent.pid,
            activeStages: c.activeStages,
            capacity: {
              freeMemoryBytes: c.freeMemoryBytes,
              totalMemoryBytes: c.totalMemoryBytes,
              threads: c.threads,
              backend: c.backend
            },
            ...(c.devices === undefined ? {} : { devices: c.devices }),
            ...(c.openSessions === undefined ? {} : { openSessions: c.openSessions }),
            ...(c.stepCosts === undefined ? {} : { stepCosts: c.stepCosts })
          })),
          Effect.orElseSucceed(() => ({ address: agent.node.address, pid: agent.pid, activeStages: -1 }))
        ),
      { concurrency: "unbounded" }
    )
  })

/** What the snapshot reads now: the admission's state, the live pipeline, the prompt cache and the KV budget. */
interface SnapshotSources {
  readonly admission: () => { readonly used: number; readonly queued: number }
  readonly pipeline: () => Pipeline | undefined
  readonly promptCache: () => NonNullable<ServerMetrics["promptCache"]>
  readonly kvBudgetBytes: () => number
  /** The bytes of the planned stages (absent: the plan is not shown). */
  readonly sizing?: PlanSizing
}

/**
 * The metrics now: the counters, the admission's and the prompt cache's state, and (with a live pipeline) each
 * agent's capacity, asked with a 1 s timeout (-1 active stages: no answer).
 */
const snapshot = (
  counts: Counts,
  weights: ReturnType<typeof makeWeightsRecorder>,
  plan: ReturnType<typeof makePlanRecorder>,
  now: SnapshotSources
): Effect.Effect<ServerMetrics> =>
  Effect.gen(function* () {
    const state = now.admission()
    const up = now.pipeline()
    const agents = up !== undefined ? yield* agentsOf(up) : []
    return {
      requests: {
        completed: counts.completed,
        cancelled: counts.cancelled,
        failed: counts.failed,
        refused: counts.refused
      },
      promptTokens: counts.promptTokens,
      completionTokens: counts.completionTokens,
      recoveries: counts.recoveries,
      speculative: { ...counts.speculative },
      stragglers: counts.stragglers,
      revivals: counts.revivals,
      revivalAttempts: counts.revivalAttempts,
      promptCache: now.promptCache(),
      inFlight: counts.inFlight,
      queued: state.queued,
      kvReservedBytes: state.used,
      kvBudgetBytes: up !== undefined ? now.kvBudgetBytes() : 0,
      stages: [...counts.stages].sort(([a], [b]) => a - b).map(([stageIndex, m]) => ({ stageIndex, ...m })),
      firstToken: { ...counts.firstToken },
      ...weights.snapshot(),
      ...plan.snapshot(now.sizing),
      agents
    }
  })

export const make = () => {
  const weights = makeWeightsRecorder()
  const plan = makePlanRecorder()
  const counts = newCounts()
  return {
    counts,
    record: (update: RunUpdate, firstToken: () => FirstTokenTimes | undefined) => record(counts, update, firstToken),
    snapshot: (now: SnapshotSources) => snapshot(counts, weights, plan, now),
    observeSetup: (update: RunUpdate) => {
      weights.observe(update)
      plan.observe(update)
    },
    /** Every run's updates (the warm-up's too): the plan and the stages' loading. */
    observePlan: plan.observe
  }
}
