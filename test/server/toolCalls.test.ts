/**
 * ToolCalls.ts: replies in each chat family's call syntax (as node-llama-cpp's wrappers write calls: Qwen/Hermes,
 * Llama 3.1, Mistral, gpt-oss harmony) parse into calls, also several at once and while streaming (a standalone call
 * streams: its start, then its arguments in fragments); malformed text stays content and never throws; the grammar that forces a call accepts a valid call and refuses a wrong one.
 */
import { afterAll, beforeAll, describe, expect, it } from "vitest"
import * as lib from "node-llama-cpp"
import { wrapperToolSyntax } from "../../src/layers/gguf/TokenizerLive.js"
import { Effect } from "effect"
import { jsonSchemaGrammar } from "../../src/layers/server/JsonGrammar.js"
import { chatWithTools } from "../../src/layers/server/OpenAiTools.js"
import {
  genericToolMessages,
  parseToolCalls,
  toolCallStream,
  toolGrammar,
  toolGrammarEffect
} from "../../src/layers/server/ToolCalls.js"
import type { ChatTool, ChatToolCall, ToolSyntax } from "../../src/services/Tools.js"

const tools: ReadonlyArray<ChatTool> = [
  {
    name: "get_weather",
    description: "The weather in a city",
    parameters: {
      type: "object",
      properties: { city: { type: "string" }, unit: { enum: ["c", "f"] } },
      required: ["city", "unit"]
    }
  },
  { name: "get_time", parameters: { type: "object", properties: { zone: { type: "string" } } } }
]

type Wrapper = NonNullable<ReturnType<typeof lib.resolveChatWrapper>>

/** A LlamaText as the text of a reply (special tokens' text as it is; built-in special tokens such as EOS never show). */
const text = (value: unknown) =>
  lib
    .LlamaText(value as never)
    .values.map((v) => (typeof v === "string" ? v : v instanceof lib.SpecialTokensText ? v.value : ""))
    .join("")

/**
 * Calls as the wrapper writes them (several: in its parallel section, which ends where the reply ends: Qwen's section
 * suffix is <|im_end|>, an end-of-generation token that never reaches the text).
 */
const written = (wrapper: Wrapper, calls: ReadonlyArray<readonly [string, unknown]>) => {
  const one = calls.map(([name, params]) => wrapper.generateFunctionCall(name, params))
  const section = wrapper.settings.functions.parallelism?.call
  if (calls.length === 1 && (section === undefined || text(section.sectionPrefix).trim() === "")) return text(one[0]!)
  return text(
    lib.LlamaText([
      section!.sectionPrefix,
      ...one.flatMap((call, i) => (i === 0 ? [call] : [section!.betweenCalls ?? "", call])),
      wrapperToolSyntax(lib, wrapper)._tag === "Family"
        ? (wrapperToolSyntax(lib, wrapper) as { sectionSuffix: string }).sectionSuffix
        : ""
    ])
  )
}

const families: ReadonlyArray<readonly [string, () => Wrapper]> = [
  ["Qwen (Hermes <tool_call>)", () => new lib.QwenChatWrapper()],
  ["Llama 3.1", () => new lib.Llama3_1ChatWrapper()],
  ["Mistral", () => new lib.MistralChatWrapper()],
  ["gpt-oss harmony", () => new lib.HarmonyChatWrapper()]
]

const shape = (calls: ReadonlyArray<{ readonly name: string; readonly arguments: string }>) =>
  calls.map((c) => ({ name: c.name, arguments: JSON.parse(c.arguments) as unknown }))

/**
 * The reply streamed in pieces of `size` characters (`cut`: ended by max_tokens): what came out, content and calls;
 * `callPieces`: the calls of each piece (the end's last).
 */
const streamed = (reply: string, syntax: ToolSyntax, size: number, cut = false) => {
  const stream = toolCallStream(syntax, tools)
  let content = ""
  const calls: Array<{ name: string; arguments: string }> = []
  const pieces: Array<string> = []
  const callPieces: Array<ReadonlyArray<ChatToolCall>> = []
  for (let i = 0; i < reply.length; i += size) {
    const out = stream.push(reply.slice(i, i + size))
    pieces.push(out.content)
    callPieces.push(out.calls)
    content += out.content
    calls.push(...out.calls)
  }
  const end = stream.end(cut)
  content += end.content
  calls.push(...end.calls)
  callPieces.push(end.calls)
  return { content, calls, pieces, callPieces }
}

describe("parsing each family's call syntax", () => {
  for (const [family, make] of families) {
    describe(family, () => {
      const wrapper = make()
      const syntax = wrapperToolSyntax(lib, wrapper)

      it("is the family's own syntax", () => {
        expect(syntax._tag).toBe("Family")
      })

      it("one call after some text: the text is content, the call has its name and arguments", () => {
        const reply = `Let me look that up.\n${written(wrapper, [["get_weather", { city: "Paris", unit: "c" }]])}`
        const parsed = parseToolCalls(reply, syntax, tools)
        expect(shape(parsed.calls)).toEqual([{ name: "get_weather", arguments: { city: "Paris", unit: "c" } }])
        // (node-llama-cpp's harmony call starts with its own channel header, which stays content.)
        expect(parsed.content.startsWith("Let me look that up.")).toBe(true)
        expect(parsed.content).toBe(
          family.includes("harmony")
            ? "Let me look that up.\n<|start|>assistant<|channel|>commentary"
            : "Let me look that up."
        )
        expect(parsed.calls[0]!.id).toMatch(/^call_[0-9a-f]{24}$/)
      })

      it("streamed in small pieces: the same call, and no piece of it shown as content", () => {
        const reply = `Sure. ${written(wrapper, [["get_time", { zone: "UTC" }]])}`
        for (const size of [1, 3, 7]) {
          const out = streamed(reply, syntax, size)
          expect(shape(out.calls)).toEqual([{ name: "get_time", arguments: { zone: "UTC" } }])
          expect(out.content.trim()).toBe(
            family.includes("harmony") ? "Sure. <|start|>assistant<|channel|>commentary" : "Sure."
          )
        }
      })

      it("a call naming no tool, arguments that are no JSON, or a call cut short stay content", () => {
        const good = written(wrapper, [["get_weather", { city: "Oslo", unit: "f" }]])
        const unknown = good.replace("get_weather", "rm_rf")
        expect(parseToolCalls(unknown, syntax, tools)).toMatchObject({ calls: [], content: unknown })
        const broken = good.replace('"Oslo"', "Oslo")
        expect(parseToolCalls(broken, syntax, tools)).toMatchObject({ calls: [], content: broken })
        const cut = good.slice(0, good.indexOf("Oslo"))
        expect(parseToolCalls(cut, syntax, tools)).toMatchObject({ calls: [], content: cut })
        // Streamed the same: nothing of a call goes out before it is complete.
        expect(streamed(cut, syntax, 2)).toMatchObject({ calls: [], content: cut })
      })

      it("cut by max_tokens anywhere: no half call, neither as a call nor as content; whole and streamed alike", () => {
        const reply = `Sure. ${written(wrapper, [["get_weather", { city: "Paris", unit: "c" }]])}`
        const whole = parseToolCalls(reply, syntax, tools)
        const args = whole.calls[0]!.arguments
        const callAt = reply.indexOf(written(wrapper, [["get_weather", { city: "Paris", unit: "c" }]]))
        for (let end = callAt + 1; end <= reply.length; end++) {
          const part = reply.slice(0, end)
          const cut = parseToolCalls(part, syntax, tools, true, true)
          // no text of the call as content (harmony's channel header before the call is content, as in the whole reply)
          expect(whole.content.startsWith(cut.content.trim()), part).toBe(true)
          // before its arguments are whole, no call; after (only closing markup cut), the call
          expect(shape(cut.calls), part).toEqual(part.includes(args) ? shape(whole.calls) : [])
          // (the same cut without max_tokens, a reply that ended there, keeps an unfinished call's text as content)
          if (!part.includes(args)) expect(parseToolCalls(part, syntax, tools).content).toBe(part)
          for (const size of [1, 5]) {
            const pieces = streamed(part, syntax, size, true)
            expect(shape(pieces.calls), part).toEqual(shape(cut.calls))
            expect(pieces.content.trim(), part).toBe(cut.content.trim())
          }
        }
      })

      it("never throws on any prefix of a reply, streamed or whole", () => {
        const reply = `a <b> {"x": 1} ${written(wrapper, [["get_weather", { city: 'Rome \\"}', unit: "c" }]])} tail`
        for (let end = 0; end <= reply.length; end++) {
          const part = reply.slice(0, end)
          const whole = parseToolCalls(part, syntax, tools)
          const pieces = streamed(part, syntax, 2)
          expect(shape(pieces.calls)).toEqual(shape(whole.calls))
        }
        expect(shape(parseToolCalls(reply, syntax, tools).calls)).toEqual([
          { name: "get_weather", arguments: { city: 'Rome \\"}', unit: "c" } }
        ])
      })
    })
  }

  it("a harmony reply as gpt-oss writes it (channel, then the recipient, a space before <|constrain|>)", () => {
    const syntax = wrapperToolSyntax(lib, new lib.HarmonyChatWrapper())
    const reply = '<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"zone":"CET"}'
    expect(shape(parseToolCalls(reply, syntax, tools).calls)).toEqual([
      { name: "get_time", arguments: { zone: "CET" } }
    ])
  })

  // A call goes out whole once complete, never in pieces: a reply cut by max_tokens must not have shown part of a call.
  for (const [family, make] of families) {
    it(`${family}: streamed, a call comes whole once complete, equal to the whole reply's`, () => {
      const wrapper = make()
      const syntax = wrapperToolSyntax(lib, wrapper)
      const call = written(wrapper, [["get_weather", { city: "Paris", unit: "c" }]])
      const reply = `Sure. ${call}`
      const whole = parseToolCalls(reply, syntax, tools)
      for (const size of [1, 3, 7]) {
        const out = streamed(reply, syntax, size)
        expect(out.calls.map((c) => ({ name: c.name, arguments: c.arguments }))).toEqual(
          whole.calls.map((c) => ({ name: c.name, arguments: c.arguments }))
        )
        // in one piece, and not before its arguments came whole
        const at = out.callPieces.findIndex((calls) => calls.length > 0)
        expect(out.callPieces.filter((calls) => calls.length > 0)).toHaveLength(1)
        const upTo = Math.min(reply.length, (at + 1) * size)
        expect(reply.slice(0, upTo)).toContain(whole.calls[0]!.arguments)
        expect(out.content.trim()).toBe(whole.content)
      }
    })
  }

  it("parallel_tool_calls false: the first call only, whole or streamed", () => {
    const wrapper = new lib.QwenChatWrapper()
    const syntax = wrapperToolSyntax(lib, wrapper)
    const reply = written(wrapper, [
      ["get_weather", { city: "Lima", unit: "c" }],
      ["get_time", { zone: "PET" }]
    ])
    const first = [{ name: "get_weather", arguments: { city: "Lima", unit: "c" } }]
    expect(shape(parseToolCalls(reply, syntax, tools).calls)).toHaveLength(2)
    expect(parseToolCalls(reply, syntax, tools, false)).toMatchObject({ content: "" })
    expect(shape(parseToolCalls(reply, syntax, tools, false).calls)).toEqual(first)
    const stream = toolCallStream(syntax, tools, false)
    const pieces = [...reply.match(/[\s\S]{1,5}/g)!.map((p) => stream.push(p)), stream.end()]
    expect(shape(pieces.flatMap((p) => p.calls))).toEqual(first)
    expect(pieces.map((p) => p.content).join("")).toBe("")
  })

  for (const [family, make] of families.filter(([name]) => name.startsWith("Qwen") || name.startsWith("Mistral"))) {
    it(`${family}: parallel calls come out in order`, () => {
      const wrapper = make()
      const syntax = wrapperToolSyntax(lib, wrapper)
      expect(syntax).toMatchObject({ parallel: true })
      const reply = written(wrapper, [
        ["get_weather", { city: "Lima", unit: "c" }],
        ["get_time", { zone: "PET" }]
      ])
      const expected = [
        { name: "get_weather", arguments: { city: "Lima", unit: "c" } },
        { name: "get_time", arguments: { zone: "PET" } }
      ]
      const parsed = parseToolCalls(reply, syntax, tools)
      expect(shape(parsed.calls)).toEqual(expected)
      expect(parsed.content).toBe("")
      expect(new Set(parsed.calls.map((c) => c.id)).size).toBe(2)
      expect(shape(streamed(reply, syntax, 4).calls)).toEqual(expected)
    })

    it(`${family}: parallel calls cut by max_tokens: the calls completed, none of the cut one; whole and streamed`, () => {
      const wrapper = make()
      const syntax = wrapperToolSyntax(lib, wrapper)
      const reply = written(wrapper, [
        ["get_weather", { city: "Lima", unit: "c" }],
        ["get_time", { zone: "PET" }],
        ["get_weather", { city: "Cusco", unit: "f" }]
      ])
      const expected = [
        { name: "get_weather", arguments: { city: "Lima", unit: "c" } },
        { name: "get_time", arguments: { zone: "PET" } },
        { name: "get_weather", arguments: { city: "Cusco", unit: "f" } }
      ]
      const argsEnd = ['"c"}', '"PET"}', '"f"}'].map((tail, k) =>
        k === 0 ? reply.indexOf(tail) + tail.length : reply.lastIndexOf(tail) + tail.length
      )
      let seen = 0
      for (let end = 1; end <= reply.length; end++) {
        const part = reply.slice(0, end)
        // the calls whose arguments closed before the cut
        const done = argsEnd.filter((at) => at <= end).length
        const cut = parseToolCalls(part, syntax, tools, true, true)
        expect({ calls: shape(cut.calls), content: cut.content }, part).toEqual({
          calls: expected.slice(0, done),
          content: ""
        })
        const out = streamed(part, syntax, 3, true)
        expect({ calls: shape(out.calls), content: out.content }, part).toEqual({
          calls: expected.slice(0, done),
          content: ""
        })
        seen = Math.max(seen, done)
      }
      expect(seen).toBe(3)
    })
  }
})

describe("the generic JSON reply (templates without tools)", () => {
  const syntax: ToolSyntax = { _tag: "Generic", parallel: true }
  it("tool_call, tool_calls and response", () => {
    expect(
      shape(parseToolCalls('{"tool_call": {"name": "get_time", "arguments": {"zone": "UTC"}}}', syntax, tools).calls)
    ).toEqual([{ name: "get_time", arguments: { zone: "UTC" } }])
    expect(
      shape(
        parseToolCalls(
          ' {"tool_calls": [{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "X", "unit": "f"}}]}',
          syntax,
          tools
        ).calls
      )
    ).toEqual([
      { name: "get_time", arguments: {} },
      { name: "get_weather", arguments: { city: "X", unit: "f" } }
    ])
    expect(parseToolCalls('{"response": "Hello there"}', syntax, tools)).toEqual({ content: "Hello there", calls: [] })
  })
  it("anything else stays content; a stream holds it to the end", () => {
    for (const reply of [
      "plain words",
      '{"tool_call": {"name": "nope", "arguments": {}}}',
      '{"tool_call": ',
      "[1, 2]"
    ]) {
      expect(parseToolCalls(reply, syntax, tools)).toEqual({ content: reply, calls: [] })
      const out = streamed(reply, syntax, 3)
      expect(out.pieces.every((p) => p === "")).toBe(true)
      expect(out.content).toBe(reply)
    }
  })
  it("streamed: the calls come whole at the reply's end, their arguments as written", () => {
    const reply = '{"tool_call": {"name": "get_weather", "arguments": {"city":  "Paris", "unit": "c"}}}'
    const whole = parseToolCalls(reply, syntax, tools)
    // the arguments as the model wrote them (two spaces kept), not re-serialized
    expect(whole.calls.map((c) => c.arguments)).toEqual(['{"city":  "Paris", "unit": "c"}'])
    for (const size of [1, 3, 7]) {
      const out = streamed(reply, syntax, size)
      expect(out.callPieces.slice(0, -1).flat()).toEqual([])
      expect(out.calls.map((c) => ({ name: c.name, arguments: c.arguments }))).toEqual([
        { name: "get_weather", arguments: whole.calls[0]!.arguments }
      ])
      expect(out.content).toBe("")
    }
    const list = '{"tool_calls": [{"name": "get_time", "arguments": {"zone":"UTC"}}]}'
    const out = streamed(list, syntax, 2)
    expect(out.calls.map((c) => c.arguments)).toEqual(['{"zone":"UTC"}'])
  })

  it("cut by max_tokens: a tool_calls list's whole items are the calls, the cut one and the rest dropped; whole and streamed", () => {
    const items = [
      '{"name": "get_weather", "arguments": {"city": "Lima", "unit": "c"}}',
      '{ "name": "get_time", "arguments": { "zone": "PET" } }',
      '{"name": "get_weather", "arguments": {"city": "Cusco", "unit": "f"}}'
    ]
    const expected = [
      { name: "get_weather", arguments: { city: "Lima", unit: "c" } },
      { name: "get_time", arguments: { zone: "PET" } },
      { name: "get_weather", arguments: { city: "Cusco", unit: "f" } }
    ]
    for (const [reply, ends] of [
      [`{ "tool_calls": [ ${items.join(", ")} ] }`, [true, true, true]],
      [`{"tool_call": ${items[1]}}`, [false, true, false]]
    ] as const) {
      const closes = items.map((item, k) => (ends[k] ? reply.indexOf(item) + item.length : -1))
      for (let end = 0; end <= reply.length; end++) {
        const part = reply.slice(0, end)
        const want = expected.filter((_, k) => closes[k]! >= 0 && closes[k]! <= end)
        const cut = parseToolCalls(part, syntax, tools, true, true)
        expect({ calls: shape(cut.calls), content: cut.content }, part).toEqual({ calls: want, content: "" })
        const out = streamed(part, syntax, 4, true)
        expect({ calls: shape(out.calls), content: out.content }, part).toEqual({ calls: want, content: "" })
      }
    }
    // A call naming no tool ends the list; a reply that is no call object is read as it is.
    const unknown = '{"tool_calls": [{"name": "get_time", "arguments": {}}, {"name": "rm_rf", "arguments": {}}, {"na'
    expect(shape(parseToolCalls(unknown, syntax, tools, true, true).calls)).toEqual([
      { name: "get_time", arguments: {} }
    ])
    for (const reply of ['{"response": "Once upon a ti', "plain words"])
      expect(parseToolCalls(reply, syntax, tools, true, true)).toEqual({ content: reply, calls: [] })
  })

  it("a chat with calls and results as plain messages for a template without tools", () => {
    const messages = genericToolMessages(
      [
        { role: "user", content: "time?" },
        {
          role: "assistant",
          content: "",
          toolCalls: [{ id: "call_1", name: "get_time", arguments: '{"zone":"UTC"}' }]
        },
        { role: "tool", content: "12:00", toolCallId: "call_1" }
      ],
      { tools, choice: "auto" }
    )
    expect(messages.map((m) => m.role)).toEqual(["system", "user", "assistant", "user"])
    expect(messages[0]!.content).toContain("get_weather")
    expect(JSON.parse(messages[2]!.content)).toEqual({
      tool_call: { name: "get_time", arguments: { zone: "UTC" }, id: "call_1" }
    })
    expect(JSON.parse(messages[3]!.content)).toEqual({
      tool_response: { name: "get_time", id: "call_1", content: "12:00" }
    })
  })
})

describe("the grammar that forces a call", () => {
  let llama: Awaited<ReturnType<typeof lib.getLlama>>
  beforeAll(async () => {
    llama = await lib.getLlama({ gpu: false, build: "never", logLevel: lib.LlamaLogLevel.error })
  })
  afterAll(() => llama.dispose())
  const jsonGrammar = (schema: unknown) => new lib.LlamaJsonSchemaGrammar(llama, schema as never).grammar
  const accepts = (gbnf: string, reply: string) =>
    (new lib.LlamaGrammar(llama, { grammar: gbnf }) as unknown as { _testText: (t: string) => boolean })._testText(
      reply
    )

  it("Qwen, required: a valid call (two, in parallel) passes; a wrong enum value, an unknown tool or text first do not", () => {
    const wrapper = new lib.QwenChatWrapper()
    const syntax = wrapperToolSyntax(lib, wrapper)
    const gbnf = toolGrammar(syntax, { tools, choice: "required" }, jsonGrammar)!
    const call = (name: string, args: string) =>
      `${syntax._tag === "Family" ? syntax.callPrefix : ""}${name}", "arguments": ${args}}\n</tool_call>`
    expect(accepts(gbnf, call("get_weather", '{"city": "Paris", "unit": "c"}'))).toBe(true)
    expect(
      accepts(gbnf, `${call("get_weather", '{"city": "Paris", "unit": "c"}')}\n${call("get_time", '{"zone": "UTC"}')}`)
    ).toBe(true)
    expect(accepts(gbnf, call("get_weather", '{"city": "Paris", "unit": "k"}'))).toBe(false)
    expect(accepts(gbnf, call("get_date", "{}"))).toBe(false)
    expect(accepts(gbnf, `Hello ${call("get_time", '{"zone": "UTC"}')}`)).toBe(false)
  })

  it("a named function: only that one, once", () => {
    const syntax = wrapperToolSyntax(lib, new lib.QwenChatWrapper())
    const gbnf = toolGrammar(syntax, { tools, choice: { name: "get_time" } }, jsonGrammar)!
    const call = (name: string, args: string) => `<tool_call>\n{"name": "${name}", "arguments": ${args}}\n</tool_call>`
    expect(accepts(gbnf, call("get_time", '{"zone": "UTC"}'))).toBe(true)
    expect(accepts(gbnf, call("get_weather", '{"city": "Paris", "unit": "c"}'))).toBe(false)
  })

  it("Mistral: calls inside its [TOOL_CALLS] section; auto with a family syntax is left free", () => {
    const syntax = wrapperToolSyntax(lib, new lib.MistralChatWrapper())
    const gbnf = toolGrammar(syntax, { tools, choice: "required" }, jsonGrammar)!
    expect(accepts(gbnf, '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]')).toBe(true)
    expect(accepts(gbnf, '{"name": "get_time", "arguments": {"zone": "UTC"}}')).toBe(false)
    expect(toolGrammar(syntax, { tools, choice: "auto" }, jsonGrammar)).toBeUndefined()
    expect(toolGrammar(syntax, { tools, choice: "none" }, jsonGrammar)).toBeUndefined()
  })

  it("through JsonGrammar.ts: a parameter schema it cannot enforce fails naming the field; auto converts nothing", async () => {
    const syntax = wrapperToolSyntax(lib, new lib.QwenChatWrapper())
    const strict = [
      tools[0]!,
      {
        name: "get_time",
        parameters: { type: "object", properties: { zone: { type: "string", pattern: "^[A-Z]+$" } } }
      }
    ]
    const convert = (schema: unknown, path: string) => Effect.map(jsonSchemaGrammar(schema, path), (g) => g.text)
    const refused = await Effect.runPromise(
      Effect.flip(toolGrammarEffect(syntax, { tools: strict, choice: "required" }, convert))
    )
    expect(refused.message).toMatch(/^tools\[1\]\.function\.parameters\.properties\.zone/)
    expect(
      await Effect.runPromise(toolGrammarEffect(syntax, { tools: strict, choice: "auto" }, convert))
    ).toBeUndefined()
    const named = await Effect.runPromise(
      toolGrammarEffect(syntax, { tools: strict, choice: { name: "get_weather" } }, convert)
    )
    expect(
      accepts(named!, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>')
    ).toBe(true)
  })

  it("generic: required is a call object; auto also allows a response", () => {
    const syntax: ToolSyntax = { _tag: "Generic", parallel: true }
    const required = toolGrammar(syntax, { tools, choice: "required" }, jsonGrammar)!
    expect(accepts(required, '{"tool_calls": [{"name": "get_time", "arguments": {"zone": "UTC"}}]}')).toBe(true)
    expect(accepts(required, '{"response": "hi"}')).toBe(false)
    const auto = toolGrammar(syntax, { tools, choice: "auto" }, jsonGrammar)!
    expect(accepts(auto, '{"response": "hi"}')).toBe(true)
    expect(accepts(auto, '{"tool_call": {"name": "get_time", "arguments": {"zone": "UTC"}}}')).toBe(true)
    expect(accepts(auto, "hi")).toBe(false)
  })
})

describe("OpenAI's tool fields (OpenAiTools.chatWithTools)", () => {
  const weather = {
    type: "function",
    function: { name: "get_weather", parameters: { type: "object", properties: {} } }
  }
  const user = { role: "user" as const, content: "hi" }
  it("each tool_choice string is a choice, not a problem; no tools and no tool messages: no tool options", () => {
    for (const choice of ["auto", "none", "required"] as const) {
      const checked = chatWithTools({ messages: [user], tools: [weather], tool_choice: choice })
      expect(typeof checked === "string" ? checked : checked.tools?.choice).toBe(choice)
    }
    expect(chatWithTools({ messages: [user] })).toEqual({
      messages: [{ role: "user", content: "hi" }],
      tools: undefined
    })
    const named = chatWithTools({
      messages: [user],
      tools: [weather],
      tool_choice: { type: "function", function: { name: "get_weather" } },
      parallel_tool_calls: false
    })
    expect(typeof named === "string" ? named : named.tools).toMatchObject({
      choice: { name: "get_weather" },
      parallel: false
    })
  })
  it('a history with calls and results becomes ChatMessages (content null → "")', () => {
    const checked = chatWithTools({
      tools: [weather],
      messages: [
        user,
        {
          role: "assistant",
          content: null,
          tool_calls: [{ id: "c1", type: "function", function: { name: "get_weather", arguments: "{}" } }]
        },
        { role: "tool", tool_call_id: "c1", content: [{ type: "text", text: "sunny" }] }
      ]
    })
    expect(typeof checked === "string" ? checked : checked.messages).toEqual([
      { role: "user", content: "hi" },
      { role: "assistant", content: "", toolCalls: [{ id: "c1", name: "get_weather", arguments: "{}" }] },
      { role: "tool", content: "sunny", toolCallId: "c1" }
    ])
  })
  it("each problem is one line naming the field", () => {
    const problem = (body: Parameters<typeof chatWithTools>[0]) => chatWithTools(body)
    expect(problem({ messages: [user], tools: [weather, { type: "function", function: {} }] })).toBe(
      "tools[1].function.name is required"
    )
    expect(problem({ messages: [user], tools: [weather, weather] })).toBe(
      'tools[1].function.name: "get_weather" is already the name of tools[0]'
    )
    expect(problem({ messages: [user], tools: [{ type: "retrieval" }] })).toBe('tools[0].type must be "function"')
    expect(problem({ messages: [user], tools: [weather], tool_choice: "sometimes" })).toMatch(/^tool_choice must be/)
    expect(
      problem({ messages: [user], tools: [weather], tool_choice: { type: "function", function: { name: "x" } } })
    ).toBe('tool_choice.function.name: no tool named "x" in tools')
    expect(problem({ messages: [user, { role: "tool", tool_call_id: "c9", content: "1" }] })).toBe(
      'messages[1].tool_call_id: "c9" matches no tool call of an earlier assistant message'
    )
    expect(problem({ messages: [user, { role: "tool", content: "1" }] })).toBe("messages[1].tool_call_id is required")
    expect(problem({ messages: [{ role: "user", content: null }] })).toBe("messages[0].content is required")
  })
})
