/**
 * gemma4 with the 31B's per-block attention shapes (HParams.blockHeads): sliding-window blocks with their own head size
 * (`attention.key_length_swa`, half the global one) and more KV heads than the global blocks (`head_count_kv` one count
 * per block), as the 31B ships them (256-wide heads and 16 KV heads against 512 and 4). On synthetic models of that
 * layout: every split into 1, 2 and 3 stages, cutting between the two kinds of block, gives node-llama-cpp's greedy
 * tokens past twice the window; sequences batched equal their lone runs; each block's KV cache, the stage's StageInfo,
 * the catalog's layout, placement's memory and the server's admission count each block's own row width (byte counts
 * against a hand computation); `swactor synth` writes the layout and node-llama-cpp loads it.
 */
import * as Command from "@effect/cli/Command"
import * as NodeContext from "@effect/platform-node/NodeContext"
import { assert, describe, it } from "@effect/vitest"
import { Effect, Exit } from "effect"
import { join } from "node:path"
import { synthCommand } from "../../src/cli/SynthCommand.js"
import { NativeSession } from "../../src/layers/engine/KvCache.js"
import { layerWith, LiveLoadedStage } from "../../src/layers/engine/StageExecutorLive.js"
import { getArray, getU32, readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { readModelLayout } from "../../src/layers/gguf/ModelCatalogLive.js"
import { kvBytesPerSequence } from "../../src/layers/server/KvSizing.js"
import { type SyntheticModelOptions, writeSyntheticModel } from "../../src/layers/gguf/Synthetic.js"
import { kvBytesOfStage, kvCacheSize, swaCacheSize } from "../../src/services/KvSize.js"
import { computeReserveBytes, stageMemoryBytes } from "../../src/services/Placement.js"
import { makeRng } from "../../src/services/Sampler.js"
import { StageExecutor } from "../../src/services/StageExecutor.js"
import * as Batch from "../support/batch.js"
import type { SeqPlan } from "../support/batch.js"
import { allSplits, nodeLlamaReference, splitsMatchReference } from "../support/engine.js"
import {
  gemma4Model,
  modelFolder,
  REFERENCE_OPTIONS as options,
  STORY_PROMPT as PROMPT
} from "../support/synthFiles.js"

const dir = modelFolder("swactor-engine-gemma4w-")

/**
 * The 31B's layout at tiny size: 8 query heads; global blocks (2 and 5) 32-wide heads and 1 KV head, no attn_v;
 * sliding-window blocks 16-wide heads and 4 KV heads. K/V row widths: 32 (global) and 64 (sliding).
 */
const model = (name: string, extra: Partial<SyntheticModelOptions> = {}): SyntheticModelOptions =>
  gemma4Model(join(dir, `${name}.gguf`), {
    heads: 8,
    kvHeads: 4,
    headDim: 32,
    swaHeadDim: 16,
    globalKvHeads: 1,
    kEqV: true,
    contextLength: 4096,
    seed: 51,
    ...extra
  })
const SLIDING = [true, true, false, true, true, false]
const rowOf = (il: number) => (SLIDING[il] ? 16 * 4 : 32 * 1)

describe("gemma4 31B layout (per-block head sizes and KV heads): every split matches node-llama-cpp past the window", () => {
  it.live(
    "f32, window 16, pattern 3, soft-capping 10: all 16 splits give node-llama-cpp's 48 tokens",
    () =>
      Effect.gen(function* () {
        const o = model("w-f32", { logitSoftcap: 10 })
        yield* writeSyntheticModel(o)
        const n = 48
        const ref = yield* nodeLlamaReference(o.path, PROMPT, n, options)
        assert.isAbove(ref.prompt.length + n, 2 * 16, "the run is longer than twice the window")
        assert.isAtLeast(new Set(ref.tokens).size, 8, `reference stream ${ref.tokens}`)
        const splits = allSplits(o.layers, 3)
        const cuts = new Set(splits.flatMap((s) => s.slice(1, -1)))
        for (const g of [2, 5])
          assert.isTrue(cuts.has(g) && (g + 1 === o.layers || cuts.has(g + 1)), `cuts around ${g}`)
        const maxDiff = yield* splitsMatchReference(o.path, ref, splits, options)
        console.log(
          `gemma4 31B layout: ${splits.length} splits x ${n} tokens after a ${ref.prompt.length}-token prompt equal ` +
            `node-llama-cpp's; first-position log-prob max diff ${maxDiff.toExponential(2)}`
        )
        assert.isBelow(maxDiff, 1e-4)
      }),
    300_000
  )
})

describe("gemma4 31B layout: sequences batched equal their lone runs", () => {
  const schedule = (): ReadonlyArray<SeqPlan> => {
    const r = makeRng(53)
    const prompt = (n: number) => Array.from({ length: n }, () => 3 + Math.floor(r() * 397))
    return [
      { prompt: prompt(5), start: 0, steps: 30 },
      { prompt: prompt(20), start: 0, steps: 30 },
      { prompt: prompt(1), start: 2, steps: 24 },
      { prompt: prompt(40), start: 1, steps: 30 },
      { prompt: prompt(60), start: 0, steps: 24, chunk: 24 }
    ]
  }
  it.live(
    "1/2/3 stages (cuts at sliding|global and global|sliding): tokens equal lone runs",
    () =>
      Effect.gen(function* () {
        const o = model("w-batch", { seed: 54 })
        yield* writeSyntheticModel(o)
        const maxDiff = yield* Batch.batchedEqualsAlone(
          o.path,
          [
            [0, 6],
            [0, 3, 6],
            [0, 2, 4, 6]
          ],
          schedule(),
          256
        )
        console.log(`gemma4 31B layout batched vs alone: max logit difference ${maxDiff.toExponential(2)}`)
        assert.isBelow(maxDiff, 2e-2)
      }).pipe(Effect.provide(layerWith({ smallBatchRows: 0 }))),
    300_000
  )
})

describe("gemma4 31B layout: each block's own K/V width in the cache and in the memory accounting", () => {
  it.live(
    "KvCache tensors, StageInfo, the catalog's layout and placement's memory against a hand computation",
    () =>
      Effect.gen(function* () {
        const o = model("w-layout", { seed: 55 })
        yield* writeSyntheticModel(o)
        const file = yield* readGgufFile(o.path)
        assert.deepStrictEqual(yield* getArray(file, "gemma4.attention.head_count_kv"), [4, 4, 1, 4, 4, 1])
        assert.strictEqual(yield* getU32(file, "gemma4.attention.key_length"), 32)
        assert.strictEqual(yield* getU32(file, "gemma4.attention.key_length_swa"), 16)
        assert.strictEqual(yield* getU32(file, "gemma4.rope.dimension_count_swa"), 16)
        const layout = yield* readModelLayout(o.path)
        // F16 K + V per token: 2 bytes x (64 + 64) sliding, 2 x (32 + 32) global
        assert.deepStrictEqual(layout.kvBytesPerToken, [256, 256, 128, 256, 256, 128])
        const ctx = 4096
        const placement = { contextTokens: ctx, computeBytes: computeReserveBytes(layout, ctx) }
        const hands = new Map<string, number>()
        for (const [start, end] of [
          [0, 2],
          [2, 3],
          [3, 6],
          [1, 6],
          [0, 6]
        ] as const) {
          const { info, cacheBytes } = yield* Effect.scoped(
            Effect.gen(function* () {
              const stage = yield* (yield* StageExecutor).load({
                path: o.path,
                layerStart: start,
                layerEndExclusive: end,
                isFirst: start === 0,
                isLast: end === 6
              })
              assert.instanceOf(stage, LiveLoadedStage)
              const session = new NativeSession((stage as LiveLoadedStage).weights, ctx, 1)
              try {
                return { info: stage.info, cacheBytes: session.kvBytes }
              } finally {
                session.free()
              }
            })
          )
          let perToken = 0
          let swaPerToken = 0
          let hand = 0
          for (let il = start; il < end; il++) {
            const bytes = 2 * 2 * rowOf(il)
            perToken += bytes
            if (SLIDING[il]) swaPerToken += bytes
            hand += bytes * (SLIDING[il] ? swaCacheSize(ctx, 16) : kvCacheSize(ctx))
          }
          assert.strictEqual(info.kvBytesPerToken, perToken, `StageInfo.kvBytesPerToken of [${start}, ${end})`)
          assert.deepStrictEqual(
            info.kvWindow,
            swaPerToken === 0 ? undefined : { window: 16, bytesPerToken: swaPerToken }
          )
          assert.strictEqual(cacheBytes, hand, `allocated cache of [${start}, ${end})`)
          assert.strictEqual(kvBytesOfStage(info, ctx), hand, `what the agent budgets for [${start}, ${end})`)
          const { slidingWindow: _, ...uncapped } = layout
          const capped = stageMemoryBytes(layout, start, end, placement)
          assert.strictEqual(
            stageMemoryBytes(uncapped, start, end, placement) - capped,
            swaPerToken * (kvCacheSize(ctx) - swaCacheSize(ctx, 16))
          )
          hands.set(`${start}-${end}`, hand)
        }
        // the server's admission: each planned stage's blocks at their own widths, the heaviest stage
        assert.deepStrictEqual(layout.kvBytesPerToken, [256, 256, 128, 256, 256, 128])
        for (const ranges of [
          [
            [0, 2],
            [2, 3],
            [3, 6]
          ],
          [[0, 6]]
        ] as const) {
          const most = Math.max(...ranges.map(([a, b]) => hands.get(`${a}-${b}`) ?? 0))
          assert.strictEqual(kvBytesPerSequence(layout, ranges, ctx), most, `admission over ${JSON.stringify(ranges)}`)
        }
      }).pipe(Effect.provide(layerWith({ smallBatchRows: 0 }))),
    120_000
  )
})

describe("swactor synth --arch gemma4 --swa-head-dim --global-kv-heads", () => {
  const cli = Command.run(Command.make("swactor").pipe(Command.withSubcommands([synthCommand])), {
    name: "swactor",
    version: "test"
  })
  it.live(
    "writes the 31B's per-block layout; node-llama-cpp loads it and our 3 stages give its tokens",
    () =>
      Effect.gen(function* () {
        const out = join(dir, "cli-gemma4w.gguf")
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
          "8",
          "--kv-heads",
          "4",
          "--head-dim",
          "32",
          "--swa-head-dim",
          "16",
          "--global-kv-heads",
          "1",
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
        assert.deepStrictEqual(yield* getArray(file, "gemma4.attention.head_count_kv"), [4, 1, 4, 1])
        assert.deepStrictEqual(file.tensorsByName.get("blk.0.attn_k.weight")?.dims, [128, 64])
        assert.deepStrictEqual(file.tensorsByName.get("blk.1.attn_k.weight")?.dims, [128, 32])
        assert.deepStrictEqual(file.tensorsByName.get("blk.1.attn_q.weight")?.dims, [128, 256])
        assert.deepStrictEqual(file.tensorsByName.get("rope_freqs.weight")?.dims, [16])
        const ref = yield* nodeLlamaReference(out, PROMPT, 40, options)
        assert.isAtLeast(ref.tokens.length, 24)
        yield* splitsMatchReference(out, ref, [[0, 1, 2, 4]], options)
      }),
    120_000
  )
})
