/**
 * Mixture of experts (qwen3moe: Moe.ts, archs/qwen3moe.ts, SyntheticMoe.ts) on synthetic files of the real structure
 * at small size (4 blocks, hidden 256, 8 experts of 128, 2 used):
 * - every split into 1, 2 and 3 stages gives node-llama-cpp's greedy tokens (the oracle runs the same file);
 * - several sequences with different prompts in one batch (routing differs per row) equal the same sequences alone;
 * - a bad file (expert count disagreeing with the tensors, more experts used than exist) is a typed ModelLoadError
 *   naming the key or tensor, before ggml sees anything.
 */
import { assert, describe, it } from "@effect/vitest"
import { Effect, Exit } from "effect"
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { afterAll } from "vitest"
import { GgufValues, writeGgufFile } from "../../src/layers/gguf/GgufWriter.js"
import { layerWith } from "../../src/layers/engine/StageExecutorLive.js"
import {
  type SyntheticModelOptions,
  syntheticModelSpec,
  type SyntheticType,
  writeSyntheticModel
} from "../../src/layers/gguf/Synthetic.js"
import { makeRng } from "../../src/services/Sampler.js"
import { StageExecutor } from "../../src/services/StageExecutor.js"
import { getU32, readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { readModelFacts, readModelLayout } from "../../src/layers/gguf/ModelCatalogLive.js"
import * as Command from "@effect/cli/Command"
import * as NodeContext from "@effect/platform-node/NodeContext"
import { synthCommand } from "../../src/cli/SynthCommand.js"
import * as Batch from "../support/batch.js"
import type { SeqPlan } from "../support/batch.js"
import { allSplits, greedyRun, nodeLlamaReference, splitsMatchReference } from "../support/engine.js"
import { killedStageResumes } from "../support/resume.js"

const N_TOKENS = 24
const LAYERS = 4
const CONTEXT = 512
const options = { threads: 1, contextLength: CONTEXT } as const
const dir = mkdtempSync(join(tmpdir(), "swactor-moe-"))
afterAll(() => rmSync(dir, { recursive: true, force: true }))

const moeShape = (type: SyntheticType, extra: Partial<SyntheticModelOptions> = {}): SyntheticModelOptions => ({
  path: join(dir, `qwen3moe-${type}-${extra.expertsUsed ?? 2}.gguf`),
  arch: "qwen3moe",
  layers: LAYERS,
  hidden: 256,
  ffn: 512,
  heads: 4,
  kvHeads: 2,
  vocab: 400,
  contextLength: CONTEXT,
  type,
  seed: 7,
  experts: 8,
  expertsUsed: 2,
  expertFfn: 128,
  ...extra
})

/** node-llama-cpp's greedy tokens on `path`, then every split into 1-3 stages: same tokens, splits bit-identical. */
const checkParity = (label: string, path: string, exact = true) =>
  Effect.gen(function* () {
    const ref = yield* nodeLlamaReference(path, "Once upon a time", N_TOKENS, options)
    assert.isAtLeast(new Set(ref.tokens).size, 4, `reference stream ${ref.tokens}`)
    const splits = allSplits(LAYERS, 3)
    const maxDiff = yield* splitsMatchReference(path, ref, splits, options)
    console.log(
      `${label}: ${splits.length} splits x ${N_TOKENS} tokens equal node-llama-cpp; ` +
        `first-position log-prob max diff ${maxDiff.toExponential(2)}`
    )
    if (exact) assert.isBelow(maxDiff, 1e-4)
  })

describe("qwen3moe: every split into 1, 2 and 3 stages gives node-llama-cpp's greedy tokens", () => {
  const cases = [
    ["f32", 2, true],
    ["q8_0", 2, true],
    ["f32", 1, true],
    ["f32", 8, true]
  ] as const
  for (const [type, used, exact] of cases) {
    it.live(
      `qwen3moe ${type}, 8 experts, ${used} used: ${N_TOKENS} greedy tokens at every split equal node-llama-cpp's` +
        (exact ? ", log-probs within 1e-4" : ""),
      () =>
        Effect.gen(function* () {
          const o = moeShape(type, { expertsUsed: used })
          yield* writeSyntheticModel(o)
          yield* checkParity(`qwen3moe ${type} ${used}/8`, o.path, exact)
        }),
      180_000
    )
  }
})

/** 6 sequences, different prompts (each row routes to its own experts), joins, early finishes, a chunked prefill. */
const schedule = (vocab: number): ReadonlyArray<SeqPlan> => {
  const r = makeRng(91)
  const prompt = (n: number) => Array.from({ length: n }, () => 3 + Math.floor(r() * (vocab - 3)))
  return [
    { prompt: prompt(5), start: 0, steps: 20 },
    { prompt: prompt(11), start: 0, steps: 20 },
    { prompt: prompt(1), start: 0, steps: 14 },
    { prompt: prompt(17), start: 2, steps: 20 },
    { prompt: prompt(7), start: 4, steps: 10 },
    { prompt: prompt(40), start: 1, steps: 20, chunk: 16 }
  ]
}

describe("glm4moe: every split into 1, 2 and 3 stages gives node-llama-cpp's greedy tokens", () => {
  // 4 blocks: block 0 dense, blocks 1-3 routed (sigmoid gate, expert bias exp_probs_b, weights normalised and scaled
  // by 2.5, one shared expert), q/k/v biases, post_attention_norm: GLM-4.5's structure at small size.
  for (const type of ["f32", "q8_0"] as const) {
    it.live(
      `glm4moe ${type}, 1 dense + 3 routed blocks, 8 experts, 2 used, 1 shared: ${N_TOKENS} greedy tokens at every split equal node-llama-cpp's, log-probs within 1e-4`,
      () =>
        Effect.gen(function* () {
          const o = moeShape(type, { arch: "glm4moe", path: join(dir, `glm4moe-${type}.gguf`) })
          yield* writeSyntheticModel(o)
          // partial rotary as GLM-4.5/4.6's converter writes it: half the head
          const file = yield* readGgufFile(o.path)
          const head =
            (yield* getU32(file, "glm4moe.embedding_length")) / (yield* getU32(file, "glm4moe.attention.head_count"))
          assert.strictEqual(yield* getU32(file, "glm4moe.rope.dimension_count"), head / 2)
          yield* checkParity(`glm4moe ${type}`, o.path)
        }),
      180_000
    )
  }
})

describe("glm4moe with an MTP block (nextn_predict_layers 1, as GLM-4.5/4.6 files): decoded by the trunk alone", () => {
  // block_count 5: blocks 0-3 the trunk, block 4 a whole routed block plus nextn.eh_proj / enorm / hnorm /
  // shared_head_norm. llama.cpp (node-llama-cpp) decodes with the 4 trunk blocks; so must every split of them.
  it.live(
    `glm4moe q8_0, 4 trunk blocks + 1 MTP block: ${N_TOKENS} greedy tokens at every split into 1-3 stages equal node-llama-cpp's; the MTP block is never placed nor counted`,
    () =>
      Effect.gen(function* () {
        const o = moeShape("q8_0", { arch: "glm4moe", path: join(dir, "glm4moe-nextn.gguf"), nextnLayers: 1 })
        yield* writeSyntheticModel(o)
        const file = yield* readGgufFile(o.path)
        assert.strictEqual(file.metadata.get("glm4moe.block_count"), 5)
        const mtp = file.tensors.filter((t) => t.name.startsWith("blk.4."))
        assert.includeMembers(
          mtp.map((t) => t.name),
          ["blk.4.nextn.eh_proj.weight", "blk.4.ffn_gate_exps.weight", "blk.4.attn_q.weight"]
        )
        // planning sees the trunk: 4 blocks, none of block 4's bytes
        assert.strictEqual((yield* readModelFacts(o.path)).numLayers, LAYERS)
        assert.strictEqual((yield* readModelLayout(o.path)).blockBytes.length, LAYERS)
        // one stage over the trunk loads every tensor of the file but block 4's
        const weightBytes = yield* Effect.scoped(
          Effect.gen(function* () {
            const stage = yield* (yield* StageExecutor).load({
              path: o.path,
              layerStart: 0,
              layerEndExclusive: LAYERS,
              isFirst: true,
              isLast: true
            })
            assert.strictEqual(stage.info.numLayers, LAYERS)
            return stage.info.weightBytes
          })
        ).pipe(Effect.provide(layerWith({})))
        const sum = (ts: ReadonlyArray<{ readonly byteSize: number }>) => ts.reduce((a, t) => a + t.byteSize, 0)
        assert.strictEqual(weightBytes, sum(file.tensors) - sum(mtp))
        yield* checkParity("glm4moe q8_0 + MTP block", o.path)
      }),
    180_000
  )

  it.live(
    "swactor synth --nextn-layers 1 writes the MTP block after the --layers trunk; refused for other architectures",
    () =>
      Effect.gen(function* () {
        const cli = Command.run(Command.make("swactor").pipe(Command.withSubcommands([synthCommand])), {
          name: "swactor",
          version: "test"
        })
        const args = (arch: string, out: string) => [
          "node",
          "swactor",
          "synth",
          "--arch",
          arch,
          "--layers",
          "3",
          "--hidden",
          "64",
          "--ffn",
          "128",
          "--heads",
          "2",
          "--kv-heads",
          "1",
          "--vocab",
          "300",
          "--experts",
          "4",
          "--experts-used",
          "2",
          "--nextn-layers",
          "1",
          "-o",
          out
        ]
        const out = join(dir, "cli-nextn.gguf")
        const exit = yield* cli(args("glm4moe", out)).pipe(Effect.provide(NodeContext.layer), Effect.exit)
        assert.isTrue(Exit.isSuccess(exit), String(exit))
        const file = yield* readGgufFile(out)
        assert.strictEqual(file.metadata.get("glm4moe.block_count"), 4)
        assert.strictEqual(file.metadata.get("glm4moe.nextn_predict_layers"), 1)
        assert.isTrue(file.tensorsByName.has("blk.3.nextn.eh_proj.weight"))
        assert.isFalse(file.tensorsByName.has("blk.2.nextn.eh_proj.weight"))
        assert.strictEqual((yield* readModelFacts(out)).numLayers, 3)
        const refused = yield* cli(args("qwen3moe", join(dir, "cli-nextn-qwen3moe.gguf"))).pipe(
          Effect.provide(NodeContext.layer),
          Effect.exit
        )
        assert.isTrue(Exit.isFailure(refused))
        assert.include(String(refused), "--nextn-layers (MTP blocks) is for glm4moe, qwen35, qwen35moe only")
      })
  )
})

describe("qwen3moe: a deep model with every expert used builds its graph", () => {
  // 40 blocks, 64 of 64 experts used: each routed block adds a view and an add per expert to the graph. With the node
  // budget of a dense block, ggml's context ran out of room and aborted the process (GGML_ASSERT(obj_new)). No
  // node-llama-cpp oracle here: llama.cpp's own graph budget (8 nodes per model tensor) aborts at this shape too.
  it.live(
    "40 blocks, 64 of 64 experts used: 1 and 2 stages run, bit-identical logits",
    () =>
      Effect.gen(function* () {
        const o = moeShape("q8_0", {
          path: join(dir, "deep-64.gguf"),
          layers: 40,
          hidden: 64,
          ffn: 64,
          heads: 2,
          kvHeads: 1,
          experts: 64,
          expertsUsed: 64,
          expertFfn: 32
        })
        yield* writeSyntheticModel(o)
        const one = yield* greedyRun(o.path, [0, 40], [1, 5, 9, 13], 8, options)
        const two = yield* greedyRun(o.path, [0, 17, 40], [1, 5, 9, 13], 8, options)
        assert.deepStrictEqual(two.tokens, one.tokens)
        one.logits.forEach((l, i) => assert.isTrue(Batch.sameBits(l, two.logits[i]!), `position ${i}`))
      }),
    180_000
  )
})

describe("glm4moe with group-limited routing gives node-llama-cpp's greedy tokens at every split", () => {
  // expert_group_count 4 (groups of 4 of 16 experts), expert_group_used_count 2, 4 experts used: each token chooses
  // among the experts of its 2 best groups (a group's score: the sum of its two best selection scores).
  it.live(
    `glm4moe f32, 16 experts in 4 groups, 2 groups and 4 experts used: ${N_TOKENS} greedy tokens at every split equal node-llama-cpp's, log-probs within 1e-4`,
    () =>
      Effect.gen(function* () {
        const o = moeShape("f32", {
          arch: "glm4moe",
          path: join(dir, "glm4moe-groups.gguf"),
          experts: 16,
          expertsUsed: 4,
          expertGroups: { count: 4, used: 2 }
        })
        yield* writeSyntheticModel(o)
        yield* checkParity("glm4moe f32 groups 2/4", o.path)
      }),
    180_000
  )
})

describe("qwen3moe, glm4moe: sequences batched together equal the same sequences alone", () => {
  // Forced routes (production measures, SmallBatch.ts): 0 = ggml's products (tinyBLAS for 2+ rows), 8 = the few-row
  // route for the 2-D products. The expert products are ggml_mul_mat_id either way (one-row kernel per row and expert).
  // q8_0: every product sums the same int8 blocks whatever the rows, and the F32 router gives the same bits here
  // too: the logits are bit-identical. f32: ggml's f32 products take another kernel for one row than for several.
  const cases = [
    ["qwen3moe", "q8_0", 0],
    ["qwen3moe", "q8_0", 8],
    ["qwen3moe", "f32", 8],
    ["glm4moe", "q8_0", 8]
  ] as const
  for (const [arch, type, rows] of cases) {
    it.live(
      `${arch} ${type}: 6 sequences, 1/2/3 stages, joins, early finishes, chunked prefill: ` +
        `${type === "q8_0" ? "bit-identical logits" : "tokens equal lone runs"} (route ${rows})`,
      () =>
        Effect.gen(function* () {
          const o = moeShape(type, { arch, path: join(dir, `batch-${arch}-${type}.gguf`) })
          yield* writeSyntheticModel(o)
          const splits = [
            [0, 4],
            [0, 2, 4],
            [0, 1, 3, 4]
          ]
          const maxDiff = yield* Batch.batchedEqualsAlone(o.path, splits, schedule(o.vocab), CONTEXT, {
            bitIdentical: type === "q8_0"
          })
          console.log(
            `${arch} ${type} route ${rows}: batched vs alone max logit difference ${maxDiff.toExponential(2)}`
          )
        }).pipe(Effect.provide(layerWith({ smallBatchRows: rows }))),
      180_000
    )
  }
})

/** Writes the qwen3moe model with one fact tweaked and tries to load a stage of it. */
const loadTweaked = (
  name: string,
  tweak: (md: Array<readonly [string, ReturnType<typeof GgufValues.u32>]>) => void,
  arch: SyntheticModelOptions["arch"] = "qwen3moe"
) =>
  Effect.gen(function* () {
    const path = join(dir, `bad-${name}.gguf`)
    const s = syntheticModelSpec(moeShape("f32", { arch, path, layers: 2 }))
    const md = [...s.metadata]
    tweak(md)
    yield* writeGgufFile(path, { metadata: md, tensors: s.tensors })
    const executor = yield* StageExecutor
    const exit = yield* Effect.exit(
      Effect.scoped(executor.load({ path, layerStart: 1, layerEndExclusive: 2, isFirst: false, isLast: true }))
    )
    if (Exit.isSuccess(exit)) return { reason: "loaded", message: "" }
    const e = exit.cause._tag === "Fail" ? exit.cause.error : undefined
    return { reason: e?.reason ?? "defect", message: e?.message ?? String(exit.cause) }
  }).pipe(Effect.provide(layerWith({ smallBatchRows: 0 })))

const setKey =
  (key: string, value: ReturnType<typeof GgufValues.u32> | null) =>
  (md: Array<readonly [string, ReturnType<typeof GgufValues.u32>]>) => {
    const i = md.findIndex(([k]) => k === key)
    if (i < 0) md.push([key, value!])
    else if (value === null) md.splice(i, 1)
    else md[i] = [key, value]
  }

describe("qwen3moe, glm4moe: a bad file is a typed error naming the key or tensor, never an abort", () => {
  it.live("expert_count disagreeing with the tensors: TensorShapeMismatch naming the key and the tensor", () =>
    Effect.gen(function* () {
      const fewer = yield* loadTweaked("count4", setKey("qwen3moe.expert_count", GgufValues.u32(4)))
      assert.strictEqual(fewer.reason, "TensorShapeMismatch")
      assert.include(fewer.message, "qwen3moe.expert_count")
      assert.include(fewer.message, "blk.0.ffn_gate_inp.weight")
      const more = yield* loadTweaked("count16", setKey("qwen3moe.expert_count", GgufValues.u32(16)))
      assert.strictEqual(more.reason, "TensorShapeMismatch")
      assert.include(more.message, "qwen3moe.expert_count")
    })
  )

  it.live("expert_used_count > expert_count, missing or zero counts: InvalidMetadata naming the key", () =>
    Effect.gen(function* () {
      const over = yield* loadTweaked("used9", setKey("qwen3moe.expert_used_count", GgufValues.u32(9)))
      assert.strictEqual(over.reason, "InvalidMetadata")
      assert.include(over.message, "qwen3moe.expert_used_count")
      assert.include(over.message, "qwen3moe.expert_count")
      const missing = yield* loadTweaked("nocount", setKey("qwen3moe.expert_count", null))
      assert.strictEqual(missing.reason, "InvalidMetadata")
      assert.include(missing.message, "qwen3moe.expert_count")
      const zero = yield* loadTweaked("used0", setKey("qwen3moe.expert_used_count", GgufValues.u32(0)))
      assert.strictEqual(zero.reason, "InvalidMetadata")
      assert.include(zero.message, "qwen3moe.expert_used_count")
      const huge = yield* loadTweaked("count2000", setKey("qwen3moe.expert_count", GgufValues.u32(2000)))
      assert.strictEqual(huge.reason, "InvalidMetadata")
      assert.include(huge.message, "qwen3moe.expert_count")
    })
  )

  it.live(
    "glm4moe: MTP layers leaving no trunk, an unknown gating function, bad expert groups, no shared-expert count: InvalidMetadata naming the key",
    () =>
      Effect.gen(function* () {
        // 2 blocks, both MTP: no trunk left
        const mtp = yield* loadTweaked(
          "glm-nextn",
          setKey("glm4moe.nextn_predict_layers", GgufValues.u32(2)),
          "glm4moe"
        )
        assert.strictEqual(mtp.reason, "InvalidMetadata")
        assert.include(mtp.message, "glm4moe.nextn_predict_layers")
        const gating = yield* loadTweaked(
          "glm-gating",
          setKey("glm4moe.expert_gating_func", GgufValues.u32(5)),
          "glm4moe"
        )
        assert.strictEqual(gating.reason, "InvalidMetadata")
        assert.include(gating.message, "glm4moe.expert_gating_func")
        const shared = yield* loadTweaked("glm-shared", setKey("glm4moe.expert_shared_count", null), "glm4moe")
        assert.strictEqual(shared.reason, "InvalidMetadata")
        assert.include(shared.message, "glm4moe.expert_shared_count")
        const groups = yield* loadTweaked(
          "glm-groups3",
          (md) => {
            setKey("glm4moe.expert_group_count", GgufValues.u32(3))(md)
            setKey("glm4moe.expert_group_used_count", GgufValues.u32(1))(md)
          },
          "glm4moe"
        )
        assert.strictEqual(groups.reason, "InvalidMetadata")
        assert.include(groups.message, "glm4moe.expert_group_count")
        const groupsUsed = yield* loadTweaked(
          "glm-groups-used",
          (md) => {
            setKey("glm4moe.expert_group_count", GgufValues.u32(4))(md)
            setKey("glm4moe.expert_group_used_count", GgufValues.u32(4))(md)
          },
          "glm4moe"
        )
        assert.strictEqual(groupsUsed.reason, "InvalidMetadata")
        assert.include(groupsUsed.message, "glm4moe.expert_group_used_count")
        const used = yield* loadTweaked("glm-used", setKey("glm4moe.expert_used_count", GgufValues.u32(9)), "glm4moe")
        assert.strictEqual(used.reason, "InvalidMetadata")
        assert.include(used.message, "glm4moe.expert_used_count")
      })
  )

  it.live("an expert tensor of the wrong shape: TensorShapeMismatch naming the tensor", () =>
    Effect.gen(function* () {
      const ffn = yield* loadTweaked("expffn", setKey("qwen3moe.expert_feed_forward_length", GgufValues.u32(64)))
      assert.strictEqual(ffn.reason, "TensorShapeMismatch")
      assert.include(ffn.message, "blk.1.ffn_gate_exps.weight")
    })
  )
})

describe("qwen3moe, glm4moe end to end: a killed stage agent resumes with identical text", () => {
  // 3 stages + 1 spare on local agents; the middle stage's agent is killed with SIGKILL at token 12: the spare takes
  // its stage, the prompt and the tokens so far are replayed (one prefill per stage, routing each row again), and the
  // stream goes on to the uninterrupted run's tokens and text.
  for (const arch of ["qwen3moe", "glm4moe"] as const) {
    it.live(
      `${arch}: kill -9 of the middle stage with a spare: greedy output equals the uninterrupted run's`,
      () =>
        Effect.gen(function* () {
          const o = moeShape("q8_0", { arch, path: join(dir, `e2e-${arch}-q8_0.gguf`) })
          yield* writeSyntheticModel(o)
          yield* killedStageResumes(
            { model: o.path, prompt: "Once upon a time", maxTokens: 48, threads: 1, stages: 3 },
            { atToken: 12 }
          )
        }),
      180_000
    )
  }
})
