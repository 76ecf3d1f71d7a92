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
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { afterAll } from "vitest"
import { GgmlType } from "../src/domain/ggmlTypes.js"
import { GgufValueType, type ModelLoadError } from "../src/domain/gguf.js"
import { layerWith } from "../src/layers/engine/StageExecutorLive.js"
import { synthCommand } from "../src/cli/SynthCommand.js"
import { getString, getU32, readGgufFile } from "../src/layers/gguf/GgufReader.js"
import { GgufValues, type GgufTypedValue, writeGgufFile } from "../src/layers/gguf/GgufWriter.js"
import { type SyntheticModelOptions, syntheticModelSpec, writeSyntheticModel } from "../src/layers/gguf/Synthetic.js"
import { logSoftmax, makeRng } from "../src/services/Sampler.js"
import { StageExecutor } from "../src/services/StageExecutor.js"
import * as Batch from "./support/batch.js"
import type { SeqPlan } from "./support/batch.js"
import { allSplits, type EngineRun, greedyRun, maxLogProbDiff, referenceLlama } from "./support/engine.js"

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
const reference = (path: string, n: number, swaFullCache: boolean) =>
  Effect.promise(async () => {
    const llama = await referenceLlama()
    const m = await llama.loadModel({ modelPath: path, gpuLayers: 0 })
    try {
      const ctx = await m.createContext({
        contextSize: options.contextLength,
        threads: options.threads,
        flashAttention: true,
        sequences: 1,
        swaFullCache
      })
      try {
        const prompt = [...(m.tokens.bos !== null ? [m.tokens.bos] : []), ...m.tokenize(PROMPT)]
        const tokens: Array<number> = []
        const seq = ctx.getSequence()
        for await (const t of seq.evaluate(prompt, { temperature: 0 })) {
          tokens.push(t)
          if (tokens.length >= n) break
        }
        await seq.clearHistory()
        const res = await seq.controlledEvaluate([
          ...prompt.slice(0, -1),
          [prompt[prompt.length - 1]!, { generateNext: { probabilities: true } }]
        ])
        const probs = res[res.length - 1]?.next?.probabilities
        if (probs === undefined) throw new Error("node-llama-cpp returned no probabilities")
        return { prompt: prompt as ReadonlyArray<number>, tokens, firstProbabilities: new Map(probs) }
      } finally {
        await ctx.dispose()
      }
    } finally {
      await m.dispose()
    }
  })

/** Every split into 1..3 stages: tokens equal node-llama-cpp's (both caches), logits bit-identical across splits. */
const checkParity = (label: string, o: SyntheticModelOptions, maxLogProb: number) =>
  Effect.gen(function*() {
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
    let single: EngineRun | undefined
    let maxDiff = 0
    for (const split of splits) {
      const run = yield* greedyRun(o.path, split, ref.prompt, N_TOKENS, options)
      assert.deepStrictEqual(run.tokens, ref.tokens, `split ${JSON.stringify(split)}`)
      maxDiff = Math.max(maxDiff, maxLogProbDiff(logSoftmax(run.logits[0]!), ref.firstProbabilities))
      if (single === undefined) single = run
      else run.logits.forEach((l, i) => assert.isTrue(Batch.sameBits(l, single!.logits[i]!), `split ${split} position ${i}`))
    }
    console.log(
      `${label}: ${splits.length} splits x ${N_TOKENS} tokens after a ${ref.prompt.length}-token prompt equal ` +
        `node-llama-cpp's (capped and full SWA cache); first-position log-prob max diff ${maxDiff.toExponential(2)}`
    )
    assert.isBelow(maxDiff, maxLogProb)
    return ref.tokens
  })

describe("gpt-oss: every split into 1-3 stages matches node-llama-cpp past the sliding window", () => {
  it.live(`f32, window ${WINDOW}, YaRN: greedy ${N_TOKENS} tokens of all 7 splits equal node-llama-cpp's`, () =>
    Effect.gen(function*() {
      const o = model("gptoss-f32")
      const tokens = yield* checkParity("gpt-oss f32", o, 1e-4)
      // the same weights with the window past the context, and without YaRN: node-llama-cpp's tokens change
      for (const [name, extra] of [["wide", { slidingWindow: 4096 }], ["no-yarn", { yarnFactor: 0 }]] as const) {
        const other = model(`gptoss-${name}`, extra)
        yield* writeSyntheticModel(other)
        const ref = yield* reference(other.path, N_TOKENS, false)
        assert.notDeepEqual(ref.tokens, tokens, `${name} changes node-llama-cpp's tokens`)
      }
    }), 300_000)

  it.live(`mxfp4 experts, q8_0 rest: greedy ${N_TOKENS} tokens of all 7 splits equal node-llama-cpp's`, () =>
    Effect.gen(function*() {
      const o = model("gptoss-mxfp4", { type: "mxfp4", seed: 62 })
      const spec = syntheticModelSpec(o)
      const typeOf = (name: string) => spec.tensors.find((t) => t.name === name)?.type
      assert.strictEqual(typeOf("blk.0.ffn_up_exps.weight"), GgmlType.MXFP4)
      assert.strictEqual(typeOf("blk.0.attn_q.weight"), GgmlType.Q8_0)
      assert.strictEqual(typeOf("blk.0.ffn_gate_inp.weight"), GgmlType.F32)
      assert.strictEqual(typeOf("blk.0.ffn_down_exps.bias"), GgmlType.F32)
      yield* checkParity("gpt-oss mxfp4", o, 1e-3)
    }), 300_000)
})
