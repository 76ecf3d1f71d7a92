import { Context, type Effect, Schema, type Scope } from "effect"
import type { ChatToolCall, ChatToolOptions, ToolSyntax } from "./Tools.js"

/** The model's vocabulary could not be loaded. */
export class TokenizerError extends Schema.TaggedError<TokenizerError>()("TokenizerError", {
  path: Schema.String,
  message: Schema.String
}) {}

/** Turns a stream of token ids into text, holding back bytes of a character that is not complete yet. */
export interface IncrementalDecoder {
  /** The text this token completes ("" while a multi-byte character is still partial). */
  readonly push: (token: number) => string
  /** Whatever is still held back (a character the stream never completed). */
  readonly flush: () => string
}

/** A chat that cannot be rendered as asked (its tools, or its calls' arguments): the request's fault, in words. */
export class ChatRenderError extends Schema.TaggedError<ChatRenderError>()("ChatRenderError", {
  message: Schema.String
}) {}

/** One message of a chat: an assistant's may carry the tool calls it made, a tool's is the result of one call. */
export interface ChatMessage {
  readonly role: "system" | "user" | "assistant" | "tool"
  readonly content: string
  /** The assistant's calls (Tools.ts). */
  readonly toolCalls?: ReadonlyArray<ChatToolCall>
  /** A tool message: the id of the call it answers. */
  readonly toolCallId?: string
}

/** A chat rendered for the assistant's next turn. */
export interface FormattedChat {
  readonly tokens: ReadonlyArray<number>
  /** Texts that end the assistant's turn (besides end-of-generation tokens). */
  readonly stop: ReadonlyArray<string>
  /** Which template rendered it (e.g. the chat wrapper's name). */
  readonly template: string
  /** With tools (not `none`): how the model writes calls, and the grammar that forces a call when the choice does. */
  readonly tools?: { readonly syntax: ToolSyntax; readonly grammar?: string }
}

/** The vocabulary of one model. */
export interface ModelTokenizer {
  readonly vocabSize: number
  readonly bosTokenId: number | undefined
  readonly eosTokenId: number | undefined
  /** Whether `tokenize` prepends BOS (as llama.cpp does for this model). */
  readonly addsBos: boolean
  /** Prompt text to token ids, BOS first when the model wants it. */
  readonly tokenize: (text: string) => ReadonlyArray<number>
  readonly detokenize: (tokens: ReadonlyArray<number>, context?: ReadonlyArray<number>) => string
  readonly isEndOfGeneration: (token: number) => boolean
  /** A decoder for a generation that continues `context` (usually the prompt tokens). */
  readonly decoder: (context: ReadonlyArray<number>) => IncrementalDecoder
  /**
   * Messages through the model's own chat template, ready for the assistant's turn (an effect: the live tokenizer
   * loads the template machinery, node-llama-cpp, on the first chat only).
   */
  readonly formatChat: (
    messages: ReadonlyArray<ChatMessage>,
    tools?: ChatToolOptions
  ) => Effect.Effect<FormattedChat, TokenizerError | ChatRenderError>
}

export interface TokenizerService {
  /** Loads the vocabulary of a GGUF file (no weights); released with the scope. */
  readonly open: (modelPath: string) => Effect.Effect<ModelTokenizer, TokenizerError, Scope.Scope>
}

export class Tokenizer extends Context.Tag("swactor/Tokenizer")<Tokenizer, TokenizerService>() {}

const maxCharacterTokens = 4
const contextTokens = 8

/**
 * Incremental decoding over any whole-sequence detokenizer: pending tokens are decoded with the last
 * emitted tokens as context (so leading spaces come out right) and held while the text ends in an
 * incomplete UTF-8 sequence (U+FFFD), up to the longest UTF-8 character.
 */
export const makeIncrementalDecoder = (
  detokenize: (tokens: ReadonlyArray<number>, context: ReadonlyArray<number>) => string,
  context: ReadonlyArray<number>
): IncrementalDecoder => {
  let history = context.slice(-contextTokens)
  let pending: Array<number> = []
  const settle = (text: string) => {
    history = [...history, ...pending].slice(-contextTokens)
    pending = []
    return text
  }
  return {
    push: (token) => {
      pending.push(token)
      const text = detokenize(pending, history)
      if (text.endsWith("\uFFFD") && pending.length < maxCharacterTokens) return ""
      return settle(text)
    },
    flush: () => (pending.length === 0 ? "" : settle(detokenize(pending, history)))
  }
}
