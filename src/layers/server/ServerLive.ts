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
import type { ChatRenderError } from "../../services/Tokenizer.js"
import * as Admission from "./Admission.js"
import * as KvSizing from "./KvSizing.js"
import * as MetricsRecorder from "./MetricsRecorder.js"
import * as PipelineLifecycle from "./PipelineLifecycle.js"
import * as PromptCacheKeeper from "./PromptCacheKeeper.js"
import { errorWords } from "./Revival.js"

export const make = (options: ServeOptions) =>
  Effect.gen(function* () {
    const orchestrator = yield* Orchestrator
    const parallel = options.parallel ?? 4
    const queueLimit = options.queueLimit ?? 64
    if (
      options.maxPromptTokens !== undefined &&
      !(Number.isSafeInteger(options.maxPromptTokens) && options.maxPromptTokens >= 1)
    ) {
      return yield* Effect.dieMessage(`maxPromptTokens must be a positive whole number, got ${options.maxPromptTokens}`)
    }
    // Prompts are tokenized and chats rendered on a worker thread when one is provided (the serve API and command
    // provide it: PromptTokenizer.ts), else in this thread over the pipeline's vocabulary; either way bounded.
    const offThread = yield* Effect.serviceOption(PromptTokenizer)
    const promptTokenizer = (pipeline: Pipeline) => Option.getOrElse(offThread, () => inThread(pipeline.vocabulary))
    const maxPromptTokens = (pipeline: Pipeline) => options.maxPromptTokens ?? Math.min(pipeline.model.maxSeqLen, 32768)
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
    if (!Number.isSafeInteger(parallel) || parallel < 1)
      return yield* Effect.dieMessage(`parallel must be a positive whole number, got ${parallel}`)
    const log = options.log ?? ((line: string) => void process.stderr.write(`${line}\n`))
    const recorder = MetricsRecorder.make()
    const metrics = recorder.counts
    // the prompt cache: what the agents hold, what each run adopts and keeps (PromptCacheKeeper.ts)
    const keeper: PromptCacheKeeper.PromptCacheKeeper = yield* PromptCacheKeeper.make(
      options.promptCache,
      (): Pipeline | undefined => lifecycle.live()?.pipeline
    )
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
          if (update._tag === "WeightsDelivery" && update.totalBytes > 0 && update.sentBytes === update.totalBytes) {
            log(
              `stage ${update.stageIndex} on ${update.address}: ${(update.totalBytes / 2 ** 20).toFixed(1)} MiB of ` +
                `weights ${update.source === "Hub" ? "fetched from the hub" : "sent"}`
            )
          }
        }),
      tooLong,
      forgetCache: keeper.forget,
      counts: metrics,
      log
    })
    const { current } = lifecycle

    const validate = (request: ServeRequest, maxSeqLen: number, prompt: ReadonlyArray<number>, vocabSize: number) => {
      const maxTokens = request.maxTokens ?? 128
      // The prompt, max tokens, token ids, context and sampling fields: the same rules and words as `swactor run`.
      const problem = serveRequestProblem(
        { text: request.prompt, tokens: prompt, maxTokens, sampling: request.sampling },
        { contextLength: maxSeqLen, vocabSize }
      )
      return problem === undefined ? Effect.succeed(maxTokens) : Effect.fail(new BadServeRequest({ message: problem }))
    }

    /**
     * Requests between arrival and their run (tokenizing, checks, admission), not queued: a run started now tells the
     * stages how many are right behind it (RunRequest.arriving), so requests sent together prefill together.
     */
    let arriving = 0
    const generate = (request: ServeRequest): Stream.Stream<ServeEvent, ServeError> =>
      Stream.unwrapScoped(
        Effect.gen(function* () {
          const receivedAt = request.receivedAt ?? performance.now()
          arriving++
          let here = true
          const leave = () => {
            if (here) arriving--
            here = false
          }
          yield* Effect.addFinalizer(() => Effect.sync(leave))
          const { pipeline } = yield* current
          const limit = maxPromptTokens(pipeline)
          const prompt =
            typeof request.prompt === "string"
              ? yield* promptTokenizer(pipeline).tokenize(request.prompt, limit).pipe(Effect.mapError(promptRefused))
              : request.prompt.length > limit
                ? yield* promptRefused(new PromptTooLong({ tokens: request.prompt.length, atLeast: false, limit }))
                : request.prompt
          const maxTokens = yield* validate(request, pipeline.model.maxSeqLen, prompt, pipeline.vocabulary.vocabSize)
          const contextLength = runContextLength(pipeline.model.maxSeqLen, prompt.length, maxTokens)
          if (sizing.bytes(contextLength) > sizing.budget()) return yield* tooLong(contextLength)
          // Prompt cache: the longest held prefix, now the most recently used entry, so admission's eviction (which may
          // need its memory) takes it last; in use from admission on (runAdmitted)
          const match = keeper.match(prompt)
          const queuedAt = performance.now()
          const ticket = yield* admission
            .enter(contextLength)
            .pipe(Effect.tapError(() => Effect.sync(() => metrics.refused++)))
          const queued: ReadonlyArray<ServeEvent> = ticket.admitted ? [] : [{ _tag: "Queued", ahead: ticket.ahead }]
          if (!ticket.admitted) leave() // waits for memory: not right behind anyone
          const run = runAdmitted(
            prompt,
            maxTokens,
            request,
            { receivedAt, queuedAt, leave },
            contextLength,
            ticket,
            match
          )
          return Stream.concat(Stream.fromIterable(queued), Stream.unwrap(Effect.as(ticket.wait, run)))
        })
      )

    const runAdmitted = (
      prompt: ReadonlyArray<number>,
      maxTokens: number,
      request: ServeRequest,
      arrival: { readonly receivedAt: number; readonly queuedAt: number; readonly leave: () => void },
      contextLength: number,
      ticket: { readonly onRelease: (f: () => void) => void; readonly release: () => void },
      match: PromptCacheMatch | undefined
    ): Stream.Stream<ServeEvent, ServeError> =>
      Stream.unwrapScoped(
        Effect.gen(function* () {
          const { pipeline } = yield* current
          const admittedAt = performance.now()
          arrival.leave()
          const behind = arriving
          let readyAt = admittedAt
          let firstAt: number | undefined
          // Prompt cache: adopt `match` if admission left it (in use until the run ends: never evicted); keep this run's
          // KV as a new entry once it completes (added when its admission is released, its memory then the entry's),
          // else drop it.
          const cache = yield* keeper.forRun(match, pipeline)
          const generatedIds: Array<number> = []
          let keptTokens = 0
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
          ticket.onRelease(() => {
            const kept = keptTokens > 0 ? keptTokens : events.stoppedByText() ? prompt.length : 0
            cache.keep(
              [...prompt, ...generatedIds].slice(0, kept),
              sizing.bytes(contextLength),
              () => admission.state().used + keeper.held.bytes() > sizing.budget()
            )
          })
          // a stop string stops the run; at an end-of-generation token it ends by itself, and its KV may be kept
          let stopRun = true
          metrics.inFlight++
          lifecycle.touch()
          let outcome: "completed" | "cancelled" | "failed" = "cancelled"
          yield* Effect.addFinalizer(() =>
            Effect.sync(() => {
              metrics.inFlight--
              metrics[outcome]++
              lifecycle.touch()
            })
          )
          metrics.promptTokens += prompt.length
          const onUpdate = (update: RunUpdate): ReadonlyArray<ServeEvent> => {
            if (update._tag === "StageReady") readyAt = performance.now()
            if (update._tag === "Token" && firstAt === undefined) firstAt = performance.now()
            if (update._tag === "PromptCached") cache.promptCached(update.cachedTokens)
            if (update._tag === "Finished") {
              // torn down on every stage: its KV is an entry now (before the client hears Done and sends its next turn)
              keptTokens = update.summary.promptCache?.keptTokens ?? 0
              ticket.release()
            }
            // a stage was replaced: what the agents hold no longer covers the pipeline
            if (update._tag === "Recovering" && keeper.enabled) keeper.forget()
            if (events.finished()) return []
            if (update._tag === "Token" && update.token.tokenId >= 0) {
              metrics.completionTokens++
              generatedIds.push(update.token.tokenId)
              if (cache.keepId !== undefined && pipeline.vocabulary.isEndOfGeneration(update.token.tokenId))
                stopRun = false
            }
            recorder.record(update, () =>
              firstAt === undefined ? undefined : { ...arrival, admittedAt, readyAt, firstAt }
            )
            const out = events.events(update)
            if (events.finished()) outcome = "completed"
            return out
          }
          const admitted: ServeEvent = {
            _tag: "Admitted",
            promptTokens: prompt.length,
            queuedMillis: admittedAt - arrival.queuedAt
          }
          return Stream.concat(
            Stream.make(admitted),
            pipeline
              .run({
                prompt,
                maxTokens,
                ...(request.sampling === undefined ? {} : { sampling: request.sampling }),
                ...(cache.keepId === undefined
                  ? {}
                  : {
                      promptCache: { keep: cache.keepId, ...(cache.adopt === undefined ? {} : { adopt: cache.adopt }) }
                    }),
                ...(behind > 0 ? { arriving: behind } : {})
              })
              .pipe(
                Stream.mapError((error): ServeError =>
                  error._tag === "InvalidRequest"
                    ? new BadServeRequest({ message: error.message })
                    : new PipelineFaulted({ message: errorWords(error) })
                ),
                Stream.tapError(() => Effect.sync(() => (outcome = "failed"))),
                Stream.tap(observePlan),
                Stream.mapConcat(onUpdate),
                Stream.takeUntil((event) => event._tag === "Done" && stopRun)
              )
          )
        })
      )

    return Server.of({
      status: lifecycle.status,
      ready: lifecycle.ready,
      generate,
      // a chat being rendered is a request on its way as well (its generate follows)
      formatChat: (messages, tools) =>
        Effect.acquireUseRelease(
          Effect.sync(() => arriving++),
          () =>
            Effect.flatMap(current, ({ pipeline }) =>
              promptTokenizer(pipeline)
                .formatChat(messages, maxPromptTokens(pipeline), tools)
                .pipe(Effect.mapError(promptRefused))
            ),
          () => Effect.sync(() => arriving--)
        ),
      metrics: recorder.snapshot({
        admission: admission.state,
        pipeline: () => lifecycle.live()?.pipeline,
        promptCache: keeper.metrics,
        kvBudgetBytes: sizing.budget
      })
    })
  })

/** A Server over the Orchestrator in context: its pipeline lives as long as the layer. */
export const layer = (options: ServeOptions): Layer.Layer<Server, never, Orchestrator> =>
  Layer.scoped(Server, make(options))
