/**
 * Capped sliding-window KV caches (KvCache.ts, services/KvSize.ts swaCacheSize): a gemma3 stage's sliding-window
 * blocks keep a ring of pad256(window + 128) cells, not the context's. With a context of 1024 and a window of 16 the
 * ring is 256 cells, and a run of 320 positions wraps it: the greedy tokens still equal node-llama-cpp's (its default,
 * capped iSWA cache) at every split; the stage allocates exactly the formula's bytes, less than full-size caches;
 * a prompt-cache copy and a rewind within what the ring holds continue bit for bit as a fresh session, and one
 * further back is a typed refusal (the caller prefills again).
 */
import { assert, describe, it } from "@effect/vitest"
import { Effect, Exit } from "effect"
import { join } from "node:path"
import type { StageInput, StageOutput } from "../../src/domain/engine.js"
import { NativeSession } from "../../src/layers/engine/KvCache.js"
import { layerWith, LiveLoadedStage } from "../../src/layers/engine/StageExecutorLive.js"
import { type SyntheticModelOptions, writeSyntheticModel } from "../../src/layers/gguf/Synthetic.js"
import { readModelLayout } from "../../src/layers/gguf/ModelCatalogLive.js"
import { kvBytesPerSequence } from "../../src/layers/server/KvSizing.js"
import {
  kvBytesOfBlocks,
  kvBytesOfStage,
  kvBytesPerTokenOfBlock,
  kvCacheSize,
  swaCacheSize
} from "../../src/services/KvSize.js"
import { stageMemoryBytes } from "../../src/services/Placement.js"
import { greedy, logSoftmax, makeRng } from "../../src/services/Sampler.js"
import { StageExecutor, type StageSession } from "../../src/services/StageExecutor.js"
import * as Batch from "../support/batch.js"
import type { SeqPlan } from "../support/batch.js"
import { allSplits, greedyRun, maxLogProbDiff, nodeLlamaReference } from "../support/engine.js"
import { modelFolder, STORY_PROMPT as PROMPT } from "../support/synthFiles.js"

const CONTEXT = 1024
const WINDOW = 16
const N_TOKENS = 300
const dir = modelFolder("swactor-engine-swacache-")

// 4 blocks, pattern 2: blocks 0 and 2 slide over 16 positions, 1 and 3 are global
const model = (name: string, extra: Partial<SyntheticModelOptions> = {}): SyntheticModelOptions => ({
  path: join(dir, `${name}.gguf`),
  arch: "gemma3",
  layers: 4,
  hidden: 128,
  ffn: 256,
  heads: 4,
  kvHeads: 2,
  vocab: 400,
  contextLength: 2048,
  type: "f32",
  seed: 51,
  slidingWindow: WINDOW,
  swaPattern: 2,
  ...extra
})

/** node-llama-cpp's greedy tokens (default capped SWA cache; flash attention on, F16 KV, 1 thread). */
const reference = (path: string, n: number, promptTokens?: ReadonlyArray<number>) =>
  nodeLlamaReference(path, promptTokens ?? PROMPT, n, { threads: 1, contextLength: CONTEXT })

describe("capped sliding-window caches: the ring wraps and the tokens still match node-llama-cpp", () => {
  it.live(
    `window ${WINDOW}, context ${CONTEXT} (ring of 256 cells): ${N_TOKENS} greedy tokens of all 7 splits equal node-llama-cpp's`,
    () =>
      Effect.gen(function* () {
        const o = model("swa-parity")
        yield* writeSyntheticModel(o)
        const ref = yield* reference(o.path, N_TOKENS)
        const ring = swaCacheSize(CONTEXT, WINDOW)
        assert.strictEqual(ring, 256)
        assert.isAbove(ref.prompt.length + N_TOKENS, ring + 3 * WINDOW, "the run wraps the ring")
        assert.isAtLeast(new Set(ref.tokens).size, 8, `reference stream ${ref.tokens}`)
        // the same weights with the window past the context: other tokens, so the window matters in this run
        const wide = model("swa-parity-wide", { slidingWindow: 4096 })
        yield* writeSyntheticModel(wide)
        assert.notDeepEqual((yield* reference(wide.path, N_TOKENS)).tokens, ref.tokens, "the window changes the tokens")
        for (const split of allSplits(o.layers, 3)) {
          const run = yield* greedyRun(o.path, split, ref.prompt, N_TOKENS, { threads: 1, contextLength: CONTEXT })
          assert.deepStrictEqual(run.tokens, ref.tokens, `split ${JSON.stringify(split)}`)
        }
      }),
    600_000
  )
})

describe("capped sliding-window caches: a prompt longer than one call may take", () => {
  // the ring (256 cells, window 16) holds the positions of at most 241 rows of one call: a 300-token prompt in one
  // forward runs in two equal pieces (Forward.ts runInPieces), as llama.cpp splits a batch into ubatches
  it.live(
    "a 300-token prompt in one forward at every split: node-llama-cpp's 40 greedy tokens",
    () =>
      Effect.gen(function* () {
        const o = model("swa-long-prompt", { seed: 54 })
        yield* writeSyntheticModel(o)
        const r = makeRng(81)
        const prompt = Array.from({ length: 300 }, () => 3 + Math.floor(r() * 397))
        const ref = yield* reference(o.path, 40, prompt)
        assert.isAtLeast(new Set(ref.tokens).size, 4, `reference stream ${ref.tokens}`)
        for (const split of allSplits(o.layers, 3)) {
          const run = yield* greedyRun(o.path, split, prompt, 40, { threads: 1, contextLength: CONTEXT })
          // the prompt's last position within 1e-4 of node-llama-cpp's log-probs (pieces of 241 + 59 rows: 5.7e-3,
          // the last piece under ggml's 64-row flash attention threshold; 150 + 150: 3e-5)
          const diff = maxLogProbDiff(logSoftmax(run.logits[0]!), ref.firstProbabilities)
          assert.isBelow(diff, 1e-4, `split ${JSON.stringify(split)}`)
          // then its tokens, up to the first position where our two likeliest are within 1e-3 (30x that difference:
          // which token a near-tie gives depends on the CPU's ggml variant); at least 20 of the 40
          const upTo = Batch.firstNearTie(run.logits, 1e-3)
          assert.isAtLeast(upTo, 20, `split ${JSON.stringify(split)}: a near-tie at ${upTo}`)
          assert.deepStrictEqual(run.tokens.slice(0, upTo), ref.tokens.slice(0, upTo), `split ${JSON.stringify(split)}`)
        }
      }),
    300_000
  )
})

describe("capped sliding-window caches: batched = alone while the rings wrap", () => {
  const schedule = (): ReadonlyArray<SeqPlan> => {
    const r = makeRng(71)
    const prompt = (n: number) => Array.from({ length: n }, () => 3 + Math.floor(r() * 397))
    return [
      { prompt: prompt(200), start: 0, steps: 100, chunk: 50 },
      { prompt: prompt(260), start: 1, steps: 40, chunk: 65 },
      { prompt: prompt(30), start: 0, steps: 260 },
      { prompt: prompt(5), start: 3, steps: 280 }
    ]
  }
  it.live(
    "4 sequences of 285-300 positions, 1/2/3 stages: tokens equal their lone runs",
    () =>
      Effect.gen(function* () {
        const o = model("swa-batch", { seed: 53 })
        yield* writeSyntheticModel(o)
        const plans = schedule()
        plans.forEach((p, i) =>
          assert.isAbove(p.prompt.length + p.steps, swaCacheSize(CONTEXT, WINDOW), `sequence ${i} wraps its ring`)
        )
        const maxDiff = yield* Batch.batchedEqualsAlone(
          o.path,
          [
            [0, 4],
            [0, 1, 4],
            [0, 1, 2, 4]
          ],
          plans,
          CONTEXT
        )
        console.log(`capped SWA caches, batched vs alone: max logit difference ${maxDiff.toExponential(2)}`)
        // prefills of several rows take other product kernels than alone (as engine.gemma3's batched case)
        assert.isBelow(maxDiff, 2e-2)
      }).pipe(Effect.provide(layerWith({ smallBatchRows: 8 }))),
    300_000
  )
})

describe("capped sliding-window caches: memory", () => {
  it.live(
    "a stage's allocated KV bytes equal the per-block formula, sliding-window blocks capped",
    () =>
      Effect.gen(function* () {
        const o = model("swa-bytes")
        yield* writeSyntheticModel(o)
        const stages = yield* Batch.loadSplit(o.path, [0, 1, 4])
        const row = kvBytesPerTokenOfBlock(32 * 2, 32 * 2)
        // stage 0: block 0 (window); stage 1: blocks 1 (global), 2 (window), 3 (global)
        const expected = [
          kvBytesOfBlocks([{ bytesPerToken: row, window: WINDOW }], CONTEXT),
          kvBytesOfBlocks(
            [{ bytesPerToken: row }, { bytesPerToken: row, window: WINDOW }, { bytesPerToken: row }],
            CONTEXT
          )
        ]
        assert.deepStrictEqual(expected, [256 * row, (1024 + 256 + 1024) * row])
        stages.forEach((stage, i) => {
          assert.instanceOf(stage, LiveLoadedStage)
          const s = new NativeSession((stage as LiveLoadedStage).weights, CONTEXT, 1)
          try {
            assert.strictEqual(s.kvBytes, expected[i], `stage ${i}`)
            // what the agent reports and budgets for the stage (StageInfo.kvWindow)
            assert.strictEqual(kvBytesOfStage(stage.info, CONTEXT), expected[i], `stage ${i}: StageInfo`)
            const full = (i === 0 ? 1 : 3) * kvCacheSize(CONTEXT) * row
            assert.isBelow(s.kvBytes, full, `stage ${i}: less than full-size caches`)
          } finally {
            s.free()
          }
        })
      }).pipe(Effect.scoped, Effect.provide(layerWith({}))),
    60_000
  )

  it.live(
    "placement (--dry-run's memory) and the server's admission count the capped caches",
    () =>
      Effect.gen(function* () {
        const o = model("swa-layout")
        yield* writeSyntheticModel(o)
        const layout = yield* readModelLayout(o.path)
        assert.deepStrictEqual(layout.slidingWindow, { window: WINDOW, blocks: [true, false, true, false] })
        const row = kvBytesPerTokenOfBlock(32 * 2, 32 * 2)
        const options = { contextTokens: CONTEXT, computeBytes: 0 }
        const { slidingWindow: _, ...uncapped } = layout
        // stage [0, 4): 2 full blocks of 1024 cells and 2 rings of 256
        const capped = stageMemoryBytes(layout, 0, 4, options)
        assert.strictEqual(stageMemoryBytes(uncapped, 0, 4, options) - capped, 2 * (1024 - 256) * row)
        assert.strictEqual(
          stageMemoryBytes(layout, 0, 1, options) - stageMemoryBytes(uncapped, 0, 1, options),
          (256 - 1024) * row,
          "stage [0, 1): one ring"
        )
        // a context shorter than the ring: no block holds more than the context
        assert.strictEqual(
          stageMemoryBytes(layout, 0, 4, { contextTokens: 100, computeBytes: 0 }),
          stageMemoryBytes(uncapped, 0, 4, { contextTokens: 100, computeBytes: 0 })
        )
        // admission: the heaviest planned stage; [0, 1) + [1, 4) -> blocks 1..3 (2 full, 1 ring)
        const ranges = [
          [0, 1],
          [1, 4]
        ] as const
        assert.strictEqual(kvBytesPerSequence(layout, ranges, CONTEXT), (1024 + 256 + 1024) * row)
        const { slidingWindow: _sw, ...full } = layout
        assert.strictEqual(kvBytesPerSequence(full, ranges, CONTEXT), 3 * 1024 * row)
      }),
    60_000
  )
})

describe("capped sliding-window caches: copies and rewinds past the ring", () => {
  it.live(
    "copyPrefix / rewind to 290 of 300 continue bit for bit as a fresh session; to 40 (window overwritten) are refused",
    () =>
      Effect.gen(function* () {
        const o = model("swa-copy", { seed: 52 })
        yield* writeSyntheticModel(o)
        const executor = yield* StageExecutor
        const stages = yield* Batch.loadSplit(o.path, [0, 2, 4])
        const r = makeRng(61)
        const prompt = Int32Array.from({ length: 300 }, () => 3 + Math.floor(r() * 397))
        const open = () => Batch.openSessions(stages, CONTEXT)
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
        const prefill = (sessions: ReadonlyArray<StageSession>, end: number) =>
          Effect.gen(function* () {
            for (let at = 0; at < end; at += 100)
              yield* through(sessions, at, prompt.subarray(at, Math.min(end, at + 100)))
          })
        /** Positions 290..299, then 6 greedy decode steps. */
        const continueFrom290 = (sessions: ReadonlyArray<StageSession>) =>
          Effect.gen(function* () {
            const out: Array<Float32Array> = [yield* through(sessions, 290, prompt.subarray(290))]
            for (let pos = 300; pos < 306; pos++)
              out.push(yield* through(sessions, pos, Int32Array.of(greedy(out[out.length - 1]!))))
            return out
          })
        const fresh = yield* open()
        yield* prefill(fresh, 290)
        const want = yield* continueFrom290(fresh)

        const source = yield* open()
        yield* prefill(source, 290)
        yield* through(source, 290, prompt.subarray(290))
        const copied = yield* open()
        for (let i = 0; i < stages.length; i++) yield* executor.copyPrefix!(source[i]!, copied[i]!, 290)
        const gotCopied = yield* continueFrom290(copied)
        // 40: its window (25..39) was overwritten in the ring (it holds 44..299): refused, nothing copied
        const other = yield* open()
        const refused = yield* Effect.exit(executor.copyPrefix!(source[0]!, other[0]!, 40))
        assert.isTrue(Exit.isFailure(refused), "a copy of overwritten positions is refused")
        const rewoundFar = yield* Effect.exit(
          source[0]!.forward(40, { _tag: "Tokens", tokens: prompt.subarray(40, 41) })
        )
        assert.isTrue(Exit.isFailure(rewoundFar), "a rewind past the ring is refused")
        const gotRewound = yield* continueFrom290(source)
        want.forEach((l, i) => {
          assert.isTrue(Batch.sameBits(gotCopied[i]!, l), `copied, step ${i}`)
          assert.isTrue(Batch.sameBits(gotRewound[i]!, l), `rewound, step ${i}`)
        })
        assert.isAtLeast(new Set(want.map((l) => greedy(l))).size, 2)
      }).pipe(Effect.scoped, Effect.provide(layerWith({ smallBatchRows: 0 }))),
    120_000
  )
})
