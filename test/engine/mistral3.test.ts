/**
 * mistral3 (archs/mistral3.ts): greedy tokens of every split into 1, 2 and 3 stages equal node-llama-cpp's on
 * synthetic mistral3 files that `swactor synth --arch mistral3` writes (Synthetic.ts + SyntheticMistral3.ts): YaRN
 * RoPE scaling (factor 4, original context 32, beta_fast 32, beta_slow 1, log multiplier 1) and attention temperature
 * tuning (scale 0.1: q scaled from position 32 on, again at 64 and 96), with the prompt + generation running past
 * position 96; also a plain one (neither) in q8_0. Node-llama-cpp on the same weights without YaRN, or without the
 * temperature, gives other tokens within the test's length, so each feature is exercised. Sequences at different
 * temperature steps batched into one decode step get their lone bits. Bad mistral3 metadata is a typed error naming
 * the key.
 */
import * as Command from "@effect/cli/Command"
import * as NodeContext from "@effect/platform-node/NodeContext"
import { assert, describe, it } from "@effect/vitest"
import { Effect, Exit } from "effect"
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { afterAll } from "vitest"
import { GgufValueType, type ModelLoadError } from "../../src/domain/gguf.js"
import { layerWith } from "../../src/layers/engine/StageExecutorLive.js"
import { synthCommand } from "../../src/cli/SynthCommand.js"
import { getF32, getString, getU32, readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { GgufValues, type GgufTypedValue, writeGgufFile } from "../../src/layers/gguf/GgufWriter.js"
import { type SyntheticModelOptions, syntheticModelSpec, writeSyntheticModel } from "../../src/layers/gguf/Synthetic.js"
import type { StageInput } from "../../src/domain/engine.js"
import { makeRng } from "../../src/services/Sampler.js"
import { StageExecutor } from "../../src/services/StageExecutor.js"
import { allSplits, greedyRun, nodeLlamaReference, splitsMatchReference } from "../support/engine.js"
import { killedStageResumes } from "../support/resume.js"

const N_TOKENS = 96
const LAYERS = 4
const options = { threads: 1, contextLength: 256 } as const
const PROMPT = "Once upon a time there was a little girl who lived in a village near the forest"
const dir = mkdtempSync(join(tmpdir(), "swactor-engine-mistral3-"))
afterAll(() => rmSync(dir, { recursive: true, force: true }))

const model = (name: string, extra: Partial<SyntheticModelOptions> = {}): SyntheticModelOptions => ({
  path: join(dir, `${name}.gguf`),
  arch: "mistral3",
  layers: LAYERS,
  hidden: 128,
  ffn: 256,
  heads: 4,
  kvHeads: 2,
  vocab: 400,
  contextLength: 512,
  type: "f32",
  seed: 31,
  yarnFactor: 4,
  yarnOriginalContext: 32,
  attnTemperatureScale: 0.1,
  ...extra
})

/** node-llama-cpp's tokens, then every split of 1-3 stages: same tokens, bit-identical logits across splits. */
const checkModel = (label: string, path: string, exact: boolean) =>
  Effect.gen(function* () {
    const ref = yield* nodeLlamaReference(path, PROMPT, N_TOKENS, options)
    assert.isAtLeast(new Set(ref.tokens).size, 4, `reference stream ${ref.tokens}`)
    // the generation runs past position 96 (the temperature's third step)
    assert.isAbove(ref.prompt.length + N_TOKENS, 96)
    const splits = allSplits(LAYERS, 3)
    const maxDiff = yield* splitsMatchReference(path, ref, splits, options)
    console.log(
      `${label}: ${splits.length} splits x ${N_TOKENS} tokens equal node-llama-cpp; ` +
        `first-position log-prob max diff ${maxDiff.toExponential(2)}`
    )
    if (exact) assert.isBelow(maxDiff, 1e-4)
    return ref.tokens
  })

describe("mistral3: every split into 1-3 stages matches node-llama-cpp", () => {
  it.live(
    `f32 with YaRN and attention temperature: greedy ${N_TOKENS} tokens of every split equal node-llama-cpp's`,
    () =>
      Effect.gen(function* () {
        const o = model("mistral3-yarn-temp")
        yield* writeSyntheticModel(o)
        const tokens = yield* checkModel("mistral3 f32 yarn + temperature", o.path, true)
        // The same weights without the temperature, and without YaRN: node-llama-cpp's tokens change, so both
        // features act within this test's length.
        for (const [name, extra] of [
          ["no-temp", { attnTemperatureScale: 0 }],
          ["no-yarn", { yarnFactor: 0 }]
        ] as const) {
          const other = model(`mistral3-${name}`, extra)
          yield* writeSyntheticModel(other)
          const ref = yield* nodeLlamaReference(other.path, PROMPT, N_TOKENS, options)
          assert.notDeepEqual(ref.tokens, tokens, `${name} changes node-llama-cpp's tokens`)
        }
      }),
    300_000
  )

  it.live(
    `q8_0 without YaRN or temperature, tied output: greedy ${N_TOKENS} tokens of every split equal node-llama-cpp's`,
    () =>
      Effect.gen(function* () {
        const o = model("mistral3-plain-q8", { type: "q8_0", yarnFactor: 0, attnTemperatureScale: 0, tiedOutput: true })
        yield* writeSyntheticModel(o)
        yield* checkModel("mistral3 q8_0 plain", o.path, false)
      }),
    300_000
  )
})

describe("mistral3: a batch of sequences at different temperature steps", () => {
  // 4 sequences at positions 30, 33, 65 and 100 (temperature steps 0, 1, 2, 3 with original context 32) decode one
  // token together in one forwardBatch: each gets the bits of its lone step (few-row route forced on: 8 rows).
  it.live(
    "each sequence of a batched decode step gets the logits of its lone step",
    () =>
      Effect.gen(function* () {
        const o = model("mistral3-batch")
        yield* writeSyntheticModel(o)
        const executor = yield* StageExecutor
        const whole = yield* executor.load({
          path: o.path,
          layerStart: 0,
          layerEndExclusive: LAYERS,
          isFirst: true,
          isLast: true
        })
        const open = () => executor.session(whole, { threads: 1, contextLength: 256 })
        const lengths = [30, 33, 65, 100]
        const r = makeRng(7)
        const batched = yield* Effect.forEach(lengths, open)
        const lone = yield* Effect.forEach(lengths, open)
        for (let i = 0; i < lengths.length; i++) {
          const prompt = Int32Array.from({ length: lengths[i]! }, () => 3 + Math.floor(r() * 390))
          yield* batched[i]!.forward(0, { _tag: "Tokens", tokens: prompt })
          yield* lone[i]!.forward(0, { _tag: "Tokens", tokens: prompt })
        }
        const step = (i: number): StageInput => ({ _tag: "Tokens", tokens: Int32Array.of(10 + i) })
        const outs = yield* executor.forwardBatch(
          batched.map((session, i) => ({ session, startPos: lengths[i]!, input: step(i) }))
        )
        for (let i = 0; i < lengths.length; i++) {
          assert.deepStrictEqual(
            outs[i],
            yield* lone[i]!.forward(lengths[i]!, step(i)),
            `sequence at position ${lengths[i]}`
          )
        }
      }).pipe(Effect.scoped, Effect.provide(layerWith({ smallBatchRows: 8 }))),
    120_000
  )
})

describe("swactor synth --arch mistral3", () => {
  const cli = Command.run(Command.make("swactor").pipe(Command.withSubcommands([synthCommand])), {
    name: "swactor",
    version: "test"
  })
  // The command line's defaults: YaRN factor 4 over context / 8, temperature 0.1; node-llama-cpp loads the file and a
  // 2-stage split gives its greedy tokens.
  it.live(
    "writes YaRN and the attention temperature by default; node-llama-cpp loads it and 2 stages give its tokens",
    () =>
      Effect.gen(function* () {
        const out = join(dir, "cli-mistral3.gguf")
        const exit = yield* cli([
          "node",
          "swactor",
          "synth",
          "--arch",
          "mistral3",
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
          "-o",
          out
        ]).pipe(Effect.provide(NodeContext.layer), Effect.exit)
        assert.isTrue(Exit.isSuccess(exit), String(exit))
        const file = yield* readGgufFile(out)
        assert.strictEqual(yield* getString(file, "general.architecture"), "mistral3")
        assert.strictEqual(yield* getString(file, "mistral3.rope.scaling.type"), "yarn")
        assert.strictEqual(yield* getF32(file, "mistral3.rope.scaling.factor"), 4)
        assert.strictEqual(yield* getU32(file, "mistral3.rope.scaling.original_context_length"), 64)
        assert.closeTo(yield* getF32(file, "mistral3.attention.temperature_scale"), 0.1, 1e-7)
        const ref = yield* nodeLlamaReference(out, PROMPT, 80, options)
        const run = yield* greedyRun(out, [0, 2, 4], ref.prompt, 80, options)
        assert.deepStrictEqual(run.tokens, ref.tokens)
      }),
    120_000
  )
})

describe("mistral3: bad metadata is a typed error naming the key", () => {
  const base = model("mistral3-bad", { layers: 2, hidden: 64, ffn: 128 })
  const set = (md: Array<readonly [string, GgufTypedValue]>, key: string, v: GgufTypedValue) => {
    const i = md.findIndex(([k]) => k === key)
    if (i >= 0) md.splice(i, 1)
    md.push([key, v])
  }
  const cases: ReadonlyArray<readonly [string, string, GgufTypedValue, string]> = [
    [
      "temp-array",
      "mistral3.attention.temperature_scale",
      GgufValues.array(GgufValueType.FLOAT32, [0.1, 0.1]),
      "is an array"
    ],
    ["temp-string", "mistral3.attention.temperature_scale", GgufValues.string("0.1"), "must be a float"],
    ["beta-nan", "mistral3.rope.scaling.yarn_beta_fast", GgufValues.f32(Number.NaN), "must be finite"],
    ["yarn-factor-zero", "mistral3.rope.scaling.factor", GgufValues.f32(0), "must be > 0 for YaRN"],
    ["scaling-unknown", "mistral3.rope.scaling.type", GgufValues.string("longrope"), "is not supported"]
  ]
  for (const [name, key, value, words] of cases) {
    it.live(`${key} = ${JSON.stringify(value.value)}: ModelLoadError naming it`, () =>
      Effect.gen(function* () {
        const path = join(dir, `${name}.gguf`)
        const s = syntheticModelSpec({ ...base, path })
        const md = [...s.metadata]
        set(md, key, value)
        yield* writeGgufFile(path, { metadata: md, tensors: s.tensors })
        const executor = yield* StageExecutor
        const exit: Exit.Exit<unknown, ModelLoadError> = yield* Effect.exit(
          Effect.scoped(executor.load({ path, layerStart: 0, layerEndExclusive: 2, isFirst: true, isLast: true }))
        )
        assert.isTrue(Exit.isFailure(exit) && exit.cause._tag === "Fail", `a typed failure: ${String(exit)}`)
        if (Exit.isFailure(exit) && exit.cause._tag === "Fail") {
          assert.strictEqual(exit.cause.error._tag, "ModelLoadError")
          assert.include(exit.cause.error.message, key.replace(/^mistral3\./, ""))
          assert.include(exit.cause.error.message, words)
        }
      }).pipe(Effect.provide(layerWith({ smallBatchRows: 0 })))
    )
  }
})

describe("mistral3 end to end: a killed stage agent resumes with identical text", () => {
  // YaRN and attention temperature (original context 32); 3 stages + 1 spare on local agents. The middle stage's agent
  // is killed with SIGKILL at token 40 (past position 32, the temperature's first step); the spare takes its stage,
  // the prompt and the tokens so far are replayed in one prefill whose rows span two temperature steps, and the
  // stream goes on past position 64 to the uninterrupted run's tokens and text.
  it.live(
    "f32 with YaRN and temperature, kill -9 of the middle stage at token 40: greedy output equals the uninterrupted run's",
    () =>
      Effect.gen(function* () {
        const o = model("mistral3-e2e")
        yield* writeSyntheticModel(o)
        const { reference } = yield* killedStageResumes(
          { model: o.path, prompt: PROMPT, maxTokens: 64, threads: 1, stages: 3 },
          { atToken: 40 }
        )
        assert.isAbove(reference.summary!.promptTokens + 40, 32, "killed past the temperature's first step")
        assert.isAbove(reference.summary!.promptTokens + 64, 64, "the run ends past its second")
      }),
    180_000
  )
})
