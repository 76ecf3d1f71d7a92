/**
 * gemma4's mixture of experts (Gemma 4 26B-A4B's layout, archs/gemma4Moe.ts): every block routes 2 of 8 GELU experts
 * beside its dense feed-forward (router over the RMS-normed residual times `ffn_gate_inp.scale`, per-expert output
 * scale `ffn_down_exps.scale`, the two branches' own norms), with the 31B/26B-A4B per-block head sizes and KV heads.
 * On synthetic models of that layout: every split into 1, 2 and 3 stages, cutting between sliding-window and global
 * blocks, gives node-llama-cpp's greedy tokens past twice the window; sequences batched equal their lone runs;
 * `swactor synth --arch gemma4 --experts` writes it and node-llama-cpp loads it.
 */
import * as Command from "@effect/cli/Command"
import * as NodeContext from "@effect/platform-node/NodeContext"
import { assert, describe, it } from "@effect/vitest"
import { Effect, Exit } from "effect"
import { join } from "node:path"
import { synthCommand } from "../../src/cli/SynthCommand.js"
import { layerWith } from "../../src/layers/engine/StageExecutorLive.js"
import { getU32, readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { type SyntheticModelOptions, writeSyntheticModel } from "../../src/layers/gguf/Synthetic.js"
import { makeRng } from "../../src/services/Sampler.js"
import * as Batch from "../support/batch.js"
import type { SeqPlan } from "../support/batch.js"
import { allSplits, nodeLlamaReference, splitsMatchReference } from "../support/engine.js"
import {
  gemma4Model,
  modelFolder,
  REFERENCE_OPTIONS as options,
  STORY_PROMPT as PROMPT
} from "../support/synthFiles.js"

const dir = modelFolder("swactor-engine-gemma4moe-")

/** 26B-A4B at tiny size: 8 experts, 2 per token, expert width 64 beside the dense 256; 31B-style head shapes. */
const model = (name: string, extra: Partial<SyntheticModelOptions> = {}): SyntheticModelOptions =>
  gemma4Model(join(dir, `${name}.gguf`), {
    heads: 8,
    kvHeads: 4,
    headDim: 32,
    swaHeadDim: 16,
    globalKvHeads: 1,
    kEqV: true,
    experts: 8,
    expertsUsed: 2,
    expertFfn: 64,
    seed: 61,
    ...extra
  })

describe("gemma4 experts (26B-A4B layout): every split matches node-llama-cpp past the window", () => {
  it.live(
    "f32, 8 experts top-2, window 16, pattern 3, soft-capping 10: all 16 splits give node-llama-cpp's 48 tokens",
    () =>
      Effect.gen(function* () {
        const o = model("moe-f32", { logitSoftcap: 10 })
        yield* writeSyntheticModel(o)
        const n = 48
        const ref = yield* nodeLlamaReference(o.path, PROMPT, n, options)
        assert.isAbove(ref.prompt.length + n, 2 * 16, "the run is longer than twice the window")
        assert.isAtLeast(new Set(ref.tokens).size, 8, `reference stream ${ref.tokens}`)
        const splits = allSplits(o.layers, 3)
        const maxDiff = yield* splitsMatchReference(o.path, ref, splits, options)
        console.log(
          `gemma4 experts: ${splits.length} splits x ${n} tokens after a ${ref.prompt.length}-token prompt equal ` +
            `node-llama-cpp's; first-position log-prob max diff ${maxDiff.toExponential(2)}`
        )
        assert.isBelow(maxDiff, 1e-4)
      }),
    300_000
  )

  it.live(
    "q8_0, 8 experts top-3, tied output: 1, 2 and 3 stages give node-llama-cpp's 40 tokens",
    () =>
      Effect.gen(function* () {
        const o = model("moe-q8", { type: "q8_0", expertsUsed: 3, tiedOutput: true, seed: 62 })
        yield* writeSyntheticModel(o)
        const ref = yield* nodeLlamaReference(o.path, PROMPT, 40, options)
        assert.isAtLeast(new Set(ref.tokens).size, 8, `reference stream ${ref.tokens}`)
        const maxDiff = yield* splitsMatchReference(
          o.path,
          ref,
          [
            [0, 6],
            [0, 3, 6],
            [0, 2, 3, 6]
          ],
          options
        )
        console.log(`gemma4 experts q8_0: first-position log-prob max diff ${maxDiff.toExponential(2)}`)
        assert.isBelow(maxDiff, 1e-3)
      }),
    300_000
  )
})

describe("gemma4 experts: sequences batched equal their lone runs", () => {
  const schedule = (): ReadonlyArray<SeqPlan> => {
    const r = makeRng(63)
    const prompt = (n: number) => Array.from({ length: n }, () => 3 + Math.floor(r() * 397))
    return [
      { prompt: prompt(5), start: 0, steps: 30 },
      { prompt: prompt(20), start: 0, steps: 30 },
      { prompt: prompt(1), start: 2, steps: 24 },
      { prompt: prompt(40), start: 1, steps: 30 },
      { prompt: prompt(60), start: 0, steps: 24, chunk: 24 }
    ]
  }
  // each row routes on its own logits: on the few-row route (8) a row's products have the same bits in a batch as
  // alone, so its expert choice does too (on tinyBLAS a router logit's last bits can differ and flip a near tie)
  it.live(
    "q8_0, few-row route 8, 1/2/3 stages (cuts at sliding|global and global|sliding): bit-identical logits to the lone runs",
    () =>
      Effect.gen(function* () {
        const o = model("moe-batch", { type: "q8_0", seed: 64 })
        yield* writeSyntheticModel(o)
        yield* Batch.batchedEqualsAlone(
          o.path,
          [
            [0, 6],
            [0, 3, 6],
            [0, 2, 4, 6]
          ],
          schedule(),
          256,
          { bitIdentical: true }
        )
      }).pipe(Effect.provide(layerWith({ smallBatchRows: 8 }))),
    300_000
  )
})

describe("swactor synth --arch gemma4 --experts", () => {
  const cli = Command.run(Command.make("swactor").pipe(Command.withSubcommands([synthCommand])), {
    name: "swactor",
    version: "test"
  })
  it.live(
    "writes the experts' keys and tensors; node-llama-cpp loads it and our 2 stages give its tokens",
    () =>
      Effect.gen(function* () {
        const out = join(dir, "cli-gemma4moe.gguf")
        const exit = yield* cli([
          "node",
          "swactor",
          "synth",
          "--arch",
          "gemma4",
          "--layers",
          "4",
          "--hidden",
          "128",
          "--ffn",
          "256",
          "--heads",
          "4",
          "--kv-heads",
          "2",
          "--experts",
          "8",
          "--experts-used",
          "2",
          "--expert-ffn",
          "64",
          "--vocab",
          "400",
          "--context-length",
          "512",
          "--sliding-window",
          "16",
          "--swa-pattern",
          "2",
          "--k-eq-v",
          "--type",
          "q8_0",
          "-o",
          out
        ]).pipe(Effect.provide(NodeContext.layer), Effect.exit)
        assert.isTrue(Exit.isSuccess(exit))
        const file = yield* readGgufFile(out)
        assert.strictEqual(yield* getU32(file, "gemma4.expert_count"), 8)
        assert.strictEqual(yield* getU32(file, "gemma4.expert_used_count"), 2)
        // gate and up fused as the converter writes them (gate rows first)
        assert.deepStrictEqual(file.tensorsByName.get("blk.1.ffn_gate_up_exps.weight")?.dims, [128, 128, 8])
        assert.isFalse(file.tensorsByName.has("blk.1.ffn_gate_exps.weight"))
        assert.deepStrictEqual(file.tensorsByName.get("blk.1.ffn_down_exps.scale")?.dims, [8])
        assert.isTrue(file.tensorsByName.has("blk.3.ffn_gate.weight"), "the dense feed-forward stays")
        const ref = yield* nodeLlamaReference(out, PROMPT, 40, options)
        assert.isAtLeast(ref.tokens.length, 24)
        yield* splitsMatchReference(out, ref, [[0, 1, 4]], options)
      }),
    120_000
  )
})
