/**
 * AnthropicMessages.ts without a server: how a Messages body becomes chat messages and tool options for the template
 * (system first, text blocks joined, tool_use as the assistant's calls, tool_result as tool messages before the user's
 * text, thinking left out), and the refusals that name their field.
 */
import { describe, expect, it } from "vitest"
import { Effect, Either, Schema } from "effect"
import { chatOf, MessagesBody } from "../../src/layers/server/AnthropicMessages.js"

const convert = (body: unknown) =>
  Effect.runSync(Effect.either(Effect.flatMap(Schema.decodeUnknown(MessagesBody)(body), chatOf)))

const weather = { name: "get_weather", input_schema: { type: "object", properties: { city: { type: "string" } } } }

describe("chatOf", () => {
  it("system first (blocks joined), text blocks joined, thinking left out, no tools: no tool options", () => {
    const result = convert({
      max_tokens: 8,
      system: [
        { type: "text", text: "Be " },
        { type: "text", text: "brief." }
      ],
      messages: [
        {
          role: "user",
          content: [
            { type: "text", text: "Hi " },
            { type: "text", text: "there" }
          ]
        },
        {
          role: "assistant",
          content: [
            { type: "thinking", thinking: "hmm", signature: "x" },
            { type: "text", text: "Hello" }
          ]
        },
        { role: "user", content: "Bye" }
      ]
    })
    expect(Either.getOrThrow(result)).toEqual({
      messages: [
        { role: "system", content: "Be brief." },
        { role: "user", content: "Hi there" },
        { role: "assistant", content: "Hello" },
        { role: "user", content: "Bye" }
      ],
      tools: undefined
    })
  })

  it("tool_use is the assistant's call (arguments as JSON text); tool_result a tool message before the user's text", () => {
    const result = convert({
      max_tokens: 8,
      tools: [weather],
      tool_choice: { type: "any", disable_parallel_tool_use: true },
      messages: [
        { role: "user", content: "Weather in Paris?" },
        {
          role: "assistant",
          content: [
            { type: "text", text: "Let me look." },
            { type: "tool_use", id: "toolu_1", name: "get_weather", input: { city: "Paris" } }
          ]
        },
        {
          role: "user",
          content: [
            {
              type: "tool_result",
              tool_use_id: "toolu_1",
              content: [
                { type: "text", text: "Sun" },
                { type: "text", text: "ny" }
              ]
            },
            { type: "text", text: "And tomorrow?" }
          ]
        },
        {
          role: "assistant",
          content: [{ type: "tool_use", id: "toolu_2", name: "get_weather", input: { city: "Paris" } }]
        },
        {
          role: "user",
          content: [{ type: "tool_result", tool_use_id: "toolu_2", content: "no forecast", is_error: true }]
        }
      ]
    })
    expect(Either.getOrThrow(result)).toEqual({
      messages: [
        { role: "user", content: "Weather in Paris?" },
        {
          role: "assistant",
          content: "Let me look.",
          toolCalls: [{ id: "toolu_1", name: "get_weather", arguments: '{"city":"Paris"}' }]
        },
        { role: "tool", toolCallId: "toolu_1", content: "Sunny" },
        { role: "user", content: "And tomorrow?" },
        {
          role: "assistant",
          content: "",
          toolCalls: [{ id: "toolu_2", name: "get_weather", arguments: '{"city":"Paris"}' }]
        },
        { role: "tool", toolCallId: "toolu_2", content: "Error: no forecast" }
      ],
      tools: {
        tools: [{ name: "get_weather", parameters: weather.input_schema }],
        choice: "required",
        parallel: false
      }
    })
  })

  it("tool choices: auto by default with tools, tool = that one, none", () => {
    const choice = (tool_choice: unknown) =>
      Either.getOrThrow(
        convert({
          max_tokens: 8,
          tools: [weather],
          messages: [{ role: "user", content: "x" }],
          ...(tool_choice === undefined ? {} : { tool_choice })
        })
      ).tools?.choice
    expect(choice(undefined)).toBe("auto")
    expect(choice({ type: "auto" })).toBe("auto")
    expect(choice({ type: "none" })).toBe("none")
    expect(choice({ type: "tool", name: "get_weather" })).toEqual({ name: "get_weather" })
  })

  it("refusals name their field", () => {
    const refusal = (body: unknown) => {
      const result = convert({ max_tokens: 8, ...(body as object) })
      return Either.isLeft(result) ? (result.left as { message: string }).message : "accepted"
    }
    expect(
      refusal({ messages: [{ role: "user", content: [{ type: "tool_use", id: "a", name: "b", input: {} }] }] })
    ).toMatch(/messages\.0\.content\.0: tool_use blocks belong in assistant messages/)
    expect(
      refusal({ messages: [{ role: "user", content: "x" }], tools: [{ ...weather, name: "get weather" }] })
    ).toMatch(/tools\.0\.name must be/)
    expect(refusal({ messages: [{ role: "user", content: "x" }], tools: [weather, weather] })).toMatch(
      /tools\.1\.name: "get_weather" is already/
    )
    expect(refusal({ messages: [{ role: "user", content: [{ type: "document", source: {} }] }] })).toMatch(
      /messages\.0\.content\.0: documents/
    )
    expect(
      refusal({
        messages: [
          { role: "user", content: "x" },
          { role: "assistant", content: "y" }
        ]
      })
    ).toMatch(/messages\.1: the last message/)
  })
})
