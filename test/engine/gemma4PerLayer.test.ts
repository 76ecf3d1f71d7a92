/**
 * gemma4 E2B/E4B's per-layer embeddings and shared KV layers (archs/gemma4PerLayer.ts, engine/PerLayerInputs.ts) on
 * synthetic models with both: node-llama-cpp loads what `swactor synth` writes, and every legal split into 1-3 stages
 * (never between a shared KV block and the block whose cache it reads) gives its greedy tokens past twice the window,
 * also with the 31B's per-block head sizes; 8 sequences batched equal their lone runs; the catalog's layout and
 * placement never cut a shared KV block from its source, a forced cut and a frame of the wrong width are typed errors;
 * a stage killed with SIGKILL mid-generation resumes on a spare with identical text (specs GM16-GM19).
 */
import * as Command from "@effect/cli/Command"
import * as NodeContext from "@effect/platform-node/NodeContext"
import { assert, describe, it } from "@effect/vitest"
import { Effect, Either, Exit } from "effect"
import { existsSync } from "node:fs"
import { join } from "node:path"
import { synthCommand } from "../../src/cli/SynthCommand.js"
import type { ModelLoadError } from "../../src/domain/gguf.js"
import { NodeId } from "../../src/domain/ids.js"
import type { PlacementChoice } from "../../src/domain/plan.js"
import { layoutStage } from "../../src/layers/engine/StageLayout.js"
import { layerWith } from "../../src/layers/engine/StageExecutorLive.js"
import { getU32, readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { sliceTensors } from "../../src/layers/gguf/GgufSlice.js"
import { GgufValues, type GgufTypedValue, writeGgufFile } from "../../src/layers/gguf/GgufWriter.js"
import { readModelLayout } from "../../src/layers/gguf/ModelCatalogLive.js"
import { type SyntheticModelOptions, syntheticModelSpec, writeSyntheticModel } from "../../src/layers/gguf/Synthetic.js"
import { kvBytesPerTokenOfBlock } from "../../src/services/KvSize.js"
import { choosePlacement } from "../../src/services/Placement.js"
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

const dir = modelFolder("swactor-engine-gemma4pl-")

// 9 blocks, pattern 3 (blocks 2, 5, 8 global), 3 shared KV layers: blocks 6, 7 (sliding) read block 4's cache, block
// 8 (global) block 5's; so no stage boundary inside [4, 9)
const model = (name: string, extra: Partial<SyntheticModelOptions> = {}): SyntheticModelOptions =>
  gemma4Model(join(dir, `${name}.gguf`), {
    layers: 9,
    seed: 51,
    kEqV: true,
    logitSoftcap: 10,
    perLayerEmbd: 32,
    sharedKvLayers: 3,
    ...extra
  })

/** Splits whose boundaries never fall inside [4, 9). */
const legalSplits = (layers: number, groupStart: number) =>
  allSplits(layers, 3).filter((s) => s.slice(1, -1).every((c) => c <= groupStart))

describe("gemma4 per-layer embeddings + shared KV layers: every legal split matches node-llama-cpp", () => {
  it.live(
    "f32, window 16: all 11 legal splits into 1-3 stages give node-llama-cpp's 48 tokens",
    () =>
      Effect.gen(function* () {
        const o = model("pl-f32")
        yield* writeSyntheticModel(o)
        const ref = yield* nodeLlamaReference(o.path, PROMPT, 48, options)
        assert.strictEqual(ref.tokens.length, 48)
        assert.isAbove(ref.prompt.length + 48, 2 * 16)
        assert.isAtLeast(new Set(ref.tokens).size, 8, `reference stream ${ref.tokens}`)
        const splits = legalSplits(9, 4)
        assert.strictEqual(splits.length, 11)
        const maxDiff = yield* splitsMatchReference(o.path, ref, splits, options)
        console.log(
          `gemma4 per-layer + shared KV: ${splits.length} splits x 48 tokens, first log-prob diff ${maxDiff.toExponential(2)}`
        )
        assert.isBelow(maxDiff, 1e-4)
      }),
    300_000
  )

  // with the 31B's per-block attention shapes too: sliding-window blocks 16-wide heads, 2 KV heads; global ones 32-wide,
  // 1 KV head (blocks 6, 7 read sliding block 4's narrow cache, block 8 global block 5's)
  it.live(
    "q8_0, per-block head sizes and KV heads: all 11 legal splits give node-llama-cpp's 48 tokens",
    () =>
      Effect.gen(function* () {
        const o = model("pl-widths", { type: "q8_0", swaHeadDim: 16, globalKvHeads: 1, seed: 58 })
        yield* writeSyntheticModel(o)
        const ref = yield* nodeLlamaReference(o.path, PROMPT, 48, options)
        assert.strictEqual(ref.tokens.length, 48)
        assert.isAtLeast(new Set(ref.tokens).size, 8, `reference stream ${ref.tokens}`)
        const maxDiff = yield* splitsMatchReference(o.path, ref, legalSplits(9, 4), options)
        console.log(
          `gemma4 per-layer + shared KV + per-block widths, q8_0: first log-prob diff ${maxDiff.toExponential(2)}`
        )
        assert.isBelow(maxDiff, 1e-3)
      }),
    300_000
  )
})

describe("gemma4 per-layer embeddings + shared KV layers: 8 sequences batched equal their lone runs", () => {
  const schedule = (): ReadonlyArray<SeqPlan> => {
    const r = makeRng(53)
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
      `1/2/3 stages ([0,9] [0,4,9] [0,2,4,9]), past the window: tokens equal lone runs, few-row route ${rows}`,
      () =>
        Effect.gen(function* () {
          // seed 60: seeds 54, 57 and 59 have near-ties (top-2 logit gaps 1.25e-4 to 8.5e-3) that the batched products
          // (logits within ~1e-2 to 4e-2 of the lone ones, tinyBLAS against one-row kernels) flip
          const o = model(`pl-batch-${rows}`, { seed: 60 })
          yield* writeSyntheticModel(o)
          const maxDiff = yield* Batch.batchedEqualsAlone(
            o.path,
            [
              [0, 9],
              [0, 4, 9],
              [0, 2, 4, 9]
            ],
            schedule(),
            256,
            // route 0's batched products differ from the one-row kernel's (up to the 2e-2 asserted below), so a token
            // may flip where the two likeliest are that close: which seed has such a near-tie depends on the CPU's
            // ggml variant (seed 60: none on the Intel hosts, one with zen4 on a Zen 5 host); route 8 stays strict
            { roundingFlips: rows === 0 }
          )
          console.log(
            `gemma4 per-layer batched vs alone, route ${rows}: max logit difference ${maxDiff.toExponential(2)}`
          )
          assert.isBelow(maxDiff, 2e-2)
        }).pipe(Effect.provide(layerWith({ smallBatchRows: rows }))),
      300_000
    )
  }
})

describe("gemma4 shared KV layers: placement never cuts a block from the cache it reads; a forced cut is refused", () => {
  const kvRow = kvBytesPerTokenOfBlock((128 / 4) * 2, (128 / 4) * 2)
  const load = (path: string, start: number, end: number) =>
    Effect.flatMap(StageExecutor, (x) =>
      Effect.scoped(
        x.load({ path, layerStart: start, layerEndExclusive: end, isFirst: start === 0, isLast: end === 9 })
      )
    )
  const loadExit = (path: string, start: number, end: number) => Effect.exit(load(path, start, end))
  it.live(
    "layout (sources, no KV for blocks 6-8), balanced / capacity / fixed placement, stage loads and widths",
    () =>
      Effect.gen(function* () {
        const o = model("pl-layout", { contextLength: 4096, seed: 55 })
        yield* writeSyntheticModel(o)
        const layout = yield* readModelLayout(o.path)
        assert.deepStrictEqual(layout.kvSources, [0, 1, 2, 3, 4, 5, 4, 4, 5])
        assert.deepStrictEqual(layout.kvBytesPerToken, [...Array(6).fill(kvRow), 0, 0, 0])
        // the first stage's per-layer tables count with its input embedding, and only its weight slice carries them
        const header = yield* readGgufFile(o.path)
        const bytes = (name: string) => header.tensorsByName.get(name)!.byteSize
        assert.strictEqual(
          layout.inputBytes,
          bytes("token_embd.weight") +
            bytes("per_layer_token_embd.weight") +
            bytes("per_layer_model_proj.weight") +
            bytes("per_layer_proj_norm.weight")
        )
        const sliced = (start: number, end: number) =>
          sliceTensors(header, { layerStart: start, layerEndExclusive: end, numLayers: 9 }).map((t) => t.name)
        assert.includeMembers(sliced(0, 4), [
          "per_layer_token_embd.weight",
          "per_layer_model_proj.weight",
          "per_layer_proj_norm.weight"
        ])
        assert.notInclude(sliced(4, 9), "per_layer_token_embd.weight")
        assert.notInclude(sliced(4, 9), "per_layer_model_proj.weight")
        // a middle stage's global block reads the RoPE frequency factors too
        assert.include(sliced(2, 4), "rope_freqs.weight")
        const node = (id: number) => ({ nodeId: NodeId.make(id), freeMemoryBytes: 2 ** 40, speedBytesPerSecond: 1e9 })
        const pool = [node(1), node(2), node(3)]
        const opts = { contextTokens: 4096 }
        const ranges = (c: Either.Either<PlacementChoice, unknown>) =>
          Either.getOrThrow(c).stages.map((s) => [s.layerStart, s.layerEndExclusive])
        // balanced 3 would be [0,3) [3,6) [6,9): the cut at 6 moves down to 4, the last legal boundary
        assert.deepStrictEqual(ranges(choosePlacement({ _tag: "Balanced", stageCount: 3 }, layout, pool, opts)), [
          [0, 3],
          [3, 4],
          [4, 9]
        ])
        assert.deepStrictEqual(ranges(choosePlacement({ _tag: "Balanced", stageCount: 2 }, layout, pool, opts)), [
          [0, 4],
          [4, 9]
        ])
        const capacity = ranges(choosePlacement({ _tag: "Capacity" }, layout, pool, opts))
        for (const [start] of capacity) assert.isAtMost(start!, 4, `capacity split ${JSON.stringify(capacity)}`)
        assert.isTrue(
          Either.isLeft(
            choosePlacement({ _tag: "Balanced", stageCount: 6 }, layout, [...pool, node(4), node(5), node(6)], opts)
          )
        )
        const fixed = choosePlacement(
          {
            _tag: "Fixed",
            ranges: [
              [0, 5],
              [5, 9]
            ]
          },
          layout,
          pool,
          opts
        )
        assert.isTrue(Either.isLeft(fixed))
        if (Either.isLeft(fixed)) {
          assert.strictEqual(fixed.left._tag, "InvalidLayerRanges")
          assert.include(String((fixed.left as { reason?: string }).reason), "block 6 reads block 4's KV cache")
        }
        // the stage load refuses a range without the block whose cache its blocks read, naming the key
        for (const [start, end] of [
          [5, 9],
          [6, 9],
          [7, 9]
        ] as const) {
          const exit = yield* loadExit(o.path, start, end)
          assert.isTrue(Exit.isFailure(exit), `[${start}, ${end}) refused`)
          if (Exit.isFailure(exit) && exit.cause._tag === "Fail") {
            const e = exit.cause.error as ModelLoadError
            assert.strictEqual(e.reason, "InvalidLayerRange")
            assert.include(e.message, "gemma4.attention.shared_kv_layers")
          } else assert.fail(`not a typed failure: ${String(exit)}`)
        }
        // legal stages: KV bytes only for blocks with a cache; input width carries the per-layer inputs of blocks 4..8
        const last = yield* Effect.scoped(
          Effect.gen(function* () {
            const x = yield* StageExecutor
            const stage = yield* x.load({
              path: o.path,
              layerStart: 4,
              layerEndExclusive: 9,
              isFirst: false,
              isLast: true
            })
            const session = yield* x.session(stage, { threads: 1, contextLength: 256 })
            // a frame of the residual width only (no per-layer inputs) is refused, typed
            const bad = yield* Effect.exit(
              session.forward(0, { _tag: "Hidden", hidden: new Float32Array(128 * 2), nTokens: 2 })
            )
            assert.isTrue(Exit.isFailure(bad))
            if (Exit.isFailure(bad) && bad.cause._tag === "Fail")
              assert.strictEqual(bad.cause.error._tag, "InvalidStageInput")
            else assert.fail(`not a typed failure: ${String(bad)}`)
            return stage.info
          })
        )
        assert.strictEqual(last.hiddenDim, 128 + 32 * 5)
        assert.strictEqual(last.kvBytesPerToken, 2 * kvRow, "blocks 4 and 5 only")
        assert.deepStrictEqual(last.kvWindow, { window: 16, bytesPerToken: kvRow }, "sliding block 4's ring only")
        // only the first stage loads the per-layer tables
        const file = yield* readGgufFile(o.path)
        const names = (start: number, end: number) =>
          Effect.map(
            layoutStage(file, {
              path: o.path,
              layerStart: start,
              layerEndExclusive: end,
              isFirst: start === 0,
              isLast: end === 9
            }),
            (l) => l.tensors.map((t) => t.name)
          )
        const first = yield* names(0, 4)
        assert.includeMembers(first, [
          "per_layer_token_embd.weight",
          "per_layer_model_proj.weight",
          "per_layer_proj_norm.weight",
          "blk.0.inp_gate.weight"
        ])
        const rest = yield* names(4, 9)
        assert.notInclude(rest, "per_layer_token_embd.weight")
        assert.notInclude(rest, "per_layer_model_proj.weight")
        assert.notInclude(rest, "blk.6.attn_k.weight", "a shared KV block loads no K projection")
        assert.include(rest, "blk.6.attn_q.weight")
      }).pipe(Effect.provide(layerWith({ smallBatchRows: 0 }))),
    120_000
  )

  const u32 = GgufValues.u32
  const cases: ReadonlyArray<readonly [string, string, GgufTypedValue, string]> = [
    ["shared-too-many", "gemma4.attention.shared_kv_layers", u32(8), "gemma4.attention.shared_kv_layers"],
    // from 5: block 5 (global) would read block 4 (sliding)
    ["shared-kind", "gemma4.attention.shared_kv_layers", u32(4), "gemma4.attention.shared_kv_layers"],
    ["per-layer-width", "gemma4.embedding_length_per_layer_input", u32(16), "per_layer_token_embd.weight"]
  ]
  for (const [name, key, value, named] of cases) {
    it.live(`${key} = ${JSON.stringify(value.value)}: ModelLoadError naming ${named}`, () =>
      Effect.gen(function* () {
        const path = join(dir, `${name}.gguf`)
        const s = syntheticModelSpec({ ...model(name), path })
        yield* writeGgufFile(path, {
          metadata: [...s.metadata.filter(([k]) => k !== key), [key, value]],
          tensors: s.tensors
        })
        const exit = yield* loadExit(path, 0, 9)
        assert.isTrue(Exit.isFailure(exit))
        if (Exit.isFailure(exit) && exit.cause._tag === "Fail")
          assert.include((exit.cause.error as ModelLoadError).message, named)
        else assert.fail(`not a typed failure: ${String(exit)}`)
      }).pipe(Effect.provide(layerWith({ smallBatchRows: 0 })))
    )
  }
})

describe("swactor synth --arch gemma4 --per-layer-embd --shared-kv-layers", () => {
  const cli = Command.run(Command.make("swactor").pipe(Command.withSubcommands([synthCommand])), {
    name: "swactor",
    version: "test"
  })
  it.live(
    "writes the keys and tables; node-llama-cpp loads it and our 3 stages give its tokens",
    () =>
      Effect.gen(function* () {
        const out = join(dir, "cli-pl.gguf")
        const exit = yield* cli([
          "node",
          "swactor",
          "synth",
          "--arch",
          "gemma4",
          "--layers",
          "9",
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
          "16",
          "--swa-pattern",
          "3",
          "--k-eq-v",
          "--logit-softcap",
          "10",
          "--per-layer-embd",
          "32",
          "--shared-kv-layers",
          "3",
          "--type",
          "q8_0",
          "--seed",
          "58",
          "-o",
          out
        ]).pipe(Effect.provide(NodeContext.layer), Effect.exit)
        assert.isTrue(Exit.isSuccess(exit), String(exit))
        const file = yield* readGgufFile(out)
        assert.strictEqual(yield* getU32(file, "gemma4.embedding_length_per_layer_input"), 32)
        assert.strictEqual(yield* getU32(file, "gemma4.attention.shared_kv_layers"), 3)
        assert.deepStrictEqual(file.tensorsByName.get("per_layer_token_embd.weight")?.dims, [32 * 9, 400])
        assert.isTrue(file.tensorsByName.has("blk.8.inp_gate.weight") && file.tensorsByName.has("blk.8.proj.weight"))
        const ref = yield* nodeLlamaReference(out, PROMPT, 40, options)
        assert.strictEqual(ref.tokens.length, 40)
        yield* splitsMatchReference(out, ref, [[0, 2, 4, 9]], options, { bitIdentical: false })
      }),
    120_000
  )

  // values llama.cpp would abort on are refused before a file is written
  for (const [shared, why] of [
    ["4", "block 5 would read the cache of block 4"],
    ["8", "between 0 and --layers - 2"]
  ] as const) {
    it.live(`--shared-kv-layers ${shared} on 9 blocks of pattern 3: refused (${why})`, () =>
      Effect.gen(function* () {
        const out = join(dir, `cli-bad-${shared}.gguf`)
        const errors: Array<string> = []
        const exit = yield* cli([
          "node",
          "swactor",
          "synth",
          "--arch",
          "gemma4",
          "--layers",
          "9",
          "--hidden",
          "64",
          "--ffn",
          "128",
          "--heads",
          "4",
          "--kv-heads",
          "2",
          "--vocab",
          "400",
          "--sliding-window",
          "16",
          "--swa-pattern",
          "3",
          "--per-layer-embd",
          "16",
          "--shared-kv-layers",
          shared,
          "-o",
          out
        ]).pipe(
          Effect.provide(NodeContext.layer),
          Effect.tapErrorCause((c) => Effect.sync(() => errors.push(String(c)))),
          Effect.exit
        )
        assert.isTrue(Exit.isFailure(exit))
        assert.include(errors.join("\n"), why)
        assert.isFalse(existsSync(out), "no file written")
      })
    )
  }
})

describe("gemma4 per-layer embeddings + shared KV layers end to end: a killed stage resumes with identical text", () => {
  // 3 stages + 1 spare on local agents: placement puts the shared KV group on the last stage ([0,3) [3,4) [4,9));
  // that agent is killed with SIGKILL at token 24 (past twice the window) and the spare takes it over
  it.live(
    "q8_0, kill -9 of the last stage (blocks 4-8, the shared KV group): greedy output equals the uninterrupted run's",
    () =>
      Effect.gen(function* () {
        const o = model("pl-e2e", { type: "q8_0", seed: 57 })
        yield* writeSyntheticModel(o)
        const { killedLayers, reference } = yield* killedStageResumes(
          { model: o.path, prompt: PROMPT, maxTokens: 48, threads: 1, stages: 3 },
          { atToken: 24, agent: 2 }
        )
        assert.deepStrictEqual(killedLayers, [4, 9], "the killed stage holds the shared KV group")
        assert.isAbove(reference.summary!.promptTokens + 24, 2 * 16)
      }),
    240_000
  )
})
