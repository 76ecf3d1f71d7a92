/**
 * The orchestrator: plans a run over a pool of node agents, drives the run FSM actor, executes
 * its commands through the agent links and the data plane, and streams what the run produces.
 */
import type { TokenTimeline } from "./Timeline.js"
import type { SpeculativeOptions } from "./Speculation.js"
import { Context, type Duration, type Effect, Schema, type Scope, type Stream } from "effect"
import type { ModelLoadError } from "../domain/gguf.js"
import type { DeviceBytes, StageDeviceSplit } from "../domain/engine.js"
import type { DeviceShare } from "./DeviceFit.js"
import type { LayerRange, ModelFacts, ModelLayout, PlacementChoice, PoolNode } from "../domain/plan.js"
import type { PlacementRejection, PlanRejection } from "../domain/planErrors.js"
import { RunFaultReason } from "../domain/runEvents.js"
import type { TransportAddress } from "../domain/frames.js"
import { type NodeId, RunId } from "../domain/ids.js"
import type { AgentSpawnError } from "./AgentLinks.js"
import type { AgentUnavailable } from "./AgentLinks.js"
import type { NodeCapacity, NodeEndpoint, NodeLost, PoolNotReady } from "./Membership.js"
import type { ModelTokenizer, TokenizerError } from "./Tokenizer.js"

export interface SamplingOptions {
  /** 0 (default) is greedy. */
  readonly temperature?: number
  /** 0 = no limit (default 40 when temperature > 0). */
  readonly topK?: number
  /** Nucleus sampling: keep the most likely tokens whose probabilities add up to this (1 = off, the default). */
  readonly topP?: number
  /** Drop tokens less likely than this fraction of the most likely one (0 = off, the default). */
  readonly minP?: number
  /** Same seed, same model, same prompt → same text (random when omitted). */
  readonly seed?: number
  /** Locally typical sampling (1 = off, the default). */
  readonly typicalP?: number
  /** Divides (positive logits) or multiplies (negative) the logits of recent tokens (1 = off, the default). */
  readonly repeatPenalty?: number
  /** Subtracted from the logits of tokens seen recently (0 = off, the default; OpenAI's presence_penalty). */
  readonly presencePenalty?: number
  /** Subtracted once per occurrence of a recent token (0 = off, the default; OpenAI's frequency_penalty). */
  readonly frequencyPenalty?: number
  /** How many recent tokens the repeat, presence and frequency penalties look at (default 64; -1: the whole context). */
  readonly penaltyLastN?: number
  /** DRY ("don't repeat yourself") penalty; off when absent or multiplier 0. */
  readonly dry?: DrySampling
  /** XTC ("exclude top choices"); off when absent or probability 0. */
  readonly xtc?: { readonly probability: number; readonly threshold: number }
  /** Added to the logits of the given tokens before sampling (-Infinity bans a token). */
  readonly logitBias?: ReadonlyArray<{ readonly tokenId: number; readonly bias: number }>
  /** A GBNF grammar the output must follow (llama.cpp's grammar sampler; `root` defaults to "root"). */
  readonly grammar?: { readonly text: string; readonly root?: string }
  /**
   * Report the log-probability of each sampled token and of the `logprobs` most likely alternatives (0–20) in
   * GeneratedToken.logprob; absent: none reported.
   */
  readonly logprobs?: number
}

/** llama.cpp's DRY sampler settings. */
export interface DrySampling {
  readonly multiplier: number
  /** Default 1.75. */
  readonly base?: number
  /** Default 2. */
  readonly allowedLength?: number
  /** Default -1 (the whole context). */
  readonly penaltyLastN?: number
  /** Default ["\n", ":", "\"", "*"]. */
  readonly sequenceBreakers?: ReadonlyArray<string>
}

export interface GenerateRequest {
  /** GGUF file (for remote agents: a path valid on every node). */
  readonly model: string
  readonly prompt: string
  /** Stages to split the model into (local agents: one agent each; remote: stage i on node i mod n). */
  readonly stages?: number
  readonly sampling?: SamplingOptions
  /** Default 128. */
  readonly maxTokens?: number
  /** Engine threads per stage (default: the agent's). */
  readonly threads?: number
  /** Stages and endpoints must be ready this long after provisioning starts (default 120 s). */
  readonly readinessTimeout?: Duration.DurationInput
  /** Each token must come back within this (default 60 s). */
  readonly tokenTimeout?: Duration.DurationInput
  readonly heartbeat?: { readonly interval: Duration.DurationInput; readonly deadline: Duration.DurationInput }
  /** Stop after planning: report the nodes' capacity and the placement, provision nothing. */
  readonly dryRun?: boolean
  /**
   * How blocks are placed on nodes (default balanced: equal ranges over `stages`). `Speed`: the same stages on the same
   * nodes, each node's share of the blocks by its measured speed within its memory (the CLI's default with --agents);
   * `Capacity`: in proportion to each node's speed within its memory, maybe on fewer nodes; `Fixed`: these ranges,
   * stage i on the i-th node.
   */
  readonly placement?: PlacementRequest
  /** Deliver each stage's weights to agents that lack them (see `PipelineOptions.deliverWeights`). */
  readonly deliverWeights?: PipelineOptions["deliverWeights"]
  /** Local agents: this many extra agents that host nothing until a recovery needs them (default 0). */
  readonly spares?: number
  /** See `PipelineOptions.tokenLoop` (default true). */
  readonly tokenLoop?: boolean
  /** See `PipelineOptions.prefillThreads`. */
  readonly prefillThreads?: number
  readonly recovery?: RecoveryOptions
  /** When a stage's step counts as a straggler (see StragglerRule). */
  readonly stragglers?: Partial<StragglerRule>
  /** Time every decode step on every stage and link: the summary's `timeline` (see RunRequest.timeline). */
  readonly timeline?: boolean
  /** Speculative decoding (see RunRequest.speculative). */
  readonly speculative?: SpeculativeOptions
}

/** When a stage's decode step is a straggler: over `factor` × the median of its `window` steps before, by `minExcessMillis`. */
export interface StragglerRule {
  /** Default 4. */
  readonly factor: number
  /** Steps the median is taken over (default 16). */
  readonly window: number
  /** Steps a stage must have run before any is judged (default 8). */
  readonly minSamples: number
  /** A step must also be this much slower than the median (default 5 ms: scheduling noise is not a straggler). */
  readonly minExcessMillis: number
}

/** How a generation continues after its run faults for a recoverable reason (a node or stage worker lost, transport failed). */
export interface RecoveryOptions {
  /** Recovery attempts before the generation faults (default 3; 0 turns recovery off). */
  readonly maxAttempts?: number
  /** From the first fault, recoveries must have brought the generation back within this (default 60 s). */
  readonly budget?: Duration.DurationInput
}

/** One recovery of a generation: why, onto which placement, how long from the fault to the next token. */
export interface RecoveryRecord {
  readonly attempt: number
  readonly reason: string
  /** Tokens already produced when the run faulted (replayed with the prompt). */
  readonly resumedAt: number
  readonly stages: ReadonlyArray<{
    readonly stageIndex: number
    readonly address: string
    readonly layers: readonly [number, number]
  }>
  /** From the fault being reported to the next token. */
  readonly millis: number
}

/** A decoded token that took much longer than the recent median (a slow stage or node). */
export interface Straggler {
  readonly step: number
  readonly latencyMillis: number
  readonly medianMillis: number
}

/** A decode step on which one stage took over 4× its own recent median (engine time plus the hand-off to the next stage). */
export interface StageStragglerToken {
  readonly stageIndex: number
  /** The agent hosting the stage. */
  readonly address: string
  readonly step: number
  readonly millis: number
  /** That stage's median over its steps before this one (at most 16). */
  readonly medianMillis: number
}

/** A stage that straggled in a run: how many of its decode steps, its median step time and its worst. */
export interface StageStragglers {
  readonly stageIndex: number
  readonly address: string
  /** Straggling steps (see StageStragglerToken). */
  readonly tokens: number
  /** Median over all the stage's decode steps in the run. */
  readonly medianMillis: number
  readonly worstMillis: number
  readonly worstStep: number
}

export interface TokenTimings {
  /** Since the prompt was injected. */
  readonly sinceStartMillis: number
  /** From injecting the input of this step to receiving its token. */
  readonly latencyMillis: number
}

/**
 * One generated token. `text` is what it adds to the output ("" while a multi-byte character is incomplete). At the
 * end of a run whose last tokens left a character incomplete, one more update with `tokenId` -1 carries the flushed
 * text (U+FFFD): text only, not a generated token.
 */
export interface GeneratedToken {
  readonly tokenId: number
  readonly text: string
  readonly step: number
  readonly timings: TokenTimings
  /** When SamplingOptions.logprobs asked for it: this token's log-probability and the most likely alternatives. */
  readonly logprob?: TokenLogprob
}

/** Log-probabilities from the model's distribution at one step (log-softmax of the raw logits, before sampling). */
export interface TokenLogprob {
  readonly logprob: number
  /** The most likely tokens, most likely first (as many as SamplingOptions.logprobs asked for). */
  readonly top: ReadonlyArray<{ readonly tokenId: number; readonly logprob: number }>
}

export interface StageSummary {
  readonly stageIndex: number
  readonly address: string
  readonly layers: readonly [start: number, endExclusive: number]
  /** The data listener of the stage's inbound edge: TCP, or a Unix socket for agents on this machine. */
  readonly dataAddress: TransportAddress
  readonly loadMillis: number
  readonly cachedWeights: boolean
  /** Where the stage computed: "cpu", "cuda", "vulkan" (absent: the node did not say). */
  readonly backend?: string
  /**
   * A GPU stage: its last `blocks` blocks on the device, the bytes the fit counted (services/DeviceFit.ts: weights,
   * one session's caches at the planned context and the compute buffer kept on the device; weights and caches in host
   * memory), and what its backend allocated on the device while it ran, from ggml's buffer sizes (`allocated`: the most
   * of each part seen). Absent: a CPU stage.
   */
  readonly device?: StageDeviceSplit & { readonly allocated: DeviceBytes }
  /** The prompt's time on this stage, from its arrival to its output (batcher wait included). */
  readonly prefillComputeMillis: number
  /** Of that, the time it waited in the agent's batcher for partners or behind other micro-batches. */
  readonly prefillWaitMillis: number
  /** The last stage: sampling the first token. */
  readonly firstSampleMillis: number
  /** Mean engine time per decoded token on this stage. */
  readonly computeMillisPerToken: number
  /** The agent's stage batcher: micro-batches that carried this stage's work, their rows, most sequences in one. */
  readonly microBatches: number
  readonly batchRows: number
  readonly maxBatchSequences: number
  /** Median of the stage's decode steps (engine time plus hand-off to the next stage), from its timing reports. */
  readonly medianTokenMillis: number
  /** Mean time the stage took to hand a decode step's output to the next stage (send, window credit included). */
  readonly sendMillisPerToken: number
  /**
   * Measured when the stage stopped (0 where its agent did not say): its compute buffers and KV cache, and its agent
   * process's resident set then and at its peak (shared by the stages one agent hosts).
   */
  readonly computeBytes: number
  readonly kvBytes: number
  readonly residentBytes: number
  readonly peakResidentBytes: number
}

export interface RunSummary {
  readonly runId: number
  readonly outcome: "Eos" | "MaxTokens"
  readonly promptTokens: number
  readonly generatedTokens: number
  readonly text: string
  /** From the start of the request to the first token (agents, load, prefill). */
  readonly timeToFirstTokenMillis: number
  /** From the prompt injection to the first token (prefill through the pipeline). */
  readonly prefillMillis: number
  readonly decodeTokensPerSecond: number
  /** Mean time per decoded token, end to end. */
  readonly decodeMillisPerToken: number
  readonly stages: ReadonlyArray<StageSummary>
  /** Per decoded token: end-to-end time minus every stage's compute (transfers, framing, scheduling). */
  readonly transferMillisPerToken: number
  /** The recoveries this generation went through (the stages above are the last run's). */
  readonly recoveries: ReadonlyArray<RecoveryRecord>
  /** Decoded tokens slower than 4× the median of the 16 before them (and by at least 5 ms). */
  readonly stragglers: ReadonlyArray<Straggler>
  /**
   * Stages with steps slower than 4× their own recent median (after 8 steps, and by at least 5 ms): the stage that
   * made those tokens slow (the last run's stages; `StageStraggler` updates report every run's as they happen).
   */
  readonly stageStragglers: ReadonlyArray<StageStragglers>
  /**
   * Prompt cache (runs that asked for it, RunRequest.promptCache): prompt tokens whose KV came from the entry adopted
   * on every stage (not prefilled), and the tokens (prompt + generated) every stage kept as the entry named `keep`
   * (0: not kept on some stage).
   */
  readonly promptCache?: { readonly cachedTokens: number; readonly keptTokens: number }
  /** Where each decoded token's time went, per stage and per link (runs that asked for it: RunRequest.timeline). */
  readonly timeline?: TokenTimeline
  /**
   * Speculative decoding (runs that drafted, the last run's): steps that carried drafts, the tokens drafted and the
   * drafts kept (acceptance = accepted / drafted).
   */
  readonly speculative?: { readonly steps: number; readonly drafted: number; readonly accepted: number }
}

/** A placement and the pool it was chosen from, for `--dry-run`. */
export interface PlacementExplanation {
  readonly choice: PlacementChoice
  readonly pool: ReadonlyArray<PoolNode>
  /**
   * Stages on a node with a GPU backend and device: the device (its name) and how much of the stage it holds, by the
   * node's reported device memory and `--gpu-memory` (services/DeviceFit.ts, as the stage will load it).
   */
  readonly deviceShares?: ReadonlyArray<{
    readonly stageIndex: number
    readonly device: string
    readonly share: DeviceShare
  }>
}

/** A run's placement intent (see `src/services/Placement.ts`). */
export type PlacementRequest =
  | { readonly _tag: "Balanced" }
  | { readonly _tag: "Speed" }
  | { readonly _tag: "Capacity" }
  | { readonly _tag: "Fixed"; readonly ranges: ReadonlyArray<LayerRange> }

/** What a run produces, in order: start-up progress, tokens, then one summary. */
export type RunUpdate =
  | { readonly _tag: "AgentsStarted"; readonly nodes: ReadonlyArray<NodeEndpoint> }
  | {
      readonly _tag: "PoolReady"
      readonly nodes: ReadonlyArray<NodeEndpoint>
      /** What each needed node reported in its last heartbeat. */
      readonly capacity: ReadonlyArray<{ readonly node: NodeEndpoint; readonly capacity: NodeCapacity }>
    }
  | {
      readonly _tag: "Planned"
      readonly runId: number
      readonly stages: ReadonlyArray<{
        readonly stageIndex: number
        readonly address: string
        readonly layers: readonly [number, number]
      }>
      /** Why: each stage's node, bytes, memory and expected ms per token, and each node's memory and speed. */
      readonly placement?: PlacementExplanation
    }
  /** Weight delivery (`deliverWeights`): slice bytes of a stage received by its agent so far. */
  | {
      readonly _tag: "WeightsDelivery"
      readonly stageIndex: number
      readonly address: string
      readonly sentBytes: number
      readonly totalBytes: number
      /** "Hub": the node fetches the bytes from the model's hub itself (a `hf:` or URL model). */
      readonly source?: "Hub"
    }
  | {
      readonly _tag: "StageLoading"
      readonly stageIndex: number
      readonly loadedBytes: number
      readonly totalBytes: number
    }
  | {
      readonly _tag: "StageReady"
      readonly stageIndex: number
      readonly loadMillis: number
      readonly cachedWeights: boolean
    }
  | {
      readonly _tag: "Token"
      readonly token: GeneratedToken
      /** The random draws the last stage's sampler has made so far in this run (a recovery resumes from them). */
      readonly samplerDraws?: number
    }
  /** Exactly once per planned run, after its terminal outcome, when every stage and endpoint confirmed its stop. */
  | {
      readonly _tag: "TornDown"
      readonly outcome: "Completed" | "Faulted" | "OperatorStopped"
      readonly unconfirmedStages: ReadonlyArray<number>
      readonly endpointsConfirmed: boolean
    }
  /** The run faulted for a recoverable reason: a new run on the nodes still alive (plus spares) continues the generation. */
  | { readonly _tag: "Recovering"; readonly attempt: number; readonly reason: string; readonly resumedAt: number }
  /** A stage took over 4× its recent median on a decode step (see RunSummary.stageStragglers). */
  | { readonly _tag: "StageStraggler"; readonly straggler: StageStragglerToken }
  /** Prompt cache (RunRequest.promptCache): the prompt went in after this many tokens whose KV every stage held. */
  | { readonly _tag: "PromptCached"; readonly cachedTokens: number }
  /** The generation continues: the first token after the recovery came back. */
  | { readonly _tag: "Recovered"; readonly recovery: RecoveryRecord }
  | { readonly _tag: "Finished"; readonly summary: RunSummary }

/** The run ended Faulted; `reason` is the first fault the run FSM recorded, `message` says it in words. */
export class RunFaulted extends Schema.TaggedError<RunFaulted>()("RunFaulted", {
  runId: RunId,
  reason: RunFaultReason,
  message: Schema.String
}) {}

/**
 * A recovery found no placement on the nodes left: the survivors lack the memory (as they reported it) for the blocks
 * they would have to take. Raised before any new run is tried; `message` names the numbers and every run's fault.
 */
export class RecoveryOverMemory extends Schema.TaggedError<RecoveryOverMemory>()("RecoveryOverMemory", {
  runId: RunId,
  /** The even split over the survivors: each one's blocks, what they need (weights + KV + compute) and its free memory. */
  survivors: Schema.Array(
    Schema.Struct({
      nodeId: Schema.Number,
      address: Schema.String,
      layers: Schema.Tuple(Schema.Number, Schema.Number),
      requiredBytes: Schema.Number,
      freeBytes: Schema.Number
    })
  ),
  /** The whole model on one stage; no contiguous split over the survivors fits either. */
  modelBytes: Schema.Number,
  survivorsFreeBytes: Schema.Number,
  message: Schema.String
}) {}

/** A request the orchestrator cannot run (empty prompt, bad numbers, no nodes). */
export class InvalidRequest extends Schema.TaggedError<InvalidRequest>()("InvalidRequest", {
  message: Schema.String
}) {}

export type GenerateError =
  | InvalidRequest
  | ModelLoadError
  | TokenizerError
  | PlanRejection
  | PlacementRejection
  | AgentSpawnError
  | AgentUnavailable
  | PoolNotReady
  | RunFaulted
  | RecoveryOverMemory

/** The agents a run may use, and the token that proves the orchestrator may use them. */
export interface AgentSet {
  readonly nodes: ReadonlyArray<NodeEndpoint>
  readonly token: string
  /** Where the orchestrator's own data listener binds (reachable from the agents). */
  readonly listenHost: string
  /** The listener's address when not TCP on `listenHost` (local agents: a Unix socket). */
  readonly dataListen?: TransportAddress
  /**
   * Where the last stage sends its tokens when not the listener's own address (a relay in front of it: bench:wan's
   * simulated links). Unset by default.
   */
  readonly dataAdvertise?: TransportAddress
  /** Completes when an agent process is seen to exit (local agents only; never for remote ones). */
  readonly exited: Effect.Effect<{ readonly node: NodeEndpoint; readonly reason: string }>
  /**
   * Local agents only (absent for remote nodes): whether a node's agent process is still running (a stopped one,
   * SIGSTOP, still runs). Its presence says the agents are this process's children: a new set can replace them.
   */
  readonly processRunning?: (node: NodeEndpoint) => boolean
}

export interface AgentPoolService {
  /** Agents for a run of `stages` stages (local: started now, stopped with the scope; remote: the configured nodes). */
  readonly acquire: (
    stages: number | undefined,
    spares?: number
  ) => Effect.Effect<AgentSet, AgentSpawnError | InvalidRequest, Scope.Scope>
}

/** Where a run's agents come from: local child processes or remote nodes (see OrchestratorLive). */
export class AgentPool extends Context.Tag("swactor/AgentPool")<AgentPool, AgentPoolService>() {}

/** What a warm pipeline is set up for: the model, the agents, how many stages. */
export interface PipelineOptions {
  /** GGUF file (for remote agents: a path valid on every node). */
  readonly model: string
  /** Stages (local agents: one agent each; remote: stage i on node i mod n). */
  readonly stages?: number
  /** Default engine threads per stage. */
  readonly threads?: number
  /** The node pool must answer this long after the agents start (default 120 s). */
  readonly readinessTimeout?: Duration.DurationInput
  readonly heartbeat?: { readonly interval: Duration.DurationInput; readonly deadline: Duration.DurationInput }
  /** Checked with the planner before any agent starts (default 1). */
  readonly maxTokens?: number
  /** Local agents: extra agents that host nothing until a recovery needs them (default 0). */
  readonly spares?: number
  /** Default recovery of the runs on this pipeline. */
  readonly recovery?: RecoveryOptions
  /** Default straggler rule of the runs on this pipeline (see StragglerRule). */
  readonly stragglers?: Partial<StragglerRule>
  /** Which node hosts which blocks (default: balanced, stage i on node i mod n). Decided once for the pipeline. */
  readonly placement?: PlacementRequest
  /** Context per sequence that placement budgets KV memory for (default: max tokens + 1, padded to 256). */
  readonly contextTokens?: number
  /**
   * Send each stage's weights (a GGUF slice) to agents that lack them, once per pipeline after placement
   * (src/layers/orchestrator/WeightDelivery.ts). Off: agents read `model` at its path.
   */
  readonly deliverWeights?: boolean | { readonly outgoingDir?: string; readonly chunkBytes?: number }
  /**
   * A run of two stages or more loops its tokens (default true): the last stage sends each decode step's token
   * straight to stage 0 as well as to the orchestrator, which then sends stage 0 the prompt only (one link less per
   * token, and no wait for the orchestrator's turn; see ProvisionRequest.tokenLoop). False: every token goes back
   * through the orchestrator.
   */
  readonly tokenLoop?: boolean
  /**
   * Threads a stage takes for the prompt of a run alone on the pipeline, when the prompt runs in one piece (under 128
   * tokens) and so every other stage waits meanwhile: the cores those stages leave idle (StageHosting.prefillThreadsOf).
   * Default: with local agents and `threads` set, stages × threads, at most this machine's cores; else `threads`.
   * The tokens are the same (ggml's CPU kernels give each output element to one thread).
   */
  readonly prefillThreads?: number
}

/** One run on a warm pipeline. */
export interface RunRequest {
  /** Text (tokenized with BOS as the model wants) or token ids as they are. */
  readonly prompt: string | ReadonlyArray<number>
  readonly sampling?: SamplingOptions
  /** Default 128. */
  readonly maxTokens?: number
  /** Engine threads per stage (default: the pipeline's). */
  readonly threads?: number
  /** Stages must be ready this long after provisioning starts (default 120 s). */
  readonly readinessTimeout?: Duration.DurationInput
  /** Each token must come back within this (default 60 s). */
  readonly tokenTimeout?: Duration.DurationInput
  /** Stop after planning. */
  readonly dryRun?: boolean
  readonly recovery?: RecoveryOptions
  /** When a stage's step counts as a straggler (see StragglerRule). */
  readonly stragglers?: Partial<StragglerRule>
  /**
   * The agents' prompt cache: start from the first `adopt.length` KV positions of held entry `adopt.entry` on every
   * stage (at most the prompt's length - 1; a stage lacking it means fewer, down to a full prefill), and keep this
   * run's KV as entry `keep` when it completes (dropped with `Pipeline.dropCached`). Only the first run of a
   * generation uses it (a recovery's replay prefills in full and keeps nothing).
   */
  readonly promptCache?: {
    readonly adopt?: { readonly entry: number; readonly length: number }
    readonly keep?: number
  }
  /**
   * Requests that reached the server beside this one and are not running yet (e.g. still tokenizing): the stages'
   * batchers let this run's prompt wait briefly for theirs, to prefill them together (0 or absent: a lone request,
   * which never waits).
   */
  readonly arriving?: number
  /**
   * Time every decode step on every stage (StepTimeline: waiting, wake-up, framing, queueing, copies, compute, send)
   * and every link: the summary's `timeline` (services/Timeline.ts). Off: the stages measure only what they always do.
   */
  readonly timeline?: boolean
  /**
   * Speculative decoding (services/Speculation.ts): stage 0 drafts tokens by prompt lookup (or from `predicted`) and
   * the pipeline verifies them as one step of a few rows; the text is the text without drafts, for every sampler.
   * `auto` drafts where the model's stages can roll back (ModelLayout.rewind) and the run has no timeline; `ngram`
   * refuses a model that cannot. Absent or `off`: no drafts.
   */
  readonly speculative?: SpeculativeOptions
  /**
   * A long-lived pipeline's first run (the server's warm-up): every stage moves its mapped weights into huge-page memory
   * (LoadedStage.settle) before it reports ready, so the requests after it neither run from the file mapping (4 KiB
   * pages: slower, with stalls) nor wait behind the move.
   */
  readonly settleWeights?: boolean
}

/** One agent of a warm pipeline. */
export interface PipelineAgent {
  readonly node: NodeEndpoint
  /** Its process id, as it said in its hello. */
  readonly pid: number
  readonly dataAddress: TransportAddress
  /** What it reports now (fails when it cannot be reached). */
  readonly capacity: Effect.Effect<NodeCapacity, AgentUnavailable>
}

/** One agent of a warm pipeline as membership sees it now. */
export interface PipelineMember {
  readonly agent: PipelineAgent
  /** up: answers its heartbeats; waiting: not lost, no answer yet (e.g. just rejoined); lost: given up on. */
  readonly state: "up" | "waiting" | "lost"
  /** Why it is waiting or lost, in words ("" when up). */
  readonly detail: string
  /** Local agents: its process has ended (it cannot come back). Always false for remote nodes. */
  readonly exited: boolean
}

/**
 * A pipeline set up once (model facts, tokenizer, agents, control links, membership pool, data listener) on which
 * any number of runs go, each its own run of the contract (own RunId, planner, run FSM, teardown). Weights stay
 * in the agents' model caches between runs. Closed with its scope (agents stopped).
 */
export interface Pipeline {
  readonly model: ModelFacts
  readonly vocabulary: ModelTokenizer
  readonly agents: ReadonlyArray<PipelineAgent>
  readonly stageCount: number
  /** One run; interrupting the stream is an operator stop (with the full teardown). */
  readonly run: (request: RunRequest) => Stream.Stream<RunUpdate, GenerateError>
  /** Completes with the first node lost (runs then go on without it: see `alive`). */
  readonly lost: Effect.Effect<NodeLost>
  /** The agents not lost (heartbeats answered, no exit seen): the ones the next run may use. */
  readonly alive: Effect.Effect<ReadonlyArray<PipelineAgent>>
  /** Every agent and its state (lost ones rejoin when they answer again at their address: PipelineSetup). */
  readonly members: Effect.Effect<ReadonlyArray<PipelineMember>>
  /** The agents are local processes started for this pipeline (another pipeline starts fresh ones); false: remote nodes. */
  readonly localAgents: boolean
  /** Drops prompt-cache entries (every one when `all`) on every agent that answers. */
  readonly dropCached?: (entries: ReadonlyArray<number>, all: boolean) => Effect.Effect<void>
  /**
   * The placement chosen when it was set up, with the model's per-block bytes and the context it budgeted (a server
   * compares it with a plan over nodes that joined since: src/layers/server/Replan.ts).
   */
  readonly placed?: {
    readonly explanation: PlacementExplanation
    readonly layout: ModelLayout
    readonly contextTokens: number
  }
  /** The runs going on now (each attempt of each request, from its plan to its end). */
  readonly activeRuns?: () => number
  /** Declares a node lost now (as a dropped control connection does): its runs recover on the others. */
  readonly markLost?: (nodeId: NodeId, reason: string) => Effect.Effect<void>
}

export interface OrchestratorService {
  /** Runs one generation on a pipeline of its own; interrupting the stream is an operator stop (with the full teardown). */
  readonly run: (request: GenerateRequest) => Stream.Stream<RunUpdate, GenerateError>
  /**
   * Sets up a warm pipeline that outlives its runs (closed with the scope). `progress` sees AgentsStarted and
   * PoolReady.
   */
  readonly pipeline: (
    options: PipelineOptions,
    progress?: (update: RunUpdate) => Effect.Effect<void>
  ) => Effect.Effect<Pipeline, GenerateError, Scope.Scope>
}

export class Orchestrator extends Context.Tag("swactor/Orchestrator")<Orchestrator, OrchestratorService>() {}
