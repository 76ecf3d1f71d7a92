/**
 * gemma3 (archs/gemma3.ts): greedy tokens of every split into 1, 2 and 3 stages equal node-llama-cpp's on synthetic
 * models with gemma's layer pattern (sliding-window blocks and global blocks; the splits cut between the two kinds),
 * prompt + generation longer than the window; 8 sequences batched equal their lone runs; bad gemma metadata is a
 * typed error naming the key.
 *
 * node-llama-cpp is run twice per model: with its default SWA cache (llama.cpp's iswa cache, the sliding-window
 * blocks' cache capped near the window) and with `swaFullCache` (full-size caches for every block, as swactor keeps
 * them: the window is a mask here). A third run on the same weights with the window widened past the context shows
 * that the window changes the tokens within the test's length (it really slides).
 */
import * as Command from "@effect/cli/Command"
import * as NodeContext from "@effect/platform-node/NodeContext"
import { assert, describe, it } from "@effect/vitest"
import { Effect, Exit } from "effect"
import { existsSync } from "node:fs"
import { join } from "node:path"
import { GgufValueType, type ModelLoadError } from "../../src/domain/gguf.js"
import { layerWith } from "../../src/layers/engine/StageExecutorLive.js"
import { getF32, getString, getU32, readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { GgufValues, type GgufTypedValue, writeGgufFile } from "../../src/layers/gguf/GgufWriter.js"
import { type SyntheticModelOptions, syntheticModelSpec, writeSyntheticModel } from "../../src/layers/gguf/Synthetic.js"
import { synthCommand } from "../../src/cli/SynthCommand.js"
import type { StageInput, StageOutput } from "../../src/domain/engine.js"
import { greedy, makeRng } from "../../src/services/Sampler.js"
import { StageExecutor, type StageSession } from "../../src/services/StageExecutor.js"
import * as Batch from "../support/batch.js"
import type { SeqPlan } from "../support/batch.js"
import { allSplits, greedyRun, nodeLlamaReference, splitsMatchReference } from "../support/engine.js"
import { killedStageResumes } from "../support/resume.js"
import { modelFolder, REFERENCE_OPTIONS as options, STORY_PROMPT as PROMPT } from "../support/synthFiles.js"

const N_TOKENS = 80
const LAYERS = 6
const dir = modelFolder("swactor-engine-gemma3-")

const model = (name: string, extra: Partial<SyntheticModelOptions> = {}): SyntheticModelOptions => ({
  path: join(dir, `${name}.gguf`),
  arch: "gemma3",
  layers: LAYERS,
  hidden: 128,
  ffn: 256,
  heads: 4,
  kvHeads: 2,
  vocab: 400,
  contextLength: 512,
  type: "f32",
  seed: 21,
  ...extra
})

/** node-llama-cpp: BOS + tokenize(PROMPT), greedy `n` tokens; flash attention on, F16 KV, explicit threads. */
const reference = (path: string, n: number, swaFullCache: boolean) =>
  nodeLlamaReference(path, PROMPT, n, { ...options, swaFullCache })

/** Every split into 1..3 stages: tokens equal node-llama-cpp's (both caches), logits bit-identical across splits. */
const checkParity = (o: SyntheticModelOptions, window: number, globalBlocks: ReadonlyArray<number>) =>
  Effect.gen(function* () {
    yield* writeSyntheticModel(o)
    const ref = yield* reference(o.path, N_TOKENS, false)
    const refFull = yield* reference(o.path, N_TOKENS, true)
    assert.isAbove(ref.prompt.length + N_TOKENS, 2 * window, "the run is longer than twice the window")
    assert.isAtLeast(new Set(ref.tokens).size, 8, `reference stream ${ref.tokens}`)
    assert.deepStrictEqual(refFull.tokens, ref.tokens, "node-llama-cpp: capped and full SWA caches agree")
    // the same weights with the window past the context: other tokens, so the window matters in this run
    const wide = { ...o, path: o.path.replace(/\.gguf$/, "-wide.gguf"), slidingWindow: 4096 }
    yield* writeSyntheticModel(wide)
    const refWide = yield* reference(wide.path, N_TOKENS, false)
    assert.notDeepEqual(refWide.tokens, ref.tokens, "widening the window changes node-llama-cpp's tokens")

    const splits = allSplits(o.layers, 3)
    const cuts = new Set(splits.flatMap((s) => s.slice(1, -1)))
    // splits cut right before each global block and right after it (sliding-window blocks on the other side)
    for (const g of globalBlocks) {
      assert.isTrue(cuts.has(g) && (g + 1 === o.layers || cuts.has(g + 1)), `cuts around global block ${g}`)
    }
    const maxDiff = yield* splitsMatchReference(o.path, ref, splits, options)
    console.log(
      `gemma3 ${o.type} window ${window}: ${splits.length} splits x ${N_TOKENS} tokens after a ${ref.prompt.length}-token ` +
        `prompt equal node-llama-cpp's (capped and full SWA cache); window ${4096} gives other tokens; ` +
        `first-position log-prob max diff ${maxDiff.toExponential(2)}`
    )
    assert.isBelow(maxDiff, 1e-4)
  })

describe("gemma3: every split into 1-3 stages matches node-llama-cpp past the sliding window", () => {
  // 7 blocks, gemma3's own pattern (sliding_window_pattern 6): blocks 0-4 and 6 slide over 32 positions, 5 is global
  it.live(
    `f32, window 32, 5 local : 1 global (7 blocks): greedy ${N_TOKENS} tokens of all 22 splits equal node-llama-cpp's`,
    () => checkParity(model("gemma3-f32", { layers: 7, slidingWindow: 32 }), 32, [5]),
    300_000
  )

  // pattern 3 (blocks 2 and 5 global), window 16, tied output, final logit soft-capping 4
  it.live(
    `f16, window 16, pattern 3, soft-capping 4, tied output: greedy ${N_TOKENS} tokens of all 16 splits equal node-llama-cpp's`,
    () =>
      checkParity(
        model("gemma3-f16", {
          type: "f16",
          slidingWindow: 16,
          swaPattern: 3,
          logitSoftcap: 4,
          tiedOutput: true,
          seed: 22
        }),
        16,
        [2, 5]
      ),
    300_000
  )
})

describe("gemma3 without a sliding window", () => {
  // No attention.sliding_window key: every block is global with the model's RoPE base (llama.cpp's graph<false>).
  it.live(
    "no sliding_window key: 1 and 2 stages give node-llama-cpp's greedy tokens",
    () =>
      Effect.gen(function* () {
        const o = model("gemma3-global", { layers: 4, seed: 26 })
        const spec = syntheticModelSpec(o)
        const metadata = spec.metadata.filter(([k]) => !k.startsWith("gemma3.attention.sliding_window"))
        assert.strictEqual(metadata.length, spec.metadata.length - 2)
        yield* writeGgufFile(o.path, { metadata, tensors: spec.tensors })
        const ref = yield* reference(o.path, 40, false)
        assert.isAtLeast(new Set(ref.tokens).size, 4)
        for (const split of [
          [0, 4],
          [0, 2, 4]
        ]) {
          const run = yield* greedyRun(o.path, split, ref.prompt, 40, options)
          assert.deepStrictEqual(run.tokens, ref.tokens, `split ${split}`)
        }
      }),
    120_000
  )
})

describe("gemma3: 8 sequences batched equal their lone runs", () => {
  const CONTEXT = 256
  const schedule = (): ReadonlyArray<SeqPlan> => {
    const r = makeRng(31)
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
      `window 16, pattern 3, 1/2/3 stages (cuts at local|global and global|local): tokens equal lone runs, few-row route ${rows}`,
      () =>
        Effect.gen(function* () {
          const o = model(`gemma3-batch-${rows}`, { slidingWindow: 16, swaPattern: 3, seed: 23 })
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
          console.log(`gemma3 batched vs alone, route ${rows}: max logit difference ${maxDiff.toExponential(2)}`)
          // measured 3.2e-3 / 3.3e-3 (routes 0 / 8): prefills of several rows take other product kernels than alone
          assert.isBelow(maxDiff, 2e-2)
        }).pipe(Effect.provide(layerWith({ smallBatchRows: rows }))),
      300_000
    )
  }
})

describe("gemma3: a copied or rewound KV cache continues as one computed afresh", () => {
  // The prompt cache copies positions [0, L) of one session into another (StageExecutor.copyPrefix); a session may be
  // rewound to an earlier position. Past the window, the sliding-window blocks' cells must come along: the
  // continuation then has the bits of a fresh session fed the same chunks.
  it.live(
    "window 16, pattern 3, 2 stages: copyPrefix of 40 positions and a rewind to 40 give a fresh run's logits",
    () =>
      Effect.gen(function* () {
        const o = model("gemma3-copy", { slidingWindow: 16, swaPattern: 3, seed: 24 })
        yield* writeSyntheticModel(o)
        const executor = yield* StageExecutor
        const stages = yield* Batch.loadSplit(o.path, [0, 3, 6])
        const r = makeRng(41)
        const prompt = Int32Array.from({ length: 60 }, () => 3 + Math.floor(r() * 397))
        const open = () => Batch.openSessions(stages, 256)
        const through = (sessions: ReadonlyArray<StageSession>, pos: number, tokens: Int32Array) =>
          Effect.gen(function* () {
            let input: StageInput = { _tag: "Tokens", tokens }
            for (const s of sessions) {
              const out: StageOutput = yield* s.forward(pos, input)
              if (out._tag === "Logits") return out.logits
              input = out
            }
            return yield* Effect.dieMessage("no logits")
          })
        /** Positions 40..59, then 8 greedy decode steps: the logits of each. */
        const continueFrom40 = (sessions: ReadonlyArray<StageSession>) =>
          Effect.gen(function* () {
            const out: Array<Float32Array> = [yield* through(sessions, 40, prompt.subarray(40))]
            for (let pos = 60; pos < 68; pos++) {
              out.push(yield* through(sessions, pos, Int32Array.of(greedy(out[out.length - 1]!))))
            }
            return out
          })
        const fresh = yield* open()
        yield* through(fresh, 0, prompt.subarray(0, 40))
        const want = yield* continueFrom40(fresh)

        const source = yield* open()
        yield* through(source, 0, prompt)
        const copied = yield* open()
        for (let i = 0; i < stages.length; i++) yield* executor.copyPrefix!(source[i]!, copied[i]!, 40)
        const gotCopied = yield* continueFrom40(copied)
        // the source itself, rewound to 40 after holding 60 positions (and 8 more from the copy's twin run)
        yield* continueFrom40(source)
        const gotRewound = yield* continueFrom40(source)
        want.forEach((l, i) => {
          assert.isTrue(Batch.sameBits(gotCopied[i]!, l), `copied, step ${i}`)
          assert.isTrue(Batch.sameBits(gotRewound[i]!, l), `rewound, step ${i}`)
        })
        // and the 8 steps are not one token repeated
        assert.isAtLeast(new Set(want.map((l) => greedy(l))).size, 2)
      }).pipe(Effect.scoped, Effect.provide(layerWith({ smallBatchRows: 0 }))),
    120_000
  )
})

describe("swactor synth --arch gemma3", () => {
  const cli = Command.run(Command.make("swactor").pipe(Command.withSubcommands([synthCommand])), {
    name: "swactor",
    version: "test"
  })
  const synth = (args: ReadonlyArray<string>) =>
    cli(["node", "swactor", "synth", ...args]).pipe(Effect.provide(NodeContext.layer), Effect.exit)

  it.live(
    "writes the window, pattern and soft-capping its flags give; node-llama-cpp loads it and our 2 stages give its tokens",
    () =>
      Effect.gen(function* () {
        const out = join(dir, "cli-gemma3.gguf")
        const exit = yield* synth([
          "--arch",
          "gemma3",
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
          "--logit-softcap",
          "10",
          "--type",
          "q8_0",
          "-o",
          out
        ])
        assert.isTrue(Exit.isSuccess(exit))
        const file = yield* readGgufFile(out)
        assert.strictEqual(yield* getString(file, "general.architecture"), "gemma3")
        assert.strictEqual(yield* getU32(file, "gemma3.attention.sliding_window"), 24)
        assert.strictEqual(yield* getU32(file, "gemma3.attention.sliding_window_pattern"), 4)
        assert.strictEqual(yield* getF32(file, "gemma3.final_logit_softcapping"), 10)
        assert.isTrue(file.tensorsByName.has("blk.3.post_ffw_norm.weight"))
        const ref = yield* reference(out, 40, false)
        const run = yield* greedyRun(out, [0, 3, 4], ref.prompt, 40, options)
        assert.deepStrictEqual(run.tokens, ref.tokens)
      }),
    120_000
  )

  it.live("--sliding-window 0 is refused and nothing is written", () =>
    Effect.gen(function* () {
      const out = join(dir, "cli-gemma3-bad.gguf")
      const exit = yield* synth([
        "--arch",
        "gemma3",
        "--layers",
        "2",
        "--hidden",
        "64",
        "--ffn",
        "128",
        "--vocab",
        "300",
        "--sliding-window",
        "0",
        "-o",
        out
      ])
      assert.isTrue(Exit.isFailure(exit))
      assert.isFalse(existsSync(out))
    })
  )
})

describe("gemma3: bad metadata is a typed error naming the key", () => {
  const base = model("gemma3-bad", { layers: 2, hidden: 64, ffn: 128 })
  const loadWith = (name: string, tweak: (md: Array<readonly [string, GgufTypedValue]>) => void) =>
    Effect.gen(function* () {
      const path = join(dir, `${name}.gguf`)
      const s = syntheticModelSpec({ ...base, path })
      const md = [...s.metadata]
      tweak(md)
      yield* writeGgufFile(path, { metadata: md, tensors: s.tensors })
      const executor = yield* StageExecutor
      return yield* Effect.exit(
        Effect.scoped(executor.load({ path, layerStart: 0, layerEndExclusive: 2, isFirst: true, isLast: true }))
      )
    }).pipe(Effect.provide(layerWith({ smallBatchRows: 0 })))
  const set = (md: Array<readonly [string, GgufTypedValue]>, key: string, v: GgufTypedValue) => {
    const i = md.findIndex(([k]) => k === key)
    if (i >= 0) md.splice(i, 1)
    md.push([key, v])
  }
  const failure = (exit: Exit.Exit<unknown, ModelLoadError>) => {
    assert.isTrue(Exit.isFailure(exit), "the load failed")
    if (!Exit.isFailure(exit) || exit.cause._tag !== "Fail") return assert.fail(`not a typed failure: ${String(exit)}`)
    return exit.cause.error
  }
  const cases: ReadonlyArray<readonly [string, string, GgufTypedValue]> = [
    ["pattern-array", "gemma3.attention.sliding_window_pattern", GgufValues.array(GgufValueType.UINT32, [6, 6])],
    ["swa-base-negative", "gemma3.rope.freq_base_swa", GgufValues.f32(-1)],
    ["softcap-negative", "gemma3.final_logit_softcapping", GgufValues.f32(-30)],
    ["window-string", "gemma3.attention.sliding_window", GgufValues.string("32")]
  ]
  for (const [name, key, value] of cases) {
    it.live(`${key} = ${JSON.stringify(value.value)}: ModelLoadError naming it`, () =>
      Effect.gen(function* () {
        const e = failure(yield* loadWith(name, (md) => set(md, key, value)))
        assert.strictEqual(e._tag, "ModelLoadError")
        assert.include(e.message, key)
      })
    )
  }
  it.live("a missing post_ffw_norm tensor: ModelLoadError naming it", () =>
    Effect.gen(function* () {
      const path = join(dir, "gemma3-no-post-ffw.gguf")
      const s = syntheticModelSpec({ ...base, path })
      yield* writeGgufFile(path, {
        metadata: s.metadata,
        tensors: s.tensors.filter((t) => t.name !== "blk.1.post_ffw_norm.weight")
      })
      const exit = yield* Effect.exit(
        Effect.scoped(
          Effect.flatMap(StageExecutor, (x) =>
            x.load({ path, layerStart: 0, layerEndExclusive: 2, isFirst: true, isLast: true })
          )
        )
      )
      const e = failure(exit)
      assert.include(e.message, "blk.1.post_ffw_norm.weight")
    }).pipe(Effect.provide(layerWith({ smallBatchRows: 0 })))
  )
})

describe("gemma3 end to end: a killed stage agent resumes with identical text past the window", () => {
  // 6 blocks, window 16, pattern 3 (blocks 2 and 5 global); 3 stages + 1 spare on local agents, balanced: the middle
  // stage holds blocks 2 (global) and 3 (sliding). Its agent is killed with SIGKILL at token 24, past twice the window;
  // the spare takes the stage, the prompt and the tokens so far are replayed in one prefill, and the stream goes on
  // to the uninterrupted run's tokens and text.
  it.live(
    "q8_0, window 16, pattern 3, kill -9 of the middle stage past the window: greedy output equals the uninterrupted run's",
    () =>
      Effect.gen(function* () {
        const o = model("gemma3-e2e", { type: "q8_0", slidingWindow: 16, swaPattern: 3, seed: 25 })
        yield* writeSyntheticModel(o)
        const { reference, killedLayers } = yield* killedStageResumes(
          { model: o.path, prompt: PROMPT, maxTokens: 48, threads: 1, stages: 3 },
          { atToken: 24 }
        )
        assert.deepStrictEqual(killedLayers, [2, 4], "the killed stage holds global block 2 and sliding block 3")
        assert.isAbove(reference.summary!.promptTokens + 24, 2 * 16, "killed after the run passed twice the window")
      }),
    180_000
  )
})
