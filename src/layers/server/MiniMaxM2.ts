/**
 * MiniMax-M2's replies (M2, M2.1, M2.5; its chat template writes `<minimax:tool_call>`), as llama.cpp's parser reads
 * them:
 * - reasoning: `<think>REASONING</think>` at the start of the reply (the template's generation prompt may open the
 *   `<think>` itself: `thinkStream(true)`), the rest the content. `reasoning_content` on the OpenAI API, a thinking
 *   block on the Messages API. The whitespace the template puts around the reasoning is no part of it.
 * - tool calls: `<minimax:tool_call>` then one `<invoke name="NAME">` per call, each holding
 *   `<parameter name="ARG">VALUE</parameter>`s, `</invoke>`, and `</minimax:tool_call>`. A value is the text as written
 *   where the tool's JSON schema makes the argument a string (one newline at either end dropped), else JSON (a number,
 *   a boolean, an object...), or the text when it is no JSON.
 *
 * `thinkStream` has the shape of Harmony.ts's splitter (one state machine for whole replies and streams);
 * `parseMiniMaxCalls` is what ToolCalls.ts's parser runs for this syntax (whole replies, streams, cut replies).
 */
import type { ChatTool, ChatToolCall } from "../../services/Tools.js"
import { type ReasoningPiece, type ReasoningStream, splitWhole } from "./ReasoningPiece.js"

const OPEN = "<think>"
const CLOSE = "</think>"

/** Where a tail that could be the start of `marker` starts (text.length when none). */
const partialTail = (text: string, marker: string): number => {
  for (let at = Math.max(0, text.length - marker.length + 1); at < text.length; at++)
    if (marker.startsWith(text.slice(at))) return at
  return text.length
}

/** Where the trailing whitespace of `text` starts. */
const trailingSpace = (text: string): number => text.length - (text.length - text.trimEnd().length)

/**
 * A reply's `<think>…</think>` split from its content as it streams. `open`: the prompt opened the `<think>` (the
 * reply starts in the reasoning). A reply that does not start with `<think>` (and was not opened) is all content.
 */
export const thinkStream = (open = false): ReasoningStream => {
  let held = ""
  let state: "start" | "think" | "after" | "content" = open ? "think" : "start"
  /** Whether reasoning text went out (the leading whitespace of the reasoning is dropped until then). */
  let thought = false
  const step = (final: boolean): ReasoningPiece => {
    let reasoning = ""
    let content = ""
    for (;;) {
      if (state === "start") {
        const trimmed = held.trimStart()
        if (trimmed.startsWith(OPEN)) {
          held = trimmed.slice(OPEN.length)
          state = "think"
          continue
        }
        if (!final && OPEN.startsWith(trimmed)) break
        state = "content"
        continue
      }
      if (state === "think") {
        if (!thought) held = held.trimStart()
        const at = held.indexOf(CLOSE)
        if (at >= 0) {
          reasoning += held.slice(0, at).trimEnd()
          held = held.slice(at + CLOSE.length)
          state = "after"
          continue
        }
        // a tail that might be `</think>`, or whitespace that might end the reasoning, waits
        const upTo = trailingSpace(final ? held : held.slice(0, partialTail(held, CLOSE)))
        reasoning += held.slice(0, upTo)
        held = final ? "" : held.slice(upTo)
        break
      }
      if (state === "after") {
        held = held.trimStart()
        if (held === "") break
        state = "content"
        continue
      }
      content += held
      held = ""
      break
    }
    if (reasoning !== "") thought = true
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

/** A whole reply split into reasoning and content (see thinkStream). */
export const splitThink = (text: string, open = false): ReasoningPiece => splitWhole(thinkStream(open), text)

// --- tool calls ---

const SECTION = "<minimax:tool_call>"
const SECTION_END = "</minimax:tool_call>"
const INVOKE = '<invoke name="'
const INVOKE_END = "</invoke>"
const PARAMETER = '<parameter name="'
const PARAMETER_END = "</parameter>"

export type MiniMaxSegment =
  { readonly _tag: "Text"; readonly text: string } | { readonly _tag: "Call"; readonly call: ChatToolCall }

/** As ToolCalls.ts's parse: the segments, and where the text that might still become a call starts (held back). */
export interface MiniMaxParsed {
  readonly segments: ReadonlyArray<MiniMaxSegment>
  readonly heldFrom: number | undefined
}

const isRecord = (value: unknown): value is Record<string, unknown> =>
  typeof value === "object" && value !== null && !Array.isArray(value)

/** Whether a JSON schema admits strings only (llama.cpp's resolves_to_string, without $ref). */
export const isStringSchema = (schema: unknown): boolean => {
  if (!isRecord(schema)) return false
  const type = schema["type"]
  if (type === "string") return true
  if (Array.isArray(type)) return type.length > 0 && type.every((t) => t === "string")
  if (typeof schema["const"] === "string") return true
  if (Array.isArray(schema["enum"]))
    return schema["enum"].length > 0 && schema["enum"].every((v) => typeof v === "string")
  for (const key of ["anyOf", "oneOf"]) {
    const options = schema[key]
    if (Array.isArray(options)) return options.length > 0 && options.every(isStringSchema)
  }
  return false
}

/** A parameter's value: the text for a string argument (one newline at either end dropped), else JSON if it is. */
const typedValue = (tool: ChatTool | undefined, name: string, raw: string): unknown => {
  const parameters = tool?.parameters
  const properties = isRecord(parameters) ? parameters["properties"] : undefined
  const schema = isRecord(properties) ? properties[name] : undefined
  const text = raw.replace(/^\r?\n/, "").replace(/\r?\n$/, "")
  if (isStringSchema(schema)) return text
  try {
    return JSON.parse(raw) as unknown
  } catch {
    return text
  }
}

type Found<A> = { readonly end: number; readonly value: A } | "partial" | undefined

/** `marker` at `at`: its end, "partial" when the text ends inside it, undefined when it is not there. */
const literal = (text: string, at: number, marker: string): Found<null> => {
  const rest = text.slice(at, at + marker.length)
  if (rest === marker) return { end: at + marker.length, value: null }
  return marker.startsWith(rest) ? "partial" : undefined
}

const skipSpace = (text: string, at: number) => {
  let i = at
  while (i < text.length && /\s/.test(text[i]!)) i++
  return i
}

/** `"NAME">` after a `name="` (a name holds no quote or angle bracket). */
const quotedName = (text: string, at: number): Found<string> => {
  const quote = text.indexOf('"', at)
  const name = text.slice(at, quote < 0 ? text.length : quote)
  if (/[<>\n]/.test(name) || name.length > 256) return undefined
  if (quote < 0) return "partial"
  if (name === "") return undefined
  const close = literal(text, quote + 1, ">")
  return close === "partial" || close === undefined ? close : { end: close.end, value: name }
}

/** One `<invoke name="NAME">` … `</invoke>` at `at` (after whitespace), as a call of a known tool. */
const parseInvoke = (
  text: string,
  at: number,
  tools: ReadonlyArray<ChatTool> | undefined,
  newId: () => string
): Found<ChatToolCall> => {
  const open = literal(text, at, INVOKE)
  if (open === "partial" || open === undefined) return open
  const name = quotedName(text, open.end)
  if (name === "partial" || name === undefined) return name
  const tool = tools?.find((t) => t.name === name.value)
  if (tools !== undefined && tool === undefined) return undefined
  const args: Record<string, unknown> = {}
  let i = name.end
  for (;;) {
    i = skipSpace(text, i)
    const done = literal(text, i, INVOKE_END)
    if (typeof done === "object")
      return { end: done.end, value: { id: newId(), name: name.value, arguments: JSON.stringify(args) } }
    const parameter = literal(text, i, PARAMETER)
    if (parameter === undefined) return done === "partial" ? "partial" : undefined
    if (parameter === "partial") return "partial"
    const key = quotedName(text, parameter.end)
    if (key === "partial" || key === undefined) return key
    const close = text.indexOf(PARAMETER_END, key.end)
    if (close < 0) return "partial"
    args[key.value] = typedValue(tool, key.value, text.slice(key.end, close))
    i = close + PARAMETER_END.length
  }
}

/** A `<minimax:tool_call>` section at `at`: its calls (complete invokes), "partial" when the text ends inside it. */
const parseSection = (
  text: string,
  at: number,
  tools: ReadonlyArray<ChatTool> | undefined,
  newId: () => string
): { readonly end: number; readonly calls: ReadonlyArray<ChatToolCall>; readonly partial: boolean } | undefined => {
  const open = literal(text, at, SECTION)
  if (open === undefined) return undefined
  if (open === "partial") return { end: text.length, calls: [], partial: true }
  const calls: Array<ChatToolCall> = []
  let i = open.end
  for (;;) {
    const next = skipSpace(text, i)
    const close = literal(text, next, SECTION_END)
    if (typeof close === "object") return { end: close.end, calls, partial: false }
    const call = parseInvoke(text, next, tools, newId)
    if (call === "partial" || (call === undefined && close === "partial"))
      return { end: text.length, calls, partial: true }
    // markup that is no call: the section ends at the last call (none: it is no section)
    if (call === undefined) return calls.length === 0 ? undefined : { end: i, calls, partial: false }
    calls.push(call.value)
    i = call.end
  }
}

/**
 * A reply's text and calls. `ending` as in ToolCalls.ts: "open" holds back a section not yet closed (or the start of
 * its marker); at the end ("final" or "cut") the complete calls of a section count (its closing marker may never come:
 * it ends the turn) and a call cut short is dropped, neither a call nor content.
 */
export const parseMiniMaxCalls = (
  text: string,
  tools: ReadonlyArray<ChatTool> | undefined,
  ending: "open" | "final" | "cut",
  newId: () => string
): MiniMaxParsed => {
  const segments: Array<MiniMaxSegment> = []
  let textFrom = 0
  let i = text.indexOf("<")
  while (i >= 0 && i < text.length) {
    const section = parseSection(text, i, tools, newId)
    // the reply ended inside the section's marker itself: that is text
    const markerOnly = ending === "final" && literal(text, i, SECTION) === "partial"
    if (section === undefined || markerOnly) {
      i = text.indexOf("<", i + 1)
      continue
    }
    if (i > textFrom) segments.push({ _tag: "Text", text: text.slice(textFrom, i) })
    if (section.partial && ending === "open") return { segments, heldFrom: i }
    for (const call of section.calls) segments.push({ _tag: "Call", call })
    textFrom = section.end
    i = text.indexOf("<", textFrom)
  }
  if (textFrom < text.length) segments.push({ _tag: "Text", text: text.slice(textFrom) })
  return { segments, heldFrom: undefined }
}
