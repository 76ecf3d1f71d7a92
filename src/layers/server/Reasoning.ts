/**
 * A reply's reasoning split from its content, by the chat template that rendered the prompt (FormattedChat.template):
 * gpt-oss's harmony channels (Harmony.ts) and MiniMax-M2's `<think>…</think>` (MiniMaxM2.ts). The reasoning goes in
 * `reasoning_content` on the OpenAI API and in thinking blocks on the Messages API; the content goes on to the tools'
 * parser (ToolCalls.ts) when the chat has tools. Other templates: no split, the reply is content.
 */
import { harmonyStream } from "./Harmony.js"
import { thinkStream } from "./MiniMaxM2.js"
import { type ReasoningPiece, type ReasoningStream, splitWhole } from "./ReasoningPiece.js"

export type ReasoningFormat = "Harmony" | "MiniMax-M2"

export type { ReasoningPiece, ReasoningStream }

/** The reasoning format of a template's replies (by its name), undefined when its replies have none to split. */
export const reasoningFormatOf = (template: string): ReasoningFormat | undefined =>
  template === "Harmony" || template === "MiniMax-M2" ? template : undefined

/** A splitter for a reply as it streams (the pieces add up to `splitReasoning` of the whole reply). */
export const reasoningStream = (format: ReasoningFormat): ReasoningStream =>
  format === "Harmony" ? harmonyStream() : thinkStream()

/** A whole reply split. */
export const splitReasoning = (format: ReasoningFormat, text: string): ReasoningPiece =>
  splitWhole(reasoningStream(format), text)
