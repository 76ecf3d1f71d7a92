/**
 * Log-probabilities in OpenAI's shapes, from the Server's per-token entries (ServeEvent Text `logprobs`):
 *
 * - chat: `{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`
 * - completions: `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}` (`text_offset`: where each
 *   token's text begins in the choice's text, counted in UTF-16 code units as JavaScript and OpenAI's Python client do)
 *
 * A stream's chunk carries the entries of the tokens its text covers; a non-streamed choice carries them all.
 */
import type { TextLogprob } from "../../services/Server.js"

const encoder = new TextEncoder()
const bytes = (token: string) => Array.from(encoder.encode(token))

export const chatLogprobs = (entries: ReadonlyArray<TextLogprob>) => ({
  content: entries.map((e) => ({
    token: e.token,
    logprob: e.logprob,
    bytes: bytes(e.token),
    top_logprobs: e.top.map((t) => ({ token: t.token, logprob: t.logprob, bytes: bytes(t.token) }))
  })),
  refusal: null
})

/** `offset`: where the first entry's text begins in the choice's text (a stream's running count). */
export const completionLogprobs = (entries: ReadonlyArray<TextLogprob>, offset = 0) => {
  const text_offset: Array<number> = []
  let at = offset
  for (const e of entries) {
    text_offset.push(at)
    at += e.token.length
  }
  return {
    tokens: entries.map((e) => e.token),
    token_logprobs: entries.map((e) => e.logprob),
    // one object per token: alternative text → logprob (alternatives whose text repeats keep the most likely)
    top_logprobs: entries.map((e) => {
      const top: Record<string, number> = {}
      for (const t of e.top) if (!(t.token in top)) top[t.token] = t.logprob
      return top
    }),
    text_offset
  }
}

/** How far a run of entries moves a completion's text offset. */
export const entriesLength = (entries: ReadonlyArray<TextLogprob>) => entries.reduce((n, e) => n + e.token.length, 0)
