/**
 * Stacked experts (ffn_*_exps, multiplied through ggml_mul_mat_id) in the repacked CPU buffer (WeightPlacement's rule
 * 1 for mul_mat_id, as llama.cpp places them): each placement forced in turn (repack on, repack off) on synthetic
 * qwen3moe files whose experts ggml repacks (q4_0, q4_k):
 * - with repack on, every ffn_*_exps tensor is in CPU_REPACK (not used in place from the mapping); with it off, none is
 *   in an extra buffer type;
 * - both give node-llama-cpp's greedy tokens on the same file (node-llama-cpp repacks the experts too), whole and split;
 * - with the experts repacked, sequences batched together give the same tokens as each alone (not the same bits: the
 *   repacked 2-D products take a 4-row gemm for 4+ rows, a gemv below).
 */
import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { afterAll } from "vitest"
import { getGgml } from "../../src/layers/ggml/Bindings.js"
import { layerWith, LiveLoadedStage } from "../../src/layers/engine/StageExecutorLive.js"
import { type SyntheticType, writeSyntheticModel } from "../../src/layers/gguf/Synthetic.js"
import { batchedEqualsAlone, loadSplit, runAlone, type SeqPlan } from "../support/batch.js"
import { makeRng } from "../../src/services/Sampler.js"
import { nodeLlamaReference } from "../support/engine.js"

const N_TOKENS = 16
const LAYERS = 2
const CONTEXT = 256
const options = { threads: 1, contextLength: CONTEXT } as const
const dir = mkdtempSync(join(tmpdir(), "swactor-moe-repack-"))
afterAll(() => rmSync(dir, { recursive: true, force: true }))

const ggml = getGgml()
const extraNames: ReadonlySet<string> = new Set(
  ggml.cpuExtraBufferTypes().map((b) => ggml.raw.ggml_backend_buft_name(b))
)
const EXPERTS = /^blk\.\d+\.ffn_(gate|up|down)_exps\.weight$/

const writeModel = (type: SyntheticType) =>
  Effect.gen(function* () {
    // every expert matrix 256-wide (whole K-quant blocks) and a multiple of 8 rows (the 8x8 repacked layout)
    const path = join(dir, `qwen3moe-${type}.gguf`)
    const summary = yield* writeSyntheticModel({
      path,
      arch: "qwen3moe",
      layers: LAYERS,
      hidden: 256,
      ffn: 512,
      heads: 4,
      kvHeads: 2,
      vocab: 400,
      contextLength: CONTEXT,
      type,
      seed: 11,
      experts: 8,
      expertsUsed: 2,
      expertFfn: 256
    })
    assert.deepStrictEqual(summary.fallbacks, [], "no matrix fell back to another type")
    return path
  })

describe("qwen3moe: the stacked experts in the repacked CPU buffer, and out of it, both give node-llama-cpp's tokens", () => {
  for (const type of ["q4_0", "q4_k"] as const satisfies ReadonlyArray<SyntheticType>) {
    it.live(
      `qwen3moe ${type}, 8 experts, 2 used: repack on puts every ffn_*_exps in CPU_REPACK, off puts none in an extra ` +
        `type; both give node-llama-cpp's ${N_TOKENS} greedy tokens at splits [0,2] and [0,1,2]`,
      () =>
        Effect.gen(function* () {
          const path = yield* writeModel(type)
          assert.isTrue(extraNames.has("CPU_REPACK"), `this CPU has no CPU_REPACK buffer type (${[...extraNames]})`)
          const ref = yield* nodeLlamaReference(path, "Once upon a time", N_TOKENS, options)
          assert.isAtLeast(new Set(ref.tokens).size, 4, `reference stream ${ref.tokens}`)
          for (const repack of [true, false]) {
            for (const split of [
              [0, LAYERS],
              [0, 1, LAYERS]
            ]) {
              const at = `${type}, repack ${repack ? "on" : "off"}, split ${JSON.stringify(split)}`
              const tokens = yield* Effect.scoped(
                Effect.gen(function* () {
                  const stages = (yield* loadSplit(path, split)).map((s) => {
                    assert.instanceOf(s, LiveLoadedStage)
                    return s as LiveLoadedStage
                  })
                  const experts = stages.flatMap((s) => s.placements).filter((p) => EXPERTS.test(p.name))
                  assert.strictEqual(experts.length, 3 * LAYERS, `${at}: expert tensors placed`)
                  for (const p of experts) {
                    if (repack) assert.strictEqual(p.bufferType, "CPU_REPACK", `${at}: ${p.name}`)
                    else assert.isFalse(extraNames.has(p.bufferType), `${at}: ${p.name} in ${p.bufferType}`)
                  }
                  const run = yield* runAlone(stages, { prompt: ref.prompt, start: 0, steps: N_TOKENS }, CONTEXT)
                  return run.tokens
                })
              ).pipe(Effect.provide(layerWith({ repack })))
              assert.deepStrictEqual(tokens, ref.tokens, `${at}: greedy tokens equal node-llama-cpp's`)
            }
            console.log(`moeRepack ${type}, repack ${repack ? "on" : "off"}: ${N_TOKENS} tokens equal node-llama-cpp's`)
          }
        }),
      180_000
    )
  }
})

/** 4 sequences, different prompts (each row routes to its own experts), joins, an early finish, a chunked prefill. */
const schedule = (vocab: number): ReadonlyArray<SeqPlan> => {
  const r = makeRng(23)
  const prompt = (n: number) => Array.from({ length: n }, () => 3 + Math.floor(r() * (vocab - 3)))
  return [
    { prompt: prompt(5), start: 0, steps: 12 },
    { prompt: prompt(9), start: 0, steps: 12 },
    { prompt: prompt(1), start: 2, steps: 8 },
    { prompt: prompt(20), start: 1, steps: 12, chunk: 7 }
  ]
}

describe("qwen3moe with the experts repacked: sequences batched together equal the same sequences alone", () => {
  it.live(
    "qwen3moe q4_k, repack on, few-row route off: 4 sequences, 1 and 2 stages: tokens equal lone runs",
    () =>
      Effect.gen(function* () {
        const path = yield* writeModel("q4_k")
        const maxDiff = yield* batchedEqualsAlone(
          path,
          [
            [0, LAYERS],
            [0, 1, LAYERS]
          ],
          schedule(400),
          CONTEXT
        )
        console.log(`moeRepack q4_k batched vs alone max logit difference ${maxDiff.toExponential(2)}`)
      }).pipe(Effect.provide(layerWith({ repack: true, smallBatchRows: 0 }))),
    180_000
  )
})
