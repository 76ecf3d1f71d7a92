// The live tokenizer on an SPM model (stories260K) serves a run without loading node-llama-cpp (its import and binary
// check cost ~0.7 s of CPU at start-up: SpmTokenizer.ts does the work); the first chat template loads it.
import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import * as TokenizerLive from "../../src/layers/gguf/TokenizerLive.js"
import { Tokenizer } from "../../src/services/Tokenizer.js"
import { requireModel } from "../support/models.js"

const llamaAddonLoaded = () =>
  (process.report.getReport() as unknown as { sharedObjects: Array<string> }).sharedObjects.some((so) =>
    so.includes("llama-addon")
  )

describe("live tokenizer, SPM vocabulary", () => {
  it.live(
    "tokenizes and decodes without node-llama-cpp; a chat template loads it",
    () =>
      Effect.gen(function* () {
        const model = yield* Effect.flatMap(Tokenizer, (t) => t.open(requireModel("stories260K.gguf")))
        const prompt = model.tokenize("Once upon a time")
        assert.deepStrictEqual(prompt, [1, 403, 407, 261, 378])
        assert.strictEqual(
          model.detokenize(model.tokenize("there was a little girl").slice(1), prompt),
          " there was a little girl"
        )
        assert.isTrue(model.isEndOfGeneration(2))
        assert.isFalse(llamaAddonLoaded())
        const chat = yield* model.formatChat([{ role: "user", content: "Hello" }])
        assert.isAbove(chat.tokens.length, 1)
        assert.isTrue(llamaAddonLoaded())
      }).pipe(Effect.scoped, Effect.provide(TokenizerLive.layer)),
    60_000
  )
})
