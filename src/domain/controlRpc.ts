/**
 * The orchestrator ↔ node agent control plane: one @effect/rpc group and the Schema messages that
 * cross the process boundary with it. The transport (an authenticated socket: mutual HMAC
 * handshake, then ndjson RPC) is `makeSocketServer` of src/layers/transport/ControlPlane.ts; the
 * agent's handlers and the orchestrator's client are src/layers/agent/AgentControlRpc.ts.
 *
 * The group is the `AgentLink` of src/services/AgentLinks.ts one to one:
 *
 * - `Hello` → the agent's data-plane address and pid (`AgentHello`).
 * - `Capacity` → its heartbeat answer (`NodeCapacity`).
 * - `Provision` → a stream of `StageReport`s for one stage (loading progress, ready, per-step timings while it
 *   runs, then fault with a `StageFaultReason` of src/domain/runEvents.ts, or stopped with the stage's compute
 *   counters). The stream ends after `StageStopped`; a dropped connection fails it at once (a crashed agent is a
 *   fault, never a hang), and the agent interrupts the handlers of a client that went away (its stages stop).
 * - `Stop` → asks a stage to stop (idempotent).
 * - `WeightsCheck` / `SliceChunk` / `SliceFinish` → weight delivery: whether the agent holds a stage's tensors (the
 *   model path with the same tensor hash, or a verified slice in its slice cache), the slice's bytes at an offset
 *   (a resumed transfer starts where the agent's partial file ends), and the hash-checked finish. The bytes normally
 *   travel on a connection of their own to the same address instead of in `SliceChunk` messages
 *   (src/layers/gguf/SliceStream.ts); `SliceChunk` serves links without it. A held or finished
 *   slice is then what the agent loads when a provision names that model path and block range.
 */
import { Rpc, RpcGroup } from "@effect/rpc"
import { Schema } from "effect"
import { DeviceBytes, StageDeviceSplit } from "./engine.js"
import { TransportAddress } from "./frames.js"
import { EdgeId, RunId } from "./ids.js"
import { ProvisionStage, RingSpec } from "./plan.js"
import { StageFaultReason } from "./runEvents.js"

/**
 * One decode step of one stage, as the timeline of `swactor run --timeline` takes it (ms). The `…At` times are on the
 * host's monotonic clock (shared by the processes of one machine); the rest are durations that follow each other:
 * the frame's bytes arrived (`arrivedAt`, the socket's or shared-memory ring's wake-up), were decoded (`decodeMillis`),
 * the stage took the frame (`wakeMillis`: the scheduling delay), its rows waited in the batcher (`queueMillis`, both
 * ways), were copied into and out of ggml (`copyMillis`), computed (`computeMillis`: the graph, and sampling on the
 * last stage), encoded into frames (`encodeMillis`) and written (`sendMillis`: the socket write or ring copy, window
 * waits included). `handOffAt`: when the frame the pipeline waits for was written (to the next stage, or the token
 * loop's to stage 0); `doneAt`: when the stage was done with the step.
 */
export const StepTimeline = Schema.Struct({
  step: Schema.Number,
  arrivedAt: Schema.Number,
  decodeMillis: Schema.Number,
  wakeMillis: Schema.Number,
  queueMillis: Schema.Number,
  copyMillis: Schema.Number,
  computeMillis: Schema.Number,
  encodeMillis: Schema.Number,
  sendMillis: Schema.Number,
  handOffAt: Schema.Number,
  doneAt: Schema.Number
})
export type StepTimeline = typeof StepTimeline.Type

/** Per-stage counters, reported when the stage stops. */
export class StageStats extends Schema.Class<StageStats>("StageStats")({
  frames: Schema.Number,
  tokens: Schema.Number,
  loadMillis: Schema.Number,
  cachedWeights: Schema.Boolean,
  prefillComputeMillis: Schema.Number,
  /** Of prefillComputeMillis: the time the prompt waited in the agent's batcher (gathering, behind other work). */
  prefillWaitMillis: Schema.optionalWith(Schema.Number, { default: () => 0 }),
  /** The last stage: how long sampling the first token took. */
  firstSampleMillis: Schema.optionalWith(Schema.Number, { default: () => 0 }),
  decodeFrames: Schema.Number,
  decodeComputeMillis: Schema.Number,
  /** Micro-batches of the agent's stage batcher that carried this stage's work (see layers/agent/StageBatcher.ts). */
  microBatches: Schema.optionalWith(Schema.Number, { default: () => 0 }),
  /** Rows (tokens of all sequences) of those micro-batches. */
  batchRows: Schema.optionalWith(Schema.Number, { default: () => 0 }),
  /** Most sequences in one of those micro-batches (> 1: this stage shared a computation with other runs). */
  maxBatchSequences: Schema.optionalWith(Schema.Number, { default: () => 0 }),
  /** Prompt chunks this stage ran. */
  prefillChunks: Schema.optionalWith(Schema.Number, { default: () => 0 }),
  /**
   * Memory as measured when the stage stopped: the loaded stage's compute buffers, this stage's KV cache, and the
   * agent process's resident set now and at its peak (VmRSS, VmHWM; every stage the agent hosts shares them).
   */
  computeBytes: Schema.optionalWith(Schema.Number, { default: () => 0 }),
  /**
   * A GPU stage: the device memory its backend allocated while the stage ran, from ggml's buffer sizes (the most of
   * each part seen). Absent: a CPU stage.
   */
  device: Schema.optional(DeviceBytes),
  kvBytes: Schema.optionalWith(Schema.Number, { default: () => 0 }),
  residentBytes: Schema.optionalWith(Schema.Number, { default: () => 0 }),
  peakResidentBytes: Schema.optionalWith(Schema.Number, { default: () => 0 }),
  /** Prompt cache: KV positions this stage kept as its provision's `promptCache.keep` entry (0: none kept). */
  keptPositions: Schema.optionalWith(Schema.Number, { default: () => 0 }),
  /**
   * Speculative decoding, on the last stage: its steps that carried drafts, the tokens they drafted, and the drafts its
   * sampler kept (ProvisionRequest.speculative; 0 without).
   */
  verifySteps: Schema.optionalWith(Schema.Number, { default: () => 0 }),
  draftedTokens: Schema.optionalWith(Schema.Number, { default: () => 0 }),
  acceptedTokens: Schema.optionalWith(Schema.Number, { default: () => 0 })
}) {}

export const StageReport = Schema.Union(
  Schema.TaggedStruct("StageLoading", {
    runId: RunId,
    stageIndex: Schema.Number,
    loadedBytes: Schema.Number,
    totalBytes: Schema.Number
  }),
  Schema.TaggedStruct("StageReady", {
    runId: RunId,
    stageIndex: Schema.Number,
    loadMillis: Schema.Number,
    cachedWeights: Schema.Boolean,
    /** Where the stage computes: "cpu", or the GPU package's backend ("cuda", "vulkan"). Absent: an older node. */
    backend: Schema.optional(Schema.String),
    /**
     * A GPU stage's split (services/DeviceFit.ts): its last `blocks` blocks on the device, and the device and host
     * bytes the fit counted. Absent: a CPU stage, or an older node.
     */
    device: Schema.optional(StageDeviceSplit),
    /** Prompt cache: KV positions the stage's session took over from the entry its provision named (absent: none). */
    cachedPositions: Schema.optional(Schema.Number),
    /**
     * The last stage of a run provisioned with a token loop: its loop edge to stage 0 is connected, so it sends each
     * decode step's token there itself (the orchestrator then sends stage 0 the prompt only). Absent: it does not.
     */
    tokenLoop: Schema.optional(Schema.Boolean)
  }),
  /** Why the stage failed, in the run FSM's own vocabulary: the orchestrator passes it on unchanged. */
  Schema.TaggedStruct("StageFault", { runId: RunId, stageIndex: Schema.Number, reason: StageFaultReason }),
  Schema.TaggedStruct("StageStopped", { runId: RunId, stageIndex: Schema.Number, stats: StageStats }),
  /**
   * The stage's decode steps since its last such report (sent every 16 steps or 250 ms, and before StageStopped),
   * one entry per step in the three arrays: the frame's step, the engine's time on it and the time to hand its
   * output to the next stage (ms). The orchestrator finds straggling stages from them while the run goes on.
   */
  Schema.TaggedStruct("StageTimings", {
    runId: RunId,
    stageIndex: Schema.Number,
    steps: Schema.Array(Schema.Number),
    computeMillis: Schema.Array(Schema.Number),
    sendMillis: Schema.Array(Schema.Number),
    /** A run provisioned with `timeline`: the same steps, each as its timeline (absent: not asked for). */
    timeline: Schema.optional(Schema.Array(StepTimeline)),
    /**
     * With `timeline`: the stage's clock (the host's boot id): times of stages on the same clock as the orchestrator's
     * are comparable, so the links between them are measured.
     */
    clock: Schema.optional(Schema.String)
  })
)
export type StageReport = typeof StageReport.Type

/**
 * A run's use of the agents' prompt cache (see layers/agent/PromptCacheHost.ts): copy the first `adopt.length` KV
 * positions of held entry `adopt.entry` into the new session (a stage lacking it starts empty, the orchestrator then
 * prefills from the shortest any stage took); keep the session as entry `keep` when the stage stops without a fault.
 * `promptLength`: the prompt's tokens (stage 0 starts its prompt frame at promptLength - tokens sent).
 */
export const PromptCacheUse = Schema.Struct({
  adopt: Schema.NullOr(Schema.Struct({ entry: Schema.Number, length: Schema.Number })),
  keep: Schema.NullOr(Schema.Number),
  promptLength: Schema.Number
})
export type PromptCacheUse = typeof PromptCacheUse.Type

/**
 * The token loop of a pipeline run (two stages or more): the last stage sends each sampled token that the run goes on
 * from straight to stage 0 as the next decode step's input, on an edge of its own (`edgeId`, unique in the run, with
 * the token ring `ring`; its first message is step 1), besides sending it to the orchestrator as always. A token
 * crosses one link less per step and skips the orchestrator's turn. Stage 0 accepts the edge; the last stage
 * connects to `stage0` and stops looping at the run's end: an end-of-sequence token, or the token that makes
 * `maxTokens` (the run FSM's own rules; an earlier stop, such as a stop string, tears the run down).
 */
export const TokenLoop = Schema.Struct({
  edgeId: EdgeId,
  ring: RingSpec,
  /** The last stage's: stage 0's data address (absent on stage 0). */
  stage0: Schema.optional(TransportAddress),
  maxTokens: Schema.Number
})
export type TokenLoop = typeof TokenLoop.Type

/**
 * Speculative decoding (services/Speculation.ts), on every stage of a run that drafts: stage 0 drafts up to
 * `maxDraft` tokens after each token (prompt lookup, or `predicted` while the output follows it) and sends them with
 * it as one step; every stage runs such a step's rows on the few-row route and rolls back the rows that were not kept
 * by starting its next step after the kept ones; the last stage keeps the drafts its sampler agrees with.
 * `maxTokens`: the run's, so no step drafts past it.
 */
export const SpeculativeProvision = Schema.Struct({
  maxDraft: Schema.Number.pipe(Schema.int(), Schema.between(1, 255)),
  maxTokens: Schema.Number,
  predicted: Schema.optional(Schema.Array(Schema.Number)),
  /** Draft `maxDraft` wherever drafts are found (SpeculativeOptions.fixed); absent: the adaptive count. */
  fixed: Schema.optional(Schema.Boolean),
  /**
   * Stage 0 of a `draft` run: the draft model (SpeculativeOptions.draftModel) to run whole beside the stage, its file
   * and block count; it decodes the drafts greedily.
   */
  draft: Schema.optional(
    Schema.Struct({ path: Schema.String, blocks: Schema.Number.pipe(Schema.int(), Schema.positive()) })
  )
})
export type SpeculativeProvision = typeof SpeculativeProvision.Type

/** Everything an agent needs to host one stage: the plan's message plus where its output goes. */
export class ProvisionRequest extends Schema.Class<ProvisionRequest>("ProvisionRequest")({
  provision: ProvisionStage,
  /** The data listener of the next stage's agent (or the orchestrator's, for the last stage). */
  outboundAddress: TransportAddress,
  /** Engine threads for this stage (default: the agent's). */
  threads: Schema.NullOr(Schema.Number),
  /**
   * Engine threads for this stage's prompt when the run is alone on the pipeline and its prompt runs in one piece, so
   * the other stages wait (absent: `threads`; PipelineOptions.prefillThreads). The same bits either way.
   */
  prefillThreads: Schema.optional(Schema.Number),
  /** KV cache length for this stage's session. */
  contextLength: Schema.Number,
  /** Prompt cache (absent: none). */
  promptCache: Schema.optional(PromptCacheUse),
  /** Requests that reached the server beside this run's and will be provisioned soon: its prompt may wait for theirs. */
  arriving: Schema.optional(Schema.Number),
  /** Move mapped weights into huge-page memory before reporting ready (a long-lived pipeline's warm-up). */
  settleWeights: Schema.optional(Schema.Boolean),
  /** Stage 0 and the last stage of a run with a token loop (absent: tokens go back through the orchestrator). */
  tokenLoop: Schema.optional(TokenLoop),
  /** Report each decode step's timeline with its timings (StepTimeline; `swactor run --timeline`). */
  timeline: Schema.optional(Schema.Boolean),
  speculative: Schema.optional(SpeculativeProvision)
}) {}

/** What an agent says about itself when the orchestrator connects. */
export class AgentHello extends Schema.Class<AgentHello>("AgentHello")({
  dataAddress: TransportAddress,
  pid: Schema.Number
}) {}

/** What a node agent reports about itself in answer to a heartbeat. */
/** One ggml device of a node: its kind and memory as the backend reports them (ggml_backend_dev_memory). */
export const NodeDevice = Schema.Struct({
  name: Schema.String,
  description: Schema.String,
  kind: Schema.String,
  freeBytes: Schema.Number,
  totalBytes: Schema.Number,
  /** The most of it this node's GPU stages may use (`swactor node --gpu-memory`); absent: its free memory. */
  limitBytes: Schema.optional(Schema.Number)
})

export const NodeCapacity = Schema.Struct({
  freeMemoryBytes: Schema.Number,
  totalMemoryBytes: Schema.Number,
  threads: Schema.Number,
  backend: Schema.String,
  hostname: Schema.String,
  /** Stages this agent hosts right now (all runs). */
  activeStages: Schema.Number,
  /** The ggml devices of the agent's package, GPU first as ggml lists them (absent: an older node, or a test engine). */
  devices: Schema.optional(Schema.Array(NodeDevice)),
  /** Sessions open in this agent's process now, the DeltaNet state bytes and all cache bytes they hold (absent: unknown). */
  openSessions: Schema.optional(
    Schema.Struct({ sessions: Schema.Number, stateBytes: Schema.Number, cacheBytes: Schema.Number })
  ),
  /**
   * Per loaded block range: its measured decode step ms by rows, whether the idle probe ran, and the batcher's last
   * choice of rows per decode micro-batch (for `decoders` sequences through `stages` stages; `defaultRows` = ceil).
   */
  stepCosts: Schema.optional(
    Schema.Array(
      Schema.Struct({
        layers: Schema.Tuple(Schema.Number, Schema.Number),
        costs: Schema.Array(Schema.Struct({ rows: Schema.Number, millis: Schema.Number })),
        probe: Schema.Literal("off", "pending", "done"),
        choice: Schema.optional(
          Schema.Struct({
            decoders: Schema.Number,
            stages: Schema.Number,
            rows: Schema.Number,
            defaultRows: Schema.Number
          })
        )
      })
    )
  ),
  /** Weight bytes the agent's engine processes per second (placement's speed); absent: unknown. */
  speedBytesPerSecond: Schema.optional(Schema.Number),
  /** Where the speed comes from: declared by the operator (`--speed`) or measured. */
  speedSource: Schema.optional(Schema.Literal("declared", "measured")),
  /** The operator's memory cap (`--memory-limit`); `freeMemoryBytes` never exceeds it. */
  memoryLimitBytes: Schema.optional(Schema.Number)
}).annotations({ identifier: "NodeCapacity" })
export type NodeCapacity = typeof NodeCapacity.Type

/** A stage's weights, named by the orchestrator's model path, the block range and the tensors' content hash. */
export class StageWeights extends Schema.Class<StageWeights>("StageWeights")({
  modelPath: Schema.String,
  layerStart: Schema.Number,
  layerEndExclusive: Schema.Number,
  numLayers: Schema.Number,
  /**
   * SHA-256 (hex) over the stage's tensors (src/layers/gguf/GgufSlice.ts `sliceHash`); with `source` "Hub", the
   * remote slice's identity instead (src/layers/gguf/RemoteGguf.ts `remoteSliceId`).
   */
  hash: Schema.String,
  /** "Hub": the agent fetches the slice of the remote model (`modelPath` is a hub name or URL) itself. */
  source: Schema.optional(Schema.Literal("Hub"))
}) {}

/**
 * What an agent holds of a stage's weights: the tensors (at `path`), or `have` bytes of a partial slice; for a slice
 * it fetches from the hub itself, `have` of `total` bytes so far, or why it could not (the orchestrator then sends it).
 */
export const WeightsHeld = Schema.Union(
  Schema.TaggedStruct("Held", { via: Schema.Literal("ModelFile", "Slice"), path: Schema.String }),
  Schema.TaggedStruct("Missing", { have: Schema.Number }),
  Schema.TaggedStruct("Fetching", { have: Schema.Number, total: Schema.Number }),
  Schema.TaggedStruct("FetchFailed", { message: Schema.String })
)
export type WeightsHeld = typeof WeightsHeld.Type

/** Why an agent could not take a slice (bad hash, out-of-order chunk, a corrupt result, its disk). */
export class WeightDeliveryError extends Schema.TaggedError<WeightDeliveryError>()("WeightDeliveryError", {
  reason: Schema.Literal("BadHash", "OutOfOrder", "Corrupt", "Io"),
  message: Schema.String
}) {}

/** The agent control plane. Handlers: `AgentRpcs.toLayer({ Hello, Capacity, Provision, Stop, WeightsCheck, SliceChunk, SliceFinish })`. */
export class AgentRpcs extends RpcGroup.make(
  Rpc.make("Hello", { success: AgentHello }),
  Rpc.make("Capacity", { success: NodeCapacity }),
  Rpc.make("Provision", { payload: { request: ProvisionRequest }, success: StageReport, stream: true }),
  Rpc.make("Stop", { payload: { runId: RunId, stageIndex: Schema.Number } }),
  /** Drops held prompt-cache entries (every one when `all`); idempotent, and an entry dropped is never kept after. */
  Rpc.make("DropCached", { payload: { entries: Schema.Array(Schema.Number), all: Schema.Boolean } }),
  Rpc.make("WeightsCheck", { payload: { weights: StageWeights }, success: WeightsHeld, error: WeightDeliveryError }),
  Rpc.make("SliceChunk", {
    payload: { hash: Schema.String, offset: Schema.Number, bytes: Schema.Uint8ArrayFromBase64 },
    success: Schema.Number,
    error: WeightDeliveryError
  }),
  Rpc.make("SliceFinish", { payload: { weights: StageWeights }, success: Schema.String, error: WeightDeliveryError })
) {}
