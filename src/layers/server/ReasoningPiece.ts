/**
 * The shape every reasoning splitter has (Harmony.ts's channels, MiniMaxM2.ts's `<think>…</think>`): one state machine
 * fed a reply as it streams, each push giving the reasoning and the content it could settle, `end` the rest. A whole
 * reply is one push and the end (`splitWhole`), so a stream's pieces add up to the whole reply's split.
 */

export interface ReasoningPiece {
  readonly reasoning: string
  readonly content: string
}

export interface ReasoningStream {
  readonly push: (text: string) => ReasoningPiece
  readonly end: () => ReasoningPiece
}

/** A whole reply split by a fresh splitter: one push, then the end. */
export const splitWhole = (stream: ReasoningStream, text: string): ReasoningPiece => {
  const a = stream.push(text)
  const b = stream.end()
  return { reasoning: a.reasoning + b.reasoning, content: a.content + b.content }
}
