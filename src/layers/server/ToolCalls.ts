/**
 * Tool calls, independent of any wire format: `{name, description, parameters (JSON schema)}` in (ChatTool),
 * `{id, name, arguments (JSON text)}` out (ChatToolCall). How to use it from an API front (OpenAI's, Anthropic's):
 *
 * 1. Render: pass the tools and the choice to `formatChat(messages, {tools, choice, parallel})` (Server / Tokenizer).
 *    The model's own chat template renders them through node-llama-cpp (TokenizerLive); history items are
 *    ChatMessage's `toolCalls` (assistant) and `role: "tool"` with `toolCallId`. The FormattedChat's `tools` says how
 *    the model writes calls (`syntax`, a ToolSyntax) and, when the choice forces a call (`required`, a named function;
 *    with a generic JSON syntax also `auto`), a GBNF `grammar` to sample with (SamplingOptions.grammar).
 * 2. Parse: `parseToolCalls(text, syntax, tools)` splits a whole reply into content and calls; for a stream,
 *    `toolCallStream(syntax, tools)` takes the text as it comes (`push`) and gives back the content that can be shown
 *    now (text that might be the start of a call is held back) and the calls completed so far, each whole; `end()`
 *    gives the rest. Text that looks like a call but is not a valid one (unknown function, arguments that are no JSON)
 *    stays content; nothing here throws. A reply cut by max_tokens (`cut`, both forms) keeps the calls it completed and
 *    drops a call it cut short: neither a call nor content.
 * 3. `toolGrammar(...)` builds that grammar from the syntax and each tool's parameter schema (TokenizerLive calls it
 *    through `toolGrammarEffect` with JsonGrammar.ts's converter, so a schema it cannot enforce is a ChatRenderError
 *    naming `tools[i].function.parameters...`); `genericToolMessages(...)` turns a chat with tools into plain
 *    messages for a template that knows no tools (a system message describing them and the JSON reply; calls and
 *    results as JSON text), as llama.cpp's server does.
 */
import { randomBytes } from "node:crypto"
import { Effect } from "effect"
import type { ChatMessage } from "../../services/Tokenizer.js"
import type { ChatTool, ChatToolCall, ChatToolOptions, ToolSyntax } from "../../services/Tools.js"
import { isStringSchema, parseMiniMaxCalls } from "./MiniMaxM2.js"
import { parseGlmCalls } from "./Glm.js"

/** A new call id in OpenAI's form (`call_` and 24 hex digits). */
export const newToolCallId = (): string => `call_${randomBytes(12).toString("hex")}`

// --- parsing ---

const isSpace = (c: string | undefined) => c === " " || c === "\n" || c === "\t" || c === "\r"

/** The end of `pattern` matched at `at` (a whitespace run in the pattern matches any whitespace, or none), "partial"
 * when the text ends inside the match, -1 when it does not match. */
const matchLoose = (text: string, at: number, pattern: string): number | "partial" => {
  let i = at
  let j = 0
  while (j < pattern.length) {
    if (isSpace(pattern[j])) {
      while (j < pattern.length && isSpace(pattern[j])) j++
      while (i < text.length && isSpace(text[i])) i++
      if (i >= text.length && j < pattern.length) return "partial"
      continue
    }
    if (i >= text.length) return "partial"
    if (text[i] !== pattern[j]) return -1
    i++
    j++
  }
  return i
}

const skipSpace = (text: string, at: number) => {
  let i = at
  while (i < text.length && isSpace(text[i])) i++
  return i
}

/** The end of one JSON value starting at `at` (after whitespace), "partial" when the text ends inside it, -1 if none. */
const scanJson = (text: string, at: number): { readonly start: number; readonly end: number } | "partial" | -1 => {
  const start = skipSpace(text, at)
  if (start >= text.length) return "partial"
  const first = text[start]!
  if (first === "{" || first === "[" || first === '"') {
    let depth = 0
    let inString = false
    for (let i = start; i < text.length; i++) {
      const c = text[i]
      if (inString) {
        if (c === "\\") i++
        else if (c === '"') {
          inString = false
          if (depth === 0) return { start, end: i + 1 }
        }
      } else if (c === '"') inString = true
      else if (c === "{" || c === "[") depth++
      else if (c === "}" || c === "]") {
        depth--
        if (depth === 0) return { start, end: i + 1 }
        if (depth < 0) return -1
      }
    }
    return "partial"
  }
  return -1
}

/** The arguments as compact JSON text, when they are a JSON object (or a string holding one); else undefined. */
const argumentsText = (raw: unknown): string | undefined => {
  const value = typeof raw === "string" ? safeParse(raw) : raw
  return typeof value === "object" && value !== null && !Array.isArray(value) ? JSON.stringify(value) : undefined
}

const safeParse = (text: string): unknown => {
  try {
    return JSON.parse(text)
  } catch {
    return undefined
  }
}

type Segment = { readonly _tag: "Text"; readonly text: string } | { readonly _tag: "Call"; readonly call: ChatToolCall }

interface Parsed {
  readonly segments: ReadonlyArray<Segment>
  /** Where the text that might still become a call starts (not final); the text from there is not in `segments`. */
  readonly heldFrom: number | undefined
}

/**
 * How the text ends: "open" (more may come: text that might still become a call is held back), "final" (the reply
 * ended: text that did not become a call is content), "cut" (max_tokens ended the reply: the calls completed count, and
 * a call it cut short is dropped, neither a call nor content).
 */
type Ending = "open" | "final" | "cut"

type Family = Extract<ToolSyntax, { _tag: "Family" }>

const known = (tools: ReadonlyArray<ChatTool> | undefined, name: string) =>
  tools === undefined || tools.some((t) => t.name === name)

/** One call at `at`: its end and the call, "partial" when the text ends inside it, undefined when it is none. */
const parseCall = (
  text: string,
  at: number,
  syntax: Family,
  tools: ReadonlyArray<ChatTool> | undefined,
  final: boolean
): { readonly end: number; readonly call: ChatToolCall } | "partial" | undefined => {
  let after: number | undefined
  for (const prefix of [syntax.callPrefix, ...syntax.alternatePrefixes]) {
    const m = matchLoose(text, at, prefix.trimStart())
    if (m === "partial") return final ? undefined : "partial"
    if (m >= 0) {
      after = m
      break
    }
  }
  if (after === undefined) return undefined
  let nameEnd = after
  while (nameEnd < text.length && /[A-Za-z0-9_.:-]/.test(text[nameEnd]!)) nameEnd++
  if (nameEnd >= text.length) return final ? undefined : "partial"
  const name = text.slice(after, nameEnd)
  if (name === "" || name.length > 256) return undefined
  const params = matchLoose(
    text,
    syntax.paramsPrefix.startsWith(" ") ? nameEnd : skipSpace(text, nameEnd),
    syntax.paramsPrefix
  )
  if (params === "partial") return final ? undefined : "partial"
  if (params < 0) return undefined
  const json = scanJson(text, params)
  if (json === "partial") return final ? undefined : "partial"
  if (json === -1) return undefined
  // The arguments as the model wrote them (re-serializing could change a value: 1e999 would become null).
  const raw = text.slice(json.start, json.end)
  const value = safeParse(raw)
  const args = typeof value === "string" ? argumentsText(value) : argumentsText(value) === undefined ? undefined : raw
  if (args === undefined || !known(tools, name)) return undefined
  const call = { id: newToolCallId(), name, arguments: args }
  if (syntax.callSuffix.trim() === "") return { end: json.end, call }
  const suffix = matchLoose(text, skipSpace(text, json.end), syntax.callSuffix.trimStart())
  // The suffix cut short by the end of the text (a stop): the call is whole once the text is.
  if (suffix === "partial") return final ? { end: text.length, call } : "partial"
  // No suffix (the model left it out): the call still counts.
  return { end: suffix < 0 ? json.end : suffix, call }
}

/** Calls in a section (`sectionPrefix` call (`betweenCalls` call)* `sectionSuffix`) starting at `at`. */
const parseSection = (
  text: string,
  at: number,
  syntax: Family,
  tools: ReadonlyArray<ChatTool> | undefined,
  final: boolean
): { readonly end: number; readonly calls: ReadonlyArray<ChatToolCall> } | "partial" | undefined => {
  const open = matchLoose(text, at, syntax.sectionPrefix.trimStart())
  if (open === "partial") return final ? undefined : "partial"
  if (open < 0) return undefined
  const calls: Array<ChatToolCall> = []
  let i = open
  for (;;) {
    const call = parseCall(text, skipSpace(text, i), syntax, tools, final)
    if (call === "partial") return "partial"
    if (call === undefined) return calls.length === 0 ? undefined : close(i)
    calls.push(call.call)
    i = call.end
    const between = syntax.betweenCalls.trim() === "" ? i : matchLoose(text, i, syntax.betweenCalls.trimStart())
    if (between === "partial") return final ? close(i) : "partial"
    if (between < 0) return close(i)
    if (between === i && syntax.betweenCalls.trim() !== "") return close(i)
    i = between
  }
  function close(end: number) {
    if (syntax.sectionSuffix.trim() === "") return { end, calls }
    const m = matchLoose(text, skipSpace(text, end), syntax.sectionSuffix.trimStart())
    if (m === "partial") return final ? { end: text.length, calls } : "partial"
    return { end: m < 0 ? end : m, calls }
  }
}

const parseFamily = (
  text: string,
  syntax: Family,
  tools: ReadonlyArray<ChatTool> | undefined,
  ending: Ending
): Parsed => {
  const sectioned = syntax.sectionPrefix.trim() !== ""
  const markers = (sectioned ? [syntax.sectionPrefix] : [syntax.callPrefix, ...syntax.alternatePrefixes])
    .map((m) => m.trimStart())
    .filter((m) => m !== "")
  const firsts = new Set(markers.map((m) => m[0]!))
  const segments: Array<Segment> = []
  let textFrom = 0
  let i = 0
  while (i < text.length) {
    if (!firsts.has(text[i]!)) {
      i++
      continue
    }
    const at = i
    const find = (final: boolean) =>
      sectioned
        ? parseSection(text, at, syntax, tools, final)
        : ((r) => (r === undefined || r === "partial" ? r : { end: r.end, calls: [r.call] }))(
            parseCall(text, at, syntax, tools, final)
          )
    const found = find(ending === "final")
    if (found === undefined) {
      i++
      continue
    }
    if (i > textFrom) segments.push({ _tag: "Text", text: text.slice(textFrom, i) })
    if (found === "partial" && ending === "cut") {
      // Cut inside a call or a section of calls: the calls that completed (a call whose closing markup alone was
      // cut is complete), and nothing of the rest.
      const complete = find(true)
      if (typeof complete === "object") for (const call of complete.calls) segments.push({ _tag: "Call", call })
      return { segments, heldFrom: undefined }
    }
    if (found === "partial") return { segments, heldFrom: i }
    for (const call of found.calls) segments.push({ _tag: "Call", call })
    textFrom = i = found.end
  }
  if (textFrom < text.length) segments.push({ _tag: "Text", text: text.slice(textFrom) })
  return { segments, heldFrom: undefined }
}

/** The end of the JSON value at `at` (after whitespace): objects, arrays and strings by scanJson, others to a delimiter. */
const valueEnd = (text: string, at: number): number => {
  const json = scanJson(text, at)
  if (typeof json === "object") return json.end
  let i = skipSpace(text, at)
  while (i < text.length && !/[,}\]\s]/.test(text[i]!)) i++
  return i
}

/** The raw text of each element of the JSON array at `at` (valid JSON: JSON.parse took it). */
const rawItems = (text: string, at: number): Array<{ readonly start: number; readonly end: number }> => {
  const items: Array<{ start: number; end: number }> = []
  let i = skipSpace(text, at) + 1
  for (;;) {
    i = skipSpace(text, i)
    if (i >= text.length || text[i] === "]") return items
    const start = i
    i = valueEnd(text, i)
    items.push({ start, end: i })
    i = skipSpace(text, i)
    if (text[i] === ",") i++
  }
}

/** The raw text of member `key` of the JSON object at `at` (the last, as JSON.parse keeps it), if any. */
const rawMember = (
  text: string,
  at: number,
  key: string
): { readonly start: number; readonly end: number } | undefined => {
  let found: { start: number; end: number } | undefined
  let i = skipSpace(text, at) + 1
  for (;;) {
    i = skipSpace(text, i)
    if (i >= text.length || text[i] !== '"') return found
    const name = scanJson(text, i)
    if (typeof name !== "object") return found
    i = skipSpace(text, name.end) + 1
    const start = skipSpace(text, i)
    i = valueEnd(text, start)
    if (safeParse(text.slice(name.start, name.end)) === key) found = { start, end: i }
    i = skipSpace(text, i)
    if (text[i] === ",") i++
  }
}

/** The generic JSON reply: `{"tool_call"}`, `{"tool_calls"}` or `{"response"}`; anything else stays text. */
const parseGeneric = (text: string, tools: ReadonlyArray<ChatTool> | undefined): Parsed => {
  const value = safeParse(text.trim())
  const asText: Parsed = { segments: text === "" ? [] : [{ _tag: "Text", text }], heldFrom: undefined }
  if (typeof value !== "object" || value === null) return asText
  const record = value as Record<string, unknown>
  if (typeof record["response"] === "string")
    return { segments: [{ _tag: "Text", text: record["response"] }], heldFrom: undefined }
  const raw = Array.isArray(record["tool_calls"])
    ? record["tool_calls"]
    : record["tool_call"] !== undefined
      ? [record["tool_call"]]
      : undefined
  if (raw === undefined || raw.length === 0) return asText
  // where each call object is written (its arguments object is given as the model wrote it, as in the families)
  const top = skipSpace(text, 0)
  const listed = Array.isArray(record["tool_calls"]) ? rawMember(text, top, "tool_calls") : undefined
  const spans = listed !== undefined ? rawItems(text, listed.start) : [rawMember(text, top, "tool_call")]
  const calls: Array<Segment> = []
  for (const [k, item] of raw.entries()) {
    const call = genericCall(item, text, spans[k], tools)
    if (call === undefined) return asText
    calls.push({ _tag: "Call", call })
  }
  return { segments: calls, heldFrom: undefined }
}

/**
 * One call of the generic form (`{"name": ..., "arguments": {...}}`, written at `span` of `text`), its arguments as the
 * model wrote them; undefined when it is no call of a known tool.
 */
const genericCall = (
  item: unknown,
  text: string,
  span: { readonly start: number; readonly end: number } | undefined,
  tools: ReadonlyArray<ChatTool> | undefined
): ChatToolCall | undefined => {
  if (typeof item !== "object" || item === null) return undefined
  const { arguments: args, name } = item as Record<string, unknown>
  const json = argumentsText(args ?? {})
  if (typeof name !== "string" || json === undefined || !known(tools, name)) return undefined
  const member = span === undefined ? undefined : rawMember(text, span.start, "arguments")
  const written = member === undefined ? undefined : text.slice(member.start, member.end)
  const asWritten = written !== undefined && written.startsWith("{") && argumentsText(safeParse(written)) !== undefined
  return { id: newToolCallId(), name, arguments: asWritten ? written : json }
}

/**
 * The generic reply cut by max_tokens. Where it is (the start of) a call object, `{"tool_calls": [...` or
 * `{"tool_call": ...`: the calls written whole before the cut (a list's items up to the first one cut or not a call),
 * and no content. Anything else is read as a reply that ended there.
 */
const parseGenericCut = (text: string, tools: ReadonlyArray<ChatTool> | undefined): Parsed => {
  const top = skipSpace(text, 0)
  if (safeParse(text.trim()) !== undefined || matchLoose(text, top, '{ "tool_call') === -1)
    return parseGeneric(text, tools)
  const found = (pattern: string) => ((m) => (m === "partial" || m < 0 ? undefined : m))(matchLoose(text, top, pattern))
  const list = found('{ "tool_calls" : [')
  const segments: Array<Segment> = []
  let at = list ?? found('{ "tool_call" : ') ?? text.length
  for (;;) {
    const span = scanJson(text, at)
    if (typeof span !== "object") break
    const call = genericCall(safeParse(text.slice(span.start, span.end)), text, span, tools)
    if (call === undefined) break
    segments.push({ _tag: "Call", call })
    at = skipSpace(text, span.end)
    if (list === undefined || text[at] !== ",") break
    at++
  }
  return { segments, heldFrom: undefined }
}

const parse = (text: string, syntax: ToolSyntax, tools: ReadonlyArray<ChatTool> | undefined, ending: Ending): Parsed =>
  syntax._tag === "Family"
    ? parseFamily(text, syntax, tools, ending)
    : syntax._tag === "MiniMaxM2"
      ? parseMiniMaxCalls(text, tools, ending, newToolCallId)
      : syntax._tag === "Glm"
        ? parseGlmCalls(text, tools, ending, newToolCallId)
        : ending === "open"
          ? { segments: [], heldFrom: 0 }
          : ending === "cut"
            ? parseGenericCut(text, tools)
            : parseGeneric(text, tools)

/**
 * A whole reply: its text outside calls (trimmed; "" when none) and its calls, in order (`parallel: false`: the first
 * only, the others dropped). `cut`: max_tokens ended the reply; the calls it completed count, and a call it cut short
 * is dropped (neither a call nor content).
 */
export const parseToolCalls = (
  text: string,
  syntax: ToolSyntax,
  tools?: ReadonlyArray<ChatTool>,
  parallel = true,
  cut = false
): { readonly content: string; readonly calls: ReadonlyArray<ChatToolCall> } => {
  const { segments } = parse(text, syntax, tools, cut ? "cut" : "final")
  const all = segments.flatMap((s) => (s._tag === "Call" ? [s.call] : []))
  const calls = parallel ? all : all.slice(0, 1)
  const content = segments.map((s) => (s._tag === "Text" ? s.text : "")).join("")
  return { content: calls.length > 0 ? content.trim() : content, calls }
}

/** What a piece of streamed text gives: content to show, and the calls it completed. */
export interface ToolCallPiece {
  readonly content: string
  /** Calls completed by this piece, whole. */
  readonly calls: ReadonlyArray<ChatToolCall>
}

export interface ToolCallStream {
  /** More text: the content that can be shown now, and the calls completed by it. */
  readonly push: (text: string) => ToolCallPiece
  /**
   * The end of the reply: what was held back, as content or calls. `cut`: max_tokens ended it; a call it cut short is
   * dropped (neither a call nor content).
   */
  readonly end: (cut?: boolean) => ToolCallPiece
}

/**
 * A reply as it streams: text that might be the start of a call is held back until it is one (or is not); with the
 * generic JSON syntax the whole reply is held until its end. After a call, text of whitespace only is dropped.
 *
 * A call goes out whole, once it is complete (at its closing markup; a section's calls, e.g. Mistral's `[TOOL_CALLS]`,
 * each as it completes; the generic form's at the reply's end), never in pieces: a reply cut by max_tokens in the
 * middle of a call must not have shown any of it, and a piece sent cannot be taken back. `parallel: false`: calls
 * after the first are dropped (neither calls nor content). The pieces add up to `parseToolCalls` of the whole reply.
 */
export const toolCallStream = (
  syntax: ToolSyntax,
  tools?: ReadonlyArray<ChatTool>,
  parallel = true
): ToolCallStream => {
  let held = ""
  let called = false
  let count = 0
  const step = (ending: Ending): ToolCallPiece => {
    const { heldFrom, segments } = parse(held, syntax, tools, ending)
    held = heldFrom === undefined ? "" : held.slice(heldFrom)
    let content = ""
    const calls: Array<ChatToolCall> = []
    for (const segment of segments) {
      if (segment._tag === "Call") {
        if (parallel || count === 0) calls.push(segment.call)
        count++
        called = true
      } else if (!(called && segment.text.trim() === "")) content += segment.text
    }
    return { content, calls }
  }
  return {
    push: (text) => {
      held += text
      return step("open")
    },
    end: (cut = false) => step(cut ? "cut" : "final")
  }
}

// --- grammar ---

/** A GBNF string literal of `text` ("" for none). */
const literal = (text: string) =>
  text === ""
    ? ""
    : `"${text
        .replace(/[\\"]/g, (c) => `\\${c}`)
        .replace(/\n/g, "\\n")
        .replace(/\r/g, "\\r")
        .replace(/\t/g, "\\t")}"`

/** node-llama-cpp's JSON-schema grammars end their root in four newlines (its own end marker): not part of a call. */
const withoutEndMarker = (gbnf: string) => gbnf.replace(/ "\\n\\n\\n\\n" \[\\n\]\*$/m, "")

/** Every rule of a GBNF grammar renamed with `prefix` (references too; literals and character classes untouched). */
const renameRules = (gbnf: string, prefix: string): string => {
  const names = new Set(Array.from(gbnf.matchAll(/^([a-zA-Z0-9-]+)\s*::=/gm), (m) => m[1]!))
  let out = ""
  for (let i = 0; i < gbnf.length;) {
    const c = gbnf[i]!
    if (c === '"' || c === "[") {
      const close = c === '"' ? '"' : "]"
      let j = i + 1
      while (j < gbnf.length && gbnf[j] !== close) j += gbnf[j] === "\\" ? 2 : 1
      out += gbnf.slice(i, j + 1)
      i = j + 1
    } else if (c === "#") {
      const j = gbnf.indexOf("\n", i)
      const end = j < 0 ? gbnf.length : j
      out += gbnf.slice(i, end)
      i = end
    } else if (/[a-zA-Z0-9-]/.test(c)) {
      let j = i
      while (j < gbnf.length && /[a-zA-Z0-9-]/.test(gbnf[j]!)) j++
      const word = gbnf.slice(i, j)
      out += names.has(word) ? `${prefix}${word}` : word
      i = j
    } else {
      out += c
      i++
    }
  }
  return out
}

const noArguments = { type: "object", properties: {} }

/** The tools a choice allows: the named one, or all. */
export const toolsAllowed = (options: ChatToolOptions): ReadonlyArray<ChatTool> =>
  typeof options.choice === "object"
    ? options.tools.filter((t) => t.name === (options.choice as { name: string }).name)
    : options.tools

/**
 * `toolGrammar` with a JSON-schema converter that is an effect (JsonGrammar.ts's `jsonSchemaGrammar`): each allowed
 * tool's parameters are converted first under their own path (`tools[i].function.parameters`), so a schema the
 * converter refuses fails naming its field. Nothing is converted when the reply is left free.
 */
export const toolGrammarEffect = <E>(
  syntax: ToolSyntax,
  options: ChatToolOptions,
  jsonGrammar: (schema: unknown, path: string) => Effect.Effect<string, E>
): Effect.Effect<string | undefined, E> =>
  Effect.gen(function* () {
    if (toolGrammar(syntax, options, () => 'root ::= ""') === undefined) return undefined
    const allowed = new Set(toolsAllowed(options).map((t) => t.name))
    yield* Effect.forEach(
      options.tools.flatMap((tool, index) => (allowed.has(tool.name) ? [[tool, index] as const] : [])),
      ([tool, index]) => jsonGrammar(tool.parameters ?? noArguments, `tools[${index}].function.parameters`),
      { discard: true }
    )
    const asked: Array<unknown> = []
    toolGrammar(syntax, options, (schema) => {
      asked.push(schema)
      return 'root ::= ""'
    })
    const texts = yield* Effect.forEach(asked, (schema) => jsonGrammar(schema, "tools"))
    let next = 0
    return toolGrammar(syntax, options, () => texts[next++]!)
  })

/**
 * The GBNF grammar that makes the reply calls only (`required`, a named function: exactly that one), in the syntax,
 * each call's arguments following its tool's schema; with the generic syntax also for `auto` (a call or
 * `{"response": text}`). Undefined when the reply is left free (`auto` with the family's syntax, `none`).
 * `jsonGrammar`: a JSON schema to a GBNF grammar whose root is that JSON value (node-llama-cpp's converter).
 */
export const toolGrammar = (
  syntax: ToolSyntax,
  options: ChatToolOptions,
  jsonGrammar: (schema: unknown) => string
): string | undefined => {
  if (options.choice === "none") return undefined
  const tools = toolsAllowed(options)
  const parallel =
    syntax.parallel && options.choice !== "auto" && typeof options.choice !== "object" && options.parallel !== false
  if (syntax._tag === "Generic") {
    const schemas = tools.map((tool) => ({
      type: "object",
      properties: { name: { const: tool.name }, arguments: tool.parameters ?? noArguments },
      required: ["name", "arguments"]
    }))
    const one = schemas.length === 1 ? schemas[0] : { oneOf: schemas }
    const call = parallel
      ? {
          type: "object",
          properties: { tool_calls: { type: "array", items: one, minItems: 1 } },
          required: ["tool_calls"]
        }
      : { type: "object", properties: { tool_call: one }, required: ["tool_call"] }
    const schema =
      options.choice === "auto"
        ? { oneOf: [call, { type: "object", properties: { response: { type: "string" } }, required: ["response"] }] }
        : call
    return withoutEndMarker(jsonGrammar(schema))
  }
  if (options.choice === "auto") return undefined
  if (syntax._tag === "MiniMaxM2") return miniMaxGrammar(tools, parallel, jsonGrammar)
  if (syntax._tag === "Glm") return glmGrammar(tools, parallel, syntax, jsonGrammar)
  const rules: Array<string> = []
  const calls = tools.map((tool, index) => {
    const args = renameRules(withoutEndMarker(jsonGrammar(tool.parameters ?? noArguments)), `t${index}-`)
    rules.push(args)
    const parts = [
      literal(syntax.callPrefix),
      literal(tool.name),
      literal(syntax.paramsPrefix),
      `t${index}-root`,
      literal(syntax.callSuffix)
    ]
    return `call${index} ::= ${parts.filter((p) => p !== "").join(" ")}`
  })
  const call = `call ::= ${tools.map((_, index) => `call${index}`).join(" | ")}`
  const more = parallel ? ` (${[literal(syntax.betweenCalls), "call"].filter((p) => p !== "").join(" ")})*` : ""
  const root = `root ::= ${[literal(syntax.sectionPrefix), `call${more}`, literal(syntax.sectionSuffix)].filter((p) => p !== "").join(" ")}`
  return [root, call, ...calls, ...rules].join("\n")
}

const propertiesOf = (schema: unknown): ReadonlyArray<readonly [string, unknown]> => {
  const properties = (schema as { properties?: unknown } | undefined)?.properties
  return typeof properties === "object" && properties !== null ? Object.entries(properties) : []
}

/**
 * MiniMax-M2's forced calls (MiniMaxM2.ts): `<minimax:tool_call>` and one `<invoke name="NAME">` per call, its
 * parameters in the schema's order (the required ones each once, the others optional), a string argument's value any
 * text without `</`, another's the JSON its schema admits.
 */
const miniMaxGrammar = (
  tools: ReadonlyArray<ChatTool>,
  parallel: boolean,
  jsonGrammar: (schema: unknown) => string
): string => {
  const rules: Array<string> = ['text ::= ([^<] | "<" [^/])*']
  const calls = tools.map((tool, index) => {
    const required = new Set((tool.parameters as { required?: ReadonlyArray<string> } | undefined)?.required ?? [])
    const parameters = propertiesOf(tool.parameters).map(([name, schema], k) => {
      const prefix = `t${index}-p${k}-`
      const value = isStringSchema(schema) ? "text" : `${prefix}root`
      if (value !== "text") rules.push(renameRules(withoutEndMarker(jsonGrammar(schema)), prefix))
      const one = `${literal(`<parameter name="${name}">`)} ${value} ${literal("</parameter>\n")}`
      return required.has(name) ? one : `(${one})?`
    })
    return `call${index} ::= ${[literal(`<invoke name="${tool.name}">\n`), ...parameters, literal("</invoke>\n")].join(" ")}`
  })
  const call = `call ::= ${tools.map((_, index) => `call${index}`).join(" | ")}`
  const root = `root ::= ${literal("<minimax:tool_call>\n")} call${parallel ? " call*" : ""} ${literal("</minimax:tool_call>")}`
  return [root, call, ...calls, ...rules].join("\n")
}

/**
 * GLM's forced calls (Glm.ts): one `<tool_call>NAME` block per call, its arguments as `<arg_key>`/`<arg_value>` pairs
 * in the schema's order (the required ones each once, the others optional), the template's `between` text between the
 * tags, a string argument's value any text without `</`, another's the JSON its schema admits. A prompt that left a
 * `<think>` open gets it closed first (no reasoning).
 */
const glmGrammar = (
  tools: ReadonlyArray<ChatTool>,
  parallel: boolean,
  syntax: Extract<ToolSyntax, { _tag: "Glm" }>,
  jsonGrammar: (schema: unknown) => string
): string => {
  const between = syntax.between
  const rules: Array<string> = ['text ::= ([^<] | "<" [^/])*']
  const calls = tools.map((tool, index) => {
    const required = new Set((tool.parameters as { required?: ReadonlyArray<string> } | undefined)?.required ?? [])
    const parameters = propertiesOf(tool.parameters).map(([name, schema], k) => {
      const prefix = `t${index}-p${k}-`
      const value = isStringSchema(schema) ? "text" : `${prefix}root`
      if (value !== "text") rules.push(renameRules(withoutEndMarker(jsonGrammar(schema)), prefix))
      const one = `${literal(`<arg_key>${name}</arg_key>${between}<arg_value>`)} ${value} ${literal(`</arg_value>${between}`)}`
      return required.has(name) ? one : `(${one})?`
    })
    return `call${index} ::= ${[literal(`<tool_call>${tool.name}${between}`), ...parameters, literal("</tool_call>")].join(" ")}`
  })
  const call = `call ::= ${tools.map((_, index) => `call${index}`).join(" | ")}`
  const open = syntax.thinkOpen ? `${literal("</think>")} ` : ""
  const more = parallel ? ` (${between === "" ? "" : `${literal(between)} `}call)*` : ""
  const root = `root ::= ${open}call${more}`
  return [root, call, ...calls, ...rules].join("\n")
}

// --- templates without tools ---

/**
 * For a chat template that knows no tools (the Generic syntax): the messages with a system message that lists the
 * tools (their JSON schemas) and asks for one JSON object as the reply, earlier calls as that JSON (the assistant's
 * text, when any, alongside) and tool results as user messages holding `{"tool_response": {...}}`.
 */
export const genericToolMessages = (
  messages: ReadonlyArray<ChatMessage>,
  options: ChatToolOptions | undefined
): ReadonlyArray<ChatMessage> => {
  const plain = messages.map((m): ChatMessage => {
    if (m.role === "tool") {
      const call = messages.flatMap((c) => c.toolCalls ?? []).find((c) => c.id === m.toolCallId)
      return {
        role: "user",
        content: JSON.stringify({
          tool_response: { ...(call === undefined ? {} : { name: call.name }), id: m.toolCallId, content: m.content }
        })
      }
    }
    if (m.role === "assistant" && m.toolCalls !== undefined && m.toolCalls.length > 0) {
      const calls = m.toolCalls.map((c) => ({
        name: c.name,
        arguments: safeParse(c.arguments) ?? c.arguments,
        id: c.id
      }))
      const json = calls.length === 1 ? { tool_call: calls[0] } : { tool_calls: calls }
      return {
        role: "assistant",
        content: m.content === "" ? JSON.stringify(json) : `${m.content}\n${JSON.stringify(json)}`
      }
    }
    return { role: m.role, content: m.content }
  })
  if (options === undefined || options.choice === "none" || options.tools.length === 0) return plain
  const tools = toolsAllowed(options).map((t) => ({
    name: t.name,
    ...(t.description === undefined ? {} : { description: t.description }),
    parameters: t.parameters ?? noArguments
  }))
  const parallel = options.parallel !== false
  const instructions = [
    "You can call these tools (JSON schemas of their arguments):",
    JSON.stringify(tools),
    `Reply with one JSON object: ${parallel ? '{"tool_calls": [{"name": ..., "arguments": {...}}]}' : '{"tool_call": {"name": ..., "arguments": {...}}}'} ` +
      `to call ${parallel ? "tools" : "a tool"}${options.choice === "auto" ? ', or {"response": "..."} to answer the user' : ""}.`
  ].join("\n")
  const first = plain[0]
  return first?.role === "system"
    ? [{ role: "system", content: `${first.content}\n\n${instructions}` }, ...plain.slice(1)]
    : [{ role: "system", content: instructions }, ...plain]
}
