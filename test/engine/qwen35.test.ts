/**
 * qwen35 (issue 21), first step: `swactor synth --arch qwen35` writes Qwen3.5's hybrid stack (three gated DeltaNet
 * blocks, then one gated full-attention block, SyntheticQwen35.ts) that node-llama-cpp loads and generates from, its
 * greedy stream not degenerate. The engine has no qwen35 graph yet: loading such a file is a typed ModelLoadError
 * (UnsupportedArchitecture), never an abort.
 */
import * as Command from "@effect/cli/Command"
import * as NodeContext from "@effect/platform-node/NodeContext"
import { assert, describe, it } from "@effect/vitest"
import { Effect, Exit } from "effect"
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { afterAll } from "vitest"
import { synthCommand } from "../../src/cli/SynthCommand.js"
import { NativeSession } from "../../src/layers/engine/KvCache.js"
import { layerWith, LiveLoadedStage } from "../../src/layers/engine/StageExecutorLive.js"
import { getString, getU32, readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { type GgufTypedValue, GgufValues, writeGgufFile } from "../../src/layers/gguf/GgufWriter.js"
import { GgufValueType, type ModelLoadError } from "../../src/domain/gguf.js"
import { type SyntheticModelOptions, syntheticModelSpec, writeSyntheticModel } from "../../src/layers/gguf/Synthetic.js"
import type { StageInput } from "../../src/domain/engine.js"
import { makeRng } from "../../src/services/Sampler.js"
import { readModelLayout } from "../../src/layers/gguf/ModelCatalogLive.js"
import { stageMemoryBytes } from "../../src/services/Placement.js"
import * as KvSizing from "../../src/layers/server/KvSizing.js"
import { kvBytesPerSequence } from "../../src/layers/server/KvSizing.js"
import { kvBytesOfSequence, kvBytesOfStage, kvBytesPerTokenOfBlock, kvCacheSize } from "../../src/services/KvSize.js"
import { StageExecutor } from "../../src/services/StageExecutor.js"
import * as Batch from "../support/batch.js"
import { allSplits, decodeBatchGetsLoneBits, nodeLlamaReference, splitsMatchReference } from "../support/engine.js"
import { killedStageResumes } from "../support/resume.js"

const N_TOKENS = 32
const LAYERS = 4
const options = { threads: 1, contextLength: 256 } as const
const PROMPT = "Once upon a time there was a little girl who lived in a village near the forest"
const dir = mkdtempSync(join(tmpdir(), "swactor-engine-qwen35-"))
afterAll(() => rmSync(dir, { recursive: true, force: true }))

const model = (name: string, extra: Partial<SyntheticModelOptions> = {}): SyntheticModelOptions => ({
  path: join(dir, `${name}.gguf`),
  arch: "qwen35",
  layers: 8,
  hidden: 256,
  ffn: 512,
  heads: 4,
  kvHeads: 2,
  headDim: 64,
  vocab: 400,
  contextLength: 512,
  type: "f32",
  seed: 35,
  ...extra
})

describe("swactor synth --arch qwen35", () => {
  it("plans the real layer pattern: DeltaNet blocks 0-2 and 4-6, attention blocks 3 and 7", () => {
    const s = syntheticModelSpec(model("plan"))
    const names = new Set(s.tensors.map((t) => t.name))
    for (let i = 0; i < 8; i++) {
      const attention = i % 4 === 3
      assert.strictEqual(names.has(`blk.${i}.attn_q.weight`), attention, `block ${i} attn_q`)
      assert.strictEqual(names.has(`blk.${i}.ssm_conv1d.weight`), !attention, `block ${i} ssm_conv1d`)
      assert.isTrue(names.has(`blk.${i}.post_attention_norm.weight`))
      assert.isFalse(names.has(`blk.${i}.ffn_norm.weight`))
    }
    // q carries the output gate: twice the heads' width
    assert.deepStrictEqual(s.tensors.find((t) => t.name === "blk.3.attn_q.weight")!.dims, [256, 2 * 4 * 64])
    // conv channels: q and k of 2 groups x 32, v of 4 heads x 32
    assert.deepStrictEqual(s.tensors.find((t) => t.name === "blk.0.ssm_conv1d.weight")!.dims, [4, 2 * 2 * 32 + 4 * 32])
  })

  it("keeps ssm_conv1d F32 in a q8_0 file and rejects value heads that are not a multiple of the key heads", () =>
    Effect.gen(function* () {
      const s = syntheticModelSpec(model("q8", { type: "q8_0" }))
      assert.strictEqual(s.tensors.find((t) => t.name === "blk.0.ssm_conv1d.weight")!.type, 0)
      assert.strictEqual(s.tensors.find((t) => t.name === "blk.0.attn_qkv.weight")!.type, 8)
      const bad = yield* Effect.exit(writeSyntheticModel(model("bad", { ssmGroups: 3, ssmHeads: 4 })))
      assert.isTrue(Exit.isFailure(bad))
      assert.include(String(bad), "ssmHeads (4) must be a multiple of ssmGroups (3)")
      const other = yield* Effect.exit(writeSyntheticModel({ ...model("bad2"), arch: "qwen3", ssmHeads: 4 }))
      assert.include(String(other), "ssmHeads is a qwen35 option")
    }))

  const cli = Command.run(Command.make("swactor").pipe(Command.withSubcommands([synthCommand])), {
    name: "swactor",
    version: "test"
  })
  it.live(
    "writes a file node-llama-cpp loads and generates a varied greedy stream from",
    () =>
      Effect.gen(function* () {
        const out = join(dir, "cli-qwen35.gguf")
        const exit = yield* cli([
          "node",
          "swactor",
          "synth",
          "--arch",
          "qwen35",
          "--layers",
          "4",
          "--hidden",
          "256",
          "--ffn",
          "512",
          "--heads",
          "4",
          "--kv-heads",
          "2",
          "--head-dim",
          "64",
          "--vocab",
          "400",
          "--context-length",
          "512",
          "-o",
          out
        ]).pipe(Effect.provide(NodeContext.layer), Effect.exit)
        assert.isTrue(Exit.isSuccess(exit), String(exit))
        const file = yield* readGgufFile(out)
        assert.strictEqual(yield* getString(file, "general.architecture"), "qwen35")
        assert.strictEqual(yield* getU32(file, "qwen35.full_attention_interval"), 4)
        assert.strictEqual(yield* getU32(file, "qwen35.rope.dimension_count"), 16)
        assert.strictEqual(yield* getU32(file, "qwen35.ssm.inner_size"), 128)
        const ref = yield* nodeLlamaReference(out, PROMPT, 48, options)
        assert.strictEqual(ref.tokens.length, 48)
        assert.isAtLeast(new Set(ref.tokens).size, 4, `reference stream ${ref.tokens}`)
        console.log(`qwen35 node-llama-cpp greedy: ${ref.tokens.join(",")}`)
      }),
    120_000
  )
})

describe("qwen35: every split into 1-3 stages matches node-llama-cpp", () => {
  it.live(
    `f32, blocks 0-2 DeltaNet, block 3 attention: greedy ${N_TOKENS} tokens of every split equal node-llama-cpp's`,
    () =>
      Effect.gen(function* () {
        const o = model("parity", { layers: LAYERS })
        yield* writeSyntheticModel(o)
        const ref = yield* nodeLlamaReference(o.path, PROMPT, N_TOKENS, options)
        assert.isAtLeast(new Set(ref.tokens).size, 4, `reference stream ${ref.tokens}`)
        const maxDiff = yield* splitsMatchReference(o.path, ref, allSplits(LAYERS, 3), options, { bitIdentical: false })
        console.log(
          `qwen35: ${allSplits(LAYERS, 3).length} splits x ${N_TOKENS} tokens; first log-prob max diff ${maxDiff}`
        )
        assert.isBelow(maxDiff, 1e-4)
      }).pipe(Effect.provide(layerWith({ smallBatchRows: 0 }))),
    300_000
  )
})

describe("qwen35: 8 blocks, q8_0", () => {
  it.live(
    "q8_0, 8 blocks (two 3 DeltaNet : 1 attention groups), tied output: 48 greedy tokens of all 29 splits into 1-3 stages equal node-llama-cpp's",
    () =>
      Effect.gen(function* () {
        const o = model("parity-q8", { type: "q8_0", tiedOutput: true })
        yield* writeSyntheticModel(o)
        const ref = yield* nodeLlamaReference(o.path, PROMPT, 48, options)
        assert.isAtLeast(new Set(ref.tokens).size, 4, `reference stream ${ref.tokens}`)
        const splits = allSplits(8, 3)
        assert.strictEqual(splits.length, 29)
        yield* splitsMatchReference(o.path, ref, splits, options, { bitIdentical: false })
      }),
    300_000
  )
})

describe("qwen35: the DeltaNet state per sequence", () => {
  const whole = (o: SyntheticModelOptions) =>
    Effect.gen(function* () {
      yield* writeSyntheticModel(o)
      const executor = yield* StageExecutor
      const stage = yield* executor.load({
        path: o.path,
        layerStart: 0,
        layerEndExclusive: LAYERS,
        isFirst: true,
        isLast: true
      })
      return { executor, stage }
    })
  const tokens = (n: number, seed: number) => {
    const r = makeRng(seed)
    return Int32Array.from({ length: n }, () => 3 + Math.floor(r() * 390))
  }

  it.live(
    "1, 2 and 8 sequences decoding together each get the bits of their lone step",
    () =>
      Effect.gen(function* () {
        const { stage } = yield* whole(model("batch", { layers: LAYERS }))
        yield* decodeBatchGetsLoneBits(stage, [1, 2, 8], 390, 11)
      }).pipe(Effect.scoped, Effect.provide(layerWith({ smallBatchRows: 8 }))),
    120_000
  )

  it.live(
    "a rewind is refused; a call from 0 starts from a cleared state",
    () =>
      Effect.gen(function* () {
        const { executor, stage } = yield* whole(model("rewind", { layers: LAYERS }))
        const s = yield* executor.session(stage, { threads: 1, contextLength: 64 })
        const prompt = tokens(12, 5)
        const first = yield* s.forward(0, { _tag: "Tokens", tokens: prompt })
        yield* s.forward(12, { _tag: "Tokens", tokens: Int32Array.of(7) })
        const rewind = yield* Effect.exit(s.forward(10, { _tag: "Tokens", tokens: Int32Array.of(7) }))
        assert.isTrue(Exit.isFailure(rewind) && String(rewind).includes("InvalidStageInput"), String(rewind))
        assert.include(String(rewind), "cannot be rewound")
        // from 0 again: the same bits as the first time (the state was cleared, not carried)
        assert.deepStrictEqual(yield* s.forward(0, { _tag: "Tokens", tokens: prompt }), first)
      }).pipe(Effect.scoped, Effect.provide(layerWith({ smallBatchRows: 0 }))),
    120_000
  )

  it.live(
    "a prefix copy is refused unless whole; a whole copy continues as the source",
    () =>
      Effect.gen(function* () {
        const { executor, stage } = yield* whole(model("copy", { layers: LAYERS }))
        const open = () => executor.session(stage, { threads: 1, contextLength: 64 })
        const [a, b, c] = [yield* open(), yield* open(), yield* open()]
        yield* a.forward(0, { _tag: "Tokens", tokens: tokens(12, 6) })
        const partial = yield* Effect.exit(executor.copyPrefix!(a, b, 8))
        assert.isTrue(Exit.isFailure(partial), String(partial))
        assert.include(String(partial), "cannot be rewound")
        yield* executor.copyPrefix!(a, b, 12)
        const next: StageInput = { _tag: "Tokens", tokens: Int32Array.of(9, 10) }
        const fromCopy = yield* b.forward(12, next)
        const fromSource = yield* a.forward(12, next)
        assert.deepStrictEqual(fromCopy, fromSource)
        // a copy of no position: a cleared state (c ran before, so its state is not zero)
        yield* c.forward(0, { _tag: "Tokens", tokens: tokens(5, 7) })
        yield* executor.copyPrefix!(a, c, 0)
        const fresh = yield* open()
        assert.deepStrictEqual(yield* c.forward(0, next), yield* fresh.forward(0, next))
      }).pipe(Effect.scoped, Effect.provide(layerWith({ smallBatchRows: 0 }))),
    120_000
  )
})

describe("qwen35: 8 sequences batched together equal the same sequences alone", () => {
  // each sequence reads and writes its own DeltaNet states inside shared batches: joins, early finishes, one chunked
  // prefill (its state carried from chunk to chunk), prefill rows beside decode rows; q8_0 on the few-row route
  const r = makeRng(21)
  const prompt = (n: number) => Array.from({ length: n }, () => 3 + Math.floor(r() * 390))
  const plans = [
    { prompt: prompt(5), start: 0, steps: 16 },
    { prompt: prompt(11), start: 0, steps: 16 },
    { prompt: prompt(1), start: 0, steps: 10 },
    { prompt: prompt(17), start: 2, steps: 16 },
    { prompt: prompt(7), start: 4, steps: 8 },
    { prompt: prompt(3), start: 1, steps: 16 },
    { prompt: prompt(9), start: 3, steps: 12 },
    { prompt: prompt(40), start: 1, steps: 16, chunk: 16 }
  ]
  it.live(
    "q8_0, 1/2/3 stages cut between DeltaNet and attention blocks: bit-identical logits to the lone runs",
    () =>
      Effect.gen(function* () {
        const o = model("batched", { layers: LAYERS, type: "q8_0" })
        yield* writeSyntheticModel(o)
        yield* Batch.batchedEqualsAlone(
          o.path,
          [
            [0, 4],
            [0, 3, 4],
            [0, 1, 3, 4]
          ],
          plans,
          128,
          { bitIdentical: true }
        )
      }).pipe(Effect.provide(layerWith({ smallBatchRows: 8 }))),
    240_000
  )
})

describe("qwen35: bad metadata is a typed error naming the key", () => {
  const cases: ReadonlyArray<readonly [string, string, GgufTypedValue | null, string]> = [
    ["no-conv", "qwen35.ssm.conv_kernel", null, "is missing"],
    ["inner", "qwen35.ssm.inner_size", GgufValues.u32(100), "must be ssm.state_size x ssm.time_step_rank"],
    ["groups", "qwen35.ssm.group_count", GgufValues.u32(3), "must be a multiple of"],
    ["sections", "qwen35.rope.dimension_sections", GgufValues.array(GgufValueType.INT32, [1, 1, 1, 5]), "4th position"],
    [
      "recurrent-array",
      "qwen35.attention.recurrent_layers",
      GgufValues.array(GgufValueType.BOOL, [true, true, true, false]),
      "not supported"
    ]
  ]
  for (const [name, key, value, words] of cases) {
    it.live(`${key} ${value === null ? "missing" : JSON.stringify(value.value)}: ModelLoadError naming it`, () =>
      Effect.gen(function* () {
        const path = join(dir, `bad-${name}.gguf`)
        const s = syntheticModelSpec(model(`bad-${name}`, { layers: LAYERS }))
        const md = s.metadata.filter(([k]) => k !== key)
        if (value !== null) md.push([key, value])
        yield* writeGgufFile(path, { metadata: md, tensors: s.tensors })
        const executor = yield* StageExecutor
        const exit: Exit.Exit<unknown, ModelLoadError> = yield* Effect.exit(
          Effect.scoped(executor.load({ path, layerStart: 0, layerEndExclusive: LAYERS, isFirst: true, isLast: true }))
        )
        assert.isTrue(Exit.isFailure(exit) && exit.cause._tag === "Fail", `a typed failure: ${String(exit)}`)
        if (Exit.isFailure(exit) && exit.cause._tag === "Fail") {
          assert.strictEqual(exit.cause.error._tag, "ModelLoadError")
          assert.include(exit.cause.error.message, key)
          assert.include(exit.cause.error.message, words)
        }
      }).pipe(Effect.provide(layerWith({ smallBatchRows: 0 })))
    )
  }
})

describe("qwen35: memory of a stage", () => {
  // 4 blocks split [0, 3) | [3, 4): three DeltaNet blocks, each a constant conv state of (4 - 1) x 256 and an SSM
  // state of 32 x 32 x 4 F32 values per sequence; one attention block, K and V rows of 2 heads x 64 F16 per cell
  it.live(
    "a DeltaNet stage allocates a constant state per sequence; StageInfo counts exactly what is allocated",
    () =>
      Effect.gen(function* () {
        const o = model("bytes", { layers: LAYERS })
        yield* writeSyntheticModel(o)
        const stages = yield* Batch.loadSplit(o.path, [0, 3, 4])
        const state = 4 * (3 * 256 + 32 * 32 * 4)
        const row = kvBytesPerTokenOfBlock(128, 128)
        for (const context of [64, 512]) {
          const expected = [3 * state, kvCacheSize(context) * row]
          stages.forEach((stage, i) => {
            assert.instanceOf(stage, LiveLoadedStage)
            const s = new NativeSession((stage as LiveLoadedStage).weights, context, 1)
            try {
              assert.strictEqual(s.kvBytes, expected[i], `stage ${i}, context ${context}`)
              // what the agent reports and budgets for the stage
              assert.strictEqual(
                kvBytesOfStage(stage.info, context),
                expected[i],
                `stage ${i}, context ${context}: StageInfo`
              )
            } finally {
              s.free()
            }
          })
        }
        // what placement and --dry-run read from the file: the same bytes per block type
        const layout = yield* readModelLayout(o.path)
        assert.deepStrictEqual(layout.kvBytesPerToken, [0, 0, 0, row])
        assert.deepStrictEqual(layout.stateBytes, [state, state, state, 0])
        for (const context of [64, 512]) {
          const opts = { contextTokens: context, computeBytes: 0 }
          const weights = layout.inputBytes + layout.blockBytes[0]! + layout.blockBytes[1]! + layout.blockBytes[2]!
          assert.strictEqual(stageMemoryBytes(layout, 0, 3, opts), weights + 3 * state, `placement, context ${context}`)
          const attnWeights = layout.blockBytes[3]! + layout.outputBytes
          assert.strictEqual(
            stageMemoryBytes(layout, 3, 4, opts),
            attnWeights + kvCacheSize(context) * row,
            `placement, context ${context}`
          )
        }
        // the server's admission: the heaviest planned stage, a DeltaNet block weighing its state
        for (const context of [64, 4096]) {
          const attention = kvBytesOfSequence(row, context)
          // stages not yet planned: an even split, [0, 2) and [2, 4)
          const sizing = KvSizing.make(undefined, 1)
          sizing.model(layout)
          sizing.pipeline({ maxSeqLen: context, numLayers: LAYERS }, 2)
          assert.strictEqual(sizing.bytes(context), Math.max(2 * state, state + attention), "stages not yet planned")
          sizing.planned([{ layers: [0, 3] }, { layers: [3, 4] }])
          assert.strictEqual(sizing.bytes(context), Math.max(3 * state, attention))
          assert.strictEqual(
            kvBytesPerSequence(
              layout,
              [
                [0, 1],
                [1, 4]
              ],
              context
            ),
            2 * state + attention
          )
        }
        assert.strictEqual(stages[0]!.info.kvBytesPerToken, 0)
        assert.strictEqual(stages[0]!.info.stateBytes, 3 * state)
      }).pipe(Effect.scoped, Effect.provide(layerWith({ smallBatchRows: 0 }))),
    60_000
  )
})

describe("qwen35 end to end: a killed stage agent resumes with identical text", () => {
  // 3 stages + 1 spare on local agents over 8 blocks ([0-2] DeltaNet, [3] attention, [4-6] DeltaNet, [7] attention):
  // the middle stage's agent (DeltaNet blocks) is killed with SIGKILL at token 12; the spare takes its stage, the
  // prompt and the tokens so far are replayed (a prefill from position 0 on fresh sessions rebuilds every DeltaNet
  // state), and the stream goes on to the uninterrupted run's tokens and text.
  it.live(
    "kill -9 of the middle stage with a spare: greedy output equals the uninterrupted run's",
    () =>
      Effect.gen(function* () {
        const o = model("e2e", { type: "q8_0" })
        yield* writeSyntheticModel(o)
        yield* killedStageResumes(
          { model: o.path, prompt: "Once upon a time", maxTokens: 40, threads: 1, stages: 3 },
          { atToken: 12 }
        )
      }),
    180_000
  )
})
