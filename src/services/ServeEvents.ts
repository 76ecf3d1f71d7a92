/**
 * A run's updates (Orchestrator.ts RunUpdate) as the events one served request streams (Server.ts ServeEvent): each
 * token's text through the stop strings (StopText.ts), its log-probs kept aligned with that text (TextLogprobs.ts),
 * then one Done, at an end-of-generation token, a stop string or the run's end; nothing after it. Pure: the Server
 * counts, times and caches around it.
 */
import type { RunUpdate, TokenLogprob } from "./Orchestrator.js"
import type { ServeEvent, TextLogprob } from "./Server.js"
import { makeStopMatcher } from "./StopText.js"
import { makeLogprobAligner } from "./TextLogprobs.js"
import type { ModelTokenizer } from "./Tokenizer.js"

type EventVocabulary = Pick<ModelTokenizer, "tokenize" | "detokenize" | "isEndOfGeneration">

/** The last of the prompt's final tokens that decodes to text (else the token of "a"): context for a token's text. */
const textAnchor = (vocabulary: EventVocabulary, prompt: ReadonlyArray<number>): ReadonlyArray<number> => {
  for (let i = prompt.length - 1; i >= Math.max(0, prompt.length - 16); i--) {
    if (vocabulary.detokenize([prompt[i]!]).trim() !== "") return [prompt[i]!]
  }
  return vocabulary.tokenize("a").slice(-1)
}

export const makeServeEvents = (request: {
  readonly prompt: ReadonlyArray<number>
  readonly vocabulary: EventVocabulary
  readonly stop: ReadonlyArray<string>
  /** Log-probs asked for: each token's entry (its text from the vocabulary) goes out with its text. */
  readonly logprobs: boolean
  /** Prompt tokens the prompt cache held, as Done reports them. */
  readonly cachedTokens: () => number
}) => {
  const { prompt, vocabulary } = request
  const stop = makeStopMatcher(request.stop)
  const logprobs = request.logprobs ? makeLogprobAligner() : undefined
  // a token's text as it reads after other text (its leading space kept): decoded after a token that has text
  const anchor = logprobs === undefined ? [] : textAnchor(vocabulary, prompt)
  const piece = (id: number) => vocabulary.detokenize([id], anchor)
  const textLogprob = (id: number, p: TokenLogprob): TextLogprob => ({
    token: piece(id),
    logprob: p.logprob,
    top: p.top.map((t) => ({ token: piece(t.tokenId), logprob: t.logprob }))
  })
  let completionTokens = 0
  let finished = false
  // Ended by a stop string: the run is stopped, so no summary says what the stages kept.
  let stoppedByText = false
  const done = (finishReason: "stop" | "length", stopText?: string): ServeEvent => {
    finished = true
    return {
      _tag: "Done",
      finishReason,
      ...(stopText === undefined ? {} : { stopText }),
      promptTokens: prompt.length,
      completionTokens,
      cachedTokens: request.cachedTokens()
    }
  }
  const text = (piece: string, entries?: ReadonlyArray<TextLogprob>): ServeEvent => ({
    _tag: "Text",
    text: piece,
    completionTokens,
    ...(entries === undefined ? {} : { logprobs: entries })
  })
  return {
    /** A Done went out: every later update maps to nothing. */
    finished: () => finished,
    /** The text ended at a stop string. */
    stoppedByText: () => stoppedByText,
    events: (update: RunUpdate): ReadonlyArray<ServeEvent> => {
      if (finished) return []
      if (update._tag === "Token") {
        if (update.token.tokenId >= 0) {
          completionTokens++
          if (vocabulary.isEndOfGeneration(update.token.tokenId)) {
            const rest = stop.flush()
            return [...(rest === "" ? [] : [text(rest, logprobs?.flush())]), done("stop")]
          }
          if (logprobs !== undefined && update.token.logprob !== undefined) {
            logprobs.add(textLogprob(update.token.tokenId, update.token.logprob), update.token.text.length)
          }
        }
        const match = stop.push(update.token.text)
        const entries = match.stopped ? logprobs?.stop(match.text.length) : logprobs?.release(match.text.length)
        const out = match.text === "" ? [] : [text(match.text, entries)]
        if (match.stopped) stoppedByText = true
        return match.stopped ? [...out, done("stop", match.stop)] : out
      }
      if (update._tag === "Finished") {
        const rest = stop.flush()
        return [
          ...(rest === "" ? [] : [text(rest, logprobs?.flush())]),
          done(update.summary.outcome === "Eos" ? "stop" : "length")
        ]
      }
      return []
    }
  }
}
