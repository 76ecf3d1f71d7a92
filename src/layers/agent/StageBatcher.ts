/**
 * One batcher per loaded weights on an agent: every hosted stage on those weights (any run) submits its forward
 * work here and awaits its result; one fiber takes everything pending and runs it as ONE forwardBatch (the
 * weights are read once for all sequences), then completes each submitter.
 *
 * - Micro-batch: pending decode steps (one row each) first, then prompt chunks, up to `maxRows` rows.
 * - Keep every stage busy: a pipeline of S stages needs S micro-batches in flight, so with L sequences decoding on
 *   these weights a micro-batch takes at most ceil(L / S) decode steps (the rest run in the next one, at once).
 *   Without that cap all L sequences travel as one group and S - 1 stages wait while one works. L counts the
 *   sessions that submitted a decode step within the last `activeWindowMillis` (they are somewhere in the
 *   pipeline); S comes from the submitter (its run's stage count).
 * - Groups form and stay formed: with fewer than ceil(L / S) decode steps pending (and no prompt work), the batcher
 *   waits for more, at most as long as its last micro-batch of decode steps took (and `gatherMillis`). Without that wait the
 *   sequences drift apart into one-row micro-batches (each stage always busy with one sequence; see
 *   bench/README.md, "Design measurements"), and a one-row step costs nearly what a two-row one does. A group
 *   that formed comes back together (its tokens are sampled in the same step), so it rarely waits again.
 * - A prompt longer than `prefillChunk` tokens is prefilled in fixed chunks [0, C), [C, 2C), ... one per
 *   micro-batch, interleaved with other sequences' decode steps, so a big prompt does not stall everyone's next
 *   token. Chunk boundaries depend only on the prompt (never on what else is pending): a chunk that does not fit
 *   the rows left waits for the next micro-batch, so a sequence's numerics do not depend on timing. The caller gets
 *   its output once every chunk ran (all hidden rows, or the logits of the last position).
 * - A resumed generation's prompt (`replayTail`: it ends with the tokens the interrupted run produced) runs its
 *   chunks up to those tokens, then those rows one per micro-batch: the computations the interrupted run's prefill
 *   and decode steps ran, so the same bits come out (a prefill of them takes other kernels and can tip a near tie).
 * - Faults stay per sequence: an item the engine rejects (BatchItemRejected) fails only its submitter and the rest
 *   run again without it; when a whole batched computation fails, every item is retried alone, so only the
 *   culprit fails.
 * - A submitter that is interrupted (its run stopped) is dropped before its next chunk runs.
 */
import { Cause, Deferred, Effect, Option, Queue, type Scope } from "effect"
import { EngineError, type ForwardError, type StageInput, type StageOutput } from "../../domain/engine.js"
import {
  type BatchItem,
  StageExecutor,
  type StageExecutorService,
  type StageSession
} from "../../services/StageExecutor.js"
import { chooseDecodeGroup, type DecodeGroupChoice, makeStepCosts, type StepCosts } from "../../services/StepCosts.js"

export interface BatcherSettings {
  /** Most rows (tokens of all sequences) in one micro-batch (default 256). */
  readonly maxRows?: number
  /** Prompt chunk length (default 128; at most maxRows). */
  readonly prefillChunk?: number
  /** A session counts as decoding for this long after its last decode step (default 2000 ms). */
  readonly activeWindowMillis?: number
  /** Longest wait for more decode steps to fill a micro-batch (default 250 ms; 0: never wait). */
  readonly gatherMillis?: number
  /**
   * How long prompts reaching an idle stage may wait for the prompts of the sessions opened beside them, or announced
   * to open (`expect`), to share their micro-batch (default 100 ms; 0: never wait). Nothing due: no wait at all.
   */
  readonly promptGatherMillis?: number
  /**
   * Beside decode steps, prompt rows beyond the first chunk only up to this many (default 16): a burst of new prompts
   * is spread over several micro-batches instead of making the running sequences wait for all of it at once.
   */
  readonly promptRowsBesideDecode?: number
  /**
   * Measure the decode step's cost by row count while the stage is quiet: nothing decoding, opened or announced here,
   * and no session seen for `quietMillis` (default 1000; a run's prompt follows its session's opening within ms). One
   * micro-batch of 1, 2, ... `maxRows` one-row steps of scratch sessions opened with `session` (closed right after
   * each; `SessionOptions.scratch` keeps them out of the agent's tally of open sessions), once. Work that arrives
   * pauses it after the step in flight; it goes on when the stage is quiet again. Absent: costs come only from the
   * micro-batches served (StepCosts.ts).
   */
  readonly stepProbe?: {
    readonly maxRows: number
    readonly session: Effect.Effect<StageSession, unknown, Scope.Scope>
    readonly quietMillis?: number
  }
  /** Where the measured step costs go and the decode micro-batch size is chosen from (default: a fresh table). */
  readonly stepCosts?: StepCosts
}

/** The batcher's measured step costs and its last choice of decode micro-batch size (for /metrics). */
export interface StepCostReport {
  /** Measured forward ms of decode micro-batches by rows (probe and served micro-batches). */
  readonly costs: ReadonlyArray<{ readonly rows: number; readonly millis: number }>
  /** The last choice: for `decoders` sequences through `stages` stages, `rows` per micro-batch (`defaultRows` = ceil). */
  readonly choice?: DecodeGroupChoice & { readonly decoders: number; readonly stages: number }
  /** The idle probe: not asked for, still to run, or done. */
  readonly probe: "off" | "pending" | "done"
}

/** Counters of the micro-batches that carried one submitter's work (a stage of one run). */
export interface BatchCounters {
  /** Micro-batches this stage's work took part in. */
  microBatches: number
  /** Rows of those micro-batches, all sequences together. */
  batchRows: number
  /** Most sequences in one of those micro-batches. */
  maxBatchSequences: number
  /** Prompt chunks this stage ran (a prompt of n tokens takes ceil(n / prefillChunk)). */
  prefillChunks: number
  /**
   * Engine time (ms) of those micro-batches, each counted whole: a submit's wall time minus what this grew by is the
   * time its work waited in the batcher (gathering partners, or behind other micro-batches).
   */
  engineMillis: number
}

export const emptyBatchCounters = (): BatchCounters => ({
  microBatches: 0,
  batchRows: 0,
  maxBatchSequences: 0,
  prefillChunks: 0,
  engineMillis: 0
})

/**
 * A timeline's record of one submit (`swactor run --timeline`), filled in by the batcher: when the forward of its last
 * micro-batch started and ended (performance.now), and the ms the engine said that forward spent on copies.
 */
export interface JobTrace {
  forwardStart: number
  forwardEnd: number
  copyMillis: number
}

export interface StageBatcher {
  /** Runs `input` at startPos.. of `session` in the next micro-batch(es); counts into `counters`. */
  readonly submit: (
    session: StageSession,
    startPos: number,
    input: StageInput,
    counters: BatchCounters,
    /** Stages in the submitter's pipeline (default 1: no cap on decode steps per micro-batch). */
    pipelineStages?: number,
    /** The input's last `replayTail` rows run one per micro-batch (a resumed generation's replayed tokens). */
    replayTail?: number,
    /** Filled in with the forward's times (absent: nothing measured beyond the counters). */
    trace?: JobTrace
  ) => Effect.Effect<StageOutput, ForwardError>
  /**
   * A session was opened and its prompt will follow: prompts that wake the idle batcher wait for it (see
   * `promptGatherMillis`). Forgotten at its first submit, or when the scope closes. `arriving`: requests that reached
   * the server beside this one and will open sessions here soon (not yet provisioned): waited for as well, for at most
   * `promptGatherMillis` from this call.
   */
  readonly expect: (session: StageSession, arriving?: number) => Effect.Effect<void, never, Scope.Scope>
  /**
   * Prompt chunk length C: a prompt submitted at startPos is run as [startPos, startPos + C), ... So a prompt resumed
   * at a multiple of C runs the very computations (same rows, same batch sizes) a prompt from 0 runs there.
   */
  readonly prefillChunk: number
  /** Measured step costs and the decode micro-batch size chosen from them. */
  readonly stepCosts: () => StepCostReport
}

interface Job {
  readonly session: StageSession
  readonly startPos: number
  readonly input: StageInput
  readonly total: number
  /** From this many tokens on, one per micro-batch (`replayTail`); `total` when none. */
  readonly oneByOneFrom: number
  /** Tokens already run. */
  done: number
  readonly hidden: Array<Float32Array>
  readonly counters: BatchCounters
  readonly pipelineStages: number
  readonly result: Deferred.Deferred<StageOutput, ForwardError>
  cancelled: boolean
  /** When it was submitted (performance.now). */
  readonly submittedAt: number
  readonly trace: JobTrace | undefined
}

const lengthOf = (input: StageInput) => (input._tag === "Tokens" ? input.tokens.length : input.nTokens)

/** The tokens [from, from + n) of an input. */
const slice = (input: StageInput, from: number, n: number, dim: number): StageInput => {
  if (from === 0 && n === lengthOf(input)) return input
  return input._tag === "Tokens"
    ? { _tag: "Tokens", tokens: input.tokens.subarray(from, from + n) }
    : { _tag: "Hidden", hidden: input.hidden.subarray(from * dim, (from + n) * dim), nTokens: n }
}

/** A decode step, or a speculative step's rows (StageInput.verify: a step of a few rows, run whole): not a prompt. */
const isStep = (job: Job) => job.total === 1 || job.input.verify === true

const concat = (parts: ReadonlyArray<Float32Array>): Float32Array => {
  if (parts.length === 1) return parts[0]!
  const out = new Float32Array(parts.reduce((s, p) => s + p.length, 0))
  let off = 0
  for (const p of parts) {
    out.set(p, off)
    off += p.length
  }
  return out
}

/** One decode or prompt job of a micro-batch, and how many of its rows it runs there. */
interface Chosen {
  readonly job: Job
  readonly n: number
}

/** The batcher's settings resolved to numbers (see BatcherSettings). */
interface Limits {
  readonly maxRows: number
  readonly chunk: number
  readonly activeWindow: number
  readonly gatherMax: number
  readonly promptGather: number
  readonly promptBesideDecode: number
  /** The idle probe: its settings (absent: off), its largest size, how long the stage must be quiet first. */
  readonly probeSettings: BatcherSettings["stepProbe"]
  readonly probeMax: number
  readonly probeQuiet: number
}

/** What the batcher fiber, `submit` and `expect` share. */
interface BatcherState {
  readonly executor: StageExecutorService
  readonly limits: Limits
  readonly costs: StepCosts
  readonly inbox: Queue.Queue<Job>
  readonly pending: Array<Job>
  /** Sessions decoding on these weights: when each last submitted a decode step. */
  readonly decoders: Map<StageSession, { last: number; interval: number; prompt?: true }>
  /** Sessions opened that have not submitted anything yet (their prompt is on its way). */
  readonly expected: Set<StageSession>
  /** Sessions seen so far (opened, or submitting unannounced), and how many are announced by then (see `expect`). */
  readonly seen: WeakSet<StageSession>
  opened: number
  announced: { count: number; at: number }
  /** How long the last micro-batch of decode steps only took (ms): the longest worth waiting to fill the next one. */
  lastRunMillis: number
  lastChoice: StepCostReport["choice"]
  /** The last choice and what it was made from: it holds while L, S and the costs' revision do. */
  cached: { decoders: number; stages: number; revision: number; rows: number } | undefined
  /** The next probe size (rows); Infinity when off or done. */
  probeRows: number
  /** The last time a session was opened here or submitted work (the batcher's start to begin with). */
  lastActivity: number
  /** The batcher waits in `takeWithin`: a submit wakes it. */
  arrival: (() => void) | undefined
}

/**
 * The next job in the inbox, waiting at most `millis` of wall time for one (none when the time is up). The wait is one
 * suspension woken by `submit` or a timer: no fiber forked (a race of Queue.take against a sleep forks two and waits
 * for the loser's interruption, which cost a lone stream about 0.2 ms per step and stage, measured with
 * `swactor run --timeline`). Wall time, whatever Clock the fiber has: the gather wait is bounded by measured compute
 * time (performance.now), so it must not stand still under a test's TestClock.
 */
const takeWithin = (state: BatcherState, millis: number): Effect.Effect<Option.Option<Job>> =>
  Effect.async<void>((resume) => {
    if (Option.getOrElse(state.inbox.unsafeSize(), () => 0) > 0) return resume(Effect.void)
    const done = () => {
      clearTimeout(timer)
      state.arrival = undefined
      resume(Effect.void)
    }
    const timer = setTimeout(done, millis)
    state.arrival = done
    return Effect.sync(() => {
      clearTimeout(timer)
      if (state.arrival === done) state.arrival = undefined
    })
  }).pipe(Effect.zipRight(Queue.poll(state.inbox)))

const limitsOf = (settings: BatcherSettings): Limits => {
  const maxRows = Math.max(1, Math.floor(settings.maxRows ?? 256))
  const probeSettings = settings.stepProbe
  return {
    maxRows,
    chunk: Math.max(1, Math.min(maxRows, Math.floor(settings.prefillChunk ?? 128))),
    activeWindow: Math.max(0, settings.activeWindowMillis ?? 2000),
    gatherMax: Math.max(0, settings.gatherMillis ?? 250),
    promptGather: Math.max(0, settings.promptGatherMillis ?? 100),
    promptBesideDecode: Math.max(0, settings.promptRowsBesideDecode ?? 16),
    probeSettings,
    probeMax: Math.max(0, Math.min(maxRows, Math.floor(probeSettings?.maxRows ?? 0))),
    probeQuiet: Math.max(0, probeSettings?.quietMillis ?? 1000)
  }
}

const see = (state: BatcherState, session: StageSession) => {
  if (state.seen.has(session)) return
  state.seen.add(session)
  state.opened++
}

/** Sessions announced by the server that have not opened yet (an announcement lasts promptGatherMillis). */
const announcedDue = (state: BatcherState) =>
  state.opened < state.announced.count && performance.now() - state.announced.at < state.limits.promptGather

const pruneDecoders = (state: BatcherState) => {
  const now = performance.now()
  // gone: silent for the window, or for 3 of its own steps (a run that ended stops counting at once)
  for (const [session, d] of state.decoders)
    if (now - d.last > Math.min(state.limits.activeWindow, 3 * d.interval)) state.decoders.delete(session)
}

/**
 * Most decode steps in one micro-batch: ceil(L / S) (at least 1), or the size the measured step costs say makes a
 * round of all L sequences through the S stages clearly faster (StepCosts.chooseDecodeGroup).
 */
const decodeCap = (state: BatcherState): number => {
  pruneDecoders(state)
  const { decoders, cached, costs } = state
  let stages = 1
  for (const job of state.pending) if (job.total === 1) stages = Math.max(stages, job.pipelineStages)
  const revision = costs.revision()
  if (cached?.decoders === decoders.size && cached.stages === stages && cached.revision === revision) {
    return cached.rows
  }
  const choice = chooseDecodeGroup(Math.max(1, decoders.size), stages, costs)
  state.lastChoice = { ...choice, decoders: decoders.size, stages }
  state.cached = { decoders: decoders.size, stages, revision, rows: Math.max(1, choice.rows) }
  return state.cached.rows
}

const drop = (state: BatcherState, job: Job) => {
  const i = state.pending.indexOf(job)
  if (i >= 0) state.pending.splice(i, 1)
}

/**
 * The next micro-batch: decode steps first, then whole chunks while rows are left. Beside decode steps the first
 * chunk always goes (no prompt starves) and more only within `promptRowsBesideDecode` rows of prompt.
 */
const pick = (state: BatcherState): Array<Chosen> => {
  const { chunk, maxRows, promptBesideDecode } = state.limits
  const chosen: Array<Chosen> = []
  let rows = 0
  let promptRows = 0
  let decodeLeft = decodeCap(state)
  for (const pass of ["decode", "prefill"] as const) {
    for (const job of state.pending) {
      if (isStep(job) !== (pass === "decode")) continue
      const n =
        job.input.verify === true
          ? job.total
          : job.done >= job.oneByOneFrom
            ? 1
            : Math.min(chunk, job.oneByOneFrom - job.done)
      if (rows + n > maxRows) continue
      if (pass === "decode" && decodeLeft-- <= 0) break
      if (pass === "prefill" && promptRows > 0 && rows > promptRows && promptRows + n > promptBesideDecode) continue
      chosen.push({ job, n })
      rows += n
      if (pass === "prefill") promptRows += n
    }
  }
  return chosen
}

/** Completes the jobs of a micro-batch that ran, with their outputs in order. */
const advance = (
  state: BatcherState,
  chosen: ReadonlyArray<Chosen>,
  outputs: ReadonlyArray<StageOutput>,
  rows: number,
  millis: number
) =>
  Effect.forEach(
    chosen,
    ({ job, n }, i) => {
      const out = outputs[i]!
      job.done += n
      job.counters.microBatches++
      job.counters.engineMillis += millis
      job.counters.batchRows += rows
      job.counters.maxBatchSequences = Math.max(job.counters.maxBatchSequences, chosen.length)
      if (!isStep(job)) job.counters.prefillChunks++
      if (out._tag === "Hidden") job.hidden.push(out.hidden)
      if (job.done < job.total) return Effect.void
      drop(state, job)
      if (!isStep(job)) {
        // a prompt done: its session decodes next, so it counts in the pipeline's groups from its first step on
        // (otherwise the first decode step of requests that prefilled together runs alone, as a one-row
        // micro-batch, although their first tokens reach stage 0 within a few ms of each other). Until its
        // first decode step it is gone after 3 times as long as its prompt took here.
        const now = performance.now()
        state.decoders.set(job.session, { last: now, interval: Math.max(1, now - job.submittedAt), prompt: true })
      }
      const result: StageOutput =
        out._tag === "Logits" ? out : { _tag: "Hidden", hidden: concat(job.hidden), nTokens: job.total }
      return Deferred.succeed(job.result, result)
    },
    { discard: true }
  )

const failJob = (state: BatcherState, job: Job, error: ForwardError) => {
  drop(state, job)
  return Deferred.fail(job.result, error)
}

const itemOf = (job: Job, n: number): BatchItem => ({
  session: job.session,
  startPos: job.startPos + job.done,
  input: slice(job.input, job.done, n, job.session.info.hiddenDim)
})

const asEngineError = (error: { readonly _tag: string; readonly message: string }) =>
  new EngineError({ message: `${error._tag}: ${error.message}` })

/** The traced jobs of a micro-batch: its forward's times and copies. */
const traceForward = (chosen: ReadonlyArray<Chosen>, started: number, ended: number, copyMillis: number) => {
  for (const { job } of chosen) {
    if (job.trace === undefined) continue
    job.trace.forwardStart = started
    job.trace.forwardEnd = ended
    job.trace.copyMillis = copyMillis
  }
}

/** Runs one micro-batch; never fails (every outcome lands in the jobs' results). */
const runOnce = (state: BatcherState, chosen: ReadonlyArray<Chosen>): Effect.Effect<void> => {
  const rows = chosen.reduce((s, c) => s + c.n, 0)
  // a timeline asked for: the engine's copies measured too
  const phases = chosen.some(({ job }) => job.trace !== undefined) ? { copyMillis: 0 } : undefined
  const started = performance.now()
  const items = chosen.map(({ job, n }) => itemOf(job, n))
  return state.executor.forwardBatch(items, phases).pipe(
    Effect.matchEffect({
      onSuccess: (outputs) => {
        const ended = performance.now()
        if (phases !== undefined) traceForward(chosen, started, ended, phases.copyMillis)
        return advance(state, chosen, outputs, rows, ended - started)
      },
      onFailure: (error) => {
        switch (error._tag) {
          case "BatchItemRejected": {
            // nothing ran: only that item fails; the others are still pending for the next micro-batch
            const culprit = chosen[error.index]
            return culprit === undefined
              ? Effect.forEach(chosen, ({ job }) => failJob(state, job, asEngineError(error)), { discard: true })
              : failJob(state, culprit.job, error.error)
          }
          case "EngineError":
            // find the culprit: every item alone (a failed computation leaves each session as before it)
            return chosen.length === 1
              ? failJob(state, chosen[0]!.job, error)
              : Effect.forEach(chosen, (c) => runOnce(state, [c]), { discard: true })
          case "InvalidBatch":
            return Effect.forEach(chosen, ({ job }) => failJob(state, job, asEngineError(error)), { discard: true })
        }
      }
    }),
    Effect.catchAllCause((cause) =>
      Effect.forEach(
        chosen,
        ({ job }) =>
          failJob(state, job, new EngineError({ message: `the batched forward crashed: ${Cause.pretty(cause)}` })),
        { discard: true }
      )
    )
  )
}

const takeArrived = (state: BatcherState) =>
  Effect.gen(function* () {
    const { pending } = state
    pending.push(...(yield* Queue.takeAll(state.inbox)))
    for (let i = pending.length - 1; i >= 0; i--) if (pending[i]!.cancelled) pending.splice(i, 1)
  })

/** Fewer decode steps than a micro-batch takes, nothing else to run, and other decoders on their way. */
const worthWaiting = (state: BatcherState) => {
  if (state.pending.some((job) => !isStep(job))) return false
  const cap = decodeCap(state)
  return state.pending.length < cap && state.decoders.size > state.pending.length
}

/**
 * Takes what arrives until `deadline()`, asked again after each arrival (what is wanted changes with what
 * arrived); a past deadline ends the wait.
 */
const takeUntil = (state: BatcherState, deadline: () => number) =>
  Effect.gen(function* () {
    while (true) {
      const left = deadline() - performance.now()
      if (left < 0.5) return
      const next = yield* takeWithin(state, left)
      if (Option.isNone(next)) continue
      state.pending.push(next.value)
      yield* takeArrived(state)
    }
  })

/**
 * Before a micro-batch: prompts that woke an idle stage (no decode step pending) wait (at most
 * `promptGatherMillis`) for the prompts of the sessions opened beside them that have not submitted yet, so
 * requests that arrive together prefill together on every stage and decode in step from their first token.
 * Without it, of requests sent together the first starts its prefill alone on each stage and its next token
 * waits for the others' prefill (bench/README.md, "Design measurements"). On a first stage the
 * sessions of requests sent together open a few ms apart: the server announces them (`expect`'s `arriving`, the
 * requests it is still tokenizing), so they are waited for before they open. What is waited for is what is in
 * flight: a lone request (nothing opened or announced beside it) never waits. Otherwise short decode
 * micro-batches wait (at most min(last decode micro-batch, gatherMillis)) for the rest of their group.
 */
const gather = (state: BatcherState, wokeIdle: boolean) => {
  const { pending } = state
  const { promptGather, gatherMax } = state.limits
  const prompts = wokeIdle && promptGather > 0 && pending.length > 0 && pending.every((job) => !isStep(job))
  if (prompts) {
    const start = performance.now()
    return takeUntil(state, () => {
      if (pending.some(isStep)) return 0 // a decode step arrived: it does not wait for prompts
      return state.expected.size > 0 || announcedDue(state) ? start + promptGather : 0
    }).pipe(
      Effect.ensuring(
        Effect.sync(
          () => (state.announced = { count: Math.min(state.announced.count, state.opened), at: state.announced.at })
        )
      )
    )
  }
  const budget = Math.min(gatherMax, state.lastRunMillis)
  if (budget < 1) return Effect.void
  const deadline = performance.now() + budget
  return takeUntil(state, () => (worthWaiting(state) ? deadline : 0))
}

// --- the idle probe of step costs ---

/** ms until the probe may take the stage: nothing seen for probeQuiet, nothing decoding, expected or announced. */
const probeWait = (state: BatcherState) => {
  pruneDecoders(state)
  const { probeQuiet } = state.limits
  if (state.decoders.size > 0 || state.expected.size > 0 || announcedDue(state)) return Math.max(50, probeQuiet)
  return Math.max(0, state.lastActivity + probeQuiet - performance.now())
}

/**
 * One probe size: `probeRows` one-row steps of fresh scratch sessions at position 0, then again at position 1 (a
 * one-row warm-up first), closed right after, so they hold memory only while it runs. Both forwards are observed and
 * the estimate is the faster (StepCosts' lower median): the first forward of a batch shape also builds its graph,
 * and one slow forward (the other stage's probe, a page fault) must not become the size's cost.
 */
const probeStep = (state: BatcherState) =>
  Effect.scoped(
    Effect.gen(function* () {
      const rows = Math.max(1, state.probeRows)
      const sessions = yield* Effect.forEach(Array.from({ length: rows }), () => state.limits.probeSettings!.session)
      const items: Array<BatchItem> = sessions.map((session, i) => ({
        session,
        startPos: 0,
        input: session.info.isFirst
          ? { _tag: "Tokens" as const, tokens: Int32Array.of(1 + i) }
          : { _tag: "Hidden" as const, hidden: new Float32Array(session.info.hiddenDim).fill(0.01), nTokens: 1 }
      }))
      for (const startPos of state.probeRows > 0 ? [0, 1] : [0]) {
        const started = performance.now()
        yield* state.executor.forwardBatch(startPos === 0 ? items : items.map((item) => ({ ...item, startPos })))
        if (state.probeRows > 0) state.costs.observe(rows, performance.now() - started)
      }
      state.probeRows = state.probeRows + 1 > state.limits.probeMax ? Infinity : state.probeRows + 1
    })
  ).pipe(
    // a stage that cannot run the probe just has no probed costs
    Effect.catchAllCause(() => Effect.sync(() => (state.probeRows = Infinity)))
  )

/** One turn of the batcher fiber: wait for work (or run a probe size), gather, run one micro-batch. */
const batchOnce = (state: BatcherState) =>
  Effect.gen(function* () {
    const { pending, inbox } = state
    const wokeIdle = pending.length === 0
    if (wokeIdle && state.probeRows <= state.limits.probeMax) {
      const wait = probeWait(state)
      if (wait < 1 && (yield* Queue.isEmpty(inbox))) return yield* probeStep(state)
      // the probe waits for the stage to be quiet; work goes first
      const next = yield* takeWithin(state, Math.max(1, wait))
      if (Option.isNone(next)) return
      pending.push(next.value)
    } else if (wokeIdle) pending.push(yield* Queue.take(inbox))
    // let callers whose results just completed submit their next step into this micro-batch
    yield* Effect.yieldNow()
    yield* takeArrived(state)
    if (pending.length === 0) return
    yield* gather(state, wokeIdle)
    if (pending.length === 0) return
    const started = performance.now()
    const chosen = pick(state)
    yield* runOnce(state, chosen)
    // only decode steps: what the next such micro-batch will cost (a prompt chunk says nothing about it)
    if (chosen.every(({ job }) => job.total === 1)) {
      state.lastRunMillis = performance.now() - started
      state.costs.observe(chosen.length, state.lastRunMillis)
    }
  })

/** Notes a submitter's session: no longer expected, seen, and (a decode step) decoding at its pace. */
const noteSubmitter = (state: BatcherState, session: StageSession, decodeStep: boolean) => {
  state.expected.delete(session)
  see(state, session)
  state.lastActivity = performance.now()
  if (decodeStep) {
    const now = performance.now()
    const seen = state.decoders.get(session)
    // its interval: since its last decode step (not since its prompt, which says nothing about its pace)
    const interval = seen === undefined || seen.prompt === true ? Infinity : Math.max(1, now - seen.last)
    state.decoders.set(session, { last: now, interval })
  }
}

const submitTo =
  (state: BatcherState): StageBatcher["submit"] =>
  (session, startPos, input, counters, pipelineStages = 1, replayTail = 0, trace) =>
    Effect.gen(function* () {
      const result = yield* Deferred.make<StageOutput, ForwardError>()
      const total = lengthOf(input)
      const tail = Number.isSafeInteger(replayTail) && replayTail > 0 ? Math.min(replayTail, total) : 0
      const job: Job = {
        session,
        startPos,
        input,
        total,
        oneByOneFrom: total - tail,
        done: 0,
        hidden: [],
        counters,
        pipelineStages: Number.isSafeInteger(pipelineStages) && pipelineStages >= 1 ? pipelineStages : 1,
        result,
        cancelled: false,
        submittedAt: performance.now(),
        trace
      }
      noteSubmitter(state, session, isStep(job))
      if (!(job.total >= 1)) {
        // let the engine word the rejection (an empty input never reaches a micro-batch)
        return yield* session.forward(startPos, input)
      }
      yield* Queue.offer(state.inbox, job)
      state.arrival?.()
      return yield* Deferred.await(result).pipe(
        Effect.onInterrupt(() =>
          Effect.sync(() => {
            job.cancelled = true
            state.decoders.delete(session)
          })
        )
      )
    })

const expectAt =
  (state: BatcherState): StageBatcher["expect"] =>
  (session, arriving = 0) =>
    Effect.acquireRelease(
      Effect.sync(() => {
        state.expected.add(session)
        see(state, session)
        state.lastActivity = performance.now()
        if (Number.isSafeInteger(arriving) && arriving > 0 && state.opened + arriving > state.announced.count) {
          state.announced = { count: state.opened + arriving, at: performance.now() }
        }
      }),
      () => Effect.sync(() => void state.expected.delete(session))
    )

const stepCostReport = (state: BatcherState): StepCostReport => {
  const { probeSettings, probeMax } = state.limits
  return {
    costs: state.costs.entries(),
    ...(state.lastChoice === undefined ? {} : { choice: state.lastChoice }),
    probe: probeSettings === undefined || probeMax === 0 ? "off" : state.probeRows > probeMax ? "done" : "pending"
  }
}

/** Starts the batcher fiber in the current scope (it stops when the scope closes). */
export const makeStageBatcher = (
  settings: BatcherSettings = {}
): Effect.Effect<StageBatcher, never, StageExecutor | Scope.Scope> =>
  Effect.gen(function* () {
    const limits = limitsOf(settings)
    const state: BatcherState = {
      executor: yield* StageExecutor,
      limits,
      costs: settings.stepCosts ?? makeStepCosts(),
      inbox: yield* Queue.unbounded<Job>(),
      pending: [],
      decoders: new Map(),
      expected: new Set(),
      seen: new WeakSet(),
      opened: 0,
      announced: { count: 0, at: 0 },
      lastRunMillis: 0,
      lastChoice: undefined,
      cached: undefined,
      probeRows: limits.probeSettings === undefined || limits.probeMax === 0 ? Infinity : 0,
      lastActivity: performance.now(),
      arrival: undefined
    }
    yield* Effect.forkScoped(Effect.forever(batchOnce(state)))
    return {
      submit: submitTo(state),
      expect: expectAt(state),
      prefillChunk: limits.chunk,
      stepCosts: () => stepCostReport(state)
    }
  })
