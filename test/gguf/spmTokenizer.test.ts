// The TypeScript SPM tokenizer (src/layers/gguf/SpmTokenizer.ts, what a run uses instead of node-llama-cpp on its
// start-up path) against node-llama-cpp itself, on stories260K's vocabulary and on the synthetic models' vocabulary:
// the same ids for awkward texts (spaces, newlines, unknown characters through byte fallback, text that looks like
// special tokens), the same text back for random id sequences with and without context, and the same BOS/EOS. A
// vocabulary it cannot reproduce exactly (user-defined or extra special tokens) is left to node-llama-cpp.
import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { getLlama, type Llama } from "node-llama-cpp"
import { afterAll, beforeAll } from "vitest"
import { readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { makeSpmTokenizer, spmVocabulary } from "../../src/layers/gguf/SpmTokenizer.js"
import { writeSyntheticModel } from "../../src/layers/gguf/Synthetic.js"
import { requireModel } from "../support/models.js"

let dir = ""
let llama: Llama
beforeAll(async () => {
  dir = mkdtempSync(join(tmpdir(), "swactor-spm-"))
  llama = await getLlama({ gpu: false, build: "never", logLevel: "error" as never })
})
afterAll(() => {
  rmSync(dir, { recursive: true, force: true })
})

const texts = [
  "Once upon a time",
  "Once upon a time, there was a little girl named Lily.",
  " leading space",
  "  two leading spaces",
  "trailing space ",
  "many     spaces\tand\ttabs",
  "new\nlines\n\nand\r\nreturns\n",
  "日本語のテキスト",
  "émojis 😀🎉 and accents àéîõü",
  "<s> is not BOS here </s> <unk> <0x41>",
  "a",
  " ",
  "\n",
  "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX!",
  "1234567890 +-*/=()[]{}<>",
  'He said: "it\'s 3:45 p.m." — then left…',
  "lone surrogate \ud800 here",
  // runs of one letter: equal-score bigrams overlap, llama.cpp merges the leftmost first
  "llll lll oooo ooo eeee eee ssss sss tttt ttt aaaa aaa mmmm nnnnn pp rrr"
]

/** A deterministic pseudo-random stream (mulberry32). */
const random = (seed: number) => () => {
  seed = (seed + 0x6d2b79f5) | 0
  let t = Math.imul(seed ^ (seed >>> 15), 1 | seed)
  t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t
  return ((t ^ (t >>> 14)) >>> 0) / 4294967296
}

const compare = (path: string) =>
  Effect.gen(function* () {
    const file = yield* readGgufFile(path)
    const vocab = spmVocabulary(file)
    assert.isDefined(vocab, "the vocabulary is accepted")
    const ours = makeSpmTokenizer(vocab!)
    const model = yield* Effect.promise(() => llama.loadModel({ modelPath: path, vocabOnly: true }))
    try {
      assert.strictEqual(vocab!.bos, model.tokens.bos)
      assert.strictEqual(vocab!.eos, model.tokens.eos)
      assert.strictEqual(vocab!.addBos, model.tokens.shouldPrependBosToken)
      let vocabSize = 0
      for (const _ of model.iterateAllTokens()) vocabSize++
      assert.strictEqual(ours.vocabSize, vocabSize)
      const next = random(42)
      const words = texts.join(" ").split(/(\s+)/)
      const generated = Array.from({ length: 40 }, () =>
        Array.from({ length: 1 + Math.floor(next() * 12) }, () => words[Math.floor(next() * words.length)]).join("")
      )
      for (const text of [...texts, ...generated]) {
        assert.deepStrictEqual(ours.tokenize(text), [...model.tokenize(text)], JSON.stringify(text))
      }
      for (let round = 0; round < 300; round++) {
        const ids = Array.from({ length: 1 + Math.floor(next() * 8) }, () => Math.floor(next() * vocabSize))
        const context = Array.from({ length: Math.floor(next() * 5) }, () => Math.floor(next() * vocabSize))
        assert.strictEqual(ours.detokenize(ids), model.detokenize(ids as Array<never>, false), `ids ${ids}`)
        assert.strictEqual(
          ours.detokenize(ids, context),
          model.detokenize(ids as Array<never>, false, context as Array<never>),
          `ids ${ids} after ${context}`
        )
      }
      for (const text of texts) {
        const ids = ours.tokenize(text)
        assert.strictEqual(ours.detokenize(ids), model.detokenize(ids as Array<never>, false), JSON.stringify(text))
      }
    } finally {
      yield* Effect.promise(() => model.dispose())
    }
  })

describe("SPM tokenizer in TypeScript = node-llama-cpp", () => {
  it.live("stories260K's vocabulary", () => compare(requireModel("stories260K.gguf")), 60_000)

  it.live("a vocabulary with user-defined or extra special-looking tokens is left to node-llama-cpp", () =>
    Effect.gen(function* () {
      const file = yield* readGgufFile(requireModel("stories260K.gguf"))
      assert.isDefined(spmVocabulary(file))
      const withMetadata = (key: string, change: (value: Array<unknown>) => void) => {
        const metadata = new Map(file.metadata)
        const value = [...(metadata.get(key) as Array<unknown>)]
        change(value)
        metadata.set(key, value as never)
        return { ...file, metadata }
      }
      assert.isUndefined(spmVocabulary(withMetadata("tokenizer.ggml.token_type", (types) => (types[300] = 4))))
      assert.isUndefined(spmVocabulary(withMetadata("tokenizer.ggml.token_type", (types) => (types[300] = 3))))
      assert.isUndefined(spmVocabulary(withMetadata("tokenizer.ggml.tokens", (tokens) => (tokens[300] = "<|im_end|>"))))
      assert.isUndefined(spmVocabulary(withMetadata("tokenizer.ggml.tokens", (tokens) => (tokens[10] = "<0x4G>"))))
      assert.isUndefined(
        spmVocabulary({ ...file, metadata: new Map([...file.metadata, ["tokenizer.ggml.model", "gpt2"]]) })
      )
    })
  )

  it.live(
    "the synthetic models' vocabulary",
    () =>
      Effect.gen(function* () {
        const path = join(dir, "synthetic.gguf")
        yield* writeSyntheticModel({
          path,
          arch: "llama",
          layers: 1,
          hidden: 64,
          ffn: 128,
          heads: 2,
          kvHeads: 2,
          vocab: 2000,
          contextLength: 256,
          type: "f32",
          seed: 3
        })
        yield* compare(path)
      }),
    60_000
  )
})
