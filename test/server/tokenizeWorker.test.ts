// The serve command's tokenizer worker (src/layers/server/PromptTokenizer.ts + TokenizeWorker.ts, a worker_threads
// thread started here from the .ts sources through tsx) against the tokenizer in this thread (TokenizerLive, what the
// pipeline itself uses): the same ids for several texts (multi-byte, spaces, byte fallback) and the same rendered chat;
// the prompt-token limit, exactly after tokenizing and from the text's length alone before it; a worker that dies
// fails what it held and the next request starts another; the worker ends with its scope.
import { assert, describe, it } from "@effect/vitest"
import { Context, Effect, Either, Layer } from "effect"
import type { Worker } from "node:worker_threads"
import { readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import * as TokenizerLive from "../../src/layers/gguf/TokenizerLive.js"
import {
  type Lane,
  layerWorker,
  PromptTokenizer,
  type PromptTooLong,
  shortTextCharacters
} from "../../src/layers/server/PromptTokenizer.js"
import { longestPieceBytes } from "../../src/layers/server/TokenizeWorker.js"
import type { ChatMessage } from "../../src/services/Tokenizer.js"
import { Tokenizer } from "../../src/services/Tokenizer.js"
import { requireModel } from "../support/models.js"
import { untilTrue } from "../support/until.js"

const texts = [
  "Once upon a time",
  "Once upon a time, there was a little girl named Lily. She loved to play outside.",
  "  two leading spaces and\ttabs\nnew\n\nlines ",
  "日本語のテキスト",
  "émojis 😀🎉 and accents àéîõü",
  "<s> is not BOS here </s> <unk> <0x41>",
  "a",
  "x".repeat(5000) + " Lily ".repeat(500)
]

const chat: ReadonlyArray<ChatMessage> = [
  { role: "system", content: "You are a storyteller." },
  { role: "user", content: "Tell me about Lily 🌼." },
  { role: "assistant", content: "Once upon a time, Lily found a flower." },
  { role: "user", content: "And then?" }
]

const model = () => requireModel("stories260K.gguf")
const fields = (e: PromptTooLong | { readonly _tag: string }): Record<string, unknown> => ({ ...e })

/** The worker's tokenizer and the in-thread one over the same model, with every worker the layer started. */
const both = (workers: Array<{ worker: Worker; lane: Lane }>) =>
  Effect.gen(function* () {
    const context = yield* Layer.build(
      Layer.merge(
        TokenizerLive.layer,
        layerWorker(model(), { onWorker: (worker, lane) => workers.push({ worker, lane }) })
      )
    )
    const inThread = yield* Context.get(context, Tokenizer).open(model())
    return { inThread, worker: Context.get(context, PromptTokenizer) }
  })

describe("tokenizer worker", () => {
  it.scoped("tokens and chats equal the in-thread tokenizer's", () =>
    Effect.gen(function* () {
      const { inThread, worker } = yield* both([])
      for (const text of texts) {
        const off = yield* worker.tokenize(text, 1_000_000)
        assert.deepStrictEqual(off, [...inThread.tokenize(text)], JSON.stringify(text.slice(0, 40)))
      }
      const offChat = yield* worker.formatChat(chat, 1_000_000)
      const inChat = yield* inThread.formatChat(chat)
      assert.deepStrictEqual(offChat, { tokens: [...inChat.tokens], stop: [...inChat.stop], template: inChat.template })
      assert.isAbove(offChat.tokens.length, 10)
    })
  )

  it.scoped("over the limit: the exact count after tokenizing; a text too long by its length alone, before", () =>
    Effect.gen(function* () {
      const { inThread, worker } = yield* both([])
      const text = texts[1]!
      const count = inThread.tokenize(text).length
      assert.deepStrictEqual(yield* worker.tokenize(text, count), [...inThread.tokenize(text)])
      const over = yield* Effect.either(worker.tokenize(text, count - 1))
      assert.deepStrictEqual(
        Either.getLeft(over).pipe((e) => (e._tag === "Some" ? fields(e.value) : undefined)),
        {
          _tag: "PromptTooLong",
          tokens: count,
          atLeast: false,
          limit: count - 1
        }
      )
      // stories260K: no token stands for more than 9 bytes, so 20 MB of text is at least 20e6 / 9 tokens. Refused at
      // once (no tokenizing: the in-thread tokenizer takes ~1.4 s per MB).
      const longest = longestPieceBytes(yield* readGgufFile(model()))
      assert.strictEqual(longest, 9)
      const huge = "Once upon a time ".repeat(1_200_000)
      const startedAt = performance.now()
      const refused = yield* Effect.flip(worker.tokenize(huge, 2048))
      assert.isBelow(performance.now() - startedAt, 200)
      assert.deepStrictEqual(fields(refused), {
        _tag: "PromptTooLong",
        tokens: Math.ceil(huge.length / 9),
        atLeast: true,
        limit: 2048
      })
      // A chat counts its users' words for the cheap bound; rendered, the exact count.
      const hugeChat = yield* Effect.flip(worker.formatChat([{ role: "user", content: huge }], 2048))
      assert.deepStrictEqual(fields(hugeChat), {
        _tag: "PromptTooLong",
        tokens: Math.ceil(huge.length / 9),
        atLeast: true,
        limit: 2048
      })
      const chatTokens = (yield* inThread.formatChat(chat)).tokens.length
      const overChat = yield* Effect.flip(worker.formatChat(chat, chatTokens - 1))
      assert.deepStrictEqual(fields(overChat), {
        _tag: "PromptTooLong",
        tokens: chatTokens,
        atLeast: false,
        limit: chatTokens - 1
      })
    })
  )

  it.live(
    "lanes: a short text is answered while a long one is tokenized; a worker that dies fails what it held, the next request starts another; the scope ends them",
    () =>
      Effect.gen(function* () {
        const workers: Array<{ worker: Worker; lane: Lane }> = []
        const exited: Array<string> = []
        yield* Effect.gen(function* () {
          const { inThread, worker } = yield* both(workers)
          assert.deepStrictEqual(yield* worker.tokenize("Once upon a time", 100), [
            ...inThread.tokenize("Once upon a time")
          ])
          assert.deepStrictEqual(
            workers.map((w) => w.lane),
            ["short"]
          )
          // A long text (~1 s of tokenizing) goes to the long lane; meanwhile a short one is answered at once.
          const held = yield* Effect.fork(Effect.either(worker.tokenize("Lily ".repeat(400_000), 10_000_000)))
          yield* untilTrue("the long lane's worker to start", () => workers.length === 2)
          assert.deepStrictEqual(yield* worker.tokenize(texts[3]!, 100), [...inThread.tokenize(texts[3]!)])
          assert.isNull(held.unsafePoll())
          assert.deepStrictEqual(
            workers.map((w) => w.lane),
            ["short", "long"]
          )
          for (const { lane, worker: w } of workers) w.on("exit", () => exited.push(lane))
          // The long lane's worker killed while it works: that request fails in words, nothing else does.
          yield* Effect.promise(() => workers[1]!.worker.terminate())
          const failed = yield* held.await.pipe(Effect.flatten)
          const error = Either.getLeft(failed).pipe((e) => (e._tag === "Some" ? e.value : undefined))
          assert.strictEqual(error?._tag, "TokenizerUnavailable")
          const unavailable = error?._tag === "TokenizerUnavailable" ? error.message : ""
          // (its exit code: 1 for a terminate, 0 when the thread was inside the native tokenizer: Node 20 reports either)
          assert.match(
            unavailable,
            /^the tokenizer worker stopped \(exit code \d+\); the next request starts a new one$/,
            unavailable
          )
          // The next long request: a fresh worker, the same tokens.
          const long = texts[7]!.repeat(2)
          assert.isAbove(long.length, shortTextCharacters)
          assert.deepStrictEqual(yield* worker.tokenize(long, 100_000), [...inThread.tokenize(long)])
          assert.deepStrictEqual(
            workers.map((w) => w.lane),
            ["short", "long", "long"]
          )
          workers[2]!.worker.on("exit", () => exited.push("long"))
          assert.deepStrictEqual(exited, ["long"])
        }).pipe(Effect.scoped)
        // The scope closed: the workers still running were terminated with it.
        assert.deepStrictEqual(exited.sort(), ["long", "long", "short"])
      })
  )
})
