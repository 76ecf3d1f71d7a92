/**
 * The serve command's tokenizer worker (a worker_threads thread): opens the model's vocabulary as the pipeline does
 * (TokenizerLive: the TypeScript SPM tokenizer, else node-llama-cpp; chat templates through node-llama-cpp) and
 * answers prompt tokenizing and chat rendering requests, so the server's event loop only passes messages while a
 * long prompt is tokenized (PromptTokenizer.ts is the other side, and says where this file is found in each way the
 * code runs). It starts itself when loaded in a worker whose `workerData` carries `tokenizeWorkerKey`.
 */
import { readlinkSync } from "node:fs"
import { setPriority } from "node:os"
import { isMainThread, parentPort, workerData } from "node:worker_threads"
import { Effect } from "effect"
import type { GgufFile } from "../../domain/gguf.js"
import { readModelHeader } from "../gguf/ModelSource.js"
import * as TokenizerLive from "../gguf/TokenizerLive.js"
import { type ChatMessage, type FormattedChat, Tokenizer } from "../../services/Tokenizer.js"
import type { ChatToolOptions } from "../../services/Tools.js"

/** `workerData[tokenizeWorkerKey]` = { modelPath } makes a worker thread this worker (src/main.ts checks it too). */
export const tokenizeWorkerKey = "swactorTokenizeWorker"

export interface TokenizeWorkerData {
  readonly modelPath: string
  /** This thread's nice value (Linux: a thread's own; 0 leaves it as it is). */
  readonly nice: number
}

/** What the server asks; `limit`: more prompt tokens than this come back as a count only (OverLimit). */
export type TokenizeWorkerRequest =
  | { readonly id: number; readonly op: "tokenize"; readonly text: string; readonly limit: number }
  | {
      readonly id: number
      readonly op: "chat"
      readonly messages: ReadonlyArray<ChatMessage>
      readonly limit: number
      readonly tools?: ChatToolOptions
    }

export type TokenizeWorkerReply =
  /** The vocabulary is open; `longestPieceBytes` as `longestPieceBytes` says (undefined: no cheap bound). */
  | { readonly _tag: "Ready"; readonly longestPieceBytes: number | undefined }
  | { readonly _tag: "OpenFailed"; readonly message: string }
  | { readonly _tag: "Tokens"; readonly id: number; readonly tokens: Int32Array }
  | {
      readonly _tag: "Chat"
      readonly id: number
      readonly tokens: Int32Array
      readonly stop: ReadonlyArray<string>
      readonly template: string
      readonly tools?: FormattedChat["tools"]
    }
  /** The chat cannot be rendered as asked (its tools): the request's fault. */
  | { readonly _tag: "BadChat"; readonly id: number; readonly message: string }
  | { readonly _tag: "OverLimit"; readonly id: number; readonly count: number }
  | { readonly _tag: "Failed"; readonly id: number; readonly message: string }

/**
 * The most UTF-8 bytes of text one token of this vocabulary can stand for, when the tokenizer keeps every byte of the
 * text it is given (so a text of n UTF-16 code units, at least n UTF-8 bytes, needs at least n / this many tokens):
 * SPM ("llama": spaces become "▁", 3 bytes, so the escaped text is only longer; byte-fallback tokens cover 1 byte) and
 * byte-level BPE ("gpt2": a stored piece has one character, of 1 or 2 UTF-8 bytes, per byte it covers). The longest
 * stored piece in UTF-8 bytes bounds both from above. Undefined for tokenizers that normalize text (WPM, UGM, ...),
 * which may drop characters.
 */
export const longestPieceBytes = (file: GgufFile): number | undefined => {
  const model = file.metadata.get("tokenizer.ggml.model")
  if (model !== "llama" && model !== "gpt2") return undefined
  const tokens = file.metadata.get("tokenizer.ggml.tokens")
  if (!Array.isArray(tokens) || tokens.length === 0) return undefined
  let longest = 1
  for (const token of tokens) {
    if (typeof token !== "string") return undefined
    longest = Math.max(longest, Buffer.byteLength(token, "utf8"))
  }
  return longest
}

const words = (cause: unknown) =>
  cause instanceof Error
    ? cause.message
    : typeof cause === "object" && cause !== null && "message" in cause
      ? String(cause.message)
      : String(cause)

/** Serves requests on `parentPort` until the thread is terminated. */
export const runTokenizeWorker = (data: TokenizeWorkerData): Promise<void> => {
  const port = parentPort!
  if (data.nice !== 0) {
    try {
      // /proc/thread-self is PID/task/TID; setpriority on a TID sets that thread's nice value only (Linux).
      setPriority(Number(readlinkSync("/proc/thread-self").split("/").at(-1)), data.nice)
    } catch {
      // not Linux, or not allowed: the same work at the same priority
    }
  }
  const post = (reply: TokenizeWorkerReply, transfer: ReadonlyArray<ArrayBuffer> = []) =>
    port.postMessage(reply, [...transfer])
  const tokens = (array: ReadonlyArray<number>) => Int32Array.from(array)
  return Effect.runPromise(
    Effect.gen(function* () {
      const vocabulary = yield* (yield* Tokenizer).open(data.modelPath)
      const file = yield* readModelHeader(data.modelPath)
      post({ _tag: "Ready", longestPieceBytes: longestPieceBytes(file) })
      yield* Effect.async<never>(() => {
        port.on("message", (request: TokenizeWorkerRequest) => {
          if (request.op === "tokenize") {
            try {
              const out = vocabulary.tokenize(request.text)
              if (out.length > request.limit) post({ _tag: "OverLimit", id: request.id, count: out.length })
              else {
                const array = tokens(out)
                post({ _tag: "Tokens", id: request.id, tokens: array }, [array.buffer as ArrayBuffer])
              }
            } catch (cause) {
              post({ _tag: "Failed", id: request.id, message: `tokenizing failed: ${words(cause)}` })
            }
            return
          }
          Effect.runPromise(Effect.either(vocabulary.formatChat(request.messages, request.tools)))
            .then((either) => {
              if (either._tag === "Right") return either.right
              if (either.left._tag === "ChatRenderError") {
                post({ _tag: "BadChat", id: request.id, message: either.left.message })
                return undefined
              }
              throw either.left
            })
            .then(
              (chat) => {
                if (chat === undefined) return
                if (chat.tokens.length > request.limit)
                  return post({ _tag: "OverLimit", id: request.id, count: chat.tokens.length })
                const array = tokens(chat.tokens)
                post(
                  {
                    _tag: "Chat",
                    id: request.id,
                    tokens: array,
                    stop: chat.stop,
                    template: chat.template,
                    ...(chat.tools === undefined ? {} : { tools: chat.tools })
                  },
                  [array.buffer as ArrayBuffer]
                )
              },
              (cause) => post({ _tag: "Failed", id: request.id, message: `rendering the chat failed: ${words(cause)}` })
            )
        })
      })
    }).pipe(
      Effect.scoped,
      Effect.provide(TokenizerLive.layer),
      Effect.catchAll((error) =>
        Effect.sync(() => {
          // Nothing listens any more: the thread ends once this message is out (the server also terminates it).
          post({ _tag: "OpenFailed", message: `cannot open the vocabulary of ${data.modelPath}: ${words(error)}` })
        })
      )
    )
  )
}

const asked = isMainThread ? undefined : (workerData as Record<string, TokenizeWorkerData> | null)?.[tokenizeWorkerKey]
if (asked !== undefined) void runTokenizeWorker(asked)
