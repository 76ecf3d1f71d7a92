// serve --speculative ngram: a request alone on the pipeline drafts by prompt lookup and gets the text it gets without
// drafts (the official openai client, greedy, 2 stages of stories260K); /metrics counts the steps, the drafted tokens
// and the drafts kept. Four requests sent together (a batch: none alone) each get their lone text too.
import OpenAI from "openai"
import { afterAll, beforeAll, describe, expect, it } from "vitest"
import { requireModel } from "../support/models.js"
import { type ServeProcess, startServe, stopServe } from "../support/serve.js"

const prompt = "Once upon a time, there was a little girl. Once upon a time, there was a little"

const counter = (text: string, name: string): number => {
  const line = text.split("\n").find((l) => l.startsWith(`${name} `))
  return line === undefined ? Number.NaN : Number(line.split(" ")[1])
}

describe("serve --speculative ngram", () => {
  let plain: ServeProcess | undefined
  let drafting: ServeProcess | undefined
  beforeAll(async () => {
    const args = ["--model", requireModel("stories260K.gguf"), "--stages", "2", "--threads", "1"]
    ;[plain, drafting] = await Promise.all([startServe(args), startServe([...args, "--speculative", "ngram"])])
  }, 180_000)
  afterAll(async () => {
    await Promise.all([stopServe(plain), stopServe(drafting)])
  })

  const complete = (server: ServeProcess, text: string) =>
    new OpenAI({ baseURL: `${server.url}/v1`, apiKey: "none" }).completions
      .create({ model: "m", prompt: text, max_tokens: 64, temperature: 0 })
      .then((r) => r.choices[0]!.text)

  it("a lone request gets the text it gets without drafts, and /metrics counts the drafts", async () => {
    const expected = await complete(plain!, prompt)
    expect(await complete(drafting!, prompt)).toBe(expected)
    const metrics = await fetch(`${drafting!.url}/metrics`).then((r) => r.text())
    const drafted = counter(metrics, "swactor_speculative_drafted_total")
    const accepted = counter(metrics, "swactor_speculative_accepted_total")
    // the adaptive draft count follows measured timings: that it drafted is certain (a = 0.5 until a step drafts, the
    // prompt repeats itself), how many were kept is not (test/e2e/speculative forces the count: kept and refused)
    expect(counter(metrics, "swactor_speculative_steps_total")).toBeGreaterThan(0)
    expect(drafted).toBeGreaterThan(0)
    expect(accepted).toBeLessThanOrEqual(drafted)
    // the server without --speculative drafted nothing
    const none = await fetch(`${plain!.url}/metrics`).then((r) => r.text())
    expect(counter(none, "swactor_speculative_drafted_total")).toBe(0)
  }, 120_000)

  it("four requests together each get their lone text", async () => {
    const prompts = [prompt, "Once upon a time", "The little dog", "Lily and Tom went to the park. Lily and Tom"]
    const lone: Array<string> = []
    for (const p of prompts) lone.push(await complete(plain!, p))
    expect(await Promise.all(prompts.map((p) => complete(drafting!, p)))).toEqual(lone)
  }, 120_000)
})
