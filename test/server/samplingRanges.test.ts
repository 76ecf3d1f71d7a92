/**
 * Every numeric sampling field of both HTTP APIs against its documented range (issue 41), driven by the one table the
 * routes check with (src/layers/server/SamplingRanges.ts), through a real `swactor serve` on stories260K: for each field
 * on each route it takes, values just outside the range are a 400 invalid_request_error in that API's error shape whose
 * message names the field, and the values at the range's ends are served.
 */
import { afterAll, beforeAll } from "vitest"
import { assert, describe, it } from "@effect/vitest"
import Anthropic from "@anthropic-ai/sdk"
import OpenAI from "openai"
import { type SamplingRange, type SamplingRoute, samplingRanges } from "../../src/layers/server/SamplingRanges.js"
import { requireModel } from "../support/models.js"
import { type ServeProcess, startServe, stopServe } from "../support/serve.js"

const model = requireModel("stories260K.gguf")

const paths: Record<SamplingRoute, string> = {
  completions: "/v1/completions",
  chat: "/v1/chat/completions",
  messages: "/v1/messages"
}

/** A request that generates one token, with `field` set to `value` (and what the field needs beside it). */
const bodyWith = (route: SamplingRoute, field: string, value: number) => {
  const base =
    route === "completions"
      ? { prompt: "Once upon a time", max_tokens: 1 }
      : { model: "m", messages: [{ role: "user", content: "Once upon a time" }], max_tokens: 1 }
  return { ...base, ...(field === "top_logprobs" ? { logprobs: true } : {}), [field]: value }
}

/** Just outside the range: below its minimum (at it, when the minimum is excluded), above a finite maximum, and a fraction for a whole number. */
const outside = (range: SamplingRange): ReadonlyArray<number> => [
  range.aboveMin === true ? range.min : range.integer ? range.min - 1 : range.min - 0.01,
  ...(range.max === Infinity ? [] : [range.integer ? range.max + 1 : range.max + 0.01]),
  // a fraction inside the bounds (0.5 where the minimum is too large for a half to be a double's)
  ...(range.integer ? [Number.isInteger(range.min + 0.5) ? 0.5 : range.min + 0.5] : [])
]

/** The ends of the range (just above an excluded minimum). */
const inside = (range: SamplingRange): ReadonlyArray<number> => [
  range.aboveMin === true ? range.min + 0.01 : range.min,
  ...(range.max === Infinity ? [] : [range.max])
]

const cases = samplingRanges.flatMap((range) => range.routes.map((route) => ({ range, route })))

describe("sampling fields: each one's documented range, from one table (issue 41)", () => {
  let server: ServeProcess
  beforeAll(async () => {
    server = await startServe(["--model", model, "--stages", "1", "--threads", "1"])
  }, 180_000)
  afterAll(() => stopServe(server))

  const post = (route: SamplingRoute, body: unknown) =>
    fetch(`${server.url}${paths[route]}`, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify(body)
    })

  it("the table covers both APIs: Anthropic's temperature is 0–1, OpenAI's 0–2", () => {
    const find = (field: string, route: SamplingRoute) =>
      samplingRanges.find((r) => r.field === field && r.routes.includes(route))
    assert.deepInclude(find("temperature", "messages"), { min: 0, max: 1 })
    assert.deepInclude(find("temperature", "chat"), { min: 0, max: 2 })
    assert.deepInclude(find("temperature", "completions"), { min: 0, max: 2 })
    for (const field of ["max_tokens", "top_p", "top_k"]) assert.isDefined(find(field, "messages"), field)
    assert.isAbove(cases.length, 40)
  })

  for (const { range, route } of cases) {
    it(`${paths[route]} ${range.field}: outside ${outside(range).join(", ")} refused naming it; ${inside(range).join(", ")} served`, async () => {
      for (const value of outside(range)) {
        const response = await post(route, bodyWith(route, range.field, value))
        const text = await response.text()
        assert.strictEqual(response.status, 400, `${range.field} = ${value}: ${text}`)
        const json = JSON.parse(text) as { type?: string; error: { type: string; message: string } }
        if (route === "messages") assert.strictEqual(json.type, "error", text)
        assert.strictEqual(json.error.type, "invalid_request_error", text)
        assert.match(json.error.message, new RegExp(`^${range.field} must be `), text)
        assert.include(json.error.message, `got ${value}`, text)
      }
      for (const value of inside(range)) {
        const response = await post(route, bodyWith(route, range.field, value))
        assert.strictEqual(response.status, 200, `${range.field} = ${value}: ${await response.clone().text()}`)
        await response.arrayBuffer()
      }
    }, 60_000)
  }

  it("through the SDKs: Anthropic's BadRequestError for temperature 1.5, OpenAI's for temperature 2.5", async () => {
    const anthropic = new Anthropic({ baseURL: server.url, apiKey: "none", maxRetries: 0 })
    // This SDK's types have no sampling fields; it sends the body as given.
    const create = (temperature: number) =>
      anthropic.messages.create({
        model: "m",
        max_tokens: 4,
        temperature,
        messages: [{ role: "user", content: "hi" }]
      } as Anthropic.MessageCreateParamsNonStreaming)
    const refused = await create(1.5).then(
      () => undefined,
      (e: unknown) => e
    )
    assert.instanceOf(refused, Anthropic.BadRequestError)
    assert.match(
      (refused as InstanceType<typeof Anthropic.BadRequestError>).message,
      /temperature must be between 0 and 1, got 1\.5/
    )
    const openai = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: "none", maxRetries: 0 })
    const tooHot = await openai.chat.completions
      .create({ model: "m", max_tokens: 4, temperature: 2.5, messages: [{ role: "user", content: "hi" }] })
      .then(
        () => undefined,
        (e: unknown) => e
      )
    assert.instanceOf(tooHot, OpenAI.BadRequestError)
    assert.match(
      (tooHot as InstanceType<typeof OpenAI.BadRequestError>).message,
      /temperature must be between 0 and 2, got 2\.5/
    )
    const served = await create(1)
    assert.strictEqual(served.type, "message")
  }, 60_000)
})
