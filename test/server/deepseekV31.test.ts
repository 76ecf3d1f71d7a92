/**
 * DeepSeek-V3.2's GGUFs (architecture deepseek32) carry DeepSeek-V3.1's chat template (test/support/deepseek-v3.1.jinja,
 * as llama.cpp's models/templates/deepseek-ai-DeepSeek-V3.1.jinja has it). node-llama-cpp takes it as a Jinja
 * template and its probe finds the call syntax, `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{JSON}`
 * `<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>`, split at odd places (a marker's `｜>` in the next part) that add up to the
 * model's text: the Family ToolSyntax then needs nothing of its own. Checked here on fixed outputs: the template renders
 * the tools and the history's calls and results as the model writes them, and several calls parse whole, streamed in
 * pieces of any size and cut by max_tokens (with the end-of-sentence marker in the probe's section suffix or cut off
 * as the model's end of generation), and a forced call's grammar writes the markers whole.
 */
import * as lib from "node-llama-cpp"
import { readFileSync } from "node:fs"
import { describe, expect, it } from "vitest"
import { wrapperToolSyntax } from "../../src/layers/gguf/TokenizerLive.js"
import { parseToolCalls, toolCallStream, toolGrammar } from "../../src/layers/server/ToolCalls.js"
import type { ChatTool, ToolSyntax } from "../../src/services/Tools.js"

const template = readFileSync(new URL("../support/deepseek-v3.1.jinja", import.meta.url), "utf8")
const wrapper = new lib.JinjaTemplateChatWrapper({ template })

const tools: ReadonlyArray<ChatTool> = [
  { name: "get_time", parameters: { type: "object", properties: { zone: { type: "string" } } } },
  {
    name: "get_weather",
    parameters: { type: "object", properties: { city: { type: "string" }, days: { type: "integer" } } }
  }
]

const calls =
  "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>" +
  '{"zone": "CET"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 3}' +
  "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
const reply = `Let me check.${calls}`
const expected = [
  { name: "get_time", arguments: { zone: "CET" } },
  { name: "get_weather", arguments: { city: "Paris", days: 3 } }
]

const callsOf = (found: ReadonlyArray<{ readonly name: string; readonly arguments: string }>) =>
  found.map((c) => ({ name: c.name, arguments: JSON.parse(c.arguments) as unknown }))

const streamed = (syntax: ToolSyntax, text: string, size: number, cut = false) => {
  const stream = toolCallStream(syntax, tools)
  let content = ""
  const found: Array<{ name: string; arguments: string }> = []
  for (let i = 0; i < text.length; i += size) {
    const piece = stream.push(text.slice(i, i + size))
    content += piece.content
    found.push(...piece.calls)
  }
  const rest = stream.end(cut)
  return { content: content + rest.content, calls: callsOf([...found, ...rest.calls]) }
}

const probed = wrapperToolSyntax(lib, wrapper)
if (probed._tag !== "Family") throw new Error(`DeepSeek-V3.1's template probed as ${probed._tag}`)
// with the model, its end-of-generation token's text is cut from the suffix (TokenizerLive's stops)
const syntaxes: ReadonlyArray<ToolSyntax> = [
  probed,
  { ...probed, sectionSuffix: probed.sectionSuffix.replace("<｜end▁of▁sentence", "") }
]

describe("DeepSeek-V3.1's template (DeepSeek-V3.2's GGUFs) through node-llama-cpp's Jinja wrapper", () => {
  it("the probe's pieces add up to the markers; the template renders the history's calls and results as the model writes them", () => {
    expect(probed.sectionPrefix + probed.callPrefix + "get_time" + probed.paramsPrefix).toBe(
      "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>"
    )
    expect(probed.callSuffix + probed.betweenCalls + probed.callPrefix).toBe("<｜tool▁call▁end｜><｜tool▁call▁begin｜>")
    expect(syntaxes[1]!._tag === "Family" && probed.callSuffix + syntaxes[1]!.sectionSuffix).toBe(
      "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    )
    const state = wrapper.generateContextState({
      chatHistory: [
        { type: "user", text: "Time in Paris?" },
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
      availableFunctions: { get_time: { params: tools[0]!.parameters as never } },
      documentFunctionParams: true
    })
    const text = state.contextText.toString()
    expect(text).toContain(
      '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": "CET"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    expect(text).toContain('<｜tool▁output▁begin｜>{"time": "12:00"}<｜tool▁output▁end｜>')
  })

  it("several calls: whole, streamed in pieces of any size, no markup in the content", () => {
    for (const syntax of syntaxes) {
      const whole = parseToolCalls(reply, syntax, tools)
      expect(whole.content).toBe("Let me check.")
      expect(callsOf(whole.calls)).toEqual(expected)
      for (const size of [1, 2, 5, 1000])
        expect(streamed(syntax, reply, size)).toEqual({ content: "Let me check.", calls: expected })
    }
  })

  it("cut by max_tokens: the calls completed count, one cut short is dropped, never content", () => {
    const second = reply.indexOf("<｜tool▁call▁begin｜>get_weather")
    for (const syntax of syntaxes)
      for (const [end, names] of [
        [reply.indexOf("get_time") + 3, []],
        [second + 4, ["get_time"]],
        [reply.indexOf('"Paris"'), ["get_time"]]
      ] as const) {
        const text = reply.slice(0, end)
        const whole = parseToolCalls(text, syntax, tools, true, true)
        expect(whole.content, text).toBe("Let me check.")
        expect(whole.calls.map((c) => c.name)).toEqual(names)
        expect(streamed(syntax, text, 3, true).calls.map((c) => c.name)).toEqual(names)
      }
  })

  it("a forced call's grammar writes the probe's pieces, which add up to the markers (checked above)", () => {
    const grammar = toolGrammar(syntaxes[1]!, { tools, choice: "required" }, () => 'root ::= "{}"')!
    expect(grammar).toContain('root ::= "<｜tool▁calls▁begin" call (call)* "｜><｜tool▁calls▁end｜>"')
    expect(grammar).toContain(
      'call0 ::= "｜><｜tool▁call▁begin｜>" "get_time" "<｜tool▁sep｜>" t0-root "<｜tool▁call▁end"'
    )
  })
})
