import { assert, describe, it } from "@effect/vitest"
import { Effect, Exit } from "effect"
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { afterAll } from "vitest"
import type { StageLoadSpec } from "../../src/domain/engine.js"
import { GgmlType } from "../../src/domain/ggmlTypes.js"
import type { ModelLoadError } from "../../src/domain/gguf.js"
import {
  GgufValues,
  type GgufTensorSpec,
  type GgufTypedValue,
  writeGgufFile
} from "../../src/layers/gguf/GgufWriter.js"
import { syntheticModelSpec, type SyntheticModelOptions } from "../../src/layers/gguf/Synthetic.js"
import * as StageExecutorLive from "../../src/layers/engine/StageExecutorLive.js"
import { StageExecutor } from "../../src/services/StageExecutor.js"
import { requireModel } from "../support/models.js"

const dir = mkdtempSync(join(tmpdir(), "swactor-engine-errors-"))
afterAll(() => rmSync(dir, { recursive: true, force: true }))

const canonical: SyntheticModelOptions = {
  path: "",
  arch: "qwen3",
  layers: 2,
  hidden: 64,
  ffn: 128,
  heads: 4,
  kvHeads: 2,
  vocab: 300,
  contextLength: 256,
  type: "f32",
  seed: 3
}

/** Writes the canonical model with one fact tweaked, and tries to load its first stage. */
const loadTweaked = (
  name: string,
  tweak: (md: Array<readonly [string, GgufTypedValue]>, tensors: Array<GgufTensorSpec>) => void,
  spec: Partial<StageLoadSpec> = {}
) =>
  Effect.gen(function* () {
    const path = join(dir, `${name}.gguf`)
    const s = syntheticModelSpec({ ...canonical, path })
    const md = [...s.metadata]
    const tensors = [...s.tensors]
    tweak(md, tensors)
    yield* writeGgufFile(path, { metadata: md, tensors })
    const executor = yield* StageExecutor
    return yield* Effect.exit(
      Effect.scoped(executor.load({ path, layerStart: 0, layerEndExclusive: 1, isFirst: true, isLast: false, ...spec }))
    )
  }).pipe(Effect.provide(StageExecutorLive.layer))

const reasonOf = (exit: Exit.Exit<unknown, ModelLoadError>) => {
  if (Exit.isSuccess(exit)) return { reason: "loaded", message: "" }
  const e = exit.cause._tag === "Fail" ? exit.cause.error : undefined
  return { reason: e?.reason ?? "defect", message: e?.message ?? String(exit.cause) }
}

const replaceTensor = (tensors: Array<GgufTensorSpec>, name: string, f: (t: GgufTensorSpec) => GgufTensorSpec) => {
  const i = tensors.findIndex((t) => t.name === name)
  tensors[i] = f(tensors[i]!)
}

describe("a stage refuses a model it cannot run, with a typed ModelLoadError", () => {
  it.live("the canonical fixture loads", () =>
    Effect.gen(function* () {
      assert.strictEqual(reasonOf(yield* loadTweaked("ok", () => {})).reason, "loaded")
    })
  )

  // An architecture outside the table is named, with the supported ones listed.
  it.live("an unknown architecture is UnsupportedArchitecture listing llama, qwen2, qwen3", () =>
    Effect.gen(function* () {
      const r = reasonOf(
        yield* loadTweaked("arch", (md) => {
          md[md.findIndex(([k]) => k === "general.architecture")] = ["general.architecture", GgufValues.string("gpt2")]
        })
      )
      assert.strictEqual(r.reason, "UnsupportedArchitecture")
      assert.include(r.message, "gpt2")
      assert.include(r.message, "llama, qwen2, qwen3")
    })
  )

  it.live("a missing block tensor is MissingTensor naming it", () =>
    Effect.gen(function* () {
      const r = reasonOf(
        yield* loadTweaked("missing", (_, t) => {
          t.splice(
            t.findIndex((x) => x.name === "blk.0.attn_k_norm.weight"),
            1
          )
        })
      )
      assert.strictEqual(r.reason, "MissingTensor")
      assert.include(r.message, "blk.0.attn_k_norm.weight")
    })
  )

  it.live("a tensor of the wrong shape is TensorShapeMismatch", () =>
    Effect.gen(function* () {
      const r = reasonOf(
        yield* loadTweaked("shape", (_, t) =>
          replaceTensor(t, "blk.0.ffn_up.weight", (x) => ({
            ...x,
            dims: [64, 64],
            data: () => new Uint8Array(64 * 64 * 4)
          }))
        )
      )
      assert.strictEqual(r.reason, "TensorShapeMismatch")
      assert.include(r.message, "blk.0.ffn_up.weight")
    })
  )

  it.live("a norm stored as f16 is TensorTypeMismatch", () =>
    Effect.gen(function* () {
      const r = reasonOf(
        yield* loadTweaked("type", (_, t) =>
          replaceTensor(t, "blk.0.attn_norm.weight", (x) => ({
            ...x,
            type: GgmlType.F16,
            data: () => new Uint8Array(64 * 2)
          }))
        )
      )
      assert.strictEqual(r.reason, "TensorTypeMismatch")
    })
  )

  it.live("a block range outside the model is InvalidLayerRange", () =>
    Effect.gen(function* () {
      const r = reasonOf(yield* loadTweaked("range", () => {}, { layerEndExclusive: 3 }))
      assert.strictEqual(r.reason, "InvalidLayerRange")
    })
  )
})

describe("a session refuses what does not fit, and computes off the event loop", () => {
  const path = requireModel("stories260K.gguf")
  const first = { path, layerStart: 0, layerEndExclusive: 5, isFirst: true, isLast: true }

  it.live("context overflow is ContextOverflow; bad token ids and position gaps are InvalidStageInput", () =>
    Effect.scoped(
      Effect.gen(function* () {
        const executor = yield* StageExecutor
        const stage = yield* executor.load(first)
        const s = yield* executor.session(stage, { threads: 1, contextLength: 8 })
        const over = yield* Effect.flip(s.forward(0, { _tag: "Tokens", tokens: new Int32Array(9).fill(1) }))
        assert.strictEqual(over._tag, "ContextOverflow")
        yield* s.forward(0, { _tag: "Tokens", tokens: Int32Array.of(1, 2, 3) })
        const over2 = yield* Effect.flip(s.forward(3, { _tag: "Tokens", tokens: new Int32Array(6).fill(1) }))
        assert.strictEqual(over2._tag, "ContextOverflow")
        const bad = yield* Effect.flip(s.forward(3, { _tag: "Tokens", tokens: Int32Array.of(512) }))
        assert.strictEqual(bad._tag, "InvalidStageInput")
        const gap = yield* Effect.flip(s.forward(5, { _tag: "Tokens", tokens: Int32Array.of(1) }))
        assert.strictEqual(gap._tag, "InvalidStageInput")
        const hidden = yield* Effect.flip(s.forward(3, { _tag: "Hidden", hidden: new Float32Array(64), nTokens: 1 }))
        assert.strictEqual(hidden._tag, "InvalidStageInput")
        // reset: positions start again at 0, same logits as a fresh session
        yield* s.reset
        const a = yield* s.forward(0, { _tag: "Tokens", tokens: Int32Array.of(1, 403) })
        const fresh = yield* executor.session(stage, { threads: 1, contextLength: 8 })
        const b = yield* fresh.forward(0, { _tag: "Tokens", tokens: Int32Array.of(1, 403) })
        assert.deepStrictEqual(a, b)
      }).pipe(Effect.provide(StageExecutorLive.layer))
    )
  )

  // compute runs on a koffi worker thread: a timer keeps firing while a long prefill runs
  it.live("the event loop keeps running during compute", () =>
    Effect.scoped(
      Effect.gen(function* () {
        const executor = yield* StageExecutor
        const stage = yield* executor.load(first)
        const s = yield* executor.session(stage, { threads: 1, contextLength: 2048 })
        // one long call: if compute blocked the loop, no tick could fire until it returned
        let ticks = 0
        const timer = setInterval(() => ticks++, 1)
        const started = performance.now()
        yield* s.forward(0, { _tag: "Tokens", tokens: new Int32Array(768).fill(300) })
        const ms = performance.now() - started
        clearInterval(timer)
        assert.isAtLeast(ms, 20, "the call should take long enough to measure")
        assert.isAtLeast(
          ticks,
          Math.min(10, Math.floor(ms / 4)),
          `${ticks} timer ticks during a ${ms.toFixed(0)} ms call`
        )
      }).pipe(Effect.provide(StageExecutorLive.layer))
    )
  )
})

describe("backend choice", () => {
  const path = requireModel("stories260K.gguf")
  // With node-llama-cpp's CPU package there is no GPU: "cuda" is refused in words, "auto" runs on the CPU.
  it.live("backend cuda without a GPU is BackendUnavailable; auto falls back to the CPU", () =>
    Effect.scoped(
      Effect.gen(function* () {
        const executor = yield* StageExecutor
        const spec = { path, layerStart: 0, layerEndExclusive: 5, isFirst: true, isLast: true } as const
        const refused = yield* Effect.flip(executor.load({ ...spec, backend: "cuda" }))
        assert.strictEqual(refused.reason, "BackendUnavailable")
        assert.include(refused.message, "SWACTOR_GGML_PACKAGE")
        const auto = yield* executor.load({ ...spec, backend: "auto" })
        assert.strictEqual(auto.info.backend, "cpu")
      }).pipe(Effect.provide(StageExecutorLive.layer))
    )
  )
})
