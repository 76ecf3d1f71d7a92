import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import * as TokenizerLive from "../../src/layers/gguf/TokenizerLive.js"
import { Tokenizer } from "../../src/services/Tokenizer.js"
import { requireModel } from "../support/models.js"

const decodeAll = (tokens: ReadonlyArray<number>, push: (token: number) => string) => tokens.map(push)

describe("Tokenizer", () => {
  // Incremental decoding never emits half a character: bytes of a multi-byte character are held
  // until the character is complete, and the concatenation equals whole-sequence decoding.
  it.effect("incremental decoding holds partial UTF-8 characters back", () =>
    Effect.gen(function* () {
      const tokenizer = yield* Tokenizer
      const model = yield* tokenizer.open("unused")
      const tokens = model.tokenize("a日é")
      const pieces = decodeAll(tokens.slice(1), model.decoder([]).push)
      assert.deepStrictEqual(pieces, ["a", "", "", "日", "", "é"])
    }).pipe(Effect.scoped, Effect.provide(TokenizerLive.layerTest))
  )

  // The live vocabulary tokenizes like llama.cpp (BOS first for an SPM llama model) and decodes a
  // generated continuation piece by piece to the same text as a whole-sequence decode.
  it.live("node-llama-cpp vocabulary: BOS + prompt, streaming decode equals whole decode", () =>
    Effect.gen(function* () {
      const tokenizer = yield* Tokenizer
      const model = yield* tokenizer.open(requireModel("stories260K.gguf"))
      const prompt = model.tokenize("Once upon a time")
      assert.deepStrictEqual(prompt, [1, 403, 407, 261, 378])
      assert.strictEqual(model.eosTokenId, 2)
      assert.isTrue(model.isEndOfGeneration(2))
      const continuation = model.tokenize(", there was a little girl named Lily. 日本").slice(1)
      const decoder = model.decoder(prompt)
      const streamed = continuation.map(decoder.push).join("") + decoder.flush()
      assert.strictEqual(streamed, model.detokenize(continuation, prompt))
      assert.isTrue(streamed.endsWith("日本"))
      assert.notInclude(streamed, "\uFFFD")
    }).pipe(Effect.scoped, Effect.provide(TokenizerLive.layer))
  )
})
