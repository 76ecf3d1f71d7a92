import { basename } from "node:path"
import { Effect } from "effect"
import type { ModelLoadError } from "../domain/gguf.js"
import type { ModelFacts } from "../domain/plan.js"
import * as Gguf from "../layers/gguf/GgufReader.js"

/** What the planner needs to know about a GGUF file, read from its metadata (no tensor data). */
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
