import { Effect, Layer, Option, Scope } from "effect"
import { readGgufFile } from "./GgufReader.js"
import { makeSpmTokenizer, type SpmVocabulary, spmVocabulary } from "./SpmTokenizer.js"
import {
  type ChatMessage,
  type FormattedChat,
  makeIncrementalDecoder,
  type ModelTokenizer,
  Tokenizer,
  TokenizerError,
  type TokenizerService
} from "../../services/Tokenizer.js"

type NodeLlamaCpp = typeof import("node-llama-cpp")
type Llama = Awaited<ReturnType<NodeLlamaCpp["getLlama"]>>
type LlamaModel = Awaited<ReturnType<Llama["loadModel"]>>

type ChatHistoryItem = import("node-llama-cpp").ChatHistoryItem

/**
 * The model's chat template through node-llama-cpp: the GGUF's own template (a known wrapper, or its Jinja
 * template), else the wrapper node-llama-cpp picks for the architecture, else its general wrapper.
 */
const chatFormatter = (lib: NodeLlamaCpp, model: LlamaModel) => {
  let wrapper: NonNullable<ReturnType<NodeLlamaCpp["resolveChatWrapper"]>> | undefined
  const resolve = () => (wrapper ??= lib.resolveChatWrapper(model) ?? new lib.GeneralChatWrapper())
  return (messages: ReadonlyArray<ChatMessage>): FormattedChat => {
    const chat = resolve()
    const history: Array<ChatHistoryItem> = messages.map((m): ChatHistoryItem =>
      m.role === "system"
        ? { type: "system", text: m.content }
        : m.role === "user"
        ? { type: "user", text: m.content }
        : { type: "model", response: [m.content] }
    )
    history.push({ type: "model", response: [] })
    const state = chat.generateContextState({ chatHistory: history })
    const stop = state.stopGenerationTriggers.flatMap((trigger) =>
      trigger.values.every((v) => typeof v === "string") ? [trigger.values.join("")] : []
    ).filter((text) => text !== "")
    return {
      tokens: [...state.contextText.tokenize(model.tokenizer)] as Array<number>,
      stop,
      template: chat.wrapperName
    }
  }
}

const fromModel = (
  model: LlamaModel,
  lib: NodeLlamaCpp
): Omit<ModelTokenizer, "formatChat"> & { readonly chat: ReturnType<typeof chatFormatter> } => {
  const bos = model.tokens.bos ?? undefined
  const eos = model.tokens.eos ?? undefined
  const addsBos = bos !== undefined && model.tokens.shouldPrependBosToken
  const detokenize = (tokens: ReadonlyArray<number>, context?: ReadonlyArray<number>) =>
    model.detokenize(tokens as Array<never>, false, context as Array<never> | undefined)
  let vocabSize = 0
  for (const _ of model.iterateAllTokens()) vocabSize++
  return {
    vocabSize,
    bosTokenId: bos as number | undefined,
    eosTokenId: eos as number | undefined,
    addsBos,
    tokenize: (text) => {
      const tokens = model.tokenize(text) as ReadonlyArray<number>
      return addsBos ? [bos as number, ...tokens] : [...tokens]
    },
    detokenize,
    isEndOfGeneration: (token) => model.isEogToken(token as never),
    decoder: (context) => makeIncrementalDecoder(detokenize, context),
    chat: chatFormatter(lib, model)
  }
}

/** The TypeScript SPM tokenizer (SpmTokenizer.ts) for what a run needs; the chat template still from node-llama-cpp. */
const fromSpm = (
  vocab: SpmVocabulary,
  chat: Effect.Effect<ReturnType<typeof chatFormatter>, TokenizerError>
): ModelTokenizer => {
  const spm = makeSpmTokenizer(vocab)
  return {
    vocabSize: spm.vocabSize,
    bosTokenId: vocab.bos,
    eosTokenId: vocab.eos,
    addsBos: vocab.addBos,
    tokenize: (text) => (vocab.addBos ? [vocab.bos, ...spm.tokenize(text)] : spm.tokenize(text)),
    detokenize: spm.detokenize,
    isEndOfGeneration: (token) => token === vocab.eos,
    decoder: (context) => makeIncrementalDecoder(spm.detokenize, context),
    formatChat: (messages) => Effect.map(chat, (format) => format(messages))
  }
}

/**
 * SPM vocabularies in TypeScript (SpmTokenizer.ts); the others, and chat templates, through vocabulary-only loads with
 * node-llama-cpp's prebuilt CPU binary (never compiles, no GPU).
 */
export const layer: Layer.Layer<Tokenizer> = Layer.scoped(
  Tokenizer,
  Effect.gen(function*() {
    const layerScope = yield* Effect.scope
    const llama = yield* Effect.cached(
      Effect.acquireRelease(
        Effect.promise(async () => {
          const lib = await import("node-llama-cpp")
          return { lib, llama: await lib.getLlama({ gpu: false, build: "never", logLevel: lib.LlamaLogLevel.error }) }
        }),
        ({ llama }) => Effect.promise(() => llama.dispose())
      ).pipe(Scope.extend(layerScope))
    )
    const loadModel = (modelPath: string) =>
      Effect.gen(function*() {
        const { lib, llama: instance } = yield* llama
        const model = yield* Effect.acquireRelease(
          Effect.tryPromise({
            try: () => instance.loadModel({ modelPath, vocabOnly: true }),
            catch: (cause) =>
              new TokenizerError({ path: modelPath, message: cause instanceof Error ? cause.message : String(cause) })
          }),
          (model) => Effect.promise(() => model.dispose())
        )
        return fromModel(model, lib)
      })
    const service: TokenizerService = {
      open: (modelPath) =>
        Effect.gen(function*() {
          // An SPM vocabulary this package tokenizes exactly as llama.cpp (SpmTokenizer.ts): node-llama-cpp, ~0.7 s of
          // CPU to import and check its binary, is then loaded only for a chat template. Any other: node-llama-cpp.
          const file = yield* Effect.option(readGgufFile(modelPath))
          const vocab = Option.isSome(file) ? spmVocabulary(file.value) : undefined
          if (vocab !== undefined) {
            const openScope = yield* Effect.scope
            const chat = yield* Effect.cached(Effect.map(loadModel(modelPath).pipe(Scope.extend(openScope)), (m) => m.chat))
            return fromSpm(vocab, chat)
          }
          const { chat, ...tokenizer } = yield* loadModel(modelPath)
          return {
            ...tokenizer,
            formatChat: (messages: ReadonlyArray<ChatMessage>) => Effect.sync(() => chat(messages))
          } satisfies ModelTokenizer
        }).pipe(Effect.withSpan("Tokenizer.open", { attributes: { modelPath } }))
    }
    return service
  })
)

/**
 * A deterministic stand-in: token 1 = BOS, 2 = EOS, 3 + byte for every UTF-8 byte of the text.
 * Multi-byte characters span several tokens, which exercises incremental decoding.
 */
export const layerTest: Layer.Layer<Tokenizer> = Layer.succeed(Tokenizer, {
  open: (_modelPath) => Effect.succeed(byteTokenizer)
})

const decoder = new TextDecoder("utf-8")
const encoder = new TextEncoder()

export const byteTokenizer: ModelTokenizer = {
  vocabSize: 259,
  bosTokenId: 1,
  eosTokenId: 2,
  addsBos: true,
  tokenize: (text) => [1, ...Array.from(encoder.encode(text), (byte) => byte + 3)],
  detokenize: (tokens) => decoder.decode(Uint8Array.from(tokens.filter((token) => token >= 3), (token) => token - 3)),
  isEndOfGeneration: (token) => token === 2,
  decoder: (context) => makeIncrementalDecoder((tokens) => byteTokenizer.detokenize(tokens), context),
  // The test double's own plain rendering (no model template to follow).
  formatChat: (messages) =>
    Effect.succeed({
      tokens: byteTokenizer.tokenize(`${messages.map((m) => `${m.role}: ${m.content}\n`).join("")}assistant:`),
      stop: ["\nuser:"],
      template: "test"
    })
}
