/**
 * Recovery above the run contract: a generation is one or more runs. Each run keeps the contract (own RunId,
 * first fault sticky, teardown exactly once); when one faults for a recoverable reason (a stage worker crashed,
 * a node lost, a transport or endpoint broke), the generation re-plans on the nodes still alive (spares with the
 * memory for it take a lost node's stages; without one the survivors absorb its layers in fewer stages when their
 * reported memory holds them, else RecoveryOverMemory before any run is tried), replays the prompt plus
 * every token already produced as the new run's prompt, and continues: every stage runs the prompt's part in the
 * chunks the first prefill ran and each produced token in a forward of its own, as it was decoded (the plan's
 * `replayTail`), so the new run computes the interrupted run's very bits (a prefill of the produced tokens takes
 * other kernels; gpt-oss tipped a near tie that way), and the sampler of the new run draws from the position the
 * generation reached: greedy and seeded output equal an uninterrupted run's. The caller sees
 * one stream (steps and text continue), `Recovering` / `Recovered` updates, and the recoveries in the
 * summary. At most `maxAttempts` recoveries within `budget`; then the typed fault, naming every attempt.
 */
import { Cause, Deferred, Duration, Effect, Either, Exit, Option } from "effect"
import { type NodeId, RunId } from "../../domain/ids.js"
import type { LayerRange, ModelLayout, PlacementChoice, PoolNode } from "../../domain/plan.js"
import type { RunFaultReason } from "../../domain/runEvents.js"
import {
  type GenerateError,
  InvalidRequest,
  RecoveryOverMemory,
  RunFaulted,
  type RecoveryRecord,
  type RunRequest,
  type RunSummary,
  type RunUpdate
} from "../../services/Orchestrator.js"
import {
  choosePlacement,
  DEFAULT_SPEED_BYTES_PER_SECOND,
  plannerPlacement,
  stageMemoryBytes
} from "../../services/Placement.js"
import { deliverySettings, samplingPolicy, type WarmPipeline } from "./PipelineSetup.js"
import { deliverWeights } from "./WeightDelivery.js"
import { poolNodeOf } from "./RunPlacement.js"
import type { UpdateSink } from "./RunContext.js"
import { driveRun } from "./RunWorld.js"
import { generationProblem, samplingPolicyProblem, threadsProblem } from "../../services/RequestChecks.js"
import type { NodeStatus } from "../../services/Membership.js"
import type { IncrementalDecoder } from "../../services/Tokenizer.js"
import { speculativeProblem } from "../../services/Speculation.js"
import { checkedDraft } from "./DraftModelCheck.js"

type Placement = ReadonlyArray<{ readonly stageIndex: number; readonly nodeId: NodeId }>

/** Faults a new run on other nodes may cure: lost nodes and workers, broken transports. Not a bad model or request. */
export const isRecoverable = (reason: RunFaultReason): boolean => {
  switch (reason._tag) {
    case "StageFault":
      return (
        reason.reason._tag === "WorkerCrashed" ||
        reason.reason._tag === "TransportFailed" ||
        reason.reason._tag === "StoppedUnexpectedly"
      )
    case "EndpointFault":
    case "MembershipLost":
    case "EndpointsStoppedUnexpectedly":
      return true
    case "ReadinessTimeout":
    case "TokenTimeout":
      return false
  }
}

/**
 * Nodes that take over blocks get their weights as the first placement's did (a node that holds them answers so at
 * once); a delivery that fails leaves the run to fault at load, and recovery to go on.
 */
const redeliverTo = (
  warm: WarmPipeline,
  placement: Placement,
  layerRanges: ReadonlyArray<LayerRange>,
  offer: (update: RunUpdate) => Effect.Effect<unknown>
): Effect.Effect<void> => {
  const delivery = deliverySettings(warm.options)
  return delivery === undefined || placement.length === 0
    ? Effect.void
    : deliverWeights(
        { ...delivery, modelPath: warm.options.model, placement, layerRanges, linkOf: warm.linkOf },
        (update) => offer(update).pipe(Effect.asVoid)
      ).pipe(Effect.ignore)
}

/**
 * The placement of the next run: stages whose node is alive stay; a lost node's stage moves to a spare (an
 * alive node hosting nothing) that `canHost` its blocks (has the memory for them); with no such spare left it is
 * dropped and the survivors share the layers in fewer stages (see `absorbPlacement`). Empty when no node is alive.
 */
export const replan = (
  current: Placement,
  alive: ReadonlyArray<NodeId>,
  canHost: (nodeId: NodeId, stageIndex: number) => boolean = () => true
): Placement => {
  const aliveSet = new Set<number>(alive)
  const used = new Set<number>(current.filter((p) => aliveSet.has(p.nodeId)).map((p) => p.nodeId))
  const spares = alive.filter((n) => !used.has(n))
  const nodes: Array<NodeId> = []
  for (const p of [...current].sort((a, b) => a.stageIndex - b.stageIndex)) {
    if (aliveSet.has(p.nodeId)) nodes.push(p.nodeId)
    else {
      const at = spares.findIndex((spare) => canHost(spare, p.stageIndex))
      if (at >= 0) nodes.push(spares.splice(at, 1)[0]!)
    }
  }
  return nodes.map((nodeId, stageIndex) => ({ stageIndex, nodeId }))
}

/** Where the next run's stages go and which blocks each takes. */
export interface NextPlacement {
  readonly placement: Placement
  readonly layerRanges: ReadonlyArray<LayerRange>
}

/** A survivor as the memory check sees it: placement's pool node and its address (for the words). */
export interface Survivor extends PoolNode {
  readonly address: string
}

/** RecoveryOverMemory's figures. */
export type OverMemoryFigures = Omit<ConstructorParameters<typeof RecoveryOverMemory>[0], "runId" | "message">

const mib = (bytes: number) => `${(bytes / 2 ** 20).toFixed(1)} MiB`

/**
 * When the survivors must absorb a lost node's blocks (fewer stages than before): the even split over them (what the
 * planner did before this check) if every survivor has the memory for its share by its reported capacity, else the
 * fastest contiguous split that fits (placement's `Capacity`, maybe on fewer of them); when none fits, the numbers of
 * the even split and of the whole model, for a typed fault instead of a run that would not load.
 */
export const absorbPlacement = (
  layout: ModelLayout,
  survivors: ReadonlyArray<Survivor>,
  contextTokens: number
): Either.Either<NextPlacement, OverMemoryFigures> => {
  const options = { contextTokens }
  const next = (choice: PlacementChoice): Either.Either<NextPlacement, OverMemoryFigures> => {
    const planned = plannerPlacement(choice)
    return Either.right({ placement: planned.placement.stages, layerRanges: planned.layerRanges })
  }
  const balanced = choosePlacement({ _tag: "Balanced", stageCount: survivors.length }, layout, survivors, options)
  if (Either.isRight(balanced)) return next(balanced.right)
  const capacity = choosePlacement({ _tag: "Capacity" }, layout, survivors, options)
  if (Either.isRight(capacity)) return next(capacity.right)
  // The even split's figures, whatever memory the survivors have.
  const unlimited = survivors.map((s) => ({ ...s, freeMemoryBytes: Number.MAX_SAFE_INTEGER }))
  const even = choosePlacement({ _tag: "Balanced", stageCount: survivors.length }, layout, unlimited, options)
  const whole = choosePlacement({ _tag: "Balanced", stageCount: 1 }, layout, unlimited.slice(0, 1), options)
  return Either.left({
    survivors: Either.isRight(even)
      ? even.right.stages.map((stage) => {
          const node = survivors.find((s) => s.nodeId === stage.nodeId)!
          return {
            nodeId: node.nodeId,
            address: node.address,
            layers: [stage.layerStart, stage.layerEndExclusive] as const,
            requiredBytes: stage.memoryBytes,
            freeBytes: node.freeMemoryBytes
          }
        })
      : [],
    modelBytes: Either.isRight(whole) ? whole.right.stages[0]!.memoryBytes : 0,
    survivorsFreeBytes: survivors.reduce((sum, s) => sum + Math.min(s.freeMemoryBytes, Number.MAX_SAFE_INTEGER), 0)
  })
}

/** The over-memory figures in words. */
const overMemoryWords = (figures: OverMemoryFigures) =>
  `the ${figures.survivors.length} node(s) left lack the memory for the lost blocks: ${figures.survivors
    .map(
      (s) =>
        `blocks [${s.layers[0]}, ${s.layers[1]}) on ${s.address} need ${mib(s.requiredBytes)} (weights + KV cache + ` +
        `compute buffers) and it has ${mib(s.freeBytes)} free`
    )
    .join(
      "; "
    )}; no other contiguous split fits either (the whole model needs ${mib(figures.modelBytes)}, the nodes left have ${mib(
    figures.survivorsFreeBytes
  )} free in all)`

/** The pool's nodes that are not lost, in pool order. */
const aliveNodes = (warm: WarmPipeline) =>
  warm.pool.status.pipe(
    Effect.map((status) => warm.agents.nodes.map((n) => n.nodeId).filter((id) => status.get(id)?._tag !== "Lost"))
  )

/** Waits (at most `millis`) until one of `nodes` is seen lost: a killed node's loss may trail the run's fault. */
const awaitSomeLost = (warm: WarmPipeline, nodes: ReadonlyArray<NodeId>, millis: number) =>
  Effect.gen(function* () {
    const until = performance.now() + millis
    while (performance.now() < until) {
      const status = yield* warm.pool.status
      if (nodes.some((n) => status.get(n)?._tag === "Lost")) return
      yield* Effect.sleep("50 millis")
    }
  })

/** The request's limits once checked: what a generation may take. */
interface GenerationLimits {
  readonly maxAttempts: number
  readonly budgetMillis: number
  readonly maxTokens: number
  readonly prompt: ReadonlyArray<number>
}

/**
 * The request checked before any stage hears of it: the recovery limits, max tokens, and the same checks and words as
 * `swactor run` and serve (services/RequestChecks.ts): an id outside the vocabulary or a context the model cannot hold
 * is the caller's mistake.
 */
const checkGeneration = (warm: WarmPipeline, request: RunRequest) =>
  Effect.gen(function* () {
    const recovery = request.recovery ?? warm.options.recovery ?? {}
    const maxAttempts = recovery.maxAttempts ?? 3
    const budgetMillis = Duration.toMillis(Duration.decode(recovery.budget ?? "60 seconds"))
    if (!Number.isSafeInteger(maxAttempts) || maxAttempts < 0) {
      return yield* new InvalidRequest({ message: `recovery attempts must be a whole number, got ${maxAttempts}` })
    }
    const maxTokens = request.maxTokens ?? 128
    if (!Number.isSafeInteger(maxTokens) || maxTokens < 1) {
      return yield* new InvalidRequest({ message: `max tokens must be a positive whole number, got ${maxTokens}` })
    }
    const prompt = typeof request.prompt === "string" ? warm.vocabulary.tokenize(request.prompt) : request.prompt
    // The same checks and words as `swactor run` and serve (services/RequestChecks.ts): an id outside the vocabulary
    // or a context the model cannot hold is the caller's mistake, refused before any stage hears of it.
    const problem = generationProblem({
      text: request.prompt,
      tokens: prompt,
      maxTokens,
      contextLength: warm.facts.maxSeqLen,
      vocabSize: warm.vocabulary.vocabSize,
      maxTokensField: "maxTokens"
    })
    if (problem !== undefined) return yield* new InvalidRequest({ message: problem })
    const samplingProblem = samplingPolicyProblem(samplingPolicy(request.sampling), warm.vocabulary.vocabSize)
    if (samplingProblem !== undefined) return yield* new InvalidRequest({ message: samplingProblem })
    if (request.threads !== undefined) {
      const bad = threadsProblem(request.threads)
      if (bad !== undefined) return yield* new InvalidRequest({ message: bad })
    }
    const speculation = speculativeProblem(request.speculative, warm.layout.rewind, warm.vocabulary.vocabSize)
    if (speculation !== undefined) return yield* new InvalidRequest({ message: speculation })
    const limits: GenerationLimits = { maxAttempts, budgetMillis, maxTokens, prompt }
    return limits
  })

/** One recovering generation: its request, where it stands across runs, and where its stages go next. */
interface Generation {
  readonly warm: WarmPipeline
  readonly request: RunRequest
  /** The request of a replay: only the first run uses the prompt cache. */
  readonly replayRequest: RunRequest
  readonly updates: UpdateSink
  readonly stopRequested: Deferred.Deferred<void>
  readonly requestStart: number
  readonly limits: GenerationLimits
  /** One decoder spans all runs. */
  readonly decoder: IncrementalDecoder
  readonly produced: Array<number>
  /** The random draws the last stage's sampler made for them (a resumed sampler skips them). */
  samplerDraws: number
  readonly recoveries: Array<RecoveryRecord>
  readonly faults: Array<string>
  text: string
  firstTokenAt: number | undefined
  firstFaultAt: number | undefined
  finished: RunSummary | undefined
  lastPlanned: RecoveryRecord["stages"]
  /** A recovery waiting for its first token. */
  pending: { attempt: number; reason: string; resumedAt: number; since: number } | undefined
  /** Placement: the pipeline's, minus nodes lost before this generation began (see `placeOn`). */
  placement: Placement
  layerRanges: ReadonlyArray<LayerRange>
}

/** A node as placement sees it: its last heartbeat's free memory (unknown: no limit). */
const reportedNode = (warm: WarmPipeline, status: ReadonlyMap<NodeId, NodeStatus>, nodeId: NodeId): Survivor => {
  const s = status.get(nodeId)
  return {
    ...(s?._tag === "Up"
      ? poolNodeOf(nodeId, s.capacity)
      : {
          nodeId,
          freeMemoryBytes: Number.MAX_SAFE_INTEGER,
          speedBytesPerSecond: DEFAULT_SPEED_BYTES_PER_SECOND
        }),
    address: warm.addressOf(nodeId)
  }
}

const redeliver = (gen: Generation) =>
  Effect.suspend(() => redeliverTo(gen.warm, gen.placement, gen.layerRanges, (u) => gen.updates.offer(u)))

/**
 * The next placement on the nodes alive: a spare takes a lost node's stage (same blocks); without one the
 * survivors absorb its blocks when their reported memory holds them, else the typed fault with the numbers.
 */
const placeOn = (gen: Generation, alive: ReadonlyArray<NodeId>, runId: RunId, faults: ReadonlyArray<string>) =>
  Effect.gen(function* () {
    const { warm } = gen
    const status = yield* warm.pool.status
    const reported = (nodeId: NodeId) => reportedNode(warm, status, nodeId)
    const next = replan(gen.placement, alive, (nodeId, stageIndex) => {
      const [start, end] = gen.layerRanges[stageIndex] ?? [0, 0]
      return (
        stageMemoryBytes(warm.layout, start, end, { contextTokens: warm.contextTokens }) <=
        reported(nodeId).freeMemoryBytes
      )
    })
    if (next.length === 0 || next.length === gen.placement.length) {
      // Stage i keeps its blocks (a spare in a lost node's place).
      gen.placement = next
      return yield* redeliver(gen)
    }
    const survivors = next.map((p) => reported(p.nodeId))
    const absorbed = absorbPlacement(warm.layout, survivors, warm.contextTokens)
    if (Either.isLeft(absorbed)) {
      return yield* new RecoveryOverMemory({
        runId,
        ...absorbed.left,
        message: `cannot recover: ${overMemoryWords(absorbed.left)}${
          faults.length === 0 ? "" : ` (after ${faults.map((f, i) => `run ${i + 1}: ${f}`).join("; ")})`
        }`
      })
    }
    gen.placement = absorbed.right.placement
    gen.layerRanges = absorbed.right.layerRanges
    yield* redeliver(gen)
  })

/** A run's token as the generation's: its step after the tokens before the run, its text from the one decoder. */
const passToken = (gen: Generation, base: number, update: Extract<RunUpdate, { _tag: "Token" }>) => {
  // The run's own flush of an incomplete character is not the generation's: one decoder spans all runs.
  if (update.token.tokenId < 0) return Effect.void
  const now = performance.now()
  gen.firstTokenAt ??= now
  const pending = gen.pending
  const recovered =
    pending === undefined
      ? undefined
      : {
          attempt: pending.attempt,
          reason: pending.reason,
          resumedAt: pending.resumedAt,
          stages: gen.lastPlanned,
          millis: now - pending.since
        }
  gen.pending = undefined
  gen.produced.push(update.token.tokenId)
  if (update.samplerDraws !== undefined) gen.samplerDraws = update.samplerDraws
  const piece = gen.decoder.push(update.token.tokenId)
  gen.text += piece
  const token: RunUpdate = {
    _tag: "Token",
    token: { ...update.token, text: piece, step: base + update.token.step },
    ...(update.samplerDraws === undefined ? {} : { samplerDraws: update.samplerDraws })
  }
  if (recovered === undefined) return gen.updates.offer(token)
  gen.recoveries.push(recovered)
  return Effect.zipRight(gen.updates.offer({ _tag: "Recovered", recovery: recovered }), gen.updates.offer(token))
}

/** Where one run's updates go: on to the generation's sink, steps after `base` (the tokens before this run). */
const runSink = (gen: Generation, base: number): UpdateSink => ({
  offer: (update: RunUpdate) =>
    Effect.suspend((): Effect.Effect<unknown> => {
      switch (update._tag) {
        case "Token":
          return passToken(gen, base, update)
        case "Planned":
          gen.lastPlanned = update.stages
          return gen.updates.offer(update)
        case "StageStraggler":
          return gen.updates.offer({
            _tag: "StageStraggler",
            straggler: { ...update.straggler, step: base + update.straggler.step }
          })
        case "Finished":
          gen.finished = update.summary
          return Effect.void
        default:
          return gen.updates.offer(update)
      }
    })
})

/** One run of the generation, resuming after the `base` tokens produced so far, to its exit. */
const runAttempt = (gen: Generation, attempt: number, base: number) => {
  const { prompt, maxTokens } = gen.limits
  return driveRun(
    gen.warm,
    // only the first run uses the prompt cache: a replay prefills in full on its new placement
    {
      ...(attempt === 0 ? gen.request : gen.replayRequest),
      prompt: [...prompt, ...gen.produced],
      maxTokens: maxTokens - base
    },
    runSink(gen, base),
    gen.stopRequested,
    gen.requestStart,
    {
      placement: gen.placement,
      layerRanges: gen.layerRanges,
      startPosition: base,
      resume: { tokens: gen.produced.slice(), draws: gen.samplerDraws }
    }
  ).pipe(Effect.exit)
}

/** The last run finished: the decoder's rest, then the generation's summary (the last run's, with all the tokens). */
const finishGeneration = (gen: Generation, base: number) =>
  Effect.gen(function* () {
    const finished = gen.finished
    if (finished === undefined) return // a dry run
    const rest = gen.decoder.flush()
    if (rest !== "") {
      gen.text += rest
      yield* gen.updates.offer({
        _tag: "Token",
        token: {
          tokenId: -1,
          text: rest,
          step: gen.produced.length,
          timings: { sinceStartMillis: 0, latencyMillis: 0 }
        }
      })
    }
    yield* gen.updates.offer({
      _tag: "Finished",
      summary: {
        ...finished,
        promptTokens: gen.limits.prompt.length,
        generatedTokens: gen.produced.length,
        text: gen.text,
        timeToFirstTokenMillis: (gen.firstTokenAt ?? performance.now()) - gen.requestStart,
        recoveries: gen.recoveries,
        // The last run's steps, as the generation's.
        stragglers: finished.stragglers.map((s) => ({ ...s, step: s.step + base })),
        stageStragglers: finished.stageStragglers.map((s) => ({ ...s, worstStep: s.worstStep + base }))
      }
    })
  })

/** Whether everything was produced before the fault (max tokens, or an end of generation): nothing to resume. */
const allProduced = (gen: Generation) =>
  gen.produced.length >= gen.limits.maxTokens ||
  (gen.produced.length > 0 && gen.warm.vocabulary.isEndOfGeneration(gen.produced.at(-1)!))

/** Everything was produced before the fault: the generation finishes with what it has. */
const finishAfterFault = (gen: Generation, runId: RunId, now: number) =>
  gen.updates.offer({
    _tag: "Finished",
    summary: {
      runId,
      outcome: gen.produced.length >= gen.limits.maxTokens ? "MaxTokens" : "Eos",
      promptTokens: gen.limits.prompt.length,
      generatedTokens: gen.produced.length,
      text: gen.text + gen.decoder.flush(),
      timeToFirstTokenMillis: (gen.firstTokenAt ?? now) - gen.requestStart,
      prefillMillis: 0,
      decodeTokensPerSecond: 0,
      decodeMillisPerToken: 0,
      stages: [],
      transferMillisPerToken: 0,
      recoveries: gen.recoveries,
      stragglers: [],
      stageStragglers: []
    }
  })

/**
 * After the recoverable fault of run `attempt`: says `Recovering`, waits a moment for a lost node to be seen lost
 * (an operator stop ends it), and places the next run on the nodes alive. True when the generation is over (stopped).
 */
const prepareNextRun = (gen: Generation, attempt: number, error: RunFaulted, now: number) =>
  Effect.gen(function* () {
    yield* gen.updates.offer({
      _tag: "Recovering",
      attempt: attempt + 1,
      reason: error.message,
      resumedAt: gen.produced.length
    })
    // A fault while replaying keeps the clock of the recovery it interrupted.
    gen.pending = {
      attempt: attempt + 1,
      reason: error.message,
      resumedAt: gen.produced.length,
      since: gen.pending?.since ?? now
    }
    // An operator stop while recovering ends the generation as a stopped run would (no new run), at once: this
    // wait gives way to it.
    yield* Effect.raceFirst(
      awaitSomeLost(
        gen.warm,
        gen.placement.map((p) => p.nodeId),
        1500
      ),
      Deferred.await(gen.stopRequested)
    )
    if (yield* stopRequestedDone(gen.stopRequested)) return true
    const alive = yield* aliveNodes(gen.warm)
    yield* placeOn(gen, alive, error.runId, gen.faults)
    if (gen.placement.length === 0) {
      return yield* new RunFaulted({
        runId: error.runId,
        reason: error.reason,
        message: `no node left to host the model after ${attempt + 1} recovery attempt${attempt === 0 ? "" : "s"}: ${gen.faults
          .map((f, i) => `run ${i + 1}: ${f}`)
          .join("; ")}`
      })
    }
    return false
  })

/**
 * Run `attempt` failed: a fault that is not recoverable (or a stop) fails the generation, so does the last attempt
 * or a spent budget; else the next run is placed. True when the generation is over.
 */
const recoverFrom = (gen: Generation, attempt: number, cause: Cause.Cause<GenerateError>) =>
  Effect.gen(function* () {
    const failure = Cause.failureOption(cause)
    if (Option.isNone(failure)) return yield* Effect.failCause(cause)
    const error: GenerateError = failure.value
    const stopped = yield* stopRequestedDone(gen.stopRequested)
    if (error._tag !== "RunFaulted" || !isRecoverable(error.reason) || stopped) {
      return yield* failWith(error, gen.faults)
    }
    const now = performance.now()
    gen.firstFaultAt ??= now
    gen.faults.push(error.message)
    const { maxAttempts, budgetMillis } = gen.limits
    if (attempt >= maxAttempts || now - gen.firstFaultAt > budgetMillis) {
      return yield* new RunFaulted({
        runId: error.runId,
        reason: error.reason,
        message: `gave up after ${attempt} recovery attempt${attempt === 1 ? "" : "s"}${
          attempt >= maxAttempts ? "" : ` (the ${Duration.format(Duration.millis(budgetMillis))} budget ran out)`
        }: ${gen.faults.map((f, i) => `run ${i + 1}: ${f}`).join("; ")}`
      })
    }
    if (allProduced(gen)) {
      yield* finishAfterFault(gen, error.runId, now)
      return true
    }
    return yield* prepareNextRun(gen, attempt, error, now)
  })

/**
 * One generation on `warm`: runs it, and resumes it in a new run after each recoverable fault (see above).
 * Updates go to `updates`; the stream's tokens continue across runs.
 */
export const generateRecovering = (
  warm: WarmPipeline,
  asked: RunRequest,
  updates: UpdateSink,
  stopRequested: Deferred.Deferred<void>,
  requestStart: number = performance.now()
) =>
  Effect.gen(function* () {
    const limits = yield* checkGeneration(warm, asked)
    // a draft model read and compared with the model before any stage hears of it (its block count for stage 0)
    const speculative = yield* checkedDraft(warm.options.model, asked.speculative)
    const request = speculative === undefined ? asked : { ...asked, speculative }
    if (limits.maxAttempts === 0) return yield* driveRun(warm, request, updates, stopRequested, requestStart)
    const { promptCache: _firstRunOnly, ...replayRequest } = request
    const gen: Generation = {
      warm,
      request,
      replayRequest,
      updates,
      stopRequested,
      requestStart,
      limits,
      decoder: warm.vocabulary.decoder(limits.prompt),
      produced: [],
      samplerDraws: 0,
      recoveries: [],
      faults: [],
      text: "",
      firstTokenAt: undefined,
      firstFaultAt: undefined,
      finished: undefined,
      lastPlanned: [],
      pending: undefined,
      placement: warm.placement,
      layerRanges: warm.layerRanges
    }
    {
      const alive = yield* aliveNodes(warm)
      if (gen.placement.some((p) => !alive.includes(p.nodeId))) yield* placeOn(gen, alive, RunId.make(0), [])
    }
    for (let attempt = 0; ; attempt++) {
      const base = gen.produced.length
      const exit = yield* runAttempt(gen, attempt, base)
      if (Exit.isSuccess(exit)) return yield* finishGeneration(gen, base)
      if (yield* recoverFrom(gen, attempt, exit.cause)) return
    }
  })

const stopRequestedDone = (stop: Deferred.Deferred<void>) => Deferred.isDone(stop)

const failWith = (error: GenerateError, faults: ReadonlyArray<string>): Effect.Effect<never, GenerateError> =>
  error._tag === "RunFaulted" && faults.length > 0
    ? Effect.fail(
        new RunFaulted({
          runId: error.runId,
          reason: error.reason,
          message: `${error.message} (after ${faults.length} recovery attempt${faults.length === 1 ? "" : "s"}: ${faults
            .map((f, i) => `run ${i + 1}: ${f}`)
            .join("; ")})`
        })
      )
    : Effect.fail(error)
