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

/**
 * One generation on `warm`: runs it, and resumes it in a new run after each recoverable fault (see above).
 * Updates go to `updates`; the stream's tokens continue across runs.
 */
export const generateRecovering = (
  warm: WarmPipeline,
  request: RunRequest,
  updates: UpdateSink,
  stopRequested: Deferred.Deferred<void>,
  requestStart: number = performance.now()
) =>
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
    if (maxAttempts === 0) return yield* driveRun(warm, request, updates, stopRequested, requestStart)

    const decoder = warm.vocabulary.decoder(prompt)
    const { promptCache: _firstRunOnly, ...replayRequest } = request
    const produced: Array<number> = []
    // the random draws the last stage's sampler made for them (a resumed sampler skips them)
    let samplerDraws = 0
    const recoveries: Array<RecoveryRecord> = []
    const faults: Array<string> = []
    let text = ""
    let firstTokenAt: number | undefined
    let firstFaultAt: number | undefined
    let finished: RunSummary | undefined
    let lastPlanned: RecoveryRecord["stages"] = []
    // A recovery waiting for its first token.
    let pending: { attempt: number; reason: string; resumedAt: number; since: number } | undefined

    // Placement: the pipeline's, minus nodes lost before this generation began.
    let placement: Placement = warm.placement
    let layerRanges: ReadonlyArray<LayerRange> = warm.layerRanges
    // The next placement on the nodes alive: a spare takes a lost node's stage (same blocks); without one the
    // survivors absorb its blocks when their reported memory holds them, else the typed fault with the numbers.
    const redeliver = Effect.suspend(() => redeliverTo(warm, placement, layerRanges, (u) => updates.offer(u)))
    const placeOn = (alive: ReadonlyArray<NodeId>, runId: RunId, faults: ReadonlyArray<string>) =>
      Effect.gen(function* () {
        const status = yield* warm.pool.status
        // A node as placement sees it: its last heartbeat's free memory (unknown: no limit).
        const reported = (nodeId: NodeId): Survivor => {
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
        const next = replan(placement, alive, (nodeId, stageIndex) => {
          const [start, end] = layerRanges[stageIndex] ?? [0, 0]
          return (
            stageMemoryBytes(warm.layout, start, end, { contextTokens: warm.contextTokens }) <=
            reported(nodeId).freeMemoryBytes
          )
        })
        if (next.length === 0 || next.length === placement.length) {
          // Stage i keeps its blocks (a spare in a lost node's place).
          placement = next
          return yield* redeliver
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
        placement = absorbed.right.placement
        layerRanges = absorbed.right.layerRanges
        yield* redeliver
      })
    {
      const alive = yield* aliveNodes(warm)
      if (placement.some((p) => !alive.includes(p.nodeId))) yield* placeOn(alive, RunId.make(0), [])
    }

    for (let attempt = 0; ; attempt++) {
      const base = produced.length
      const sink: UpdateSink = {
        offer: (update: RunUpdate) =>
          Effect.suspend((): Effect.Effect<unknown> => {
            switch (update._tag) {
              case "Token": {
                // The run's own flush of an incomplete character is not the generation's: one decoder spans all runs.
                if (update.token.tokenId < 0) return Effect.void
                const now = performance.now()
                firstTokenAt ??= now
                const recovered =
                  pending === undefined
                    ? undefined
                    : {
                        attempt: pending.attempt,
                        reason: pending.reason,
                        resumedAt: pending.resumedAt,
                        stages: lastPlanned,
                        millis: now - pending.since
                      }
                pending = undefined
                produced.push(update.token.tokenId)
                if (update.samplerDraws !== undefined) samplerDraws = update.samplerDraws
                const piece = decoder.push(update.token.tokenId)
                text += piece
                const token: RunUpdate = {
                  _tag: "Token",
                  token: { ...update.token, text: piece, step: base + update.token.step },
                  ...(update.samplerDraws === undefined ? {} : { samplerDraws: update.samplerDraws })
                }
                if (recovered === undefined) return updates.offer(token)
                recoveries.push(recovered)
                return Effect.zipRight(updates.offer({ _tag: "Recovered", recovery: recovered }), updates.offer(token))
              }
              case "Planned":
                lastPlanned = update.stages
                return updates.offer(update)
              case "StageStraggler":
                return updates.offer({
                  _tag: "StageStraggler",
                  straggler: { ...update.straggler, step: base + update.straggler.step }
                })
              case "Finished":
                finished = update.summary
                return Effect.void
              default:
                return updates.offer(update)
            }
          })
      }
      const exit = yield* driveRun(
        warm,
        // only the first run uses the prompt cache: a replay prefills in full on its new placement
        { ...(attempt === 0 ? request : replayRequest), prompt: [...prompt, ...produced], maxTokens: maxTokens - base },
        sink,
        stopRequested,
        requestStart,
        { placement, layerRanges, startPosition: base, resume: { tokens: produced.slice(), draws: samplerDraws } }
      ).pipe(Effect.exit)

      if (Exit.isSuccess(exit)) {
        if (finished === undefined) return // a dry run
        const rest = decoder.flush()
        if (rest !== "") {
          text += rest
          yield* updates.offer({
            _tag: "Token",
            token: {
              tokenId: -1,
              text: rest,
              step: produced.length,
              timings: { sinceStartMillis: 0, latencyMillis: 0 }
            }
          })
        }
        yield* updates.offer({
          _tag: "Finished",
          summary: {
            ...finished,
            promptTokens: prompt.length,
            generatedTokens: produced.length,
            text,
            timeToFirstTokenMillis: (firstTokenAt ?? performance.now()) - requestStart,
            recoveries,
            // The last run's steps, as the generation's.
            stragglers: finished.stragglers.map((s) => ({ ...s, step: s.step + base })),
            stageStragglers: finished.stageStragglers.map((s) => ({ ...s, worstStep: s.worstStep + base }))
          }
        })
        return
      }

      const failure = Cause.failureOption(exit.cause)
      if (Option.isNone(failure)) return yield* Effect.failCause(exit.cause)
      const error: GenerateError = failure.value
      const stopped = yield* stopRequestedDone(stopRequested)
      if (error._tag !== "RunFaulted" || !isRecoverable(error.reason) || stopped) {
        return yield* failWith(error, faults)
      }
      const now = performance.now()
      firstFaultAt ??= now
      faults.push(error.message)
      if (attempt >= maxAttempts || now - firstFaultAt > budgetMillis) {
        return yield* new RunFaulted({
          runId: error.runId,
          reason: error.reason,
          message: `gave up after ${attempt} recovery attempt${attempt === 1 ? "" : "s"}${
            attempt >= maxAttempts ? "" : ` (the ${Duration.format(Duration.millis(budgetMillis))} budget ran out)`
          }: ${faults.map((f, i) => `run ${i + 1}: ${f}`).join("; ")}`
        })
      }
      if (
        produced.length >= maxTokens ||
        (produced.length > 0 && warm.vocabulary.isEndOfGeneration(produced.at(-1)!))
      ) {
        // Everything was produced before the fault: nothing to resume.
        yield* updates.offer({
          _tag: "Finished",
          summary: {
            runId: error.runId,
            outcome: produced.length >= maxTokens ? "MaxTokens" : "Eos",
            promptTokens: prompt.length,
            generatedTokens: produced.length,
            text: text + decoder.flush(),
            timeToFirstTokenMillis: (firstTokenAt ?? now) - requestStart,
            prefillMillis: 0,
            decodeTokensPerSecond: 0,
            decodeMillisPerToken: 0,
            stages: [],
            transferMillisPerToken: 0,
            recoveries,
            stragglers: [],
            stageStragglers: []
          }
        })
        return
      }

      yield* updates.offer({
        _tag: "Recovering",
        attempt: attempt + 1,
        reason: error.message,
        resumedAt: produced.length
      })
      // A fault while replaying keeps the clock of the recovery it interrupted.
      pending = {
        attempt: attempt + 1,
        reason: error.message,
        resumedAt: produced.length,
        since: pending?.since ?? now
      }
      // An operator stop while recovering ends the generation as a stopped run would (no new run), at once: this
      // wait gives way to it.
      yield* Effect.raceFirst(
        awaitSomeLost(
          warm,
          placement.map((p) => p.nodeId),
          1500
        ),
        Deferred.await(stopRequested)
      )
      if (yield* stopRequestedDone(stopRequested)) return
      const alive = yield* aliveNodes(warm)
      yield* placeOn(alive, error.runId, faults)
      if (placement.length === 0) {
        return yield* new RunFaulted({
          runId: error.runId,
          reason: error.reason,
          message: `no node left to host the model after ${attempt + 1} recovery attempt${attempt === 0 ? "" : "s"}: ${faults
            .map((f, i) => `run ${i + 1}: ${f}`)
            .join("; ")}`
        })
      }
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
