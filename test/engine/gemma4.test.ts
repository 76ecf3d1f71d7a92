/**
 * gemma4, dense text model (archs/gemma4.ts): greedy tokens of every split into 1, 2 and 3 stages equal
 * node-llama-cpp's on synthetic gemma4 models (sliding-window and global blocks, the splits cutting between the two
 * kinds; global blocks without attn_v, RoPE frequency factors, per-block output scales, soft-capping), prompt +
 * generation longer than twice the window, node-llama-cpp's capped and full SWA caches agreeing and a wider window
 * giving other tokens (it really slides); 8 sequences batched equal their lone runs; bad gemma4 metadata (odd or
 * mismatched sliding-window head sizes, a RoPE width past the head, shared KV layers reading a cache of the other kind,
 * and the parts of Gemma 4 swactor does not build: experts) is a typed error naming the key; a stage killed with SIGKILL mid-generation resumes on a spare with identical text.
 */
import * as Command from "@effect/cli/Command"
import * as NodeContext from "@effect/platform-node/NodeContext"
import { assert, describe, it } from "@effect/vitest"
import { Effect, Exit } from "effect"
import { join } from "node:path"
import { synthCommand } from "../../src/cli/SynthCommand.js"
import { GgufValueType, type ModelLoadError } from "../../src/domain/gguf.js"
import { layerWith } from "../../src/layers/engine/StageExecutorLive.js"
import { getArray, getString, getU32, readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { GgufValues, type GgufTypedValue, writeGgufFile } from "../../src/layers/gguf/GgufWriter.js"
import { readModelLayout } from "../../src/layers/gguf/ModelCatalogLive.js"
import { type SyntheticModelOptions, syntheticModelSpec, writeSyntheticModel } from "../../src/layers/gguf/Synthetic.js"
import { kvBytesPerTokenOfBlock } from "../../src/services/KvSize.js"
import { computeReserveBytes, stageMemoryBytes } from "../../src/services/Placement.js"
import { makeRng } from "../../src/services/Sampler.js"
import { StageExecutor } from "../../src/services/StageExecutor.js"
import * as Batch from "../support/batch.js"
import type { SeqPlan } from "../support/batch.js"
import { allSplits, nodeLlamaReference, splitsMatchReference } from "../support/engine.js"
import { killedStageResumes } from "../support/resume.js"
import {
  gemma4Model,
  modelFolder,
  REFERENCE_OPTIONS as options,
  STORY_PROMPT as PROMPT
} from "../support/synthFiles.js"

const dir = modelFolder("swactor-engine-gemma4-")

const model = (name: string, extra: Partial<SyntheticModelOptions> = {}): SyntheticModelOptions =>
  gemma4Model(join(dir, `${name}.gguf`), extra)

/**
 * Every split into 1..3 stages gives node-llama-cpp's greedy `n` tokens (its capped and full SWA caches agreeing),
 * logits bit-identical across splits; the same weights with the window past the context give node-llama-cpp other
 * tokens; the splits cut right before and right after each global block.
 */
const checkParity = (o: SyntheticModelOptions, n: number, globalBlocks: ReadonlyArray<number>, maxLogProb: number) =>
  Effect.gen(function* () {
    yield* writeSyntheticModel(o)
    const window = o.slidingWindow!
    const ref = yield* nodeLlamaReference(o.path, PROMPT, n, options)
    const refFull = yield* nodeLlamaReference(o.path, PROMPT, n, { ...options, swaFullCache: true })
    assert.isAbove(ref.prompt.length + n, 2 * window, "the run is longer than twice the window")
    assert.isAtLeast(new Set(ref.tokens).size, 8, `reference stream ${ref.tokens}`)
    assert.deepStrictEqual(refFull.tokens, ref.tokens, "node-llama-cpp: capped and full SWA caches agree")
    const wide = { ...o, path: o.path.replace(/\.gguf$/, "-wide.gguf"), slidingWindow: 4096 }
    yield* writeSyntheticModel(wide)
    const refWide = yield* nodeLlamaReference(wide.path, PROMPT, n, options)
    assert.notDeepEqual(refWide.tokens, ref.tokens, "widening the window changes node-llama-cpp's tokens")
    const splits = allSplits(o.layers, 3)
    const cuts = new Set(splits.flatMap((s) => s.slice(1, -1)))
    for (const g of globalBlocks) {
      assert.isTrue(cuts.has(g) && (g + 1 === o.layers || cuts.has(g + 1)), `cuts around global block ${g}`)
    }
    const maxDiff = yield* splitsMatchReference(o.path, ref, splits, options)
    console.log(
      `gemma4 ${o.type} window ${window}: ${splits.length} splits x ${n} tokens after a ${ref.prompt.length}-token prompt ` +
        `equal node-llama-cpp's (capped and full SWA cache); window 4096 gives other tokens; ` +
        `first-position log-prob max diff ${maxDiff.toExponential(2)}`
    )
    assert.isBelow(maxDiff, maxLogProb)
  })

describe("gemma4: every split into 1-3 stages matches node-llama-cpp past the sliding window", () => {
  // blocks 2 and 5 global (no attn_v: V is K's projection; RoPE frequency factors), the others slide over 16 positions
  it.live(
    "f32, window 16, pattern 3, global blocks without attn_v, soft-capping 10: all 16 splits give node-llama-cpp's 64 tokens",
    () => checkParity(model("gemma4-f32", { kEqV: true, logitSoftcap: 10 }), 64, [2, 5], 1e-4),
    300_000
  )

  // every block has attn_v; q8_0, tied output, window 24, pattern 2 (blocks 1 and 3 global); first-position log-prob
  // difference measured 1.2e-4 (q8_0 products: node-llama-cpp's repacked kernels sum in another order)
  it.live(
    "q8_0, window 24, pattern 2, attn_v everywhere, tied output: all 7 splits of 4 blocks give node-llama-cpp's 48 tokens",
    () =>
      checkParity(
        model("gemma4-q8", { layers: 4, type: "q8_0", slidingWindow: 24, swaPattern: 2, tiedOutput: true, seed: 42 }),
        48,
        [1, 3],
        1e-3
      ),
    300_000
  )
})

describe("gemma4: 8 sequences batched equal their lone runs", () => {
  const CONTEXT = 256
  const schedule = (): ReadonlyArray<SeqPlan> => {
    const r = makeRng(43)
    const prompt = (n: number) => Array.from({ length: n }, () => 3 + Math.floor(r() * 397))
    return [
      { prompt: prompt(5), start: 0, steps: 40 },
      { prompt: prompt(20), start: 0, steps: 40 },
      { prompt: prompt(1), start: 0, steps: 30 },
      { prompt: prompt(40), start: 2, steps: 40 },
      { prompt: prompt(7), start: 3, steps: 20 },
      { prompt: prompt(12), start: 0, steps: 40 },
      { prompt: prompt(3), start: 10, steps: 30 },
      { prompt: prompt(70), start: 1, steps: 36, chunk: 24 }
    ]
  }
  for (const rows of [0, 8] as const) {
    it.live(
      `window 16, pattern 3, global blocks without attn_v, 1/2/3 stages (cuts at local|global and global|local): tokens equal lone runs, few-row route ${rows}`,
      () =>
        Effect.gen(function* () {
          const o = model(`gemma4-batch-${rows}`, { kEqV: true, seed: 44 })
          yield* writeSyntheticModel(o)
          const maxDiff = yield* Batch.batchedEqualsAlone(
            o.path,
            [
              [0, 6],
              [0, 3, 6],
              [0, 2, 4, 6]
            ],
            schedule(),
            CONTEXT
          )
          console.log(`gemma4 batched vs alone, route ${rows}: max logit difference ${maxDiff.toExponential(2)}`)
          assert.isBelow(maxDiff, 2e-2)
        }).pipe(Effect.provide(layerWith({ smallBatchRows: rows }))),
      300_000
    )
  }
})

describe("gemma4: the catalog's layout and each loaded stage count the capped sliding-window caches", () => {
  // placement (--dry-run's memory) and the server's admission read the layout; the engine allocates the rings
  it.live(
    "pattern 3 as one bool per block: layout, each stage's kvWindow, and placement's memory less full caches",
    () =>
      Effect.gen(function* () {
        const o = model("gemma4-layout", { contextLength: 4096, seed: 45 })
        yield* writeSyntheticModel(o)
        const sliding = [true, true, false, true, true, false]
        const file = yield* readGgufFile(o.path)
        assert.deepStrictEqual(yield* getArray(file, "gemma4.attention.sliding_window_pattern"), sliding)
        const layout = yield* readModelLayout(o.path)
        assert.deepStrictEqual(layout.slidingWindow, { window: 16, blocks: sliding })
        const row = kvBytesPerTokenOfBlock((128 / 4) * 2, (128 / 4) * 2)
        const options = { contextTokens: 4096, computeBytes: computeReserveBytes(layout, 4096) }
        const { slidingWindow: _, ...uncapped } = layout
        for (const [start, end] of [
          [0, 2],
          [2, 3],
          [3, 6]
        ] as const) {
          const info = yield* Effect.scoped(
            Effect.gen(function* () {
              const stage = yield* (yield* StageExecutor).load({
                path: o.path,
                layerStart: start,
                layerEndExclusive: end,
                isFirst: start === 0,
                isLast: end === 6
              })
              return stage.info
            })
          )
          const slidingHere = sliding.slice(start, end).filter((b) => b).length
          assert.deepStrictEqual(
            info.kvWindow,
            slidingHere === 0 ? undefined : { window: 16, bytesPerToken: slidingHere * row }
          )
          assert.strictEqual(info.kvBytesPerToken, (end - start) * row)
          const memory = stageMemoryBytes(layout, start, end, options)
          assert.strictEqual(stageMemoryBytes(uncapped, start, end, options) - memory, slidingHere * (4096 - 256) * row)
        }
      }).pipe(Effect.provide(layerWith({ smallBatchRows: 0 }))),
    120_000
  )
})

describe("swactor synth --arch gemma4", () => {
  const cli = Command.run(Command.make("swactor").pipe(Command.withSubcommands([synthCommand])), {
    name: "swactor",
    version: "test"
  })
  const synth = (args: ReadonlyArray<string>) =>
    cli(["node", "swactor", "synth", ...args]).pipe(Effect.provide(NodeContext.layer), Effect.exit)

  it.live(
    "writes gemma4's keys and tensors from its flags; node-llama-cpp loads it and our 2 stages give its tokens",
    () =>
      Effect.gen(function* () {
        const out = join(dir, "cli-gemma4.gguf")
        const exit = yield* synth([
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
          "--vocab",
          "400",
          "--context-length",
          "512",
          "--sliding-window",
          "24",
          "--swa-pattern",
          "4",
          "--k-eq-v",
          "--logit-softcap",
          "10",
          "--type",
          "q8_0",
          "-o",
          out
        ])
        assert.isTrue(Exit.isSuccess(exit))
        const file = yield* readGgufFile(out)
        assert.strictEqual(yield* getString(file, "general.architecture"), "gemma4")
        assert.strictEqual(yield* getU32(file, "gemma4.attention.sliding_window"), 24)
        assert.deepStrictEqual(yield* getArray(file, "gemma4.attention.sliding_window_pattern"), [
          true,
          true,
          true,
          false
        ])
        assert.strictEqual(yield* getU32(file, "gemma4.embedding_length_per_layer_input"), 0)
        assert.isTrue(file.tensorsByName.has("rope_freqs.weight"))
        assert.isTrue(file.tensorsByName.has("blk.2.attn_v.weight"))
        assert.isFalse(file.tensorsByName.has("blk.3.attn_v.weight"), "the global block has no attn_v")
        // node-llama-cpp stops at the end-of-generation token (after 34 here); ours run as many
        const ref = yield* nodeLlamaReference(out, PROMPT, 40, options)
        assert.isAtLeast(ref.tokens.length, 24)
        yield* splitsMatchReference(out, ref, [[0, 3, 4]], options)
      }),
    120_000
  )
})

describe("gemma4: bad metadata and the parts swactor does not build are typed errors naming the key", () => {
  const base = model("gemma4-bad", { layers: 3, hidden: 64, ffn: 128, kEqV: true })
  const load = (path: string) =>
    Effect.flatMap(StageExecutor, (x) =>
      Effect.exit(Effect.scoped(x.load({ path, layerStart: 0, layerEndExclusive: 3, isFirst: true, isLast: true })))
    ).pipe(Effect.provide(layerWith({ smallBatchRows: 0 })))
  const failure = (exit: Exit.Exit<unknown, ModelLoadError>) => {
    assert.isTrue(Exit.isFailure(exit), "the load failed")
    if (!Exit.isFailure(exit) || exit.cause._tag !== "Fail") return assert.fail(`not a typed failure: ${String(exit)}`)
    return exit.cause.error
  }
  const u32 = GgufValues.u32
  const cases: ReadonlyArray<readonly [string, string, GgufTypedValue | undefined]> = [
    ["per-layer-embd-missing", "gemma4.embedding_length_per_layer_input", undefined],
    // block 2 (global) would read sliding block 1's cache (engine.gemma4PerLayer covers the shared KV layers built)
    ["shared-kv", "gemma4.attention.shared_kv_layers", u32(1)],
    ["experts", "gemma4.expert_count", u32(2000)],
    ["key-length-swa", "gemma4.attention.key_length_swa", u32(7)],
    ["key-length-swa-missing", "gemma4.attention.key_length_swa", undefined],
    ["value-length-swa", "gemma4.attention.value_length_swa", u32(8)],
    ["rope-dim-swa", "gemma4.rope.dimension_count_swa", u32(18)],
    ["window-zero", "gemma4.attention.sliding_window", u32(0)],
    ["window-missing", "gemma4.attention.sliding_window", undefined],
    ["pattern-period", "gemma4.attention.sliding_window_pattern", u32(3)],
    ["pattern-length", "gemma4.attention.sliding_window_pattern", GgufValues.array(GgufValueType.BOOL, [true, false])],
    ["pattern-missing", "gemma4.attention.sliding_window_pattern", undefined],
    ["swa-base-negative", "gemma4.rope.freq_base_swa", GgufValues.f32(-1)],
    ["softcap-negative", "gemma4.final_logit_softcapping", GgufValues.f32(-30)]
  ]
  for (const [name, key, value] of cases) {
    it.live(
      `${key} ${value === undefined ? "missing" : `= ${JSON.stringify(value.value)}`}: ModelLoadError naming it`,
      () =>
        Effect.gen(function* () {
          const path = join(dir, `${name}.gguf`)
          const s = syntheticModelSpec({ ...base, path })
          const md = s.metadata.filter(([k]) => k !== key)
          if (value !== undefined) md.push([key, value])
          yield* writeGgufFile(path, { metadata: md, tensors: s.tensors })
          const e = failure(yield* load(path))
          assert.strictEqual(e._tag, "ModelLoadError")
          assert.include(e.message, key)
        })
    )
  }
  it.live("a missing rope_freqs tensor (the model has global blocks): ModelLoadError naming it", () =>
    Effect.gen(function* () {
      const path = join(dir, "gemma4-no-rope-freqs.gguf")
      const s = syntheticModelSpec({ ...base, path })
      yield* writeGgufFile(path, {
        metadata: s.metadata,
        tensors: s.tensors.filter((t) => t.name !== "rope_freqs.weight")
      })
      assert.include(failure(yield* load(path)).message, "rope_freqs.weight")
    })
  )
})

describe("gemma4 end to end: a killed stage agent resumes with identical text past the window", () => {
  // 3 stages + 1 spare on local agents: the middle stage holds global block 2 and sliding block 3; its agent is killed
  // with SIGKILL at token 24 (past twice the window): the spare takes the stage, the prompt and the tokens so far are
  // replayed, and the stream goes on to the uninterrupted run's tokens and text.
  it.live(
    "q8_0, window 16, pattern 3, global blocks without attn_v, kill -9 of the middle stage: greedy output equals the uninterrupted run's",
    () =>
      Effect.gen(function* () {
        const o = model("gemma4-e2e", { type: "q8_0", kEqV: true, seed: 46 })
        yield* writeSyntheticModel(o)
        const { killedLayers, reference } = yield* killedStageResumes(
          { model: o.path, prompt: PROMPT, maxTokens: 48, threads: 1, stages: 3 },
          { atToken: 24 }
        )
        assert.deepStrictEqual(killedLayers, [2, 4], "the killed stage holds global block 2 and sliding block 3")
        assert.isAbove(reference.summary!.promptTokens + 24, 2 * 16, "killed after the run passed twice the window")
      }),
    180_000
  )
})
