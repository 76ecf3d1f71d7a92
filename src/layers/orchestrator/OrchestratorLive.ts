/**
 * The orchestrator over real services, in three parts (src/layers/orchestrator/):
 *
 * - `PipelineSetup`: validate → model facts → tokenizer → agents → control links → membership pool → data
 *   listener, once; the warm pipeline outlives its runs.
 * - `RunWorld`: one run on a warm pipeline: plan, run FSM actor, the commands it emits executed, the events
 *   the world produces fed back, the lifecycle turned into updates.
 * - `RunReport`: pure: stage fault reports as FSM reasons, faults in words, updates, the summary.
 *
 * `run(request)` is a pipeline of its own and one run on it (agents started and stopped with the stream);
 * `pipeline(options)` keeps one warm for any number of runs. Interrupting a run's stream is an OperatorStop:
 * the run is stopped and fully torn down before the interruption completes.
 */
import { Context, Deferred, Effect, Fiber, Layer, Mailbox, Option, Scope, Stream } from "effect"
import { AgentControl, DataPlane } from "../../services/AgentLinks.js"
import { Membership } from "../../services/Membership.js"
import {
  AgentPool,
  type GenerateError,
  type GenerateRequest,
  InvalidRequest,
  Orchestrator,
  type Pipeline,
  type PipelineMember,
  type PipelineOptions,
  type RunRequest,
  type RunUpdate
} from "../../services/Orchestrator.js"
import { alignUp } from "../../domain/plan.js"
import { Tokenizer } from "../../services/Tokenizer.js"
import { ModelCatalog } from "../../services/ModelCatalog.js"
import { checkedDraft } from "./DraftModelCheck.js"
import { openPipeline, type WarmPipeline } from "./PipelineSetup.js"
import { generateRecovering } from "./Recovery.js"
import { emptyPromptMessage, generationProblem, isEmptyPrompt, maxTokensProblem } from "../../services/RequestChecks.js"

type Services = Tokenizer | Membership | AgentControl | DataPlane | AgentPool | ModelCatalog

/**
 * How long an operator stop waits for a run to stop its stages itself (they answer in milliseconds) before the run
 * is interrupted: its provision streams close, which stops its stages on every agent that still listens, and
 * its scopes close (a one-shot run's agents stopped). A stalled agent, a recovery attempt or a pipeline still
 * starting up is never waited for longer than this.
 */
const operatorStopGrace = "1 second"

/**
 * `effect`, interrupted as soon as `stop` completes: the waits of a run driver outside a run (setting the pipeline
 * up, a recovery's pause) have nothing to stop gracefully, so an operator stop ends them at once.
 */
const interruptedOnStop =
  (stop: Deferred.Deferred<void>) =>
  <A, E, R>(effect: Effect.Effect<A, E, R>) =>
    Effect.raceFirst(effect, Effect.zipRight(Deferred.await(stop), Effect.interrupt))

/**
 * A run's updates as a stream: `drive` runs in its own fiber; closing the stream early (consumer done or
 * interrupted) is an operator stop, and the stream's end waits for the teardown: `stop` completes (a run stops its
 * stages, see RunWorld), and a driver still going after `operatorStopGrace` is interrupted (its scopes close).
 */
const runStream = (
  drive: (
    updates: Mailbox.Mailbox<RunUpdate, GenerateError>,
    stop: Deferred.Deferred<void>
  ) => Effect.Effect<void, GenerateError>
): Stream.Stream<RunUpdate, GenerateError> =>
  Stream.unwrapScoped(
    Effect.gen(function* () {
      const updates = yield* Mailbox.make<RunUpdate, GenerateError>()
      const stopRequested = yield* Deferred.make<void>()
      const driver = yield* drive(updates, stopRequested).pipe(
        Effect.exit,
        Effect.flatMap((exit) => updates.done(exit)),
        Effect.forkDaemon
      )
      yield* Effect.addFinalizer(() =>
        Effect.gen(function* () {
          yield* Deferred.succeed(stopRequested, undefined)
          // An interruptible region: a finalizer is uninterruptible, and there the timeout could not interrupt the
          // wait it races (it would wait for the driver however long it takes, as a 20 s timeout once did).
          const finished = yield* Effect.interruptible(Fiber.await(driver)).pipe(
            Effect.timeout(operatorStopGrace),
            Effect.option
          )
          if (Option.isNone(finished)) yield* Fiber.interrupt(driver)
        })
      )
      return Mailbox.toStream(updates)
    })
  )

const pipelineOf = (warm: WarmPipeline, context: Context.Context<Services>): Pipeline => {
  // Through the current link: a node that rejoined has a new one (new pid).
  const agentsNow = () =>
    warm.agents.nodes.map((node) => {
      const link = warm.linkOf(node.nodeId)
      return { node, pid: link.hello.pid, dataAddress: link.hello.dataAddress, capacity: link.capacity }
    })
  return {
    model: warm.facts,
    vocabulary: warm.vocabulary,
    stageCount: warm.stageCount,
    agents: agentsNow(),
    alive: Effect.map(warm.pool.status, (status) =>
      agentsNow().filter((a) => status.get(a.node.nodeId)?._tag !== "Lost")
    ),
    members: Effect.map(warm.pool.status, (status) =>
      agentsNow().map((agent): PipelineMember => {
        const s = status.get(agent.node.nodeId)
        const exited = warm.agents.processRunning !== undefined && !warm.agents.processRunning(agent.node)
        return s?._tag === "Up"
          ? { agent, state: "up", detail: "", exited }
          : s?._tag === "Lost"
            ? { agent, state: "lost", detail: s.lost.reason, exited }
            : { agent, state: "waiting", detail: s?.lastError ?? "never probed", exited }
      })
    ),
    localAgents: warm.agents.processRunning !== undefined,
    run: (request: RunRequest) =>
      runStream((updates, stop) => generateRecovering(warm, request, updates, stop).pipe(Effect.provide(context))),
    dropCached: (entries, all) =>
      Effect.forEach(
        warm.agents.nodes,
        (node) =>
          (warm.linkOf(node.nodeId).dropCached?.(entries, all) ?? Effect.void).pipe(
            Effect.timeout("5 seconds"),
            Effect.ignore
          ),
        { concurrency: "unbounded", discard: true }
      ),
    lost: warm.pool.firstLost,
    placed: { explanation: warm.placementExplanation, layout: warm.layout, contextTokens: warm.contextTokens },
    activeRuns: () => warm.activeRuns.count,
    markLost: warm.pool.markLost
  }
}

export const make = Effect.gen(function* () {
  // Without the Scope the layer was built in (when there is one): a pipeline lives in its caller's scope, not the layer's.
  const context = Context.omit(Scope.Scope)(yield* Effect.context<Services>()) as Context.Context<Services>

  const pipeline = (
    options: PipelineOptions,
    progress: (update: RunUpdate) => Effect.Effect<void> = () => Effect.void
  ) =>
    openPipeline(options, progress).pipe(
      Effect.map((warm) => pipelineOf(warm, context)),
      Effect.provide(context)
    )

  const run = (request: GenerateRequest): Stream.Stream<RunUpdate, GenerateError> =>
    runStream((updates, stop) =>
      Effect.gen(function* () {
        const requestStart = performance.now()
        const maxTokens = request.maxTokens ?? 128
        if (isEmptyPrompt(request.prompt)) return yield* new InvalidRequest({ message: emptyPromptMessage })
        const badMaxTokens = maxTokensProblem(maxTokens, "maxTokens")
        if (badMaxTokens !== undefined) return yield* new InvalidRequest({ message: badMaxTokens })
        // a draft model that cannot draft for this model is refused before any agent starts
        yield* checkedDraft(request.model, request.speculative)
        // An operator stop while the pipeline is set up (agents starting, weights on their way, nodes awaited)
        // interrupts the setup at once; what it started stops with this scope.
        const warm = yield* openPipeline(
          {
            model: request.model,
            maxTokens,
            ...(request.stages === undefined ? {} : { stages: request.stages }),
            ...(request.threads === undefined ? {} : { threads: request.threads }),
            ...(request.readinessTimeout === undefined ? {} : { readinessTimeout: request.readinessTimeout }),
            ...(request.heartbeat === undefined ? {} : { heartbeat: request.heartbeat }),
            ...(request.spares === undefined ? {} : { spares: request.spares }),
            ...(request.placement === undefined ? {} : { placement: request.placement }),
            ...(request.deliverWeights === undefined ? {} : { deliverWeights: request.deliverWeights }),
            ...(request.tokenLoop === undefined ? {} : { tokenLoop: request.tokenLoop }),
            ...(request.prefillThreads === undefined ? {} : { prefillThreads: request.prefillThreads }),
            // Placement budgets KV for this run's context: every prompt token covers at least one character (+ BOS).
            contextTokens: alignUp(request.prompt.length + 1 + maxTokens + 1, 256)
          },
          (update) => updates.offer(update).pipe(Effect.asVoid),
          (facts, vocabulary) => {
            // The prompt against the model before any agent starts (the same check runs again in generateRecovering).
            const tokens = typeof request.prompt === "string" ? vocabulary.tokenize(request.prompt) : request.prompt
            const problem = generationProblem({
              text: request.prompt,
              tokens,
              maxTokens,
              contextLength: facts.maxSeqLen,
              vocabSize: vocabulary.vocabSize,
              maxTokensField: "maxTokens"
            })
            return problem === undefined ? Effect.void : Effect.fail(new InvalidRequest({ message: problem }))
          }
        ).pipe(interruptedOnStop(stop))
        yield* generateRecovering(
          warm,
          {
            prompt: request.prompt,
            maxTokens,
            ...(request.sampling === undefined ? {} : { sampling: request.sampling }),
            ...(request.tokenTimeout === undefined ? {} : { tokenTimeout: request.tokenTimeout }),
            ...(request.dryRun === undefined ? {} : { dryRun: request.dryRun }),
            ...(request.recovery === undefined ? {} : { recovery: request.recovery }),
            ...(request.stragglers === undefined ? {} : { stragglers: request.stragglers }),
            ...(request.timeline === true ? { timeline: true } : {}),
            ...(request.speculative === undefined ? {} : { speculative: request.speculative })
          },
          updates,
          stop,
          requestStart
        )
      }).pipe(Effect.scoped, Effect.provide(context))
    )

  return Orchestrator.of({ run, pipeline })
})

export const layer: Layer.Layer<Orchestrator, never, Services> = Layer.effect(Orchestrator, make)
