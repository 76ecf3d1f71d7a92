/**
 * The `ModelCatalog` service's implementations: `layer` reads each model's GGUF metadata (no tensor data);
 * `layerTest` answers from a table, for tests that plan without a model file.
 */
import { basename } from "node:path"
import { Effect, Layer } from "effect"
import { ModelLoadError } from "../domain/gguf.js"
import type { ModelFacts } from "../domain/plan.js"
import { ModelCatalog, type ModelCatalogService } from "../services/ModelCatalog.js"
import * as Gguf from "./gguf/GgufReader.js"

/**
 * The facts planning needs, from a GGUF file's metadata: `block_count`, `embedding_length` and `context_length` of
 * its architecture, and the EOS token (2 when absent). Activations travel as f32, so the dtype is Float, 4 bytes.
 */
export const readModelFacts = (path: string): Effect.Effect<ModelFacts, ModelLoadError> =>
  Effect.gen(function*() {
    const file = yield* Gguf.readGgufFile(path)
    const arch = yield* Gguf.getArchitecture(file)
    const numLayers = yield* Gguf.getU32(file, `${arch}.block_count`)
    const hiddenDim = yield* Gguf.getU32(file, `${arch}.embedding_length`)
    const maxSeqLen = yield* Gguf.getU32(file, `${arch}.context_length`)
    const eos = yield* Gguf.getOptional(file, "tokenizer.ggml.eos_token_id", Gguf.getU32)
    return {
      modelId: basename(path),
      ggufSource: { _tag: "LocalPath", path },
      numLayers,
      hiddenDim,
      dtypeFamily: "Float",
      dtypeWidthBytes: 4,
      maxSeqLen,
      eosTokenId: eos ?? 2,
      tokenizer: { _tag: "EmbeddedInGguf" }
    } satisfies ModelFacts
  })

export const make: ModelCatalogService = { facts: readModelFacts }

/** Reads GGUF metadata from the file system. */
export const layer: Layer.Layer<ModelCatalog> = Layer.succeed(ModelCatalog, make)

/** Answers from `models` (path → facts); any other path is a `ModelLoadError` (Io). */
export const layerTest = (models: ReadonlyMap<string, ModelFacts>): Layer.Layer<ModelCatalog> =>
  Layer.succeed(ModelCatalog, {
    facts: (path) => {
      const facts = models.get(path)
      return facts !== undefined
        ? Effect.succeed(facts)
        : Effect.fail(new ModelLoadError({ path, reason: "Io", message: `no model at ${path}` }))
    }
  })
