/**
 * mistral3's mixture-of-experts variant (archs/mistral3.ts over Moe.ts; SyntheticMistral3.ts writes it): every block
 * routes its feed-forward as llama.cpp's src/models/mistral3.cpp does (ffn_norm, softmax gate, top-k experts, weights
 * normalised to sum 1, no scale, no shared expert), each expert `feed_forward_length` wide.
 * - every split into 1, 2 and 3 stages gives node-llama-cpp's greedy tokens on the same synthetic file: f32 with YaRN
 *   and attention temperature, q8_0 plain with keys llama.cpp does not read for mistral3 (expert_feed_forward_length,
 *   expert_weights_scale, expert_gating_func, expert_weights_norm: ignored by both), f32 with 8 of 8 experts used;
 * - 8 sequences batched equal the same sequences alone;
 * - placement counts the experts (active bytes: 2 of 8);
 * - bad expert metadata or a missing routed tensor is a typed ModelLoadError naming the key or tensor;
 * - `swactor synth --arch mistral3 --experts N --experts-used K --expert-ffn F` writes one node-llama-cpp loads.
 */
import { assert, describe, it } from "@effect/vitest"
import { Effect, Exit } from "effect"
import { join } from "node:path"
import { GgufValues, type GgufTypedValue, writeGgufFile } from "../../src/layers/gguf/GgufWriter.js"
import { layerWith } from "../../src/layers/engine/StageExecutorLive.js"
import { type SyntheticModelOptions, syntheticModelSpec, writeSyntheticModel } from "../../src/layers/gguf/Synthetic.js"
import { getU32, readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { readModelLayout } from "../../src/layers/gguf/ModelCatalogLive.js"
import { makeRng } from "../../src/services/Sampler.js"
import { StageExecutor } from "../../src/services/StageExecutor.js"
import * as Batch from "../support/batch.js"
import type { SeqPlan } from "../support/batch.js"
import { allSplits, greedyRun, nodeLlamaReference, splitsMatchReference } from "../support/engine.js"
import { runSynthCli } from "../support/synthCli.js"
import { modelFolder, REFERENCE_OPTIONS, STORY_PROMPT } from "../support/synthFiles.js"

const N_TOKENS = 96
const LAYERS = 4
const CONTEXT = 512
const options = REFERENCE_OPTIONS
const dir = modelFolder("swactor-engine-mistral3moe-")

/** 4 routed blocks, hidden 128, 8 experts of 128 (feed_forward_length 128), 2 used; YaRN and temperature on. */
const model = (name: string, extra: Partial<SyntheticModelOptions> = {}): SyntheticModelOptions => ({
  path: join(dir, `${name}.gguf`),
  arch: "mistral3",
  layers: LAYERS,
  hidden: 128,
  ffn: 256,
  heads: 4,
  kvHeads: 2,
  vocab: 400,
  contextLength: CONTEXT,
  type: "f32",
  seed: 53,
  experts: 8,
  expertsUsed: 2,
  expertFfn: 128,
  yarnFactor: 4,
  yarnOriginalContext: 32,
  attnTemperatureScale: 0.1,
  ...extra
})

const setKey = (md: Array<readonly [string, GgufTypedValue]>, key: string, v: GgufTypedValue | null) => {
  const i = md.findIndex(([k]) => k === key)
  if (i >= 0) md.splice(i, 1)
  if (v !== null) md.push([key, v])
}

/** The synthetic file of `o` with metadata keys set (null: removed) and tensors left out. */
const writeTweaked = (
  o: SyntheticModelOptions,
  keys: ReadonlyArray<readonly [string, GgufTypedValue | null]>,
  without: ReadonlyArray<string> = []
) => {
  const s = syntheticModelSpec(o)
  const md = [...s.metadata]
  for (const [k, v] of keys) setKey(md, k, v)
  return writeGgufFile(o.path, { metadata: md, tensors: s.tensors.filter((t) => !without.includes(t.name)) })
}

/** node-llama-cpp's tokens, then every split of 1-3 stages: same tokens, log-probs of the splits within `exact`. */
const checkModel = (label: string, path: string, exact: boolean) =>
  Effect.gen(function* () {
    const ref = yield* nodeLlamaReference(path, STORY_PROMPT, N_TOKENS, options)
    assert.isAtLeast(new Set(ref.tokens).size, 4, `reference stream ${ref.tokens}`)
    const splits = allSplits(LAYERS, 3)
    const maxDiff = yield* splitsMatchReference(path, ref, splits, options)
    console.log(
      `${label}: ${splits.length} splits x ${N_TOKENS} tokens equal node-llama-cpp; ` +
        `first-position log-prob max diff ${maxDiff.toExponential(2)}`
    )
    if (exact) assert.isBelow(maxDiff, 1e-4)
    return ref
  })

describe("mistral3 with experts: every split into 1, 2 and 3 stages gives node-llama-cpp's greedy tokens", () => {
  it.live(
    `f32, 8 experts, 2 used, YaRN and attention temperature: ${N_TOKENS} greedy tokens at every split equal node-llama-cpp's, log-probs within 1e-4`,
    () =>
      Effect.gen(function* () {
        const o = model("moe-f32")
        yield* writeSyntheticModel(o)
        const file = yield* readGgufFile(o.path)
        assert.strictEqual(yield* getU32(file, "mistral3.expert_count"), 8)
        assert.strictEqual(yield* getU32(file, "mistral3.feed_forward_length"), 128)
        assert.isFalse(file.tensorsByName.has("blk.0.ffn_gate.weight"))
        assert.deepStrictEqual(file.tensorsByName.get("blk.3.ffn_down_exps.weight")!.dims, [128, 128, 8])
        const ref = yield* checkModel("mistral3 moe f32 2/8", o.path, true)
        // the generation runs past position 96 (the temperature's third step)
        assert.isAbove(ref.prompt.length + N_TOKENS, 96)
      }),
    300_000
  )

  it.live(
    `q8_0, no YaRN or temperature, tied output, with keys llama.cpp does not read for mistral3: ${N_TOKENS} greedy tokens at every split equal node-llama-cpp's`,
    () =>
      Effect.gen(function* () {
        // expert_feed_forward_length 64 (the tensors are 128 wide), a scale of 2.5, sigmoid gating, no normalisation:
        // llama.cpp's mistral3 reads none of them; a swactor that read any would differ or refuse the file
        const o = model("moe-q8-ignored", { type: "q8_0", yarnFactor: 0, attnTemperatureScale: 0, tiedOutput: true })
        yield* writeTweaked(o, [
          ["mistral3.expert_feed_forward_length", GgufValues.u32(64)],
          ["mistral3.expert_weights_scale", GgufValues.f32(2.5)],
          ["mistral3.expert_gating_func", GgufValues.u32(2)],
          ["mistral3.expert_weights_norm", GgufValues.bool(false)]
        ])
        yield* checkModel("mistral3 moe q8_0 2/8 (ignored keys)", o.path, false)
      }),
    300_000
  )

  it.live(
    `f32, 8 of 8 experts used: ${N_TOKENS} greedy tokens at every split equal node-llama-cpp's, log-probs within 1e-4`,
    () =>
      Effect.gen(function* () {
        const o = model("moe-f32-all", { expertsUsed: 8 })
        yield* writeSyntheticModel(o)
        yield* checkModel("mistral3 moe f32 8/8", o.path, true)
      }),
    300_000
  )
})

/** 8 sequences, different prompts (each row routes to its own experts), joins, early finishes, a chunked prefill. */
const schedule = (vocab: number): ReadonlyArray<SeqPlan> => {
  const r = makeRng(77)
  const prompt = (n: number) => Array.from({ length: n }, () => 3 + Math.floor(r() * (vocab - 3)))
  return [
    { prompt: prompt(5), start: 0, steps: 20 },
    { prompt: prompt(11), start: 0, steps: 20 },
    { prompt: prompt(1), start: 0, steps: 14 },
    { prompt: prompt(17), start: 2, steps: 20 },
    { prompt: prompt(7), start: 4, steps: 10 },
    { prompt: prompt(40), start: 1, steps: 20, chunk: 16 },
    { prompt: prompt(3), start: 0, steps: 18 },
    { prompt: prompt(36), start: 3, steps: 16 }
  ]
}

describe("mistral3 with experts: 8 sequences batched equal the same sequences alone", () => {
  // q8_0: every product sums the same int8 blocks whatever the rows (the expert products are ggml_mul_mat_id, one-row
  // kernel per row and expert; the F32 router alike): bit-identical logits, routes 0 and 8.
  for (const rows of [0, 8] as const) {
    it.live(
      `q8_0 with YaRN and temperature: 8 sequences, 1/2/3 stages, joins, early finishes, chunked prefill: bit-identical logits (route ${rows})`,
      () =>
        Effect.gen(function* () {
          const o = model(`batch-q8-${rows}`, { type: "q8_0" })
          yield* writeSyntheticModel(o)
          const splits = [
            [0, 4],
            [0, 2, 4],
            [0, 1, 3, 4]
          ]
          const maxDiff = yield* Batch.batchedEqualsAlone(o.path, splits, schedule(o.vocab), CONTEXT, {
            bitIdentical: true
          })
          console.log(`mistral3 moe q8_0 route ${rows}: batched vs alone max logit difference ${maxDiff}`)
        }).pipe(Effect.provide(layerWith({ smallBatchRows: rows }))),
      180_000
    )
  }
})

describe("mistral3 with experts: what placement counts", () => {
  it.live("active bytes count 2 of 8 experts per block; the router is read whole", () =>
    Effect.gen(function* () {
      const o = model("layout", { type: "q8_0" })
      yield* writeSyntheticModel(o)
      const layout = yield* readModelLayout(o.path)
      const file = yield* readGgufFile(o.path)
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
    })
  )
})

/** Loads the whole of `path`: "loaded", or the typed failure's reason and message. */
const loadWhole = (path: string) =>
  Effect.gen(function* () {
    const executor = yield* StageExecutor
    const exit = yield* Effect.exit(
      Effect.scoped(executor.load({ path, layerStart: 0, layerEndExclusive: 2, isFirst: true, isLast: true }))
    )
    if (Exit.isSuccess(exit)) return { tag: "loaded", reason: "", message: "" }
    if (exit.cause._tag !== "Fail") return { tag: "defect", reason: "", message: String(exit.cause) }
    const e = exit.cause.error
    return { tag: e._tag, reason: "reason" in e ? String(e.reason) : "", message: e.message }
  }).pipe(Effect.provide(layerWith({ smallBatchRows: 0 })))

describe("mistral3 with experts: bad expert metadata or a missing routed tensor is a typed error naming it", () => {
  const small = (name: string) => model(name, { layers: 2, hidden: 64, ffn: 128, expertFfn: 64 })
  const cases: ReadonlyArray<
    readonly [
      string,
      ReadonlyArray<readonly [string, GgufTypedValue | null]>,
      ReadonlyArray<string>,
      string,
      ReadonlyArray<string>
    ]
  > = [
    ["used-0", [["mistral3.expert_used_count", GgufValues.u32(0)]], [], "InvalidMetadata", ["expert_used_count"]],
    [
      "used-9",
      [["mistral3.expert_used_count", GgufValues.u32(9)]],
      [],
      "InvalidMetadata",
      ["mistral3.expert_used_count", "mistral3.expert_count"]
    ],
    ["used-missing", [["mistral3.expert_used_count", null]], [], "InvalidMetadata", ["mistral3.expert_used_count"]],
    ["count-2000", [["mistral3.expert_count", GgufValues.u32(2000)]], [], "InvalidMetadata", ["mistral3.expert_count"]],
    [
      "count-4",
      [["mistral3.expert_count", GgufValues.u32(4)]],
      [],
      "TensorShapeMismatch",
      ["mistral3.expert_count", "blk.0.ffn_gate_inp.weight"]
    ],
    [
      "count-0-used-2",
      [["mistral3.expert_count", GgufValues.u32(0)]],
      [],
      "InvalidMetadata",
      ["mistral3.expert_used_count", "without experts"]
    ],
    [
      "ffn-wrong",
      [["mistral3.feed_forward_length", GgufValues.u32(32)]],
      [],
      "TensorShapeMismatch",
      ["ffn_gate_exps.weight"]
    ],
    ["no-gate-inp", [], ["blk.1.ffn_gate_inp.weight"], "", ["blk.1.ffn_gate_inp.weight"]],
    ["no-gate-exps", [], ["blk.0.ffn_gate_exps.weight"], "", ["blk.0.ffn_gate_exps.weight"]]
  ]
  for (const [name, keys, without, reason, words] of cases) {
    it.live(`${name}: ModelLoadError${reason === "" ? "" : ` (${reason})`} naming ${words.join(", ")}`, () =>
      Effect.gen(function* () {
        const o = small(`bad-${name}`)
        yield* writeTweaked(o, keys, without)
        const r = yield* loadWhole(o.path)
        assert.strictEqual(r.tag, "ModelLoadError", r.message)
        if (reason !== "") assert.strictEqual(r.reason, reason, r.message)
        for (const w of words) assert.include(r.message, w)
      })
    )
  }
})

describe("swactor synth --arch mistral3 --experts", () => {
  const args = (out: string, extra: ReadonlyArray<string>) => [
    "--arch",
    "mistral3",
    "--layers",
    "3",
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
    ...extra,
    "-o",
    out
  ]
  it.live(
    "--experts 4 --experts-used 2 --expert-ffn 64: every block routed, feed_forward_length 64; node-llama-cpp loads it and 2 stages give its tokens",
    () =>
      Effect.gen(function* () {
        const out = join(dir, "cli-moe.gguf")
        const exit = yield* runSynthCli(args(out, ["--experts", "4", "--experts-used", "2", "--expert-ffn", "64"]))
        assert.isTrue(Exit.isSuccess(exit), String(exit))
        const file = yield* readGgufFile(out)
        assert.strictEqual(yield* getU32(file, "mistral3.expert_count"), 4)
        assert.strictEqual(yield* getU32(file, "mistral3.expert_used_count"), 2)
        assert.strictEqual(yield* getU32(file, "mistral3.feed_forward_length"), 64)
        for (let i = 0; i < 3; i++) {
          assert.deepStrictEqual(file.tensorsByName.get(`blk.${i}.ffn_gate_inp.weight`)!.dims, [128, 4])
          assert.deepStrictEqual(file.tensorsByName.get(`blk.${i}.ffn_up_exps.weight`)!.dims, [128, 64, 4])
          assert.isFalse(file.tensorsByName.has(`blk.${i}.ffn_up.weight`))
          assert.isFalse(file.tensorsByName.has(`blk.${i}.ffn_up_shexp.weight`))
        }
        const ref = yield* nodeLlamaReference(out, STORY_PROMPT, 64, options)
        const run = yield* greedyRun(out, [0, 2, 3], ref.prompt, 64, options)
        assert.deepStrictEqual(run.tokens, ref.tokens)
      }),
    120_000
  )

  it.live("--experts-used without --experts, and --shared-experts: refused by name", () =>
    Effect.gen(function* () {
      const noExperts = yield* runSynthCli(args(join(dir, "cli-no-experts.gguf"), ["--experts-used", "2"]))
      assert.isTrue(Exit.isFailure(noExperts))
      assert.include(String(noExperts), "--experts-used needs --experts on mistral3")
      const shared = yield* runSynthCli(
        args(join(dir, "cli-shared.gguf"), ["--experts", "4", "--experts-used", "2", "--shared-experts", "1"])
      )
      assert.isTrue(Exit.isFailure(shared))
      assert.include(String(shared), "--shared-experts is for glm4moe, deepseek2, qwen35moe only, not mistral3")
    })
  )
})
