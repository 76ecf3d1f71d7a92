/**
 * gpt-oss (archs/gptOss.ts, llama.cpp src/models/openai-moe.cpp): greedy tokens of every split into 1, 2 and 3 stages
 * equal node-llama-cpp's on synthetic gpt-oss files (`swactor synth --arch gpt-oss`, SyntheticGptOss.ts): attention
 * sinks, q/k/v/output biases, every other block sliding (window 16, so prompt + generation run past it several times;
 * the splits cut between sliding and global blocks both ways), YaRN RoPE, routed experts with router and expert
 * biases, softmax over the chosen logits and swiglu_oai; in F32 and as gpt-oss files come (MXFP4 experts, Q8_0 rest).
 * node-llama-cpp runs with its capped SWA cache and with full-size caches (swactor keeps full caches with a window
 * mask). The same weights with the window past the context, or without YaRN, give node-llama-cpp other tokens, so
 * both act within the test's length. Sequences batched equal their lone runs; bad metadata and bad tensors are typed
 * errors naming the key or the tensor.
 */
import * as Command from "@effect/cli/Command"
import * as NodeContext from "@effect/platform-node/NodeContext"
import { assert, describe, it } from "@effect/vitest"
import { Effect, Exit } from "effect"
import { existsSync, mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { afterAll } from "vitest"
import { GgmlType } from "../../src/domain/ggmlTypes.js"
import { GgufValueType, type ModelLoadError } from "../../src/domain/gguf.js"
import { layerWith } from "../../src/layers/engine/StageExecutorLive.js"
import { synthCommand } from "../../src/cli/SynthCommand.js"
import { getString, getU32, readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import {
  type GgufTensorSpec,
  GgufValues,
  type GgufTypedValue,
  writeGgufFile
} from "../../src/layers/gguf/GgufWriter.js"
import { type SyntheticModelOptions, syntheticModelSpec, writeSyntheticModel } from "../../src/layers/gguf/Synthetic.js"
import { makeRng } from "../../src/services/Sampler.js"
import { StageExecutor } from "../../src/services/StageExecutor.js"
import * as Batch from "../support/batch.js"
import type { SeqPlan } from "../support/batch.js"
import { allSplits, greedyRun, nodeLlamaReference, splitsMatchReference } from "../support/engine.js"
import { killedStageResumes } from "../support/resume.js"

const N_TOKENS = 64
const LAYERS = 4
const WINDOW = 16
const options = { threads: 1, contextLength: 256 } as const
const PROMPT = "Once upon a time there was a little girl who lived in a village near the forest"
const dir = mkdtempSync(join(tmpdir(), "swactor-engine-gptoss-"))
afterAll(() => rmSync(dir, { recursive: true, force: true }))

const model = (name: string, extra: Partial<SyntheticModelOptions> = {}): SyntheticModelOptions => ({
  path: join(dir, `${name}.gguf`),
  arch: "gpt-oss",
  layers: LAYERS,
  hidden: 128,
  ffn: 64,
  heads: 4,
  kvHeads: 2,
  vocab: 400,
  contextLength: 512,
  type: "f32",
  seed: 61,
  experts: 8,
  expertsUsed: 2,
  slidingWindow: WINDOW,
  yarnFactor: 4,
  yarnOriginalContext: 32,
  ...extra
})

/** node-llama-cpp: BOS + tokenize(text), greedy `n` tokens; flash attention on, F16 KV, explicit threads. */
const reference = (
  path: string,
  n: number,
  swaFullCache: boolean,
  contextSize: number = options.contextLength,
  text = PROMPT
) => nodeLlamaReference(path, text, n, { threads: options.threads, contextLength: contextSize, swaFullCache })

/** Every split into 1..3 stages: tokens equal node-llama-cpp's (both caches), logits bit-identical across splits. */
const checkParity = (label: string, o: SyntheticModelOptions, maxLogProb: number) =>
  Effect.gen(function* () {
    yield* writeSyntheticModel(o)
    const ref = yield* reference(o.path, N_TOKENS, false)
    const refFull = yield* reference(o.path, N_TOKENS, true)
    assert.isAbove(ref.prompt.length + N_TOKENS, 3 * WINDOW, "the run is longer than three windows")
    assert.isAtLeast(new Set(ref.tokens).size, 8, `reference stream ${ref.tokens}`)
    assert.deepStrictEqual(refFull.tokens, ref.tokens, "node-llama-cpp: capped and full SWA caches agree")
    const splits = allSplits(LAYERS, 3)
    // cuts after a sliding block (0 | 1, 2 | 3) and after a global one (1 | 2)
    const cuts = new Set(splits.flatMap((s) => s.slice(1, -1)))
    assert.deepStrictEqual([...cuts].sort(), [1, 2, 3])
    const maxDiff = yield* splitsMatchReference(o.path, ref, splits, options)
    console.log(
      `${label}: ${splits.length} splits x ${N_TOKENS} tokens after a ${ref.prompt.length}-token prompt equal ` +
        `node-llama-cpp's (capped and full SWA cache); first-position log-prob max diff ${maxDiff.toExponential(2)}`
    )
    assert.isBelow(maxDiff, maxLogProb)
    return ref.tokens
  })

describe("gpt-oss: every split into 1-3 stages matches node-llama-cpp past the sliding window", () => {
  it.live(
    `f32, window ${WINDOW}, YaRN: greedy ${N_TOKENS} tokens of all 7 splits equal node-llama-cpp's`,
    () =>
      Effect.gen(function* () {
        const o = model("gptoss-f32")
        const tokens = yield* checkParity("gpt-oss f32", o, 1e-4)
        // the same weights with the window past the context, and without YaRN: node-llama-cpp's tokens change
        for (const [name, extra] of [
          ["wide", { slidingWindow: 4096 }],
          ["no-yarn", { yarnFactor: 0 }]
        ] as const) {
          const other = model(`gptoss-${name}`, extra)
          yield* writeSyntheticModel(other)
          const ref = yield* reference(other.path, N_TOKENS, false)
          assert.notDeepEqual(ref.tokens, tokens, `${name} changes node-llama-cpp's tokens`)
        }
      }),
    300_000
  )

  it.live(
    `mxfp4 experts, q8_0 rest: greedy ${N_TOKENS} tokens of all 7 splits equal node-llama-cpp's`,
    () =>
      Effect.gen(function* () {
        const o = model("gptoss-mxfp4", { type: "mxfp4", seed: 62 })
        const spec = syntheticModelSpec(o)
        const typeOf = (name: string) => spec.tensors.find((t) => t.name === name)?.type
        assert.strictEqual(typeOf("blk.0.ffn_up_exps.weight"), GgmlType.MXFP4)
        assert.strictEqual(typeOf("blk.0.attn_q.weight"), GgmlType.Q8_0)
        assert.strictEqual(typeOf("blk.0.ffn_gate_inp.weight"), GgmlType.F32)
        assert.strictEqual(typeOf("blk.0.ffn_down_exps.bias"), GgmlType.F32)
        yield* checkParity("gpt-oss mxfp4", o, 1e-3)
      }),
    300_000
  )
})

describe("gpt-oss: past the capped sliding-window cache", () => {
  // The sliding blocks keep a ring of pad256(min(context, window + 128)) = 256 cells (KvCache / Forward.ts ringMask);
  // with a 512 context, a ~315-token prompt (prefilled in pieces) and 60 generated tokens, positions wrap the ring
  // while the global blocks keep full caches, and the sinks ride along in both.
  it.live(
    "context 512, a 315-token prompt + 60 greedy tokens: 1 and 2 stages equal node-llama-cpp's",
    () =>
      Effect.gen(function* () {
        const o = model("gptoss-ring", { seed: 64 })
        yield* writeSyntheticModel(o)
        const long = { threads: 1, contextLength: 512 } as const
        const ref = yield* reference(o.path, 60, false, long.contextLength, Array(5).fill(PROMPT).join(" "))
        assert.isAbove(ref.prompt.length, 256 + WINDOW, "the prompt alone wraps the 256-cell ring")
        assert.strictEqual(ref.tokens.length, 60)
        assert.isAtLeast(new Set(ref.tokens).size, 8, `reference stream ${ref.tokens}`)
        for (const split of [
          [0, 4],
          [0, 1, 4]
        ]) {
          const run = yield* greedyRun(o.path, split, ref.prompt, 60, long)
          assert.deepStrictEqual(run.tokens, ref.tokens, `split ${split}`)
        }
      }),
    300_000
  )
})

describe("gpt-oss: 6 sequences batched equal their lone runs", () => {
  const CONTEXT = 256
  const schedule = (): ReadonlyArray<SeqPlan> => {
    const r = makeRng(67)
    const prompt = (n: number) => Array.from({ length: n }, () => 3 + Math.floor(r() * 397))
    return [
      { prompt: prompt(5), start: 0, steps: 36 },
      { prompt: prompt(20), start: 0, steps: 36 },
      { prompt: prompt(1), start: 0, steps: 30 },
      { prompt: prompt(40), start: 2, steps: 36 },
      { prompt: prompt(7), start: 3, steps: 20 },
      { prompt: prompt(60), start: 1, steps: 30, chunk: 24 }
    ]
  }
  it.live(
    `window ${WINDOW}, 1/2/3 stages (cuts after sliding and after global blocks): tokens equal lone runs`,
    () =>
      Effect.gen(function* () {
        const o = model("gptoss-batch", { seed: 63 })
        yield* writeSyntheticModel(o)
        const maxDiff = yield* Batch.batchedEqualsAlone(
          o.path,
          [
            [0, 4],
            [0, 2, 4],
            [0, 1, 3, 4]
          ],
          schedule(),
          CONTEXT
        )
        console.log(`gpt-oss batched vs alone: max logit difference ${maxDiff.toExponential(2)}`)
        assert.isBelow(maxDiff, 2e-2)
      }).pipe(Effect.provide(layerWith({ smallBatchRows: 8 }))),
    300_000
  )
})

describe("swactor synth --arch gpt-oss", () => {
  const cli = Command.run(Command.make("swactor").pipe(Command.withSubcommands([synthCommand])), {
    name: "swactor",
    version: "test"
  })
  const synth = (args: ReadonlyArray<string>) =>
    cli(["node", "swactor", "synth", ...args]).pipe(Effect.provide(NodeContext.layer), Effect.exit)

  it.live(
    "--experts 8 --experts-used 2 --type mxfp4: MXFP4 experts; node-llama-cpp loads it and our 2 stages give its tokens",
    () =>
      Effect.gen(function* () {
        const out = join(dir, "cli-gptoss.gguf")
        const exit = yield* synth([
          "--arch",
          "gpt-oss",
          "--layers",
          "4",
          "--hidden",
          "128",
          "--ffn",
          "64",
          "--heads",
          "4",
          "--kv-heads",
          "2",
          "--vocab",
          "400",
          "--context-length",
          "512",
          "--experts",
          "8",
          "--experts-used",
          "2",
          "--sliding-window",
          "8",
          "--type",
          "mxfp4",
          "-o",
          out
        ])
        assert.isTrue(Exit.isSuccess(exit))
        const file = yield* readGgufFile(out)
        assert.strictEqual(yield* getString(file, "general.architecture"), "gpt-oss")
        assert.strictEqual(yield* getU32(file, "gpt-oss.expert_count"), 8)
        assert.strictEqual(yield* getU32(file, "gpt-oss.expert_used_count"), 2)
        assert.strictEqual(yield* getU32(file, "gpt-oss.attention.sliding_window"), 8)
        assert.strictEqual(file.tensorsByName.get("blk.3.ffn_down_exps.weight")?.type, GgmlType.MXFP4)
        assert.strictEqual(file.tensorsByName.get("blk.3.attn_sinks.weight")?.type, GgmlType.F32)
        const ref = yield* reference(out, 40, false)
        assert.isAtLeast(new Set(ref.tokens).size, 4)
        const run = yield* greedyRun(out, [0, 2, 4], ref.prompt, 40, options)
        assert.deepStrictEqual(run.tokens, ref.tokens)
      }),
    120_000
  )

  it.live("--tied-output is refused (llama.cpp requires gpt-oss's output.weight) and nothing is written", () =>
    Effect.gen(function* () {
      const out = join(dir, "cli-gptoss-tied.gguf")
      const exit = yield* synth([
        "--arch",
        "gpt-oss",
        "--layers",
        "2",
        "--hidden",
        "64",
        "--ffn",
        "64",
        "--vocab",
        "300",
        "--tied-output",
        "-o",
        out
      ])
      assert.isTrue(Exit.isFailure(exit))
      assert.isFalse(existsSync(out))
    })
  )
})

describe("gpt-oss: bad files are typed errors naming the key or the tensor", () => {
  const base = model("gptoss-bad", { layers: 2, hidden: 64, ffn: 64 })
  const load = (path: string) =>
    Effect.gen(function* () {
      const executor = yield* StageExecutor
      return yield* Effect.exit(
        Effect.scoped(executor.load({ path, layerStart: 0, layerEndExclusive: 2, isFirst: true, isLast: true }))
      )
    }).pipe(Effect.provide(layerWith({ smallBatchRows: 0 })))
  const writeWith = (
    name: string,
    tweakMd: (md: Array<readonly [string, GgufTypedValue]>) => void,
    tweakTensors: (ts: Array<GgufTensorSpec>) => void = () => {}
  ) =>
    Effect.gen(function* () {
      const path = join(dir, `${name}.gguf`)
      const s = syntheticModelSpec({ ...base, path })
      const md = [...s.metadata]
      const ts = [...s.tensors]
      tweakMd(md)
      tweakTensors(ts)
      yield* writeGgufFile(path, { metadata: md, tensors: ts })
      return path
    })
  const drop = (md: Array<readonly [string, GgufTypedValue]>, key: string) => {
    const i = md.findIndex(([k]) => k === key)
    assert.isAtLeast(i, 0, `${key} was written`)
    md.splice(i, 1)
  }
  const set = (md: Array<readonly [string, GgufTypedValue]>, key: string, v: GgufTypedValue) => {
    const i = md.findIndex(([k]) => k === key)
    if (i >= 0) md.splice(i, 1)
    md.push([key, v])
  }
  const failure = (exit: Exit.Exit<unknown, ModelLoadError>) => {
    if (!Exit.isFailure(exit) || exit.cause._tag !== "Fail")
      return assert.fail(Exit.isSuccess(exit) ? "the load succeeded" : "the load died (not a typed failure)")
    assert.strictEqual(exit.cause.error._tag, "ModelLoadError")
    return exit.cause.error
  }
  const metadataCases: ReadonlyArray<readonly [string, string, GgufTypedValue | null]> = [
    ["no-window", "gpt-oss.attention.sliding_window", null],
    ["window-0", "gpt-oss.attention.sliding_window", GgufValues.u32(0)],
    ["pattern-array", "gpt-oss.attention.sliding_window_pattern", GgufValues.array(GgufValueType.UINT32, [2, 2])],
    ["swa-base-negative", "gpt-oss.rope.freq_base_swa", GgufValues.f32(-1)],
    ["no-expert-ffn", "gpt-oss.expert_feed_forward_length", null],
    ["used-9", "gpt-oss.expert_used_count", GgufValues.u32(9)],
    ["groups", "gpt-oss.expert_group_count", GgufValues.u32(2)]
  ]
  for (const [name, key, value] of metadataCases) {
    it.live(`${key} ${value === null ? "missing" : `= ${JSON.stringify(value.value)}`}: ModelLoadError naming it`, () =>
      Effect.gen(function* () {
        const path = yield* writeWith(name, (md) => (value === null ? drop(md, key) : set(md, key, value)))
        const e = failure(yield* load(path))
        assert.strictEqual(e.reason, "InvalidMetadata")
        assert.include(e.message, key)
      })
    )
  }
  const f32Tensor = (name: string, dims: ReadonlyArray<number>): GgufTensorSpec => ({
    name,
    type: GgmlType.F32,
    dims,
    data: function* () {
      yield new Uint8Array(4 * dims.reduce((a, b) => a * b, 1))
    }
  })
  const tensorCases: ReadonlyArray<readonly [string, string, string, (ts: Array<GgufTensorSpec>) => void]> = [
    [
      "no-sinks",
      "blk.1.attn_sinks.weight",
      "MissingTensor",
      (ts) =>
        void ts.splice(
          ts.findIndex((t) => t.name === "blk.1.attn_sinks.weight"),
          1
        )
    ],
    [
      "sinks-shape",
      "blk.0.attn_sinks.weight",
      "TensorShapeMismatch",
      (ts) => {
        ts[ts.findIndex((t) => t.name === "blk.0.attn_sinks.weight")] = f32Tensor("blk.0.attn_sinks.weight", [8])
      }
    ],
    [
      "exps-bias-shape",
      "blk.1.ffn_up_exps.bias",
      "TensorShapeMismatch",
      (ts) => {
        ts[ts.findIndex((t) => t.name === "blk.1.ffn_up_exps.bias")] = f32Tensor("blk.1.ffn_up_exps.bias", [64, 4])
      }
    ],
    [
      "no-output",
      "output.weight",
      "MissingTensor",
      (ts) =>
        void ts.splice(
          ts.findIndex((t) => t.name === "output.weight"),
          1
        )
    ]
  ]
  for (const [name, tensor, reason, tweak] of tensorCases) {
    it.live(`${name}: ModelLoadError ${reason} naming ${tensor}`, () =>
      Effect.gen(function* () {
        const path = yield* writeWith(name, () => {}, tweak)
        const e = failure(yield* load(path))
        assert.strictEqual(e.reason, reason)
        assert.include(e.message, tensor)
      })
    )
  }
})

describe("gpt-oss end to end: a killed stage agent resumes with identical text past the window", () => {
  // 3 stages + 1 spare on local agents, fixed ranges [0, 1) [1, 3) [3, 4): the middle stage holds global block 1 and
  // sliding block 2. Its agent is killed with SIGKILL at token 24, when prompt + generation have run past twice the
  // window; the spare takes the stage, the prompt and the 24 tokens are replayed in one prefill (the sliding block
  // masks all but the last 16 positions of it), and the stream goes on to the uninterrupted run's tokens and text.
  it.live(
    `mxfp4, window ${WINDOW}, kill -9 of the middle stage (a sliding and a global block) past the window: greedy output equals the uninterrupted run's`,
    () =>
      Effect.gen(function* () {
        const o = model("gptoss-e2e", { type: "mxfp4", seed: 62 })
        yield* writeSyntheticModel(o)
        const { reference, killedLayers } = yield* killedStageResumes(
          {
            model: o.path,
            prompt: PROMPT,
            maxTokens: 48,
            threads: 1,
            stages: 3,
            placement: {
              _tag: "Fixed",
              ranges: [
                [0, 1],
                [1, 3],
                [3, 4]
              ]
            }
          },
          { atToken: 24 }
        )
        assert.deepStrictEqual(killedLayers, [1, 3])
        assert.isAbove(reference.summary!.promptTokens + 24, 2 * WINDOW, "killed after the run passed twice the window")
      }),
    180_000
  )
})
