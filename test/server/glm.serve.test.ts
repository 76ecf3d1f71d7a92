/**
 * GLM's chat format (GLM-4.7, GLM-5) through a real `swactor serve`, on a synthetic model whose GGUF carries GLM's own
 * template (`swactor synth --chat-template glm`): the server finds the format from the template text. A forced
 * call (its grammar writes `<tool_call>NAME<arg_key>...</arg_key><arg_value>...</arg_value></tool_call>`) comes back as `tool_calls` on
 * the OpenAI API and as a `tool_use` block on the Messages API, whole and streamed, its arguments typed by the schema;
 * a reply that writes `<think>…</think>` (fixed by a grammar; the prompt closed it) has it as `reasoning_content`, whole and streamed.
 */
import Anthropic from "@anthropic-ai/sdk"
import * as Command from "@effect/cli/Command"
import * as NodeContext from "@effect/platform-node/NodeContext"
import { Effect, Exit } from "effect"
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import OpenAI from "openai"
import { afterAll, beforeAll, describe, expect, it } from "vitest"
import { synthCommand } from "../../src/cli/SynthCommand.js"
import { type ServeProcess, startServe, stopServe } from "../support/serve.js"

const dir = mkdtempSync(join(tmpdir(), "swactor-glm-"))
const model = join(dir, "glm.gguf")

// No string argument: a random model's free text could run to max_tokens.
const parameters = {
  type: "object",
  properties: { days: { enum: [1, 2, 3, 7] }, alerts: { type: "boolean" } },
  required: ["days", "alerts"]
}
const weather = { type: "function" as const, function: { name: "get_weather", parameters } }
const user = [{ role: "user" as const, content: "What is the weather like in Paris?" }]

const validArguments = (args: unknown) => {
  const record = args as Record<string, unknown>
  expect(Object.keys(record).sort()).toEqual(["alerts", "days"])
  expect([1, 2, 3, 7]).toContain(record["days"])
  expect(typeof record["alerts"]).toBe("boolean")
}

const synth = Command.run(Command.make("swactor").pipe(Command.withSubcommands([synthCommand])), {
  name: "swactor",
  version: "test"
})

let server: ServeProcess
let client: OpenAI

beforeAll(async () => {
  const args = ["--arch", "qwen2", "--layers", "2", "--hidden", "64", "--ffn", "128", "--heads", "2", "--vocab", "600"]
  const exit = await Effect.runPromise(
    synth(["node", "swactor", "synth", ...args, "--seed", "7", "--chat-template", "glm", "-o", model]).pipe(
      Effect.provide(NodeContext.layer),
      Effect.exit
    )
  )
  expect(Exit.isSuccess(exit)).toBe(true)
  server = await startServe(["--model", model, "--stages", "1", "--threads", "1"])
  client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: "none", maxRetries: 0 })
}, 180_000)
afterAll(async () => {
  await stopServe(server)
  rmSync(dir, { recursive: true, force: true })
})

describe("swactor serve with GLM's template", () => {
  it("a forced call is tool_calls, typed by the schema, whole and streamed", async () => {
    const request = {
      model: "m",
      messages: user,
      tools: [weather],
      tool_choice: "required" as const,
      parallel_tool_calls: false,
      temperature: 0,
      max_tokens: 200
    }
    const whole = await client.chat.completions.create(request)
    const choice = whole.choices[0]!
    expect(choice.finish_reason).toBe("tool_calls")
    const calls = choice.message.tool_calls ?? []
    expect(calls).toHaveLength(1)
    const call = calls[0]!
    if (call.type !== "function") throw new Error("not a function call")
    expect(call.function.name).toBe("get_weather")
    validArguments(JSON.parse(call.function.arguments))
    expect(choice.message.content ?? "").not.toContain("<")

    const stream = await client.chat.completions.create({ ...request, stream: true })
    const streamed: Array<{ name: string; arguments: unknown }> = []
    let content = ""
    for await (const chunk of stream) {
      const delta = chunk.choices[0]?.delta
      content += delta?.content ?? ""
      for (const c of delta?.tool_calls ?? [])
        streamed.push({ name: c.function?.name ?? "", arguments: JSON.parse(c.function?.arguments ?? "null") })
    }
    expect(content).toBe("")
    expect(streamed).toEqual([{ name: "get_weather", arguments: JSON.parse(call.function.arguments) }])
  }, 120_000)

  it("on the Messages API: a tool_use block, whole and streamed", async () => {
    const anthropic = new Anthropic({ baseURL: server.url, apiKey: "none", maxRetries: 0 })
    const request = {
      model: "m",
      max_tokens: 200,
      temperature: 0,
      messages: user,
      tools: [{ name: "get_weather", input_schema: parameters as Anthropic.Tool.InputSchema }],
      tool_choice: { type: "any" as const, disable_parallel_tool_use: true }
    }
    const message = await anthropic.messages.create(request)
    expect(message.stop_reason).toBe("tool_use")
    const uses = message.content.filter((b) => b.type === "tool_use")
    expect(uses.map((b) => b.name)).toEqual(["get_weather"])
    validArguments(uses[0]!.input)
    expect(message.content.filter((b) => b.type === "text").map((b) => b.text)).toEqual([])
    const streamed = await anthropic.messages.stream(request).finalMessage()
    expect(streamed.stop_reason).toBe("tool_use")
    expect(streamed.content.filter((b) => b.type === "tool_use").map((b) => b.input)).toEqual([uses[0]!.input])
  }, 120_000)

  it("<think>…</think> is reasoning_content, the rest the content, whole and streamed", async () => {
    const request = {
      model: "m",
      messages: user,
      temperature: 0,
      max_tokens: 60,
      grammar: 'root ::= "<think>The user asks about weather.</think>It is sunny."'
    }
    const whole = (await client.chat.completions.create(request as never)) as OpenAI.Chat.Completions.ChatCompletion
    const message = whole.choices[0]!.message as { content: string | null; reasoning_content?: string }
    expect(message.reasoning_content).toBe("The user asks about weather.")
    expect(message.content).toBe("It is sunny.")
    const stream = (await client.chat.completions.create({
      ...request,
      stream: true
    } as never)) as unknown as AsyncIterable<OpenAI.Chat.Completions.ChatCompletionChunk>
    let reasoning = ""
    let content = ""
    for await (const chunk of stream) {
      const delta = chunk.choices[0]?.delta as { content?: string | null; reasoning_content?: string } | undefined
      reasoning += delta?.reasoning_content ?? ""
      content += delta?.content ?? ""
    }
    expect({ reasoning, content }).toEqual({ reasoning: "The user asks about weather.", content: "It is sunny." })
  }, 120_000)
})
