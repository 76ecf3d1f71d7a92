/**
 * Every weight type the shipped ggml CPU backend computes, and llama.cpp-style mixed files: a small synthetic llama
 * of each `swactor synth --type` gives node-llama-cpp's greedy tokens at 1 and 2 stages; files holding a matrix of a
 * type the backend cannot multiply fail to load with a typed error naming the tensor.
 */
import { assert, describe, it } from "@effect/vitest"
import { Effect, Exit } from "effect"
import { existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { afterAll } from "vitest"
import { GGML_TYPE_COUNT, GgmlType, ggmlTypeInfo, ggmlTypeName, tensorBytes } from "../../src/domain/ggmlTypes.js"
import type { ModelLoadError } from "../../src/domain/gguf.js"
import { layerWith } from "../../src/layers/engine/StageExecutorLive.js"
import * as StageExecutorLive from "../../src/layers/engine/StageExecutorLive.js"
import { getU32, readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { type GgufTensorSpec, writeGgufFile } from "../../src/layers/gguf/GgufWriter.js"
import {
  type SyntheticModelOptions,
  syntheticModelSpec,
  type SyntheticType,
  syntheticTypes,
  writeSyntheticModel
} from "../../src/layers/gguf/Synthetic.js"
import { syntheticDefaultTypeId, syntheticFileType } from "../../src/layers/gguf/SyntheticTypes.js"
import { StageExecutor } from "../../src/services/StageExecutor.js"
import * as Batch from "../support/batch.js"
import { decodeBatchGetsLoneBits, nodeLlamaReference, splitsMatchReference } from "../support/engine.js"
import { llamaQuantize } from "../support/llamaQuantize.js"

const N_TOKENS = 16
const LAYERS = 4
const options = { threads: 1, contextLength: 256 } as const
const dir = mkdtempSync(join(tmpdir(), "swactor-wtypes-"))
afterAll(() => rmSync(dir, { recursive: true, force: true }))

/** The tensor types of the mixed files (4 blocks), by llama.cpp's rules for these file types (SyntheticTypes.ts). */
const mixedRecipes: Partial<Record<SyntheticType, Record<string, number>>> = {
  // output q6_K; attn_v and ffn_down q6_K in blocks 2 and 3 (use_more_bits), q4_K in 0 and 1; the rest q4_K
  q4_k_m: { f32: 9, q4_K: 25, q6_K: 5 },
  // output q6_K; attn_v q5_K in blocks 0 and 1, q4_K after; ffn_down and attn_output q4_K; the rest q3_K
  q3_k_m: { f32: 9, q3_K: 17, q4_K: 10, q5_K: 2, q6_K: 1 }
}

const shape = (type: SyntheticType): SyntheticModelOptions => ({
  path: join(dir, `llama-${type}.gguf`),
  arch: "llama",
  layers: LAYERS,
  hidden: 256,
  ffn: 512,
  heads: 4,
  kvHeads: 2,
  vocab: 400,
  contextLength: 256,
  type,
  seed: 5
})

describe("every weight type of the CPU backend: synthetic llama of each type gives node-llama-cpp's tokens", () => {
  for (const type of syntheticTypes) {
    it.live(`${type}: greedy ${N_TOKENS} tokens at 1 and 2 stages equal node-llama-cpp's`, () =>
      Effect.gen(function* () {
        const o = shape(type)
        const summary = yield* writeSyntheticModel(o)
        assert.deepStrictEqual(summary.fallbacks, [])
        const file = yield* readGgufFile(o.path)
        assert.strictEqual(yield* getU32(file, "general.file_type"), syntheticFileType(type))
        const mixed = mixedRecipes[type]
        if (mixed !== undefined) assert.deepStrictEqual(summary.tensorTypes, mixed)
        else {
          const expected = new Set([ggmlTypeName(syntheticDefaultTypeId(type)), "f32"])
          assert.deepStrictEqual(Object.keys(summary.tensorTypes).sort(), [...expected].sort())
        }
        const ref = yield* nodeLlamaReference(o.path, "Once upon a time", N_TOKENS, options)
        // the stream is not trivial (one token repeated)
        assert.isAtLeast(new Set(ref.tokens).size, 3, `reference stream ${ref.tokens}`)
        const maxDiff = yield* splitsMatchReference(
          o.path,
          ref,
          [
            [0, LAYERS],
            [0, 2, LAYERS]
          ],
          options,
          { bitIdentical: false }
        )
        console.log(
          `${type}: ${JSON.stringify(summary.tensorTypes)}; first-position log-prob max diff ${maxDiff.toExponential(1)}`
        )
        // same kernels as llama.cpp's (repacked where it repacks): the log-probs agree to rounding, whatever the type
        assert.isBelow(maxDiff, 1e-4)
      })
    )
  }
})

describe("every weight type on the few-row route: a decode batch gets the bits of its lone steps", () => {
  // Forced, nothing measured: repacking off (every weight in the plain buffer, which the route requires) and the
  // few-row route on for up to 8 rows (Toolkit.mulMatSmall: ggml's one-row kernel on each row), so 2 and 5 sequences
  // decoding together must give each sequence exactly its lone step's logits, whatever the weight type.
  for (const type of syntheticTypes) {
    it.live(`${type}: 2 and 5 sequences batched equal their lone decode steps bit for bit`, () =>
      Effect.gen(function* () {
        const o = shape(type)
        if (!existsSync(o.path)) yield* writeSyntheticModel(o)
        const [whole] = yield* Batch.loadSplit(o.path, [0, LAYERS])
        yield* decodeBatchGetsLoneBits(whole!, [2, 5], 390, 9)
      }).pipe(Effect.scoped, Effect.provide(layerWith({ repack: false, smallBatchRows: 8 })))
    )
  }
})

describe("mixed recipes: the per-tensor types llama.cpp's own quantizer picks", () => {
  // llama_model_quantize (libllama, node-llama-cpp's) of the f32 file of the same model is the oracle; 4, 8 and 16
  // blocks reach every rule (use_more_bits' first/last eighth and every third block, q3_k_m's first sixteenth)
  const cases = [
    ["q4_k_m", 4, false],
    ["q4_k_m", 8, true],
    ["q4_k_m", 16, false],
    ["q3_k_m", 4, false],
    ["q3_k_m", 16, true]
  ] as const
  for (const [type, layers, tiedOutput] of cases) {
    it.live(
      `${type}, ${layers} blocks${tiedOutput ? ", tied output" : ""}: every tensor's type equals llama_model_quantize's`,
      () =>
        Effect.gen(function* () {
          const o = { ...shape(type), layers, ffn: 256, tiedOutput, path: join(dir, `mix-${type}-${layers}.gguf`) }
          const f32 = { ...o, type: "f32" as const, path: join(dir, `mix-${type}-${layers}-f32.gguf`) }
          const refPath = join(dir, `mix-${type}-${layers}-llama.gguf`)
          yield* writeSyntheticModel(o)
          yield* writeSyntheticModel(f32)
          llamaQuantize(f32.path, refPath, syntheticFileType(type))
          const ours = yield* readGgufFile(o.path)
          const ref = yield* readGgufFile(refPath)
          assert.deepStrictEqual(ours.tensors.map((t) => t.name).sort(), ref.tensors.map((t) => t.name).sort())
          const differ = ours.tensors.flatMap((t) => {
            const theirs = ref.tensorsByName.get(t.name)!.type
            return theirs === t.type
              ? []
              : [`${t.name}: ours ${ggmlTypeName(t.type)}, llama.cpp ${ggmlTypeName(theirs)}`]
          })
          assert.deepStrictEqual(differ, [])
          assert.strictEqual(yield* getU32(ours, "general.file_type"), yield* getU32(ref, "general.file_type"))
        })
    )
  }
})

/** A small llama (hidden 256: every block size fits) whose `blk.1.ffn_up.weight` has ggml type `type`. */
const badFile = (label: string, type: number) =>
  Effect.gen(function* () {
    const o = { ...shape("f32"), layers: 2, ffn: 256, vocab: 300, path: join(dir, `bad-${label}.gguf`) }
    const spec = syntheticModelSpec(o)
    const tensors = spec.tensors.map((t): GgufTensorSpec =>
      t.name === "blk.1.ffn_up.weight" && ggmlTypeInfo(type) !== undefined
        ? { ...t, type, data: () => new Uint8Array(tensorBytes(type, t.dims)) }
        : t
    )
    yield* writeGgufFile(o.path, { metadata: spec.metadata, tensors })
    if (ggmlTypeInfo(type) === undefined) {
      // no writer writes an unknown type: patch the F32 tensor's type field in the table (name, n_dims, dims, type)
      const bytes = readFileSync(o.path)
      const name = Buffer.from("blk.1.ffn_up.weight")
      const at = bytes.indexOf(name) + name.length
      const nDims = bytes.readUInt32LE(at)
      assert.strictEqual(bytes.readUInt32LE(at + 4 + 8 * nDims), GgmlType.F32)
      bytes.writeUInt32LE(type, at + 4 + 8 * nDims)
      writeFileSync(o.path, bytes)
    }
    return o.path
  })

const loadStage = (path: string, layerStart: number, layerEndExclusive: number) =>
  Effect.gen(function* () {
    const executor = yield* StageExecutor
    return yield* Effect.exit(
      Effect.scoped(
        executor.load({
          path,
          layerStart,
          layerEndExclusive,
          isFirst: layerStart === 0,
          isLast: layerEndExclusive === 2
        })
      )
    )
  }).pipe(Effect.provide(StageExecutorLive.layer))

const failure = (exit: Exit.Exit<unknown, ModelLoadError>) => {
  assert.isTrue(Exit.isFailure(exit), "the stage loaded")
  const e = Exit.isFailure(exit) && exit.cause._tag === "Fail" ? exit.cause.error : undefined
  return { reason: e?.reason ?? `defect ${Exit.isFailure(exit) ? String(exit.cause) : ""}`, message: e?.message ?? "" }
}

describe("a matrix of a type the CPU backend cannot compute is a typed error naming the tensor", () => {
  // types of the pinned ggml without a CPU dot product: the layout check refuses them before any native call
  for (const type of [GgmlType.Q8_K, GgmlType.Q8_1, GgmlType.I32, GgmlType.F64]) {
    it.live(`${ggmlTypeName(type)}: UnsupportedTensorType naming blk.1.ffn_up.weight; a stage without it loads`, () =>
      Effect.gen(function* () {
        const path = yield* badFile(ggmlTypeName(type), type)
        const r = failure(yield* loadStage(path, 0, 2))
        assert.strictEqual(r.reason, "UnsupportedTensorType")
        assert.include(r.message, `"blk.1.ffn_up.weight"`)
        assert.include(r.message, ggmlTypeName(type))
        assert.isTrue(Exit.isSuccess(yield* loadStage(path, 0, 1)), "block 0 alone holds no bad tensor")
      })
    )
  }

  // ids that are no type of the pinned ggml (removed 4, 31, 36; past GGML_TYPE_COUNT): refused when the file is read
  for (const type of [4, 31, 36, GGML_TYPE_COUNT, 1000]) {
    it.live(`unknown type id ${type}: UnsupportedTensorType naming blk.1.ffn_up.weight`, () =>
      Effect.gen(function* () {
        const path = yield* badFile(`id${type}`, type)
        const r = failure(yield* loadStage(path, 1, 2))
        assert.strictEqual(r.reason, "UnsupportedTensorType")
        assert.include(r.message, `"blk.1.ffn_up.weight"`)
        assert.include(r.message, `type ${type}`)
      })
    )
  }
})
