// The ModelCatalog service (model facts for planning): the live layer reads a real GGUF's metadata, the test layer
// answers from a table, and `swactor plan --model` takes its facts from whichever layer is provided.
import { assert, describe, it } from "@effect/vitest"
import { Effect, Option } from "effect"
import type { ModelFacts } from "../src/domain/plan.js"
import { plannerInputFromArgs, type PlanArgs } from "../src/cli/PlanCommand.js"
import * as ModelCatalogLive from "../src/layers/gguf/ModelCatalogLive.js"
import { ModelCatalog } from "../src/services/ModelCatalog.js"
import * as Gguf from "../src/layers/gguf/GgufReader.js"
import { copyFileSync, mkdtempSync, rmSync, truncateSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { Layer } from "effect"
import { ModelLoadError } from "../src/domain/gguf.js"
import { layerWithCatalog } from "../src/layers/engine/StageExecutorLive.js"
import { StageExecutor } from "../src/services/StageExecutor.js"
import { requireModel } from "./support/models.js"

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
    Effect.gen(function*() {
      const path = requireModel("stories260K.gguf")
      const read = yield* (yield* ModelCatalog).facts(path)
      assert.deepInclude(read, { modelId: "stories260K.gguf", numLayers: 5, hiddenDim: 64, maxSeqLen: 2048 })
      assert.deepStrictEqual(read.ggufSource, { _tag: "LocalPath", path })
      const missing = yield* Effect.flip((yield* ModelCatalog).facts("/nonexistent/model.gguf"))
      assert.strictEqual(missing._tag, "ModelLoadError")
    }).pipe(Effect.provide(ModelCatalogLive.layer)))

  it.effect("the layout counts every tensor's bytes once: per block, the input embedding and the output head", () =>
    Effect.gen(function*() {
      const path = requireModel("stories260K.gguf")
      const layout = yield* (yield* ModelCatalog).layout(path)
      const file = yield* Gguf.readGgufFile(path)
      const total = file.tensors.reduce((sum, t) => sum + t.byteSize, 0)
      const tied = !file.tensorsByName.has("output.weight")
      const counted = layout.blockBytes.reduce((a, b) => a + b, 0) + layout.inputBytes + layout.outputBytes -
        (tied ? layout.inputBytes : 0)
      assert.strictEqual(layout.blockBytes.length, 5)
      assert.strictEqual(counted, total)
      assert.isTrue(layout.blockBytes.every((b) => b > 0 && b === layout.blockBytes[0]))
      // K and V widths: 4 KV heads x 8 dims each, F16.
      const k = file.tensorsByName.get("blk.0.attn_k.weight")!.dims[1]!
      assert.deepStrictEqual(layout.kvBytesPerToken, Array(5).fill(2 * 2 * k))
    }).pipe(Effect.provide(ModelCatalogLive.layer)))

  it.effect("swactor plan --model takes its facts from the catalog, with the dtype from the command line", () =>
    Effect.gen(function*() {
      const input = yield* plannerInputFromArgs(args("/models/table.gguf"))
      assert.deepStrictEqual(input.model, { ...facts, dtypeFamily: "BFloat", dtypeWidthBytes: 2 })
      const unknown = yield* Effect.flip(plannerInputFromArgs(args("/models/other.gguf")))
      assert.strictEqual(unknown._tag, "ModelLoadError")
    }).pipe(Effect.provide(table)))

  // One parse per file version: the facts, the layout and the engine share it; a rewritten file is read again.
  it.effect("the live catalog parses a file's header once per version; a changed file is parsed again", () =>
    Effect.gen(function*() {
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
    }).pipe(Effect.provide(ModelCatalogLive.layer)))

  // The engine decides what a stage loads from the header the catalog gives it.
  it.effect("the live engine reads a model's header through the ModelCatalog service", () =>
    Effect.gen(function*() {
      const asked: Array<string> = []
      const catalog = Layer.succeed(ModelCatalog, {
        ...ModelCatalogLive.make,
        header: (path) =>
          Effect.sync(() => asked.push(path)).pipe(
            Effect.zipRight(Effect.fail(new ModelLoadError({ path, reason: "Io", message: "the test catalog has no header" })))
          )
      })
      const path = requireModel("stories260K.gguf")
      const error = yield* Effect.flip(Effect.scoped(Effect.flatMap(StageExecutor, (executor) =>
        executor.load({ path, layerStart: 0, layerEndExclusive: 5, isFirst: true, isLast: true })
      )).pipe(Effect.provide(layerWithCatalog().pipe(Layer.provide(catalog)))))
      assert.deepStrictEqual(asked, [path])
      assert.include(error.message, "the test catalog has no header")
    }))
})
