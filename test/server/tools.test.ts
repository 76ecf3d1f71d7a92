/**
 * Tool calls through a real `swactor serve` and the official openai client, on two models: stories260K (a template
 * without tools: llama-server's generic JSON form) and a synthetic model written by `swactor synth --chat-template
 * chatml-tools` (its own Jinja template with tools: node-llama-cpp finds the <tool_call> syntax in it). On both, with
 * random-ish weights: `tool_choice: "required"` and a named function give a call whose arguments parse and validate
 * against the tool's schema (the grammar forces them); streamed, the call comes whole in one chunk once complete, the
 * same call (also through the openai client's streaming helper); a forced call cut by max_tokens anywhere before its
 * arguments are whole is no call and no content, finish_reason length (also through the AI SDK); a tool result fed
 * back continues the chat; `none` gives no call; bad tool input is a 400 naming the field, and the server keeps serving.
 */
import * as Command from "@effect/cli/Command"
import * as NodeContext from "@effect/platform-node/NodeContext"
import { Effect, Exit } from "effect"
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import OpenAI from "openai"
import { createOpenAICompatible } from "@ai-sdk/openai-compatible"
import { generateText, jsonSchema, streamText } from "ai"
import { afterAll, beforeAll, describe, expect, it } from "vitest"
import { synthCommand } from "../../src/cli/SynthCommand.js"
import { getString, readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { requireModel } from "../support/models.js"
import { type ServeProcess, startServe, stopServe } from "../support/serve.js"

const dir = mkdtempSync(join(tmpdir(), "swactor-tools-"))
const toolModel = join(dir, "chatml-tools.gguf")

const weather = {
  type: "function" as const,
  function: {
    name: "get_weather",
    description: "The weather in a city",
    parameters: {
      type: "object",
      // (No integer: node-llama-cpp's integer grammar admits exponents, e.g. 1e9999999, which JSON.parse makes Infinity.)
      properties: {
        unit: { type: "string", enum: ["celsius", "fahrenheit"] },
        days: { enum: [1, 2, 3, 7] },
        alerts: { type: "boolean" }
      },
      required: ["unit", "days", "alerts"],
      additionalProperties: false
    }
  }
}
const time = {
  type: "function" as const,
  function: {
    name: "get_time",
    parameters: { type: "object", properties: { utc: { type: "boolean" } }, required: ["utc"] }
  }
}
const tools = [weather, time]

/** The arguments follow the tool's schema (what these two schemas ask). */
const validArguments = (name: string, text: string) => {
  const args = JSON.parse(text) as Record<string, unknown>
  if (name === "get_weather") {
    expect(Object.keys(args).sort(), text).toEqual(["alerts", "days", "unit"])
    expect(["celsius", "fahrenheit"], text).toContain(args["unit"])
    expect([1, 2, 3, 7], text).toContain(args["days"])
    expect(typeof args["alerts"], text).toBe("boolean")
  } else {
    expect(name).toBe("get_time")
    expect(typeof args["utc"], text).toBe("boolean")
  }
  return args
}

const user = [{ role: "user" as const, content: "What is the weather like in Paris?" }]

const synth = Command.run(Command.make("swactor").pipe(Command.withSubcommands([synthCommand])), {
  name: "swactor",
  version: "test"
})

const models: ReadonlyArray<readonly [string, () => string]> = [
  ["stories260K (no tools in its template: generic JSON)", () => requireModel("stories260K.gguf")],
  ["synthetic chatml-tools (its own tool template)", () => toolModel]
]

beforeAll(async () => {
  const exit = await Effect.runPromise(
    synth([
      "node",
      "swactor",
      "synth",
      "--arch",
      "qwen2",
      "--layers",
      "2",
      "--hidden",
      "64",
      "--ffn",
      "128",
      "--heads",
      "2",
      "--vocab",
      "600",
      "--seed",
      "7",
      "--chat-template",
      "chatml-tools",
      "-o",
      toolModel
    ]).pipe(Effect.provide(NodeContext.layer), Effect.exit)
  )
  expect(Exit.isSuccess(exit)).toBe(true)
  const file = await Effect.runPromise(readGgufFile(toolModel))
  expect(await Effect.runPromise(getString(file, "tokenizer.chat_template"))).toContain("<tool_call>")
}, 60_000)
afterAll(() => rmSync(dir, { recursive: true, force: true }))

for (const [name, path] of models) {
  describe(`swactor serve with tools: ${name}`, () => {
    let server: ServeProcess
    let client: OpenAI
    beforeAll(async () => {
      server = await startServe(["--model", path(), "--stages", "1", "--threads", "1"])
      client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: "none", maxRetries: 0 })
    }, 180_000)
    afterAll(() => stopServe(server))

    it("tool_choice required: a call whose arguments validate against its tool's schema, finish_reason tool_calls", async () => {
      // One call per reply: with parallel calls allowed the grammar admits any number of them (as llama-server's does),
      // and a random model may go on adding calls until max_tokens.
      for (const seed of [1, 2, 3]) {
        const answer = await client.chat.completions.create({
          model: "m",
          messages: user,
          tools,
          tool_choice: "required",
          parallel_tool_calls: false,
          temperature: 1,
          seed,
          max_tokens: 400
        })
        const choice = answer.choices[0]!
        expect(choice.finish_reason).toBe("tool_calls")
        const calls = choice.message.tool_calls ?? []
        expect(calls.length).toBeGreaterThan(0)
        for (const call of calls) {
          expect(call.type).toBe("function")
          expect(call.id).toMatch(/^call_/)
          if (call.type === "function") validArguments(call.function.name, call.function.arguments)
        }
      }
    }, 120_000)

    it("a named function: exactly that one", async () => {
      for (const seed of [4, 5]) {
        const answer = await client.chat.completions.create({
          model: "m",
          messages: user,
          tools,
          tool_choice: { type: "function", function: { name: "get_time" } },
          seed,
          max_tokens: 300
        })
        const calls = answer.choices[0]!.message.tool_calls ?? []
        expect(calls.map((c) => (c.type === "function" ? c.function.name : c.type))).toEqual(["get_time"])
        if (calls[0]?.type === "function") validArguments("get_time", calls[0].function.arguments)
      }
    }, 120_000)

    it("streamed: delta.tool_calls (index, id, name and the whole arguments in one chunk) give the same call", async () => {
      // One call (greedy, a random model could repeat parallel calls up to max_tokens).
      const request = {
        model: "m",
        messages: user,
        tools,
        tool_choice: "required" as const,
        parallel_tool_calls: false,
        temperature: 0,
        max_tokens: 400
      }
      const whole = await client.chat.completions.create(request)
      const stream = await client.chat.completions.create({ ...request, stream: true })
      const calls: Array<{ id: string; name: string; arguments: string }> = []
      let finish: string | null = null
      let content = ""
      for await (const chunk of stream) {
        const choice = chunk.choices[0]
        if (choice === undefined) continue
        content += choice.delta.content ?? ""
        finish = choice.finish_reason ?? finish
        // each call whole in one delta: its index, id, name and arguments
        for (const delta of choice.delta.tool_calls ?? []) {
          expect(delta.index).toBe(calls.length)
          expect(delta.id).toMatch(/^call_/)
          calls.push({ id: delta.id!, name: delta.function?.name ?? "", arguments: delta.function?.arguments ?? "" })
        }
      }
      expect(finish).toBe("tool_calls")
      expect(content).toBe("")
      const expected = (whole.choices[0]!.message.tool_calls ?? []).map((c) =>
        c.type === "function"
          ? { name: c.function.name, arguments: JSON.parse(c.function.arguments) as unknown }
          : undefined
      )
      expect(expected.length).toBeGreaterThan(0)
      expect(calls.map((c) => ({ name: c.name, arguments: validArguments(c.name, c.arguments) }))).toEqual(expected)
      // The openai client's own streaming helper assembles the same call, arguments byte for byte, from one delta
      const helper = client.chat.completions.stream(request)
      let fragments = 0
      helper.on("tool_calls.function.arguments.delta", (event) => void (event.arguments_delta === "" ? 0 : fragments++))
      const assembled = await helper.finalChatCompletion()
      const plain = (c: { type: string; function?: { name: string; arguments: string } }) => ({
        name: c.function?.name,
        arguments: c.function?.arguments
      })
      expect(assembled.choices[0]!.finish_reason).toBe("tool_calls")
      expect((assembled.choices[0]!.message.tool_calls ?? []).map(plain)).toEqual(
        (whole.choices[0]!.message.tool_calls ?? []).map(plain)
      )
      expect(fragments).toBe(1)
    }, 120_000)

    it("a forced call cut by max_tokens before it completes: finish_reason length, no call, no half call as content (openai client, AI SDK; whole and streamed)", async () => {
      const provider = createOpenAICompatible({ name: "swactor", baseURL: `${server.url}/v1` })
      const sdkTools = Object.fromEntries(
        tools.map((t) => [
          t.function.name,
          { inputSchema: jsonSchema<Record<string, unknown>>(t.function.parameters as never) }
        ])
      )
      const plain = (calls: ReadonlyArray<OpenAI.Chat.Completions.ChatCompletionMessageToolCall> | undefined) =>
        (calls ?? []).map((c) => {
          const fn = (c as OpenAI.Chat.Completions.ChatCompletionMessageFunctionToolCall).function
          return { name: fn.name, arguments: fn.arguments }
        })
      const choices = [
        ["required", "required"],
        [
          { type: "function", function: { name: "get_time" } },
          { type: "tool", toolName: "get_time" }
        ]
      ] as const
      for (const [tool_choice, toolChoice] of choices) {
        // One call (the grammar admits one), greedy: every shorter max_tokens cuts the same reply somewhere in it.
        const request = { model: "m", messages: user, tools, tool_choice, parallel_tool_calls: false, temperature: 0 }
        const full = await client.chat.completions.create({ ...request, max_tokens: 400 })
        expect(full.choices[0]!.finish_reason).toBe("tool_calls")
        const call = plain(full.choices[0]!.message.tool_calls)
        expect(call).toHaveLength(1)
        const length = full.usage!.completion_tokens
        for (let max = 4; max < length; max += 3) {
          const answer = await client.chat.completions.create({ ...request, max_tokens: max })
          const choice = answer.choices[0]!
          const at = `max_tokens ${max} of ${length}`
          expect(choice.finish_reason, at).toBe("length")
          expect(choice.message.content ?? "", at).toBe("")
          // no call, or (cut in its closing markup, its arguments whole) the call itself
          const calls = plain(choice.message.tool_calls)
          if (max <= 8) expect(calls, at).toEqual([])
          else expect([[], call], at).toContainEqual(calls)
          // Streamed: the same, and no piece of a call that did not complete.
          let content = ""
          let finish: string | null = null
          const streamed: Array<{ name: string; arguments: string }> = []
          for await (const chunk of await client.chat.completions.create({
            ...request,
            max_tokens: max,
            stream: true
          })) {
            for (const c of chunk.choices) {
              content += c.delta.content ?? ""
              finish = c.finish_reason ?? finish
              for (const delta of c.delta.tool_calls ?? []) {
                if (delta.id !== undefined)
                  streamed.push({ name: delta.function?.name ?? "", arguments: delta.function?.arguments ?? "" })
                else streamed[delta.index]!.arguments += delta.function?.arguments ?? ""
              }
            }
          }
          expect({ content, finish, calls: streamed }, at).toEqual({ content: "", finish: "length", calls })
        }
        const assembled = await client.chat.completions.stream({ ...request, max_tokens: 8 }).finalChatCompletion()
        expect(assembled.choices[0]!.message.tool_calls ?? []).toEqual([])
        expect(assembled.choices[0]!.finish_reason).toBe("length")

        const settings = {
          model: provider("m"),
          messages: user,
          tools: sdkTools,
          toolChoice,
          maxOutputTokens: 8,
          temperature: 0,
          maxRetries: 0
        }
        const generated = await generateText(settings)
        expect({ finish: generated.finishReason, text: generated.text, calls: generated.toolCalls }).toEqual({
          finish: "length",
          text: "",
          calls: []
        })
        const streamed = streamText(settings)
        expect({
          finish: await streamed.finishReason,
          text: await streamed.text,
          calls: await streamed.toolCalls
        }).toEqual({ finish: "length", text: "", calls: [] })
      }
    }, 240_000)

    it("a tool result fed back (assistant tool_calls, then the tool message) continues the chat", async () => {
      const first = await client.chat.completions.create({
        model: "m",
        messages: user,
        tools,
        tool_choice: "required",
        parallel_tool_calls: false,
        seed: 9,
        max_tokens: 400
      })
      const call = first.choices[0]!.message.tool_calls![0]!
      for (const tool_choice of ["auto", "required"] as const) {
        const next = await client.chat.completions.create({
          model: "m",
          tools,
          tool_choice,
          parallel_tool_calls: false,
          seed: 10,
          max_tokens: tool_choice === "required" ? 400 : 60,
          messages: [
            ...user,
            { role: "assistant", content: null, tool_calls: [call] },
            { role: "tool", tool_call_id: call.id, content: '{"temperature": 21, "sky": "clear"}' }
          ]
        })
        const choice = next.choices[0]!
        expect(["stop", "length", "tool_calls"]).toContain(choice.finish_reason)
        if (choice.finish_reason === "tool_calls") {
          for (const c of choice.message.tool_calls ?? [])
            if (c.type === "function") validArguments(c.function.name, c.function.arguments)
        } else expect(choice.message.tool_calls ?? []).toEqual([])
        if (tool_choice === "required") expect(choice.finish_reason).toBe("tool_calls")
      }
    }, 120_000)

    it("tool_choice none: no call, plain content", async () => {
      const answer = await client.chat.completions.create({
        model: "m",
        messages: user,
        tools,
        tool_choice: "none",
        max_tokens: 20,
        temperature: 0
      })
      expect(answer.choices[0]!.message.tool_calls ?? []).toEqual([])
      expect(["stop", "length"]).toContain(answer.choices[0]!.finish_reason)
      expect(typeof answer.choices[0]!.message.content).toBe("string")
    }, 60_000)

    it("bad tool input is a 400 naming the field; the server keeps serving", async () => {
      const refused = async (body: Record<string, unknown>) => {
        const response = await fetch(`${server.url}/v1/chat/completions`, {
          method: "POST",
          headers: { "content-type": "application/json" },
          body: JSON.stringify({ messages: user, max_tokens: 4, ...body })
        })
        expect(response.status).toBe(400)
        const json = (await response.json()) as { error: { message: string; type: string } }
        expect(json.error.type).toBe("invalid_request_error")
        return json.error.message
      }
      expect(await refused({ tools: [weather, { type: "function", function: { description: "x" } }] })).toBe(
        "tools[1].function.name is required"
      )
      expect(await refused({ tools: [weather, weather] })).toMatch(
        /^tools\[1\]\.function\.name: "get_weather" is already the name of tools\[0\]/
      )
      expect(await refused({ tools, tool_choice: { type: "function", function: { name: "launch" } } })).toMatch(
        /^tool_choice\.function\.name: no tool named "launch"/
      )
      expect(await refused({ tool_choice: "required" })).toMatch(/^tool_choice "required" needs tools/)
      expect(
        await refused({
          tools,
          messages: [...user, { role: "tool", tool_call_id: "call_nope", content: "1" }]
        })
      ).toMatch(/^messages\[1\]\.tool_call_id: "call_nope" matches no tool call/)
      expect(
        await refused({
          tools,
          messages: [
            ...user,
            {
              role: "assistant",
              content: null,
              tool_calls: [{ id: "c1", type: "function", function: { name: "get_time", arguments: "{utc" } }]
            }
          ]
        })
      ).toBe("messages[1].tool_calls[0].function.arguments is not JSON")
      expect(
        await refused({
          tools: [
            {
              type: "function",
              function: {
                name: "f",
                parameters: { type: "object", properties: { a: { type: "string", pattern: "x+" } } }
              }
            }
          ],
          tool_choice: "required"
        })
      ).toMatch(/^tools\[0\]\.function\.parameters\.properties\.a/)
      // Still serving, with and without tools.
      const after = await client.chat.completions.create({
        model: "m",
        messages: user,
        tools,
        tool_choice: "required",
        parallel_tool_calls: false,
        seed: 11,
        max_tokens: 400
      })
      expect(after.choices[0]!.finish_reason).toBe("tool_calls")
      const health = await fetch(`${server.url}/health`)
      expect(health.status).toBe(200)
    }, 120_000)
  })
}
