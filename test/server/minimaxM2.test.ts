/**
 * MiniMax-M2's replies (MiniMaxM2.ts, Reasoning.ts): `<think>…</think>` is the reasoning, `<minimax:tool_call>` holds
 * calls as `<invoke name>` with one `<parameter name>` per argument, typed by the tool's JSON schema (strings as
 * written, the rest JSON), as llama.cpp's parser reads them. On fixed model outputs: several calls, typed parameters,
 * reasoning before a call, a call cut off at the end (not passed off as content), streamed in pieces of any size (the
 * whole reply's split). The format is found from the GGUF's template text (its own MiniMax-M2 template: the synthetic
 * `minimax-m2`), which renders the tools and the history's calls as the model writes them, and forces a call with a
 * grammar in the format.
 */
import * as lib from "node-llama-cpp"
import { describe, expect, it } from "vitest"
import { ownArguments, wrapperToolSyntax } from "../../src/layers/gguf/TokenizerLive.js"
import { contentBlocks, replyStream, wholeReply } from "../../src/layers/server/AnthropicMessages.js"
import { syntheticTemplateSpec } from "../../src/layers/gguf/SyntheticTemplates.js"
import { splitThink, thinkStream } from "../../src/layers/server/MiniMaxM2.js"
import { reasoningFormatOf, splitReasoning } from "../../src/layers/server/Reasoning.js"
import { parseToolCalls, toolCallStream, toolGrammar } from "../../src/layers/server/ToolCalls.js"
import type { ChatTool, ToolSyntax } from "../../src/services/Tools.js"

const syntax: ToolSyntax = { _tag: "MiniMaxM2", parallel: true }

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
  { name: "get_time", parameters: { type: "object", properties: { zone: { type: "string" } } } }
]

const reasoning = "<think>\nThe user wants the weather and the time.\nI will call both.\n</think>\n\n"
const twoCalls =
  "Let me look that up.\n<minimax:tool_call>\n" +
  '<invoke name="get_weather">\n<parameter name="city">Paris\nFrance</parameter>\n<parameter name="days">3</parameter>\n' +
  '<parameter name="alerts">true</parameter>\n<parameter name="zip">75001</parameter>\n' +
  '<parameter name="unit">celsius</parameter>\n<parameter name="where">{"lat": 48.85, "lon": 2.35}</parameter>\n' +
  '<parameter name="hours">[1, 2.5]</parameter>\n</invoke>\n' +
  '<invoke name="get_time">\n<parameter name="zone">CET</parameter>\n</invoke>\n</minimax:tool_call>'
const reply = reasoning + twoCalls

const weatherArgs = {
  city: "Paris\nFrance",
  days: 3,
  alerts: true,
  zip: "75001",
  unit: "celsius",
  where: { lat: 48.85, lon: 2.35 },
  hours: [1, 2.5]
}

const callsOf = (calls: ReadonlyArray<{ readonly name: string; readonly arguments: string }>) =>
  calls.map((c) => ({ name: c.name, arguments: JSON.parse(c.arguments) as unknown }))

/** The reply through the reasoning splitter and the tools' parser, in pieces of `size` characters. */
const streamed = (text: string, size: number, cut = false) => {
  const think = thinkStream()
  const calls = toolCallStream(syntax, tools)
  let thought = ""
  let content = ""
  const found: Array<{ name: string; arguments: string }> = []
  const take = (piece: { reasoning: string; content: string }, last: boolean) => {
    thought += piece.reasoning
    const parsed = calls.push(piece.content)
    const rest = last ? calls.end(cut) : { content: "", calls: [] }
    content += parsed.content + rest.content
    found.push(...parsed.calls, ...rest.calls)
  }
  for (let i = 0; i < text.length; i += size) take(think.push(text.slice(i, i + size)), false)
  take(think.end(), true)
  return { reasoning: thought, content, calls: callsOf(found) }
}

describe("MiniMax-M2 replies", () => {
  it("reasoning in <think> is the reasoning, without the template's whitespace; the rest the content", () => {
    expect(splitThink(`${reasoning}Hello there.`)).toEqual({
      reasoning: "The user wants the weather and the time.\nI will call both.",
      content: "Hello there."
    })
    // the prompt opened the <think> itself
    expect(splitThink("Short thought.</think>\n\nHi.", true)).toEqual({ reasoning: "Short thought.", content: "Hi." })
    // no <think>: all content; cut inside the reasoning: the reasoning so far
    expect(splitThink("Just an answer.")).toEqual({ reasoning: "", content: "Just an answer." })
    expect(splitThink("<think>\nLet me th")).toEqual({ reasoning: "Let me th", content: "" })
    expect(reasoningFormatOf("MiniMax-M2")).toBe("MiniMax-M2")
    expect(splitReasoning("MiniMax-M2", `${reasoning}Hi.`).content).toBe("Hi.")
  })

  it("several calls, each parameter typed by its tool's schema: strings as written, numbers, booleans, objects as JSON", () => {
    const parsed = parseToolCalls(twoCalls, syntax, tools)
    expect(parsed.content).toBe("Let me look that up.")
    expect(callsOf(parsed.calls)).toEqual([
      { name: "get_weather", arguments: weatherArgs },
      { name: "get_time", arguments: { zone: "CET" } }
    ])
    expect(parsed.calls[0]!.id).toMatch(/^call_[0-9a-f]{24}$/)
    // parallel_tool_calls false: the first call only
    expect(callsOf(parseToolCalls(twoCalls, syntax, tools, false).calls)).toHaveLength(1)
  })

  it("reasoning before a call: the reasoning, the calls, no markup in the content", () => {
    const split = splitThink(reply)
    expect(split.reasoning).toBe("The user wants the weather and the time.\nI will call both.")
    const parsed = parseToolCalls(split.content, syntax, tools)
    expect(parsed.content).toBe("Let me look that up.")
    expect(callsOf(parsed.calls).map((c) => c.name)).toEqual(["get_weather", "get_time"])
  })

  it("streamed in pieces of any size: the whole reply's reasoning, content and calls, no markup in the content", () => {
    for (const size of [1, 2, 3, 7, 16, 1000]) {
      const out = streamed(reply, size)
      expect(out.reasoning).toBe("The user wants the weather and the time.\nI will call both.")
      expect(out.content.trim()).toBe("Let me look that up.")
      expect(out.calls).toEqual([
        { name: "get_weather", arguments: weatherArgs },
        { name: "get_time", arguments: { zone: "CET" } }
      ])
    }
  })

  it("a call cut off at the end (max_tokens) is dropped, not passed off as content; the calls before it count", () => {
    const second = twoCalls.indexOf('<invoke name="get_time">')
    const cuts: ReadonlyArray<readonly [number, ReadonlyArray<string>]> = [
      [twoCalls.indexOf("75001"), []],
      [twoCalls.indexOf('{"lat'), []],
      [second + 5, ["get_weather"]],
      [second + 40, ["get_weather"]],
      // only the closing marker cut: both calls are whole
      [twoCalls.length - 12, ["get_weather", "get_time"]]
    ]
    for (const [end, before] of cuts) {
      const text = twoCalls.slice(0, end)
      const whole = parseToolCalls(text, syntax, tools, true, true)
      expect(whole.content.trim(), text).toBe("Let me look that up.")
      expect(whole.content).not.toContain("<")
      expect(whole.calls.map((c) => c.name)).toEqual(before)
      for (const size of [1, 5]) {
        const out = streamed(reasoning + text, size, true)
        expect(out.content.trim()).toBe("Let me look that up.")
        expect(out.calls.map((c) => c.name)).toEqual(before)
      }
    }
    // the closing </minimax:tool_call> never reaches the text (it ends the turn): the calls still count
    expect(parseToolCalls(twoCalls.slice(0, -"</minimax:tool_call>".length), syntax, tools).calls).toHaveLength(2)
  })

  it("text that is no call stays content: an unknown function, a '<' in prose", () => {
    const unknown =
      '<minimax:tool_call>\n<invoke name="nope">\n<parameter name="a">1</parameter>\n</invoke>\n</minimax:tool_call>'
    expect(parseToolCalls(unknown, syntax, tools)).toEqual({ content: unknown, calls: [] })
    expect(streamed("1 < 2 and <b>bold</b>", 3)).toMatchObject({ content: "1 < 2 and <b>bold</b>", calls: [] })
  })

  it("found from the GGUF's own template; it renders the tools and the history's calls as the model writes them", () => {
    const template = syntheticTemplateSpec("minimax-m2").template
    const wrapper = ownArguments(lib, new lib.JinjaTemplateChatWrapper({ template }))
    expect(wrapperToolSyntax(lib, wrapper)).toEqual({ _tag: "MiniMaxM2", parallel: true })
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
              name: "get_time",
              params: { zone: "CET" },
              result: { time: "12:00" },
              startsNewChunk: true
            }
          ]
        },
        { type: "model", response: [] }
      ],
      availableFunctions: { get_time: { params: tools[1]!.parameters as never } },
      documentFunctionParams: true
    })
    const text = state.contextText.toString()
    expect(text).toContain('<tool>{"name": "get_time"')
    expect(text).toContain(
      '<minimax:tool_call>\n<invoke name="get_time">\n<parameter name="zone">CET</parameter>\n</invoke>\n</minimax:tool_call>'
    )
    expect(text).toContain(`<response>{"time": "12:00"}</response>`)
  })

  it("a forced call's grammar writes the format: strings as text, the rest by their schema", () => {
    const asked: Array<unknown> = []
    const grammar = toolGrammar(syntax, { tools, choice: "required" }, (schema) => {
      asked.push(schema)
      return 'root ::= "0"'
    })!
    expect(grammar).toContain('root ::= "<minimax:tool_call>\\n" call call* "</minimax:tool_call>"')
    expect(grammar).toContain('"<parameter name=\\"city\\">" text "</parameter>\\n"')
    expect(grammar).toContain('("<parameter name=\\"days\\">" t0-p1-root "</parameter>\\n")?')
    // the JSON arguments (days, alerts, where, hours) through the converter; the strings (city, zip, unit, zone) not
    expect(asked).toHaveLength(4)
    expect(toolGrammar(syntax, { tools, choice: "auto" }, () => "")).toBeUndefined()
  })

  it("on the Messages API: the reasoning a thinking block before the text and the tool_use blocks, whole and streamed", () => {
    const whole = wholeReply(reply, { syntax, tools }, "MiniMax-M2", false)
    expect(whole.reasoning).toBe("The user wants the weather and the time.\nI will call both.")
    expect(whole.content).toBe("Let me look that up.")
    expect(callsOf(whole.calls).map((c) => c.name)).toEqual(["get_weather", "get_time"])
    for (const size of [1, 4, 1000]) {
      const blocks = contentBlocks(false)
      const stream = replyStream({ syntax, tools }, "MiniMax-M2")
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
      expect(deltas("text_delta").join("").trim()).toBe("Let me look that up.")
      expect(deltas("input_json_delta").map((j: string) => JSON.parse(j))).toEqual([weatherArgs, { zone: "CET" }])
      // each block stopped before the next starts
      expect(events.filter((e) => e["type"] === "content_block_stop").map((e) => e["index"])).toEqual([0, 1, 2, 3])
    }
  })
})
