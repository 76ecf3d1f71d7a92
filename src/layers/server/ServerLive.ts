/**
 * The Server over the Orchestrator: one warm pipeline set up in the background (status Loading → Ready, or
 * Faulted with the reason in words), a warm-up run so the first request does not pay the load, admission by
 * KV bytes per stage, and each request its own run on the pipeline.
 */
import { Cause, Deferred, Duration, Effect, Exit, Layer, Option, Ref, Schedule, Stream } from "effect"
import * as Gguf from "../gguf/GgufReader.js"
import { Orchestrator, type Pipeline, type RunUpdate } from "../../services/Orchestrator.js"
import {
  BadServeRequest,
  PipelineFaulted,
  Server,
  ServerBusy,
  type ServeError,
  type ServeEvent,
  type ServeOptions,
  type ServeRequest,
  type ServerInfo,
  ServerLoading,
  type ServerMetrics,
  type StageMetrics,
  type ServerStatus
} from "../../services/Server.js"
import { kvBytesOfSequence, kvBytesPerTokenOfBlock } from "../../services/KvSize.js"
import { makeStopMatcher } from "../../services/StopText.js"
import { runContextLength } from "../orchestrator/RunWorld.js"

/** KV cache bytes one sequence of `contextLength` tokens takes on the heaviest stage (services/KvSize.ts). */
export const kvBytesPerSequence = (
  shape: { readonly layersPerStage: number; readonly kvBytesPerBlockToken: number },
  contextLength: number
): number => kvBytesOfSequence(shape.layersPerStage * shape.kvBytesPerBlockToken, contextLength)

/** KV bytes per token per block, from the GGUF's attention facts. */
const readKvBytesPerBlockToken = (path: string) =>
  Effect.gen(function*() {
    const file = yield* Gguf.readGgufFile(path)
    const arch = yield* Gguf.getArchitecture(file)
    const hidden = yield* Gguf.getU32(file, `${arch}.embedding_length`)
    const heads = yield* Gguf.getU32(file, `${arch}.attention.head_count`)
    const kvHeads = (yield* Gguf.getOptional(file, `${arch}.attention.head_count_kv`, Gguf.getU32)) ?? heads
    const keyLength = (yield* Gguf.getOptional(file, `${arch}.attention.key_length`, Gguf.getU32)) ?? Math.floor(hidden / heads)
    const valueLength = (yield* Gguf.getOptional(file, `${arch}.attention.value_length`, Gguf.getU32)) ?? keyLength
    return kvBytesPerTokenOfBlock(keyLength * kvHeads, valueLength * kvHeads)
  })

interface Ticket {
  /** The request's KV context (its bytes per stage follow the pipeline's current shape). */
  readonly contextLength: number
  readonly ready: Deferred.Deferred<void, ServeError>
  admitted: boolean
}

/** The KV budget per stage and what a context of n tokens takes on the heaviest stage, as the pipeline is now. */
export interface KvSizing {
  readonly budget: () => number
  readonly bytes: (contextLength: number) => number
}

/**
 * FIFO admission: a request runs when it fits the KV budget and the parallel limit; at most `limit` wait. Sizes are
 * read from `sizing` each time, so a pipeline that changed shape (fewer stages after a recovery) re-weighs every
 * reservation at once (`reshaped`).
 */
const makeAdmission = (sizing: KvSizing, parallel: number, limit: number) => {
  const admitted = new Set<Ticket>()
  const queue: Array<Ticket> = []
  const used = () => {
    let sum = 0
    for (const ticket of admitted) sum += sizing.bytes(ticket.contextLength)
    return sum
  }
  const fits = (contextLength: number) => admitted.size < parallel && used() + sizing.bytes(contextLength) <= sizing.budget()
  const admit = (ticket: Ticket) => {
    ticket.admitted = true
    admitted.add(ticket)
    Deferred.unsafeDone(ticket.ready, Exit.void)
  }
  const pump = () => {
    while (queue.length > 0 && fits(queue[0]!.contextLength)) admit(queue.shift()!)
  }
  return {
    state: () => ({ used: used(), running: admitted.size, queued: queue.length }),
    /**
     * Admitted (or queued) for the rest of the scope: refused at once when the queue is full; otherwise `wait`
     * completes on admission. `ahead` is how many wait before it (0 when admitted at once).
     */
    enter: (contextLength: number) =>
      Effect.gen(function*() {
        const ticket: Ticket = { contextLength, ready: yield* Deferred.make<void, ServeError>(), admitted: false }
        if (queue.length === 0 && fits(contextLength)) admit(ticket)
        else if (queue.length >= limit) {
          return yield* new ServerBusy({
            queued: queue.length,
            retryAfterSeconds: 1 + Math.floor(queue.length / parallel),
            message: `the server is busy: ${admitted.size} requests running and ${queue.length} queued (the queue holds ${limit})`
          })
        } else queue.push(ticket)
        yield* Effect.addFinalizer(() =>
          Effect.sync(() => {
            if (ticket.admitted) admitted.delete(ticket)
            else {
              const at = queue.indexOf(ticket)
              if (at >= 0) queue.splice(at, 1)
            }
            pump()
          })
        )
        return { ahead: ticket.admitted ? 0 : queue.length, admitted: ticket.admitted, wait: Deferred.await(ticket.ready) }
      }),
    /** The sizes changed: waiting requests that can never fit now are refused, the others admitted as room allows. */
    reshaped: (tooLong: (contextLength: number) => ServeError) =>
      Effect.sync(() => {
        for (const ticket of [...queue]) {
          if (sizing.bytes(ticket.contextLength) <= sizing.budget()) continue
          queue.splice(queue.indexOf(ticket), 1)
          Deferred.unsafeDone(ticket.ready, Exit.fail(tooLong(ticket.contextLength)))
        }
        pump()
      }),
    /** Fails every waiting request (the pipeline faulted). */
    failAll: (error: ServeError) =>
      Effect.sync(() => {
        for (const ticket of queue.splice(0)) Deferred.unsafeDone(ticket.ready, Exit.fail(error))
      })
  }
}

const errorWords = (error: { readonly _tag: string }): string => {
  const message = "message" in error && typeof error.message === "string" ? error.message : ""
  return message !== "" ? message : `${error._tag}: ${JSON.stringify(error)}`
}

export const make = (options: ServeOptions) =>
  Effect.gen(function*() {
    const orchestrator = yield* Orchestrator
    const parallel = options.parallel ?? 4
    const queueLimit = options.queueLimit ?? 64
    if (!Number.isSafeInteger(parallel) || parallel < 1) return yield* Effect.dieMessage(`parallel must be a positive whole number, got ${parallel}`)

    const status = yield* Ref.make<ServerStatus>({ _tag: "Loading" })
    const started = yield* Deferred.make<{ pipeline: Pipeline; info: ServerInfo }, PipelineFaulted>()
    const metrics = {
      completed: 0,
      cancelled: 0,
      failed: 0,
      refused: 0,
      promptTokens: 0,
      completionTokens: 0,
      recoveries: 0,
      stragglers: 0,
      inFlight: 0,
      stages: new Map<number, { -readonly [K in Exclude<keyof StageMetrics, "stageIndex">]: StageMetrics[K] }>()
    }
    let admission: ReturnType<typeof makeAdmission> | undefined
    // The pipeline's shape as its runs were last planned: the most blocks on one stage (more after a recovery onto
    // fewer stages, fewer again when a node rejoins). KV bytes per request and the default budget follow it.
    const shape = { layersPerStage: 0, kvBytesPerBlockToken: 0, maxSeqLen: 0 }
    const sizing: KvSizing = {
      budget: () =>
        options.kvBudgetBytes ??
          parallel * kvBytesPerSequence(shape, Math.min(shape.maxSeqLen, 4096)),
      bytes: (contextLength) => kvBytesPerSequence(shape, contextLength)
    }
    const tooLong = (contextLength: number) =>
      new BadServeRequest({
        message: `context too long: ${contextLength} tokens need ${sizing.bytes(contextLength)} bytes of KV cache per stage, ` +
          `the budget is ${sizing.budget()}`
      })
    /** A run was planned: when its heaviest stage holds a different number of blocks, the sizes change. */
    const observePlan = (update: RunUpdate) =>
      Effect.suspend(() => {
        if (update._tag !== "Planned" || update.stages.length === 0) return Effect.void
        const layers = Math.max(...update.stages.map((s) => s.layers[1] - s.layers[0]))
        if (layers === shape.layersPerStage) return Effect.void
        shape.layersPerStage = layers
        return admission === undefined ? Effect.void : admission.reshaped(tooLong)
      })
    let lastRunAt = performance.now()

    const fault = (message: string) =>
      Effect.gen(function*() {
        const current = yield* Ref.get(status)
        if (current._tag === "Faulted") return
        yield* Ref.set(status, { _tag: "Faulted", message })
        yield* Deferred.fail(started, new PipelineFaulted({ message }))
        if (admission !== undefined) yield* admission.failAll(new PipelineFaulted({ message }))
      })

    const warmUp = (pipeline: Pipeline) =>
      pipeline.run({ prompt: [pipeline.vocabulary.bosTokenId ?? 1], maxTokens: 1 }).pipe(Stream.runForEach(observePlan))

    // --- setup, in the background: /health answers Loading meanwhile ---
    yield* Effect.gen(function*() {
      const pipeline = yield* orchestrator.pipeline(options)
      shape.kvBytesPerBlockToken = yield* readKvBytesPerBlockToken(options.model)
      shape.maxSeqLen = pipeline.model.maxSeqLen
      shape.layersPerStage = Math.ceil(pipeline.model.numLayers / pipeline.stageCount)
      admission = makeAdmission(sizing, parallel, queueLimit)
      // A lost agent leaves the pipeline (its runs recover on the others); with none left, the server faults.
      // Without recovery, the first lost agent faults it.
      yield* (options.recovery?.maxAttempts === 0
        ? pipeline.lost.pipe(Effect.flatMap((lost) => fault(`lost agent ${lost.node.address}: ${lost.reason}`)))
        : pipeline.lost.pipe(
          Effect.zipRight(
            pipeline.alive.pipe(
              Effect.repeat({ schedule: Schedule.spaced("250 millis"), until: (alive) => alive.length === 0 })
            )
          ),
          Effect.flatMap(() => fault("every agent of the pipeline was lost"))
        )).pipe(Effect.forkScoped)
      // Loads every stage's weights now, so the first request starts on a warm pipeline.
      yield* warmUp(pipeline)
      // While idle, keep the agents' weights from expiring out of their model caches.
      const keepWarm = Duration.decode(options.keepWarmEvery ?? "4 minutes")
      yield* Effect.suspend(() =>
        metrics.inFlight === 0 && performance.now() - lastRunAt >= Duration.toMillis(keepWarm) / 2
          ? warmUp(pipeline).pipe(Effect.tap(() => Effect.sync(() => (lastRunAt = performance.now()))), Effect.ignore)
          : Effect.void
      ).pipe(Effect.repeat(Schedule.spaced(Duration.toMillis(keepWarm) / 2)), Effect.forkScoped)
      yield* Ref.update(status, (s): ServerStatus => (s._tag === "Loading" ? { _tag: "Ready" } : s))
      yield* Deferred.succeed(started, {
        pipeline,
        info: { modelId: pipeline.model.modelId, model: pipeline.model, stageCount: pipeline.stageCount, parallel }
      })
      yield* Effect.never
    }).pipe(
      Effect.catchAllCause((cause) =>
        Cause.isInterruptedOnly(cause)
          ? Effect.void
          : fault(
            `setting up the pipeline for ${options.model} failed: ${
              Option.match(Cause.failureOption(cause), {
                onNone: () => Cause.pretty(cause),
                onSome: (error) => errorWords(error as { _tag: string })
              })
            }`
          )
      ),
      Effect.scoped,
      Effect.forkScoped
    )

    const current = Effect.gen(function*() {
      const s = yield* Ref.get(status)
      if (s._tag === "Loading") return yield* new ServerLoading({ message: "the model is still loading" })
      if (s._tag === "Faulted") return yield* new PipelineFaulted({ message: s.message })
      return yield* Deferred.await(started)
    })

    const validate = (request: ServeRequest, maxSeqLen: number, promptTokens: number) => {
      const s = request.sampling ?? {}
      const maxTokens = request.maxTokens ?? 128
      const bad = (message: string) => Effect.fail(new BadServeRequest({ message }))
      if (promptTokens === 0) return bad("the prompt is empty")
      if (!Number.isSafeInteger(maxTokens) || maxTokens < 1) return bad(`max_tokens must be a positive whole number, got ${maxTokens}`)
      if (promptTokens + maxTokens + 1 > maxSeqLen) {
        return bad(
          `context too long: ${promptTokens} prompt tokens + ${maxTokens} max tokens exceed the model's context of ${maxSeqLen} tokens`
        )
      }
      if (s.temperature !== undefined && !(Number.isFinite(s.temperature) && s.temperature >= 0 && s.temperature <= 100)) {
        return bad(`temperature must be between 0 and 100, got ${s.temperature}`)
      }
      if (s.topK !== undefined && !(Number.isSafeInteger(s.topK) && s.topK >= 0)) return bad(`top_k must be a whole number ≥ 0, got ${s.topK}`)
      if (s.topP !== undefined && !(s.topP > 0 && s.topP <= 1)) return bad(`top_p must be in (0, 1], got ${s.topP}`)
      if (s.minP !== undefined && !(s.minP >= 0 && s.minP <= 1)) return bad(`min_p must be in [0, 1], got ${s.minP}`)
      if (s.seed !== undefined && !Number.isSafeInteger(s.seed)) return bad(`seed must be a whole number, got ${s.seed}`)
      return Effect.succeed(maxTokens)
    }

    const generate = (request: ServeRequest): Stream.Stream<ServeEvent, ServeError> =>
      Stream.unwrapScoped(
        Effect.gen(function*() {
          const { pipeline } = yield* current
          const prompt = typeof request.prompt === "string" ? pipeline.vocabulary.tokenize(request.prompt) : request.prompt
          const maxTokens = yield* validate(request, pipeline.model.maxSeqLen, prompt.length)
          const contextLength = runContextLength(pipeline.model.maxSeqLen, prompt.length, maxTokens)
          if (sizing.bytes(contextLength) > sizing.budget()) return yield* tooLong(contextLength)
          const queuedAt = performance.now()
          const ticket = yield* admission!.enter(contextLength).pipe(Effect.tapError(() => Effect.sync(() => metrics.refused++)))
          const queued: ReadonlyArray<ServeEvent> = ticket.admitted ? [] : [{ _tag: "Queued", ahead: ticket.ahead }]
          return Stream.concat(Stream.fromIterable(queued), Stream.unwrap(Effect.as(ticket.wait, runAdmitted(prompt, maxTokens, request, queuedAt))))
        })
      )

    const runAdmitted = (
      prompt: ReadonlyArray<number>,
      maxTokens: number,
      request: ServeRequest,
      queuedAt: number
    ): Stream.Stream<ServeEvent, ServeError> =>
      Stream.unwrapScoped(
        Effect.gen(function*() {
          const { pipeline } = yield* current
          metrics.inFlight++
          lastRunAt = performance.now()
          let outcome: "completed" | "cancelled" | "failed" = "cancelled"
          yield* Effect.addFinalizer(() =>
            Effect.sync(() => {
              metrics.inFlight--
              metrics[outcome]++
              lastRunAt = performance.now()
            })
          )
          metrics.promptTokens += prompt.length
          const stop = makeStopMatcher(request.stop ?? [])
          let completionTokens = 0
          let finished = false
          const done = (finishReason: "stop" | "length"): ServeEvent => {
            finished = true
            outcome = "completed"
            return { _tag: "Done", finishReason, promptTokens: prompt.length, completionTokens }
          }
          const onUpdate = (update: RunUpdate): ReadonlyArray<ServeEvent> => {
            if (finished) return []
            if (update._tag === "Token") {
              if (update.token.tokenId >= 0) {
                completionTokens++
                metrics.completionTokens++
                if (pipeline.vocabulary.isEndOfGeneration(update.token.tokenId)) {
                  const rest = stop.flush()
                  return [...(rest === "" ? [] : [text(rest)]), done("stop")]
                }
              }
              const match = stop.push(update.token.text)
              const out = match.text === "" ? [] : [text(match.text)]
              return match.stopped ? [...out, done("stop")] : out
            }
            if (update._tag === "Recovered") metrics.recoveries++
            if (update._tag === "StageStraggler") stageMetrics(update.straggler.stageIndex).stragglerTokens++
            if (update._tag === "Finished") {
              metrics.stragglers += update.summary.stragglers.length
              recordStages(update)
              const rest = stop.flush()
              return [...(rest === "" ? [] : [text(rest)]), done(update.summary.outcome === "Eos" ? "stop" : "length")]
            }
            return []
          }
          const text = (piece: string): ServeEvent => ({ _tag: "Text", text: piece, completionTokens })
          const admitted: ServeEvent = { _tag: "Admitted", promptTokens: prompt.length, queuedMillis: performance.now() - queuedAt }
          return Stream.concat(
            Stream.make(admitted),
            pipeline.run({
              prompt,
              maxTokens,
              ...(request.sampling === undefined ? {} : { sampling: request.sampling })
            }).pipe(
              Stream.mapError((error): ServeError =>
                error._tag === "InvalidRequest"
                  ? new BadServeRequest({ message: error.message })
                  : new PipelineFaulted({ message: errorWords(error) })
              ),
              Stream.tapError(() => Effect.sync(() => (outcome = "failed"))),
              Stream.tap(observePlan),
              Stream.mapConcat(onUpdate),
              Stream.takeUntil((event) => event._tag === "Done")
            )
          )
        })
      )

    const stageMetrics = (stageIndex: number) => {
      const m = metrics.stages.get(stageIndex) ?? {
        computeSeconds: 0,
        transferSeconds: 0,
        decodeTokens: 0,
        microBatches: 0,
        batchRows: 0,
        maxBatchSequences: 0,
        stragglerTokens: 0,
        computeBytes: 0,
        residentBytes: 0,
        peakResidentBytes: 0
      }
      metrics.stages.set(stageIndex, m)
      return m
    }

    const recordStages = (update: Extract<RunUpdate, { _tag: "Finished" }>) => {
      const decodeSteps = Math.max(0, update.summary.generatedTokens - 1)
      for (const stage of update.summary.stages) {
        const m = stageMetrics(stage.stageIndex)
        m.computeSeconds += (stage.prefillComputeMillis + stage.computeMillisPerToken * decodeSteps) / 1000
        m.transferSeconds += (update.summary.transferMillisPerToken * decodeSteps) / 1000 / update.summary.stages.length
        m.decodeTokens += decodeSteps
        m.microBatches += stage.microBatches
        m.batchRows += stage.batchRows
        m.maxBatchSequences = Math.max(m.maxBatchSequences, stage.maxBatchSequences)
        if (stage.residentBytes > 0) {
          m.computeBytes = stage.computeBytes
          m.residentBytes = stage.residentBytes
          m.peakResidentBytes = Math.max(m.peakResidentBytes, stage.peakResidentBytes)
        }
      }
    }

    const snapshot: Effect.Effect<ServerMetrics> = Effect.gen(function*() {
      const state = admission?.state() ?? { used: 0, running: 0, queued: 0 }
      const ready = yield* Deferred.poll(started)
      const up = ready._tag === "Some" ? yield* Effect.option(ready.value) : Option.none()
      const agents = Option.isSome(up)
        ? yield* Effect.forEach(yield* up.value.pipeline.alive, (agent) =>
          agent.capacity.pipe(
            Effect.timeout("1 second"),
            Effect.map((c) => ({ address: agent.node.address, pid: agent.pid, activeStages: c.activeStages })),
            Effect.orElseSucceed(() => ({ address: agent.node.address, pid: agent.pid, activeStages: -1 }))
          ), { concurrency: "unbounded" })
        : []
      return {
        requests: { completed: metrics.completed, cancelled: metrics.cancelled, failed: metrics.failed, refused: metrics.refused },
        promptTokens: metrics.promptTokens,
        completionTokens: metrics.completionTokens,
        recoveries: metrics.recoveries,
        stragglers: metrics.stragglers,
        inFlight: metrics.inFlight,
        queued: state.queued,
        kvReservedBytes: state.used,
        kvBudgetBytes: Option.isSome(up) ? sizing.budget() : 0,
        stages: [...metrics.stages].sort(([a], [b]) => a - b).map(([stageIndex, m]) => ({ stageIndex, ...m })),
        agents
      }
    })

    // Ready, with the agents lost so far (the pipeline goes on without them).
    const currentStatus = Effect.gen(function*() {
      const s = yield* Ref.get(status)
      const ready = yield* Deferred.poll(started)
      if (s._tag !== "Ready" || ready._tag === "None") return s
      const up = yield* Effect.option(ready.value)
      if (Option.isNone(up)) return s
      const alive = new Set((yield* up.value.pipeline.alive).map((a) => a.node.address))
      const lost = up.value.pipeline.agents.map((a) => a.node.address).filter((address) => !alive.has(address))
      return lost.length === 0 ? s : { _tag: "Ready" as const, lostAgents: lost }
    })

    return Server.of({
      status: currentStatus,
      ready: Deferred.await(started).pipe(Effect.map((s) => s.info)),
      generate,
      formatChat: (messages) =>
        Effect.flatMap(current, ({ pipeline }) => Effect.orDie(pipeline.vocabulary.formatChat(messages))),
      metrics: snapshot
    })
  })

/** A Server over the Orchestrator in context: its pipeline lives as long as the layer. */
export const layer = (options: ServeOptions): Layer.Layer<Server, never, Orchestrator> => Layer.scoped(Server, make(options))
