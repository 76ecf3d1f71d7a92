/**
 * A warm pipeline serving many requests: each request is its own run on it; admission by a KV memory
 * budget per stage (and at most `parallel` sequences), a bounded queue beyond it, refusal beyond the queue.
 * `generate` is a Stream per request; interrupting it cancels the run (its KV freed on every stage).
 */
import type { DiscoveredPoolService } from "./DiscoveredPool.js"
import type { SpeculativeOptions } from "./Speculation.js"
import { Context, type Duration, type Effect, Schema, type Stream } from "effect"
import type { NodeCapacity } from "../domain/controlRpc.js"
import type { ModelFacts } from "../domain/plan.js"
import type { PipelineOptions, SamplingOptions } from "./Orchestrator.js"
import type { ChatMessage, FormattedChat } from "./Tokenizer.js"
import type { ChatToolOptions } from "./Tools.js"

export interface ServeOptions extends PipelineOptions {
  /** Sequences running at once at most (default 4). */
  readonly parallel?: number
  /** KV cache bytes per stage shared by the running sequences (default: `parallel` sequences of up to 4,096 tokens). */
  readonly kvBudgetBytes?: number
  /** Requests waiting for admission at most (default 64); more are refused with ServerBusy. */
  readonly queueLimit?: number
  /**
   * Prompt tokens a request may have at most (default: the model's context length, at most 32,768); more are refused
   * with BadServeRequest, a text prompt whose length alone guarantees more before it is tokenized.
   */
  readonly maxPromptTokens?: number
  /** While idle, a one-token run this often keeps the agents' weights loaded (default 4 minutes). */
  readonly keepWarmEvery?: Duration.DurationInput
  /** How a server whose agents were all lost keeps trying to serve again (see ServerStatus `Reviving`). */
  readonly revive?: ReviveOptions
  /** Where the server writes its lines about revival (default: stderr, one line each). */
  readonly log?: (line: string) => void
  /** Reuse of a shared prompt prefix's KV across requests (see PromptCacheOptions; default on). */
  readonly promptCache?: PromptCacheOptions
  /**
   * `serve --discover`: the discovered pool, heard while the server runs. A node that appears is added by a re-plan
   * when the plan over the pool is better (src/layers/server/Replan.ts); a node the pipeline loses is buried there.
   */
  readonly discovered?: DiscoveredPoolService
  /** How much lower (a fraction) the slowest stage's time per token must be for a re-plan (default 0.2). */
  readonly replanMargin?: number
  /** Speculative decoding for each request while it is alone on the pipeline (RunRequest.speculative; default off). */
  readonly speculative?: SpeculativeOptions
}

/**
 * The prompt cache: a finished request's KV (prompt + generated) stays on every stage as an entry; a later prompt that
 * starts with an entry's tokens prefills only the rest. Entries count against the KV budget; the least recently used
 * not in use are dropped when a request needs the memory, or beyond `maxEntries`.
 */
export interface PromptCacheOptions {
  /** Default true. */
  readonly enabled?: boolean
  /** Most entries held (default 16). */
  readonly maxEntries?: number
  /** Shortest shared prefix worth reusing (default 8 tokens). */
  readonly minTokens?: number
}

/**
 * Every agent lost: attempts back off from `firstDelay` (default 0.5 s), doubling, to `maxDelay` (default 10 s), for as
 * long as the server lives. An attempt runs on the agents that answer again (a stalled agent that resumed, a node
 * restarted at its address); local agents whose processes all exited, or that have not answered for
 * `freshAgentsAfter` (default 30 s) since they were lost, are stopped and fresh local agents take their place.
 */
export interface ReviveOptions {
  readonly firstDelay?: Duration.DurationInput
  readonly maxDelay?: Duration.DurationInput
  readonly freshAgentsAfter?: Duration.DurationInput
}

/** An agent of the pipeline while the server revives it. */
export interface RevivalAgent {
  readonly address: string
  readonly pid: number
  /** up, waiting (no answer yet), lost (given up on by its heartbeats), exited (its process ended: local agents). */
  readonly state: "up" | "waiting" | "lost" | "exited"
  /** Why, in words ("" when up). */
  readonly detail: string
}

export interface ServeRequest {
  /** Text (tokenized, BOS as the model wants) or token ids as they are (e.g. a formatted chat). */
  readonly prompt: string | ReadonlyArray<number>
  /** Default 128. */
  readonly maxTokens?: number
  readonly sampling?: SamplingOptions
  /** The text ends before the first of these (also when one spans several tokens). */
  readonly stop?: ReadonlyArray<string>
  /**
   * `performance.now()` when the request arrived, if before `generate` (e.g. HTTP rendered its chat first): the time to
   * first token and its `tokenize` phase count from it.
   */
  readonly receivedAt?: number
}

export type FinishReason = "stop" | "length"

/** A generated token's log-probability, its text from the vocabulary, and the most likely alternatives (most likely first). */
export interface TextLogprob {
  readonly token: string
  readonly logprob: number
  readonly top: ReadonlyArray<{ readonly token: string; readonly logprob: number }>
}

export type ServeEvent =
  /** The request waits in the admission queue (`ahead` requests before it); Admitted follows. */
  | { readonly _tag: "Queued"; readonly ahead: number }
  /** The request was admitted (after `queuedMillis` in the queue); its run starts. */
  | { readonly _tag: "Admitted"; readonly promptTokens: number; readonly queuedMillis: number }
  /**
   * More text; `completionTokens` so far. With `sampling.logprobs`: the entries of the tokens whose text begins in this
   * piece (TextLogprobs.ts keeps them aligned with text the stop matcher holds back or cuts).
   */
  | {
      readonly _tag: "Text"
      readonly text: string
      readonly completionTokens: number
      readonly logprobs?: ReadonlyArray<TextLogprob>
    }
  | {
      readonly _tag: "Done"
      readonly finishReason: FinishReason
      /** The stop string (ServeRequest.stop) that ended the text; absent when an end-of-generation token or max tokens did. */
      readonly stopText?: string
      readonly promptTokens: number
      readonly completionTokens: number
      /** Prompt tokens whose KV came from the prompt cache instead of a prefill (0 or absent: none). */
      readonly cachedTokens?: number
    }

export type ServerStatus =
  | { readonly _tag: "Loading" }
  /** `lostAgents`: agents the pipeline lost and runs without (absent when none). */
  | { readonly _tag: "Ready"; readonly lostAgents?: ReadonlyArray<string> }
  /**
   * Every agent of the pipeline was lost; the server keeps trying (ServeOptions.revive) and is Ready again once a run
   * succeeds on agents that answer again or on fresh local ones. Requests meanwhile fail with ServerReviving.
   */
  | {
      readonly _tag: "Reviving"
      /** Why it went down, in words ("every agent of the pipeline was lost"). */
      readonly message: string
      /** When (epoch ms). */
      readonly sinceMillis: number
      /** Attempts made so far. */
      readonly attempts: number
      /** When the next attempt starts (epoch ms); null while one is running. */
      readonly nextAttemptAtMillis: number | null
      /** The pipeline's agents it waits for, each with its state (empty while fresh local agents are being started). */
      readonly waitingFor: ReadonlyArray<RevivalAgent>
      /** Local agents: when those that still do not answer are stopped and fresh ones started (epoch ms). */
      readonly freshAgentsAtMillis?: number
      /** What the last attempt found or why it failed, in words. */
      readonly lastAttempt?: string
    }
  /** The pipeline could not be set up (or, with recovery off, lost an agent): final. */
  | { readonly _tag: "Faulted"; readonly message: string }

/** The pipeline is still being set up (agents starting, weights loading). */
export class ServerLoading extends Schema.TaggedError<ServerLoading>()("ServerLoading", {
  message: Schema.String
}) {}

/** Every agent of the pipeline was lost and the server is reviving it; try again after `retryAfterSeconds`. */
export class ServerReviving extends Schema.TaggedError<ServerReviving>()("ServerReviving", {
  retryAfterSeconds: Schema.Number,
  message: Schema.String
}) {}

/** The admission queue is full; try again after `retryAfterSeconds`. */
export class ServerBusy extends Schema.TaggedError<ServerBusy>()("ServerBusy", {
  queued: Schema.Number,
  retryAfterSeconds: Schema.Number,
  message: Schema.String
}) {}

/** The request cannot be served as asked (bad values, context too long). */
export class BadServeRequest extends Schema.TaggedError<BadServeRequest>()("BadServeRequest", {
  message: Schema.String
}) {}

/** The pipeline faulted (an agent was lost, a run faulted); `message` says it in words. */
export class PipelineFaulted extends Schema.TaggedError<PipelineFaulted>()("PipelineFaulted", {
  message: Schema.String
}) {}

export type ServeError = ServerLoading | ServerReviving | ServerBusy | BadServeRequest | PipelineFaulted

export interface StageMetrics {
  readonly stageIndex: number
  readonly computeSeconds: number
  readonly transferSeconds: number
  readonly decodeTokens: number
  /** Per completed request: the agent's micro-batches that carried its work on this stage, and their rows (summed). */
  readonly microBatches: number
  readonly batchRows: number
  /** The most sequences seen in one micro-batch on this stage. */
  readonly maxBatchSequences: number
  /** Decode steps on which this stage took over 4× its own recent median (counted as they happen, every request). */
  readonly stragglerTokens: number
  /** Measured by the stage's agent at its last completed request: compute buffers, and resident set now / at peak. */
  readonly computeBytes: number
  readonly residentBytes: number
  readonly peakResidentBytes: number
  /** KV cache bytes of one sequence on the stage, as its agent sized them (capped sliding-window caches counted). */
  readonly kvBytes: number
  /** Completed requests' prompts on this stage: engine time, and time waiting in the agent's batcher. */
  readonly prefillSeconds: number
  readonly prefillWaitSeconds: number
}

/**
 * Where the time to first token went, summed over completed requests that got a first token (`requests` of them):
 * - tokenize: from arrival (`receivedAt`) to the prompt's tokens (chat rendering included) and checks;
 * - admit: waiting for admission (memory budget, queue);
 * - setup: the run's sessions opened on every stage;
 * - prefillWait: the prompt waiting in the stages' batchers (gathering partners, behind other micro-batches);
 * - prefill: the stages' engine time on the prompt (per stage in StageMetrics);
 * - sample: the last stage sampling the first token;
 * - hops: the rest (frames between stages and back, the orchestrator's side).
 */
export interface FirstTokenPhases {
  readonly requests: number
  readonly totalSeconds: number
  readonly tokenize: number
  readonly admit: number
  readonly setup: number
  readonly prefillWait: number
  readonly prefill: number
  readonly sample: number
  readonly hops: number
}

export interface ServerMetrics {
  readonly requests: {
    readonly completed: number
    readonly cancelled: number
    readonly failed: number
    readonly refused: number
  }
  readonly promptTokens: number
  readonly completionTokens: number
  readonly inFlight: number
  readonly queued: number
  readonly kvReservedBytes: number
  readonly kvBudgetBytes: number
  readonly stages: ReadonlyArray<StageMetrics>
  readonly firstToken: FirstTokenPhases
  /** Generations resumed after a fault of their run (a lost agent, a broken transport). */
  /**
   * Speculative decoding (ServeOptions.speculative): steps that carried drafts, tokens drafted, drafts kept (the steps
   * saved: one per kept draft).
   */
  readonly speculative: { readonly steps: number; readonly drafted: number; readonly accepted: number }
  readonly recoveries: number
  /** Decoded tokens of completed requests that took over 4× the recent median. */
  readonly stragglers: number
  /** Times the server served again after every agent of its pipeline was lost (status Reviving → Ready). */
  readonly revivals: number
  /** Revival attempts made (successful or not). */
  readonly revivalAttempts: number
  /** The prompt cache: requests that reused a held prefix (hits) or found none (misses), prompt tokens not prefilled, entries. */
  readonly promptCache?: {
    readonly enabled: boolean
    readonly hits: number
    readonly misses: number
    readonly evictions: number
    readonly cachedTokens: number
    readonly entries: number
    /** KV bytes per stage the entries hold (counted against the budget beside kvReservedBytes). */
    readonly bytes: number
    /** Each entry and the tokens it holds, least recently used first (the next to be evicted). */
    readonly lru: ReadonlyArray<{ readonly entry: number; readonly tokens: number }>
  }
  /** Each agent not lost: its pid and the stages it hosts now (asked at scrape time; -1 when it did not answer). */
  /**
   * Each stage's weights on their way at start-up (a revival's too): fetched from the model's hub by its node
   * (`hf:` or URL models) or sent by this process; the latest report per stage and node.
   */
  readonly weights?: ReadonlyArray<{
    readonly stageIndex: number
    readonly address: string
    readonly source: "hub" | "orchestrator"
    readonly bytes: number
    readonly totalBytes: number
  }>
  /**
   * The pipeline as its runs were last planned: each stage's node, blocks, weight bytes and the KV bytes one sequence
   * of `contextTokens` takes on it (absent: not planned yet).
   */
  readonly plan?: {
    readonly contextTokens: number
    readonly stages: ReadonlyArray<{
      readonly stageIndex: number
      readonly address: string
      readonly layers: readonly [number, number]
      readonly weightBytes: number
      readonly kvBytes: number
    }>
  }
  /**
   * The pipeline's set-up as it went: each node's capacity as it reported it when the pool was ready, and each stage's
   * weights loaded so far (its agent's StageLoading reports; `done` once the stage reported ready).
   */
  readonly setup?: {
    readonly nodes: ReadonlyArray<{ readonly address: string; readonly capacity: NodeCapacity }>
    readonly loading: ReadonlyArray<{
      readonly stageIndex: number
      readonly loadedBytes: number
      readonly totalBytes: number
      readonly done: boolean
    }>
  }
  readonly agents: ReadonlyArray<{
    readonly address: string
    readonly pid: number
    readonly activeStages: number
    /** Its memory, cores and backend as it answered now (absent: no answer). */
    readonly capacity?: Pick<NodeCapacity, "freeMemoryBytes" | "totalMemoryBytes" | "threads" | "backend">
    /** The agent's ggml devices and their memory now (absent: no answer, or an engine without devices). */
    readonly devices?: ReadonlyArray<{
      readonly name: string
      readonly kind: string
      readonly freeBytes: number
      readonly totalBytes: number
    }>
    /** Sessions open in the agent's process and the DeltaNet state / cache bytes they hold (absent: no answer). */
    readonly openSessions?: { readonly sessions: number; readonly stateBytes: number; readonly cacheBytes: number }
    /**
     * Per block range it has loaded: the measured decode step (ms) by rows, and its batcher's last choice of rows per
     * decode micro-batch for `decoders` sequences through `stages` stages (`defaultRows`: ceil(decoders / stages)).
     */
    readonly stepCosts?: ReadonlyArray<{
      readonly layers: readonly [number, number]
      readonly costs: ReadonlyArray<{ readonly rows: number; readonly millis: number }>
      readonly probe: "off" | "pending" | "done"
      readonly choice?:
        | { readonly decoders: number; readonly stages: number; readonly rows: number; readonly defaultRows: number }
        | undefined
    }>
  }>
}

export interface ServerInfo {
  readonly modelId: string
  readonly model: ModelFacts
  readonly stageCount: number
  readonly parallel: number
}

export interface ServerService {
  readonly status: Effect.Effect<ServerStatus>
  /** Waits until the pipeline is ready (fails if setting it up failed). */
  readonly ready: Effect.Effect<ServerInfo, PipelineFaulted>
  /**
   * One request: [Queued,] Admitted, Text…, Done. Refusals (loading, busy, bad request) fail before the first
   * event. Interrupting the stream cancels the run.
   */
  readonly generate: (request: ServeRequest) => Stream.Stream<ServeEvent, ServeError>
  /**
   * Chat messages (and tools: Tools.ts) through the model's chat template (BadServeRequest: more prompt tokens than
   * `maxPromptTokens`, or tools that cannot be rendered).
   */
  readonly formatChat: (
    messages: ReadonlyArray<ChatMessage>,
    tools?: ChatToolOptions
  ) => Effect.Effect<FormattedChat, ServerLoading | ServerReviving | BadServeRequest | PipelineFaulted>
  readonly metrics: Effect.Effect<ServerMetrics>
}

export class Server extends Context.Tag("swactor/Server")<Server, ServerService>() {}
