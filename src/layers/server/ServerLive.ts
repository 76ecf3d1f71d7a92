/**
 * The Server over the Orchestrator: one warm pipeline set up in the background (status Loading → Ready, or
 * Faulted with the reason in words), a warm-up run so the first request does not pay the load, admission by
 * KV bytes per stage, and each request its own run on the pipeline.
 */
import { Cause, Chunk, Deferred, Duration, Effect, Either, Exit, ExecutionStrategy, Layer, Option, Queue, Ref, Schedule, Scope, Stream } from "effect"
import * as Gguf from "../gguf/GgufReader.js"
import type { GgufFile } from "../../domain/gguf.js"
import { Orchestrator, type Pipeline, type PipelineMember, type RunSummary, type RunUpdate, type TokenLogprob } from "../../services/Orchestrator.js"
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
  type RevivalAgent,
  ServerReviving,
  type ServerMetrics,
  type StageMetrics,
  type ServerStatus,
  type TextLogprob
} from "../../services/Server.js"
import { kvBytesOfBlocks, kvBytesOfSequence, kvBytesPerTokenOfBlock } from "../../services/KvSize.js"
import { slidingWindowOf, type SlidingWindowLayout } from "../gguf/SlidingWindow.js"
import { makePromptCacheIndex, type PromptCacheMatch } from "../../services/PromptCacheIndex.js"
import { makeStopMatcher } from "../../services/StopText.js"
import { makeLogprobAligner } from "../../services/TextLogprobs.js"
import { generationProblem } from "../../services/RequestChecks.js"
import { runContextLength } from "../orchestrator/RunWorld.js"
import { inThread, PromptTokenizer, PromptTooLong, type TokenizerUnavailable } from "./PromptTokenizer.js"
import type { ChatRenderError } from "../../services/Tokenizer.js"

/**
 * KV cache bytes one sequence of `contextLength` tokens takes on the heaviest stage (services/KvSize.ts). With
 * sliding-window blocks (their caches capped) and the planned stages' blocks known: the most any planned stage takes;
 * else `layersPerStage` blocks holding the whole context.
 */
export const kvBytesPerSequence = (
  shape: {
    readonly layersPerStage: number
    readonly kvBytesPerBlockToken: number
    /** Per block, when blocks differ (gemma4 31B: its own head size and KV heads); kvBytesPerBlockToken is their most. */
    readonly kvBytesPerBlock?: ReadonlyArray<number> | undefined
    readonly slidingWindow?: SlidingWindowLayout | undefined
    readonly ranges?: ReadonlyArray<readonly [number, number]>
    /** DeltaNet blocks (qwen35): which blocks keep a constant state per sequence instead of KV, and its bytes. */
    readonly recurrent?: RecurrentLayout | undefined
  },
  contextLength: number
): number => {
  const sw = shape.slidingWindow
  const rec = shape.recurrent
  if (rec !== undefined) {
    const perToken = kvBytesOfSequence(shape.kvBytesPerBlockToken, contextLength)
    // stages unknown: every block of a stage as the heavier of the two kinds
    if (shape.ranges === undefined || shape.ranges.length === 0) return shape.layersPerStage * Math.max(perToken, rec.stateBytes)
    return Math.max(...shape.ranges.map(([start, end]) => {
      let sum = 0
      for (let il = start; il < end; il++) sum += rec.blocks[il] === true ? rec.stateBytes : perToken
      return sum
    }))
  }
  const perBlock = shape.kvBytesPerBlock
  if ((sw === undefined && perBlock === undefined) || shape.ranges === undefined || shape.ranges.length === 0) {
    return kvBytesOfSequence(shape.layersPerStage * shape.kvBytesPerBlockToken, contextLength)
  }
  return Math.max(...shape.ranges.map(([start, end]) =>
    kvBytesOfBlocks(
      Array.from({ length: end - start }, (_, i) => ({
        bytesPerToken: perBlock?.[start + i] ?? shape.kvBytesPerBlockToken,
        ...(sw?.blocks[start + i] === true ? { window: sw.window } : {})
      })),
      contextLength
    )
  ))
}

/** Which blocks are DeltaNet blocks (qwen35, qwen35moe) and the state bytes one sequence holds in each. */
interface RecurrentLayout {
  readonly blocks: ReadonlyArray<boolean>
  readonly stateBytes: number
}

/** qwen35's DeltaNet blocks from its metadata (`ssm.*`, `full_attention_interval`, default 4); undefined: none. */
const recurrentOf = (file: GgufFile, arch: string, blocks: number) =>
  Effect.gen(function*() {
    const u32 = (key: string) => Gguf.getOptional(file, `${arch}.${key}`, Gguf.getU32)
    const kernel = yield* u32("ssm.conv_kernel")
    const state = yield* u32("ssm.state_size")
    const groups = yield* u32("ssm.group_count")
    const heads = yield* u32("ssm.time_step_rank")
    if (kernel === undefined || state === undefined || groups === undefined || heads === undefined) return undefined
    const interval = (yield* u32("full_attention_interval")) ?? 4
    if (interval === 0) return undefined
    const layout: RecurrentLayout = {
      blocks: Array.from({ length: blocks }, (_, il) => (il + 1) % interval !== 0),
      stateBytes: 4 * ((kernel - 1) * (2 * state * groups + state * heads) + state * state * heads)
    }
    return layout
  })

/** KV bytes per token per block, from the GGUF's attention facts, and the blocks that slide (capped caches). */
export const readKvBytesPerBlockToken = (path: string) =>
  Effect.gen(function*() {
    const file = yield* Gguf.readGgufFile(path)
    const arch = yield* Gguf.getArchitecture(file)
    const blocks = yield* Gguf.getU32(file, `${arch}.block_count`)
    const slidingWindow = slidingWindowOf(file, arch, blocks)
    const perBlock = arch === "gemma4" ? yield* gemma4KvBytesPerBlock(file, blocks, slidingWindow) : undefined
    return {
      bytes: perBlock === undefined ? yield* kvBytesPerBlockTokenOf(file, arch) : Math.max(...perBlock),
      ...(perBlock === undefined ? {} : { perBlock }),
      slidingWindow,
      recurrent: arch === "qwen35" || arch === "qwen35moe" ? yield* recurrentOf(file, arch, blocks) : undefined
    }
  })

/**
 * gemma4's KV bytes per token of each block (archs/gemma4.ts): sliding-window blocks' head size `key_length_swa`,
 * global ones `key_length`, `head_count_kv` one count per block or one for all; K and V rows of equal width.
 */
const gemma4KvBytesPerBlock = (file: GgufFile, blocks: number, sw: SlidingWindowLayout | undefined) =>
  Effect.gen(function*() {
    const u32 = (key: string) => Gguf.getOptional(file, `gemma4.${key}`, Gguf.getU32)
    const heads = yield* Gguf.getU32(file, "gemma4.attention.head_count")
    const hidden = yield* Gguf.getU32(file, "gemma4.embedding_length")
    const head = (yield* u32("attention.key_length")) ?? Math.floor(hidden / heads)
    const headSwa = (yield* u32("attention.key_length_swa")) ?? head
    const kvKey = "gemma4.attention.head_count_kv"
    const kvHeads = Array.isArray(file.metadata.get(kvKey))
      ? yield* Gguf.getNumberArray(file, kvKey)
      : Array.from({ length: blocks }, () => 0).fill((yield* u32("attention.head_count_kv")) ?? heads)
    return Array.from({ length: blocks }, (_, il) => {
      const width = (sw?.blocks[il] === true ? headSwa : head) * (kvHeads[il] ?? 0)
      return kvBytesPerTokenOfBlock(width, width)
    })
  })

const kvBytesPerBlockTokenOf = (file: GgufFile, arch: string) =>
  Effect.gen(function*() {
    const hidden = yield* Gguf.getU32(file, `${arch}.embedding_length`)
    const heads = yield* Gguf.getU32(file, `${arch}.attention.head_count`)
    const kvHeads = (yield* Gguf.getOptional(file, `${arch}.attention.head_count_kv`, Gguf.getU32)) ?? heads
    const keyLength = (yield* Gguf.getOptional(file, `${arch}.attention.key_length`, Gguf.getU32)) ?? Math.floor(hidden / heads)
    const valueLength = (yield* Gguf.getOptional(file, `${arch}.attention.value_length`, Gguf.getU32)) ?? keyLength
    // latent attention (deepseek2): one cached K row (latent + RoPE part), V is a view of it
    if (file.metadata.has(`${arch}.attention.kv_lora_rank`)) return kvBytesPerTokenOfBlock(keyLength * kvHeads, 0)
    return kvBytesPerTokenOfBlock(keyLength * kvHeads, valueLength * kvHeads)
  })

interface Ticket {
  /** The request's KV context (its bytes per stage follow the pipeline's current shape). */
  readonly contextLength: number
  readonly ready: Deferred.Deferred<void, ServeError>
  admitted: boolean
  /** Run when the ticket is released, before waiting tickets are admitted (a finished run's KV becomes an entry). */
  onRelease?: () => void
}

/** What else the budget holds: the prompt cache's entries, evicted (least recently used first) to make room. */
export interface HeldKv {
  readonly bytes: () => number
  readonly evictWhile: (needMore: () => boolean) => void
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
const makeAdmission = (sizing: KvSizing, parallel: number, limit: number, held?: HeldKv) => {
  const admitted = new Set<Ticket>()
  const queue: Array<Ticket> = []
  const used = () => {
    let sum = 0
    for (const ticket of admitted) sum += sizing.bytes(ticket.contextLength)
    return sum
  }
  const over = (contextLength: number) => used() + sizing.bytes(contextLength) + (held?.bytes() ?? 0) > sizing.budget()
  // held entries not in use give way to a request that needs their memory
  const fits = (contextLength: number) => {
    if (admitted.size >= parallel) return false
    if (over(contextLength)) held?.evictWhile(() => over(contextLength))
    return !over(contextLength)
  }
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
        let released = false
        const release = () => {
          if (released) return
          released = true
          if (ticket.admitted) admitted.delete(ticket)
          else {
            const at = queue.indexOf(ticket)
            if (at >= 0) queue.splice(at, 1)
          }
          ticket.onRelease?.()
          pump()
        }
        yield* Effect.addFinalizer(() => Effect.sync(release))
        return {
          ahead: ticket.admitted ? 0 : queue.length,
          admitted: ticket.admitted,
          wait: Deferred.await(ticket.ready),
          /** `f` runs when the ticket is released (at the latest when the scope closes). */
          onRelease: (f: () => void) => void (ticket.onRelease = f),
          /** Releases it now (its run ended and was torn down: its KV is freed or kept as an entry). */
          release
        }
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
    if (options.maxPromptTokens !== undefined && !(Number.isSafeInteger(options.maxPromptTokens) && options.maxPromptTokens >= 1)) {
      return yield* Effect.dieMessage(`maxPromptTokens must be a positive whole number, got ${options.maxPromptTokens}`)
    }
    // Prompts are tokenized and chats rendered on a worker thread when one is provided (the serve API and command
    // provide it: PromptTokenizer.ts), else in this thread over the pipeline's vocabulary; either way bounded.
    const offThread = yield* Effect.serviceOption(PromptTokenizer)
    const promptTokenizer = (pipeline: Pipeline) => Option.getOrElse(offThread, () => inThread(pipeline.vocabulary))
    const maxPromptTokens = (pipeline: Pipeline) => options.maxPromptTokens ?? Math.min(pipeline.model.maxSeqLen, 32768)
    const promptRefused = (error: PromptTooLong | TokenizerUnavailable | ChatRenderError): BadServeRequest | ServerLoading =>
      error._tag === "ChatRenderError"
        ? new BadServeRequest({ message: error.message })
        : error._tag === "PromptTooLong"
        ? new BadServeRequest({
          message: `prompt too long: ${error.atLeast ? `at least ${error.tokens} prompt tokens (from the text's length alone, ` +
            `not tokenized)` : `${error.tokens} prompt tokens`} are over the limit of ${error.limit} prompt tokens ` +
            `(swactor serve --max-prompt-tokens)`
        })
        : new ServerLoading({ message: `the prompt tokenizer is not available: ${error.message}` })
    if (!Number.isSafeInteger(parallel) || parallel < 1) return yield* Effect.dieMessage(`parallel must be a positive whole number, got ${parallel}`)

    const status = yield* Ref.make<ServerStatus>({ _tag: "Loading" })
    const started = yield* Deferred.make<{ pipeline: Pipeline; info: ServerInfo }, PipelineFaulted>()
    // The pipeline requests run on: set once it is Ready; a revival may put another in its place (fresh local agents).
    let live: { readonly pipeline: Pipeline; readonly info: ServerInfo } | undefined
    // While Reviving: the pipeline whose agents it waits for (undefined while fresh local agents start).
    let revivingOn: Pipeline | undefined
    const log = options.log ?? ((line: string) => void process.stderr.write(`${line}\n`))
    const metrics = {
      completed: 0,
      cancelled: 0,
      failed: 0,
      refused: 0,
      promptTokens: 0,
      completionTokens: 0,
      recoveries: 0,
      stragglers: 0,
      revivals: 0,
      revivalAttempts: 0,
      inFlight: 0,
      stages: new Map<number, { -readonly [K in Exclude<keyof StageMetrics, "stageIndex">]: StageMetrics[K] }>(),
      firstToken: { requests: 0, totalSeconds: 0, tokenize: 0, admit: 0, setup: 0, prefillWait: 0, prefill: 0, sample: 0, hops: 0 }
    }
    // --- prompt cache: the index of what the agents hold; dropped entries go to the agents through `dropQueue` ---
    const cacheOn = options.promptCache?.enabled ?? true
    const cacheIndex = makePromptCacheIndex({
      ...(options.promptCache?.maxEntries === undefined ? {} : { maxEntries: options.promptCache.maxEntries }),
      ...(options.promptCache?.minTokens === undefined ? {} : { minTokens: options.promptCache.minTokens })
    })
    const cacheCounts = { hits: 0, misses: 0, cachedTokens: 0 }
    const dropQueue = yield* Queue.unbounded<number>()
    const dropOnAgents = (ids: ReadonlyArray<number>) => {
      for (const id of ids) Queue.unsafeOffer(dropQueue, id)
    }
    /** In the drop queue: every entry. */
    const DROP_ALL = -1
    const heldKv: HeldKv = {
      bytes: () => cacheIndex.bytes(),
      evictWhile: (needMore) => dropOnAgents(cacheIndex.evictWhile(needMore))
    }
    /** The agents' entries are gone or unusable (another pipeline, a recovery replaced a stage): forget them all. */
    const forgetCache = () => {
      cacheIndex.clear()
      dropOnAgents([DROP_ALL])
    }
    yield* Queue.takeBetween(dropQueue, 1, 1024).pipe(
      Effect.flatMap((ids) => {
        const all = Chunk.some(ids, (id) => id === DROP_ALL)
        return live?.pipeline.dropCached?.(all ? [] : Chunk.toArray(ids), all) ?? Effect.void
      }),
      Effect.forever,
      Effect.forkScoped
    )
    let admission: ReturnType<typeof makeAdmission> | undefined
    // The pipeline's shape as its runs were last planned: the most blocks on one stage (more after a recovery onto
    // fewer stages, fewer again when a node rejoins). KV bytes per request and the default budget follow it.
    const shape: {
      layersPerStage: number
      kvBytesPerBlockToken: number
      kvBytesPerBlock?: ReadonlyArray<number> | undefined
      maxSeqLen: number
      slidingWindow?: SlidingWindowLayout | undefined
      ranges?: ReadonlyArray<readonly [number, number]>
      recurrent?: RecurrentLayout | undefined
    } = { layersPerStage: 0, kvBytesPerBlockToken: 0, maxSeqLen: 0 }
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
        const before = kvBytesPerSequence(shape, shape.maxSeqLen)
        shape.ranges = update.stages.map((s) => [s.layers[0], s.layers[1]] as const)
        if (layers === shape.layersPerStage && kvBytesPerSequence(shape, shape.maxSeqLen) === before) return Effect.void
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

    const infoOf = (pipeline: Pipeline): ServerInfo => ({
      modelId: pipeline.model.modelId,
      model: pipeline.model,
      stageCount: pipeline.stageCount,
      parallel
    })
    /** A pipeline of its own scope (a child of `parent`): a revival may close it (its local agents stopped) and open another. */
    interface Generation {
      readonly pipeline: Pipeline
      readonly scope: Scope.CloseableScope
    }
    const openGeneration = (parent: Scope.Scope) =>
      Effect.gen(function*() {
        const scope = yield* Scope.fork(parent, ExecutionStrategy.sequential)
        return yield* orchestrator.pipeline(options).pipe(
          Scope.extend(scope),
          Effect.map((pipeline): Generation => ({ pipeline, scope })),
          Effect.onExit((exit) => (Exit.isSuccess(exit) ? Effect.void : Scope.close(scope, Exit.void)))
        )
      })
    /** The pipeline's shape before its first run is planned (the warm-up's plan refines it). */
    const observePipeline = (pipeline: Pipeline) =>
      Effect.sync(() => {
        shape.maxSeqLen = pipeline.model.maxSeqLen
        shape.layersPerStage = Math.ceil(pipeline.model.numLayers / pipeline.stageCount)
      })
    const serveOn = (pipeline: Pipeline) =>
      Effect.gen(function*() {
        if (live !== undefined && live.pipeline !== pipeline) forgetCache()
        live = { pipeline, info: infoOf(pipeline) }
        yield* Ref.set(status, { _tag: "Ready" })
        if (admission !== undefined) yield* admission.reshaped(tooLong)
      })

    // --- revival: every agent lost; keep trying, with backoff, until a run succeeds again ---
    const revive = {
      firstMillis: Duration.toMillis(Duration.decode(options.revive?.firstDelay ?? "500 millis")),
      maxMillis: Duration.toMillis(Duration.decode(options.revive?.maxDelay ?? "10 seconds")),
      freshAfterMillis: Duration.toMillis(Duration.decode(options.revive?.freshAgentsAfter ?? "30 seconds"))
    }
    /** The wait before attempt n (1, 2, ...): first, doubling, capped. */
    const reviveDelay = (attempt: number) => Math.min(revive.maxMillis, revive.firstMillis * 2 ** Math.min(attempt - 1, 30))
    const seconds = (millis: number) => `${(millis / 1000).toFixed(millis < 10_000 ? 1 : 0)} s`
    const revivalAgentOf = (member: PipelineMember): RevivalAgent => ({
      address: member.agent.node.address,
      pid: member.agent.pid,
      state: member.exited ? "exited" : member.state,
      detail: member.state === "up" ? "" : member.detail
    })
    const agentWords = (agent: RevivalAgent) =>
      `${agent.address} (pid ${agent.pid}) ${agent.state}${agent.detail === "" ? "" : `: ${agent.detail}`}`
    /** What a request is told while the server revives. */
    const revivingError = (s: Extract<ServerStatus, { _tag: "Reviving" }>) => {
      const next = s.nextAttemptAtMillis === null ? 0 : Math.max(0, s.nextAttemptAtMillis - Date.now())
      const waiting = s.waitingFor.filter((agent) => agent.state !== "up")
      return new ServerReviving({
        retryAfterSeconds: Math.max(1, Math.ceil(next / 1000)),
        message: `the pipeline is being revived: ${s.message} ${seconds(Date.now() - s.sinceMillis)} ago; ` +
          (s.nextAttemptAtMillis === null ? `attempt ${s.attempts + 1} is running` : `attempt ${s.attempts + 1} in ${seconds(next)}`) +
          (s.waitingFor.length === 0
            ? ", on fresh local agents"
            : waiting.length === 0
            ? ""
            : `, waiting for ${waiting.length} agent(s) to answer again (/health names them)`)
      })
    }

    type Attempt =
      | { readonly _tag: "Revived"; readonly generation: Generation; readonly words: string }
      | {
        readonly _tag: "NotYet"
        readonly generation: Generation | undefined
        readonly words: string
        /** Nothing was tried: no agent answers yet. */
        readonly waiting: boolean
      }

    /**
     * One attempt: on the agents that answer again (a run must succeed on them); else, local agents that all exited
     * or that have been given up on are stopped and a fresh pipeline is set up; else (remote nodes, or local ones
     * still within `freshAgentsAfter`) nothing to do but wait for them.
     */
    const attemptRevival = (
      parent: Scope.Scope,
      generation: Generation | undefined,
      sinceMillis: number
    ): Effect.Effect<Attempt> =>
      Effect.gen(function*() {
        if (generation !== undefined) {
          const members = yield* generation.pipeline.members
          const answering = members.filter((m) => m.state === "up")
          if (answering.length > 0) {
            const names = answering.map((m) => `${m.agent.node.address} (pid ${m.agent.pid})`).join(", ")
            const run = yield* Effect.either(warmUp(generation.pipeline))
            return Either.isRight(run)
              ? { _tag: "Revived", generation, words: `a run succeeded on the agents that answer again: ${names}` } as const
              : {
                _tag: "NotYet",
                generation,
                words: `a run on the agents that answer again (${names}) failed: ${errorWords(run.left)}`,
                waiting: false
              } as const
          }
          const waited = Date.now() - sinceMillis
          const allExited = members.every((m) => m.exited)
          if (!generation.pipeline.localAgents || (!allExited && waited < revive.freshAfterMillis)) {
            return {
              _tag: "NotYet",
              generation,
              words: `no agent answers yet: ${members.map((m) => agentWords(revivalAgentOf(m))).join("; ")}`,
              waiting: true
            } as const
          }
          // Given up on (or gone): stopped (SIGTERM, then SIGKILL: a stopped process too) before fresh ones start.
          yield* Scope.close(generation.scope, Exit.void)
        }
        const opened = yield* Effect.either(openGeneration(parent))
        if (Either.isLeft(opened)) {
          return { _tag: "NotYet", generation: undefined, words: `setting up fresh local agents failed: ${errorWords(opened.left)}`, waiting: false } as const
        }
        const fresh = opened.right
        yield* observePipeline(fresh.pipeline)
        const run = yield* Effect.either(warmUp(fresh.pipeline))
        if (Either.isLeft(run)) {
          yield* Scope.close(fresh.scope, Exit.void)
          return { _tag: "NotYet", generation: undefined, words: `a run on fresh local agents failed: ${errorWords(run.left)}`, waiting: false } as const
        }
        const pids = fresh.pipeline.agents.map((a) => a.pid).join(", ")
        return {
          _tag: "Revived",
          generation: fresh,
          words: `a run succeeded on ${fresh.pipeline.agents.length} fresh local agents (pids ${pids}); the old ones were stopped`
        } as const
      })

    /** Every agent of `lost`'s pipeline was lost: Reviving until an attempt succeeds; returns the generation serving again. */
    const reviveFrom = (parent: Scope.Scope, lost: Generation, message: string) =>
      Effect.gen(function*() {
        const sinceMillis = Date.now()
        let generation: Generation | undefined = lost
        revivingOn = lost.pipeline
        let attempts = 0
        let lastAttempt: string | undefined
        const waitingFor = () =>
          generation === undefined
            ? Effect.succeed([] as ReadonlyArray<RevivalAgent>)
            : Effect.map(generation.pipeline.members, (members) => members.map(revivalAgentOf))
        const setReviving = (nextAttemptAtMillis: number | null) =>
          Effect.flatMap(waitingFor(), (agents) =>
            Ref.set(status, {
              _tag: "Reviving",
              message,
              sinceMillis,
              attempts,
              nextAttemptAtMillis,
              waitingFor: agents,
              ...(generation === undefined || generation.pipeline.localAgents
                ? { freshAgentsAtMillis: sinceMillis + revive.freshAfterMillis }
                : {}),
              ...(lastAttempt === undefined ? {} : { lastAttempt })
            }))
        yield* setReviving(Date.now() + reviveDelay(1))
        live = undefined
        // Requests waiting for admission cannot run now: told so, as new ones are.
        const now = yield* Ref.get(status)
        if (admission !== undefined && now._tag === "Reviving") yield* admission.failAll(revivingError(now))
        log(
          `swactor serve: ${message}: ${(yield* waitingFor()).map(agentWords).join("; ")}; reviving the pipeline ` +
            `(attempts every ${seconds(revive.firstMillis)}, doubling to ${seconds(revive.maxMillis)})`
        )
        // Until an attempt has found agents answering, one that answers again (rejoined: PipelineSetup) starts the
        // next attempt early (never sooner than `firstDelay` after the last); after a failed run on them, the backoff
        // alone paces the attempts. Local agents are given up on at `freshAgentsAfter`, not at the next backoff step.
        let wakeOnAnswer = true
        const someoneAnswers = Effect.suspend(() =>
          generation === undefined
            ? Effect.never
            : generation.pipeline.members.pipe(
              Effect.repeat({ schedule: Schedule.spaced("100 millis"), until: (members) => members.some((m) => m.state === "up") }),
              Effect.asVoid
            )
        )
        while (true) {
          const untilFresh = sinceMillis + revive.freshAfterMillis - Date.now()
          const delay = generation !== undefined && generation.pipeline.localAgents && untilFresh > 0
            ? Math.min(reviveDelay(attempts + 1), Math.max(revive.firstMillis, untilFresh))
            : reviveDelay(attempts + 1)
          yield* setReviving(Date.now() + delay)
          yield* (wakeOnAnswer && delay > revive.firstMillis
            ? Effect.race(Effect.sleep(delay), Effect.zipRight(Effect.sleep(revive.firstMillis), someoneAnswers))
            : Effect.sleep(delay))
          yield* setReviving(null)
          attempts++
          metrics.revivalAttempts++
          const attempt: Attempt = yield* attemptRevival(parent, generation, sinceMillis)
          generation = attempt.generation
          revivingOn = generation?.pipeline
          wakeOnAnswer = attempt._tag === "NotYet" && attempt.waiting
          lastAttempt = attempt.words
          if (attempt._tag === "Revived") {
            metrics.revivals++
            revivingOn = undefined
            log(
              `swactor serve: reviving the pipeline: attempt ${attempts}: ${attempt.words}; serving again ` +
                `${seconds(Date.now() - sinceMillis)} after every agent was lost`
            )
            return attempt.generation
          }
          log(`swactor serve: reviving the pipeline: attempt ${attempts}: ${attempt.words}; next attempt in at most ${seconds(reviveDelay(attempts + 1))}`)
        }
      })

    /** Completes once every agent of the pipeline is lost (runs recover on the others until then). */
    const everyAgentLost = (pipeline: Pipeline) =>
      pipeline.alive.pipe(
        Effect.repeat({ schedule: Schedule.spaced("250 millis"), until: (alive) => alive.length === 0 }),
        Effect.asVoid
      )

    // --- setup, in the background: /health answers Loading meanwhile ---
    yield* Effect.gen(function*() {
      const parent = yield* Effect.scope
      let generation = yield* openGeneration(parent)
      const pipeline = generation.pipeline
      const kv = yield* readKvBytesPerBlockToken(options.model)
      shape.kvBytesPerBlockToken = kv.bytes
      shape.kvBytesPerBlock = kv.perBlock
      shape.slidingWindow = kv.slidingWindow
      shape.recurrent = kv.recurrent
      yield* observePipeline(pipeline)
      admission = makeAdmission(sizing, parallel, queueLimit, heldKv)
      // Loads every stage's weights now, so the first request starts on a warm pipeline.
      yield* warmUp(pipeline)
      // While idle, keep the agents' weights from expiring out of their model caches.
      const keepWarm = Duration.decode(options.keepWarmEvery ?? "4 minutes")
      yield* Effect.suspend(() =>
        live !== undefined && metrics.inFlight === 0 && performance.now() - lastRunAt >= Duration.toMillis(keepWarm) / 2
          ? warmUp(live.pipeline).pipe(Effect.tap(() => Effect.sync(() => (lastRunAt = performance.now()))), Effect.ignore)
          : Effect.void
      ).pipe(Effect.repeat(Schedule.spaced(Duration.toMillis(keepWarm) / 2)), Effect.forkScoped)
      yield* serveOn(pipeline)
      yield* Deferred.succeed(started, { pipeline, info: infoOf(pipeline) })
      // Without recovery, the first lost agent faults the server for good.
      if (options.recovery?.maxAttempts === 0) {
        const lost = yield* pipeline.lost
        yield* fault(`lost agent ${lost.node.address}: ${lost.reason}`)
        return yield* Effect.never
      }
      // A lost agent leaves the pipeline (its runs recover on the others); with none left, the server revives it.
      while (true) {
        yield* everyAgentLost(generation.pipeline)
        generation = yield* reviveFrom(parent, generation, "every agent of the pipeline was lost")
        yield* serveOn(generation.pipeline)
      }
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
      if (s._tag === "Reviving") return yield* revivingError(s)
      if (live === undefined) return yield* new ServerLoading({ message: "the model is still loading" })
      return live
    })

    const validate = (request: ServeRequest, maxSeqLen: number, prompt: ReadonlyArray<number>, vocabSize: number) => {
      const s = request.sampling ?? {}
      const maxTokens = request.maxTokens ?? 128
      const bad = (message: string) => Effect.fail(new BadServeRequest({ message }))
      // The prompt, max tokens, token ids and context: the same rules and words as `swactor run` (RequestChecks.ts).
      const problem = generationProblem({
        text: request.prompt,
        tokens: prompt,
        maxTokens,
        contextLength: maxSeqLen,
        vocabSize,
        maxTokensField: "max_tokens"
      })
      if (problem !== undefined) return bad(problem)
      if (s.temperature !== undefined && !(Number.isFinite(s.temperature) && s.temperature >= 0 && s.temperature <= 100)) {
        return bad(`temperature must be between 0 and 100, got ${s.temperature}`)
      }
      if (s.topK !== undefined && !(Number.isSafeInteger(s.topK) && s.topK >= 0)) return bad(`top_k must be a whole number ≥ 0, got ${s.topK}`)
      if (s.topP !== undefined && !(s.topP > 0 && s.topP <= 1)) return bad(`top_p must be in (0, 1], got ${s.topP}`)
      if (s.minP !== undefined && !(s.minP >= 0 && s.minP <= 1)) return bad(`min_p must be in [0, 1], got ${s.minP}`)
      if (s.seed !== undefined && !Number.isSafeInteger(s.seed)) return bad(`seed must be a whole number, got ${s.seed}`)
      return Effect.succeed(maxTokens)
    }

    /** The last of the prompt's final tokens that decodes to text (else the token of "a"): context for a token's text. */
    const textAnchor = (vocabulary: Pipeline["vocabulary"], prompt: ReadonlyArray<number>): ReadonlyArray<number> => {
      for (let i = prompt.length - 1; i >= Math.max(0, prompt.length - 16); i--) {
        if (vocabulary.detokenize([prompt[i]!]).trim() !== "") return [prompt[i]!]
      }
      return vocabulary.tokenize("a").slice(-1)
    }

    /**
     * Requests between arrival and their run (tokenizing, checks, admission), not queued: a run started now tells the
     * stages how many are right behind it (RunRequest.arriving), so requests sent together prefill together.
     */
    let arriving = 0
    const generate = (request: ServeRequest): Stream.Stream<ServeEvent, ServeError> =>
      Stream.unwrapScoped(
        Effect.gen(function*() {
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
          const prompt = typeof request.prompt === "string"
            ? yield* promptTokenizer(pipeline).tokenize(request.prompt, limit).pipe(Effect.mapError(promptRefused))
            : request.prompt.length > limit
            ? yield* promptRefused(new PromptTooLong({ tokens: request.prompt.length, atLeast: false, limit }))
            : request.prompt
          const maxTokens = yield* validate(request, pipeline.model.maxSeqLen, prompt, pipeline.vocabulary.vocabSize)
          const contextLength = runContextLength(pipeline.model.maxSeqLen, prompt.length, maxTokens)
          if (sizing.bytes(contextLength) > sizing.budget()) return yield* tooLong(contextLength)
          // Prompt cache: the longest held prefix, now the most recently used entry, so admission's eviction (which may
          // need its memory) takes it last; in use from admission on (runAdmitted)
          const match = cacheOn ? cacheIndex.match(prompt) : undefined
          const queuedAt = performance.now()
          const ticket = yield* admission!.enter(contextLength).pipe(Effect.tapError(() => Effect.sync(() => metrics.refused++)))
          const queued: ReadonlyArray<ServeEvent> = ticket.admitted ? [] : [{ _tag: "Queued", ahead: ticket.ahead }]
          if (!ticket.admitted) leave() // waits for memory: not right behind anyone
          const run = runAdmitted(prompt, maxTokens, request, { receivedAt, queuedAt, leave }, contextLength, ticket, match)
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
        Effect.gen(function*() {
          const { pipeline } = yield* current
          const admittedAt = performance.now()
          arrival.leave()
          const behind = arriving
          let readyAt = admittedAt
          let firstAt: number | undefined
          // Prompt cache: adopt `match` if admission left it (in use until the run ends: never evicted); keep this run's
          // KV as a new entry once it completes (added when its admission is released, its memory then the entry's),
          // else drop it.
          const adopt = match !== undefined && cacheIndex.has(match.entry) ? match : undefined
          if (adopt !== undefined) cacheIndex.pin(adopt.entry)
          let pinned = adopt !== undefined
          const unpin = () => {
            if (pinned && adopt !== undefined) cacheIndex.unpin(adopt.entry)
            pinned = false
          }
          yield* Effect.addFinalizer(() => Effect.sync(unpin))
          const keepId = cacheOn ? cacheIndex.nextId() : undefined
          const generatedIds: Array<number> = []
          let cachedTokens = 0
          let keptTokens = 0
          // Ended by a stop string: the run is stopped, so no summary says what the stages kept; but every stage had
          // prefilled the whole prompt before the first token was sampled, and an entry holds prompt positions only
          // (NodeAgent), so the entry is the prompt. A stage that kept nothing only means a full prefill (PC4).
          let stoppedByText = false
          ticket.onRelease(() => {
            unpin()
            if (keepId === undefined) return
            const kept = keptTokens > 0 ? keptTokens : stoppedByText ? prompt.length : 0
            if (kept === 0 || live?.pipeline !== pipeline) return dropOnAgents([keepId])
            const tokens = [...prompt, ...generatedIds].slice(0, kept)
            dropOnAgents(cacheIndex.add({ id: keepId, tokens, bytes: sizing.bytes(contextLength) }))
            // over the budget with it (requests admitted meanwhile): the least recently used not in use go
            heldKv.evictWhile(() => admission !== undefined && admission.state().used + cacheIndex.bytes() > sizing.budget())
          })
          // a stop string stops the run; at an end-of-generation token it ends by itself, and its KV may be kept
          let stopRun = true
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
          // log-probs asked for: each token's entry (its text from the vocabulary) goes out with its text
          const logprobs = request.sampling?.logprobs === undefined ? undefined : makeLogprobAligner()
          // a token's text as it reads after other text (its leading space kept): decoded after a token that has text
          const anchor = logprobs === undefined ? [] : textAnchor(pipeline.vocabulary, prompt)
          const piece = (id: number) => pipeline.vocabulary.detokenize([id], anchor)
          const textLogprob = (id: number, p: TokenLogprob): TextLogprob => ({
            token: piece(id),
            logprob: p.logprob,
            top: p.top.map((t) => ({ token: piece(t.tokenId), logprob: t.logprob }))
          })
          let completionTokens = 0
          let finished = false
          const done = (finishReason: "stop" | "length", stopSequence?: string): ServeEvent => {
            finished = true
            outcome = "completed"
            return {
              _tag: "Done",
              finishReason,
              ...(stopSequence === undefined ? {} : { stopSequence }),
              promptTokens: prompt.length,
              completionTokens,
              cachedTokens
            }
          }
          const onUpdate = (update: RunUpdate): ReadonlyArray<ServeEvent> => {
            if (update._tag === "StageReady") readyAt = performance.now()
            if (update._tag === "Token" && firstAt === undefined) firstAt = performance.now()
            if (update._tag === "PromptCached") {
              cachedTokens = update.cachedTokens
              cacheCounts.cachedTokens += cachedTokens
              if (cachedTokens > 0) cacheCounts.hits++
              else cacheCounts.misses++
            }
            if (update._tag === "Finished") {
              // torn down on every stage: its KV is an entry now (before the client hears Done and sends its next turn)
              keptTokens = update.summary.promptCache?.keptTokens ?? 0
              ticket.release()
            }
            // a stage was replaced: what the agents hold no longer covers the pipeline
            if (update._tag === "Recovering" && cacheOn) forgetCache()
            if (finished) return []
            if (update._tag === "Token") {
              if (update.token.tokenId >= 0) {
                completionTokens++
                metrics.completionTokens++
                generatedIds.push(update.token.tokenId)
                if (pipeline.vocabulary.isEndOfGeneration(update.token.tokenId)) {
                  if (keepId !== undefined) stopRun = false
                  const rest = stop.flush()
                  return [...(rest === "" ? [] : [text(rest, logprobs?.flush())]), done("stop")]
                }
                if (logprobs !== undefined && update.token.logprob !== undefined) {
                  logprobs.add(textLogprob(update.token.tokenId, update.token.logprob), update.token.text.length)
                }
              }
              const match = stop.push(update.token.text)
              const entries = match.stopped ? logprobs?.stop(match.text.length) : logprobs?.release(match.text.length)
              const out = match.text === "" ? [] : [text(match.text, entries)]
              if (match.stopped) stoppedByText = true
              return match.stopped ? [...out, done("stop", match.stop)] : out
            }
            if (update._tag === "Recovered") metrics.recoveries++
            if (update._tag === "StageStraggler") stageMetrics(update.straggler.stageIndex).stragglerTokens++
            if (update._tag === "Finished") {
              metrics.stragglers += update.summary.stragglers.length
              recordStages(update)
              if (firstAt !== undefined) recordFirstToken(update.summary, { ...arrival, admittedAt, readyAt, firstAt })
              const rest = stop.flush()
              return [...(rest === "" ? [] : [text(rest, logprobs?.flush())]), done(update.summary.outcome === "Eos" ? "stop" : "length")]
            }
            return []
          }
          const text = (piece: string, entries?: ReadonlyArray<TextLogprob>): ServeEvent => ({
            _tag: "Text",
            text: piece,
            completionTokens,
            ...(entries === undefined ? {} : { logprobs: entries })
          })
          const admitted: ServeEvent = { _tag: "Admitted", promptTokens: prompt.length, queuedMillis: admittedAt - arrival.queuedAt }
          return Stream.concat(
            Stream.make(admitted),
            pipeline.run({
              prompt,
              maxTokens,
              ...(request.sampling === undefined ? {} : { sampling: request.sampling }),
              ...(keepId === undefined ? {} : { promptCache: { keep: keepId, ...(adopt === undefined ? {} : { adopt }) } }),
              ...(behind > 0 ? { arriving: behind } : {})
            }).pipe(
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
        peakResidentBytes: 0,
        kvBytes: 0,
        prefillSeconds: 0,
        prefillWaitSeconds: 0
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
          m.kvBytes = stage.kvBytes
        }
      }
    }

    /** A completed request's time to first token, split into its phases (FirstTokenPhases); per stage its prefill. */
    const recordFirstToken = (
      summary: RunSummary,
      at: {
        readonly receivedAt: number
        readonly queuedAt: number
        readonly admittedAt: number
        readonly readyAt: number
        readonly firstAt: number
      }
    ) => {
      const f = metrics.firstToken
      let onStages = 0
      let wait = 0
      let sample = 0
      for (const stage of summary.stages) {
        const m = stageMetrics(stage.stageIndex)
        m.prefillSeconds += (stage.prefillComputeMillis - stage.prefillWaitMillis) / 1000
        m.prefillWaitSeconds += stage.prefillWaitMillis / 1000
        onStages += stage.prefillComputeMillis
        wait += stage.prefillWaitMillis
        sample += stage.firstSampleMillis
      }
      f.requests++
      f.totalSeconds += (at.firstAt - at.receivedAt) / 1000
      f.tokenize += (at.queuedAt - at.receivedAt) / 1000
      f.admit += (at.admittedAt - at.queuedAt) / 1000
      f.setup += (at.readyAt - at.admittedAt) / 1000
      f.prefillWait += wait / 1000
      f.prefill += (onStages - wait) / 1000
      f.sample += sample / 1000
      f.hops += Math.max(0, at.firstAt - at.readyAt - onStages - sample) / 1000
    }

    const snapshot: Effect.Effect<ServerMetrics> = Effect.gen(function*() {
      const state = admission?.state() ?? { used: 0, running: 0, queued: 0 }
      const up = Option.fromNullable(live)
      const agents = Option.isSome(up)
        ? yield* Effect.forEach(yield* up.value.pipeline.alive, (agent) =>
          agent.capacity.pipe(
            Effect.timeout("1 second"),
            Effect.map((c) => ({
              address: agent.node.address,
              pid: agent.pid,
              activeStages: c.activeStages,
              ...(c.openSessions === undefined ? {} : { openSessions: c.openSessions }),
              ...(c.stepCosts === undefined ? {} : { stepCosts: c.stepCosts })
            })),
            Effect.orElseSucceed(() => ({ address: agent.node.address, pid: agent.pid, activeStages: -1 }))
          ), { concurrency: "unbounded" })
        : []
      return {
        requests: { completed: metrics.completed, cancelled: metrics.cancelled, failed: metrics.failed, refused: metrics.refused },
        promptTokens: metrics.promptTokens,
        completionTokens: metrics.completionTokens,
        recoveries: metrics.recoveries,
        stragglers: metrics.stragglers,
        revivals: metrics.revivals,
        revivalAttempts: metrics.revivalAttempts,
        promptCache: {
          enabled: cacheOn,
          hits: cacheCounts.hits,
          misses: cacheCounts.misses,
          evictions: cacheIndex.evictions(),
          cachedTokens: cacheCounts.cachedTokens,
          entries: cacheIndex.size(),
          bytes: cacheIndex.bytes(),
          lru: cacheIndex.order().map((e) => ({ entry: e.id, tokens: e.tokens.length }))
        },
        inFlight: metrics.inFlight,
        queued: state.queued,
        kvReservedBytes: state.used,
        kvBudgetBytes: Option.isSome(up) ? sizing.budget() : 0,
        stages: [...metrics.stages].sort(([a], [b]) => a - b).map(([stageIndex, m]) => ({ stageIndex, ...m })),
        firstToken: { ...metrics.firstToken },
        agents
      }
    })

    // Ready, with the agents lost so far (the pipeline goes on without them).
    const currentStatus = Effect.gen(function*() {
      const s = yield* Ref.get(status)
      // Reviving: each agent's state as membership sees it now.
      if (s._tag === "Reviving" && revivingOn !== undefined) {
        return { ...s, waitingFor: (yield* revivingOn.members).map(revivalAgentOf) }
      }
      if (s._tag !== "Ready" || live === undefined) return s
      const alive = new Set((yield* live.pipeline.alive).map((a) => a.node.address))
      const lost = live.pipeline.agents.map((a) => a.node.address).filter((address) => !alive.has(address))
      return lost.length === 0 ? s : { _tag: "Ready" as const, lostAgents: lost }
    })

    return Server.of({
      status: currentStatus,
      ready: Deferred.await(started).pipe(Effect.map((s) => s.info)),
      generate,
      // a chat being rendered is a request on its way as well (its generate follows)
      formatChat: (messages, tools) =>
        Effect.acquireUseRelease(
          Effect.sync(() => arriving++),
          () =>
            Effect.flatMap(current, ({ pipeline }) =>
              promptTokenizer(pipeline).formatChat(messages, maxPromptTokens(pipeline), tools).pipe(Effect.mapError(promptRefused))),
          () => Effect.sync(() => arriving--)
        ),
      metrics: snapshot
    })
  })

/** A Server over the Orchestrator in context: its pipeline lives as long as the layer. */
export const layer = (options: ServeOptions): Layer.Layer<Server, never, Orchestrator> => Layer.scoped(Server, make(options))
