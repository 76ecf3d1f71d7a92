/**
 * One hosted stage's work on each frame it receives (StageHost.ts runs it): the frame checked for this stage's role,
 * its rows run through the weights' batcher (a prompt cut into pieces on stage 0 of a pipeline, PromptPieces.ts), and
 * the output sent on: activations to the next stage, or on the last stage a sampled token to the orchestrator (and to
 * stage 0 first on the token loop). Also the stage's failures, its counters and its decode-step timing reports.
 */
import { Data, Effect } from "effect"
import type { ProvisionRequest, StepTimeline, TokenLoop } from "../../domain/controlRpc.js"
import type { DeviceBytes, StageInput, StageOutput } from "../../domain/engine.js"
import { type DataFrame, describeFault, type EdgeFault } from "../../domain/frames.js"
import type { RunId } from "../../domain/ids.js"
import { type StageFaultReason, StageFaultReasons } from "../../domain/runEvents.js"
import { dataFrame, type EdgeSender, type StageReport } from "../../services/AgentLinks.js"
import { promptPieces } from "../../services/PromptPieces.js"
import type { StageSession } from "../../services/StageExecutor.js"
import type { SequenceSampler } from "../sampling/ChainSampler.js"
import { arrivalOf, clockId, encodedMillis, lastWrittenAt, monoOf } from "../transport/WireClock.js"
import { emptyBatchCounters, type JobTrace, type StageBatcher } from "./StageBatcher.js"
import { acceptedDrafts } from "../../services/Speculation.js"
import { firstStageStep, type SpeculationState, verifiedTokens } from "./SpeculativeStep.js"

export class StageFailure extends Data.TaggedError("StageFailure")<{ readonly reason: StageFaultReason }> {}
export const loadFailed = (message: string) =>
  new StageFailure({ reason: StageFaultReasons.ModelLoadFailed({ message }) })
export const transportFailed = (message: string) =>
  new StageFailure({ reason: StageFaultReasons.TransportFailed({ message }) })
const protocolViolated = (message: string) =>
  new StageFailure({ reason: StageFaultReasons.ProtocolViolated({ message }) })

/** A stage's counters before it ran anything. */
export const freshStats = () => ({
  frames: 0,
  tokens: 0,
  loadMillis: 0,
  cachedWeights: false,
  prefillComputeMillis: 0,
  prefillWaitMillis: 0,
  firstSampleMillis: 0,
  decodeFrames: 0,
  decodeComputeMillis: 0,
  ...emptyBatchCounters(),
  computeBytes: 0,
  device: undefined as DeviceBytes | undefined,
  kvBytes: 0,
  residentBytes: 0,
  peakResidentBytes: 0,
  keptPositions: 0,
  verifySteps: 0,
  draftedTokens: 0,
  acceptedTokens: 0
})
export type StageCounters = ReturnType<typeof freshStats>

const errorWords = (error: unknown): string => {
  if (typeof error !== "object" || error === null) return String(error)
  const message = "message" in error && typeof error.message === "string" ? error.message : ""
  if (message !== "" && !message.startsWith("{")) return message
  return Object.entries(error)
    .filter(([key]) => key !== "_tag" && key !== "message" && key !== "stack")
    .map(([key, value]) => `${key} ${String(value)}`)
    .join(", ")
}

/** Steps per StageTimings report, and the longest a step waits to be reported while the stage runs. */
const TIMINGS_BATCH = 16
const TIMINGS_EVERY_MILLIS = 250

const roundMicros = (millis: number) => Math.round(millis * 1000) / 1000

/**
 * A stage's decode-step timings, sent as one StageTimings report per TIMINGS_BATCH steps or TIMINGS_EVERY_MILLIS; with
 * `timeline`, each step's timeline (`addTimeline`, before its `add`) goes in the same report.
 */
export const makeTimingBuffer = (
  runId: RunId,
  stageIndex: number,
  send: (report: StageReport) => void,
  timeline = false
) => {
  let steps: Array<number> = []
  let computeMillis: Array<number> = []
  let sendMillis: Array<number> = []
  let traced: Array<StepTimeline> = []
  let lastSent = performance.now()
  const flush = () => {
    lastSent = performance.now()
    if (steps.length === 0) return
    send({
      _tag: "StageTimings",
      runId,
      stageIndex,
      steps,
      computeMillis,
      sendMillis,
      ...(timeline ? { timeline: traced, clock: clockId() } : {})
    })
    steps = []
    computeMillis = []
    sendMillis = []
    traced = []
  }
  return {
    timeline,
    addTimeline: (entry: StepTimeline) => void traced.push(entry),
    add: (step: number, compute: number, handOff: number) => {
      steps.push(step)
      computeMillis.push(roundMicros(compute))
      sendMillis.push(roundMicros(handOff))
      if (steps.length >= TIMINGS_BATCH || performance.now() - lastSent >= TIMINGS_EVERY_MILLIS) flush()
    },
    flush
  }
}

/** What a decode step's timeline is made of (performance.now, except the frame's arrival: monoNow). */
interface StepMarks {
  /** The stage took the frame. */
  readonly taken: number
  readonly trace: JobTrace
  /** The batcher's result was back with the stage. */
  readonly resumed: number
  /** The send began (after sampling, on the last stage). */
  readonly sendStart: number
  /** The frame the pipeline waits for was written; the stage was done with the step. */
  readonly handOff: number
  readonly done: number
  readonly encodeMillis: number
}

/** A decode step's timeline from its marks (StepTimeline: the parts follow each other from arrival to done). */
const timelineOf = (frame: DataFrame, m: StepMarks): StepTimeline => {
  const takenAt = monoOf(m.taken)
  const arrival = arrivalOf(frame) ?? { arrivedAt: takenAt, decodedAt: takenAt }
  const forward = m.trace.forwardEnd - m.trace.forwardStart
  return {
    step: frame.step,
    arrivedAt: arrival.arrivedAt,
    decodeMillis: arrival.decodedAt - arrival.arrivedAt,
    wakeMillis: takenAt - arrival.decodedAt,
    queueMillis: m.trace.forwardStart - m.taken + (m.resumed - m.trace.forwardEnd),
    copyMillis: m.trace.copyMillis,
    // the graph, and whatever ran between the forward and the send (sampling on the last stage)
    computeMillis: forward - m.trace.copyMillis + (m.sendStart - m.resumed),
    encodeMillis: m.encodeMillis,
    sendMillis: m.done - m.sendStart - m.encodeMillis,
    handOffAt: monoOf(m.handOff),
    doneAt: monoOf(m.done)
  }
}

/** What a hosted stage's steps work with: its role, its session and batcher, its edges, sampler and counters. */
export interface StepContext {
  readonly request: ProvisionRequest
  readonly batcher: StageBatcher
  readonly session: StageSession
  readonly stats: StageCounters
  /** KV positions the session holds (the next step's start on stage 0). */
  readonly state: { position: number }
  /** The most rows of this stage's output one frame on the outbound window carries. */
  readonly windowRows: number
  readonly outbound: EdgeSender
  readonly loopOut: { readonly loop: TokenLoop; readonly sender: EdgeSender } | undefined
  /** The last stage's sampler. */
  readonly sample: SequenceSampler | undefined
  readonly timings: ReturnType<typeof makeTimingBuffer>
  readonly measureStage: () => void
  /** A speculative run's state (ProvisionRequest.speculative; SpeculativeStep.ts). */
  readonly speculation?: SpeculationState | undefined
}

const transport = (fault: EdgeFault) => transportFailed(describeFault(fault))

/** When the frame just sent was handed over (WireClock.lastWrittenAt), if a data-plane edge sent it since `since`. */
const writtenSince = (since: number): number => {
  const at = lastWrittenAt()
  return at >= since ? at : performance.now()
}
const isFirstOf = (ctx: StepContext) => ctx.request.provision.stageIndex === 0
const isLastOf = (ctx: StepContext) => {
  const p = ctx.request.provision
  return p.stageIndex === p.stageCount - 1
}

/** The engine input of a frame and the position it starts at, or why this stage cannot take it. */
const inputOf = (
  ctx: StepContext,
  frame: DataFrame
): Effect.Effect<{ readonly input: StageInput; readonly startPos: number }, StageFailure> => {
  const cacheUse = ctx.request.promptCache
  const position = ctx.state.position
  if (!isFirstOf(ctx)) {
    if (frame._tag !== "ActivationFrame")
      return protocolViolated(`stage ${ctx.request.provision.stageIndex} expects activations, got ${frame._tag}`)
    const verify = frame.drafts !== undefined && frame.drafts.length > 0
    return Effect.succeed({
      input: { _tag: "Hidden", hidden: frame.payload, nTokens: frame.nTokens, ...(verify ? { verify } : {}) },
      startPos: frame.startPos
    })
  }
  if (frame._tag !== "TokenFrame" || frame.payload._tag === "Sampled")
    return protocolViolated(`stage 0 expects token frames, got ${frame._tag}`)
  const tokens = frame.payload._tag === "Prompt" ? frame.payload.tokens : [frame.payload.tokenId]
  // a prompt after cached positions: the orchestrator sent only the rest of it
  const startPos =
    frame.payload._tag === "Prompt" && cacheUse !== undefined ? cacheUse.promptLength - tokens.length : position
  if (startPos < 0 || startPos > position) {
    return protocolViolated(
      `a prompt of ${tokens.length} tokens does not end the ${cacheUse?.promptLength} prompt tokens after the ` +
        `${position} cached positions`
    )
  }
  return Effect.succeed({ input: { _tag: "Tokens", tokens: Int32Array.from(tokens) }, startPos })
}

/** A piece's output activations to the next stage. */
const sendHidden = (
  ctx: StepContext,
  frame: DataFrame,
  output: Extract<StageOutput, { _tag: "Hidden" }>,
  at: {
    readonly pieceStart: number
    readonly chunkIndex: number
    readonly chunkCount: number
    /** A speculative step: its message number (stage 0's own count) and its drafts. */
    readonly step?: number
    readonly drafts?: ReadonlyArray<number>
  }
) => {
  const p = ctx.request.provision
  return ctx.outbound
    .send(
      dataFrame({
        _tag: "ActivationFrame",
        runId: p.runId,
        edgeId: p.outbound.edgeId,
        step: at.step ?? frame.step,
        ...(at.drafts === undefined || at.drafts.length === 0 ? {} : { drafts: at.drafts }),
        chunkIndex: at.chunkIndex,
        chunkCount: at.chunkCount,
        startPos: at.pieceStart,
        nTokens: output.nTokens,
        hiddenDim: output.hidden.length / output.nTokens,
        dtype: "f32",
        payload: output.hidden as Float32Array<ArrayBuffer>
      })
    )
    .pipe(Effect.mapError(transport))
}

/**
 * The last stage: a token sampled from the logits and sent to the orchestrator, and first to stage 0 on the token
 * loop (it is what the pipeline waits for), unless the run ends with it (end of sequence, or max tokens). Returns when
 * the hand-off began, and when the frame the pipeline waits for was handed over (the token loop's, else the
 * orchestrator's).
 */
const sendSampled = (ctx: StepContext, frame: DataFrame, logits: Float32Array, sample: SequenceSampler) =>
  Effect.gen(function* () {
    const p = ctx.request.provision
    const eosTokenId = p.model.eosTokenId
    const sampleStart = performance.now()
    const sampled = sample.sample(logits)
    if (frame.step === 0) ctx.stats.firstSampleMillis = performance.now() - sampleStart
    // nothing selectable (every token banned, or none the grammar allows): the generation ends
    const tokenId = sampled.tokenId < 0 ? Math.max(0, eosTokenId) : sampled.tokenId
    const eos = sampled.tokenId < 0 || tokenId === eosTokenId
    const handOffStart = performance.now()
    let loopSent: number | undefined
    const loopOut = ctx.loopOut
    if (loopOut !== undefined && !eos && frame.step + 1 < loopOut.loop.maxTokens) {
      yield* loopOut.sender
        .send(
          dataFrame({
            _tag: "TokenFrame",
            runId: p.runId,
            edgeId: loopOut.loop.edgeId,
            step: frame.step + 1,
            chunkIndex: 0,
            chunkCount: 1,
            payload: { _tag: "Decode", tokenId }
          })
        )
        .pipe(Effect.mapError(transport))
      loopSent = writtenSince(handOffStart)
    }
    yield* ctx.outbound
      .send(
        dataFrame({
          _tag: "TokenFrame",
          runId: p.runId,
          edgeId: p.outbound.edgeId,
          step: frame.step,
          chunkIndex: 0,
          chunkCount: 1,
          payload: {
            _tag: "Sampled",
            tokenId,
            eos,
            ...(sampled.draws === 0 ? {} : { draws: sampled.draws }),
            ...(sampled.logprob === undefined ? {} : { logprob: sampled.logprob })
          }
        })
      )
      .pipe(Effect.mapError(transport))
    return { handOffStart, handOff: loopSent ?? writtenSince(handOffStart) }
  })

/** A frame's rows to run: its input and start, a speculative step's drafts, and stage 0's message number for it. */
interface PlannedStep {
  readonly input: StageInput
  readonly startPos: number
  readonly drafts: ReadonlyArray<number>
  readonly outStep: number | undefined
}

/** What a frame asks this stage to run; undefined: nothing (stage 0 given a draft its last step already ran, kept). */
const plannedStep = (ctx: StepContext, frame: DataFrame): Effect.Effect<PlannedStep | undefined, StageFailure> => {
  const spec = ctx.speculation
  if (spec !== undefined && isFirstOf(ctx) && frame._tag === "TokenFrame") {
    const payload = frame.payload
    if (payload._tag === "Decode") {
      const room = Math.min(ctx.windowRows, (ctx.request.contextLength ?? Infinity) - ctx.state.position)
      return firstStageStep(spec, payload.tokenId, frame.step, ctx.state.position, room).pipe(
        Effect.mapError(
          (error) =>
            new StageFailure({
              reason: StageFaultReasons.ExecutionFailed({ message: `draft model: ${error._tag}: ${errorWords(error)}` })
            })
        ),
        Effect.map((next) => (next._tag === "Kept" ? undefined : { ...next, outStep: spec.nextMessage++ }))
      )
    }
    if (payload._tag === "Prompt") {
      spec.history.push(...payload.tokens)
      spec.promptTokens = spec.history.length
      spec.nextMessage = 1
    }
  }
  return Effect.map(inputOf(ctx, frame), (planned) => ({
    ...planned,
    drafts: frame._tag === "ActivationFrame" ? (frame.drafts ?? []) : [],
    outStep: undefined
  }))
}

/**
 * The last stage of a speculative run: the step's tokens (SpeculativeStep.verifiedTokens), each sent to stage 0 on the
 * token loop (all of them first: the pipeline waits for the last) and to the orchestrator, under its own step number.
 */
const sendVerified = (
  ctx: StepContext,
  frame: DataFrame,
  output: Extract<StageOutput, { _tag: "Logits" }>,
  drafts: ReadonlyArray<number>,
  sample: SequenceSampler,
  spec: SpeculationState
) =>
  Effect.gen(function* () {
    const p = ctx.request.provision
    const sampleStart = performance.now()
    const tokens = verifiedTokens(spec, output.logits, output.rows ?? 1, drafts, sample, p.model.eosTokenId)
    if (frame.step === 0) ctx.stats.firstSampleMillis = performance.now() - sampleStart
    if (drafts.length > 0) {
      ctx.stats.verifySteps++
      ctx.stats.draftedTokens += drafts.length
      ctx.stats.acceptedTokens += acceptedDrafts(
        drafts,
        tokens.map((t) => t.tokenId)
      )
    }
    const handOffStart = performance.now()
    const first = spec.nextToken
    spec.nextToken += tokens.length
    let loopSent: number | undefined
    const loopOut = ctx.loopOut
    for (let j = 0; loopOut !== undefined && j < tokens.length; j++) {
      if (tokens[j]!.eos || first + j + 1 >= spec.options.maxTokens) break
      const decode = { _tag: "Decode" as const, tokenId: tokens[j]!.tokenId }
      yield* loopOut.sender
        .send(
          dataFrame({
            _tag: "TokenFrame",
            runId: p.runId,
            edgeId: loopOut.loop.edgeId,
            step: first + j + 1,
            payload: decode
          })
        )
        .pipe(Effect.mapError(transport))
      loopSent = writtenSince(handOffStart)
    }
    for (let j = 0; j < tokens.length; j++) {
      const { draws, eos, logprob, tokenId } = tokens[j]!
      const payload = {
        _tag: "Sampled" as const,
        tokenId,
        eos,
        ...(draws === 0 ? {} : { draws }),
        ...(logprob === undefined ? {} : { logprob })
      }
      yield* ctx.outbound
        .send(dataFrame({ _tag: "TokenFrame", runId: p.runId, edgeId: p.outbound.edgeId, step: first + j, payload }))
        .pipe(Effect.mapError(transport))
    }
    return { handOffStart, handOff: loopSent ?? writtenSince(handOffStart) }
  })

/** One piece's rows through the batcher, counted (prefill or decode); its output. */
const runPiece = (
  ctx: StepContext,
  frame: DataFrame,
  pieceStart: number,
  input: StageInput,
  rows: number,
  trace: JobTrace | undefined
) =>
  Effect.gen(function* () {
    const { stats } = ctx
    const p = ctx.request.provision
    const replayTail = frame.step === 0 && isFirstOf(ctx) && isLastOf(ctx) ? p.runtime.replayTail : undefined
    const engineBefore = stats.engineMillis
    const t0 = performance.now()
    const output: StageOutput = yield* ctx.batcher
      .submit(ctx.session, pieceStart, input, stats, p.stageCount, replayTail, trace)
      .pipe(
        Effect.mapError(
          (error) =>
            new StageFailure({
              reason: StageFaultReasons.ExecutionFailed({ message: `${error._tag}: ${errorWords(error)}` })
            })
        )
      )
    const t1 = performance.now()
    const elapsed = t1 - t0
    stats.frames++
    stats.tokens += rows
    if (frame.step === 0) {
      stats.prefillComputeMillis += elapsed
      stats.prefillWaitMillis += Math.max(0, elapsed - (stats.engineMillis - engineBefore))
    } else {
      stats.decodeFrames++
      stats.decodeComputeMillis += elapsed
    }
    ctx.state.position = pieceStart + rows
    if (frame.step === 0 || stats.decodeFrames % 64 === 0) ctx.measureStage()
    return { output, t0, t1 }
  })

/**
 * One received frame. A prompt travels in pieces (PromptPieces.ts): stage 0 of a pipeline cuts it and sends each piece
 * on as soon as it ran; a later stage runs the piece it got and sends it on as the same piece; the last stage samples
 * after the last piece. A one-stage run's prompt runs whole, its replayed tokens (a resumed generation's) one per
 * forward through the batcher, as they were decoded; in a pipeline the pieces carry them one per piece.
 */
export const stepOf =
  (ctx: StepContext) =>
  (frame: DataFrame): Effect.Effect<void, StageFailure> =>
    Effect.gen(function* () {
      const taken = performance.now()
      const p = ctx.request.provision
      const planned = yield* plannedStep(ctx, frame)
      if (planned === undefined) return
      const { drafts, input, outStep, startPos } = planned
      const nTokens = input._tag === "Tokens" ? input.tokens.length : input.nTokens
      const received =
        frame._tag === "ActivationFrame" ? { index: frame.chunkIndex, count: frame.chunkCount } : undefined
      const pieces =
        isFirstOf(ctx) && !isLastOf(ctx) && frame.step === 0
          ? promptPieces(nTokens, ctx.batcher.prefillChunk, p.runtime.replayTail ?? 0, ctx.windowRows)
          : [nTokens]
      const sampleHere = received === undefined || received.index + 1 === received.count
      let offset = 0
      for (let piece = 0; piece < pieces.length; piece++) {
        const rows = pieces[piece]!
        const pieceStart = startPos + offset
        // only stage 0 cuts, and its input is tokens
        const pieceInput: StageInput =
          pieces.length > 1 && input._tag === "Tokens"
            ? { _tag: "Tokens", tokens: input.tokens.subarray(offset, offset + rows) }
            : input
        offset += rows
        const trace =
          ctx.timings.timeline && frame.step !== 0 ? { forwardStart: 0, forwardEnd: 0, copyMillis: 0 } : undefined
        const { output, t0, t1 } = yield* runPiece(ctx, frame, pieceStart, pieceInput, rows, trace)
        let handOffStart = t1
        let handOff: number | undefined
        const encodedBefore = encodedMillis()
        if (output._tag === "Hidden") {
          if (isLastOf(ctx)) return yield* protocolViolated("the last stage produced hidden states")
          handOffStart = performance.now()
          yield* sendHidden(ctx, frame, output, {
            pieceStart,
            chunkIndex: pieces.length > 1 ? piece : (received?.index ?? 0),
            chunkCount: pieces.length > 1 ? pieces.length : (received?.count ?? 1),
            ...(outStep === undefined ? {} : { step: outStep }),
            drafts
          })
          handOff = writtenSince(handOffStart)
        } else {
          if (ctx.sample === undefined) return yield* protocolViolated("a middle stage produced logits")
          // a piece before a prompt's last: nothing to sample yet
          if (!sampleHere) continue
          const sent =
            ctx.speculation !== undefined
              ? yield* sendVerified(ctx, frame, output, drafts, ctx.sample, ctx.speculation)
              : yield* sendSampled(ctx, frame, output.logits, ctx.sample)
          handOffStart = sent.handOffStart
          handOff = sent.handOff
        }
        const done = performance.now()
        if (trace !== undefined) {
          const encodeMillis = encodedMillis() - encodedBefore
          const marks = { taken, trace, resumed: t1, sendStart: handOffStart, handOff: handOff ?? done, done }
          ctx.timings.addTimeline(timelineOf(frame, { ...marks, encodeMillis }))
        }
        // Sampling counts as the last stage's compute; the hand-off is the send (window credit included).
        if (frame.step !== 0) ctx.timings.add(frame.step, handOffStart - t0, done - handOffStart)
      }
    })
