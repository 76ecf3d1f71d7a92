/**
 * A list of tool calls cut by max_tokens, through a real `swactor serve` on stories260K (its template knows no tools:
 * llama-server's generic JSON form, `{"tool_calls": [...]}` under a grammar that admits any number of calls). With the
 * request an AI SDK agent sends (`tool_choice: "required"`, parallel calls allowed, the tool's JSON schema with
 * `additionalProperties: false`, greedy) the model writes calls until max_tokens. The answer holds the calls completed
 * before the cut as `tool_calls`, leaves the cut trailing call out, and says `finish_reason: "length"`: whole and
 * streamed, with n = 2, through the openai client and the AI SDK; on /v1/messages as `tool_use` blocks with
 * `stop_reason: "max_tokens"` (the @anthropic-ai/sdk client, whole and streamed).
 */
import Anthropic from "@anthropic-ai/sdk"
import { createOpenAICompatible } from "@ai-sdk/openai-compatible"
import { generateText, jsonSchema, streamText } from "ai"
import OpenAI from "openai"
import { afterAll, beforeAll, describe, expect, it } from "vitest"
import { requireModel } from "../support/models.js"
import { type ServeProcess, startServe, stopServe } from "../support/serve.js"

const model = requireModel("stories260K.gguf")

// The tool as the AI SDK sends a `jsonSchema(...)` tool: its JSON schema as given.
const parameters = {
  type: "object",
  properties: { location: { type: "string", description: "The city" } },
  required: ["location"],
  additionalProperties: false,
  $schema: "http://json-schema.org/draft-07/schema#"
}
const description = "Get the weather in a location"
const weather = { type: "function" as const, function: { name: "weather", description, parameters } }
const prompt = "What is the weather in Paris?"
const maxTokens = 300
const request = {
  model: "m",
  messages: [{ role: "user" as const, content: prompt }],
  tools: [weather],
  tool_choice: "required" as const,
  max_tokens: maxTokens,
  temperature: 0
}

/** A call's arguments: they parse, and follow the schema (one string `location`, nothing else). */
const argumentsOf = (text: string) => {
  const args = JSON.parse(text) as Record<string, unknown>
  expect(Object.keys(args), text).toEqual(["location"])
  expect(typeof args["location"], text).toBe("string")
  return args
}

type Call = { readonly name: string; readonly arguments: Record<string, unknown> }

/** A streamed choice: its content, its calls (each delta.tool_calls entry with an id starts one), its finish. */
const collect = async (stream: AsyncIterable<OpenAI.Chat.Completions.ChatCompletionChunk>) => {
  const choices = new Map<
    number,
    { content: string; calls: Array<{ name: string; arguments: string }>; finish: string | null }
  >()
  for await (const chunk of stream) {
    for (const choice of chunk.choices) {
      const c = choices.get(choice.index) ?? { content: "", calls: [], finish: null }
      choices.set(choice.index, c)
      c.content += choice.delta.content ?? ""
      c.finish = choice.finish_reason ?? c.finish
      for (const delta of choice.delta.tool_calls ?? []) {
        if (delta.id !== undefined) {
          expect(delta.index).toBe(c.calls.length)
          c.calls.push({ name: delta.function?.name ?? "", arguments: delta.function?.arguments ?? "" })
        } else c.calls[delta.index]!.arguments += delta.function?.arguments ?? ""
      }
    }
  }
  return choices
}

describe("swactor serve: tool calls cut by max_tokens (stories260K)", () => {
  let server: ServeProcess
  let client: OpenAI
  /** The calls of the whole (non-streamed) answer, greedy: what every other form of the request must give. */
  let whole: Promise<ReadonlyArray<Call>> | undefined
  const wholeCalls = () =>
    (whole ??= client.chat.completions.create(request).then((answer) =>
      (answer.choices[0]!.message.tool_calls ?? []).map((c) => {
        const fn = (c as OpenAI.Chat.Completions.ChatCompletionMessageFunctionToolCall).function
        return { name: fn.name, arguments: argumentsOf(fn.arguments) }
      })
    ))
  beforeAll(async () => {
    server = await startServe(["--model", model, "--stages", "1", "--threads", "1", "--parallel", "2"])
    client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: "none", maxRetries: 0, timeout: 120_000 })
  }, 180_000)
  afterAll(() => stopServe(server))

  it("a forced list cut by max_tokens: the completed calls as tool_calls, finish_reason length (openai client, AI SDK)", async () => {
    const answer = await client.chat.completions.create(request)
    const choice = answer.choices[0]!
    // the premise: the model was still writing calls when max_tokens cut it
    expect(answer.usage?.completion_tokens).toBe(maxTokens)
    expect(choice.finish_reason).toBe("length")
    // no raw call text as content
    expect(choice.message.content ?? "").toBe("")
    const toolCalls = choice.message.tool_calls ?? []
    expect(toolCalls.length).toBeGreaterThan(1)
    const calls = toolCalls.map((c) => {
      expect(c.type).toBe("function")
      expect(c.id).toMatch(/^call_[0-9a-f]{24}$/)
      const fn = (c as OpenAI.Chat.Completions.ChatCompletionMessageFunctionToolCall).function
      return { name: fn.name, arguments: argumentsOf(fn.arguments) }
    })
    for (const call of calls) expect(call.name).toBe("weather")

    // The AI SDK sees the same calls, and why the reply ended.
    const provider = createOpenAICompatible({ name: "swactor", baseURL: `${server.url}/v1` })
    const tools = { weather: { description, inputSchema: jsonSchema<{ location: string }>(parameters as never) } }
    const settings = {
      model: provider("m"),
      prompt,
      tools,
      toolChoice: "required" as const,
      maxOutputTokens: maxTokens,
      temperature: 0,
      maxRetries: 0
    }
    const generated = await generateText(settings)
    expect(generated.finishReason).toBe("length")
    expect(generated.text).toBe("")
    expect(generated.toolCalls.map((c) => ({ name: c.toolName, arguments: c.input }))).toEqual(calls)
    const streamed = streamText(settings)
    expect(await streamed.finishReason).toBe("length")
    expect(await streamed.text).toBe("")
    expect((await streamed.toolCalls).map((c) => ({ name: c.toolName, arguments: c.input }))).toEqual(calls)
  }, 240_000)

  it("streamed (openai client): the completed calls as delta.tool_calls, none as content, finish_reason length", async () => {
    const calls = await wholeCalls()
    expect(calls.length).toBeGreaterThan(1)
    const choices = await collect(await client.chat.completions.create({ ...request, stream: true }))
    expect([...choices.keys()]).toEqual([0])
    const choice = choices.get(0)!
    expect(choice.finish).toBe("length")
    expect(choice.content).toBe("")
    expect(choice.calls.map((c) => ({ name: c.name, arguments: argumentsOf(c.arguments) }))).toEqual(calls)
    // The client's own streaming helper assembles the same calls.
    const assembled = await client.chat.completions.stream(request).finalChatCompletion()
    expect(assembled.choices[0]!.finish_reason).toBe("length")
    expect(assembled.choices[0]!.message.content ?? "").toBe("")
    expect(
      (assembled.choices[0]!.message.tool_calls ?? []).map((c) => {
        const fn = (c as OpenAI.Chat.Completions.ChatCompletionMessageFunctionToolCall).function
        return { name: fn.name, arguments: argumentsOf(fn.arguments) }
      })
    ).toEqual(calls)
  }, 240_000)

  it("n = 2, whole and streamed: each choice has the completed calls, finish_reason length", async () => {
    const calls = await wholeCalls()
    expect(calls.length).toBeGreaterThan(1)
    const answer = await client.chat.completions.create({ ...request, n: 2 })
    expect(answer.choices.map((c) => c.index)).toEqual([0, 1])
    for (const choice of answer.choices) {
      expect(choice.finish_reason).toBe("length")
      expect(choice.message.content ?? "").toBe("")
      expect(
        (choice.message.tool_calls ?? []).map((c) => {
          const fn = (c as OpenAI.Chat.Completions.ChatCompletionMessageFunctionToolCall).function
          return { name: fn.name, arguments: argumentsOf(fn.arguments) }
        })
      ).toEqual(calls)
    }
    const choices = await collect(await client.chat.completions.create({ ...request, n: 2, stream: true }))
    expect([...choices.keys()].sort()).toEqual([0, 1])
    for (const choice of choices.values()) {
      expect(choice.finish).toBe("length")
      expect(choice.content).toBe("")
      expect(choice.calls.map((c) => ({ name: c.name, arguments: argumentsOf(c.arguments) }))).toEqual(calls)
    }
  }, 240_000)

  it("/v1/messages (@anthropic-ai/sdk): tool_use blocks of the completed calls, stop_reason max_tokens, whole and streamed", async () => {
    const anthropic = new Anthropic({ baseURL: server.url, apiKey: "none", maxRetries: 0 })
    const body = {
      model: "m",
      max_tokens: maxTokens,
      temperature: 0,
      messages: [{ role: "user" as const, content: prompt }],
      tools: [{ name: "weather", description, input_schema: parameters as Anthropic.Tool.InputSchema }],
      tool_choice: { type: "any" as const }
    }
    const uses = (message: Anthropic.Message) => {
      expect(message.stop_reason).toBe("max_tokens")
      expect(message.usage.output_tokens).toBe(maxTokens)
      // only tool_use blocks: no text block holding the raw call text
      expect(message.content.map((b) => b.type)).toEqual(message.content.map(() => "tool_use"))
      return message.content.map((b) => {
        const use = b as Anthropic.ToolUseBlock
        expect(use.id).toMatch(/^toolu_[0-9a-f]{24}$/)
        return { name: use.name, arguments: argumentsOf(JSON.stringify(use.input)) }
      })
    }
    const whole = uses(await anthropic.messages.create(body))
    expect(whole.length).toBeGreaterThan(1)
    for (const call of whole) expect(call.name).toBe("weather")
    expect(uses(await anthropic.messages.stream(body).finalMessage())).toEqual(whole)
  }, 240_000)
})
