/**
 * The prompt cache keeps a server's outputs bit for bit those of a server without it, on a random-weight synthetic
 * llama (hidden 512: wide enough that a different kernel's rounding shows in the logits, where stories260K hid it).
 * A four-turn conversation, greedy, each turn = the last prompt + its reply + a short message; every token's
 * log-probability and its top 5 alternatives are compared, not only the text. Turns 2-4 adopt the previous turn's
 * entry: a multiple of the agents' prompt chunk (128), never the reply (its KV was computed one decode step at a time).
 */
import { assert, describe, it } from "@effect/vitest"
import { Effect, type Layer, ManagedRuntime, Stream } from "effect"
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { afterAll, beforeAll } from "vitest"
import { serve, Server } from "../../src/api/serve.js"
import { writeSyntheticModel } from "../../src/layers/gguf/Synthetic.js"

const dir = mkdtempSync(join(tmpdir(), "swactor-pc-synth-"))
const model = join(dir, "llama512.gguf")

interface Turn {
  readonly text: string
  /** Each token: its log-prob and its top alternatives' (exact numbers, as the last stage computed them). */
  readonly logprobs: ReadonlyArray<unknown>
  readonly promptTokens: number
  readonly cachedTokens: number
}

const open = (enabled: boolean) =>
  ManagedRuntime.make(
    serve({ model, stages: 2, threads: 1, parallel: 2, promptCache: { enabled } }) as Layer.Layer<Server>
  )

const turn = (runtime: ManagedRuntime.ManagedRuntime<Server, never>, prompt: string) =>
  runtime.runPromise(
    Effect.flatMap(Server, (server) =>
      Effect.suspend(() => {
        let text = ""
        const logprobs: Array<unknown> = []
        let promptTokens = 0
        let cachedTokens = 0
        return server.generate({ prompt, maxTokens: 24, sampling: { temperature: 0, logprobs: 5 } }).pipe(
          Stream.runForEach((event) =>
            Effect.sync(() => {
              if (event._tag === "Text") {
                text += event.text
                logprobs.push(...(event.logprobs ?? []))
              }
              if (event._tag === "Done") {
                promptTokens = event.promptTokens
                cachedTokens = event.cachedTokens ?? 0
              }
            })
          ),
          Effect.map((): Turn => ({ text, logprobs, promptTokens, cachedTokens }))
        )
      })
    )
  )

const words =
  "the quick brown fox jumps over a lazy dog while seven small birds sing in an old green tree near the river "
const messages = [" Tell me more.", " And then what happened?", " Why was that?"]

describe("swactor serve: prompt cache on a random-weight model", () => {
  let on: ManagedRuntime.ManagedRuntime<Server, never> | undefined
  let off: ManagedRuntime.ManagedRuntime<Server, never> | undefined
  beforeAll(async () => {
    await Effect.runPromise(
      writeSyntheticModel({
        path: model,
        arch: "llama",
        layers: 4,
        hidden: 512,
        ffn: 1376,
        heads: 8,
        kvHeads: 8,
        vocab: 2048,
        contextLength: 2048,
        type: "f32",
        seed: 5
      })
    )
    on = open(true)
    off = open(false)
    await on.runPromise(Effect.flatMap(Server, (s) => s.ready))
    await off.runPromise(Effect.flatMap(Server, (s) => s.ready))
  }, 240_000)
  afterAll(async () => {
    await on?.dispose()
    await off?.dispose()
    rmSync(dir, { recursive: true, force: true })
  })

  it("four turns: the same tokens and log-probabilities with the cache on as off, turns 2-4 reusing KV", async () => {
    let prompt = `Story: ${words.repeat(6)}`
    const cached: Array<string> = []
    for (let t = 0; t < 4; t++) {
      const a = await turn(on!, prompt)
      const b = await turn(off!, prompt)
      assert.strictEqual(a.text, b.text, `turn ${t + 1}`)
      assert.deepStrictEqual(a.logprobs, b.logprobs, `turn ${t + 1}`)
      assert.strictEqual(b.cachedTokens, 0)
      if (t > 0) {
        // the previous prompt's whole 128-token chunks (never its reply's tokens)
        assert.isAbove(a.cachedTokens, 0, `turn ${t + 1}`)
        assert.strictEqual(a.cachedTokens % 128, 0, `turn ${t + 1}`)
      }
      cached.push(`${a.cachedTokens}/${a.promptTokens}`)
      prompt = `${prompt}${a.text}${messages[t % messages.length]}`
    }
    console.log(`prompt cache on a random-weight llama: cached/prompt tokens per turn ${cached.join(", ")}`)
  }, 240_000)
})
