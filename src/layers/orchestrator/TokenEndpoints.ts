/**
 * The orchestrator's two token endpoints of a run (the run FSM's endpoint commands): token-in connects to stage 0
 * and carries the prompt and each decode step's token; token-out accepts the last stage's sampled tokens and feeds
 * them back to the run as events. Both live in the run's endpoint scope, closed once by the teardown.
 */
import { arrivalOf, monoNow } from "../transport/WireClock.js"
import { Deferred, Effect, Exit, Scope } from "effect"
import type { Edge } from "../../domain/plan.js"
import { type RunCommand, RunEvents } from "../../domain/runEvents.js"
import { dataFrame, isNotYetRegistered, notYetRegisteredRetry } from "../../services/AgentLinks.js"
import { isEcho, noteDetail, offerConsequence, type RunContext, stageNode } from "./RunContext.js"
import { faultWords } from "./RunReport.js"

/**
 * Connects token-in to stage 0, not before stage 0 is ready (its edge is registered then): a stage that loads for
 * minutes, or never, is not polled with connections meanwhile. The retry only covers a registration that is not
 * visible yet.
 */
export const openTokenIn = (context: RunContext, edge: Edge) => {
  const { ledger, offer, runId, warm } = context
  return Deferred.await(ledger.firstStageReady).pipe(
    Effect.zipRight(
      context.dataPlane.connect(
        warm.dataAddressOf(stageNode(context, 0)),
        { runId, edgeId: edge.edgeId, ring: edge.ring },
        warm.agents.token
      )
    ),
    Effect.retry({ schedule: notYetRegisteredRetry, while: isNotYetRegistered }),
    Scope.extend(ledger.endpointScope),
    Effect.matchEffect({
      onFailure: (fault) =>
        Effect.zipRight(
          Effect.sync(() => noteDetail(context, "endpoint:TokenIn", faultWords(fault))),
          offer(RunEvents.EndpointFault({ runId, endpoint: "TokenIn" }))
        ),
      onSuccess: (sender) =>
        Effect.zipRight(
          Effect.sync(() => (ledger.tokenIn = sender)),
          offer(RunEvents.TokenInEndpointReady())
        )
    })
  )
}

/** Accepts token-out from the last stage, then receives its sampled tokens until the teardown or a fault. */
export const openTokenOut = (context: RunContext, edge: Edge) => {
  const { ledger, offer, runId } = context
  return Effect.gen(function* () {
    const receiver = yield* context.warm.listener
      .accept({ runId, edgeId: edge.edgeId, ring: edge.ring })
      .pipe(Scope.extend(ledger.endpointScope))
    yield* offer(RunEvents.TokenOutEndpointReady())
    const receiveLoop = Effect.gen(function* () {
      while (true) {
        const frame = yield* receiver.receive
        if (frame._tag !== "TokenFrame" || frame.payload._tag !== "Sampled") {
          noteDetail(context, "endpoint:TokenOut", `unexpected ${frame._tag} on the token-out edge`)
          return yield* offer(RunEvents.EndpointFault({ runId, endpoint: "TokenOut" }))
        }
        ledger.receivedAt.set(frame.step, performance.now())
        ledger.timeline?.tokenArrivedAt.set(frame.step, arrivalOf(frame)?.arrivedAt ?? monoNow())
        const { draws, logprob } = frame.payload
        if (draws !== undefined || logprob !== undefined) {
          ledger.sampledExtras.set(frame.step, {
            ...(draws === undefined ? {} : { draws }),
            ...(logprob === undefined ? {} : { logprob })
          })
        }
        yield* offer(
          RunEvents.TokenReceived({ step: frame.step, tokenId: frame.payload.tokenId, eos: frame.payload.eos })
        )
      }
    })
    yield* receiveLoop.pipe(
      Effect.catchAll((fault) => {
        if (ledger.tornDown) return Effect.void
        const event = RunEvents.EndpointFault({ runId, endpoint: "TokenOut" })
        return Effect.zipRight(
          Effect.sync(() => noteDetail(context, "endpoint:TokenOut", faultWords(fault))),
          isEcho(fault) ? offerConsequence(context, event) : offer(event)
        )
      }),
      Effect.forkIn(ledger.endpointScope)
    )
  }).pipe(
    Effect.catchAll((fault) =>
      Effect.zipRight(
        Effect.sync(() => noteDetail(context, "endpoint:TokenOut", faultWords(fault))),
        offer(RunEvents.EndpointFault({ runId, endpoint: "TokenOut" }))
      )
    )
  )
}

/**
 * Sends a token object (the prompt, or a decode step's token) through token-in. A prompt starts after the positions
 * every stage already holds from the prompt cache (PromptCached tells the caller how many).
 */
export const injectTokenObject = (context: RunContext, command: Extract<RunCommand, { _tag: "InjectTokenObject" }>) =>
  Effect.suspend(() => {
    const { cacheUse, ledger, offer, plan, runId, updates } = context
    const { payload, step } = command.object
    const sender = ledger.tokenIn
    if (sender === undefined) {
      noteDetail(context, "endpoint:TokenIn", "inject before the endpoint was ready")
      return offer(RunEvents.EndpointFault({ runId, endpoint: "TokenIn" }))
    }
    ledger.injectedAt.set(step, performance.now())
    // the token loop: the last stage already sent this token to stage 0 (ProvisionRequest.tokenLoop)
    if (payload._tag === "Decode" && ledger.tokenLoop) return Effect.void
    const edge = plan.edges.find((e) => e.kind === "TokenIn")!
    if (payload._tag === "Prompt" && cacheUse?.adopt != null) {
      // every stage holds the positions before this (a stage that lacks the entry holds none: a full prefill)
      ledger.cachedTokens = Math.min(
        cacheUse.adopt.length,
        ...plan.stages.map((s) => ledger.stageCachedPositions.get(s.stageIndex) ?? 0)
      )
    }
    const cachedTokens = ledger.cachedTokens
    const cachedUpdate =
      payload._tag === "Prompt" && cacheUse !== undefined
        ? updates.offer({ _tag: "PromptCached", cachedTokens })
        : Effect.void
    return cachedUpdate
      .pipe(
        Effect.zipRight(
          sender.send(
            dataFrame({
              _tag: "TokenFrame",
              runId,
              edgeId: edge.edgeId,
              step,
              chunkIndex: 0,
              chunkCount: 1,
              payload:
                payload._tag === "Prompt"
                  ? { _tag: "Prompt", tokens: cachedTokens > 0 ? payload.tokens.slice(cachedTokens) : payload.tokens }
                  : { _tag: "Decode", tokenId: payload.tokenId }
            })
          )
        )
      )
      .pipe(
        Effect.catchAll((fault) => {
          const event = RunEvents.EndpointFault({ runId, endpoint: "TokenIn" })
          return Effect.zipRight(
            Effect.sync(() => noteDetail(context, "endpoint:TokenIn", faultWords(fault))),
            isEcho(fault) ? offerConsequence(context, event) : offer(event)
          )
        })
      )
  })

/** Closes both token endpoints (marked torn down first: token-out's receive loop then ends quietly). */
export const tearDownTokenEndpoints = (context: RunContext) =>
  Effect.gen(function* () {
    context.ledger.tornDown = true
    yield* Scope.close(context.ledger.endpointScope, Exit.void).pipe(Effect.exit)
    yield* context.offer(RunEvents.TokenEndpointsStopped())
  })
