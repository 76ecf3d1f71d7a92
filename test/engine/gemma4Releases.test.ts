/**
 * Miniatures of the four released Gemma 4 checkpoints (E2B, E4B, 26B-A4B, 31B): files with the released GGUFs' gemma4
 * key set and structure at tiny widths, as `writeSyntheticModel` writes them. The real values (google/gemma-4-*
 * config.json `text_config`, as llama.cpp's conversion/gemma.py Gemma4Model turns them into keys) and what each
 * miniature keeps:
 * - E2B: 35 blocks, 4 sliding : 1 global (period 5), window 512, 20 shared KV layers (from block 15 = 3 periods),
 *   8 heads / 1 KV head on every block, heads 256 (sliding) / 512 (global), per-layer embeddings 256, V projection on
 *   every block (no K = V), soft-capping 30, RoPE bases 10k / 1M, tied output. Kept: period 5, window 8, 15 blocks
 *   with 5 shared (from block 10 = 2 periods), 8 / 1 heads, heads 16 / 32, per-layer 32, and the "double-wide"
 *   feed-forward of its shared blocks (use_double_wide_mlp: feed_forward_length a per-block array, 2x from the first
 *   shared block; real 6144 / 12288 from block 15, here 256 / 512 from block 10).
 * - E4B: 42 blocks, 5 : 1 (period 6), window 512, 18 shared (from block 24 = 4 periods), 8 heads / 2 KV heads,
 *   256 / 512, per-layer 256, V projection, 30, 10k / 1M, tied. Kept: 18 blocks with 6 shared (from block 12 =
 *   2 periods), window 8, 8 / 2 heads, 16 / 32, per-layer 32.
 * - 26B-A4B: 30 blocks, period 6, window 1024, no shared KV, 16 heads, KV heads 8 sliding / 2 global (per-block
 *   array), 256 / 512, K = V on the global blocks, 128 experts, 8 used, expert width 704 beside the dense 2112,
 *   30, 10k / 1M, tied, no per-layer embeddings. Kept: 6 blocks, window 16, 16 heads 8 / 2, 16 / 32, 128 experts
 *   top-8 (the real counts), expert width 16 beside the dense 48 (1 : 3 as 704 : 2112).
 * - 31B: 60 blocks, period 6, window 1024, no shared KV, 32 heads, KV heads 16 / 4, 256 / 512, K = V, 30,
 *   10k / 1M, tied. Kept: 12 blocks, window 16, 32 heads 16 / 4, 16 / 32.
 * Each: node-llama-cpp loads it; our greedy tokens at 1, 2 and 3 stages (cuts at sliding|global and global|sliding,
 * never inside a shared KV group) equal node-llama-cpp's for 48 tokens, 32+ past twice the window; the catalog's
 * layout (per-block KV widths, window pattern, KV sources) and balanced placement at 1-3 stages accept it.
 */
import * as Command from "@effect/cli/Command"
import * as NodeContext from "@effect/platform-node/NodeContext"
import { assert, describe, it } from "@effect/vitest"
import { Effect, Either, Exit } from "effect"
import { join } from "node:path"
import { synthCommand } from "../../src/cli/SynthCommand.js"
import { NodeId } from "../../src/domain/ids.js"
import { type GgufFile, GgufValueType } from "../../src/domain/gguf.js"
import { layoutStage } from "../../src/layers/engine/StageLayout.js"
import { readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { readModelLayout } from "../../src/layers/gguf/ModelCatalogLive.js"
import { type SyntheticModelOptions, writeSyntheticModel } from "../../src/layers/gguf/Synthetic.js"
import { kvBytesPerTokenOfBlock } from "../../src/services/KvSize.js"
import { choosePlacement } from "../../src/services/Placement.js"
import { nodeLlamaReference, splitsMatchReference } from "../support/engine.js"
import { requireModel } from "../support/models.js"
import { modelFolder, REFERENCE_OPTIONS as options, STORY_PROMPT as PROMPT } from "../support/synthFiles.js"

const dir = modelFolder("swactor-engine-gemma4rel-")

// what every released gemma4 file has: soft-capping 30, global RoPE base 1M (sliding 10k), RMS eps 1e-6, tied output,
// sliding heads half the global ones' width
const common = {
  arch: "gemma4",
  vocab: 400,
  contextLength: 1024,
  type: "q8_0",
  logitSoftcap: 30,
  ropeFreqBase: 1_000_000,
  normEps: 1e-6,
  tiedOutput: true,
  headDim: 32,
  swaHeadDim: 16
} as const

interface Release {
  readonly name: string
  readonly options: SyntheticModelOptions
  /** Stage boundaries to run (1, 2 and 3 stages). */
  readonly splits: ReadonlyArray<ReadonlyArray<number>>
  /** Per block, the block whose KV cache it reads. */
  readonly kvSources: ReadonlyArray<number>
}

const ident = (n: number) => Array.from({ length: n }, (_, i) => i)
const path = (name: string) => join(dir, `${name}.gguf`)

const releases: ReadonlyArray<Release> = [
  {
    // blocks 4, 9, 14 global; 10-13 (sliding) read block 8, 14 (global) reads block 9: no cut inside [8, 15)
    name: "E2B",
    options: {
      ...common,
      path: path("e2b"),
      layers: 15,
      hidden: 128,
      ffn: 256,
      heads: 8,
      kvHeads: 1,
      slidingWindow: 8,
      swaPattern: 5,
      perLayerEmbd: 32,
      sharedKvLayers: 5,
      doubleWideSharedFfn: true,
      seed: 71
    },
    splits: [
      [0, 15],
      [0, 5, 15],
      [0, 4, 5, 15],
      [0, 5, 8, 15]
    ],
    kvSources: [...ident(10), 8, 8, 8, 8, 9]
  },
  {
    // blocks 5, 11, 17 global; 12-16 (sliding) read block 10, 17 (global) reads block 11: no cut inside [10, 18)
    name: "E4B",
    options: {
      ...common,
      path: path("e4b"),
      layers: 18,
      hidden: 128,
      ffn: 256,
      heads: 8,
      kvHeads: 2,
      slidingWindow: 8,
      swaPattern: 6,
      perLayerEmbd: 32,
      sharedKvLayers: 6,
      seed: 72
    },
    splits: [
      [0, 18],
      [0, 6, 18],
      [0, 5, 6, 18],
      [0, 6, 10, 18]
    ],
    kvSources: [...ident(12), 10, 10, 10, 10, 10, 11]
  },
  {
    name: "26B-A4B",
    options: {
      ...common,
      path: path("26b-a4b"),
      layers: 6,
      hidden: 128,
      ffn: 48,
      heads: 16,
      kvHeads: 8,
      globalKvHeads: 2,
      kEqV: true,
      experts: 128,
      expertsUsed: 8,
      expertFfn: 16,
      slidingWindow: 16,
      swaPattern: 6,
      sharedKvLayers: 0,
      seed: 73
    },
    splits: [
      [0, 6],
      [0, 5, 6],
      [0, 2, 5, 6]
    ],
    kvSources: ident(6)
  },
  {
    name: "31B",
    options: {
      ...common,
      path: path("31b"),
      layers: 12,
      hidden: 128,
      ffn: 256,
      heads: 32,
      kvHeads: 16,
      globalKvHeads: 4,
      kEqV: true,
      slidingWindow: 16,
      swaPattern: 6,
      sharedKvLayers: 0,
      seed: 74
    },
    splits: [
      [0, 12],
      [0, 6, 12],
      [0, 5, 6, 12],
      [0, 3, 11, 12]
    ],
    kvSources: ident(12)
  }
]

// the gemma4 keys llama.cpp's converter writes for every released checkpoint (experts: the 26B-A4B's three more)
const releasedKeys = [
  "block_count",
  "context_length",
  "embedding_length",
  "feed_forward_length",
  "attention.head_count",
  "attention.head_count_kv",
  "attention.layer_norm_rms_epsilon",
  "rope.freq_base",
  "rope.freq_base_swa",
  "rope.dimension_count",
  "rope.dimension_count_swa",
  "attention.key_length",
  "attention.value_length",
  "attention.key_length_swa",
  "attention.value_length_swa",
  "attention.sliding_window",
  "attention.sliding_window_pattern",
  "attention.shared_kv_layers",
  "embedding_length_per_layer_input",
  "final_logit_softcapping"
].map((k) => `gemma4.${k}`)
const expertKeys = ["expert_count", "expert_used_count", "expert_feed_forward_length"].map((k) => `gemma4.${k}`)

const node = (id: number) => ({ nodeId: NodeId.make(id), freeMemoryBytes: 2 ** 40, speedBytesPerSecond: 1e9 })
const pool = Array.from({ length: 8 }, (_, i) => node(i + 1))

/** Per block of a released layout, the block whose cache it reads: from `layers - shared` the last one of its kind before. */
const releasedSources = (layers: number, period: number, shared: number) => {
  const slides = (il: number) => il % period < period - 1
  const first = layers - shared
  return Array.from({ length: layers }, (_, il) => {
    if (il < first) return il
    let src = first - 1
    while (slides(src) !== slides(il)) src--
    return src
  })
}

// at the released block counts (E2B: 35 blocks, 20 shared; E4B: 42, 18), balanced placement finds a legal split for
// every stage count the legal boundaries allow (E2B: 13 of them, all below the shared group [13, 35))
describe("Gemma 4 E2B / E4B at their released block counts: balanced placement keeps each shared KV group whole", () => {
  for (const [name, layers, period, shared, legal] of [
    ["E2B", 35, 5, 20, 13],
    ["E4B", 42, 6, 18, 22]
  ] as const) {
    it(`${name}: ${layers} blocks, ${shared} shared, 1-8 stages`, () => {
      const kvSources = releasedSources(layers, period, shared)
      const layout = {
        blockBytes: Array(layers).fill(1_000_000),
        kvBytesPerToken: kvSources.map((s, il) => (s === il ? 1024 : 0)),
        kvSources,
        inputBytes: 1_000_000,
        outputBytes: 1_000_000,
        hiddenDim: 128
      }
      const groupStart = Math.min(...kvSources.filter((s, il) => s !== il))
      assert.strictEqual(groupStart, legal)
      for (let stageCount = 1; stageCount <= 8; stageCount++) {
        const choice = choosePlacement({ _tag: "Balanced", stageCount }, layout, pool, { contextTokens: 1024 })
        assert.isTrue(Either.isRight(choice), `${name} at ${stageCount} stages: ${JSON.stringify(choice)}`)
        const starts = Either.getOrThrow(choice).stages.map((st) => st.layerStart)
        assert.strictEqual(starts.length, stageCount)
        for (const start of starts) assert.isAtMost(start, groupStart, `${name} ${stageCount} stages: ${starts}`)
      }
    })
  }
})

for (const r of releases) {
  const o = r.options
  const window = o.slidingWindow!
  const period = o.swaPattern!
  const slides = Array.from({ length: o.layers }, (_, il) => il % period < period - 1)
  describe(`Gemma 4 ${r.name} miniature`, () => {
    it.live(
      `keys, layout and placement as the released file; 1-3 stages give node-llama-cpp's tokens (48, or to its end of generation)`,
      () =>
        Effect.gen(function* () {
          yield* writeSyntheticModel(o)
          const file = yield* readGgufFile(o.path)
          const keys = [...file.metadata.keys()].filter((k) => k.startsWith("gemma4."))
          const want = o.experts === undefined ? releasedKeys : [...releasedKeys, ...expertKeys]
          assert.includeMembers(keys, want, `${r.name} key set`)
          assert.deepStrictEqual(
            keys.filter((k) => !want.includes(k)),
            [],
            `${r.name}: no key a released file lacks`
          )
          assert.isFalse(file.tensorsByName.has("output.weight"), "tied output head")
          assert.strictEqual(file.tensorsByName.has("per_layer_token_embd.weight"), (o.perLayerEmbd ?? 0) > 0)
          const global = slides.indexOf(false)
          assert.strictEqual(
            file.tensorsByName.has(`blk.${global}.attn_v.weight`),
            o.kEqV !== true,
            "K = V on global blocks"
          )
          // E2B: the shared blocks' feed-forward twice as wide, feed_forward_length one width per block
          const ffns = Array.from({ length: o.layers }, (_, il) =>
            o.doubleWideSharedFfn === true && il >= o.layers - o.sharedKvLayers! ? 2 * o.ffn : o.ffn
          )
          assert.deepStrictEqual(
            file.metadata.get("gemma4.feed_forward_length"),
            o.doubleWideSharedFfn === true ? ffns : o.ffn
          )
          assert.deepStrictEqual(
            ffns.map((_, il) => file.tensorsByName.get(`blk.${il}.ffn_down.weight`)?.dims),
            ffns.map((f) => [f, o.hidden])
          )

          // the catalog's layout: per-block KV widths (sliding: 16-wide heads x kvHeads; global: 32 x globalKvHeads;
          // a shared block none), the window pattern, the KV sources
          const layout = yield* readModelLayout(o.path)
          const swaRow = kvBytesPerTokenOfBlock(16 * o.kvHeads, 16 * o.kvHeads)
          const globalRow = kvBytesPerTokenOfBlock(
            32 * (o.globalKvHeads ?? o.kvHeads),
            32 * (o.globalKvHeads ?? o.kvHeads)
          )
          assert.deepStrictEqual(
            layout.kvBytesPerToken,
            slides.map((s, il) => (r.kvSources[il] !== il ? 0 : s ? swaRow : globalRow))
          )
          assert.deepStrictEqual(layout.slidingWindow, { window, blocks: slides })
          if ((o.sharedKvLayers ?? 0) > 0) assert.deepStrictEqual(layout.kvSources, r.kvSources)
          else assert.isTrue(layout.kvSources === undefined || layout.kvSources.every((s, il) => s === il))
          // balanced placement at 1-4 stages accepts it and never cuts a block from the cache it reads
          for (const stageCount of [1, 2, 3, 4]) {
            const choice = choosePlacement({ _tag: "Balanced", stageCount }, layout, pool, { contextTokens: 1024 })
            assert.isTrue(Either.isRight(choice), `${r.name} at ${stageCount} stages: ${JSON.stringify(choice)}`)
            const stages = Either.getOrThrow(choice).stages
            assert.strictEqual(stages.length, stageCount)
            for (const s of stages) {
              for (let il = s.layerStart; il < s.layerEndExclusive; il++) {
                assert.isAtLeast(r.kvSources[il]!, s.layerStart, `${r.name}: block ${il} on the stage of its source`)
              }
            }
          }

          // node-llama-cpp loads it; every split gives its greedy tokens, 32+ past twice the window
          const ref = yield* nodeLlamaReference(o.path, PROMPT, 48, options)
          // node-llama-cpp's stream ends at an end-of-generation token: the 26B-A4B miniature's reaches one after 31
          // tokens with the zen4 ggml variant (48 with the Intel ones); what it gives must still pass twice the window
          assert.isAtLeast(ref.tokens.length, 24, `reference stream ${ref.tokens}`)
          assert.isAtLeast(ref.prompt.length + ref.tokens.length, 2 * window + 16)
          assert.isAtLeast(new Set(ref.tokens).size, 8, `reference stream ${ref.tokens}`)
          for (const split of r.splits) {
            for (let b = 1; b < split.length - 1; b++) {
              const cut = split[b]!
              for (let il = cut; il < o.layers; il++) assert.isAtLeast(r.kvSources[il]!, cut, `legal split ${split}`)
            }
          }
          const maxDiff = yield* splitsMatchReference(o.path, ref, r.splits, options)
          console.log(
            `gemma4 ${r.name} miniature: ${r.splits.length} splits x ${ref.tokens.length} tokens, first log-prob diff ${maxDiff.toExponential(2)}`
          )
          assert.isBelow(maxDiff, 1e-3)
        }),
      300_000
    )
  })
}

describe("swactor synth --arch gemma4 --shared-kv-layers --double-wide-shared-ffn", () => {
  const cli = Command.run(Command.make("swactor").pipe(Command.withSubcommands([synthCommand])), {
    name: "swactor",
    version: "test"
  })
  it.live(
    "writes E2B's per-block feed-forward widths; node-llama-cpp loads it and our 2 stages give its tokens",
    () =>
      Effect.gen(function* () {
        const out = join(dir, "cli-double-wide.gguf")
        const exit = yield* cli([
          "node",
          "swactor",
          "synth",
          "--arch",
          "gemma4",
          "--layers",
          "6",
          "--hidden",
          "128",
          "--ffn",
          "96",
          "--heads",
          "4",
          "--kv-heads",
          "1",
          "--head-dim",
          "32",
          "--vocab",
          "400",
          "--context-length",
          "512",
          "--sliding-window",
          "8",
          "--swa-pattern",
          "2",
          "--per-layer-embd",
          "16",
          "--shared-kv-layers",
          "2",
          "--double-wide-shared-ffn",
          "--type",
          "q8_0",
          "-o",
          out
        ]).pipe(Effect.provide(NodeContext.layer), Effect.exit)
        assert.isTrue(Exit.isSuccess(exit))
        const file = yield* readGgufFile(out)
        assert.deepStrictEqual(file.metadata.get("gemma4.feed_forward_length"), [96, 96, 96, 96, 192, 192])
        assert.deepStrictEqual(file.tensorsByName.get("blk.3.ffn_up.weight")?.dims, [128, 96])
        assert.deepStrictEqual(file.tensorsByName.get("blk.4.ffn_up.weight")?.dims, [128, 192])
        const ref = yield* nodeLlamaReference(out, PROMPT, 24, options)
        assert.strictEqual(ref.tokens.length, 24)
        yield* splitsMatchReference(out, ref, [[0, 2, 6]], options)
      }),
    120_000
  )
})

// feed_forward_length as one width per block: gemma4 checks each entry and each block's tensors at its own width;
// another architecture (llama) takes a uniform array and refuses a varying one, naming the key
describe("feed_forward_length per block: checked before ggml", () => {
  // the value and its stored type (an UINT32 array, as llama.cpp's converter writes it)
  const withFf = (file: GgufFile, key: string, value: ReadonlyArray<number>): GgufFile => ({
    ...file,
    metadata: new Map([...file.metadata, [key, value]]),
    metadataTypes: new Map([
      ...file.metadataTypes,
      [key, { type: GgufValueType.ARRAY, itemType: GgufValueType.UINT32 }]
    ])
  })
  const layout = (file: GgufFile, blocks: number) =>
    layoutStage(file, { path: file.path, layerStart: 0, layerEndExclusive: blocks, isFirst: true, isLast: true }).pipe(
      Effect.map(() => "ok"),
      Effect.catchTag("ModelLoadError", (e) => Effect.succeed(`${e.reason}: ${e.message}`))
    )
  it.live(
    "gemma4 E2B-shaped: a wrong count, a 0 width or a width its tensors do not have is refused",
    () =>
      Effect.gen(function* () {
        const o = { ...releases[0]!.options, path: path("e2b-ff") }
        yield* writeSyntheticModel(o)
        const file = yield* readGgufFile(o.path)
        const key = "gemma4.feed_forward_length"
        const wide = Array.from({ length: 15 }, (_, il) => (il >= 10 ? 512 : 256))
        assert.strictEqual(yield* layout(file, 15), "ok")
        assert.strictEqual(yield* layout(withFf(file, key, wide), 15), "ok")
        assert.strictEqual(
          yield* layout(withFf(file, key, wide.slice(1)), 15),
          `InvalidMetadata: metadata "${key}" has 14 entries for 15 blocks`
        )
        assert.match(
          yield* layout(
            withFf(
              file,
              key,
              wide.map((f, il) => (il === 3 ? 0 : f))
            ),
            15
          ),
          /^InvalidMetadata: metadata "gemma4.feed_forward_length" = 0 must be > 0/
        )
        assert.match(
          yield* layout(
            withFf(
              file,
              key,
              wide.map((f, il) => (il === 12 ? 256 : f))
            ),
            15
          ),
          /"blk\.12\.ffn_gate\.weight" has shape \[128, 512\], expected \[128, 256\]/
        )
      }),
    60_000
  )
  it.live(
    "llama (stories260K): a uniform array is read as one width, a varying one refused naming the key",
    () =>
      Effect.gen(function* () {
        const file = yield* readGgufFile(requireModel("stories260K.gguf"))
        const key = "llama.feed_forward_length"
        const ff = file.metadata.get(key) as number
        assert.strictEqual(yield* layout(withFf(file, key, [ff, ff, ff, ff, ff]), 5), "ok")
        assert.strictEqual(
          yield* layout(withFf(file, key, [ff, ff, ff, ff, 2 * ff]), 5),
          `InvalidMetadata: metadata "${key}" varies per layer, which swactor does not support`
        )
      }),
    60_000
  )
})
