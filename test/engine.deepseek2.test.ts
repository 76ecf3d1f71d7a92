/**
 * deepseek2 (archs/deepseek2.ts: multi-head latent attention in llama.cpp's absorbed form, a K-only latent cache,
 * leading dense blocks, routed blocks with the expert bias and a shared expert) on synthetic files written by
 * SyntheticDeepseek2.ts at small size (4 blocks: 1 dense + 3 routed, hidden 256, 4 heads of 64 (32 no-RoPE + 32
 * RoPE), kv_lora_rank 64, q_lora_rank 64, 8 experts of 128, 2 used, 1 shared):
 * - every split into 1, 2 and 3 stages (cuts between the dense and the routed blocks included) gives node-llama-cpp's
 *   greedy tokens on the same file;
 * - sequences batched together equal the same sequences alone;
 * - the cache and the byte counts hold the latent row only (kv_lora_rank + rope per token and block);
 * - bad metadata is a typed ModelLoadError naming the key.
 */
import { assert, describe, it } from "@effect/vitest"
import { Effect, Exit } from "effect"
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { afterAll } from "vitest"
import { GgufValues, writeGgufFile } from "../src/layers/gguf/GgufWriter.js"
import { layerWith } from "../src/layers/engine/StageExecutorLive.js"
import {
  type SyntheticModelOptions,
  syntheticModelSpec,
  type SyntheticType,
  writeSyntheticModel
} from "../src/layers/gguf/Synthetic.js"
import { logSoftmax, makeRng } from "../src/services/Sampler.js"
import { StageExecutor } from "../src/services/StageExecutor.js"
import * as Batch from "./support/batch.js"
import type { SeqPlan } from "./support/batch.js"
import { allSplits, type EngineRun, greedyRun, maxLogProbDiff, referenceRun } from "./support/engine.js"

const N_TOKENS = 24
const LAYERS = 4
const CONTEXT = 512
const options = { threads: 1, contextLength: CONTEXT } as const
const dir = mkdtempSync(join(tmpdir(), "swactor-deepseek2-"))
afterAll(() => rmSync(dir, { recursive: true, force: true }))

const sameBits = (a: Float32Array, b: Float32Array) =>
  a.length === b.length && new Uint32Array(a.buffer).every((x, i) => x === new Uint32Array(b.buffer)[i])

const shape = (type: SyntheticType, extra: Partial<SyntheticModelOptions> = {}): SyntheticModelOptions => ({
  path: join(dir, `deepseek2-${type}.gguf`),
  arch: "deepseek2",
  layers: LAYERS,
  hidden: 256,
  ffn: 512,
  heads: 4,
  kvHeads: 1,
  vocab: 400,
  contextLength: CONTEXT,
  type,
  seed: 11,
  experts: 8,
  expertsUsed: 2,
  expertFfn: 128,
  ...extra
})

/** node-llama-cpp's greedy tokens on `path`, then every split into 1-3 stages: same tokens, splits bit-identical. */
const checkParity = (label: string, path: string) =>
  Effect.gen(function*() {
    const ref = yield* Effect.promise(() => referenceRun(path, "Once upon a time", N_TOKENS, options))
    assert.isAtLeast(new Set(ref.tokens).size, 4, `reference stream ${ref.tokens}`)
    let single: EngineRun | undefined
    let maxDiff = 0
    const splits = allSplits(LAYERS, 3)
    for (const split of splits) {
      const run = yield* greedyRun(path, split, ref.prompt, N_TOKENS, options)
      assert.deepStrictEqual(run.tokens, ref.tokens, `split ${JSON.stringify(split)}`)
      maxDiff = Math.max(maxDiff, maxLogProbDiff(logSoftmax(run.logits[0]!), ref.firstProbabilities))
      if (single === undefined) single = run
      else run.logits.forEach((l, i) => assert.isTrue(sameBits(l, single!.logits[i]!), `split ${split} position ${i}`))
    }
    console.log(
      `${label}: ${splits.length} splits x ${N_TOKENS} tokens equal node-llama-cpp; ` +
        `first-position log-prob max diff ${maxDiff.toExponential(2)}`
    )
    assert.isBelow(maxDiff, 1e-4)
  })

describe("deepseek2: every split into 1, 2 and 3 stages gives node-llama-cpp's greedy tokens", () => {
  const cases: ReadonlyArray<readonly [SyntheticType, Partial<SyntheticModelOptions>, string]> = [
    ["f32", {}, "q_lora 64"],
    ["q8_0", {}, "q_lora 64"],
    ["f32", { qLoraRank: 0, path: join(dir, "deepseek2-f32-noqlora.gguf") }, "no q compression (attn_q)"]
  ]
  for (const [type, extra, what] of cases) {
    it.live(`deepseek2 ${type}, ${what}, 1 dense + 3 routed blocks, 8 experts, 2 used, 1 shared: ${N_TOKENS} greedy tokens at every split equal node-llama-cpp's, log-probs within 1e-4`, () =>
      Effect.gen(function*() {
        const o = shape(type, extra)
        yield* writeSyntheticModel(o)
        yield* checkParity(`deepseek2 ${type} ${what}`, o.path)
      }), 240_000)
  }
})
