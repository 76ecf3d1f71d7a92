/**
 * StageExecutor over ggml (node-llama-cpp's libraries through koffi): loads only a stage's tensors, keeps a
 * KV cache per session, and computes on a koffi worker thread so the event loop keeps running.
 */
import { Effect, Layer } from "effect"
import { threadsProblem } from "../../services/RequestChecks.js"
import { availableParallelism } from "node:os"
import {
  BatchItemRejected,
  ContextOverflow,
  EngineError,
  type ForwardBatchError,
  type ForwardError,
  InvalidBatch,
  InvalidStageInput,
  type StageInfo,
  type StageInput,
  type StageLoadSpec,
  type StageOutput
} from "../../domain/engine.js"
import { ModelLoadError } from "../../domain/gguf.js"
import {
  type BatchItem,
  type ForwardPhases,
  type LoadedStage,
  type SessionOptions,
  StageExecutor,
  type StageExecutorService,
  type StageSession,
  validateForward
} from "../../services/StageExecutor.js"
import { forwardOne, runBatch } from "./Forward.js"
import { type NativeItem, NativeSession } from "./KvCache.js"
import { stageMemoryOf } from "./BlockMemory.js"
import { loadWeights, type NativeWeights, type TensorPlacement } from "./Weights.js"
import { layoutStage } from "./StageLayout.js"
import { splitForDevice } from "./DeviceSplit.js"
import { devicePlanContext } from "../../services/DeviceFit.js"
import { activationWidth } from "./PerLayerInputs.js"
import { type Ggml, type GgmlLoad, getGgml, type Ptr } from "../ggml/Bindings.js"
import { liveSettings, Settings, type SettingsValues } from "../config/Settings.js"
import * as ModelCatalogLive from "../gguf/ModelCatalogLive.js"
import { ModelCatalog, type ModelCatalogService } from "../../services/ModelCatalog.js"

/** A loaded stage of the live executor (also exposes where each tensor lives, for tests and the CLI). */
export class LiveLoadedStage implements LoadedStage {
  constructor(
    readonly info: StageInfo,
    readonly weights: NativeWeights
  ) {}
  /** Mapped weights to huge-page memory (NativeWeights.moveOutOfMapping; it checks `freed` before every tensor). */
  settle = (): Effect.Effect<boolean> => Effect.promise(() => this.weights.moveOutOfMapping().catch(() => false))
  get placements(): ReadonlyArray<TensorPlacement> {
    return this.weights.placements
  }
  /** Bytes of the allocated backend buffers that hold copied weights (their tensors plus alignment padding). */
  get bufferBytes(): number {
    return this.weights.bufferBytes
  }
  memory = () => ({
    weightBytes: this.weights.bufferBytes + this.weights.mappedBytes,
    computeBytes: this.computeBytes,
    ...(this.weights.split === null
      ? {}
      : {
          device: {
            weightBytes: this.weights.deviceWeightBytes,
            cacheBytes: this.weights.deviceKvBytes,
            computeBytes: this.weights.graphs.computeBytesOn(this.weights.backend),
            splits: this.weights.graphs.splits
          }
        })
  })
  /** Bytes of the stage's compute buffers (every cached graph's allocation, its sessions' included; GraphCache.ts). */
  get computeBytes(): number {
    return this.weights.graphs.computeBytes
  }
  /** Bytes of the weights used in place from the file mapping (no allocation; the page cache is shared). */
  get mappedBytes(): number {
    return this.weights.mappedBytes
  }
}

export interface LiveOptions {
  /** Use llama.cpp's repacked CPU buffer types for quantized weights where it would (default true). */
  readonly repack?: boolean
  /**
   * Use plain CPU weights in place from a read-only mapping of the file (default: SWACTOR_MMAP, true unless 0).
   * Repacked weights are repacked from the mapping; GPU stages always copy.
   */
  readonly mmap?: boolean
  /** Advise transparent huge pages for CPU weight memory (default: SWACTOR_THP, true unless 0). */
  readonly hugePages?: boolean
  /** A lone call reads its aligned hidden input in place, not copied (default: SWACTOR_ZERO_COPY, true unless 0). */
  readonly zeroCopy?: boolean
  /**
   * The most rows of a CPU product that take the few-row route (Toolkit.mulMatSmall) for every weight type, instead
   * of what the stage measures before its first batched step (SmallBatch.ts). 0: never. Tests force each path so.
   * Default: SWACTOR_GEMV_MAX_ROWS when set, else measured.
   */
  readonly smallBatchRows?: number
  /** CPU threads when a session does not say (default: SWACTOR_THREADS when made, else every core). */
  readonly defaultThreads?: number
  /** KV cache length when a session does not say (default min(model context, 4096)). */
  readonly defaultContextLength?: number
  /**
   * A GPU stage's device budget when its spec does not say (StageLoadSpec.deviceBudgetBytes; default:
   * SWACTOR_GPU_MEMORY, `--gpu-memory`, when set, else the device's free memory).
   */
  readonly deviceBudgetBytes?: number
  /** Which ggml package to load, if this executor is the first to load ggml (default: the Settings service's). */
  readonly ggml?: GgmlLoad
}

/** A session's context length when it does not say: the option, else min(the model's, 4096). */
const defaultContextOf = (options: LiveOptions, modelContext: number): number =>
  options.defaultContextLength ?? devicePlanContext(modelContext)

const load =
  (options: LiveOptions, catalog: ModelCatalogService) =>
  (spec: StageLoadSpec, onProgress?: (progress: { loadedBytes: number; totalBytes: number }) => void) =>
    Effect.gen(function* () {
      // the header through the model catalog: one parse per file version, shared with the facts and the layout
      const file = yield* catalog.header(spec.path)
      const layout = yield* layoutStage(file, spec)
      const ggml = yield* Effect.try({
        try: () => getGgml(options.ggml),
        catch: (e) =>
          new ModelLoadError({
            path: spec.path,
            reason: "BackendUnavailable",
            message: e instanceof Error ? e.message : String(e)
          })
      })
      const gpu = yield* stageGpu(spec, ggml)
      // a GPU stage larger than its device's budget keeps its last blocks there, the rest in host memory
      const share =
        gpu === null
          ? null
          : splitForDevice(
              layout,
              ggml,
              gpu,
              defaultContextOf(options, layout.hp.nCtxTrain),
              spec.deviceBudgetBytes ?? options.deviceBudgetBytes
            )
      const device = share === null || share.blocks === 0 ? ("cpu" as const) : ("gpu" as const)
      const weights = yield* Effect.acquireRelease(
        Effect.tryPromise({
          try: () =>
            loadWeights(layout, {
              repack: options.repack ?? true,
              device,
              ...(share === null ? {} : { deviceFrom: spec.layerEndExclusive - share.blocks }),
              ...(options.mmap !== undefined ? { mmap: options.mmap } : {}),
              ...(options.smallBatchRows !== undefined ? { smallBatchRows: options.smallBatchRows } : {}),
              ...(options.zeroCopy !== undefined ? { zeroCopy: options.zeroCopy } : {}),
              ...(options.hugePages !== undefined ? { hugePages: options.hugePages } : {}),
              ...(onProgress ? { onProgress } : {})
            }),
          catch: (e) =>
            new ModelLoadError({
              path: spec.path,
              reason: "Io",
              message: `loading blocks [${spec.layerStart}, ${spec.layerEndExclusive}): ${
                e instanceof Error ? e.message : String(e)
              }`
            })
        }),
        (w) => Effect.promise(() => w.lock.run(async () => w.free()))
      )
      const hp = layout.hp
      const info: StageInfo = {
        arch: hp.arch,
        layerStart: spec.layerStart,
        layerEndExclusive: spec.layerEndExclusive,
        numLayers: hp.nLayer,
        isFirst: spec.isFirst,
        isLast: spec.isLast,
        // the input rows' width: gemma4's per-layer inputs of this stage's blocks and later ones travel with them
        hiddenDim: activationWidth(hp, spec.layerStart),
        vocabSize: hp.nVocab,
        contextLength: hp.nCtxTrain,
        eosTokenId: hp.eosTokenId,
        bosTokenId: hp.bosTokenId,
        weightBytes: layout.weightBytes,
        backend: device === "gpu" ? ggml.library.gpu || "gpu" : "cpu",
        ...(share === null ? {} : { device: share }),
        // KV rows, DeltaNet states and capped sliding-window caches of the range's blocks (BlockMemory.ts)
        ...stageMemoryOf(hp, spec.layerStart, spec.layerEndExclusive)
      }
      return new LiveLoadedStage(info, weights) as LoadedStage
    }).pipe(Effect.withSpan("StageExecutor.load"))

/** A session of the live executor: one NativeSession (KV cache) over a LiveLoadedStage. */
class LiveStageSession implements StageSession {
  constructor(
    readonly stage: LiveLoadedStage,
    readonly native: NativeSession,
    readonly contextLength: number
  ) {}
  get info(): StageInfo {
    return this.stage.info
  }
  check(startPos: number, input: StageInput): ContextOverflow | InvalidStageInput | undefined {
    if (this.native.freed) return new InvalidStageInput({ message: "the session is closed" })
    const invalid = validateForward(this.stage.info, this.contextLength, this.native.filled, startPos, input)
    if (invalid === undefined && !this.native.canStartAt(startPos) && this.native.recurrent) {
      return new InvalidStageInput({
        message:
          `start position ${startPos}: this stage's DeltaNet state is that of position ${this.native.filled} and ` +
          `cannot be rewound; continue from ${this.native.filled} or start again from position 0`
      })
    }
    if (invalid === undefined && !this.native.canStartAt(startPos)) {
      // a rewind past what a capped sliding-window cache still holds: compute the positions again on a fresh session
      return new InvalidStageInput({
        message:
          `start position ${startPos}: the sliding-window cache no longer holds the window before it (it holds ` +
          `positions ${this.native.swaLow}..${this.native.filled - 1}); start again from position 0`
      })
    }
    return invalid
  }
  forward(startPos: number, input: StageInput): Effect.Effect<StageOutput, ForwardError> {
    return Effect.suspend((): Effect.Effect<StageOutput, ForwardError> => {
      const invalid = this.check(startPos, input)
      if (invalid !== undefined) return Effect.fail(invalid)
      return Effect.tryPromise({
        try: () => forwardOne(this.native, startPos, input),
        catch: (e) => new EngineError({ message: e instanceof Error ? e.message : String(e) })
      })
    }).pipe(Effect.withSpan("StageExecutor.forward"))
  }
  get reset(): Effect.Effect<void> {
    return Effect.promise(() => this.stage.weights.lock.run(async () => this.native.reset()))
  }
}

/** Checks a whole batch in TypeScript (nothing native runs before every item passed), then runs it as one graph. */
const forwardBatch = (
  items: ReadonlyArray<BatchItem>,
  phases?: ForwardPhases
): Effect.Effect<ReadonlyArray<StageOutput>, ForwardBatchError> =>
  Effect.suspend((): Effect.Effect<ReadonlyArray<StageOutput>, ForwardBatchError> => {
    if (items.length === 0) return Effect.fail(new InvalidBatch({ message: "a batch needs at least one item" }))
    const natives: Array<NativeItem> = []
    const seen = new Map<LiveStageSession, number>()
    let weights: NativeWeights | undefined
    for (let i = 0; i < items.length; i++) {
      const { input, session, startPos } = items[i]!
      if (!(session instanceof LiveStageSession)) {
        return Effect.fail(new InvalidBatch({ message: `item ${i}: the session was not opened by the live executor` }))
      }
      const info = session.stage.info
      if (weights === undefined) weights = session.stage.weights
      else if (session.stage.weights !== weights) {
        const first = items[0]!.session.info
        return Effect.fail(
          new InvalidBatch({
            message:
              `item ${i}: its session is on blocks [${info.layerStart}, ${info.layerEndExclusive}) of another ` +
              `loaded stage than item 0's [${first.layerStart}, ${first.layerEndExclusive}); a batch runs one loaded stage`
          })
        )
      }
      const earlier = seen.get(session)
      if (earlier !== undefined) {
        return Effect.fail(
          new InvalidBatch({
            message: `item ${i}: its session is already item ${earlier} of the batch (one step per session)`
          })
        )
      }
      seen.set(session, i)
      const invalid = session.check(startPos, input)
      if (invalid !== undefined) return Effect.fail(new BatchItemRejected({ index: i, error: invalid }))
      natives.push({ session: session.native, startPos, input })
    }
    return Effect.tryPromise({
      try: () => runBatch(weights!, natives, phases),
      catch: (e) => new EngineError({ message: e instanceof Error ? e.message : String(e) })
    })
  }).pipe(Effect.withSpan("StageExecutor.forwardBatch", { attributes: { items: items.length } }))

const session =
  (options: LiveOptions) =>
  (stage: LoadedStage, sessionOptions: SessionOptions = {}) =>
    Effect.gen(function* () {
      if (!(stage instanceof LiveLoadedStage)) {
        return yield* Effect.dieMessage("StageExecutorLive.session: the stage was not loaded by this executor")
      }
      const info = stage.info
      const contextLength = sessionOptions.contextLength ?? defaultContextOf(options, info.contextLength)
      const threads = sessionOptions.threads ?? options.defaultThreads ?? availableParallelism()
      if (!Number.isSafeInteger(contextLength) || contextLength < 1 || contextLength > 1 << 20) {
        return yield* Effect.dieMessage(`contextLength ${contextLength} must be an integer in [1, 2^20]`)
      }
      // The bounds every caller checks first (services/RequestChecks.ts: the CLI, the orchestrator, the agent).
      const prefillThreads = sessionOptions.prefillThreads ?? threads
      const badThreads = threadsProblem(threads) ?? threadsProblem(prefillThreads)
      if (badThreads !== undefined) return yield* Effect.dieMessage(badThreads)
      const native = yield* Effect.acquireRelease(
        Effect.try({
          try: () =>
            new NativeSession(stage.weights, contextLength, threads, sessionOptions.scratch === true, prefillThreads),
          catch: (e) =>
            new ModelLoadError({
              path: stage.weights.layout.file.path,
              reason: "BackendUnavailable",
              message: e instanceof Error ? e.message : String(e)
            })
        }),
        (s) => Effect.promise(() => stage.weights.lock.run(async () => s.free()))
      )
      return new LiveStageSession(stage, native, contextLength) as StageSession
    })

/** Prompt cache: the first `length` KV positions of one session into another of the same loaded stage. */
const copyPrefix = (from: StageSession, to: StageSession, length: number): Effect.Effect<void, InvalidStageInput> =>
  Effect.suspend(() => {
    if (!(from instanceof LiveStageSession) || !(to instanceof LiveStageSession) || from.stage !== to.stage) {
      return Effect.fail(
        new InvalidStageInput({ message: "copyPrefix: both sessions must be of one loaded stage of this executor" })
      )
    }
    if (from.native.freed || to.native.freed)
      return Effect.fail(new InvalidStageInput({ message: "the session is closed" }))
    if (!(Number.isSafeInteger(length) && length >= 0 && length <= from.native.filled && length <= to.contextLength)) {
      return Effect.fail(
        new InvalidStageInput({
          message: `cannot copy ${length} KV positions: the source holds ${from.native.filled}, the target ${to.contextLength}`
        })
      )
    }
    if (
      from.native.recurrent &&
      length !== 0 &&
      length !== from.native.filled &&
      from.native.snapshotRowOf(length) === undefined
    ) {
      return Effect.fail(
        new InvalidStageInput({
          message:
            `cannot copy ${length} positions: the source's DeltaNet state is that of position ${from.native.filled} ` +
            `and cannot be rewound (only a whole copy, or one ending in its last speculative step's rows, is exact)`
        })
      )
    }
    if (!from.native.canStartAt(length)) {
      // the source's capped sliding-window cache lost the window before `length`: the caller prefills instead
      return Effect.fail(
        new InvalidStageInput({
          message: `cannot copy ${length} KV positions: the source's sliding-window cache holds positions ${from.native.swaLow}..${
            from.native.filled - 1
          } only`
        })
      )
    }
    return Effect.sync(() => to.native.copyPrefixFrom(from.native, length))
  })

/**
 * The options with the hooks the caller left out taken here from the resolved settings (config/Settings.ts): when the
 * executor is made, never per call.
 */
const withHooks = (options: LiveOptions, settings: SettingsValues): LiveOptions => {
  const hooks = settings.engineHooks
  const threads = settings.threads
  const gpuMemory = settings.gpuMemory
  return {
    ggml: settings,
    ...(gpuMemory === undefined ? {} : { deviceBudgetBytes: gpuMemory }),
    mmap: hooks.mmap,
    hugePages: hooks.hugePages,
    zeroCopy: hooks.zeroCopy,
    ...(hooks.smallBatchRows === undefined ? {} : { smallBatchRows: hooks.smallBatchRows }),
    ...(threads === undefined ? {} : { defaultThreads: threads }),
    ...options
  }
}

export const make = (
  options: LiveOptions = {},
  catalog: ModelCatalogService = ModelCatalogLive.make,
  settings: SettingsValues = liveSettings()
): StageExecutorService => makeWith(withHooks(options, settings), catalog)

const makeWith = (options: LiveOptions, catalog: ModelCatalogService): StageExecutorService => ({
  load: load(options, catalog),
  session: session(options),
  forwardBatch,
  copyPrefix
})

/**
 * The GPU device a stage computes on (null: the CPU): "cuda" and "vulkan" need the loaded package to be that one
 * (the process's SWACTOR_GGML_PACKAGE, `--backend`) and to see a device, else one line saying what the node has;
 * "auto" takes the loaded package's GPU when it has one.
 */
const stageGpu = (spec: StageLoadSpec, ggml: Ggml): Effect.Effect<Ptr | null, ModelLoadError> => {
  const backend = spec.backend ?? "cpu"
  if (backend === "cpu") return Effect.succeed(null)
  const gpu = ggml.gpuDevice()
  if (backend === "auto") return Effect.succeed(gpu)
  const have = ggml.library.gpu
  const fail = (message: string) =>
    Effect.fail(new ModelLoadError({ path: spec.path, reason: "BackendUnavailable", message }))
  if (have !== backend) {
    return fail(
      `--backend ${backend} needs node-llama-cpp's ${backend} package, but this node loaded ${ggml.library.packageName} ` +
        `(start it with --backend ${backend} or SWACTOR_GGML_PACKAGE=${backend})`
    )
  }
  if (gpu === null) {
    const hint =
      backend === "cuda"
        ? "an NVIDIA GPU and driver"
        : "a Vulkan device (a GPU driver, or Mesa's lavapipe with GGML_VK_VISIBLE_DEVICES=0)"
    return fail(
      `no ${backend} device in ${ggml.library.packageName}: this node has ${ggml.deviceSummary()}; it needs ${hint}`
    )
  }
  return Effect.succeed(gpu)
}

/** The live executor over whichever model catalog is provided (it reads each file's GGUF header from it). */
export const layerWithCatalog = (options: LiveOptions = {}): Layer.Layer<StageExecutor, never, ModelCatalog> =>
  Layer.effect(
    StageExecutor,
    Effect.map(Effect.all([ModelCatalog, Settings]), ([catalog, settings]) => make(options, catalog, settings))
  )

/** The live executor with options (e.g. `repack: false`), over the live model catalog. */
export const layerWith = (options: LiveOptions): Layer.Layer<StageExecutor> =>
  layerWithCatalog(options).pipe(Layer.provide(ModelCatalogLive.layer))

/** The live stage executor (CPU ggml), over the live model catalog. */
export const layer: Layer.Layer<StageExecutor> = layerWith({})
