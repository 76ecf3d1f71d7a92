// The ModelCatalog service (model facts for planning): the live layer reads a real GGUF's metadata, the test layer
// answers from a table, and `swactor plan --model` takes its facts from whichever layer is provided.
import { assert, describe, it } from "@effect/vitest"
import { Effect, Option } from "effect"
import type { ModelFacts } from "../../src/domain/plan.js"
import { plannerInputFromArgs, type PlanArgs } from "../../src/cli/PlanCommand.js"
import * as ModelCatalogLive from "../../src/layers/gguf/ModelCatalogLive.js"
import { ModelCatalog } from "../../src/services/ModelCatalog.js"
import * as Gguf from "../../src/layers/gguf/GgufReader.js"
import { copyFileSync, mkdtempSync, rmSync, truncateSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { Layer } from "effect"
import { ModelLoadError } from "../../src/domain/gguf.js"
import { layerWithCatalog } from "../../src/layers/engine/StageExecutorLive.js"
import { StageExecutor } from "../../src/services/StageExecutor.js"
import { requireModel } from "../support/models.js"
import { type MoeFileOptions, writeMoeFile } from "../support/moeFile.js"

const facts: ModelFacts = {
  modelId: "table.gguf",
  ggufSource: { _tag: "LocalPath", path: "/models/table.gguf" },
  numLayers: 12,
  hiddenDim: 96,
  dtypeFamily: "Float",
  dtypeWidthBytes: 4,
  maxSeqLen: 512,
  eosTokenId: 3,
  tokenizer: { _tag: "EmbeddedInGguf" }
}
const table = ModelCatalogLive.layerTest(new Map([["/models/table.gguf", facts]]))

const args = (model: string): PlanArgs => ({
  layers: Option.none(),
  model: Option.some(model),
  stages: 3,
  nodes: "1,2,3",
  pool: Option.none(),
  orchestrator: 0,
  runId: 1,
  maxTokens: 8,
  hiddenDim: 64,
  maxSeqLen: 256,
  dtype: "bf16",
  activationRingBytes: 1 << 20,
  tokenRingBytes: 4096,
  alignment: 64
})

describe("ModelCatalog", () => {
  it.effect("the live layer reads layer count, hidden size, context length and EOS from the GGUF metadata", () =>
    Effect.gen(function* () {
      const path = requireModel("stories260K.gguf")
      const read = yield* (yield* ModelCatalog).facts(path)
      assert.deepInclude(read, { modelId: "stories260K.gguf", numLayers: 5, hiddenDim: 64, maxSeqLen: 2048 })
      assert.deepStrictEqual(read.ggufSource, { _tag: "LocalPath", path })
      const missing = yield* Effect.flip((yield* ModelCatalog).facts("/nonexistent/model.gguf"))
      assert.strictEqual(missing._tag, "ModelLoadError")
    }).pipe(Effect.provide(ModelCatalogLive.layer))
  )

  it.effect("the layout counts every tensor's bytes once: per block, the input embedding and the output head", () =>
    Effect.gen(function* () {
      const path = requireModel("stories260K.gguf")
      const layout = yield* (yield* ModelCatalog).layout(path)
      const file = yield* Gguf.readGgufFile(path)
      const total = file.tensors.reduce((sum, t) => sum + t.byteSize, 0)
      const tied = !file.tensorsByName.has("output.weight")
      const counted =
        layout.blockBytes.reduce((a, b) => a + b, 0) +
        layout.inputBytes +
        layout.outputBytes -
        (tied ? layout.inputBytes : 0)
      assert.strictEqual(layout.blockBytes.length, 5)
      assert.strictEqual(counted, total)
      assert.isTrue(layout.blockBytes.every((b) => b > 0 && b === layout.blockBytes[0]))
      // K and V widths: 4 KV heads x 8 dims each, F16.
      const k = file.tensorsByName.get("blk.0.attn_k.weight")!.dims[1]!
      assert.deepStrictEqual(layout.kvBytesPerToken, Array(5).fill(2 * 2 * k))
    }).pipe(Effect.provide(ModelCatalogLive.layer))
  )

  it.effect("swactor plan --model takes its facts from the catalog, with the dtype from the command line", () =>
    Effect.gen(function* () {
      const input = yield* plannerInputFromArgs(args("/models/table.gguf"))
      assert.deepStrictEqual(input.model, { ...facts, dtypeFamily: "BFloat", dtypeWidthBytes: 2 })
      const unknown = yield* Effect.flip(plannerInputFromArgs(args("/models/other.gguf")))
      assert.strictEqual(unknown._tag, "ModelLoadError")
    }).pipe(Effect.provide(table))
  )

  // One parse per file version: the facts, the layout and the engine share it; a rewritten file is read again.
  it.effect("the live catalog parses a file's header once per version; a changed file is parsed again", () =>
    Effect.gen(function* () {
      const dir = mkdtempSync(join(tmpdir(), "swactor-catalog-"))
      try {
        const path = join(dir, "m.gguf")
        copyFileSync(requireModel("stories260K.gguf"), path)
        const catalog = yield* ModelCatalog
        const first = yield* catalog.header(path)
        yield* catalog.facts(path)
        yield* catalog.layout(path)
        assert.strictEqual(yield* catalog.header(path), first, "the same parse, not a second one")
        truncateSync(path, 64) // another version of the file: read again, and now refused
        const refused = yield* Effect.flip(catalog.header(path))
        assert.strictEqual(refused._tag, "ModelLoadError")
      } finally {
        rmSync(dir, { recursive: true, force: true })
      }
    }).pipe(Effect.provide(ModelCatalogLive.layer))
  )

  // The engine decides what a stage loads from the header the catalog gives it.
  it.effect("the live engine reads a model's header through the ModelCatalog service", () =>
    Effect.gen(function* () {
      const asked: Array<string> = []
      const catalog = Layer.succeed(ModelCatalog, {
        ...ModelCatalogLive.make,
        header: (path) =>
          Effect.sync(() => asked.push(path)).pipe(
            Effect.zipRight(
              Effect.fail(new ModelLoadError({ path, reason: "Io", message: "the test catalog has no header" }))
            )
          )
      })
      const path = requireModel("stories260K.gguf")
      const error = yield* Effect.flip(
        Effect.scoped(
          Effect.flatMap(StageExecutor, (executor) =>
            executor.load({ path, layerStart: 0, layerEndExclusive: 5, isFirst: true, isLast: true })
          )
        ).pipe(Effect.provide(layerWithCatalog().pipe(Layer.provide(catalog))))
      )
      assert.deepStrictEqual(asked, [path])
      assert.include(error.message, "the test catalog has no header")
    })
  )

  // A mixture of experts: blocks 2 and 3 hold a router, 8 stacked experts (2 used per token) and a shared expert.
  // Stored bytes count every tensor; bytes read per token count the stacked experts at 2/8, everything else whole
  // (dense blocks: read == stored).
  const withMoeFile = <A, E>(
    options: Omit<MoeFileOptions, "path">,
    use: (path: string) => Effect.Effect<A, E, ModelCatalog>
  ) =>
    Effect.acquireUseRelease(
      Effect.sync(() => mkdtempSync(join(tmpdir(), "swactor-moe-"))),
      (dir) => {
        const path = join(dir, "moe.gguf")
        return writeMoeFile({ ...options, path }).pipe(Effect.orDie, Effect.zipRight(use(path)))
      },
      (dir) => Effect.sync(() => rmSync(dir, { recursive: true, force: true }))
    )

  it.effect("a MoE layout: stored bytes count every expert, bytes read per token only the used ones", () =>
    withMoeFile({ layers: 4, moeBlocks: [2, 3], experts: 8, expertsUsed: 2 }, (path) =>
      Effect.gen(function* () {
        const layout = yield* (yield* ModelCatalog).layout(path)
        const file = yield* Gguf.readGgufFile(path)
        const ofBlock = (i: number, experts: boolean) =>
          file.tensors
            .filter((t) => t.name.startsWith(`blk.${i}.`) && /_exps\./.test(t.name) === experts)
            .reduce((sum, t) => sum + t.byteSize, 0)
        assert.deepStrictEqual(
          layout.blockBytes,
          [0, 1, 2, 3].map((i) => ofBlock(i, false) + ofBlock(i, true))
        )
        // Each stacked expert tensor: 64 x 128 x 8 f32 = 256 KiB; three per MoE block.
        assert.strictEqual(ofBlock(2, true), 3 * 64 * 128 * 8 * 4)
        assert.deepStrictEqual(layout.activeBlockBytes, [
          layout.blockBytes[0]!,
          layout.blockBytes[1]!,
          ofBlock(2, false) + (ofBlock(2, true) * 2) / 8,
          ofBlock(3, false) + (ofBlock(3, true) * 2) / 8
        ])
        // The router and shared expert are read whole: more than the dense blocks' attention alone.
        assert.isTrue(
          file.tensorsByName.has("blk.2.ffn_gate_inp.weight") && file.tensorsByName.has("blk.2.ffn_up_shexp.weight")
        )
        assert.isBelow(layout.activeBlockBytes![2]!, layout.blockBytes[2]! / 2)
        // A dense file reads what it stores.
        const dense = yield* (yield* ModelCatalog).layout(requireModel("stories260K.gguf"))
        assert.deepStrictEqual(dense.activeBlockBytes, dense.blockBytes)
      })
    ).pipe(Effect.provide(ModelCatalogLive.layer))
  )

  it.effect("a MoE file whose expert counts disagree with its tensors is refused naming the key or tensor", () =>
    Effect.gen(function* () {
      const refusal = (options: Omit<MoeFileOptions, "path">) =>
        withMoeFile(options, (path) => Effect.flip(Effect.flatMap(ModelCatalog, (c) => c.layout(path))))
      const cases: ReadonlyArray<readonly [Omit<MoeFileOptions, "path">, string, string]> = [
        [
          { layers: 3, moeBlocks: [1], experts: null, expertsUsed: 2 },
          "InvalidMetadata",
          `metadata key "llama.expert_count" is missing: the file has stacked expert tensors (blk.1.ffn_gate_exps.weight)`
        ],
        [
          { layers: 3, moeBlocks: [1], experts: 8, expertsUsed: null },
          "InvalidMetadata",
          `metadata key "llama.expert_used_count" is missing`
        ],
        [
          { layers: 3, moeBlocks: [1], experts: 8, expertsUsed: 9 },
          "InvalidMetadata",
          `metadata "llama.expert_used_count" = 9 must be between 1 and "llama.expert_count" = 8`
        ],
        [
          { layers: 3, moeBlocks: [1], experts: 8, expertsUsed: 0 },
          "InvalidMetadata",
          `metadata "llama.expert_used_count" = 0 must be between 1`
        ],
        [
          { layers: 3, moeBlocks: [1], experts: 16, expertsUsed: 2, storedExperts: 8 },
          "TensorShapeMismatch",
          `tensor "blk.1.ffn_gate_exps.weight" has shape [64, 128, 8]: its last dimension must be "llama.expert_count" = 16`
        ]
      ]
      for (const [options, reason, words] of cases) {
        const error = yield* refusal(options)
        assert.strictEqual(error._tag, "ModelLoadError")
        assert.strictEqual(error.reason, reason, error.message)
        assert.include(error.message, words)
      }
    }).pipe(Effect.provide(ModelCatalogLive.layer))
  )
})
