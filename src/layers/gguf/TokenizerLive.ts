import { Effect, Layer, Option, Scope } from "effect"
import { readGgufFile } from "./GgufReader.js"
import { localMetadataFile } from "./ModelSource.js"
import { makeSpmTokenizer, type SpmVocabulary, spmVocabulary } from "./SpmTokenizer.js"
import { jsonSchemaGrammar } from "../server/JsonGrammar.js"
import { genericToolMessages, toolGrammarEffect, toolsAllowed } from "../server/ToolCalls.js"
import type { ChatToolOptions, ToolSyntax } from "../../services/Tools.js"
import {
  type ChatMessage,
  ChatRenderError,
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

type Wrapper = NonNullable<ReturnType<NodeLlamaCpp["resolveChatWrapper"]>>
type SettingText = Wrapper["settings"]["functions"]["call"]["prefix"] | undefined

/**
 * A chat wrapper's setting as the text a reply holds: special tokens' text as it is, cut at the first built-in
 * special token (EOS...) or at the first of `stops` (texts that end the turn, which never reach the reply).
 */
const settingText = (
  lib: NodeLlamaCpp,
  value: SettingText,
  stops: ReadonlyArray<string>,
  model?: LlamaModel
): string => {
  if (value === undefined) return ""
  let out = ""
  for (const v of lib.LlamaText(value).values) {
    if (typeof v === "string") out += v
    else if (v instanceof lib.SpecialTokensText) {
      // Up to the model's first end-of-generation token in it (e.g. Llama 3.1's <|eom_id|>): it ends the reply.
      const tokens = model?.tokenize(v.value, true) ?? []
      const end = tokens.findIndex((token) => model!.isEogToken(token))
      if (end < 0) out += v.value
      else {
        out += model!.detokenize(tokens.slice(0, end), true)
        return cutAtStops(out, stops)
      }
    } else break
  }
  return cutAtStops(out, stops)
}

const cutAtStops = (out: string, stops: ReadonlyArray<string>) => {
  const cut = stops.reduce((end, stop) => {
    const at = stop === "" ? -1 : out.indexOf(stop)
    return at < 0 ? end : Math.min(end, at)
  }, out.length)
  return out.slice(0, cut)
}

/**
 * How the wrapper's template writes calls (its `settings.functions`); Generic when the template knows no tools
 * (a Jinja template node-llama-cpp found no call syntax in, or a wrapper with node-llama-cpp's own default syntax).
 */
const toolSyntaxOf = (
  lib: NodeLlamaCpp,
  wrapper: Wrapper,
  stops: ReadonlyArray<string>,
  model?: LlamaModel
): ToolSyntax => {
  const functions = wrapper.settings.functions
  const generic =
    (wrapper instanceof lib.JinjaTemplateChatWrapper && !wrapper.usingJinjaFunctionCallTemplate) ||
    settingText(lib, functions.call.prefix, []) ===
      settingText(lib, lib.ChatWrapper.defaultSettings.functions.call.prefix, [])
  if (generic) return { _tag: "Generic", parallel: true }
  const text = (value: SettingText) => settingText(lib, value, stops, model)
  const section = functions.parallelism?.call
  return {
    _tag: "Family",
    wrapper: wrapper.wrapperName,
    callPrefix: text(functions.call.prefix),
    alternatePrefixes: (functions.call.prefixAlternateMatches ?? []).map(text).filter((p) => p.trim() !== ""),
    paramsPrefix: text(functions.call.paramsPrefix),
    callSuffix: text(functions.call.suffix),
    parallel: section !== undefined,
    sectionPrefix: text(section?.sectionPrefix),
    betweenCalls: text(section?.betweenCalls),
    sectionSuffix: text(section?.sectionSuffix)
  }
}

const parsedOr = (text: string): unknown => {
  try {
    return JSON.parse(text)
  } catch {
    return text
  }
}

/**
 * node-llama-cpp's chat history for messages with tool calls: an assistant's calls are function-call items of its
 * model turn, each with the result of the tool message that answers it; a turn stays open through its tool results
 * (and an assistant message after them), so a chat ending in a tool result continues that turn.
 */
const historyOf = (messages: ReadonlyArray<ChatMessage>): Array<ChatHistoryItem> => {
  const results = new Map(
    messages.flatMap((m) =>
      m.role === "tool" && m.toolCallId !== undefined ? [[m.toolCallId, m.content] as const] : []
    )
  )
  const history: Array<ChatHistoryItem> = []
  let turn: Extract<ChatHistoryItem, { type: "model" }> | undefined
  for (const m of messages) {
    if (m.role === "system" || m.role === "user") {
      history.push(m.role === "system" ? { type: "system", text: m.content } : { type: "user", text: m.content })
      turn = undefined
    } else if (m.role === "assistant") {
      if (turn === undefined) history.push((turn = { type: "model", response: [] }))
      if (m.content !== "") turn.response.push(m.content)
      ;(m.toolCalls ?? []).forEach((call, index) => {
        const result = results.get(call.id)
        turn!.response.push({
          type: "functionCall",
          name: call.name,
          params: parsedOr(call.arguments),
          result: result === undefined ? undefined : parsedOr(result),
          startsNewChunk: index === 0
        })
      })
    }
  }
  if (messages.at(-1)?.role !== "tool" || turn === undefined) history.push({ type: "model", response: [] })
  return history
}

/**
 * Whether the wrapper is the GGUF's own Jinja template of MiniMax-M2 (M2, M2.1, M2.5: it writes `<minimax:tool_call>`;
 * M3's namespaced tags are another format). Its calls are XML with one `<parameter>` per argument (MiniMaxM2.ts), and its
 * reasoning `<think>…</think>`.
 */
export const isMiniMaxM2Template = (lib: NodeLlamaCpp, wrapper: Wrapper): boolean =>
  wrapper instanceof lib.JinjaTemplateChatWrapper &&
  wrapper.template.includes("<minimax:tool_call>") &&
  !wrapper.template.includes("]<]minimax[>[")

/**
 * Whether the wrapper is the GGUF's own Jinja template of GLM-4.5…4.7 or GLM-5 (it writes a call's arguments as
 * `<arg_key>`/`<arg_value>` pairs inside `<tool_call>`; Glm.ts), its reasoning `<think>…</think>`.
 */
export const isGlmTemplate = (lib: NodeLlamaCpp, wrapper: Wrapper): boolean =>
  wrapper instanceof lib.JinjaTemplateChatWrapper &&
  ["<tool_call>", "<arg_key>", "<arg_value>"].every((tag) => wrapper.template.includes(tag))

/**
 * How a chat wrapper writes tool calls, parts that end the turn cut off (its stop triggers; with the model, its
 * end-of-generation tokens).
 */
export const wrapperToolSyntax = (lib: NodeLlamaCpp, wrapper: Wrapper, model?: LlamaModel): ToolSyntax => {
  if (isMiniMaxM2Template(lib, wrapper)) return { _tag: "MiniMaxM2", parallel: true }
  const triggers = wrapper.generateContextState({
    chatHistory: [{ type: "model", response: [] }]
  }).stopGenerationTriggers
  const stops = triggers.flatMap((trigger) => {
    const text = trigger.values.map((v) =>
      typeof v === "string" ? v : v instanceof lib.SpecialTokensText ? v.value : undefined
    )
    return text.every((t) => t !== undefined) ? [text.join("")] : []
  })
  const syntax = toolSyntaxOf(
    lib,
    wrapper,
    stops.filter((text) => text !== ""),
    model
  )
  return isGlmTemplate(lib, wrapper) ? glmSyntax(syntax) : syntax
}

/**
 * GLM's syntax (Glm.ts): what its template writes between the tags, as node-llama-cpp's probe of it found
 * (`<arg_key>params</arg_key>\n<arg_value>` for GLM-4.5/4.6, no newline for 4.7/5). Whether the prompt leaves a
 * `<think>` open is known once it is rendered (chatFormatter).
 */
const glmSyntax = (probed: ToolSyntax): ToolSyntax => {
  const prefix = probed._tag === "Family" ? probed.paramsPrefix : ""
  const between = /<\/arg_key>(\s*)<arg_value>/.exec(prefix)?.[1] ?? ""
  return { _tag: "Glm", parallel: true, between, thinkOpen: false }
}

/**
 * FormattedChat.template: the wrapper's name, or the format of a template known by its text (Reasoning.ts splits its
 * replies by it); GLM's as "GLM-open-think" when the prompt ends inside a `<think>` it opened.
 */
const templateName = (lib: NodeLlamaCpp, wrapper: Wrapper, prompt: string): string =>
  isMiniMaxM2Template(lib, wrapper)
    ? "MiniMax-M2"
    : !isGlmTemplate(lib, wrapper)
      ? wrapper.wrapperName
      : prompt.lastIndexOf("<think>") > prompt.lastIndexOf("</think>")
        ? "GLM-open-think"
        : "GLM"

/** GLM's syntax knowing the prompt: a forced call closes a `<think>` the prompt left open. */
const withOpenThink = (syntax: ToolSyntax | undefined, template: string): ToolSyntax | undefined =>
  syntax?._tag === "Glm" ? { ...syntax, thinkOpen: template === "GLM-open-think" } : syntax

/**
 * MiniMax-M2's and GLM's templates write each argument of a call on its own (`tool_call.arguments.items()`: a
 * `<parameter>`, an `<arg_key>`/`<arg_value>` pair). node-llama-cpp's probe of the template wraps the arguments in a
 * `params` key (one argument holding all the JSON); unwrapped, the template renders the history's calls as the model
 * writes them.
 */
export const ownArguments = (lib: NodeLlamaCpp, wrapper: Wrapper): Wrapper => {
  if (isMiniMaxM2Template(lib, wrapper) || isGlmTemplate(lib, wrapper))
    (wrapper as unknown as { _wrapFunctionParamsInsideMapKey?: string | undefined })._wrapFunctionParamsInsideMapKey =
      undefined
  return wrapper
}

/**
 * The model's chat template through node-llama-cpp: the GGUF's own template (a known wrapper, or its Jinja
 * template), else the wrapper node-llama-cpp picks for the architecture, else its general wrapper. With tools, the
 * template renders them (node-llama-cpp's `availableFunctions`, calls and results as function-call items); a
 * template that knows no tools gets them as plain messages (ToolCalls.ts `genericToolMessages`).
 */
const chatFormatter = (lib: NodeLlamaCpp, model: LlamaModel) => {
  let wrapper: Wrapper | undefined
  const resolve = () => (wrapper ??= ownArguments(lib, lib.resolveChatWrapper(model) ?? new lib.GeneralChatWrapper()))
  const render = (messages: ReadonlyArray<ChatMessage>, tools: ChatToolOptions | undefined) => {
    const chat = resolve()
    const withTools = tools !== undefined && tools.choice !== "none" && tools.tools.length > 0
    const syntax: ToolSyntax | undefined =
      withTools || messages.some((m) => m.role === "tool" || (m.toolCalls?.length ?? 0) > 0)
        ? wrapperToolSyntax(lib, chat, model)
        : undefined
    const history =
      syntax !== undefined && syntax._tag !== "Generic"
        ? historyOf(messages)
        : historyOf(syntax === undefined ? messages : genericToolMessages(messages, tools))
    const availableFunctions =
      withTools && syntax !== undefined && syntax._tag !== "Generic"
        ? Object.fromEntries(
            toolsAllowed(tools).map((t) => [
              t.name,
              {
                ...(t.description === undefined ? {} : { description: t.description }),
                ...(t.parameters === undefined ? {} : { params: t.parameters as never })
              }
            ])
          )
        : undefined
    const state = chat.generateContextState({
      chatHistory: history,
      ...(availableFunctions === undefined ? {} : { availableFunctions, documentFunctionParams: true })
    })
    const stop = state.stopGenerationTriggers
      .flatMap((trigger) => (trigger.values.every((v) => typeof v === "string") ? [trigger.values.join("")] : []))
      .filter((text) => text !== "")
    const formatted: FormattedChat = {
      tokens: [...state.contextText.tokenize(model.tokenizer)] as Array<number>,
      stop,
      template: templateName(lib, chat, state.contextText.toString())
    }
    return { formatted, syntax: withTools ? withOpenThink(syntax, formatted.template) : undefined }
  }
  return (
    messages: ReadonlyArray<ChatMessage>,
    tools?: ChatToolOptions
  ): Effect.Effect<FormattedChat, ChatRenderError> =>
    tools === undefined && messages.every((m) => m.role !== "tool" && (m.toolCalls?.length ?? 0) === 0)
      ? Effect.sync(() => render(messages, tools).formatted)
      : Effect.gen(function* () {
          const { formatted, syntax } = yield* Effect.try({
            try: () => render(messages, tools),
            catch: (cause) =>
              new ChatRenderError({
                message: `the chat with its tools cannot be rendered: ${cause instanceof Error ? cause.message : String(cause)}`
              })
          })
          if (syntax === undefined || tools === undefined) return formatted
          // The grammar that forces a call, each tool's parameters through JsonGrammar.ts (a schema it cannot enforce: 400).
          const grammar = yield* toolGrammarEffect(syntax, tools, (schema, path) =>
            Effect.map(jsonSchemaGrammar(schema, path), (g) => g.text)
          ).pipe(Effect.mapError((error) => new ChatRenderError({ message: error.message })))
          return { ...formatted, tools: { syntax, ...(grammar === undefined ? {} : { grammar }) } }
        })
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
    formatChat: (messages, tools) => Effect.flatMap(chat, (format) => format(messages, tools))
  }
}

/**
 * SPM vocabularies in TypeScript (SpmTokenizer.ts); the others, and chat templates, through vocabulary-only loads with
 * node-llama-cpp's prebuilt CPU binary (never compiles, no GPU).
 */
export const layer: Layer.Layer<Tokenizer> = Layer.scoped(
  Tokenizer,
  Effect.gen(function* () {
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
      Effect.gen(function* () {
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
        Effect.gen(function* () {
          // An SPM vocabulary this package tokenizes exactly as llama.cpp (SpmTokenizer.ts): node-llama-cpp, ~0.7 s of
          // CPU to import and check its binary, is then loaded only for a chat template. Any other: node-llama-cpp.
          // a remote model: its metadata written to a local file (node-llama-cpp needs a path)
          const local = yield* localMetadataFile(modelPath).pipe(
            Effect.mapError((e) => new TokenizerError({ path: modelPath, message: e.message }))
          )
          const file = yield* Effect.option(readGgufFile(local))
          const vocab = Option.isSome(file) ? spmVocabulary(file.value) : undefined
          if (vocab !== undefined) {
            const openScope = yield* Effect.scope
            const chat = yield* Effect.cached(Effect.map(loadModel(local).pipe(Scope.extend(openScope)), (m) => m.chat))
            return fromSpm(vocab, chat)
          }
          const { chat, ...tokenizer } = yield* loadModel(local)
          return {
            ...tokenizer,
            formatChat: (messages: ReadonlyArray<ChatMessage>, tools?: ChatToolOptions) => chat(messages, tools)
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
  detokenize: (tokens) =>
    decoder.decode(
      Uint8Array.from(
        tokens.filter((token) => token >= 3),
        (token) => token - 3
      )
    ),
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
