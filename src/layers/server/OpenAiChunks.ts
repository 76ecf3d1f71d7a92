/**
 * The pieces of OpenAI's completion answers: what every answer of one request repeats (id, created, model, chat or
 * text), one choice's chunk as a stream sends it (`chat.completion.chunk` or `text_completion`), and the usage object.
 */
import type { FinishReason } from "../../services/Server.js"

/** What every chunk and answer of one request carries. */
export interface ResponseShape {
  readonly id: string
  readonly created: number
  readonly model: string
  readonly chat: boolean
}

export const completionChunk = (
  shape: ResponseShape,
  choice: {
    text?: string
    role?: boolean
    finish: FinishReason | "tool_calls" | null
    delta?: object
    // n > 1: the choice's index; with log-probs: the entries of this chunk's tokens (Logprobs.ts)
    index?: number
    logprobs?: object | null
  }
) =>
  shape.chat
    ? {
        id: shape.id,
        object: "chat.completion.chunk",
        created: shape.created,
        model: shape.model,
        choices: [
          {
            index: choice.index ?? 0,
            delta:
              choice.finish !== null
                ? {}
                : (choice.delta ?? {
                    ...(choice.role === true ? { role: "assistant" } : {}),
                    content: choice.text ?? ""
                  }),
            logprobs: choice.logprobs ?? null,
            finish_reason: choice.finish
          }
        ]
      }
    : {
        id: shape.id,
        object: "text_completion",
        created: shape.created,
        model: shape.model,
        choices: [
          {
            index: choice.index ?? 0,
            text: choice.text ?? "",
            logprobs: choice.logprobs ?? null,
            finish_reason: choice.finish
          }
        ]
      }

/** OpenAI's usage object; `cachedTokens`: prompt tokens the prompt cache held (the most any choice's run reused). */
export const usageOf = (promptTokens: number, completionTokens: number, cachedTokens: number) => ({
  prompt_tokens: promptTokens,
  completion_tokens: completionTokens,
  total_tokens: promptTokens + completionTokens,
  prompt_tokens_details: { cached_tokens: cachedTokens }
})
