/**
 * The Server over the Orchestrator: one warm pipeline (PipelineLifecycle.ts), admission by KV bytes per stage
 * (Admission.ts over KvSizing.ts), and each request its own run on the pipeline: its prompt tokenized and checked
 * (services/RequestChecks.ts), its KV taken from and kept in the prompt cache, its run's updates streamed as events
 * (services/ServeEvents.ts) and counted (MetricsRecorder.ts).
 */
import { Effect, Layer, Option, Stream } from "effect"
import { Orchestrator, type Pipeline, type RunUpdate } from "../../services/Orchestrator.js"
import {
  BadServeRequest,
  PipelineFaulted,
  Server,
  type ServeError,
  type ServeEvent,
  type ServeOptions,
  type ServeRequest,
  ServerLoading
} from "../../services/Server.js"
import type { PromptCacheMatch } from "../../services/PromptCacheIndex.js"
import { makeServeEvents } from "../../services/ServeEvents.js"
import { serveRequestProblem } from "../../services/RequestChecks.js"
import { runContextLength } from "../orchestrator/RunWorld.js"
import { inThread, PromptTokenizer, PromptTooLong, type TokenizerUnavailable } from "./PromptTokenizer.js"
import type { ChatMessage, ChatRenderError } from "../../services/Tokenizer.js"
import type { ChatToolOptions } from "../../services/Tools.js"
import * as Admission from "./Admission.js"
import * as KvSizing from "./KvSizing.js"
import * as MetricsRecorder from "./MetricsRecorder.js"
import * as PipelineLifecycle from "./PipelineLifecycle.js"
import * as PromptCacheKeeper from "./PromptCacheKeeper.js"
import { errorWords } from "./Revival.js"
import type { SpeculativeOptions } from "../../services/Speculation.js"

/** The refusal of a prompt that could not be tokenized, rendered or is over the limit. */
const promptRefused = (
  error: PromptTooLong | TokenizerUnavailable | ChatRenderError
): BadServeRequest | ServerLoading =>
  error._tag === "ChatRenderError"
    ? new BadServeRequest({ message: error.message })
    : error._tag === "PromptTooLong"
      ? new BadServeRequest({
          message:
            `prompt too long: ${
              error.atLeast
                ? `at least ${error.tokens} prompt tokens (from the text's length alone, ` + `not tokenized)`
                : `${error.tokens} prompt tokens`
            } are over the limit of ${error.limit} prompt tokens ` + `(swactor serve --max-prompt-tokens)`
        })
      : new ServerLoading({ message: `the prompt tokenizer is not available: ${error.message}` })

/** The prompt, max tokens, token ids, context and sampling fields: the same rules and words as `swactor run`. */
const validate = (request: ServeRequest, maxSeqLen: number, prompt: ReadonlyArray<number>, vocabSize: number) => {
  const maxTokens = request.maxTokens ?? 128
  const problem = serveRequestProblem(
    { text: request.prompt, tokens: prompt, maxTokens, sampling: request.sampling },
    { contextLength: maxSeqLen, vocabSize }
  )
  return problem === undefined ? Effect.succeed(maxTokens) : Effect.fail(new BadServeRequest({ message: problem }))
}

/** A stage's weights arrived whole: say so in the log. */
const logDelivered = (log: (line: string) => void, update: RunUpdate) => {
  if (update._tag === "WeightsDelivery" && update.totalBytes > 0 && update.sentBytes === update.totalBytes) {
    log(
      `stage ${update.stageIndex} on ${update.address}: ${(update.totalBytes / 2 ** 20).toFixed(1)} MiB of ` +
        `weights ${update.source === "Hub" ? "fetched from the hub" : "sent"}`
    )
  }
}

/** What every request of the server shares. */
interface Served {
  readonly recorder: ReturnType<typeof MetricsRecorder.make>
  readonly metrics: ReturnType<typeof MetricsRecorder.make>["counts"]
  readonly keeper: PromptCacheKeeper.PromptCacheKeeper
  readonly sizing: ReturnType<typeof KvSizing.make>
  readonly admission: Admission.Admission
  readonly lifecycle: Effect.Effect.Success<ReturnType<typeof PipelineLifecycle.make>>
  readonly tooLong: (contextLength: number) => BadServeRequest
  readonly observePlan: (update: RunUpdate) => Effect.Effect<void>
  readonly promptTokenizer: (pipeline: Pipeline) => PromptTokenizer["Type"]
  readonly maxPromptTokens: (pipeline: Pipeline) => number
  /**
   * Requests between arrival and their run (tokenizing, checks, admission), not queued: a run started now tells the
   * stages how many are right behind it (RunRequest.arriving), so requests sent together prefill together.
   */
  readonly arriving: { count: number }
  readonly speculative: SpeculativeOptions | undefined
}

/** A request's arrival: when it came, when it queued, and its leaving the arriving count. */
interface Arrival {
  readonly receivedAt: number
  readonly queuedAt: number
  readonly leave: () => void
}

/** A request that passed its checks and entered admission. */
interface AdmittedRequest {
  readonly prompt: ReadonlyArray<number>
  readonly maxTokens: number
  readonly request: ServeRequest
  readonly arrival: Arrival
  readonly contextLength: number
  readonly ticket: { readonly onRelease: (f: () => void) => void; readonly release: () => void }
  readonly match: PromptCacheMatch | undefined
}

/** The request's prompt as tokens, within the limit. */
const promptTokensOf = (served: Served, pipeline: Pipeline, request: ServeRequest) => {
  const limit = served.maxPromptTokens(pipeline)
  return typeof request.prompt === "string"
    ? served.promptTokenizer(pipeline).tokenize(request.prompt, limit).pipe(Effect.mapError(promptRefused))
    : request.prompt.length > limit
      ? promptRefused(new PromptTooLong({ tokens: request.prompt.length, atLeast: false, limit }))
      : Effect.succeed(request.prompt)
}

const generate = (served: Served, request: ServeRequest): Stream.Stream<ServeEvent, ServeError> =>
  Stream.unwrapScoped(
    Effect.gen(function* () {
      const { admission, keeper, metrics, sizing } = served
      const receivedAt = request.receivedAt ?? performance.now()
      served.arriving.count++
      let here = true
      const leave = () => {
        if (here) served.arriving.count--
        here = false
      }
      yield* Effect.addFinalizer(() => Effect.sync(leave))
      const { pipeline } = yield* served.lifecycle.current
      const prompt = yield* promptTokensOf(served, pipeline, request)
      const maxTokens = yield* validate(request, pipeline.model.maxSeqLen, prompt, pipeline.vocabulary.vocabSize)
      const contextLength = runContextLength(pipeline.model.maxSeqLen, prompt.length, maxTokens)
      if (sizing.bytes(contextLength) > sizing.budget()) return yield* served.tooLong(contextLength)
      // Prompt cache: the longest held prefix, now the most recently used entry, so admission's eviction (which may
      // need its memory) takes it last; in use from admission on (runAdmitted)
      const match = keeper.match(prompt)
      const queuedAt = performance.now()
      const ticket = yield* admission
        .enter(contextLength)
        .pipe(Effect.tapError(() => Effect.sync(() => metrics.refused++)))
      const queued: ReadonlyArray<ServeEvent> = ticket.admitted ? [] : [{ _tag: "Queued", ahead: ticket.ahead }]
      if (!ticket.admitted) leave() // waits for memory: not right behind anyone
      const run = runAdmitted(served, {
        prompt,
        maxTokens,
        request,
        arrival: { receivedAt, queuedAt, leave },
        contextLength,
        ticket,
        match
      })
      return Stream.concat(Stream.fromIterable(queued), Stream.unwrap(Effect.as(ticket.wait, run)))
    })
  )

/** One admitted run as it goes: its times, its tokens, what it kept and how it ended. */
interface RunProgress {
  readonly admittedAt: number
  readyAt: number
  firstAt: number | undefined
  readonly generatedIds: Array<number>
  keptTokens: number
  /** a stop string stops the run; at an end-of-generation token it ends by itself, and its KV may be kept */
  stopRun: boolean
  outcome: "completed" | "cancelled" | "failed"
}

/** One run's update: timings, the prompt cache, the counters, and the events it gives the client. */
const onUpdate = (
  served: Served,
  run: AdmittedRequest,
  pipeline: Pipeline,
  cache: PromptCacheKeeper.RunCache,
  events: ReturnType<typeof makeServeEvents>,
  progress: RunProgress,
  update: RunUpdate
): ReadonlyArray<ServeEvent> => {
  const { keeper, metrics, recorder } = served
  if (update._tag === "StageReady") progress.readyAt = performance.now()
  if (update._tag === "Token" && progress.firstAt === undefined) progress.firstAt = performance.now()
  if (update._tag === "PromptCached") cache.promptCached(update.cachedTokens)
  if (update._tag === "Finished") {
    // torn down on every stage: its KV is an entry now (before the client hears Done and sends its next turn)
    progress.keptTokens = update.summary.promptCache?.keptTokens ?? 0
    run.ticket.release()
  }
  // a stage was replaced: what the agents hold no longer covers the pipeline
  if (update._tag === "Recovering" && keeper.enabled) keeper.forget()
  if (events.finished()) return []
  if (update._tag === "Token" && update.token.tokenId >= 0) {
    metrics.completionTokens++
    progress.generatedIds.push(update.token.tokenId)
    if (cache.keepId !== undefined && pipeline.vocabulary.isEndOfGeneration(update.token.tokenId))
      progress.stopRun = false
  }
  recorder.record(update, () =>
    progress.firstAt === undefined
      ? undefined
      : { ...run.arrival, admittedAt: progress.admittedAt, readyAt: progress.readyAt, firstAt: progress.firstAt }
  )
  const out = events.events(update)
  if (events.finished()) progress.outcome = "completed"
  return out
}

/** What the pipeline is asked to run: the prompt, sampling, the prompt cache's ids and who is right behind. */
const runRequestOf = (
  run: AdmittedRequest,
  cache: PromptCacheKeeper.RunCache,
  behind: number,
  speculative: SpeculativeOptions | undefined
) => ({
  prompt: run.prompt,
  ...(speculative === undefined ? {} : { speculative }),
  maxTokens: run.maxTokens,
  ...(run.request.sampling === undefined ? {} : { sampling: run.request.sampling }),
  ...(cache.keepId === undefined
    ? {}
    : {
        promptCache: { keep: cache.keepId, ...(cache.adopt === undefined ? {} : { adopt: cache.adopt }) }
      }),
  ...(behind > 0 ? { arriving: behind } : {})
})

const runAdmitted = (served: Served, run: AdmittedRequest): Stream.Stream<ServeEvent, ServeError> =>
  Stream.unwrapScoped(
    Effect.gen(function* () {
      const { admission, keeper, lifecycle, metrics, sizing } = served
      const { prompt, request } = run
      const { pipeline } = yield* lifecycle.current
      const admittedAt = performance.now()
      run.arrival.leave()
      const behind = served.arriving.count
      const progress: RunProgress = {
        admittedAt,
        readyAt: admittedAt,
        firstAt: undefined,
        generatedIds: [],
        keptTokens: 0,
        stopRun: true,
        outcome: "cancelled"
      }
      // Prompt cache: adopt `match` if admission left it (in use until the run ends: never evicted); keep this run's
      // KV as a new entry once it completes (added when its admission is released, its memory then the entry's),
      // else drop it.
      const cache = yield* keeper.forRun(run.match, pipeline)
      const events = makeServeEvents({
        prompt,
        vocabulary: pipeline.vocabulary,
        stop: request.stop ?? [],
        logprobs: request.sampling?.logprobs !== undefined,
        cachedTokens: cache.cachedTokens
      })
      // Ended by a stop string: the run is stopped, so no summary says what the stages kept; but every stage had
      // prefilled the whole prompt before the first token was sampled, and an entry holds prompt positions only
      // (NodeAgent), so the entry is the prompt. A stage that kept nothing only means a full prefill (PC4).
      run.ticket.onRelease(() => {
        const kept = progress.keptTokens > 0 ? progress.keptTokens : events.stoppedByText() ? prompt.length : 0
        cache.keep(
          [...prompt, ...progress.generatedIds].slice(0, kept),
          sizing.bytes(run.contextLength),
          () => admission.state().used + keeper.held.bytes() > sizing.budget()
        )
      })
      metrics.inFlight++
      lifecycle.touch()
      yield* Effect.addFinalizer(() =>
        Effect.sync(() => {
          metrics.inFlight--
          metrics[progress.outcome]++
          lifecycle.touch()
        })
      )
      metrics.promptTokens += prompt.length
      const admitted: ServeEvent = {
        _tag: "Admitted",
        promptTokens: prompt.length,
        queuedMillis: admittedAt - run.arrival.queuedAt
      }
      return Stream.concat(
        Stream.make(admitted),
        pipeline.run(runRequestOf(run, cache, behind, served.speculative)).pipe(
          Stream.mapError((error): ServeError =>
            error._tag === "InvalidRequest"
              ? new BadServeRequest({ message: error.message })
              : new PipelineFaulted({ message: errorWords(error) })
          ),
          Stream.tapError(() => Effect.sync(() => (progress.outcome = "failed"))),
          Stream.tap(served.observePlan),
          Stream.mapConcat((update) => onUpdate(served, run, pipeline, cache, events, progress, update)),
          Stream.takeUntil((event) => event._tag === "Done" && progress.stopRun)
        )
      )
    })
  )

/** The options' checks: a bad number is a defect (the command checked its flags). */
const checkOptions = (options: ServeOptions, parallel: number) =>
  Effect.gen(function* () {
    if (
      options.maxPromptTokens !== undefined &&
      !(Number.isSafeInteger(options.maxPromptTokens) && options.maxPromptTokens >= 1)
    ) {
      return yield* Effect.dieMessage(`maxPromptTokens must be a positive whole number, got ${options.maxPromptTokens}`)
    }
    if (!Number.isSafeInteger(parallel) || parallel < 1)
      return yield* Effect.dieMessage(`parallel must be a positive whole number, got ${parallel}`)
  })

/** Admission by KV bytes per stage: the sizing, the queue, the refusal of a context too long, and the plans it follows. */
const admissionOf = (
  options: ServeOptions,
  parallel: number,
  queueLimit: number,
  keeper: PromptCacheKeeper.PromptCacheKeeper
) => {
  const sizing = KvSizing.make(options.kvBudgetBytes, parallel)
  const admission = Admission.make(sizing, parallel, queueLimit, keeper.held)
  const tooLong = (contextLength: number) =>
    new BadServeRequest({
      message:
        `context too long: ${contextLength} tokens need ${sizing.bytes(contextLength)} bytes of KV cache per stage, ` +
        `the budget is ${sizing.budget()}`
    })
  /** A run was planned: when its heaviest stage holds a different number of blocks, the sizes change. */
  const observePlan = (update: RunUpdate) =>
    Effect.suspend(() =>
      update._tag !== "Planned" || update.stages.length === 0 || !sizing.planned(update.stages)
        ? Effect.void
        : admission.reshaped(tooLong)
    )
  return { sizing, admission, tooLong, observePlan }
}

/** A chat rendered for a request on its way (counted as arriving: its generate follows). */
const formatChat = (served: Served, messages: ReadonlyArray<ChatMessage>, tools: ChatToolOptions | undefined) =>
  Effect.acquireUseRelease(
    Effect.sync(() => served.arriving.count++),
    () =>
      Effect.flatMap(served.lifecycle.current, ({ pipeline }) =>
        served
          .promptTokenizer(pipeline)
          .formatChat(messages, served.maxPromptTokens(pipeline), tools)
          .pipe(Effect.mapError(promptRefused))
      ),
    () => Effect.sync(() => served.arriving.count--)
  )

export const make = (options: ServeOptions) =>
  Effect.gen(function* () {
    const orchestrator = yield* Orchestrator
    const parallel = options.parallel ?? 4
    const queueLimit = options.queueLimit ?? 64
    // Prompts are tokenized and chats rendered on a worker thread when one is provided (the serve API and command
    // provide it: PromptTokenizer.ts), else in this thread over the pipeline's vocabulary; either way bounded.
    const offThread = yield* Effect.serviceOption(PromptTokenizer)
    yield* checkOptions(options, parallel)
    const log = options.log ?? ((line: string) => void process.stderr.write(`${line}\n`))
    const recorder = MetricsRecorder.make()
    const metrics = recorder.counts
    // the prompt cache: what the agents hold, what each run adopts and keeps (PromptCacheKeeper.ts)
    const keeper: PromptCacheKeeper.PromptCacheKeeper = yield* PromptCacheKeeper.make(
      options.promptCache,
      (): Pipeline | undefined => lifecycle.live()?.pipeline
    )
    const admitted = admissionOf(options, parallel, queueLimit, keeper)
    const { admission, sizing, tooLong } = admitted
    // every run's plan passes here: the admission's sizes follow it, and the console's plan (MetricsRecorder.ts)
    const observePlan = (update: RunUpdate) =>
      Effect.zipRight(
        Effect.sync(() => recorder.observePlan(update)),
        admitted.observePlan(update)
      )
    const lifecycle = yield* PipelineLifecycle.make({
      options,
      orchestrator,
      parallel,
      kv: sizing,
      admission,
      observePlan,
      observeSetup: (update) =>
        Effect.sync(() => {
          recorder.observeSetup(update)
          logDelivered(log, update)
        }),
      tooLong,
      forgetCache: keeper.forget,
      counts: metrics,
      log
    })
    const served: Served = {
      recorder,
      metrics,
      keeper,
      sizing,
      admission,
      lifecycle,
      tooLong,
      observePlan,
      promptTokenizer: (pipeline) => Option.getOrElse(offThread, () => inThread(pipeline.vocabulary)),
      maxPromptTokens: (pipeline) => options.maxPromptTokens ?? Math.min(pipeline.model.maxSeqLen, 32768),
      arriving: { count: 0 },
      speculative: options.speculative
    }
    return Server.of({
      status: lifecycle.status,
      ready: lifecycle.ready,
      generate: (request) => generate(served, request),
      // a chat being rendered is a request on its way as well (its generate follows)
      formatChat: (messages, tools) => formatChat(served, messages, tools),
      metrics: recorder.snapshot({
        admission: admission.state,
        pipeline: () => lifecycle.live()?.pipeline,
        promptCache: keeper.metrics,
        kvBudgetBytes: sizing.budget,
        sizing
      })
    })
  })

/** A Server over the Orchestrator in context: its pipeline lives as long as the layer. */
export const layer = (options: ServeOptions): Layer.Layer<Server, never, Orchestrator> =>
  Layer.scoped(Server, make(options))
