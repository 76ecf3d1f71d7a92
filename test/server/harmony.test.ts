/**
 * Harmony.ts: gpt-oss's harmony replies split as llama.cpp's server splits them: the analysis channel is the reasoning
 * (`reasoning_content`), the final channel the content, no channel markup left in either; a commentary message to a
 * function goes on to the tools' parser (ToolCalls.ts, node-llama-cpp's harmony call syntax) as a call. Streamed in
 * pieces of any size, the same split as the whole reply.
 */
import * as lib from "node-llama-cpp"
import { describe, expect, it } from "vitest"
import { wrapperToolSyntax } from "../../src/layers/gguf/TokenizerLive.js"
import { harmonyStream, splitHarmony } from "../../src/layers/server/Harmony.js"
import { parseToolCalls, toolCallStream } from "../../src/layers/server/ToolCalls.js"
import type { ChatTool } from "../../src/services/Tools.js"

const tools: ReadonlyArray<ChatTool> = [
  { name: "get_time", parameters: { type: "object", properties: { zone: { type: "string" } } } }
]
const syntax = wrapperToolSyntax(lib, new lib.HarmonyChatWrapper())

const reply =
  "<|channel|>analysis<|message|>The user greets me. I should greet back.<|end|>" +
  "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?"
const callReply =
  "<|channel|>analysis<|message|>Need the time in CET.<|end|>" +
  '<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"zone":"CET"}<|call|>'

const streamed = (text: string, size: number) => {
  const stream = harmonyStream()
  const pieces = []
  for (let i = 0; i < text.length; i += size) pieces.push(stream.push(text.slice(i, i + size)))
  pieces.push(stream.end())
  return {
    reasoning: pieces.map((p) => p.reasoning).join(""),
    content: pieces.map((p) => p.content).join(""),
    pieces
  }
}

describe("harmony replies (gpt-oss)", () => {
  it("analysis is the reasoning, final the content, no markup left", () => {
    expect(splitHarmony(reply)).toEqual({
      reasoning: "The user greets me. I should greet back.",
      content: "Hello! How can I help?"
    })
    // a preamble (commentary without a recipient) is content; the end of the turn (<|return|>) shows nowhere
    expect(
      splitHarmony(
        `<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final<|message|>Done.<|return|>`
      )
    ).toEqual({ reasoning: "", content: "Checking.Done." })
  })

  it("streamed in pieces of any size: the whole reply's split, no piece of markup in any piece", () => {
    for (const size of [1, 2, 3, 5, 11]) {
      const out = streamed(reply, size)
      expect({ reasoning: out.reasoning, content: out.content }).toEqual(splitHarmony(reply))
      for (const piece of out.pieces) expect(`${piece.reasoning}${piece.content}`).not.toMatch(/<\||\|>/)
    }
  })

  it("a call to a function is the tools' call; its analysis the reasoning; no content", () => {
    const split = splitHarmony(callReply)
    expect(split.reasoning).toBe("Need the time in CET.")
    const parsed = parseToolCalls(split.content, syntax, tools)
    expect(parsed.content).toBe("")
    expect(parsed.calls.map((c) => ({ name: c.name, arguments: c.arguments }))).toEqual([
      { name: "get_time", arguments: '{"zone":"CET"}' }
    ])
    // streamed through both: the call comes whole once complete, nothing else is content
    for (const size of [1, 4]) {
      const calls = toolCallStream(syntax, tools)
      const out = streamed(callReply, size)
      const pieces = [...out.pieces.map((p) => calls.push(p.content)), calls.end()]
      expect(pieces.map((p) => p.content).join("")).toBe("")
      expect(pieces.flatMap((p) => p.calls).map((c) => c.arguments)).toEqual(['{"zone":"CET"}'])
      expect(pieces.flatMap((p) => p.calls).map((c) => c.name)).toEqual(["get_time"])
      expect(out.reasoning).toBe("Need the time in CET.")
    }
    // the call's end token may never reach the text (an end-of-generation token): still the call
    const cut = callReply.slice(0, -"<|call|>".length)
    expect(parseToolCalls(splitHarmony(cut).content, syntax, tools).calls).toHaveLength(1)
  })

  it("cut off: the reasoning so far; text not in the format is content as it is", () => {
    expect(splitHarmony("<|channel|>analysis<|message|>Let me th")).toEqual({ reasoning: "Let me th", content: "" })
    expect(splitHarmony("<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant")).toEqual({
      reasoning: "Hm.",
      content: ""
    })
    expect(splitHarmony("Plain words, no channels.")).toEqual({ reasoning: "", content: "Plain words, no channels." })
    expect(streamed("<|chat|> is no channel", 2)).toMatchObject({ reasoning: "", content: "<|chat|> is no channel" })
  })
})
