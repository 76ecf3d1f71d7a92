/**
 * qwen35moe (issue 21: archs/qwen35moe.ts over qwen35.ts's DeltaNet / gated attention and Moe.ts's routed
 * feed-forward with qwen35moe's sigmoid-gated shared expert; SyntheticQwen35.ts + SyntheticMoe.ts) on synthetic files
 * of Qwen3.5-MoE's structure at small size: 4 or 8 blocks (three gated DeltaNet blocks, then one gated attention
 * block), hidden 256, 8 experts of 128 with 2 used, one shared expert of 256 gated per token.
 * - `swactor synth --arch qwen35moe --experts N --experts-used K` writes a file node-llama-cpp loads and generates from;
 * - every split into 1-3 stages (cuts between DeltaNet and attention blocks) gives node-llama-cpp's greedy tokens;
 * - 8 sequences batched together equal their lone runs, bit for bit;
 * - a bad file is a typed ModelLoadError naming the key or tensor;
 * - placement counts the routed experts' active bytes and the DeltaNet blocks' state;
 * - end to end, a killed stage agent holding DeltaNet blocks is replaced and the text is the uninterrupted run's.
 */
import { assert, describe, it } from "@effect/vitest"
import { Effect, Exit } from "effect"
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { afterAll } from "vitest"
import { layerWith } from "../../src/layers/engine/StageExecutorLive.js"
import { getString, getU32, readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { type GgufTypedValue, GgufValues, writeGgufFile } from "../../src/layers/gguf/GgufWriter.js"
import { readModelLayout } from "../../src/layers/gguf/ModelCatalogLive.js"
import { type SyntheticModelOptions, syntheticModelSpec, writeSyntheticModel } from "../../src/layers/gguf/Synthetic.js"
import { makeRng } from "../../src/services/Sampler.js"
import { StageExecutor } from "../../src/services/StageExecutor.js"
import * as Batch from "../support/batch.js"
import { allSplits, nodeLlamaReference, splitsMatchReference } from "../support/engine.js"
import { killedStageResumes } from "../support/resume.js"
import { runSynthCli } from "../support/synthCli.js"

const LAYERS = 4
const CONTEXT = 512
const options = { threads: 1, contextLength: CONTEXT } as const
const PROMPT = "Once upon a time there was a little girl who lived in a village near the forest"
const dir = mkdtempSync(join(tmpdir(), "swactor-engine-qwen35moe-"))
afterAll(() => rmSync(dir, { recursive: true, force: true }))

const model = (name: string, extra: Partial<SyntheticModelOptions> = {}): SyntheticModelOptions => ({
  path: join(dir, `${name}.gguf`),
  arch: "qwen35moe",
  layers: LAYERS,
  hidden: 256,
  ffn: 512,
  heads: 4,
  kvHeads: 2,
  headDim: 64,
  vocab: 400,
  contextLength: CONTEXT,
  type: "f32",
  seed: 351,
  experts: 8,
  expertsUsed: 2,
  expertFfn: 128,
  sharedExperts: 2,
  ...extra
})

describe("swactor synth --arch qwen35moe", () => {
  it("plans qwen35's layer pattern with routed feed-forwards and the gated shared expert", () => {
    const s = syntheticModelSpec(model("plan", { layers: 8 }))
    const byName = new Map(s.tensors.map((t) => [t.name, t]))
    for (let i = 0; i < 8; i++) {
      const attention = i % 4 === 3
      assert.strictEqual(byName.has(`blk.${i}.attn_q.weight`), attention, `block ${i} attn_q`)
      assert.strictEqual(byName.has(`blk.${i}.ssm_conv1d.weight`), !attention, `block ${i} ssm_conv1d`)
      assert.isFalse(byName.has(`blk.${i}.ffn_gate.weight`), `block ${i}: no dense feed-forward`)
      assert.isFalse(byName.has(`blk.${i}.ffn_norm.weight`))
      assert.deepStrictEqual(byName.get(`blk.${i}.post_attention_norm.weight`)!.dims, [256])
      assert.deepStrictEqual(byName.get(`blk.${i}.ffn_gate_inp.weight`)!.dims, [256, 8])
      assert.deepStrictEqual(byName.get(`blk.${i}.ffn_down_exps.weight`)!.dims, [128, 256, 8])
      assert.deepStrictEqual(byName.get(`blk.${i}.ffn_up_shexp.weight`)!.dims, [256, 256])
      assert.deepStrictEqual(byName.get(`blk.${i}.ffn_gate_inp_shexp.weight`)!.dims, [256])
    }
  })

  it.effect("refuses options qwen35moe has no use for, and a missing shared expert", () =>
    Effect.gen(function* () {
      const dense = yield* Effect.exit(writeSyntheticModel(model("bad-dense", { denseBlocks: 1 })))
      assert.include(String(dense), "not qwen35moe options")
      const none = yield* Effect.exit(writeSyntheticModel(model("bad-shared", { sharedExperts: 0 })))
      assert.include(String(none), "sharedExperts must be at least 1 for qwen35moe")
      const used = yield* Effect.exit(writeSyntheticModel(model("bad-used", { expertsUsed: 9 })))
      assert.include(String(used), "expertsUsed (9) must be at most experts (8)")
    })
  )

  it.live(
    "writes a file node-llama-cpp loads and generates a varied greedy stream from",
    () =>
      Effect.gen(function* () {
        const out = join(dir, "cli-qwen35moe.gguf")
        const exit = yield* runSynthCli([
          "--arch",
          "qwen35moe",
          "--experts",
          "8",
          "--experts-used",
          "2",
          "--expert-ffn",
          "128",
          "--shared-experts",
          "2",
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
        ])
        assert.isTrue(Exit.isSuccess(exit), String(exit))
        const file = yield* readGgufFile(out)
        assert.strictEqual(yield* getString(file, "general.architecture"), "qwen35moe")
        assert.strictEqual(yield* getU32(file, "qwen35moe.expert_count"), 8)
        assert.strictEqual(yield* getU32(file, "qwen35moe.expert_used_count"), 2)
        assert.strictEqual(yield* getU32(file, "qwen35moe.expert_shared_feed_forward_length"), 256)
        assert.strictEqual(yield* getU32(file, "qwen35moe.full_attention_interval"), 4)
        assert.strictEqual(yield* getU32(file, "qwen35moe.ssm.inner_size"), 128)
        const ref = yield* nodeLlamaReference(out, PROMPT, 32, options)
        assert.isAtLeast(new Set(ref.tokens).size, 4, `reference stream ${ref.tokens}`)
      }),
    120_000
  )
})

describe("qwen35moe: every split into 1-3 stages matches node-llama-cpp", () => {
  // 4 blocks: DeltaNet 0-2, attention 3; 7 splits cut between DeltaNet blocks and between DeltaNet and attention
  for (const [type, nTokens] of [
    ["f32", 32],
    ["q8_0", 32]
  ] as const) {
    it.live(
      `${type}: greedy ${nTokens} tokens of all 7 splits equal node-llama-cpp's, splits bit-identical, first log-probs within 1e-4`,
      () =>
        Effect.gen(function* () {
          const o = model(`parity-${type}`, { type })
          yield* writeSyntheticModel(o)
          const ref = yield* nodeLlamaReference(o.path, PROMPT, nTokens, options)
          assert.isAtLeast(new Set(ref.tokens).size, 4, `reference stream ${ref.tokens}`)
          const splits = allSplits(LAYERS, 3)
          assert.strictEqual(splits.length, 7)
          const maxDiff = yield* splitsMatchReference(o.path, ref, splits, options)
          console.log(
            `qwen35moe ${type}: ${splits.length} splits x ${nTokens} tokens; first log-prob max diff ${maxDiff.toExponential(2)}`
          )
          assert.isBelow(maxDiff, 1e-4)
        }).pipe(Effect.provide(layerWith({ smallBatchRows: 0 }))),
      240_000
    )
  }
})

describe("qwen35moe without expert_shared_feed_forward_length", () => {
  // llama.cpp's default: the shared expert is feed_forward_length (512 = 4 x 128) wide
  it.live(
    "the shared expert takes feed_forward_length: node-llama-cpp's 32 greedy tokens at 1 and 2 stages",
    () =>
      Effect.gen(function* () {
        const o = model("no-shared-key", { sharedExperts: 4 })
        const s = syntheticModelSpec(o)
        const metadata = s.metadata.filter(([k]) => k !== "qwen35moe.expert_shared_feed_forward_length")
        assert.strictEqual(metadata.length, s.metadata.length - 1)
        yield* writeGgufFile(o.path, { metadata, tensors: s.tensors })
        const ref = yield* nodeLlamaReference(o.path, PROMPT, 32, options)
        assert.isAtLeast(new Set(ref.tokens).size, 4, `reference stream ${ref.tokens}`)
        const maxDiff = yield* splitsMatchReference(
          o.path,
          ref,
          [
            [0, 4],
            [0, 3, 4]
          ],
          options
        )
        assert.isBelow(maxDiff, 1e-4)
      }).pipe(Effect.provide(layerWith({ smallBatchRows: 0 }))),
    120_000
  )
})

describe("qwen35moe: 8 blocks, q8_0, tied output", () => {
  it.live(
    "two groups of 3 DeltaNet : 1 attention blocks: 32 greedy tokens of all 29 splits into 1-3 stages equal node-llama-cpp's",
    () =>
      Effect.gen(function* () {
        const o = model("parity-8", { type: "q8_0", layers: 8, tiedOutput: true })
        yield* writeSyntheticModel(o)
        const ref = yield* nodeLlamaReference(o.path, PROMPT, 32, options)
        assert.isAtLeast(new Set(ref.tokens).size, 4, `reference stream ${ref.tokens}`)
        const splits = allSplits(8, 3)
        assert.strictEqual(splits.length, 29)
        const maxDiff = yield* splitsMatchReference(o.path, ref, splits, options)
        console.log(
          `qwen35moe q8_0 8 blocks: 29 splits x 32 tokens; first log-prob max diff ${maxDiff.toExponential(2)}`
        )
        assert.isBelow(maxDiff, 1e-4)
      }).pipe(Effect.provide(layerWith({ smallBatchRows: 0 }))),
    240_000
  )
})

describe("qwen35moe: 8 sequences batched together equal the same sequences alone", () => {
  // each row routes on its own logits and reads and writes its own DeltaNet state: joins, early finishes, a chunked
  // prefill, prefill rows beside decode rows; q8_0 on the few-row route (8)
  const r = makeRng(35)
  const prompt = (n: number) => Array.from({ length: n }, () => 3 + Math.floor(r() * 390))
  const plans = [
    { prompt: prompt(5), start: 0, steps: 14 },
    { prompt: prompt(11), start: 0, steps: 14 },
    { prompt: prompt(1), start: 0, steps: 8 },
    { prompt: prompt(17), start: 2, steps: 14 },
    { prompt: prompt(7), start: 4, steps: 6 },
    { prompt: prompt(3), start: 1, steps: 14 },
    { prompt: prompt(9), start: 3, steps: 10 },
    { prompt: prompt(36), start: 1, steps: 14, chunk: 16 }
  ]
  it.live(
    "q8_0, 1/2/3 stages cut between DeltaNet and attention blocks: bit-identical logits to the lone runs",
    () =>
      Effect.gen(function* () {
        const o = model("batched", { type: "q8_0" })
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

describe("qwen35moe: a bad file is a typed ModelLoadError naming the key or tensor", () => {
  /** The 4-block f32 model with metadata `key` set to `value` (null: removed) and tensors `drop` left out. */
  const loadBad = (name: string, key: string | null, value: GgufTypedValue | null, drop: ReadonlyArray<string> = []) =>
    Effect.gen(function* () {
      const path = join(dir, `bad-${name}.gguf`)
      const s = syntheticModelSpec(model(`bad-${name}`))
      const metadata = s.metadata.filter(([k]) => k !== key)
      if (key !== null && value !== null) metadata.push([key, value])
      yield* writeGgufFile(path, { metadata, tensors: s.tensors.filter((t) => !drop.includes(t.name)) })
      const executor = yield* StageExecutor
      const exit = yield* Effect.exit(
        Effect.scoped(executor.load({ path, layerStart: 0, layerEndExclusive: LAYERS, isFirst: true, isLast: true }))
      )
      assert.isTrue(Exit.isFailure(exit) && exit.cause._tag === "Fail", `a typed failure: ${String(exit)}`)
      if (!Exit.isFailure(exit) || exit.cause._tag !== "Fail") return { reason: "", message: "" }
      assert.strictEqual(exit.cause.error._tag, "ModelLoadError")
      return { reason: exit.cause.error.reason, message: exit.cause.error.message }
    }).pipe(Effect.provide(layerWith({ smallBatchRows: 0 })))

  it.live("expert_count disagreeing with the tensors: TensorShapeMismatch naming the key and the tensor", () =>
    Effect.gen(function* () {
      const e = yield* loadBad("count", "qwen35moe.expert_count", GgufValues.u32(4))
      assert.strictEqual(e.reason, "TensorShapeMismatch")
      assert.include(e.message, "qwen35moe.expert_count")
      assert.include(e.message, "blk.0.ffn_gate_inp.weight")
    })
  )

  it.live("expert_used_count above expert_count, or missing: InvalidMetadata naming both keys", () =>
    Effect.gen(function* () {
      const over = yield* loadBad("used", "qwen35moe.expert_used_count", GgufValues.u32(9))
      assert.strictEqual(over.reason, "InvalidMetadata")
      assert.include(over.message, "qwen35moe.expert_used_count")
      assert.include(over.message, "qwen35moe.expert_count")
      const missing = yield* loadBad("no-used", "qwen35moe.expert_used_count", null)
      assert.strictEqual(missing.reason, "InvalidMetadata")
      assert.include(missing.message, "qwen35moe.expert_used_count")
    })
  )

  it.live("shared expert: a width disagreeing with expert_shared_feed_forward_length, or no gate: named", () =>
    Effect.gen(function* () {
      // the shared expert's width is the key (not the routed experts' 128, not feed_forward_length 512)
      const width = yield* loadBad("shared-width", "qwen35moe.expert_shared_feed_forward_length", null)
      assert.strictEqual(width.reason, "TensorShapeMismatch")
      assert.include(width.message, "ffn_gate_shexp.weight")
      assert.include(width.message, "[256, 512]")
      const gate = yield* loadBad("no-gate", null, null, ["blk.2.ffn_gate_inp_shexp.weight"])
      assert.include(gate.message, "blk.2.ffn_gate_inp_shexp.weight")
      const sections = yield* loadBad("inner", "qwen35moe.ssm.inner_size", GgufValues.u32(100))
      assert.strictEqual(sections.reason, "InvalidMetadata")
      assert.include(sections.message, "qwen35moe.ssm.inner_size")
    })
  )
})

describe("qwen35moe: what placement counts", () => {
  it.live("active bytes count 2 of 8 experts; DeltaNet blocks hold a constant state and no KV rows", () =>
    Effect.gen(function* () {
      const o = model("layout", { type: "q8_0" })
      yield* writeSyntheticModel(o)
      const layout = yield* readModelLayout(o.path)
      const file = yield* readGgufFile(o.path)
      const state = 4 * (3 * (2 * 2 * 32 + 4 * 32) + 32 * 32 * 4)
      assert.deepStrictEqual(layout.stateBytes, [state, state, state, 0])
      assert.deepStrictEqual(
        layout.kvBytesPerToken.map((b) => b === 0),
        [true, true, true, false]
      )
      for (let i = 0; i < LAYERS; i++) {
        const experts = ["gate", "up", "down"].reduce(
          (sum, p) => sum + file.tensorsByName.get(`blk.${i}.ffn_${p}_exps.weight`)!.byteSize,
          0
        )
        assert.isAbove(experts, 0)
        assert.strictEqual(
          layout.activeBlockBytes![i],
          layout.blockBytes[i]! - experts + (experts * 2) / 8,
          `block ${i}`
        )
      }
      // the server's admission reads the same DeltaNet blocks from the metadata
      assert.deepStrictEqual(layout.stateBytes, [state, state, state, 0])
      assert.strictEqual(layout.kvBytesPerToken[0], 0)
    })
  )
})

describe("qwen35moe end to end: a killed stage agent resumes with identical text", () => {
  // 8 blocks ([0-2] DeltaNet, [3] attention, [4-6] DeltaNet, [7] attention), 3 stages + 1 spare on local agents: the
  // middle stage's agent, holding DeltaNet blocks, is killed with SIGKILL at token 12; the spare replays the prompt
  // and the tokens so far from position 0 (rebuilding every DeltaNet state, routing each row again).
  it.live(
    "kill -9 of the middle stage with a spare: greedy output equals the uninterrupted run's",
    () =>
      Effect.gen(function* () {
        const o = model("e2e", { type: "q8_0", layers: 8 })
        yield* writeSyntheticModel(o)
        const { killedLayers } = yield* killedStageResumes(
          { model: o.path, prompt: "Once upon a time", maxTokens: 40, threads: 1, stages: 3 },
          { atToken: 12 }
        )
        const [start, end] = killedLayers
        assert.isTrue(
          start < end && [...Array(end - start).keys()].some((j) => (start + j) % 4 !== 3),
          `killed ${start}-${end}`
        )
      }),
    180_000
  )
})
