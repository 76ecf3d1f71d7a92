/**
 * OpenAI's wire shape of tools for /v1/chat/completions (HttpRoutes.ts): the request's `tools`, `tool_choice`,
 * `parallel_tool_calls` and tool messages checked and turned into ChatMessage / ChatToolOptions (Tools.ts), each
 * problem one line naming the field; and the response's `tool_calls` (whole, or as streamed `delta.tool_calls`
 * chunks, one per complete call). Rendering, parsing and grammar are ToolCalls.ts, shared with other API fronts.
 */
import { Schema } from "effect"
import type { ChatMessage } from "../../services/Tokenizer.js"
import type { ChatTool, ChatToolCall, ChatToolOptions, ToolChoice } from "../../services/Tools.js"

/** The tool fields of a chat body (checked by `chatWithTools`, so each problem names its field). */
export const ToolFields = {
  tools: Schema.optional(Schema.NullOr(Schema.Array(Schema.Unknown))),
  tool_choice: Schema.optional(Schema.NullOr(Schema.Unknown)),
  parallel_tool_calls: Schema.optional(Schema.NullOr(Schema.Boolean))
}

const TextPart = Schema.Struct({ type: Schema.Literal("text"), text: Schema.String })

/** One message of a chat body: tool messages, and assistant messages with `tool_calls` (content may be null). */
export const ChatMessageBody = Schema.Struct({
  role: Schema.Literal("system", "developer", "user", "assistant", "tool"),
  content: Schema.optional(Schema.NullOr(Schema.Union(Schema.String, Schema.Array(TextPart)))),
  tool_calls: Schema.optional(Schema.NullOr(Schema.Array(Schema.Unknown))),
  tool_call_id: Schema.optional(Schema.NullOr(Schema.String))
})

interface ToolBody {
  readonly messages: ReadonlyArray<typeof ChatMessageBody.Type>
  readonly tools?: ReadonlyArray<unknown> | null | undefined
  readonly tool_choice?: unknown
  readonly parallel_tool_calls?: boolean | null | undefined
}

const isRecord = (value: unknown): value is Record<string, unknown> =>
  typeof value === "object" && value !== null && !Array.isArray(value)

const namePattern = /^[a-zA-Z0-9_-]{1,64}$/

const toolsOf = (raw: ReadonlyArray<unknown>): ReadonlyArray<ChatTool> | string => {
  const tools: Array<ChatTool> = []
  for (const [i, tool] of raw.entries()) {
    const at = `tools[${i}]`
    if (!isRecord(tool)) return `${at} must be an object`
    if (tool["type"] !== "function") return `${at}.type must be "function"`
    const fn = tool["function"]
    if (!isRecord(fn)) return `${at}.function is required`
    const name = fn["name"]
    if (name === undefined || name === null || name === "") return `${at}.function.name is required`
    if (typeof name !== "string" || !namePattern.test(name))
      return `${at}.function.name must be 1 to 64 letters, digits, _ or -`
    const before = tools.findIndex((t) => t.name === name)
    if (before >= 0) return `${at}.function.name: "${name}" is already the name of tools[${before}]`
    const description = fn["description"]
    if (description !== undefined && description !== null && typeof description !== "string") {
      return `${at}.function.description must be a string`
    }
    const parameters = fn["parameters"]
    if (parameters !== undefined && parameters !== null && !isRecord(parameters))
      return `${at}.function.parameters must be a JSON schema object`
    const strict = fn["strict"]
    if (strict !== undefined && strict !== null && typeof strict !== "boolean")
      return `${at}.function.strict must be true or false`
    tools.push({
      name,
      ...(typeof description === "string" ? { description } : {}),
      ...(isRecord(parameters) ? { parameters } : {})
    })
  }
  return tools
}

/** The choice, or a problem (`{ problem }`: the choices "auto", "none" and "required" are strings too). */
const choiceOf = (raw: unknown, tools: ReadonlyArray<ChatTool>): ToolChoice | { readonly problem: string } => {
  const problem = (text: string) => ({ problem: text })
  if (raw === undefined || raw === null) return tools.length > 0 ? "auto" : "none"
  if (raw === "auto" || raw === "none" || raw === "required") {
    return raw === "required" && tools.length === 0 ? problem('tool_choice "required" needs tools') : raw
  }
  if (typeof raw === "string")
    return problem(
      `tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}, got "${raw.slice(0, 40)}"`
    )
  if (!isRecord(raw) || raw["type"] !== "function") return problem('tool_choice.type must be "function"')
  const fn = raw["function"]
  const name = isRecord(fn) ? fn["name"] : undefined
  if (typeof name !== "string" || name === "") return problem("tool_choice.function.name is required")
  if (!tools.some((t) => t.name === name))
    return problem(`tool_choice.function.name: no tool named "${name.slice(0, 64)}" in tools`)
  return { name }
}

const textOf = (content: (typeof ChatMessageBody.Type)["content"]) =>
  content === undefined || content === null
    ? undefined
    : typeof content === "string"
      ? content
      : content.map((part) => part.text).join("")

const callsOf = (raw: ReadonlyArray<unknown>, at: string): ReadonlyArray<ChatToolCall> | string => {
  const calls: Array<ChatToolCall> = []
  for (const [j, call] of raw.entries()) {
    const here = `${at}.tool_calls[${j}]`
    if (!isRecord(call)) return `${here} must be an object`
    const id = call["id"]
    if (typeof id !== "string" || id === "") return `${here}.id is required`
    if (call["type"] !== undefined && call["type"] !== "function") return `${here}.type must be "function"`
    const fn = call["function"]
    if (!isRecord(fn)) return `${here}.function is required`
    const name = fn["name"]
    if (typeof name !== "string" || name === "") return `${here}.function.name is required`
    const args = fn["arguments"]
    if (typeof args !== "string") return `${here}.function.arguments must be a string of JSON`
    try {
      if (!isRecord(JSON.parse(args))) return `${here}.function.arguments must be a JSON object`
    } catch {
      return `${here}.function.arguments is not JSON`
    }
    calls.push({ id, name, arguments: args })
  }
  return calls
}

/**
 * A chat body's messages and tools, checked: the messages for the template, and the tool options (undefined when the
 * chat has neither tools nor tool messages, which renders as before tools existed), or a one-line problem naming the
 * field.
 */
export const chatWithTools = (
  body: ToolBody
): { readonly messages: ReadonlyArray<ChatMessage>; readonly tools: ChatToolOptions | undefined } | string => {
  const tools = toolsOf(body.tools ?? [])
  if (typeof tools === "string") return tools
  const choice = choiceOf(body.tool_choice, tools)
  if (typeof choice === "object" && "problem" in choice) return choice.problem
  const messages: Array<ChatMessage> = []
  const callIds = new Set<string>()
  for (const [i, m] of body.messages.entries()) {
    const at = `messages[${i}]`
    const content = textOf(m.content)
    if (m.role === "tool") {
      if (m.tool_call_id === undefined || m.tool_call_id === null || m.tool_call_id === "")
        return `${at}.tool_call_id is required`
      if (!callIds.has(m.tool_call_id)) {
        return `${at}.tool_call_id: "${m.tool_call_id.slice(0, 64)}" matches no tool call of an earlier assistant message`
      }
      messages.push({ role: "tool", content: content ?? "", toolCallId: m.tool_call_id })
    } else if (m.role === "assistant") {
      const calls = m.tool_calls === undefined || m.tool_calls === null ? [] : callsOf(m.tool_calls, at)
      if (typeof calls === "string") return calls
      for (const call of calls) callIds.add(call.id)
      messages.push({ role: "assistant", content: content ?? "", ...(calls.length > 0 ? { toolCalls: calls } : {}) })
    } else {
      if (content === undefined) return `${at}.content is required`
      messages.push({ role: m.role === "developer" ? "system" : m.role, content })
    }
  }
  const used = tools.length > 0 || messages.some((m) => m.role === "tool" || m.toolCalls !== undefined)
  return {
    messages,
    tools: used ? { tools, choice, ...(body.parallel_tool_calls === false ? { parallel: false } : {}) } : undefined
  }
}

/** `message.tool_calls` of a chat completion. */
export const toolCallsJson = (calls: ReadonlyArray<ChatToolCall>) =>
  calls.map((call) => ({
    id: call.id,
    type: "function" as const,
    function: { name: call.name, arguments: call.arguments }
  }))

/**
 * A call as streamed `delta.tool_calls`: the whole call in one chunk (its index among the choice's calls, id, type,
 * name and whole arguments), sent once it is complete (ToolCalls.ts toolCallStream).
 */
export const toolCallDelta = (index: number, call: ChatToolCall) => ({
  tool_calls: [
    { index, id: call.id, type: "function" as const, function: { name: call.name, arguments: call.arguments } }
  ]
})
