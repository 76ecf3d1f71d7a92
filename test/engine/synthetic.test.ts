import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { afterAll } from "vitest"
import { GgmlType } from "../../src/domain/ggmlTypes.js"
import { GgufValues, writeGgufFile } from "../../src/layers/gguf/GgufWriter.js"
import {
  type SyntheticArch,
  type SyntheticModelOptions,
  syntheticModelSpec,
  type SyntheticType,
  writeSyntheticModel
} from "../../src/layers/gguf/Synthetic.js"
import { logSoftmax } from "../../src/services/Sampler.js"
import { allSplits, type EngineRun, greedyRun, maxLogProbDiff, referenceRun } from "../support/engine.js"

const N_TOKENS = 32
const LAYERS = 4
const options = { threads: 1, contextLength: 512 } as const
const dir = mkdtempSync(join(tmpdir(), "swactor-engine-"))
afterAll(() => rmSync(dir, { recursive: true, force: true }))

const sameBits = (a: Float32Array, b: Float32Array) =>
  a.length === b.length && new Uint32Array(a.buffer).every((x, i) => x === new Uint32Array(b.buffer)[i])

const shape = (
  arch: SyntheticArch,
  type: SyntheticType,
  extra: Partial<SyntheticModelOptions> = {}
): SyntheticModelOptions => ({
  path: join(dir, `${arch}-${type}${extra.tiedOutput === true ? "-tied" : ""}.gguf`),
  arch,
  layers: LAYERS,
  hidden: 256,
  ffn: 512,
  heads: 4,
  kvHeads: 2,
  vocab: 400,
  contextLength: 512,
  type,
  seed: 11,
  ...extra
})

/** Runs node-llama-cpp and every split of our engine on one model file. */
const checkModel = (label: string, path: string, exact: boolean) =>
  Effect.gen(function* () {
    const ref = yield* Effect.promise(() => referenceRun(path, "Once upon a time", N_TOKENS, options))
    // the stream is not trivial (e.g. one token repeated)
    assert.isAtLeast(new Set(ref.tokens).size, 4, `reference stream ${ref.tokens}`)
    let single: EngineRun | undefined
    let maxDiff = 0
    for (const split of allSplits(LAYERS, 4)) {
      const run = yield* greedyRun(path, split, ref.prompt, N_TOKENS, options)
      assert.deepStrictEqual(run.tokens, ref.tokens, `split ${JSON.stringify(split)}`)
      maxDiff = Math.max(maxDiff, maxLogProbDiff(logSoftmax(run.logits[0]!), ref.firstProbabilities))
      if (single === undefined) single = run
      else run.logits.forEach((l, i) => assert.isTrue(sameBits(l, single!.logits[i]!), `split ${split} position ${i}`))
    }
    console.log(
      `${label}: ${allSplits(LAYERS, 4).length} splits x ${N_TOKENS} tokens equal node-llama-cpp; ` +
        `first-position log-prob max diff ${maxDiff.toExponential(2)}`
    )
    if (exact) assert.isBelow(maxDiff, 1e-4)
  })

describe("synthetic models: every split of every architecture and type matches node-llama-cpp", () => {
  const archs: ReadonlyArray<SyntheticArch> = ["llama", "qwen2", "qwen3"]
  const types: ReadonlyArray<SyntheticType> = ["f32", "f16", "q8_0", "q4_k"]
  for (const arch of archs) {
    for (const type of types) {
      const exact = type === "f32" || type === "f16"
      // Same tokens for all 8 splits of 4 blocks; splits bit-identical to one stage; f32/f16 log-probs within 1e-4.
      const name =
        `${arch} ${type}: greedy ${N_TOKENS} tokens of every split equal node-llama-cpp's` +
        (exact ? ", log-probs within 1e-4" : "")
      it.live(name, () =>
        Effect.gen(function* () {
          const o = shape(arch, type)
          yield* writeSyntheticModel(o)
          yield* checkModel(`${arch} ${type}`, o.path, exact)
        })
      )
    }
  }

  // Other types the engine multiplies: bf16, and q4_0 / q6_k (q4_0 is repacked on AVX2 CPUs, q6_k is not).
  for (const type of ["bf16", "q4_0", "q6_k"] as const) {
    it.live(`llama ${type}: greedy ${N_TOKENS} tokens of every split equal node-llama-cpp's`, () =>
      Effect.gen(function* () {
        const o = shape("llama", type)
        yield* writeSyntheticModel(o)
        yield* checkModel(`llama ${type}`, o.path, false)
      })
    )
  }

  // llama 3 features: rope frequency factors (rope_freqs.weight) and an output head tied to token_embd.
  it.live("llama f16 with rope freq factors and tied output matches node-llama-cpp", () =>
    Effect.gen(function* () {
      const o = shape("llama", "f16", { tiedOutput: true })
      const spec = syntheticModelSpec(o)
      const nFreq = 256 / 4 / 2
      const freqs = Float32Array.from({ length: nFreq }, (_, i) => 1 + (i % 7) * 0.75)
      yield* writeGgufFile(o.path, {
        metadata: spec.metadata,
        tensors: [
          ...spec.tensors,
          { name: "rope_freqs.weight", type: GgmlType.F32, dims: [nFreq], data: () => new Uint8Array(freqs.buffer) }
        ]
      })
      yield* checkModel("llama f16 rope_freqs + tied", o.path, true)
    })
  )

  // YaRN RoPE scaling on a llama (rope.scaling.type yarn, factor 4, original context 16): ggml_rope_ext's ext_factor 1
  // and attn_factor as llama.cpp's context derives them (HParams.ts, PositionScaling.ts).
  it.live("llama f32 with YaRN rope scaling matches node-llama-cpp", () =>
    Effect.gen(function* () {
      const o = shape("llama", "f32", { path: join(dir, "llama-f32-yarn.gguf") })
      const spec = syntheticModelSpec(o)
      yield* writeGgufFile(o.path, {
        metadata: [
          ...spec.metadata,
          ["llama.rope.scaling.type", GgufValues.string("yarn")],
          ["llama.rope.scaling.factor", GgufValues.f32(4)],
          ["llama.rope.scaling.original_context_length", GgufValues.u32(16)]
        ],
        tensors: spec.tensors
      })
      yield* checkModel("llama f32 yarn", o.path, true)
    })
  )
})
