/**
 * qwen35 and qwen35moe files with an MTP ("NextN") block (issue 21), as current llama.cpp converters write Qwen3.5/3.6:
 * `<arch>.nextn_predict_layers` = 1 and one block after the trunk, counted in `block_count`: a full-attention block
 * (whatever `full_attention_interval` says; llama.cpp marks it non-recurrent) with the block's feed-forward, plus
 * nextn.eh_proj / enorm / hnorm / shared_head_norm (SyntheticQwen35.ts, SyntheticNextn.ts).
 * - llama.cpp (node-llama-cpp) decodes with the trunk only; so does every split of the trunk into 1-3 stages;
 * - planning, placement, the server's admission and every stage's slice and loaded weights cover the trunk only;
 * - a `nextn_predict_layers` leaving no trunk is a typed ModelLoadError naming the key;
 * - `swactor synth --nextn-layers 1` writes such a file for qwen35 and qwen35moe, which node-llama-cpp loads (its
 *   loader checks the MTP block's tensors and their shapes even when it skips them).
 */
import { assert, describe, it } from "@effect/vitest"
import { Effect, Exit } from "effect"
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { afterAll } from "vitest"
import type { ModelLoadError } from "../../src/domain/gguf.js"
import { layerWith } from "../../src/layers/engine/StageExecutorLive.js"
import { getU32, readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { sliceTensors } from "../../src/layers/gguf/GgufSlice.js"
import { GgufValues, writeGgufFile } from "../../src/layers/gguf/GgufWriter.js"
import { readModelFacts, readModelLayout } from "../../src/layers/gguf/ModelCatalogLive.js"
import { type SyntheticModelOptions, syntheticModelSpec, writeSyntheticModel } from "../../src/layers/gguf/Synthetic.js"
import { StageExecutor } from "../../src/services/StageExecutor.js"
import { allSplits, nodeLlamaReference, splitsMatchReference } from "../support/engine.js"
import { runSynthCli } from "../support/synthCli.js"

const N_TOKENS = 32
const LAYERS = 4
const CONTEXT = 512
const options = { threads: 1, contextLength: CONTEXT } as const
const PROMPT = "Once upon a time there was a little girl who lived in a village near the forest"
const dir = mkdtempSync(join(tmpdir(), "swactor-engine-qwen35-nextn-"))
afterAll(() => rmSync(dir, { recursive: true, force: true }))

const shapes = {
  qwen35: { arch: "qwen35", seed: 35 },
  qwen35moe: { arch: "qwen35moe", seed: 351, experts: 8, expertsUsed: 2, expertFfn: 128, sharedExperts: 2 }
} as const

/** 4 trunk blocks (DeltaNet 0-2, attention 3) and 1 MTP block (block 4), f32. */
const model = (arch: keyof typeof shapes, name: string, extra: Partial<SyntheticModelOptions> = {}) =>
  ({
    path: join(dir, `${arch}-${name}.gguf`),
    layers: LAYERS,
    hidden: 256,
    ffn: 512,
    heads: 4,
    kvHeads: 2,
    headDim: 64,
    vocab: 400,
    contextLength: CONTEXT,
    type: "f32",
    nextnLayers: 1,
    ...shapes[arch],
    ...extra
  }) satisfies SyntheticModelOptions

const NEXTN = ["nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight", "nextn.shared_head_norm.weight"]
const ATTENTION = [
  "attn_norm.weight",
  "post_attention_norm.weight",
  "attn_q.weight",
  "attn_k.weight",
  "attn_v.weight",
  "attn_q_norm.weight",
  "attn_k_norm.weight",
  "attn_output.weight"
]
const FFN = {
  qwen35: ["ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"],
  qwen35moe: [
    "ffn_gate_inp.weight",
    "ffn_gate_exps.weight",
    "ffn_up_exps.weight",
    "ffn_down_exps.weight",
    "ffn_gate_inp_shexp.weight",
    "ffn_gate_shexp.weight",
    "ffn_up_shexp.weight",
    "ffn_down_shexp.weight"
  ]
} as const

const sum = (ts: ReadonlyArray<{ readonly byteSize: number }>) => ts.reduce((a, t) => a + t.byteSize, 0)

/**
 * The trunk-only view of a file with an MTP block 4: planning's facts and layout, the server's admission, and for
 * each stage of `splits` its slice and the weights it loads (none of block 4's).
 */
const trunkOnly = (path: string, splits: ReadonlyArray<ReadonlyArray<number>>) =>
  Effect.gen(function* () {
    const file = yield* readGgufFile(path)
    const mtp = file.tensors.filter((t) => t.name.startsWith(`blk.${LAYERS}.`))
    assert.isAbove(mtp.length, 0)
    assert.strictEqual((yield* readModelFacts(path)).numLayers, LAYERS)
    const layout = yield* readModelLayout(path)
    assert.strictEqual(layout.blockBytes.length, LAYERS)
    assert.strictEqual(layout.stateBytes?.length, LAYERS)
    // the server's admission: the trunk's DeltaNet pattern, no block for the MTP block
    assert.deepStrictEqual(
      layout.stateBytes?.map((b) => b > 0),
      [true, true, true, false]
    )
    const executor = yield* StageExecutor
    for (const split of splits) {
      let total = 0
      for (let s = 0; s + 1 < split.length; s++) {
        const range = { layerStart: split[s]!, layerEndExclusive: split[s + 1]!, numLayers: LAYERS }
        const slice = sliceTensors(file, range)
        assert.isFalse(
          slice.some((t) => t.name.startsWith(`blk.${LAYERS}.`)),
          `split ${split} stage ${s}: the slice holds no MTP tensor`
        )
        const info = yield* Effect.scoped(
          Effect.map(
            executor.load({
              path,
              layerStart: range.layerStart,
              layerEndExclusive: range.layerEndExclusive,
              isFirst: s === 0,
              isLast: s + 2 === split.length
            }),
            (stage) => stage.info
          )
        )
        assert.strictEqual(info.numLayers, LAYERS)
        assert.strictEqual(info.weightBytes, sum(slice), `split ${split} stage ${s}: loads its slice`)
        total += info.weightBytes
      }
      // every tensor of the file is loaded once across the stages, but the MTP block's (no tied output here)
      assert.strictEqual(total, sum(file.tensors) - sum(mtp), `split ${split}`)
    }
  })

describe("qwen35 with an MTP block (nextn_predict_layers 1): decoded by the trunk alone", () => {
  for (const arch of ["qwen35", "qwen35moe"] as const) {
    it(`${arch}: synth writes block 4 as Qwen3.5's converter does: full attention, the feed-forward, nextn.*`, () => {
      const s = syntheticModelSpec(model(arch, "plan"))
      const byName = new Map(s.tensors.map((t) => [t.name, t]))
      const blk4 = s.tensors.filter((t) => t.name.startsWith("blk.4.")).map((t) => t.name.slice("blk.4.".length))
      // (4 + 1) % 4 !== 0: by the interval block 4 would be DeltaNet; llama.cpp loads an MTP block as attention
      assert.sameMembers(blk4, [...ATTENTION, ...FFN[arch], ...NEXTN])
      assert.deepStrictEqual(byName.get("blk.4.nextn.eh_proj.weight")!.dims, [512, 256])
      assert.deepStrictEqual(byName.get("blk.4.attn_q.weight")!.dims, [256, 2 * 4 * 64])
      const md = new Map(s.metadata)
      assert.strictEqual(md.get(`${arch}.block_count`)!.value, 5)
      assert.strictEqual(md.get(`${arch}.nextn_predict_layers`)!.value, 1)
      // the trunk is unchanged: blocks 0-2 DeltaNet, 3 attention, and no nextn.* tensor in it
      for (let i = 0; i < LAYERS; i++) {
        assert.strictEqual(byName.has(`blk.${i}.ssm_conv1d.weight`), i !== 3, `block ${i}`)
        assert.isFalse(byName.has(`blk.${i}.nextn.eh_proj.weight`), `block ${i}`)
      }
    })
  }

  it.live(
    `qwen35 f32, 4 trunk blocks + 1 MTP block: greedy ${N_TOKENS} tokens of all 7 splits into 1-3 stages equal node-llama-cpp's; no stage holds an MTP tensor`,
    () =>
      Effect.gen(function* () {
        const o = model("qwen35", "parity")
        yield* writeSyntheticModel(o)
        const ref = yield* nodeLlamaReference(o.path, PROMPT, N_TOKENS, options)
        assert.isAtLeast(new Set(ref.tokens).size, 4, `reference stream ${ref.tokens}`)
        const splits = allSplits(LAYERS, 3)
        assert.strictEqual(splits.length, 7)
        const maxDiff = yield* splitsMatchReference(o.path, ref, splits, options, { bitIdentical: false })
        console.log(`qwen35 + MTP: ${splits.length} splits x ${N_TOKENS} tokens; first log-prob max diff ${maxDiff}`)
        assert.isBelow(maxDiff, 1e-4)
        yield* trunkOnly(o.path, [
          [0, 4],
          [0, 3, 4],
          [0, 1, 3, 4]
        ])
      }).pipe(Effect.provide(layerWith({ smallBatchRows: 0 }))),
    300_000
  )

  it.live(
    `qwen35moe f32, 4 trunk blocks + 1 MTP block: greedy ${N_TOKENS} tokens at 1, 2 and 3 stages equal node-llama-cpp's; no stage holds an MTP tensor`,
    () =>
      Effect.gen(function* () {
        const o = model("qwen35moe", "parity")
        yield* writeSyntheticModel(o)
        const ref = yield* nodeLlamaReference(o.path, PROMPT, N_TOKENS, options)
        assert.isAtLeast(new Set(ref.tokens).size, 4, `reference stream ${ref.tokens}`)
        const splits = [
          [0, 4],
          [0, 3, 4],
          [0, 2, 4],
          [0, 1, 3, 4]
        ]
        const maxDiff = yield* splitsMatchReference(o.path, ref, splits, options)
        console.log(`qwen35moe + MTP: ${splits.length} splits x ${N_TOKENS} tokens; first log-prob max diff ${maxDiff}`)
        assert.isBelow(maxDiff, 1e-4)
        yield* trunkOnly(o.path, [
          [0, 4],
          [0, 2, 4]
        ])
      }).pipe(Effect.provide(layerWith({ smallBatchRows: 0 }))),
    300_000
  )

  for (const arch of ["qwen35", "qwen35moe"] as const) {
    it.live(`${arch}: nextn_predict_layers leaving no trunk block is a ModelLoadError naming the key`, () =>
      Effect.gen(function* () {
        const o = model(arch, "no-trunk")
        const s = syntheticModelSpec(o)
        const key = `${arch}.nextn_predict_layers`
        const md = [...s.metadata.filter(([k]) => k !== key), [key, GgufValues.u32(5)] as const]
        yield* writeGgufFile(o.path, { metadata: md, tensors: s.tensors })
        const executor = yield* StageExecutor
        const exit: Exit.Exit<unknown, ModelLoadError> = yield* Effect.exit(
          Effect.scoped(
            executor.load({ path: o.path, layerStart: 0, layerEndExclusive: 4, isFirst: true, isLast: true })
          )
        )
        assert.isTrue(Exit.isFailure(exit) && exit.cause._tag === "Fail", `a typed failure: ${String(exit)}`)
        if (Exit.isFailure(exit) && exit.cause._tag === "Fail") {
          assert.strictEqual(exit.cause.error._tag, "ModelLoadError")
          assert.include(exit.cause.error.message, key)
          assert.include(exit.cause.error.message, "leaves no trunk blocks")
        }
      }).pipe(Effect.provide(layerWith({ smallBatchRows: 0 })))
    )
  }
})

describe("swactor synth --arch qwen35 --nextn-layers 1", () => {
  const common = ["--layers", "4", "--hidden", "256", "--ffn", "512", "--heads", "4", "--kv-heads", "2"]
  const rest = ["--head-dim", "64", "--vocab", "400", "--context-length", "512", "--nextn-layers", "1"]
  const moe = ["--experts", "8", "--experts-used", "2", "--expert-ffn", "128", "--shared-experts", "2"]
  for (const arch of ["qwen35", "qwen35moe"] as const) {
    it.live(
      `${arch}: writes the MTP block after the 4 trunk blocks; node-llama-cpp loads it and generates from the trunk`,
      () =>
        Effect.gen(function* () {
          const out = join(dir, `cli-${arch}-nextn.gguf`)
          const exit = yield* runSynthCli([
            "--arch",
            arch,
            ...common,
            ...rest,
            ...(arch === "qwen35moe" ? moe : []),
            "-o",
            out
          ])
          assert.isTrue(Exit.isSuccess(exit), String(exit))
          const file = yield* readGgufFile(out)
          assert.strictEqual(yield* getU32(file, `${arch}.block_count`), 5)
          assert.strictEqual(yield* getU32(file, `${arch}.nextn_predict_layers`), 1)
          for (const name of [...NEXTN, "attn_q.weight", "attn_k_norm.weight", FFN[arch][0]]) {
            assert.isTrue(file.tensorsByName.has(`blk.4.${name}`), name)
          }
          assert.isFalse(file.tensorsByName.has("blk.4.ssm_conv1d.weight"))
          assert.isFalse(file.tensorsByName.has("blk.3.nextn.eh_proj.weight"))
          assert.strictEqual((yield* readModelFacts(out)).numLayers, 4)
          const ref = yield* nodeLlamaReference(out, PROMPT, 16, options)
          assert.isAtLeast(new Set(ref.tokens).size, 4, `reference stream ${ref.tokens}`)
        }),
      120_000
    )
  }

  it.live("refused for an architecture without MTP blocks (qwen3)", () =>
    Effect.gen(function* () {
      const exit = yield* runSynthCli(["--arch", "qwen3", ...common, ...rest, "-o", join(dir, "cli-qwen3-nextn.gguf")])
      assert.isTrue(Exit.isFailure(exit))
      assert.include(
        String(exit),
        "--nextn-layers (MTP blocks) is for glm4moe, qwen35, qwen35moe only, got --arch qwen3"
      )
    })
  )
})
