/**
 * One source of model facts (issue 37): what each block keeps per sequence is derived once, from the architecture's
 * hyperparameters (engine/BlockMemory.ts). For every architecture's synthetic file and every family's file as llama.cpp's
 * converter writes it (gguf-py), these agree to the byte, per block:
 * - the engine: the K/V tensors and DeltaNet states a session allocates on a stage holding the whole model;
 * - the catalog's layout (ModelCatalogLive.readModelLayout), through services/KvSize.ts `kvBytesOfRange`;
 * - placement (`stageMemoryBytes` of a one-block stage, weights taken off);
 * - the server's admission (KvSizing, a pipeline planned with that block as a stage);
 * and the stage's StageInfo gives the whole stage's sum. The cases reach every kind of block: full KV, a capped
 * sliding-window cache, per-block widths (gemma4 31B), a shared cache (gemma4 E2B), latent attention's K-only row
 * (deepseek2) and a DeltaNet state (qwen35).
 */
import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import { join } from "node:path"
import { blockMemory, type BlockMemory } from "../../src/layers/engine/BlockMemory.js"
import { NativeSession } from "../../src/layers/engine/KvCache.js"
import { layerWith, LiveLoadedStage } from "../../src/layers/engine/StageExecutorLive.js"
import { readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { readModelLayout } from "../../src/layers/gguf/ModelCatalogLive.js"
import { readModelHParams } from "../../src/layers/engine/StageLayout.js"
import { type SyntheticModelOptions, syntheticArchs, writeSyntheticModel } from "../../src/layers/gguf/Synthetic.js"
import * as KvSizing from "../../src/layers/server/KvSizing.js"
import { kvBytesOfRange, kvBytesOfStage } from "../../src/services/KvSize.js"
import { stageMemoryBytes } from "../../src/services/Placement.js"
import { StageExecutor } from "../../src/services/StageExecutor.js"
import { type ConvertedFamily, writeConverted } from "../support/convertedModels.js"
import { gemma4Model, modelFolder } from "../support/synthFiles.js"

const dir = modelFolder("swactor-engine-blockmem-")
/** A multiple of 256: placement's context is the engine's padded cache (services/KvSize.ts kvCacheSize). */
const CONTEXT = 1024
/** Not a multiple of 256: the cells are padded. */
const ODD_CONTEXT = 1000

const base = (arch: SyntheticModelOptions["arch"], name: string): SyntheticModelOptions => ({
  path: join(dir, `${name}.gguf`),
  arch,
  layers: 4,
  hidden: 128,
  ffn: 256,
  heads: 4,
  kvHeads: 2,
  vocab: 400,
  contextLength: 4096,
  type: "f32",
  seed: 17
})

/** Each synthetic architecture at a tiny size, with the options that give it its kinds of blocks. */
const synthetic: ReadonlyArray<readonly [string, SyntheticModelOptions]> = [
  ...syntheticArchs
    .filter((a) => a !== "gemma4")
    .map((arch) => {
      const o = base(arch, `synth-${arch}`)
      const extra: Partial<SyntheticModelOptions> =
        arch === "gemma3"
          ? { slidingWindow: 16, swaPattern: 2 }
          : arch === "gpt-oss"
            ? { experts: 4, expertsUsed: 2, slidingWindow: 16 }
            : ["qwen3moe", "glm4moe", "deepseek2", "qwen35moe"].includes(arch)
              ? { experts: 4, expertsUsed: 2 }
              : {}
      return [`synthetic ${arch}`, { ...o, ...extra }] as const
    }),
  [
    "synthetic gemma4 E2B (shared KV, per-layer inputs)",
    gemma4Model(join(dir, "synth-gemma4-e2b.gguf"), { layers: 9, perLayerEmbd: 32, sharedKvLayers: 3, kEqV: true })
  ],
  [
    "synthetic gemma4 31B (per-block head sizes and KV heads)",
    gemma4Model(join(dir, "synth-gemma4-31b.gguf"), {
      heads: 8,
      kvHeads: 4,
      headDim: 32,
      swaHeadDim: 16,
      globalKvHeads: 1,
      kEqV: true,
      contextLength: 4096
    })
  ]
]

const converted: ReadonlyArray<ConvertedFamily> = [
  "llama",
  "qwen2",
  "qwen3",
  "qwen3moe",
  "glm4moe",
  "gemma3",
  "gemma4",
  "gemma4-moe",
  "gemma4-e2b",
  "minimax-m2",
  "olmo2",
  "olmo3",
  "mistral3",
  "deepseek2",
  "deepseek4",
  "kimi-k3",
  "gpt-oss",
  "qwen35",
  "qwen35moe"
]

/** Per block, the bytes each reader gives for one sequence of `context` tokens. */
const readersAgree = (path: string, label: string) =>
  Effect.gen(function* () {
    const layout = yield* readModelLayout(path)
    const { hp } = yield* readModelHParams(yield* readGgufFile(path))
    const n = layout.blockBytes.length
    const stage = yield* (yield* StageExecutor).load({
      path,
      layerStart: 0,
      layerEndExclusive: n,
      isFirst: true,
      isLast: true
    })
    assert.instanceOf(stage, LiveLoadedStage)
    const weights = (stage as LiveLoadedStage).weights
    const raw = weights.ggml.raw
    const kinds: Array<BlockMemory["kind"] | "window" | "k-only"> = []
    for (const context of [CONTEXT, ODD_CONTEXT]) {
      const session = new NativeSession(weights, context, 1)
      try {
        const engine = Array.from({ length: n }, (_, il) => {
          const cache = session.kv.get(il)
          if (cache === undefined) return 0
          return raw.ggml_nbytes(cache.k) + (cache.v === cache.k ? 0 : raw.ggml_nbytes(cache.v))
        })
        const sizing = KvSizing.make(undefined, 1)
        sizing.model(layout)
        sizing.pipeline({ maxSeqLen: context, numLayers: n }, 1)
        for (let il = 0; il < n; il++) {
          const at = `${label}, block ${il}, context ${context}`
          assert.strictEqual(kvBytesOfRange(layout, il, il + 1, context), engine[il], `catalog layout: ${at}`)
          sizing.planned([{ layers: [il, il + 1] }])
          assert.strictEqual(sizing.bytes(context), engine[il], `admission: ${at}`)
          if (context === CONTEXT) {
            const options = { contextTokens: context, computeBytes: 0 }
            // the same stage with no KV and no state: its weights alone
            const { stateBytes: _state, ...stateless } = layout
            const weightsOnly = stageMemoryBytes(
              { ...stateless, kvBytesPerToken: layout.kvBytesPerToken.map(() => 0) },
              il,
              il + 1,
              options
            )
            assert.strictEqual(
              stageMemoryBytes(layout, il, il + 1, options) - weightsOnly,
              engine[il],
              `placement: ${at}`
            )
            const m = blockMemory(hp, il)
            kinds.push(m.kind)
            if (m.kind === "kv" && m.window !== undefined) kinds.push("window")
            if (m.kind === "kv" && m.vRow === 0) kinds.push("k-only")
          }
        }
        const total = engine.reduce((a, b) => a + b, 0)
        assert.strictEqual(kvBytesOfStage(stage.info, context), total, `StageInfo: ${label}, context ${context}`)
        assert.isAtLeast(session.kvBytes, total, `${label}: the cache buffer holds every block's tensors`)
      } finally {
        session.free()
      }
    }
    return kinds
  }).pipe(Effect.scoped)

describe("one source of per-block memory: engine, catalog, placement and admission agree to the byte", () => {
  it.live(
    "every synthetic architecture and every converter-written family, per block, at contexts 1024 and 1000",
    () =>
      Effect.gen(function* () {
        const seen = new Set<string>()
        for (const [label, o] of synthetic) {
          yield* writeSyntheticModel(o)
          for (const k of yield* readersAgree(o.path, label)) seen.add(k)
        }
        for (const family of converted) {
          const path = writeConverted(family, join(dir, `converted-${family}.gguf`), 7)
          for (const k of yield* readersAgree(path, `converted ${family}`)) seen.add(k)
        }
        // the cases reach every kind of block this is about
        assert.deepStrictEqual([...seen].sort(), ["k-only", "kv", "sharedKv", "state", "window"])
      }).pipe(Effect.provide(layerWith({ smallBatchRows: 0 }))),
    300_000
  )
})
