// The ModelCatalog service (model facts for planning): the live layer reads a real GGUF's metadata, the test layer
// answers from a table, and `swactor plan --model` takes its facts from whichever layer is provided.
import { assert, describe, it } from "@effect/vitest"
import { Effect, Option } from "effect"
import type { ModelFacts } from "../src/domain/plan.js"
import { plannerInputFromArgs, type PlanArgs } from "../src/cli/PlanCommand.js"
import * as ModelCatalogLive from "../src/layers/ModelCatalogLive.js"
import { ModelCatalog } from "../src/services/ModelCatalog.js"
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

  it.effect("swactor plan --model takes its facts from the catalog, with the dtype from the command line", () =>
    Effect.gen(function*() {
      const input = yield* plannerInputFromArgs(args("/models/table.gguf"))
      assert.deepStrictEqual(input.model, { ...facts, dtypeFamily: "BFloat", dtypeWidthBytes: 2 })
      const unknown = yield* Effect.flip(plannerInputFromArgs(args("/models/other.gguf")))
      assert.strictEqual(unknown._tag, "ModelLoadError")
    }).pipe(Effect.provide(table)))
})
