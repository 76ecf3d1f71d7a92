/**
 * The world of one run on a warm pipeline: plans it (its own RunId), starts its run FSM actor, executes
 * every command the actor emits (provision a stage through its agent's control link, open the token
 * endpoints, inject token objects, stop stages, tear the endpoints down), feeds back the events the world
 * produces, and turns the lifecycle into updates (RunReport). First fault sticky, teardown exactly once:
 * the FSM's job; this module only executes.
 */
import { Deferred, Duration, Effect, ExecutionStrategy, Exit, Queue, Schedule, Scope, Stream } from "effect"
import type { EdgeFault, TransportAddress } from "../../domain/frames.js"
import { type NodeId, RunId } from "../../domain/ids.js"
import type { Edge, LayerRange, ProvisionStage, RunPlan } from "../../domain/plan.js"
import { type LifecycleEvent, type RunCommand, type RunEvent, RunEvents, stageFaultMessage, StageFaultReasons } from "../../domain/runEvents.js"
import {
  dataFrame,
  DataPlane,
  type EdgeSender,
  isNotYetRegistered,
  notYetRegisteredRetry,
  ProvisionRequest,
  type StageStats
} from "../../services/AgentLinks.js"
import type { PromptCacheUse } from "../../domain/controlRpc.js"
import {
  type GenerateError,
  InvalidRequest,
  RunFaulted,
  type RunRequest,
  type RunUpdate,
  type TokenLogprob
} from "../../services/Orchestrator.js"
import { alignUp } from "../../domain/plan.js"
import { planRun } from "../../services/Planner.js"
import { RunActor } from "../../services/RunFsm.js"
import { makeStageStragglerDetector, stepsOf } from "../../services/StageStragglers.js"
import { plannerInput, type SamplerResume, type WarmPipeline } from "./PipelineSetup.js"
import { describeRunFault, faultWords, summarize, tokenUpdate, tornDownUpdate } from "./RunReport.js"

const consequenceGrace = "300 millis"

const randomRunId = () => RunId.make(1 + Math.floor(Math.random() * 0x7ffffffe))

/** The KV context a run's sessions allocate: prompt + generated tokens + one, in steps of 256, at most the model's. */
export const runContextLength = (maxSeqLen: number, promptTokens: number, maxTokens: number): number =>
  Math.min(maxSeqLen, alignUp(promptTokens + maxTokens + 1, 256))

/**
 * What a run asks of the agents' prompt cache (see RunRequest.promptCache): at most prompt length - 1 positions
 * adopted (the last prompt token is always prefilled, so the last stage has logits to sample).
 */
const promptCacheUse = (request: RunRequest, promptLength: number): PromptCacheUse | undefined => {
  const asked = request.promptCache
  if (asked === undefined) return undefined
  const length = Math.min(asked.adopt?.length ?? 0, promptLength - 1)
  return {
    adopt: asked.adopt !== undefined && Number.isSafeInteger(length) && length > 0 ? { entry: asked.adopt.entry, length } : null,
    keep: asked.keep ?? null,
    promptLength
  }
}

/** Where a run's updates go (a mailbox, or a recovering generation's filter). */
export interface UpdateSink {
  readonly offer: (update: RunUpdate) => Effect.Effect<unknown>
}

/** One run of a generation that may be resumed: its placement and where its sampler starts drawing. */
export interface RunAttempt {
  /** Stage → node (default: the pipeline's). */
  readonly placement?: ReadonlyArray<{ readonly stageIndex: number; readonly nodeId: NodeId }>
  /** Tokens the generation produced before this run (the prompt ends with them): the first draw's position. */
  readonly startPosition?: number
  /** Those tokens and the random draws the sampler made for them: the new last stage's sampler resumes from them. */
  readonly resume?: SamplerResume
  /** Each stage's blocks (default: the pipeline's while the stage count holds, else an even split). */
  readonly layerRanges?: ReadonlyArray<LayerRange>
}

/**
 * Runs one request on `warm` to its end, offering updates as they happen. Completing `stopRequested` is an
 * operator stop. Succeeds after a completed run's Finished update; fails with RunFaulted (after the teardown).
 */
export const driveRun = (
  warm: WarmPipeline,
  request: RunRequest,
  updates: UpdateSink,
  stopRequested: Deferred.Deferred<void>,
  requestStart: number = performance.now(),
  attempt: RunAttempt = {}
) =>
  Effect.gen(function*() {
    const dataPlane = yield* DataPlane
    const { facts, linkOf, addressOf, dataAddressOf, listener, pool } = warm
    const maxTokens = request.maxTokens ?? 128
    if (!Number.isSafeInteger(maxTokens) || maxTokens < 1) {
      return yield* new InvalidRequest({ message: `max tokens must be a positive whole number, got ${maxTokens}` })
    }
    const prompt = typeof request.prompt === "string" ? warm.vocabulary.tokenize(request.prompt) : request.prompt
    if (prompt.length === 0) return yield* new InvalidRequest({ message: "the prompt is empty" })

    const runId = randomRunId()
    const placement = attempt.placement ?? warm.placement
    // The pipeline's block ranges while its stage count holds (a spare took a stage); fewer stages after a
    // recovery: the planner splits the blocks again.
    const layerRanges = attempt.layerRanges !== undefined && attempt.layerRanges.length === placement.length
      ? attempt.layerRanges
      : placement.length === warm.placement.length
      ? warm.layerRanges
      : undefined
    const plan: RunPlan = yield* planRun(
      plannerInput(facts, runId, warm.agents.nodes.map((n) => n.nodeId), placement, {
        maxTokens,
        sampling: request.sampling,
        ...(attempt.startPosition === undefined ? {} : { startPosition: attempt.startPosition }),
        ...(attempt.resume === undefined ? {} : { resume: attempt.resume })
      }, layerRanges)
    )
    const stageNode = (stageIndex: number) => plan.stages.find((s) => s.stageIndex === stageIndex)?.nodeId ?? -1
    yield* updates.offer({
      _tag: "Planned",
      runId,
      stages: plan.stages.map((s) => ({
        stageIndex: s.stageIndex,
        address: addressOf(s.nodeId),
        layers: [s.layerStart, s.layerEndExclusive] as const
      })),
      placement: warm.placementExplanation
    })
    if (request.dryRun === true) return

    const contextLength = runContextLength(facts.maxSeqLen, prompt.length, maxTokens)
    const actor = yield* RunActor.make({
      runId,
      maxTokens,
      prompt,
      eosTokenId: facts.eosTokenId,
      readinessTimeout: request.readinessTimeout ?? warm.options.readinessTimeout ?? "120 seconds",
      tokenTimeout: request.tokenTimeout ?? "60 seconds",
      // a resumed prompt replays its produced tokens one decode step each (plan.replayTail): a token's time for each
      ...(plan.replayTail === undefined || plan.replayTail <= 0
        ? {}
        : { promptTimeout: Duration.times(Duration.decode(request.tokenTimeout ?? "60 seconds"), 1 + plan.replayTail) }),
      teardownTimeout: "10 seconds"
    }).pipe(Effect.mapError((e) => new InvalidRequest({ message: e.message })))
    const commands = yield* actor.subscribeCommands
    const lifecycle = yield* actor.subscribeLifecycle

    // What the run saw, for the summary and for fault messages.
    const details = new Map<string, string>()
    const noteDetail = (key: string, text: string) => {
      if (!details.has(key)) details.set(key, text)
    }
    const noteStageWords = (stageIndex: number, words: string | undefined) => {
      if (words !== undefined) noteDetail(`stage:${stageIndex}`, words)
    }
    const stageStats = new Map<number, StageStats>()
    const stragglerDetector = makeStageStragglerDetector(request.stragglers ?? warm.options.stragglers)
    const stageReady = new Map<number, { loadMillis: number; cachedWeights: boolean }>()
    // Prompt cache: what each stage took over of the adopted entry; the prompt starts after the fewest (cachedTokens).
    const cacheUse = promptCacheUse(request, prompt.length)
    const stageCachedPositions = new Map<number, number>()
    let cachedTokens = 0
    // Stage 0 registers its inbound (token-in) edge before it reports ready: the orchestrator connects after that.
    const firstStageReady = yield* Deferred.make<void>()
    const injectedAt = new Map<number, number>()
    const receivedAt = new Map<number, number>()
    // what the last stage sent beside each token: its log-probs (when asked) and its sampler's draws so far
    const sampledExtras = new Map<number, { readonly logprob?: TokenLogprob; readonly draws?: number }>()
    let tornDown = false
    const offer = (event: RunEvent) => actor.offer(event)
    // A broken connection is usually the echo of a fault elsewhere (the peer crashed or stopped): report it
    // after a short grace period, so the run's first reason is the root cause when that arrives in time.
    const offerConsequence = (event: RunEvent) => Effect.sleep(consequenceGrace).pipe(Effect.zipRight(offer(event)))
    const isEcho = (fault: EdgeFault) =>
      fault._tag === "PeerClosed" || fault._tag === "PeerFaulted" || fault._tag === "EdgeClosed"

    const endpointScope = yield* Scope.fork(yield* Effect.scope, ExecutionStrategy.sequential)
    let tokenIn: EdgeSender | undefined
    const tokenEdge = (kind: "TokenIn" | "TokenOut"): Edge => plan.edges.find((e) => e.kind === kind)!

    const outboundAddress = (provision: ProvisionStage): TransportAddress =>
      provision.stageIndex === provision.stageCount - 1
        ? warm.agents.dataAdvertise ?? listener.address
        : dataAddressOf(stageNode(provision.stageIndex + 1))

    // --- commands ---

    const hostStage = (provision: ProvisionStage) => {
      const stageIndex = provision.stageIndex
      let stopped = false
      const stopReport = Effect.suspend(() => {
        if (stopped) return Effect.void
        stopped = true
        return offer(RunEvents.StageStopped({ runId, stageIndex }))
      })
      const threads = request.threads ?? warm.options.threads
      return linkOf(provision.nodeId).provision(
        new ProvisionRequest({
          provision,
          outboundAddress: outboundAddress(provision),
          threads: threads ?? null,
          contextLength,
          ...(cacheUse === undefined ? {} : { promptCache: cacheUse }),
          ...(request.arriving === undefined || request.arriving <= 0 ? {} : { arriving: request.arriving })
        })
      ).pipe(
        Stream.runForEach((report) => {
          switch (report._tag) {
            case "StageLoading":
              return updates.offer({ _tag: "StageLoading", stageIndex, loadedBytes: report.loadedBytes, totalBytes: report.totalBytes })
            case "StageReady":
              stageReady.set(stageIndex, { loadMillis: report.loadMillis, cachedWeights: report.cachedWeights })
              stageCachedPositions.set(stageIndex, report.cachedPositions ?? 0)
              if (stageIndex === 0) Deferred.unsafeDone(firstStageReady, Effect.void)
              return Effect.zipRight(
                updates.offer({ _tag: "StageReady", stageIndex, loadMillis: report.loadMillis, cachedWeights: report.cachedWeights }),
                offer(RunEvents.StageReady({ runId, stageIndex }))
              )
            case "StageFault":
              // The stage's words, for a reason the FSM may record first without any (StoppedUnexpectedly).
              noteStageWords(stageIndex, stageFaultMessage(report.reason))
              return (report.reason._tag === "TransportFailed" ? offerConsequence : offer)(
                RunEvents.StageFault({ runId, stageIndex, reason: report.reason })
              )
            case "StageStopped":
              stageStats.set(stageIndex, report.stats)
              return stopReport
            case "StageTimings":
              return Effect.forEach(
                stragglerDetector.add(stageIndex, addressOf(provision.nodeId), stepsOf(report)),
                (straggler) => updates.offer({ _tag: "StageStraggler", straggler }),
                { discard: true }
              )
          }
        }),
        Effect.catchAll((unavailable) =>
          Effect.gen(function*() {
            noteDetail(`stage:${stageIndex}`, unavailable.message)
            yield* pool.markLost(provision.nodeId, unavailable.message)
            yield* offer(RunEvents.StageFault({ runId, stageIndex, reason: StageFaultReasons.WorkerCrashed() }))
          })
        ),
        // The stage is gone either way once its report stream has ended.
        Effect.zipRight(stopReport)
      )
    }

    // Not before stage 0 is ready (its edge is registered then): a stage that loads for minutes, or never, is not
    // polled with connections meanwhile. The retry only covers a registration that is not visible yet.
    const createTokenIn = (edge: Edge) =>
      Deferred.await(firstStageReady).pipe(
        Effect.zipRight(
          dataPlane.connect(dataAddressOf(stageNode(0)), { runId, edgeId: edge.edgeId, ring: edge.ring }, warm.agents.token)
        ),
        Effect.retry({ schedule: notYetRegisteredRetry, while: isNotYetRegistered }),
        Scope.extend(endpointScope),
        Effect.matchEffect({
          onFailure: (fault) =>
            Effect.zipRight(
              Effect.sync(() => noteDetail("endpoint:TokenIn", faultWords(fault))),
              offer(RunEvents.EndpointFault({ runId, endpoint: "TokenIn" }))
            ),
          onSuccess: (sender) => Effect.zipRight(Effect.sync(() => (tokenIn = sender)), offer(RunEvents.TokenInEndpointReady()))
        })
      )

    const createTokenOut = (edge: Edge) =>
      Effect.gen(function*() {
        const receiver = yield* listener.accept({ runId, edgeId: edge.edgeId, ring: edge.ring }).pipe(
          Scope.extend(endpointScope)
        )
        yield* offer(RunEvents.TokenOutEndpointReady())
        const receiveLoop = Effect.gen(function*() {
          while (true) {
            const frame = yield* receiver.receive
            if (frame._tag !== "TokenFrame" || frame.payload._tag !== "Sampled") {
              noteDetail("endpoint:TokenOut", `unexpected ${frame._tag} on the token-out edge`)
              return yield* offer(RunEvents.EndpointFault({ runId, endpoint: "TokenOut" }))
            }
            receivedAt.set(frame.sequence, performance.now())
            const { draws, logprob } = frame.payload
            if (draws !== undefined || logprob !== undefined) {
              sampledExtras.set(frame.sequence, {
                ...(draws === undefined ? {} : { draws }),
                ...(logprob === undefined ? {} : { logprob })
              })
            }
            yield* offer(RunEvents.TokenReceived({ sequence: frame.sequence, tokenId: frame.payload.tokenId, eos: frame.payload.eos }))
          }
        })
        yield* receiveLoop.pipe(
          Effect.catchAll((fault) =>
            tornDown
              ? Effect.void
              : Effect.zipRight(
                Effect.sync(() => noteDetail("endpoint:TokenOut", faultWords(fault))),
                (isEcho(fault) ? offerConsequence : offer)(RunEvents.EndpointFault({ runId, endpoint: "TokenOut" }))
              )
          ),
          Effect.forkIn(endpointScope)
        )
      }).pipe(
        Effect.catchAll((fault) =>
          Effect.zipRight(
            Effect.sync(() => noteDetail("endpoint:TokenOut", faultWords(fault))),
            offer(RunEvents.EndpointFault({ runId, endpoint: "TokenOut" }))
          )
        )
      )

    const inject = (command: Extract<RunCommand, { _tag: "InjectTokenObject" }>) =>
      Effect.suspend(() => {
        const { payload, sequence } = command.object
        const sender = tokenIn
        if (sender === undefined) {
          noteDetail("endpoint:TokenIn", "inject before the endpoint was ready")
          return offer(RunEvents.EndpointFault({ runId, endpoint: "TokenIn" }))
        }
        injectedAt.set(sequence, performance.now())
        const edge = tokenEdge("TokenIn")
        if (payload._tag === "Prompt" && cacheUse?.adopt != null) {
          // every stage holds the positions before this (a stage that lacks the entry holds none: a full prefill)
          cachedTokens = Math.min(cacheUse.adopt.length, ...plan.stages.map((s) => stageCachedPositions.get(s.stageIndex) ?? 0))
        }
        const cachedUpdate = payload._tag === "Prompt" && cacheUse !== undefined
          ? updates.offer({ _tag: "PromptCached", cachedTokens })
          : Effect.void
        return cachedUpdate.pipe(Effect.zipRight(sender.send(
          dataFrame({
            _tag: "TokenFrame",
            runId,
            edgeId: edge.edgeId,
            sequence,
            chunkIndex: 0,
            chunkCount: 1,
            payload: payload._tag === "Prompt"
              ? { _tag: "Prompt", tokens: cachedTokens > 0 ? payload.tokens.slice(cachedTokens) : payload.tokens }
              : { _tag: "Decode", tokenId: payload.tokenId }
          })
        ))).pipe(
          Effect.catchAll((fault) =>
            Effect.zipRight(
              Effect.sync(() => noteDetail("endpoint:TokenIn", faultWords(fault))),
              (isEcho(fault) ? offerConsequence : offer)(RunEvents.EndpointFault({ runId, endpoint: "TokenIn" }))
            )
          )
        )
      })

    const execute = (command: RunCommand): Effect.Effect<void> => {
      switch (command._tag) {
        case "ProvisionStage":
          return hostStage(command.provision)
        case "CreateTokenInEndpoint":
          return createTokenIn(command.edge)
        case "CreateTokenOutEndpoint":
          return createTokenOut(command.edge)
        case "InjectTokenObject":
          return inject(command)
        case "StopRun":
          return linkOf(command.nodeId).stop(runId, command.stageIndex).pipe(
            // An agent we cannot reach hosts nothing any more.
            Effect.catchAll(() => offer(RunEvents.StageStopped({ runId, stageIndex: command.stageIndex })))
          )
        case "TearDownTokenEndpoints":
          return Effect.gen(function*() {
            tornDown = true
            yield* Scope.close(endpointScope, Exit.void).pipe(Effect.exit)
            yield* offer(RunEvents.TokenEndpointsStopped())
          })
      }
    }

    // --- event sources ---

    const workers = yield* Effect.scope
    // Commands run concurrently (a stage's provisioning waits for its load); the FSM orders what must be ordered.
    yield* Queue.take(commands).pipe(
      Effect.flatMap((command) => Effect.forkIn(execute(command), workers)),
      Effect.forever,
      Effect.forkScoped
    )
    // A node of this run lost (other nodes of the pool may come and go: spares, nodes lost before this run).
    const planNodes = new Set<number>(plan.stages.map((s) => s.nodeId))
    yield* pool.status.pipe(
      Effect.flatMap((status) => {
        for (const [nodeId, s] of status) {
          if (s._tag === "Lost" && planNodes.has(nodeId)) return Effect.succeed(s.lost)
        }
        return Effect.fail(undefined)
      }),
      Effect.retry(Schedule.spaced("50 millis")),
      Effect.flatMap((lost) =>
        Effect.zipRight(
          Effect.sync(() => noteDetail(`node:${lost.node.nodeId}`, lost.reason)),
          offer(RunEvents.MembershipLost({ runId, nodeId: lost.node.nodeId }))
        )
      ),
      Effect.forkScoped
    )
    yield* Deferred.await(stopRequested).pipe(
      Effect.zipRight(offer(RunEvents.OperatorStop({ runId }))),
      Effect.forkScoped
    )

    // --- lifecycle → updates ---

    const decoder = warm.vocabulary.decoder(prompt)
    const generated: Array<number> = []
    let text = ""
    let firstTokenAt: number | undefined
    const promptInjectedAt = () => injectedAt.get(0) ?? requestStart

    yield* offer(RunEvents.PoolReady({ nodes: [...new Set(placement.map((p) => p.nodeId))] }))
    yield* offer(RunEvents.PlanAvailable({ plan }))

    let terminal: LifecycleEvent | undefined
    while (true) {
      const event = yield* Queue.take(lifecycle)
      if (event._tag === "TokenAccepted") {
        const now = receivedAt.get(event.sequence) ?? performance.now()
        firstTokenAt ??= now
        generated.push(event.tokenId)
        const piece = decoder.push(event.tokenId)
        text += piece
        const extras = sampledExtras.get(event.sequence)
        sampledExtras.delete(event.sequence)
        yield* updates.offer(
          tokenUpdate({
            tokenId: event.tokenId,
            text: piece,
            sequence: event.sequence,
            ...(extras?.logprob === undefined ? {} : { logprob: extras.logprob })
          }, {
            received: now,
            promptInjected: promptInjectedAt(),
            injected: injectedAt.get(event.sequence) ?? now
          }, extras?.draws)
        )
      } else if (event._tag === "RunCompleted" || event._tag === "RunFaulted" || event._tag === "RunOperatorStopped") {
        terminal = event
        const rest = decoder.flush()
        if (rest !== "") {
          text += rest
          yield* updates.offer({
            _tag: "Token",
            token: { tokenId: -1, text: rest, sequence: generated.length, timings: { sinceStartMillis: 0, latencyMillis: 0 } }
          })
        }
      } else if (event._tag === "RunTornDown") {
        yield* updates.offer(tornDownUpdate(terminal, event))
        break
      }
    }

    if (terminal?._tag === "RunFaulted") {
      return yield* new RunFaulted({
        runId,
        reason: terminal.reason,
        message: describeRunFault(terminal.reason, { addressOf, stageNode, detail: (key) => details.get(key) })
      })
    }
    if (terminal?._tag !== "RunCompleted") return

    const end = performance.now()
    const summary = summarize({
      runId,
      outcome: terminal.reason,
      promptTokens: prompt.length,
      generated: generated.length,
      text,
      requestStart,
      promptInjectedAt: promptInjectedAt(),
      firstTokenAt: firstTokenAt ?? end,
      injectedAt,
      receivedAt,
      stages: plan.stages.map((s) => ({
        stageIndex: s.stageIndex,
        address: addressOf(s.nodeId),
        layers: [s.layerStart, s.layerEndExclusive] as const,
        dataAddress: dataAddressOf(s.nodeId),
        ready: stageReady.get(s.stageIndex),
        stats: stageStats.get(s.stageIndex)
      })),
      stageSteps: stragglerDetector.stages(),
      stageStragglers: stragglerDetector.stragglers()
    })
    yield* updates.offer({
      _tag: "Finished",
      summary: cacheUse === undefined ? summary : {
        ...summary,
        promptCache: {
          cachedTokens,
          keptTokens: cacheUse.keep === null
            ? 0
            : Math.min(...plan.stages.map((s) => stageStats.get(s.stageIndex)?.keptPositions ?? 0))
        }
      }
    })
  }).pipe(Effect.scoped)
