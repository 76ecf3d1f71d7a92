/**
 * GLM's replies (GLM-4.5, 4.6, 4.7 and GLM-5: their chat templates write `<arg_key>`), as llama.cpp's parser reads
 * them:
 * - reasoning: `<think>REASONING</think>`, split by MiniMaxM2.ts's `thinkStream` (the same tags); GLM-4.5/4.6's
 *   prompt as node-llama-cpp renders it leaves a `<think>` open (the reply starts in the reasoning), GLM-4.7/5's closes
 *   it (Reasoning.ts's "GLM-open-think" and "GLM").
 * - tool calls: `<tool_call>NAME` then, per argument, `<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>`, then
 *   `</tool_call>`; one block per call, no section around them. GLM-4.5/4.6 put a newline between the tags, 4.7/5
 *   none: whitespace between tags is allowed. A value is the text as written where the tool's JSON schema makes the
 *   argument a string, else JSON (a number, a boolean, an object...), or the text when it is no JSON.
 *
 * `parseGlmCalls` is what ToolCalls.ts's parser runs for this syntax (whole replies, streams, cut replies).
 */
import type { ChatTool, ChatToolCall } from "../../services/Tools.js"
import { isStringSchema, type MiniMaxParsed, type MiniMaxSegment } from "./MiniMaxM2.js"

const OPEN = "<tool_call>"
const CLOSE = "</tool_call>"
const KEY = "<arg_key>"
const KEY_END = "</arg_key>"
const VALUE = "<arg_value>"
const VALUE_END = "</arg_value>"
/** A function name or argument key longer than this is no call. */
const MAX_NAME = 256

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

const isRecord = (value: unknown): value is Record<string, unknown> =>
  typeof value === "object" && value !== null && !Array.isArray(value)

/** An argument's value: the text as written for a string argument, else JSON if it is (the text if not). */
const typedValue = (tool: ChatTool | undefined, key: string, raw: string): unknown => {
  const parameters = tool?.parameters
  const properties = isRecord(parameters) ? parameters["properties"] : undefined
  if (isStringSchema(isRecord(properties) ? properties[key] : undefined)) return raw
  try {
    return JSON.parse(raw) as unknown
  } catch {
    return raw
  }
}

/** The text up to `marker` from `at` (at most MAX_NAME characters), trimmed. */
const upTo = (text: string, at: number, marker: string): Found<string> => {
  const end = text.indexOf(marker, at)
  if (end < 0) return text.length - at > MAX_NAME ? undefined : "partial"
  const name = text.slice(at, end).trim()
  return name === "" || end - at > MAX_NAME ? undefined : { end: end + marker.length, value: name }
}

/** One `<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>` at `at` (after whitespace). */
const parseArgument = (text: string, at: number): Found<{ readonly key: string; readonly raw: string }> => {
  const open = literal(text, at, KEY)
  if (open === "partial" || open === undefined) return open
  const key = upTo(text, open.end, KEY_END)
  if (key === "partial" || key === undefined) return key
  const value = literal(text, skipSpace(text, key.end), VALUE)
  if (value === "partial" || value === undefined) return value
  const close = text.indexOf(VALUE_END, value.end)
  if (close < 0) return "partial"
  return { end: close + VALUE_END.length, value: { key: key.value, raw: text.slice(value.end, close) } }
}

/** The function name after `<tool_call>`: the text up to the first tag or line end. */
const callName = (text: string, at: number): Found<string> => {
  let end = at
  while (end < text.length && text[end] !== "<" && text[end] !== "\n" && end - at <= MAX_NAME) end++
  if (end - at > MAX_NAME) return undefined
  if (end >= text.length) return "partial"
  const name = text.slice(at, end).trim()
  return name === "" ? undefined : { end, value: name }
}

/** One `<tool_call>NAME…</tool_call>` at `at`, as a call of a known tool. */
const parseCall = (
  text: string,
  at: number,
  tools: ReadonlyArray<ChatTool> | undefined,
  newId: () => string
): Found<ChatToolCall> => {
  const open = literal(text, at, OPEN)
  if (open === "partial" || open === undefined) return open
  const name = callName(text, open.end)
  if (name === "partial" || name === undefined) return name
  const tool = tools?.find((t) => t.name === name.value)
  if (tools !== undefined && tool === undefined) return undefined
  const args: Record<string, unknown> = {}
  let i = name.end
  for (;;) {
    i = skipSpace(text, i)
    const done = literal(text, i, CLOSE)
    if (typeof done === "object")
      return { end: done.end, value: { id: newId(), name: name.value, arguments: JSON.stringify(args) } }
    const argument = parseArgument(text, i)
    if (argument === undefined) return done === "partial" ? "partial" : undefined
    if (argument === "partial") return "partial"
    args[argument.value.key] = typedValue(tool, argument.value.key, argument.value.raw)
    i = argument.end
  }
}

/**
 * A reply's text and calls. `ending` as in ToolCalls.ts: "open" holds back a call not yet closed (or the start of its
 * marker); at the end ("final" or "cut") a call cut short is dropped, neither a call nor content (a reply that ends
 * inside the `<tool_call>` marker itself ended as text).
 */
export const parseGlmCalls = (
  text: string,
  tools: ReadonlyArray<ChatTool> | undefined,
  ending: "open" | "final" | "cut",
  newId: () => string
): MiniMaxParsed => {
  const segments: Array<MiniMaxSegment> = []
  let textFrom = 0
  let i = text.indexOf("<")
  while (i >= 0 && i < text.length) {
    const call = parseCall(text, i, tools, newId)
    const markerOnly = ending === "final" && literal(text, i, OPEN) === "partial"
    if (call === undefined || markerOnly) {
      i = text.indexOf("<", i + 1)
      continue
    }
    if (i > textFrom) segments.push({ _tag: "Text", text: text.slice(textFrom, i) })
    if (call === "partial") {
      if (ending === "open") return { segments, heldFrom: i }
      return { segments, heldFrom: undefined }
    }
    segments.push({ _tag: "Call", call: call.value })
    textFrom = call.end
    i = text.indexOf("<", textFrom)
  }
  if (textFrom < text.length) segments.push({ _tag: "Text", text: text.slice(textFrom) })
  return { segments, heldFrom: undefined }
}
