/**
 * The orchestrator over real services: reads the model's facts, tokenizes the prompt, acquires
 * agents (local children or remote nodes), connects the control links, waits for the pool,
 * plans, then drives the run FSM actor — executing each command it emits and feeding back the
 * events the world produces — and streams tokens as they come back.
 *
 * Interrupting the stream is an OperatorStop: the run is stopped and fully torn down before the
 * interruption completes.
 */
import { Deferred, Effect, ExecutionStrategy, Exit, Fiber, Layer, Mailbox, Option, Queue, Schedule, Scope, Stream } from "effect"
import type { EdgeFault, TransportAddress } from "../domain/frames.js"
import { dataFrame } from "../services/AgentLinks.js"
import { NodeId, RunId } from "../domain/ids.js"
import type { Edge, ProvisionStage, RingSpec, RunPlan } from "../domain/plan.js"
import {
  type LifecycleEvent,
  type RunCommand,
  type RunEvent,
  RunEvents,
  type RunFaultReason,
  type StageFaultReason,
  StageFaultReasons
} from "../domain/runFsm.js"
import { readModelFacts } from "./ModelCatalogLive.js"
import { nodesToAwait, placementFor, requestedStageCount } from "./RunPlacement.js"
import {
  type AgentLink,
  AgentControl,
  DataPlane,
  type EdgeSender,
  isNotYetRegistered,
  ProvisionRequest,
  type StageReport,
  type StageStats
} from "../services/AgentLinks.js"
import { Membership, type NodeEndpoint, NodeUnreachable } from "../services/Membership.js"
import {
  AgentPool,
  type GenerateError,
  type GenerateRequest,
  InvalidRequest,
  Orchestrator,
  RunFaulted,
  type RunSummary,
  type RunUpdate,
  type StageSummary
} from "../services/Orchestrator.js"
import { activationFrameBytes, alignUp, planRun } from "../services/Planner.js"
import { RunActor } from "../services/RunFsm.js"
import { Tokenizer } from "../services/Tokenizer.js"

const ORCHESTRATOR_NODE = NodeId.make(0)

const ring = (dataCapacity: number, direction: RingSpec["direction"]): RingSpec => ({
  dataCapacity,
  alignment: 64,
  direction,
  hostPinning: "Pageable",
  wakeCoalescing: "PendingBit"
})

const stageFaultReason = (report: Extract<StageReport, { _tag: "StageFault" }>): StageFaultReason => {
  switch (report.kind) {
    case "LoadError":
      return StageFaultReasons.ModelLoadFailed({ message: report.detail })
    case "WorkerCrashed":
      return StageFaultReasons.WorkerCrashed()
    case "TransportError":
      return StageFaultReasons.TransportFailed({ message: report.detail })
    case "EngineError":
    case "ProtocolError":
      return StageFaultReasons.ExecutionFailed({ message: report.detail })
    case "Rejected":
      return StageFaultReasons.ProvisionFailed({ message: report.detail })
  }
}

const describeStageReason = (reason: StageFaultReason): string => {
  switch (reason._tag) {
    case "WorkerCrashed":
      return "its agent crashed or became unreachable"
    case "ProvisionFailed":
      return `provisioning failed: ${reason.message}`
    case "ModelLoadFailed":
      return `loading the model failed: ${reason.message}`
    case "ExecutionFailed":
      return `execution failed: ${reason.message}`
    case "TransportFailed":
      return `transport failed: ${reason.message}`
    case "StoppedUnexpectedly":
      return "it stopped unexpectedly"
  }
}

/** The run's fault in words, with whatever detail the orchestrator saw first for it. */
export const describeRunFault = (
  reason: RunFaultReason,
  context: { readonly addressOf: (nodeId: number) => string; readonly stageNode: (stageIndex: number) => number; readonly detail: (key: string) => string | undefined }
): string => {
  switch (reason._tag) {
    case "StageFault": {
      const node = context.addressOf(context.stageNode(reason.stageIndex))
      // Reasons with a message already carry the stage's words.
      const extra = "message" in reason.reason ? undefined : context.detail(`stage:${reason.stageIndex}`)
      return `stage ${reason.stageIndex} (agent ${node}) faulted: ${describeStageReason(reason.reason)}${extra === undefined ? "" : ` (${extra})`}`
    }
    case "EndpointFault": {
      const extra = context.detail(`endpoint:${reason.endpoint}`)
      return `the orchestrator's ${reason.endpoint} endpoint faulted${extra === undefined ? "" : `: ${extra}`}`
    }
    case "MembershipLost": {
      const extra = context.detail(`node:${reason.nodeId}`)
      return `lost node ${context.addressOf(reason.nodeId)}${extra === undefined ? "" : `: ${extra}`}`
    }
    case "ReadinessTimeout":
      return `not ready before the readiness deadline: ${[
        ...reason.missingStages.map((s) => `stage ${s} (agent ${context.addressOf(context.stageNode(s))})`),
        ...reason.missingEndpoints.map((e) => `${e} endpoint`)
      ].join(", ")}`
    case "TokenTimeout":
      return `no token came back for sequence ${reason.sequence} before the token deadline`
    case "EndpointsStoppedUnexpectedly":
      return "the token endpoints stopped unexpectedly"
  }
}

const faultWords = (fault: EdgeFault): string => {
  const { _tag, ...rest } = fault
  const fields = Object.entries(rest).filter(([k]) => k !== "stack" && k !== "message")
  return `${_tag}${fields.length > 0 ? `(${fields.map(([k, v]) => `${k}=${String(v)}`).join(", ")})` : ""}`
}

const consequenceGrace = "300 millis"

const randomRunId = () => RunId.make(1 + Math.floor(Math.random() * 0x7ffffffe))

export const make = Effect.gen(function*() {
  const tokenizer = yield* Tokenizer
  const membership = yield* Membership
  const control = yield* AgentControl
  const dataPlane = yield* DataPlane
  const agentPool = yield* AgentPool

  const drive = (
    request: GenerateRequest,
    updates: Mailbox.Mailbox<RunUpdate, GenerateError>,
    stopRequested: Deferred.Deferred<void>
  ) =>
    Effect.gen(function*() {
      const requestStart = performance.now()
      const maxTokens = request.maxTokens ?? 128
      if (request.prompt.length === 0) return yield* new InvalidRequest({ message: "the prompt is empty" })
      if (!Number.isSafeInteger(maxTokens) || maxTokens < 1) {
        return yield* new InvalidRequest({ message: `max tokens must be a positive whole number, got ${maxTokens}` })
      }
      if (request.stages !== undefined && (!Number.isSafeInteger(request.stages) || request.stages < 1)) {
        return yield* new InvalidRequest({ message: `stages must be a positive whole number, got ${request.stages}` })
      }
      const facts = yield* readModelFacts(request.model)
      const vocabulary = yield* tokenizer.open(request.model)
      const prompt = vocabulary.tokenize(request.prompt)

      const activationBytes = activationFrameBytes(facts, 64)
      const plannerInput = (
        runId: RunId,
        candidatePool: ReadonlyArray<NodeId>,
        placement: ReadonlyArray<{ readonly stageIndex: number; readonly nodeId: NodeId }>,
        layerRanges?: ReadonlyArray<readonly [number, number]>
      ) => ({
        runId,
        orchestratorNodeId: ORCHESTRATOR_NODE,
        model: facts,
        runtime: {
          maxTokens,
          sampling: {
            temperatureMillis: Math.round((request.sampling?.temperature ?? 0) * 1000),
            topK: request.sampling?.topK ?? ((request.sampling?.temperature ?? 0) > 0 ? 40 : 1),
            ...(request.sampling?.seed === undefined ? {} : { seed: request.sampling.seed })
          }
        },
        candidatePool,
        stageCount: placement.length,
        placement: { _tag: "FixedLinear" as const, stages: placement },
        ...(layerRanges === undefined ? {} : { layerRanges }),
        activationRing: ring(Math.max(4 << 20, alignUp(activationBytes * 64, 64)), "Egress"),
        tokenRing: ring(64 << 10, "Egress")
      })
      // Reject what no placement can fix (too many stages, bad max tokens, ...) before starting any agent.
      if (request.stages !== undefined) {
        const ids = Array.from({ length: request.stages }, (_, i) => NodeId.make(i + 1))
        yield* planRun(plannerInput(RunId.make(1), ids, ids.map((nodeId, stageIndex) => ({ stageIndex, nodeId }))))
      }

      const agents = yield* agentPool.acquire(request.stages)
      const stageCount = requestedStageCount(request.placement, request.stages ?? agents.nodes.length)
      yield* updates.offer({ _tag: "AgentsStarted", nodes: agents.nodes })
      const links = new Map<number, AgentLink>()
      yield* Effect.forEach(agents.nodes, (node) =>
        control.connect(node, agents.token).pipe(Effect.tap((link) => Effect.sync(() => links.set(node.nodeId, link)))), {
        concurrency: "unbounded",
        discard: true
      })
      const linkOf = (nodeId: number) => links.get(nodeId)!
      const addressOf = (nodeId: number) =>
        nodeId === ORCHESTRATOR_NODE ? "orchestrator" : agents.nodes.find((n) => n.nodeId === nodeId)?.address ?? `node ${nodeId}`

      // A dropped control connection is noticed at once; the deadline covers a node that hangs (or a long load that blocks it).
      const heartbeat = request.heartbeat ?? { interval: "1 second", deadline: "10 seconds" }
      const pool = yield* membership.watch(agents.nodes, {
        probe: (node) =>
          linkOf(node.nodeId).capacity.pipe(
            Effect.mapError((e) => new NodeUnreachable({ nodeId: node.nodeId, address: node.address, message: e.message }))
          )
      }, heartbeat)
      const neededNodes = nodesToAwait(request.placement, agents.nodes, stageCount)
      const readinessTimeout = request.readinessTimeout ?? "120 seconds"
      const capacity = yield* pool.awaitReady(neededNodes, readinessTimeout)
      yield* updates.offer({
        _tag: "PoolReady",
        nodes: agents.nodes,
        capacity: agents.nodes.flatMap((node) => {
          const reported = capacity.get(node.nodeId)
          return reported === undefined ? [] : [{ node, capacity: reported }]
        })
      })

      const placed = yield* placementFor({
        request: request.placement,
        modelPath: request.model,
        nodes: agents.nodes,
        capacity,
        stageCount,
        contextTokens: Math.min(facts.maxSeqLen, alignUp(prompt.length + maxTokens + 1, 256))
      })
      const runId = randomRunId()
      const plan: RunPlan = yield* planRun(
        plannerInput(runId, agents.nodes.map((n) => n.nodeId), placed.stages, placed.layerRanges)
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
        placement: placed.explanation
      })

      if (request.dryRun === true) return

      // Local data endpoint: the last stage sends sampled tokens here.
      const listener = yield* dataPlane.listen(agents.dataListen ?? { _tag: "Tcp", host: agents.listenHost, port: 0 }, agents.token).pipe(
        Effect.mapError((fault) => new InvalidRequest({ message: `cannot open the orchestrator's data listener: ${faultWords(fault)}` }))
      )

      const contextLength = Math.min(facts.maxSeqLen, alignUp(prompt.length + maxTokens + 1, 256))
      const actor = yield* RunActor.make({
        runId,
        maxTokens,
        prompt,
        eosTokenId: facts.eosTokenId,
        readinessTimeout,
        tokenTimeout: request.tokenTimeout ?? "60 seconds",
        teardownTimeout: "10 seconds"
      }).pipe(Effect.mapError((e) => new InvalidRequest({ message: e.message })))
      const commands = yield* actor.subscribeCommands
      const lifecycle = yield* actor.subscribeLifecycle

      // What the run saw, for the summary and for fault messages.
      const details = new Map<string, string>()
      const noteDetail = (key: string, text: string) => {
        if (!details.has(key)) details.set(key, text)
      }
      const stageStats = new Map<number, StageStats>()
      const stageReady = new Map<number, { loadMillis: number; cachedWeights: boolean }>()
      const injectedAt = new Map<number, number>()
      const receivedAt = new Map<number, number>()
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
      const dataAddressOf = (nodeId: number): TransportAddress => linkOf(nodeId).hello.dataAddress

      const outboundAddress = (provision: ProvisionStage): TransportAddress =>
        provision.stageIndex === provision.stageCount - 1
          ? listener.address
          : dataAddressOf(stageNode(provision.stageIndex + 1))

      const hostStage = (provision: ProvisionStage) => {
        const stageIndex = provision.stageIndex
        let stopped = false
        const stopReport = Effect.suspend(() => {
          if (stopped) return Effect.void
          stopped = true
          return offer(RunEvents.StageStopped({ runId, stageIndex }))
        })
        return linkOf(provision.nodeId).provision(
          new ProvisionRequest({
            provision,
            outboundAddress: outboundAddress(provision),
            threads: request.threads ?? null,
            contextLength
          })
        ).pipe(
          Stream.runForEach((report) => {
            switch (report._tag) {
              case "StageLoading":
                return updates.offer({ _tag: "StageLoading", stageIndex, loadedBytes: report.loadedBytes, totalBytes: report.totalBytes })
              case "StageReady":
                stageReady.set(stageIndex, { loadMillis: report.loadMillis, cachedWeights: report.cachedWeights })
                return Effect.zipRight(
                  updates.offer({ _tag: "StageReady", stageIndex, loadMillis: report.loadMillis, cachedWeights: report.cachedWeights }),
                  offer(RunEvents.StageReady({ runId, stageIndex }))
                )
              case "StageFault":
                noteDetail(`stage:${stageIndex}`, report.detail)
                return (report.kind === "TransportError" ? offerConsequence : offer)(
                  RunEvents.StageFault({ runId, stageIndex, reason: stageFaultReason(report) })
                )
              case "StageStopped":
                stageStats.set(stageIndex, report.stats)
                return stopReport
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

      const createTokenIn = (edge: Edge) =>
        dataPlane.connect(dataAddressOf(stageNode(0)), { runId, edgeId: edge.edgeId, ring: edge.ring }, agents.token).pipe(
          Effect.retry({
            schedule: Schedule.spaced("20 millis"),
            while: isNotYetRegistered
          }),
          Scope.extend(endpointScope),
          Effect.matchEffect({
            onFailure: (fault) =>
              Effect.zipRight(
                Effect.sync(() => noteDetail("endpoint:TokenIn", faultWords(fault))),
                offer(RunEvents.EndpointFault({ runId, endpoint: "TokenIn" }))
              ),
            onSuccess: (sender) =>
              Effect.zipRight(Effect.sync(() => (tokenIn = sender)), offer(RunEvents.TokenInEndpointReady()))
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
          const { sequence, payload } = command.object
          const sender = tokenIn
          if (sender === undefined) {
            noteDetail("endpoint:TokenIn", "inject before the endpoint was ready")
            return offer(RunEvents.EndpointFault({ runId, endpoint: "TokenIn" }))
          }
          injectedAt.set(sequence, performance.now())
          const edge = tokenEdge("TokenIn")
          return sender.send(
            dataFrame({
              _tag: "TokenFrame",
              runId,
              edgeId: edge.edgeId,
              sequence,
              chunkIndex: 0,
              chunkCount: 1,
              payload: payload._tag === "Prompt"
                ? { _tag: "Prompt", tokens: payload.tokens }
                : { _tag: "Decode", tokenId: payload.tokenId }
            })
          ).pipe(
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

      const workers = yield* Effect.scope
      // Commands run concurrently (a stage's provisioning waits for its load); the FSM orders what must be ordered.
      yield* Queue.take(commands).pipe(
        Effect.flatMap((command) =>
          Effect.forkIn(execute(command), workers)
        ),
        Effect.forever,
        Effect.forkScoped
      )
      yield* pool.firstLost.pipe(
        Effect.flatMap((lost) =>
          Effect.zipRight(
            Effect.sync(() => noteDetail(`node:${lost.node.nodeId}`, lost.reason)),
            offer(RunEvents.MembershipLost({ runId, nodeId: lost.node.nodeId }))
          )
        ),
        Effect.forkScoped
      )
      yield* agents.exited.pipe(
        Effect.flatMap(({ node, reason }) => pool.markLost(node.nodeId, reason)),
        Effect.forkScoped
      )
      yield* Deferred.await(stopRequested).pipe(
        Effect.zipRight(offer(RunEvents.OperatorStop({ runId }))),
        Effect.forkScoped
      )

      const decoder = vocabulary.decoder(prompt)
      const generated: Array<number> = []
      let text = ""
      let firstTokenAt: number | undefined
      const promptInjectedAt = () => injectedAt.get(0) ?? requestStart

      yield* offer(RunEvents.PoolReady({ nodes: neededNodes }))
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
          yield* updates.offer({
            _tag: "Token",
            token: {
              tokenId: event.tokenId,
              text: piece,
              sequence: event.sequence,
              timings: {
                sinceStartMillis: now - promptInjectedAt(),
                latencyMillis: now - (injectedAt.get(event.sequence) ?? now)
              }
            }
          })
        } else if (event._tag === "RunCompleted" || event._tag === "RunFaulted" || event._tag === "RunOperatorStopped") {
          terminal = event
          const rest = decoder.flush()
          if (rest !== "") {
            text += rest
            const last = generated.length - 1
            yield* updates.offer({
              _tag: "Token",
              token: { tokenId: -1, text: rest, sequence: last + 1, timings: { sinceStartMillis: 0, latencyMillis: 0 } }
            })
          }
        } else if (event._tag === "RunTornDown") {
          yield* updates.offer({
            _tag: "TornDown",
            outcome: terminal?._tag === "RunCompleted"
              ? "Completed"
              : terminal?._tag === "RunFaulted"
              ? "Faulted"
              : "OperatorStopped",
            unconfirmedStages: event.unconfirmedStages,
            endpointsConfirmed: event.endpointsConfirmed
          })
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

      // Decode steps: sequences 1..n-1 (sequence 0 is the prefill).
      const decodeLatencies: Array<number> = []
      for (let sequence = 1; sequence < generated.length + 1; sequence++) {
        const sent = injectedAt.get(sequence)
        const got = receivedAt.get(sequence)
        if (sent !== undefined && got !== undefined) decodeLatencies.push(got - sent)
      }
      const decodeMillis = decodeLatencies.reduce((a, b) => a + b, 0)
      const decodeMillisPerToken = decodeLatencies.length > 0 ? decodeMillis / decodeLatencies.length : 0
      const stages: Array<StageSummary> = [...plan.stages]
        .sort((a, b) => a.stageIndex - b.stageIndex)
        .map((s) => {
          const stats = stageStats.get(s.stageIndex)
          const ready = stageReady.get(s.stageIndex)
          return {
            stageIndex: s.stageIndex,
            address: addressOf(s.nodeId),
            layers: [s.layerStart, s.layerEndExclusive] as const,
            dataAddress: dataAddressOf(s.nodeId),
            loadMillis: ready?.loadMillis ?? 0,
            cachedWeights: ready?.cachedWeights ?? false,
            prefillComputeMillis: stats?.prefillComputeMillis ?? 0,
            computeMillisPerToken: stats !== undefined && stats.decodeFrames > 0
              ? stats.decodeComputeMillis / stats.decodeFrames
              : 0,
            microBatches: stats?.microBatches ?? 0,
            batchRows: stats?.batchRows ?? 0,
            maxBatchSequences: stats?.maxBatchSequences ?? 0
          }
        })
      const computePerToken = stages.reduce((sum, s) => sum + s.computeMillisPerToken, 0)
      const summary: RunSummary = {
        runId,
        outcome: terminal.reason,
        promptTokens: prompt.length,
        generatedTokens: generated.length,
        text,
        timeToFirstTokenMillis: (firstTokenAt ?? performance.now()) - requestStart,
        prefillMillis: (firstTokenAt ?? performance.now()) - promptInjectedAt(),
        decodeTokensPerSecond: decodeMillis > 0 ? (decodeLatencies.length * 1000) / decodeMillis : 0,
        decodeMillisPerToken,
        stages,
        transferMillisPerToken: Math.max(0, decodeMillisPerToken - computePerToken)
      }
      yield* updates.offer({ _tag: "Finished", summary })
    }).pipe(Effect.scoped)

  const run = (request: GenerateRequest): Stream.Stream<RunUpdate, GenerateError> =>
    Stream.unwrapScoped(
      Effect.gen(function*() {
        const updates = yield* Mailbox.make<RunUpdate, GenerateError>()
        const stopRequested = yield* Deferred.make<void>()
        const driver = yield* drive(request, updates, stopRequested).pipe(
          Effect.exit,
          Effect.flatMap((exit) => updates.done(exit)),
          Effect.forkDaemon
        )
        // Closing the stream early (consumer done or interrupted): operator stop, then wait for the teardown.
        yield* Effect.addFinalizer(() =>
          Effect.gen(function*() {
            yield* Deferred.succeed(stopRequested, undefined)
            const finished = yield* Fiber.await(driver).pipe(Effect.timeout("20 seconds"), Effect.option)
            if (Option.isNone(finished)) yield* Fiber.interrupt(driver)
          })
        )
        return Mailbox.toStream(updates)
      })
    )

  return Orchestrator.of({ run })
})

export const layer: Layer.Layer<Orchestrator, never, Tokenizer | Membership | AgentControl | DataPlane | AgentPool> =
  Layer.effect(Orchestrator, make)

