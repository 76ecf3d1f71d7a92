/**
 * The Prometheus text (exposition format 0.0.4) of GET /metrics: the Server's metrics snapshot (MetricsRecorder.ts)
 * and the HTTP front's connection counts (HttpListener.ts).
 */
import type { ServerMetrics } from "../../services/Server.js"
import type { ConnectionStats } from "./HttpListener.js"

/** One metric: its HELP and TYPE lines, then a line per sample (its labels and value). */
type Metric = (name: string, type: string, help: string, samples: ReadonlyArray<[string, number]>) => void

/** One block range's measured step costs in an agent's metrics. */
type StepCostEntry = NonNullable<ServerMetrics["agents"][number]["stepCosts"]>[number]

/** The prompt cache's counters and gauges (entries in LRU order: `lru="0"` is evicted first). */
const renderPromptCache = (c: NonNullable<ServerMetrics["promptCache"]>, metric: Metric) => {
  metric("swactor_prompt_cache_hits_total", "counter", "Requests whose prompt started after a held prefix's KV", [
    ["", c.hits]
  ])
  metric(
    "swactor_prompt_cache_misses_total",
    "counter",
    "Requests with the prompt cache on that prefilled every token",
    [["", c.misses]]
  )
  metric(
    "swactor_prompt_cache_evictions_total",
    "counter",
    "Prompt-cache entries dropped for memory or the entry bound",
    [["", c.evictions]]
  )
  metric("swactor_prompt_cache_cached_tokens_total", "counter", "Prompt tokens not prefilled (their KV reused)", [
    ["", c.cachedTokens]
  ])
  metric("swactor_prompt_cache_entries", "gauge", "Prompt-cache entries held", [["", c.entries]])
  metric("swactor_prompt_cache_bytes", "gauge", "KV bytes per stage the prompt-cache entries hold", [["", c.bytes]])
  metric(
    "swactor_prompt_cache_entry_tokens",
    "gauge",
    "Tokens each entry holds, by least-recently-used rank",
    c.lru.map((e, rank): [string, number] => [`{entry="${e.entry}",lru="${rank}"}`, e.tokens])
  )
}

/** A label value in the exposition format: backslash, double quote and newline escaped. */
const labelValue = (v: string) => v.replace(/[\\"]/g, (c) => `\\${c}`).replace(/\n/g, "\\n")

/** Each stage's weights on their way: bytes fetched from the hub by its node, or sent by the server. */
const renderWeights = (weights: NonNullable<ServerMetrics["weights"]>, metric: Metric) => {
  const labels = (w: NonNullable<ServerMetrics["weights"]>[number]) =>
    `{stage="${w.stageIndex}",address="${w.address}",source="${w.source}"}`
  metric(
    "swactor_weights_bytes",
    "gauge",
    "Bytes of a stage's weights its node has fetched from the hub (source hub) or been sent (source orchestrator)",
    weights.map((w): [string, number] => [labels(w), w.bytes])
  )
  metric(
    "swactor_weights_total_bytes",
    "gauge",
    "Bytes of a stage's weights to fetch or send",
    weights.map((w): [string, number] => [labels(w), w.totalBytes])
  )
}

/** Each agent's ggml devices: free and total memory as the backend reports it. */
const renderDevices = (m: ServerMetrics, metric: Metric) => {
  const deviceMemory = (state: "free" | "total") =>
    m.agents.flatMap((a) =>
      (a.devices ?? []).map((d): [string, number] => [
        `{address="${a.address}",pid="${a.pid}",device="${labelValue(d.name)}",kind="${labelValue(d.kind)}",state="${state}"}`,
        state === "free" ? d.freeBytes : d.totalBytes
      ])
    )
  metric(
    "swactor_agent_device_memory_bytes",
    "gauge",
    "Memory of each agent's ggml devices (CPU, GPU), free and total, as the backend reports it",
    [...deviceMemory("free"), ...deviceMemory("total")]
  )
}

/** The requests' counters, by outcome, and the pipeline's recoveries and revivals. */
const renderRequests = (m: ServerMetrics, status: string, metric: Metric) => {
  metric("swactor_up", "gauge", "1 when the pipeline is ready", [[`{status="${status}"}`, status === "ready" ? 1 : 0]])
  metric("swactor_requests_total", "counter", "Requests by outcome", [
    ['{outcome="completed"}', m.requests.completed],
    ['{outcome="cancelled"}', m.requests.cancelled],
    ['{outcome="failed"}', m.requests.failed],
    ['{outcome="refused"}', m.requests.refused]
  ])
  metric("swactor_prompt_tokens_total", "counter", "Prompt tokens of admitted requests", [["", m.promptTokens]])
  metric("swactor_completion_tokens_total", "counter", "Generated tokens", [["", m.completionTokens]])
  metric("swactor_recoveries_total", "counter", "Generations resumed after their run faulted", [["", m.recoveries]])
  metric("swactor_speculative_steps_total", "counter", "Decode steps that verified drafted tokens", [
    ["", m.speculative.steps]
  ])
  metric("swactor_speculative_drafted_total", "counter", "Tokens drafted (speculative decoding)", [
    ["", m.speculative.drafted]
  ])
  metric("swactor_speculative_accepted_total", "counter", "Drafted tokens kept: decode steps saved", [
    ["", m.speculative.accepted]
  ])
  metric("swactor_pipeline_revivals_total", "counter", "Times the server served again after every agent was lost", [
    ["", m.revivals]
  ])
  metric(
    "swactor_pipeline_revival_attempts_total",
    "counter",
    "Attempts to revive a pipeline whose agents were all lost",
    [["", m.revivalAttempts]]
  )
  metric("swactor_straggler_tokens_total", "counter", "Decoded tokens over 4x the recent median", [["", m.stragglers]])
}

/** Admission's gauges: requests running and waiting, and the KV bytes reserved against the budget. */
const renderAdmission = (m: ServerMetrics, metric: Metric) => {
  metric("swactor_requests_in_flight", "gauge", "Requests running", [["", m.inFlight]])
  metric("swactor_requests_queued", "gauge", "Requests waiting for admission", [["", m.queued]])
  metric("swactor_kv_reserved_bytes", "gauge", "KV bytes per stage reserved by running requests", [
    ["", m.kvReservedBytes]
  ])
  metric("swactor_kv_budget_bytes", "gauge", "KV bytes per stage admission may reserve", [["", m.kvBudgetBytes]])
}

/** Time to first token: its sum, its count and its phases. */
const renderFirstToken = (f: ServerMetrics["firstToken"], metric: Metric) => {
  metric("swactor_first_token_seconds_sum", "counter", "Time to first token, summed over completed requests", [
    ["", f.totalSeconds]
  ])
  metric("swactor_first_token_seconds_count", "counter", "Completed requests that got a first token", [
    ["", f.requests]
  ])
  metric(
    "swactor_first_token_phase_seconds_total",
    "counter",
    "Time to first token by phase, summed over completed requests (tokenize, admit, setup: sessions opened, prefill_wait: " +
      "in the stages' batchers, prefill: engine, sample, hops: the rest)",
    (
      [
        ["tokenize", f.tokenize],
        ["admit", f.admit],
        ["setup", f.setup],
        ["prefill_wait", f.prefillWait],
        ["prefill", f.prefill],
        ["sample", f.sample],
        ["hops", f.hops]
      ] as const
    ).map(([phase, seconds]): [string, number] => [`{phase="${phase}"}`, seconds])
  )
}

/** Each stage's measured costs beyond compute: prefill, transfers, batches, memory and stragglers. */
const renderStages = (m: ServerMetrics, metric: Metric) => {
  const perStage = (value: (s: ServerMetrics["stages"][number]) => number) =>
    m.stages.map((s): [string, number] => [`{stage="${s.stageIndex}"}`, value(s)])
  metric(
    "swactor_stage_prefill_seconds_total",
    "counter",
    "Engine time on prompts per stage (completed requests)",
    perStage((s) => s.prefillSeconds)
  )
  metric(
    "swactor_stage_prefill_wait_seconds_total",
    "counter",
    "Time prompts waited in the stage's batcher (completed requests)",
    perStage((s) => s.prefillWaitSeconds)
  )
  metric(
    "swactor_stage_transfer_seconds_total",
    "counter",
    "Decode time outside the engines, shared per stage (completed requests)",
    perStage((s) => s.transferSeconds)
  )
  metric(
    "swactor_stage_decode_tokens_total",
    "counter",
    "Decode steps per stage (completed requests)",
    perStage((s) => s.decodeTokens)
  )
  metric(
    "swactor_stage_micro_batches_total",
    "counter",
    "Micro-batches that carried a completed request's work, summed over requests (rows / this = mean batch rows)",
    perStage((s) => s.microBatches)
  )
  metric(
    "swactor_stage_batch_rows_total",
    "counter",
    "Rows of those micro-batches, summed over requests",
    perStage((s) => s.batchRows)
  )
  metric(
    "swactor_stage_max_batch_sequences",
    "gauge",
    "Most sequences seen in one micro-batch",
    perStage((s) => s.maxBatchSequences)
  )
  metric(
    "swactor_stage_compute_buffer_bytes",
    "gauge",
    "The stage's compute buffers, measured by its agent",
    perStage((s) => s.computeBytes)
  )
  metric(
    "swactor_stage_kv_bytes",
    "gauge",
    "KV cache bytes of one sequence on the stage, sliding-window caches capped",
    perStage((s) => s.kvBytes)
  )
  metric(
    "swactor_stage_resident_bytes",
    "gauge",
    "Resident memory of the stage's agent process, measured at its last completed request",
    perStage((s) => s.residentBytes)
  )
  metric(
    "swactor_stage_peak_resident_bytes",
    "gauge",
    "Peak resident memory (VmHWM) of the stage's agent process",
    perStage((s) => s.peakResidentBytes)
  )
  metric(
    "swactor_stage_straggler_tokens_total",
    "counter",
    "Decode steps on which the stage took over 4x its own recent median",
    perStage((s) => s.stragglerTokens)
  )
}

/** Each agent's stages, devices, measured step costs, its batcher's last choice and its open sessions. */
const renderAgents = (m: ServerMetrics, metric: Metric) => {
  metric(
    "swactor_agent_active_stages",
    "gauge",
    "Stages each agent hosts now (-1: no answer)",
    m.agents.map((a) => [`{address="${a.address}",pid="${a.pid}"}`, a.activeStages])
  )
  renderDevices(m, metric)
  const sessionsOf = (value: (s: NonNullable<ServerMetrics["agents"][number]["openSessions"]>) => number) =>
    m.agents.flatMap((a): Array<[string, number]> =>
      a.openSessions === undefined ? [] : [[`{address="${a.address}",pid="${a.pid}"}`, value(a.openSessions)]]
    )
  const stepCostsOf = <A>(f: (label: string, entry: StepCostEntry) => ReadonlyArray<A>) =>
    m.agents.flatMap((a) =>
      (a.stepCosts ?? []).flatMap((entry) =>
        f(`address="${a.address}",pid="${a.pid}",layers="${entry.layers[0]}-${entry.layers[1]}"`, entry)
      )
    )
  // the batcher's last choice per agent and block range (none before it chose)
  const choiceOf = (value: (choice: NonNullable<StepCostEntry["choice"]>) => number) =>
    stepCostsOf((label, e): Array<[string, number]> =>
      e.choice === undefined ? [] : [[`{${label}}`, value(e.choice)]]
    )
  metric(
    "swactor_agent_step_ms",
    "gauge",
    "Measured decode step (ms) of each agent's loaded block range, by rows per micro-batch (idle probe and served steps)",
    stepCostsOf((label, e): Array<[string, number]> => e.costs.map((c) => [`{${label},rows="${c.rows}"}`, c.millis]))
  )
  metric(
    "swactor_agent_decode_batch_rows",
    "gauge",
    "Rows per decode micro-batch the agent's batcher chose last from the measured step costs (see _default_rows)",
    choiceOf((c) => c.rows)
  )
  metric(
    "swactor_agent_decode_batch_default_rows",
    "gauge",
    "ceil(decoding sequences / pipeline stages): the rows per decode micro-batch without measured costs",
    choiceOf((c) => c.defaultRows)
  )
  metric(
    "swactor_agent_decoding_sequences",
    "gauge",
    "Sequences decoding through the agent's block range at its batcher's last choice",
    choiceOf((c) => c.decoders)
  )
  metric(
    "swactor_agent_open_sessions",
    "gauge",
    "Stage sessions open in each agent's process now",
    sessionsOf((s) => s.sessions)
  )
  metric(
    "swactor_agent_state_bytes",
    "gauge",
    "DeltaNet (recurrent) state bytes held by each agent's open sessions now",
    sessionsOf((s) => s.stateBytes)
  )
  metric(
    "swactor_agent_cache_bytes",
    "gauge",
    "KV cache and DeltaNet state bytes held by each agent's open sessions now",
    sessionsOf((s) => s.cacheBytes)
  )
}

/** The Prometheus text of a metrics snapshot. */
export const renderMetrics = (m: ServerMetrics, status: string): string => {
  const lines: Array<string> = []
  const metric: Metric = (name, type, help, samples) => {
    lines.push(`# HELP ${name} ${help}`, `# TYPE ${name} ${type}`)
    for (const [labels, value] of samples) lines.push(`${name}${labels} ${value}`)
  }
  renderRequests(m, status, metric)
  if (m.weights !== undefined) renderWeights(m.weights, metric)
  renderAdmission(m, metric)
  if (m.promptCache !== undefined) renderPromptCache(m.promptCache, metric)
  const perStage = (value: (s: ServerMetrics["stages"][number]) => number) =>
    m.stages.map((s): [string, number] => [`{stage="${s.stageIndex}"}`, value(s)])
  metric(
    "swactor_stage_compute_seconds_total",
    "counter",
    "Engine time per stage (completed requests)",
    perStage((s) => s.computeSeconds)
  )
  renderFirstToken(m.firstToken, metric)
  renderStages(m, metric)
  renderAgents(m, metric)
  return `${lines.join("\n")}\n`
}

/** The Prometheus text of the HTTP front's connection counts (none without them). */
export const renderConnections = (c: ConnectionStats | undefined): string =>
  c === undefined
    ? ""
    : [
        "# HELP swactor_http_connections_open HTTP connections open now",
        "# TYPE swactor_http_connections_open gauge",
        `swactor_http_connections_open ${c.open}`,
        "# HELP swactor_http_connections_refused_total Connections closed at once: the limit was reached and every open one was busy",
        "# TYPE swactor_http_connections_refused_total counter",
        `swactor_http_connections_refused_total ${c.refused}`,
        "# HELP swactor_http_connections_dropped_total Connections closed before they sent a request (header timeout, or room for a new one)",
        "# TYPE swactor_http_connections_dropped_total counter",
        `swactor_http_connections_dropped_total ${c.dropped}`,
        ""
      ].join("\n")
