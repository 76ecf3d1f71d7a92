/**
 * GLM's replies (GLM-4.5…4.7, GLM-5; Glm.ts, Reasoning.ts): `<think>…</think>` is the reasoning, each call a
 * `<tool_call>NAME` block of `<arg_key>`/`<arg_value>` pairs, each value typed by the tool's JSON schema (strings as
 * written, the rest JSON), as llama.cpp's parser reads them (its test-chat.cpp cases among them). On fixed model
 * outputs in both spellings (GLM-4.7/5's tags back to back, GLM-4.5/4.6's on lines of their own): several calls,
 * typed values, a call without arguments, reasoning before a call (and a prompt that opened the `<think>`), a call cut
 * off at the end (not passed off as content), streamed in pieces of any size (the whole reply's split). The format is
 * found from the GGUF's template text (GLM's own: the synthetic `glm`), which renders the tools and the history's calls
 * as the model writes them, and forces a call with a grammar in the format.
 */
import * as lib from "node-llama-cpp"
import { describe, expect, it } from "vitest"
import { ownArguments, wrapperToolSyntax } from "../../src/layers/gguf/TokenizerLive.js"
import { contentBlocks, replyStream, wholeReply } from "../../src/layers/server/AnthropicMessages.js"
import { syntheticTemplateSpec } from "../../src/layers/gguf/SyntheticTemplates.js"
import {
  type ReasoningFormat,
  reasoningFormatOf,
  reasoningStream,
  splitReasoning
} from "../../src/layers/server/Reasoning.js"
import { parseToolCalls, toolCallStream, toolGrammar } from "../../src/layers/server/ToolCalls.js"
import type { ChatTool, ToolSyntax } from "../../src/services/Tools.js"

const syntax: ToolSyntax = { _tag: "Glm", parallel: true, between: "", thinkOpen: false }

const tools: ReadonlyArray<ChatTool> = [
  {
    name: "get_weather",
    parameters: {
      type: "object",
      properties: {
        city: { type: "string" },
        days: { type: "integer" },
        alerts: { type: "boolean" },
        zip: { type: "string" },
        unit: { enum: ["celsius", "fahrenheit"] },
        where: { type: "object" },
        hours: { type: "array", items: { type: "number" } }
      },
      required: ["city"]
    }
  },
  { name: "get_time", parameters: { type: "object", properties: { zone: { type: "string" } } } },
  { name: "read_file_diff_md", parameters: { type: "object", properties: { review_id: { type: "string" } } } }
]

const weatherArgs = {
  city: "Paris\nFrance",
  days: 3,
  alerts: true,
  zip: "75001",
  unit: "celsius",
  where: { lat: 48.85, lon: 2.35 },
  hours: [1, 2.5]
}

const pairs: ReadonlyArray<readonly [string, string]> = [
  ["city", "Paris\nFrance"],
  ["days", "3"],
  ["alerts", "true"],
  ["zip", "75001"],
  ["unit", "celsius"],
  ["where", '{"lat": 48.85, "lon": 2.35}'],
  ["hours", "[1, 2.5]"]
]

/** Two calls as GLM-4.7/5 write them (`between` ""), or as GLM-4.5/4.6 do ("\n": each tag on its line). */
const twoCallsIn = (between: string) => {
  const call = (name: string, args: ReadonlyArray<readonly [string, string]>) =>
    `${between}<tool_call>${name}${between}` +
    args.map(([k, v]) => `<arg_key>${k}</arg_key>${between}<arg_value>${v}</arg_value>${between}`).join("") +
    "</tool_call>"
  return "Let me look that up." + call("get_weather", pairs) + call("get_time", [["zone", "CET"]])
}
const twoCalls = twoCallsIn("")
const reasoning = "<think>The user wants the weather and the time.\nI will call both.</think>"
const reply = reasoning + twoCalls
const thought = "The user wants the weather and the time.\nI will call both."

const callsOf = (calls: ReadonlyArray<{ readonly name: string; readonly arguments: string }>) =>
  calls.map((c) => ({ name: c.name, arguments: JSON.parse(c.arguments) as unknown }))

/** The reply through the reasoning splitter and the tools' parser, in pieces of `size` characters. */
const streamed = (text: string, size: number, cut = false, format: ReasoningFormat = "GLM") => {
  const think = reasoningStream(format)
  const calls = toolCallStream(syntax, tools)
  let thinking = ""
  let content = ""
  const found: Array<{ name: string; arguments: string }> = []
  const take = (piece: { reasoning: string; content: string }, last: boolean) => {
    thinking += piece.reasoning
    const parsed = calls.push(piece.content)
    const rest = last ? calls.end(cut) : { content: "", calls: [] }
    content += parsed.content + rest.content
    found.push(...parsed.calls, ...rest.calls)
  }
  for (let i = 0; i < text.length; i += size) take(think.push(text.slice(i, i + size)), false)
  take(think.end(), true)
  return { reasoning: thinking, content, calls: callsOf(found) }
}

describe("GLM replies", () => {
  it("reasoning in <think> is the reasoning; a prompt that opened the <think> starts the reply in it", () => {
    expect(reasoningFormatOf("GLM")).toBe("GLM")
    expect(reasoningFormatOf("GLM-open-think")).toBe("GLM-open-think")
    expect(splitReasoning("GLM", `${reasoning}Hello there.`)).toEqual({ reasoning: thought, content: "Hello there." })
    expect(splitReasoning("GLM", "Just an answer.")).toEqual({ reasoning: "", content: "Just an answer." })
    // llama.cpp's GLM-4.7 case: the prompt ends in <think>, the reply in the reasoning until </think>
    expect(splitReasoning("GLM-open-think", "I'm\nthinking</think>Hello, world!\nWhat's up?")).toEqual({
      reasoning: "I'm\nthinking",
      content: "Hello, world!\nWhat's up?"
    })
    expect(splitReasoning("GLM-open-think", "Let me th")).toEqual({ reasoning: "Let me th", content: "" })
  })

  it("several calls, each value typed by its tool's schema, in GLM-4.7/5's spelling and GLM-4.5/4.6's", () => {
    for (const between of ["", "\n"]) {
      const parsed = parseToolCalls(twoCallsIn(between), syntax, tools)
      expect(parsed.content).toBe("Let me look that up.")
      expect(callsOf(parsed.calls)).toEqual([
        { name: "get_weather", arguments: weatherArgs },
        { name: "get_time", arguments: { zone: "CET" } }
      ])
      expect(parsed.calls[0]!.id).toMatch(/^call_[0-9a-f]{24}$/)
      expect(callsOf(parseToolCalls(twoCallsIn(between), syntax, tools, false).calls)).toHaveLength(1)
    }
    // llama.cpp's test-chat.cpp cases: GLM-4.6's lines, and a call with no arguments (#20650)
    const special: ReadonlyArray<ChatTool> = [
      { name: "special_function", parameters: { type: "object", properties: { arg1: { type: "integer" } } } }
    ]
    const glm46 = "<tool_call>special_function\n<arg_key>arg1</arg_key>\n<arg_value>1</arg_value>\n</tool_call>"
    expect(callsOf(parseToolCalls(glm46, syntax, special).calls)).toEqual([
      { name: "special_function", arguments: { arg1: 1 } }
    ])
    const bare = splitReasoning(
      "GLM-open-think",
      "Let me read the diff content.</think><tool_call>read_file_diff_md</tool_call>"
    )
    expect(bare.reasoning).toBe("Let me read the diff content.")
    expect(callsOf(parseToolCalls(bare.content, syntax, tools).calls)).toEqual([
      { name: "read_file_diff_md", arguments: {} }
    ])
  })

  it("streamed in pieces of any size: the whole reply's reasoning, content and calls, no markup in the content", () => {
    for (const between of ["", "\n"])
      for (const size of [1, 2, 3, 7, 16, 1000]) {
        const out = streamed(reasoning + twoCallsIn(between), size)
        expect(out.reasoning).toBe(thought)
        // GLM-4.5/4.6's newline before a call goes out before the call is known
        expect(out.content.trim()).toBe("Let me look that up.")
        expect(out.calls).toEqual([
          { name: "get_weather", arguments: weatherArgs },
          { name: "get_time", arguments: { zone: "CET" } }
        ])
      }
  })

  it("a call cut off at the end (max_tokens) is dropped, not passed off as content; the calls before it count", () => {
    const second = twoCalls.indexOf("<tool_call>get_time")
    const cuts: ReadonlyArray<readonly [number, ReadonlyArray<string>]> = [
      [twoCalls.indexOf("<tool_call>") + 4, []],
      [twoCalls.indexOf("75001"), []],
      [twoCalls.indexOf('{"lat'), []],
      [second + 5, ["get_weather"]],
      [second + 30, ["get_weather"]],
      // only the closing tag cut
      [twoCalls.length - 3, ["get_weather"]]
    ]
    for (const [end, before] of cuts) {
      const text = twoCalls.slice(0, end)
      const whole = parseToolCalls(text, syntax, tools, true, true)
      expect(whole.content, text).toBe("Let me look that up.")
      expect(whole.calls.map((c) => c.name)).toEqual(before)
      for (const size of [1, 5]) {
        const out = streamed(reasoning + text, size, true)
        expect(out.content, text).toBe("Let me look that up.")
        expect(out.calls.map((c) => c.name)).toEqual(before)
      }
    }
  })

  it("text that is no call stays content: an unknown function, a '<' in prose, the marker's start at the end", () => {
    const unknown = "<tool_call>nope<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>"
    expect(parseToolCalls(unknown, syntax, tools)).toEqual({ content: unknown, calls: [] })
    expect(streamed("1 < 2 and <b>bold</b>", 3)).toMatchObject({ content: "1 < 2 and <b>bold</b>", calls: [] })
    expect(streamed("Use the <tool", 2)).toMatchObject({ content: "Use the <tool", calls: [] })
  })

  it("found from the GGUF's own template; it renders the tools, the history's calls and results as the model writes them", () => {
    const template = syntheticTemplateSpec("glm").template
    const wrapper = ownArguments(lib, new lib.JinjaTemplateChatWrapper({ template }))
    expect(wrapperToolSyntax(lib, wrapper)).toEqual({ _tag: "Glm", parallel: true, between: "", thinkOpen: false })
    const chatml = new lib.JinjaTemplateChatWrapper({ template: syntheticTemplateSpec("chatml-tools").template })
    expect(wrapperToolSyntax(lib, chatml)._tag).toBe("Family")
    const state = wrapper.generateContextState({
      chatHistory: [
        { type: "user", text: "Weather in Paris?" },
        {
          type: "model",
          response: [
            {
              type: "functionCall",
              name: "get_weather",
              params: { city: "Paris", days: 3 },
              result: { temp: 21 },
              startsNewChunk: true
            }
          ]
        },
        { type: "model", response: [] }
      ],
      availableFunctions: { get_weather: { params: tools[0]!.parameters as never } },
      documentFunctionParams: true
    })
    const text = state.contextText.toString()
    expect(text).toContain('<tools>\n{"type": "function", "function": {"name": "get_weather"')
    expect(text).toContain(
      "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>" +
        "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
    )
    expect(text).toContain('<|observation|><tool_response>{"temp": 21}</tool_response>')
  })

  it("a forced call's grammar writes the format: strings as text, the rest by their schema; an open <think> closed first", () => {
    const asked: Array<unknown> = []
    const grammar = toolGrammar(syntax, { tools, choice: "required" }, (schema) => {
      asked.push(schema)
      return 'root ::= "0"'
    })!
    expect(grammar).toContain("root ::= call (call)*")
    expect(grammar).toContain(
      'call0 ::= "<tool_call>get_weather" "<arg_key>city</arg_key><arg_value>" text "</arg_value>"'
    )
    expect(grammar).toContain('("<arg_key>days</arg_key><arg_value>" t0-p1-root "</arg_value>")?')
    // the JSON arguments (days, alerts, where, hours) through the converter; the strings not
    expect(asked).toHaveLength(4)
    const glm46 = toolGrammar(
      { ...syntax, between: "\n", thinkOpen: true },
      { tools, choice: { name: "get_time" }, parallel: false },
      () => 'root ::= "0"'
    )!
    expect(glm46).toContain('root ::= "</think>" call\n')
    expect(glm46).toContain(
      '"<tool_call>get_time\\n" ("<arg_key>zone</arg_key>\\n<arg_value>" text "</arg_value>\\n")?'
    )
    expect(toolGrammar(syntax, { tools, choice: "auto" }, () => "")).toBeUndefined()
  })

  it("on the Messages API: the reasoning a thinking block before the text and the tool_use blocks, whole and streamed", () => {
    const whole = wholeReply(reply, { syntax, tools }, "GLM", false)
    expect(whole.reasoning).toBe(thought)
    expect(whole.content).toBe("Let me look that up.")
    expect(callsOf(whole.calls).map((c) => c.name)).toEqual(["get_weather", "get_time"])
    for (const size of [1, 4, 1000]) {
      const blocks = contentBlocks(false)
      const stream = replyStream({ syntax, tools }, "GLM")
      const bytes: Array<Uint8Array> = []
      for (let i = 0; i < reply.length; i += size) bytes.push(...blocks.push(stream.push(reply.slice(i, i + size))))
      bytes.push(...blocks.push(stream.end(false)), ...blocks.end())
      const events = bytes.map(
        (b) => JSON.parse(new TextDecoder().decode(b).split("data: ")[1]!) as Record<string, any>
      )
      const starts = events.filter((e) => e["type"] === "content_block_start")
      expect(starts.map((e) => [e["index"], e["content_block"].type])).toEqual([
        [0, "thinking"],
        [1, "text"],
        [2, "tool_use"],
        [3, "tool_use"]
      ])
      const deltas = (kind: string) =>
        events
          .filter((e) => e["type"] === "content_block_delta" && e["delta"].type === kind)
          .map((e) => e["delta"].thinking ?? e["delta"].text ?? e["delta"].partial_json)
      expect(deltas("thinking_delta").join("")).toBe(whole.reasoning)
      expect(deltas("text_delta").join("")).toBe("Let me look that up.")
      expect(deltas("input_json_delta").map((j: string) => JSON.parse(j))).toEqual([weatherArgs, { zone: "CET" }])
    }
  })
})
