/**
 * A deterministic StageExecutor double: a tiny pure-TypeScript "model" with a KV cache per block, so that
 * orchestration tests get reproducible tokens, splits, resets and context overflows without ggml or files.
 *
 * Hidden state of a position (hiddenDim >= 4 floats): [token, position, history, blocksRun, 0...].
 * Every block stores its input token in its KV cache, sets `history` to the sum of the tokens cached at
 * positions <= this one, and adds (block + 1) to `blocksRun`. The last stage picks
 *   next = (31 * token + 17 * position + 13 * history + blocksRun + 7) mod vocabSize
 * (see `testModelNextToken`), with logits peaked on it. A broken KV cache, a skipped or repeated block, or a
 * wrong position changes the tokens.
 */
import { Effect, Layer } from "effect"
import {
  BatchItemRejected,
  ContextOverflow,
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
  type LoadedStage,
  type SessionOptions,
  StageExecutor,
  type StageExecutorService,
  type StageSession,
  validateForward
} from "../../services/StageExecutor.js"

export interface TestModel {
  readonly numLayers: number
  readonly hiddenDim: number
  readonly vocabSize: number
  readonly contextLength: number
  readonly eosTokenId: number
  readonly bosTokenId?: number
  /** Paths whose load fails with ModelLoadError "Io" (to test load failures). */
  readonly missingPaths?: ReadonlyArray<string>
}

export const defaultTestModel: TestModel = {
  numLayers: 6,
  hiddenDim: 8,
  vocabSize: 64,
  contextLength: 256,
  eosTokenId: 2,
  bosTokenId: 1
}

/** The token the test model predicts after `tokens` (the whole sequence so far, prompt included). */
export const testModelNextToken = (model: TestModel, tokens: ReadonlyArray<number>): number => {
  const n = tokens.length
  const last = tokens[n - 1] ?? 0
  const history = tokens.reduce((s, t) => s + t, 0)
  const blocksRun = (model.numLayers * (model.numLayers + 1)) / 2
  return (31 * last + 17 * (n - 1) + 13 * history + blocksRun + 7) % model.vocabSize
}

/** The greedy stream of the test model: `maxTokens` tokens, stopping after EOS. */
export const testModelGreedy = (model: TestModel, prompt: ReadonlyArray<number>, maxTokens: number): Array<number> => {
  const seq = [...prompt]
  const out: Array<number> = []
  while (out.length < maxTokens) {
    const t = testModelNextToken(model, seq)
    out.push(t)
    seq.push(t)
    if (t === model.eosTokenId) break
  }
  return out
}

class TestLoadedStage implements LoadedStage {
  constructor(
    readonly info: StageInfo,
    readonly model: TestModel
  ) {}
}

interface TestStageSession extends StageSession {
  readonly stage: TestLoadedStage
  readonly check: (startPos: number, input: StageInput) => ContextOverflow | InvalidStageInput | undefined
  readonly apply: (startPos: number, input: StageInput) => StageOutput
  /** Positions held, and the cache of each block (for copyPrefix). */
  readonly filled: () => number
  readonly adopt: (from: TestStageSession, length: number) => void
  readonly cache: ReadonlyMap<number, Float64Array>
}

const testSessions = new WeakSet<StageSession>()

/** The double's batch: the live executor's checks (all before anything runs), then each item in order. */
const forwardBatch = (items: ReadonlyArray<BatchItem>): Effect.Effect<ReadonlyArray<StageOutput>, ForwardBatchError> =>
  Effect.suspend((): Effect.Effect<ReadonlyArray<StageOutput>, ForwardBatchError> => {
    if (items.length === 0) return Effect.fail(new InvalidBatch({ message: "a batch needs at least one item" }))
    const seen = new Map<StageSession, number>()
    const sessions: Array<TestStageSession> = []
    for (let i = 0; i < items.length; i++) {
      const { input, session, startPos } = items[i]!
      if (!testSessions.has(session)) {
        return Effect.fail(new InvalidBatch({ message: `item ${i}: the session was not opened by the test executor` }))
      }
      const s = session as TestStageSession
      if (s.stage !== sessions[0]?.stage && sessions.length > 0) {
        return Effect.fail(
          new InvalidBatch({ message: `item ${i}: its session is on another loaded stage than item 0's` })
        )
      }
      const earlier = seen.get(session)
      if (earlier !== undefined) {
        return Effect.fail(
          new InvalidBatch({ message: `item ${i}: its session is already item ${earlier} of the batch` })
        )
      }
      seen.set(session, i)
      const invalid = s.check(startPos, input)
      if (invalid !== undefined) return Effect.fail(new BatchItemRejected({ index: i, error: invalid }))
      sessions.push(s)
    }
    return Effect.succeed(items.map((it, i) => sessions[i]!.apply(it.startPos, it.input)))
  })

const weightBytesOf = (model: TestModel, spec: StageLoadSpec) =>
  (spec.layerEndExclusive - spec.layerStart) * model.hiddenDim * model.hiddenDim * 4 +
  (spec.isFirst ? model.vocabSize * model.hiddenDim * 4 : 0) +
  (spec.isLast ? (model.vocabSize + 1) * model.hiddenDim * 4 : 0)

/** Loads a stage of the test model: the checks of a load, two progress reports, its StageInfo. */
const loadTestStage = (
  model: TestModel,
  spec: StageLoadSpec,
  onProgress: Parameters<StageExecutorService["load"]>[1]
): Effect.Effect<LoadedStage, ModelLoadError> =>
  Effect.gen(function* () {
    const fail = (reason: ModelLoadError["reason"], message: string) =>
      Effect.fail(new ModelLoadError({ path: spec.path, reason, message }))
    if (model.missingPaths?.includes(spec.path)) return yield* fail("Io", `no such file: ${spec.path}`)
    const { layerEndExclusive: end, layerStart: start } = spec
    if (!Number.isInteger(start) || !Number.isInteger(end) || start < 0 || end > model.numLayers || start >= end) {
      return yield* fail("InvalidLayerRange", `block range [${start}, ${end}) is outside the ${model.numLayers} blocks`)
    }
    if (spec.isFirst !== (start === 0) || spec.isLast !== (end === model.numLayers)) {
      return yield* fail("InvalidLayerRange", `isFirst/isLast do not match the range [${start}, ${end})`)
    }
    const weightBytes = weightBytesOf(model, spec)
    onProgress?.({ loadedBytes: 0, totalBytes: weightBytes })
    onProgress?.({ loadedBytes: weightBytes, totalBytes: weightBytes })
    const info: StageInfo = {
      arch: "test",
      layerStart: start,
      layerEndExclusive: end,
      numLayers: model.numLayers,
      isFirst: spec.isFirst,
      isLast: spec.isLast,
      hiddenDim: model.hiddenDim,
      vocabSize: model.vocabSize,
      contextLength: model.contextLength,
      eosTokenId: model.eosTokenId,
      bosTokenId: model.bosTokenId,
      weightBytes,
      backend: "test",
      kvBytesPerToken: (end - start) * 8
    }
    return new TestLoadedStage(info, model) as LoadedStage
  })

/** Runs a checked input through the stage's blocks over their caches `kv`: the hidden rows, or the last's logits. */
const runTestBlocks = (
  info: StageInfo,
  kv: ReadonlyMap<number, Float64Array>,
  startPos: number,
  input: StageInput
): StageOutput => {
  const d = info.hiddenDim
  const n = input._tag === "Tokens" ? input.tokens.length : input.nTokens
  let h: Float32Array
  if (input._tag === "Tokens") {
    h = new Float32Array(n * d)
    for (let i = 0; i < n; i++) {
      h[i * d] = input.tokens[i]!
      h[i * d + 1] = startPos + i
    }
  } else {
    h = Float32Array.from(input.hidden)
  }
  for (let l = info.layerStart; l < info.layerEndExclusive; l++) {
    const cache = kv.get(l)!
    for (let i = 0; i < n; i++) cache[startPos + i] = h[i * d]!
    for (let i = 0; i < n; i++) {
      let history = 0
      for (let p = 0; p <= startPos + i; p++) history += cache[p]!
      h[i * d + 2] = history
      h[i * d + 3] = h[i * d + 3]! + l + 1
    }
  }
  if (!info.isLast) return { _tag: "Hidden", hidden: h, nTokens: n }
  if (input.verify !== true) return { _tag: "Logits", logits: testLogits(info, h, n - 1) }
  // a speculative step's rows: every row's logits, row after row
  const logits = new Float32Array(info.vocabSize * n)
  for (let i = 0; i < n; i++) logits.set(testLogits(info, h, i), i * info.vocabSize)
  return { _tag: "Logits", logits, rows: n }
}

/** The test model's logits of row `i` of the last block's rows `h`. */
const testLogits = (info: StageInfo, h: Float32Array, i: number): Float32Array => {
  const d = info.hiddenDim
  const [token, position, history, blocksRun] = [h[i * d]!, h[i * d + 1]!, h[i * d + 2]!, h[i * d + 3]!]
  const next = (31 * token + 17 * position + 13 * history + blocksRun + 7) % info.vocabSize
  const logits = new Float32Array(info.vocabSize)
  for (let v = 0; v < info.vocabSize; v++) logits[v] = v === next ? 10 : -((v * 7 + position) % 11) / 11
  return logits
}

/** A session over a stage of this executor: a cache per block, closed with its scope. */
const openTestSession = (stage: LoadedStage, options: SessionOptions = {}) =>
  Effect.gen(function* () {
    if (!(stage instanceof TestLoadedStage)) {
      return yield* Effect.dieMessage("StageExecutorTest.session: the stage was not loaded by this executor")
    }
    const info = stage.info
    const contextLength = options.contextLength ?? info.contextLength
    const kv = new Map<number, Float64Array>()
    for (let l = info.layerStart; l < info.layerEndExclusive; l++) kv.set(l, new Float64Array(contextLength))
    let filled = 0
    let closed = false
    yield* Effect.addFinalizer(() => Effect.sync(() => (closed = true)))

    const check = (startPos: number, input: StageInput): ContextOverflow | InvalidStageInput | undefined =>
      closed
        ? new InvalidStageInput({ message: "the session is closed" })
        : validateForward(info, contextLength, filled, startPos, input)

    /** Runs a checked input. */
    const apply = (startPos: number, input: StageInput): StageOutput => {
      const out = runTestBlocks(info, kv, startPos, input)
      filled = startPos + (input._tag === "Tokens" ? input.tokens.length : input.nTokens)
      return out
    }

    const forward = (startPos: number, input: StageInput): Effect.Effect<StageOutput, ForwardError> =>
      Effect.suspend((): Effect.Effect<StageOutput, ForwardError> => {
        const invalid = check(startPos, input)
        return invalid !== undefined ? Effect.fail(invalid) : Effect.succeed(apply(startPos, input))
      })

    const session: TestStageSession = {
      info,
      stage,
      check,
      apply,
      forward,
      reset: Effect.sync(() => {
        filled = 0
        for (const c of kv.values()) c.fill(0)
      }),
      filled: () => filled,
      cache: kv,
      adopt: (from, length) => {
        for (const [l, c] of kv) c.set(from.cache.get(l)!.subarray(0, length))
        filled = length
      }
    }
    testSessions.add(session)
    return session as StageSession
  })

/** Copies the first `length` cached positions of one session of this executor to another on the same stage. */
const copyTestPrefix = (from: StageSession, to: StageSession, length: number) =>
  Effect.suspend(() => {
    if (!testSessions.has(from) || !testSessions.has(to)) {
      return Effect.fail(new InvalidStageInput({ message: "copyPrefix: both sessions must be of this executor" }))
    }
    const a = from as TestStageSession
    const b = to as TestStageSession
    if (a.stage !== b.stage)
      return Effect.fail(new InvalidStageInput({ message: "copyPrefix: the sessions are on other stages" }))
    const target = b.cache.values().next().value?.length ?? 0
    if (!(Number.isSafeInteger(length) && length >= 0 && length <= a.filled() && length <= target)) {
      return Effect.fail(
        new InvalidStageInput({ message: `cannot copy ${length} KV positions: the source holds ${a.filled()}` })
      )
    }
    return Effect.sync(() => b.adopt(a, length))
  })

export const make = (model: TestModel = defaultTestModel): StageExecutorService => ({
  load: (spec, onProgress) => loadTestStage(model, spec, onProgress),
  session: openTestSession,
  forwardBatch,
  copyPrefix: copyTestPrefix
})

/** The deterministic double with the default test model. */
export const layer: Layer.Layer<StageExecutor> = Layer.succeed(StageExecutor, make())

/** The double over a given test model. */
export const layerWith = (model: TestModel): Layer.Layer<StageExecutor> => Layer.succeed(StageExecutor, make(model))
