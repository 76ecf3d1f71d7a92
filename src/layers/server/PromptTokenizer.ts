/**
 * Prompt tokenizing and chat rendering for the server, bounded by a prompt-token limit: on worker threads
 * (TokenizeWorker.ts, `layerWorker`: a short lane and a long lane), so a long prompt never holds up the event loop that
 * streams other requests' tokens, nor a short prompt's tokenizing, or in the calling thread (`inThread`, over the pipeline's own vocabulary: the server's fallback when no
 * worker is provided, e.g. over a test tokenizer). Both refuse a prompt over the limit with its count; the worker's
 * side first refuses, without tokenizing, a text whose length alone guarantees too many tokens (TokenizeWorker's
 * `longestPieceBytes`), so the work and memory a request can cause follow the limit, not the body's size.
 *
 * Where the worker's script is, in each way the code runs:
 * - the built command (dist/main.js running the bundle dist/swactor.cjs; CliEntry says so): dist/main.js itself,
 *   whose bundle (src/main.ts) runs TokenizeWorker when `workerData` carries its key;
 * - the compiled library (dist/layers/server/*.js): TokenizeWorker.js beside this module;
 * - sources (.ts, under vitest or tsx): TokenizeWorker.ts beside this module, loaded through tsx's ESM loader that the
 *   worker registers first (tsx is a devDependency: only sources need it).
 *
 * A worker that dies (or could not open the vocabulary) fails the requests it held with TokenizerUnavailable; the next
 * request starts a new one. The worker ends with the layer's scope; it never keeps the process alive (unref).
 */
import { createRequire } from "node:module"
import { pathToFileURL } from "node:url"
import { Worker, type WorkerOptions } from "node:worker_threads"
import { Context, Data, Effect, Layer } from "effect"
import { cliEntry } from "../agent/CliEntry.js"
import { type ChatMessage, ChatRenderError, type FormattedChat, type ModelTokenizer } from "../../services/Tokenizer.js"
import type { ChatToolOptions } from "../../services/Tools.js"
import {
  type TokenizeWorkerData,
  tokenizeWorkerKey,
  type TokenizeWorkerReply,
  type TokenizeWorkerRequest
} from "./TokenizeWorker.js"

/** More prompt tokens than the limit: `tokens` exactly, or at least (`atLeast`, known from the text's length alone). */
export class PromptTooLong extends Data.TaggedError("PromptTooLong")<{
  readonly tokens: number
  readonly atLeast: boolean
  readonly limit: number
}> {}

/** A tokenizer worker could not answer (it died, or could not open the vocabulary); a later request starts another. */
export class TokenizerUnavailable extends Data.TaggedError("TokenizerUnavailable")<{ readonly message: string }> {}

export interface PromptTokenizerService {
  /** Prompt text to token ids (BOS as the model wants), or PromptTooLong when there are more than `limit`. */
  readonly tokenize: (
    text: string,
    limit: number
  ) => Effect.Effect<ReadonlyArray<number>, PromptTooLong | TokenizerUnavailable>
  /**
   * Messages (and tools) through the model's chat template, or PromptTooLong when the rendered chat has more than
   * `limit` tokens (ChatRenderError: the tools cannot be rendered as asked).
   */
  readonly formatChat: (
    messages: ReadonlyArray<ChatMessage>,
    limit: number,
    tools?: ChatToolOptions
  ) => Effect.Effect<FormattedChat, PromptTooLong | TokenizerUnavailable | ChatRenderError>
}

export class PromptTokenizer extends Context.Tag("swactor/PromptTokenizer")<
  PromptTokenizer,
  PromptTokenizerService
>() {}

const words = (cause: unknown) =>
  typeof cause === "object" && cause !== null && "message" in cause ? String(cause.message) : String(cause)

/** Over the vocabulary in this thread (blocks it while it tokenizes): the exact count checked after. */
export const inThread = (vocabulary: ModelTokenizer): PromptTokenizerService => ({
  tokenize: (text, limit) =>
    Effect.suspend(() => {
      const tokens = vocabulary.tokenize(text)
      return tokens.length > limit
        ? Effect.fail(new PromptTooLong({ tokens: tokens.length, atLeast: false, limit }))
        : Effect.succeed(tokens)
    }),
  formatChat: (messages, limit, tools) =>
    vocabulary.formatChat(messages, tools).pipe(
      Effect.mapError((error) =>
        error._tag === "ChatRenderError"
          ? error
          : new TokenizerUnavailable({ message: `rendering the chat failed: ${error.message}` })
      ),
      Effect.filterOrFail(
        (chat) => chat.tokens.length <= limit,
        (chat) => new PromptTooLong({ tokens: chat.tokens.length, atLeast: false, limit })
      )
    )
})

/** The script and options that start a TokenizeWorker thread from this module, as the code runs (see the top). */
export const workerStart = (): { readonly script: string | URL; readonly options: WorkerOptions } => {
  const entry = cliEntry()
  if (entry !== undefined) return { script: entry, options: {} }
  const here = import.meta.url
  if (!here.endsWith(".ts")) return { script: new URL("./TokenizeWorker.js", here), options: {} }
  const tsx = pathToFileURL(createRequire(here).resolve("tsx/esm/api")).href
  const worker = new URL("./TokenizeWorker.ts", here).href
  // (`import (` with a space: scripts/build.mjs rewrites or flags every `import(` it finds in the bundle's code.)
  return {
    script: `import (${JSON.stringify(tsx)}).then((m) => { (m.register ?? m.default.register)(); return import (${JSON.stringify(worker)}) })`,
    options: { eval: true }
  }
}

/** The reply to one request, or why there is none. */
type Answer =
  Exclude<TokenizeWorkerReply, { _tag: "Ready" | "OpenFailed" }> | { readonly _tag: "Gone"; readonly message: string }

interface Running {
  readonly worker: Worker
  readonly pending: Map<number, (answer: Answer) => void>
  /** Its `longestPieceBytes` once the vocabulary is open (undefined also when it failed before). */
  readonly ready: Promise<number | undefined>
}

/** Which worker a request goes to: texts (a chat's messages together) of up to this many characters are short. */
export const shortTextCharacters = 8192

/** Lower than the server's own threads and its agents (nice 10, Linux): a long prompt takes only idle CPU. */
const longLaneNice = 10

export type Lane = "short" | "long"

/** The worker client's state: its lanes' workers, whether the scope closed, the next request's id, the cheap bound. */
interface Pool {
  readonly modelPath: string
  readonly onWorker: ((worker: Worker, lane: Lane) => void) | undefined
  readonly lanes: Record<Lane, Running | undefined>
  closed: boolean
  nextId: number
  longest: number | undefined
}

/** A lane's worker thread, started now: its replies answer its pending requests; its exit answers the rest Gone. */
const start = (pool: Pool, lane: Lane): Running => {
  const { options, script } = workerStart()
  const data: TokenizeWorkerData = { modelPath: pool.modelPath, nice: lane === "long" ? longLaneNice : 0 }
  const worker = new Worker(script, { ...options, workerData: { [tokenizeWorkerKey]: data } })
  worker.unref()
  pool.onWorker?.(worker, lane)
  let opened: (longest: number | undefined) => void = () => {}
  const running: Running = { worker, pending: new Map(), ready: new Promise((resolve) => (opened = resolve)) }
  let why = "the tokenizer worker stopped"
  worker.on("message", (reply: TokenizeWorkerReply) => {
    if (reply._tag === "Ready") {
      pool.longest = reply.longestPieceBytes
      opened(pool.longest)
    } else if (reply._tag === "OpenFailed") {
      why = reply.message
      opened(undefined)
      void worker.terminate()
    } else {
      const answer = running.pending.get(reply.id)
      running.pending.delete(reply.id)
      answer?.(reply)
    }
  })
  worker.on("error", (error) => (why = `the tokenizer worker failed: ${words(error)}`))
  worker.on("exit", (code) => {
    if (pool.lanes[lane] === running) pool.lanes[lane] = undefined
    opened(undefined)
    const message = pool.closed
      ? "the server is stopping"
      : `${why} (exit code ${code}); the next request starts a new one`
    for (const answer of running.pending.values()) answer({ _tag: "Gone", message })
    running.pending.clear()
  })
  return running
}

/** The lane's worker, started when it has none. */
const running = (pool: Pool, lane: Lane) => pool.lanes[lane] ?? (pool.lanes[lane] = start(pool, lane))

const ask = (pool: Pool, characters: number, request: (id: number) => TokenizeWorkerRequest) =>
  Effect.async<Answer, TokenizerUnavailable>((resume) => {
    if (pool.closed) return resume(Effect.fail(new TokenizerUnavailable({ message: "the server is stopping" })))
    const worker = running(pool, characters <= shortTextCharacters ? "short" : "long")
    const id = pool.nextId++
    worker.pending.set(id, (answer) =>
      resume(
        answer._tag === "Gone"
          ? Effect.fail(new TokenizerUnavailable({ message: answer.message }))
          : Effect.succeed(answer)
      )
    )
    worker.worker.postMessage(request(id))
    // Interrupted (the client went away): its answer, when it comes, is dropped.
    return Effect.sync(() => worker.pending.delete(id))
  })

/** Fails when a text of `characters` UTF-16 code units is sure to be more than `limit` tokens. */
const precheck = (pool: Pool, characters: number, limit: number) =>
  Effect.flatMap(
    pool.longest !== undefined || pool.closed
      ? Effect.succeed(pool.longest)
      : Effect.promise(() => running(pool, "short").ready),
    (longest) => {
      const atLeast = longest === undefined ? 0 : Math.ceil(characters / longest)
      return atLeast > limit ? Effect.fail(new PromptTooLong({ tokens: atLeast, atLeast: true, limit })) : Effect.void
    }
  )

const answered = <A>(answer: Answer, limit: number, ok: (answer: Answer) => A | undefined) =>
  Effect.suspend((): Effect.Effect<A, PromptTooLong | TokenizerUnavailable | ChatRenderError> => {
    if (answer._tag === "BadChat") return Effect.fail(new ChatRenderError({ message: answer.message }))
    if (answer._tag === "OverLimit")
      return Effect.fail(new PromptTooLong({ tokens: answer.count, atLeast: false, limit }))
    if (answer._tag === "Failed" || answer._tag === "Gone")
      return Effect.fail(new TokenizerUnavailable({ message: answer.message }))
    const value = ok(answer)
    return value === undefined
      ? Effect.fail(new TokenizerUnavailable({ message: `the tokenizer worker answered ${answer._tag} out of turn` }))
      : Effect.succeed(value)
  })

const tokenize =
  (pool: Pool): PromptTokenizerService["tokenize"] =>
  (text, limit) =>
    precheck(pool, text.length, limit).pipe(
      Effect.zipRight(ask(pool, text.length, (id) => ({ id, op: "tokenize", text, limit }))),
      Effect.flatMap((answer) =>
        answered(answer, limit, (a) => (a._tag === "Tokens" ? Array.from(a.tokens) : undefined))
      ),
      Effect.catchTag("ChatRenderError", (error) => Effect.fail(new TokenizerUnavailable({ message: error.message })))
    )

// Only the users' messages count for the cheap bound: a template may leave out a system message or an earlier
// assistant turn (or part of it), never what the user said.
const formatChat =
  (pool: Pool): PromptTokenizerService["formatChat"] =>
  (messages, limit, tools) =>
    precheck(
      pool,
      messages.reduce((sum, m) => sum + (m.role === "user" ? m.content.length : 0), 0),
      limit
    ).pipe(
      Effect.zipRight(
        ask(
          pool,
          messages.reduce((sum, m) => sum + m.content.length, 0),
          (id) => ({ id, op: "chat", messages, limit, ...(tools === undefined ? {} : { tools }) })
        )
      ),
      Effect.flatMap((answer) =>
        answered(answer, limit, (a) =>
          a._tag === "Chat"
            ? {
                tokens: Array.from(a.tokens),
                stop: a.stop,
                template: a.template,
                ...(a.tools === undefined ? {} : { tools: a.tools })
              }
            : undefined
        )
      )
    )

/**
 * Two worker threads, each opening the vocabulary: the short lane (started at once, while the pipeline loads) for texts
 * up to `shortTextCharacters` (a few milliseconds of work each), the long lane (started on the first long text, at a
 * lower CPU priority) for the rest, so a short request never waits behind a long one. Both end with the scope.
 * `longest`: a worker's `longestPieceBytes` once one reported it (the model does not change), the cheap bound.
 */
const makeWorkerClient = (modelPath: string, onWorker?: (worker: Worker, lane: Lane) => void) =>
  Effect.gen(function* () {
    const pool: Pool = {
      modelPath,
      onWorker,
      lanes: { short: undefined, long: undefined },
      closed: false,
      nextId: 0,
      longest: undefined
    }
    yield* Effect.acquireRelease(
      Effect.sync(() => running(pool, "short")),
      () =>
        Effect.promise(async () => {
          pool.closed = true
          const all = [pool.lanes.short, pool.lanes.long]
          pool.lanes.short = pool.lanes.long = undefined
          await Promise.all(all.map((r) => r?.worker.terminate()))
        })
    )
    const service: PromptTokenizerService = { tokenize: tokenize(pool), formatChat: formatChat(pool) }
    return service
  })

/**
 * Prompts tokenized and chats rendered on worker threads that open `modelPath`'s vocabulary; `onWorker` sees each
 * worker started, and its lane (tests).
 */
export const layerWorker = (
  modelPath: string,
  options: { readonly onWorker?: (worker: Worker, lane: Lane) => void } = {}
): Layer.Layer<PromptTokenizer> => Layer.scoped(PromptTokenizer, makeWorkerClient(modelPath, options.onWorker))
