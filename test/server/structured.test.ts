/**
 * The OpenAI request side of sampling against a real `swactor serve` on stories260K (2 local stages): structured
 * output (json_schema, json_object, raw GBNF grammar), log-probs (chat and completions, streamed and not, aligned with
 * stop strings), n > 1, logit_bias, and bad input answered with 400s naming the field. Clients: the official `openai`
 * package and the Vercel AI SDK (`ai` + `@ai-sdk/openai-compatible`).
 */
import { afterAll, beforeAll } from "vitest"
import { assert, describe, it } from "@effect/vitest"
import OpenAI from "openai"
import { generateObject, jsonSchema } from "ai"
import { createOpenAICompatible } from "@ai-sdk/openai-compatible"
import { z } from "zod"
import { Effect } from "effect"
import * as TokenizerLive from "../../src/layers/gguf/TokenizerLive.js"
import { Tokenizer } from "../../src/services/Tokenizer.js"
import { requireModel } from "../support/models.js"
import { type ServeProcess, startServe, stopServe } from "../support/serve.js"

const model = requireModel("stories260K.gguf")

// Schemas as zod (the validator) and their JSON Schema (what is sent).
const schemas = {
  required: z.object({ name: z.string().max(12), age: z.number().int() }).strict(),
  enum: z.object({ mood: z.enum(["happy", "sad", "angry"]) }).strict(),
  array: z.object({ words: z.array(z.string().max(8)).min(1).max(3) }).strict(),
  nested: z
    .object({
      hero: z
        .object({
          name: z.string().max(10),
          friend: z.object({ kind: z.enum(["cat", "dog"]), brave: z.boolean() }).strict()
        })
        .strict(),
      count: z.number().int().nullable()
    })
    .strict()
}
const jsonSchemaOf = (schema: z.ZodType) => {
  const { $schema: _, ...rest } = z.toJSONSchema(schema) as Record<string, unknown>
  return rest
}

describe("swactor serve: structured output, log-probs, n, sampling fields (stories260K)", () => {
  let server: ServeProcess
  let client: OpenAI
  beforeAll(async () => {
    server = await startServe(["--model", model, "--stages", "2", "--threads", "1", "--parallel", "4"])
    client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: "none", maxRetries: 0, timeout: 120_000 })
  }, 180_000)
  afterAll(() => stopServe(server))

  const post = (path: string, body: unknown) =>
    fetch(`${server.url}${path}`, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify(body)
    })
  const chat = (content: string) => [{ role: "user" as const, content }]

  it("json_schema output parses and validates (required fields, enum, array, nested), greedy and sampled", async () => {
    for (const [name, schema] of Object.entries(schemas)) {
      for (const sampling of [{ temperature: 0 }, { temperature: 1, seed: 7 }]) {
        const reply = await client.chat.completions.create({
          model: "stories260K.gguf",
          messages: chat("Tell me about a hero."),
          max_tokens: 200,
          ...sampling,
          response_format: { type: "json_schema", json_schema: { name, schema: jsonSchemaOf(schema), strict: true } }
        })
        const text = reply.choices[0]!.message.content ?? ""
        assert.strictEqual(reply.choices[0]!.finish_reason, "stop", `${name}: the grammar ends the output (${text})`)
        const parsed = schema.safeParse(JSON.parse(text))
        assert.isTrue(parsed.success, `${name} ${JSON.stringify(sampling)}: ${text}`)
      }
    }
  }, 240_000)

  it("json_object output is a JSON object; completions take response_format too", async () => {
    const reply = await client.chat.completions.create({
      model: "stories260K.gguf",
      messages: chat("Once upon a time"),
      max_tokens: 120,
      temperature: 0.8,
      seed: 3,
      response_format: { type: "json_object" }
    })
    const value = JSON.parse(reply.choices[0]!.message.content ?? "")
    assert.isTrue(typeof value === "object" && value !== null && !Array.isArray(value))
    const completion = (await client.completions.create({
      model: "stories260K.gguf",
      prompt: "Once upon a time",
      max_tokens: 80,
      temperature: 0,
      response_format: { type: "json_schema", json_schema: { name: "e", schema: jsonSchemaOf(schemas.enum) } }
    } as never)) as OpenAI.Completion
    assert.isTrue(schemas.enum.safeParse(JSON.parse(completion.choices[0]!.text)).success, completion.choices[0]!.text)
  }, 120_000)

  it("a raw GBNF grammar field constrains the text", async () => {
    const response = await post("/v1/completions", {
      prompt: "Once upon a time",
      max_tokens: 10,
      temperature: 1,
      seed: 1,
      grammar: `root ::= ("yes" | "no") " " [0-9]`
    })
    assert.strictEqual(response.status, 200)
    const body = (await response.json()) as { choices: Array<{ text: string }> }
    assert.match(body.choices[0]!.text, /^(yes|no) [0-9]$/)
  }, 60_000)

  it("chat log-probs: top_logprobs honoured, the greedy token is the top of its list, stream = non-stream", async () => {
    const ask = {
      model: "stories260K.gguf",
      messages: chat("Once upon a time"),
      max_tokens: 12,
      temperature: 0,
      logprobs: true,
      top_logprobs: 3
    }
    const reply = await client.chat.completions.create(ask)
    const content = reply.choices[0]!.logprobs!.content!
    assert.strictEqual(content.length, reply.usage!.completion_tokens)
    assert.strictEqual(content.map((e) => e.token).join(""), reply.choices[0]!.message.content)
    for (const entry of content) {
      assert.strictEqual(entry.top_logprobs.length, 3)
      const best = Math.max(...entry.top_logprobs.map((t) => t.logprob))
      assert.strictEqual(entry.logprob, best)
      assert.strictEqual(entry.top_logprobs[0]!.token, entry.token)
      assert.deepStrictEqual(entry.bytes, [...new TextEncoder().encode(entry.token)])
      assert.isTrue(entry.logprob <= 0)
    }
    const streamed: Array<OpenAI.Chat.Completions.ChatCompletionTokenLogprob> = []
    let text = ""
    for await (const part of await client.chat.completions.create({ ...ask, stream: true })) {
      const choice = part.choices[0]
      text += choice?.delta.content ?? ""
      streamed.push(...(choice?.logprobs?.content ?? []))
    }
    assert.strictEqual(text, reply.choices[0]!.message.content)
    assert.deepStrictEqual(
      streamed.map((e) => e.token),
      content.map((e) => e.token)
    )
    streamed.forEach((e, i) => assert.closeTo(e.logprob, content[i]!.logprob, 1e-4))
  }, 60_000)

  it("completions log-probs: OpenAI's shape, N honoured, aligned with the text a stop string cut", async () => {
    const full = await client.completions.create({
      model: "stories260K.gguf",
      prompt: "Once upon a time",
      max_tokens: 12,
      temperature: 0,
      logprobs: 2
    })
    const lp = full.choices[0]!.logprobs!
    assert.strictEqual(lp.tokens!.length, 12)
    assert.strictEqual(lp.tokens!.join(""), full.choices[0]!.text)
    assert.strictEqual(lp.top_logprobs!.length, 12)
    lp.top_logprobs!.forEach((top, i) => {
      assert.isAtMost(Object.keys(top).length, 2)
      assert.strictEqual(Math.max(...Object.values(top)), lp.token_logprobs![i])
    })
    assert.deepStrictEqual(
      lp.text_offset,
      lp.tokens!.map((_, i) => lp.tokens!.slice(0, i).join("").length)
    )
    // a stop string in the middle of the text: the entries end with the text returned
    const text = full.choices[0]!.text
    const stop = lp.tokens![5]!.trim()
    const cut = await client.completions.create({
      model: "stories260K.gguf",
      prompt: "Once upon a time",
      max_tokens: 12,
      temperature: 0,
      logprobs: 2,
      stop: [stop]
    })
    const returned = cut.choices[0]!.text
    assert.strictEqual(returned, text.slice(0, text.indexOf(stop)))
    // the entries are those of the tokens whose text begins in the returned text: all of it, nothing after it
    const cutTokens = cut.choices[0]!.logprobs!.tokens!
    assert.isTrue(
      cutTokens.join("").startsWith(returned),
      `${JSON.stringify(cutTokens)} covers ${JSON.stringify(returned)}`
    )
    assert.isBelow(cutTokens.slice(0, -1).join("").length, returned.length)
    assert.deepStrictEqual(cutTokens, lp.tokens!.slice(0, cutTokens.length))
  }, 60_000)

  it("n: 3 gives 3 choices, choice i = a lone request with seed + i; usage summed; streamed chunks carry their index", async () => {
    const ask = {
      model: "stories260K.gguf",
      prompt: "Once upon a time",
      max_tokens: 10,
      temperature: 2,
      top_k: 0,
      seed: 11
    }
    const three = await client.completions.create({ ...ask, n: 3 })
    assert.deepStrictEqual(
      three.choices.map((c) => c.index),
      [0, 1, 2]
    )
    const lone = await Promise.all([0, 1, 2].map((i) => client.completions.create({ ...ask, seed: 11 + i })))
    assert.deepStrictEqual(
      three.choices.map((c) => c.text),
      lone.map((r) => r.choices[0]!.text)
    )
    assert.notStrictEqual(lone[0]!.choices[0]!.text, lone[1]!.choices[0]!.text)
    assert.strictEqual(
      three.usage!.completion_tokens,
      lone.reduce((n, r) => n + r.usage!.completion_tokens, 0)
    )
    assert.strictEqual(three.usage!.prompt_tokens, lone[0]!.usage!.prompt_tokens)
    const texts = ["", "", ""]
    for await (const part of await client.completions.create({ ...ask, n: 3, stream: true })) {
      for (const choice of part.choices) texts[choice.index] += choice.text
    }
    assert.deepStrictEqual(
      texts,
      lone.map((r) => r.choices[0]!.text)
    )
  }, 120_000)

  it("logit_bias -100 bans a token; sampling fields llama-server takes are accepted", async () => {
    const vocab = await Effect.runPromise(
      Tokenizer.pipe(
        Effect.flatMap((t) => t.open(model)),
        Effect.map((v) => v),
        Effect.provide(TokenizerLive.layer),
        Effect.scoped
      )
    )
    const prompt = vocab.tokenize("Once upon a time")
    const next = async (bias?: Record<string, number>) => {
      const reply = await client.completions.create({
        model: "stories260K.gguf",
        prompt: [...prompt],
        max_tokens: 1,
        temperature: 0,
        ...(bias === undefined ? {} : { logit_bias: bias })
      })
      return reply.choices[0]!.text
    }
    // every token that reads as the text (a byte token may too)
    const idsOf = (text: string) =>
      Array.from({ length: vocab.vocabSize }, (_, id) => id).filter(
        (id) => vocab.detokenize([id], prompt.slice(-1)) === text
      )
    const first = await next()
    const firstIds = idsOf(first)
    assert.isNotEmpty(firstIds)
    const banned = await next(Object.fromEntries(firstIds.map((id) => [String(id), -100])))
    assert.notStrictEqual(banned, first)
    const forced = idsOf(" was")
    assert.isNotEmpty(forced)
    assert.strictEqual(await next({ [String(forced[0]!)]: 100 }), " was")
    const response = await post("/v1/completions", {
      prompt: "Once upon a time",
      max_tokens: 8,
      temperature: 0.7,
      seed: 2,
      top_k: 20,
      top_p: 0.95,
      min_p: 0.05,
      typical_p: 0.9,
      presence_penalty: 0.5,
      frequency_penalty: 0.5,
      repeat_penalty: 1.1,
      repeat_last_n: 32,
      dry_multiplier: 0.8,
      dry_base: 1.75,
      dry_allowed_length: 2,
      dry_penalty_last_n: -1,
      dry_sequence_breakers: ["\n", "."],
      xtc_probability: 0.5,
      xtc_threshold: 0.1
    })
    assert.strictEqual(response.status, 200, await response.clone().text())
  }, 60_000)

  it("Vercel AI SDK generateObject returns a valid object", async () => {
    const provider = createOpenAICompatible({
      name: "swactor",
      baseURL: `${server.url}/v1`,
      supportsStructuredOutputs: true
    })
    const { object } = await generateObject({
      model: provider("stories260K.gguf"),
      schema: schemas.nested,
      prompt: "Once upon a time",
      temperature: 0,
      maxOutputTokens: 200,
      maxRetries: 0
    })
    assert.isTrue(schemas.nested.safeParse(object).success, JSON.stringify(object))
    const plain = await generateObject({
      model: provider("stories260K.gguf"),
      schema: jsonSchema<{ colour: string }>({
        type: "object",
        properties: { colour: { enum: ["red", "blue"] } },
        required: ["colour"],
        additionalProperties: false
      }),
      prompt: "Pick a colour",
      temperature: 0.5,
      seed: 4,
      maxOutputTokens: 60,
      maxRetries: 0
    })
    assert.include(["red", "blue"], plain.object.colour)
  }, 120_000)

  it("bad input is a 400 naming the field, and the server keeps serving", async () => {
    const refused = async (path: string, body: unknown, message: RegExp) => {
      const response = await post(path, body)
      const json = (await response.json()) as { error: { message: string; type: string } }
      assert.strictEqual(response.status, 400, JSON.stringify(json))
      assert.strictEqual(json.error.type, "invalid_request_error")
      assert.match(json.error.message, message)
    }
    const messages = chat("hi")
    await refused(
      "/v1/chat/completions",
      {
        messages,
        response_format: {
          type: "json_schema",
          json_schema: {
            name: "x",
            schema: { type: "object", properties: { x: { type: "object", patternProperties: { "^a": {} } } } }
          }
        }
      },
      /^response_format\.json_schema\.schema\.properties\.x: unsupported keyword "patternProperties"$/
    )
    // An object that must contain itself has no finite instance: before, the request ran to max_tokens and returned
    // truncated JSON.
    await refused(
      "/v1/chat/completions",
      {
        messages,
        max_tokens: 64,
        response_format: {
          type: "json_schema",
          json_schema: {
            name: "tree",
            schema: {
              $defs: {
                Node: {
                  type: "object",
                  properties: { name: { type: "string" }, child: { $ref: "#/$defs/Node" } },
                  required: ["name", "child"]
                }
              },
              $ref: "#/$defs/Node"
            }
          }
        }
      },
      /^response_format\.json_schema\.schema\.\$defs\.Node\.properties\.child: admits no finite value: every "Node" must contain another "Node"/
    )
    await refused("/v1/completions", { prompt: "a", logit_bias: { abc: 5 } }, /^logit_bias: "abc" is not a token id/)
    await refused(
      "/v1/completions",
      { prompt: "a", logit_bias: { "5": 300 } },
      /^logit_bias\["5"\] must be between -100 and 100/
    )
    await refused(
      "/v1/chat/completions",
      { messages, logprobs: true, top_logprobs: 21 },
      /^top_logprobs must be a whole number between 0 and 20, got 21$/
    )
    await refused("/v1/chat/completions", { messages, top_logprobs: 2 }, /^top_logprobs needs logprobs: true$/)
    await refused(
      "/v1/completions",
      { prompt: "a", grammar: `root ::= "a"{3,1}` },
      /^grammar: repetition \{3,1\} has its maximum below its minimum/
    )
    await refused("/v1/completions", { prompt: "a", grammar: `root ::= foo` }, /^grammar: undefined rule foo/)
    await refused(
      "/v1/completions",
      { prompt: "a", presence_penalty: 3 },
      /^presence_penalty must be between -2 and 2, got 3$/
    )
    await refused(
      "/v1/completions",
      { prompt: "a", n: 9 },
      /^n must be at most 4 \(the server's parallel sequences\), got 9$/
    )
    await refused(
      "/v1/completions",
      { prompt: "a", grammar: `root ::= "a"`, response_format: { type: "json_object" } },
      /^response_format and grammar cannot be combined/
    )
    await refused(
      "/v1/completions",
      { prompt: "a", response_format: { type: "json_schema" } },
      /^response_format\.json_schema is required/
    )
    const after = await client.completions.create({
      model: "stories260K.gguf",
      prompt: "Once upon a time",
      max_tokens: 4,
      temperature: 0
    })
    assert.strictEqual(after.choices[0]!.finish_reason, "length")
    assert.strictEqual(server.child.exitCode, null)
  }, 60_000)
})
