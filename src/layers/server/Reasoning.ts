/**
 * A reply's reasoning split from its content, by the chat template that rendered the prompt (FormattedChat.template):
 * gpt-oss's harmony channels (Harmony.ts), MiniMax-M2's and GLM's `<think>…</think>` (MiniMaxM2.ts; "GLM-open-think":
 * the prompt left the `<think>` open, as GLM-4.5/4.6's does, so the reply starts in the reasoning). The reasoning goes in
 * `reasoning_content` on the OpenAI API and in thinking blocks on the Messages API; the content goes on to the tools'
 * parser (ToolCalls.ts) when the chat has tools. Other templates: no split, the reply is content.
 */
import { harmonyStream } from "./Harmony.js"
import { thinkStream } from "./MiniMaxM2.js"
import { type ReasoningPiece, type ReasoningStream, splitWhole } from "./ReasoningPiece.js"

export type ReasoningFormat = "Harmony" | "MiniMax-M2" | "GLM" | "GLM-open-think"

const formats: ReadonlyArray<string> = [
  "Harmony",
  "MiniMax-M2",
  "GLM",
  "GLM-open-think"
] satisfies Array<ReasoningFormat>

export type { ReasoningPiece, ReasoningStream }

/** The reasoning format of a template's replies (by its name), undefined when its replies have none to split. */
export const reasoningFormatOf = (template: string): ReasoningFormat | undefined =>
  formats.includes(template) ? (template as ReasoningFormat) : undefined

/** A splitter for a reply as it streams (the pieces add up to `splitReasoning` of the whole reply). */
export const reasoningStream = (format: ReasoningFormat): ReasoningStream =>
  format === "Harmony" ? harmonyStream() : thinkStream(format === "GLM-open-think")

/** A whole reply split. */
export const splitReasoning = (format: ReasoningFormat, text: string): ReasoningPiece =>
  splitWhole(reasoningStream(format), text)
