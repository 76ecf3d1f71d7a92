/**
 * gpt-oss's harmony replies (node-llama-cpp's HarmonyChatWrapper renders the chat; the reply carries the format's
 * special tokens as their text): messages `<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]<|message|>BODY`, each
 * ended by `<|end|>` (another `<|start|>assistant` message follows), `<|call|>` or `<|return|>`. As llama.cpp's server
 * does, the `analysis` channel is the reasoning (`reasoning_content`), `final` (and `commentary` without a recipient:
 * a preamble) the content. A `commentary` message to `functions.NAME` is a tool call: it goes on in the content as
 * `to=functions.NAME<|constrain|>json<|message|>BODY<|call|>`, the form ToolCalls.ts parses for harmony, so the
 * tools' parser takes it out as a call. A reply that does not start in the format is content as it is.
 *
 * One state machine for whole replies and streams (`splitHarmony` = one push, then the end), so a stream's pieces add
 * up to the whole reply's split; a marker cut between two pieces is held back until it is whole.
 */

import { type ReasoningPiece, type ReasoningStream, splitWhole } from "./ReasoningPiece.js"

const MESSAGE = "<|message|>"
const CHANNEL = "<|channel|>"
const START = "<|start|>"
const ENDS = ["<|end|>", "<|call|>", "<|return|>"]
/** A header longer than this without `<|message|>` is no harmony header: the rest is content. */
const MAX_HEADER = 512

/** Where a held tail starts: a `<|` not yet closed by `|>` could be the start of a marker (-1: nothing to hold). */
const heldTail = (text: string): number => {
  const at = text.lastIndexOf("<")
  if (at < 0 || text.length - at > 16) return -1
  const tail = text.slice(at)
  return tail.includes(">") ? -1 : at
}

export const harmonyStream = (): ReasoningStream => {
  let held = ""
  /** "start": nothing seen yet; "header": collecting a message header; "body": in a message; "plain": no harmony. */
  let state: "start" | "header" | "body" | "plain" = "start"
  let channel: "reasoning" | "content" | "call" = "content"
  const step = (final: boolean): ReasoningPiece => {
    let reasoning = ""
    let content = ""
    for (;;) {
      if (state === "plain") {
        content += held
        held = ""
        break
      }
      if (state === "start") {
        const trimmed = held.trimStart()
        if (trimmed.startsWith(CHANNEL) || trimmed.startsWith(START)) {
          state = "header"
          held = trimmed
          continue
        }
        // undecided while what came could still begin a marker
        if (!final && (CHANNEL.startsWith(trimmed) || START.startsWith(trimmed))) break
        state = "plain"
        continue
      }
      if (state === "header") {
        const at = held.indexOf(MESSAGE)
        if (at < 0) {
          // cut off in a header: its markup is no text
          if (final && held.startsWith("<|")) held = ""
          if (held.length > MAX_HEADER || (final && held !== "")) state = "plain"
          if (state === "plain") continue
          break
        }
        const header = held.slice(0, at)
        held = held.slice(at + MESSAGE.length)
        const name = /<\|channel\|>\s*([A-Za-z_]+)/.exec(header)?.[1] ?? ""
        const recipient = /(?:^|\s|>)to=functions\.([A-Za-z0-9_.:-]+)/.exec(header)?.[1]
        if (recipient !== undefined) {
          channel = "call"
          content += `to=functions.${recipient}<|constrain|>json<|message|>`
        } else channel = name === "analysis" ? "reasoning" : "content"
        state = "body"
        continue
      }
      // body: up to the first end marker
      let end = -1
      let marker = ""
      for (const m of ENDS) {
        const i = held.indexOf(m)
        if (i >= 0 && (end < 0 || i < end)) {
          end = i
          marker = m
        }
      }
      const upTo = end >= 0 ? end : final ? held.length : ((t) => (t < 0 ? held.length : t))(heldTail(held))
      const body = held.slice(0, upTo)
      if (channel === "reasoning") reasoning += body
      else content += body
      if (end < 0) {
        held = held.slice(upTo)
        break
      }
      if (channel === "call") content += "<|call|>"
      held = held.slice(end + marker.length)
      state = "header"
      if (held === "") break
    }
    if (final) held = ""
    return { reasoning, content }
  }
  return {
    push: (text) => {
      held += text
      return step(false)
    },
    end: () => step(true)
  }
}

/** A whole reply split into reasoning and content (see harmonyStream). */
export const splitHarmony = (text: string): ReasoningPiece => splitWhole(harmonyStream(), text)
