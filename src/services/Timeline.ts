/**
 * The per-token timeline of one stream (`swactor run --timeline`), pure: where each decoded token's time went, per
 * stage and per link, from the stages' StepTimeline reports and the orchestrator's token arrivals.
 *
 * Per stage, a step's parts follow each other from the frame's arrival to the stage being done with it (StepTimeline);
 * `waiting` is the stage idle before the frame arrived (since it was done with the step before). So a stage's parts
 * add up to the time between its steps, which in a steady stream is the token's wall time (the interval between two
 * tokens reaching the orchestrator). A link is the time from the frame's hand-off on one side (written) to its
 * arrival on the other, measured where both ends share a clock (one machine). Along the token's path (stage 0, link,
 * stage 1, ..., the link back to stage 0: the token loop, or through the orchestrator) the stages' busy parts and the
 * links add up to the token's wall time as well: `pathMillis`.
 */
import type { StepTimeline } from "../domain/controlRpc.js"

/** A stage's parts of one token, in the order they happen (waiting first). */
export const timelineComponents = ["waiting", "wake", "framing", "queueing", "copies", "compute", "send"] as const
export type TimelineComponent = (typeof timelineComponents)[number]

/** A duration over the timed tokens (ms): mean, median, 95th percentile, and the mean's share of the token's wall time. */
export interface TimelineStat {
  readonly mean: number
  readonly p50: number
  readonly p95: number
  readonly share: number
}

export interface StageTimeline {
  readonly stageIndex: number
  readonly components: Readonly<Record<TimelineComponent, TimelineStat>>
  /** Its parts together (the time between its steps). */
  readonly totalMillis: TimelineStat
}

export interface LinkTimeline {
  /** "stage 0", "stage 1", ..., "orchestrator". */
  readonly from: string
  readonly to: string
  /** On the token's path (the pipeline waits for it); off it: the last stage's token to the orchestrator with a loop. */
  readonly onPath: boolean
  readonly millis: TimelineStat
}

export interface TokenTimeline {
  /** Decode steps timed (every stage reported the step and the one before it). */
  readonly tokens: number
  /** The interval between two tokens reaching the orchestrator. */
  readonly wallMillis: TimelineStat
  readonly stages: ReadonlyArray<StageTimeline>
  /** Measured links (none when no two ends share a clock). */
  readonly links: ReadonlyArray<LinkTimeline>
  /** The orchestrator's turn between a token's arrival and its sending to stage 0 (no token loop only). */
  readonly orchestratorMillis?: TimelineStat
  /** The path's stage and link times together, where every link on it was measured. */
  readonly pathMillis?: TimelineStat
  /** Why some links were not measured (their ends on different clocks). */
  readonly note?: string
}

export interface TimelineInput {
  readonly stages: ReadonlyArray<{
    readonly stageIndex: number
    /** The stage's clock (StageTimings.clock); undefined: unknown. */
    readonly clock: string | undefined
    readonly steps: ReadonlyArray<StepTimeline>
  }>
  readonly orchestrator: {
    readonly clock: string
    /** When each step's token arrived (host clock, as the stages' `…At`). */
    readonly tokenArrivedAt: ReadonlyMap<number, number>
    /** When each step's token was sent to stage 0 (no token loop). */
    readonly injectedAt: ReadonlyMap<number, number>
  }
  /** The last stage sends each token straight to stage 0. */
  readonly tokenLoop: boolean
}

const percentile = (sorted: ReadonlyArray<number>, q: number) =>
  sorted.length === 0 ? 0 : sorted[Math.min(sorted.length - 1, Math.max(0, Math.ceil(q * sorted.length) - 1))]!

/** mean, p50, p95 of `values`; share of `wallMean`. */
export const timelineStat = (values: ReadonlyArray<number>, wallMean: number): TimelineStat => {
  const sorted = [...values].sort((a, b) => a - b)
  const mean = values.length === 0 ? 0 : values.reduce((a, b) => a + b, 0) / values.length
  return {
    mean,
    p50: percentile(sorted, 0.5),
    p95: percentile(sorted, 0.95),
    share: wallMean > 0 ? mean / wallMean : 0
  }
}

/**
 * One stage's parts of step `k` (its entry `e`, `previous` the step before), from the end of the step before to its own
 * end. A frame that arrived before the stage was done with the step before (the socket's event ran while the send's
 * fiber had yielded) did not wait for the stage to wake: that overlap comes off its wake-up, then off its decoding.
 */
const partsOf = (e: StepTimeline, previous: StepTimeline): Record<TimelineComponent, number> => {
  const overlap = Math.max(0, previous.doneAt - e.arrivedAt)
  const wake = Math.max(0, e.wakeMillis - overlap)
  const decode = Math.max(0, e.decodeMillis - Math.max(0, overlap - e.wakeMillis))
  return {
    waiting: Math.max(0, e.arrivedAt - previous.doneAt),
    wake,
    framing: decode + e.encodeMillis,
    queueing: e.queueMillis,
    copies: e.copyMillis,
    compute: e.computeMillis,
    send: e.sendMillis
  }
}

type StepsByStage = ReadonlyArray<ReadonlyMap<number, StepTimeline>>

/** The steps every stage reported, with the step before, and whose token (and the one before) reached the orchestrator. */
const timedSteps = (byStage: StepsByStage, arrived: ReadonlyMap<number, number>): Array<number> => {
  const first = byStage[0]
  if (first === undefined) return []
  return [...first.keys()]
    .filter((k) => byStage.every((m) => m.has(k) && m.has(k - 1)) && arrived.has(k) && arrived.has(k - 1))
    .sort((a, b) => a - b)
}

interface LinkSpec {
  readonly from: string
  readonly to: string
  readonly onPath: boolean
  /** The link's time at step k, or undefined where an end is missing. */
  readonly at: (k: number) => number | undefined
}

const stageName = (i: number) => `stage ${i}`

/** The links of the pipeline whose ends share a clock, and whether every link on the token's path does. */
const linkSpecs = (input: TimelineInput, clocks: ReadonlyArray<string | undefined>, byStage: StepsByStage) => {
  const n = byStage.length
  const { orchestrator } = input
  const clockOf = (end: number | "o") => (end === "o" ? orchestrator.clock : clocks[end])
  const same = (a: number | "o", b: number | "o") => clockOf(a) !== undefined && clockOf(a) === clockOf(b)
  const entry = (s: number, k: number) => byStage[s]!.get(k)
  const all: Array<LinkSpec & { readonly ends: readonly [number | "o", number | "o"] }> = []
  for (let s = 0; s + 1 < n; s++) {
    const at = (k: number) => diff(entry(s + 1, k)?.arrivedAt, entry(s, k)?.handOffAt)
    all.push({ from: stageName(s), to: stageName(s + 1), onPath: true, at, ends: [s, s + 1] })
  }
  const last = n - 1
  if (input.tokenLoop) {
    const loop = (k: number) => diff(entry(0, k)?.arrivedAt, entry(last, k - 1)?.handOffAt)
    all.push({ from: stageName(last), to: stageName(0), onPath: true, at: loop, ends: [last, 0] })
    // from the loop's hand-off: the orchestrator's frame is written right after the loop's
    const out = (k: number) => diff(orchestrator.tokenArrivedAt.get(k), entry(last, k)?.handOffAt)
    all.push({ from: stageName(last), to: "orchestrator", onPath: false, at: out, ends: [last, "o"] })
  } else {
    const out = (k: number) => diff(orchestrator.tokenArrivedAt.get(k), entry(last, k)?.handOffAt)
    all.push({ from: stageName(last), to: "orchestrator", onPath: true, at: out, ends: [last, "o"] })
    const back = (k: number) => diff(entry(0, k)?.arrivedAt, orchestrator.injectedAt.get(k))
    all.push({ from: "orchestrator", to: stageName(0), onPath: true, at: back, ends: ["o", 0] })
  }
  const measured = all.filter((l) => same(...l.ends))
  const unmeasured = all.filter((l) => !same(...l.ends))
  return { measured, pathComplete: unmeasured.every((l) => !l.onPath), unmeasured }
}

const diff = (a: number | undefined, b: number | undefined) => (a === undefined || b === undefined ? undefined : a - b)

/** The stages' busy time to their hand-off at step k (the path's stage parts). */
const stagesOnPath = (byStage: StepsByStage, k: number) =>
  byStage.reduce((sum, m) => {
    const e = m.get(k)!
    return sum + (e.handOffAt - e.arrivedAt)
  }, 0)

/** The timeline of a run's decode steps; undefined when no step could be timed. */
export const buildTimeline = (input: TimelineInput): TokenTimeline | undefined => {
  const stages = [...input.stages].sort((a, b) => a.stageIndex - b.stageIndex)
  const byStage: StepsByStage = stages.map((s) => new Map(s.steps.map((e) => [e.step, e])))
  const arrived = input.orchestrator.tokenArrivedAt
  const steps = timedSteps(byStage, arrived)
  if (steps.length === 0) return undefined
  const walls = steps.map((k) => arrived.get(k)! - arrived.get(k - 1)!)
  const wallMean = walls.reduce((a, b) => a + b, 0) / walls.length
  const stat = (values: ReadonlyArray<number>) => timelineStat(values, wallMean)
  const stageTimelines = stages.map((s, i) => {
    const parts = steps.map((k) => partsOf(byStage[i]!.get(k)!, byStage[i]!.get(k - 1)!))
    const components = Object.fromEntries(timelineComponents.map((c) => [c, stat(parts.map((p) => p[c]))])) as Record<
      TimelineComponent,
      TimelineStat
    >
    const totals = parts.map((p) => timelineComponents.reduce((sum, c) => sum + p[c], 0))
    return { stageIndex: s.stageIndex, components, totalMillis: stat(totals) }
  })
  const clocks = stages.map((s) => s.clock)
  const { measured, pathComplete, unmeasured } = linkSpecs(input, clocks, byStage)
  const linkValues = (l: LinkSpec) => steps.flatMap((k) => (l.at(k) === undefined ? [] : [l.at(k)!]))
  const links = measured.map((l) => ({ from: l.from, to: l.to, onPath: l.onPath, millis: stat(linkValues(l)) }))
  const orchestratorTurn = (k: number) => diff(input.orchestrator.injectedAt.get(k), arrived.get(k - 1))
  const turns = input.tokenLoop
    ? []
    : steps.flatMap((k) => (orchestratorTurn(k) === undefined ? [] : [orchestratorTurn(k)!]))
  const path = (k: number) =>
    stagesOnPath(byStage, k) +
    measured.filter((l) => l.onPath).reduce((sum, l) => sum + (l.at(k) ?? 0), 0) +
    (input.tokenLoop ? 0 : (orchestratorTurn(k) ?? 0))
  return {
    tokens: steps.length,
    wallMillis: stat(walls),
    stages: stageTimelines,
    links,
    ...(turns.length > 0 ? { orchestratorMillis: stat(turns) } : {}),
    ...(pathComplete ? { pathMillis: stat(steps.map(path)) } : {}),
    ...(unmeasured.length === 0
      ? {}
      : {
          note:
            `not measured (their ends are on different machines' clocks): ` +
            unmeasured.map((l) => `${l.from} → ${l.to}`).join(", ")
        })
  }
}

const ms = (x: number) => (x >= 100 ? x.toFixed(0) : x >= 10 ? x.toFixed(1) : x.toFixed(2))
const pct = (x: number) => `${(100 * x).toFixed(1)}%`

/** One row: name, then mean / p50 / p95 (ms) and the share of the token's wall time. */
const row = (name: string, s: TimelineStat) =>
  `  ${name.padEnd(38)} ${ms(s.mean).padStart(8)} ${ms(s.p50).padStart(8)} ${ms(s.p95).padStart(8)} ${pct(s.share).padStart(7)}`

/** The timeline as a compact table, one line per stage part and per link (`swactor run --timeline`, bench:wan). */
export const renderTimeline = (t: TokenTimeline): ReadonlyArray<string> => {
  const lines = [
    `timeline of one token (${t.tokens} decode steps; ms per token):`,
    `  ${"".padEnd(38)} ${"mean".padStart(8)} ${"p50".padStart(8)} ${"p95".padStart(8)} ${"share".padStart(7)}`,
    row("token (wall)", t.wallMillis)
  ]
  for (const s of t.stages) {
    lines.push(row(`stage ${s.stageIndex} (its parts together)`, s.totalMillis))
    for (const c of timelineComponents) if (c !== "waiting") lines.push(row(`  ${c}`, s.components[c]))
    lines.push(row("  waiting (idle)", s.components.waiting))
  }
  for (const l of t.links) lines.push(row(`link ${l.from} → ${l.to}${l.onPath ? "" : " (off path)"}`, l.millis))
  if (t.orchestratorMillis !== undefined) lines.push(row("orchestrator's turn", t.orchestratorMillis))
  if (t.pathMillis !== undefined) lines.push(row("path (stages + links)", t.pathMillis))
  if (t.note !== undefined) lines.push(`  links ${t.note}`)
  return lines
}
