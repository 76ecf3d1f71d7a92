/**
 * Families added from files their converters write (gguf-py, test/support/convertedModels.py), served: `swactor serve`
 * over 2 local stages answers the official `openai` client, and 4 streams at once each get the text the same request
 * gets alone (greedy), as issue 40 asks of each new family.
 */
import { assert, describe, it } from "@effect/vitest"
import { join } from "node:path"
import OpenAI from "openai"
import { afterAll } from "vitest"
import { writeConverted } from "../support/convertedModels.js"
import { type ServeProcess, startServe, stopServe } from "../support/serve.js"
import { modelFolder } from "../support/synthFiles.js"

const dir = modelFolder("swactor-e2e-served-families-")
const PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went", "One day, a bird"]

describe("served families: 4 concurrent streams each give their lone text", () => {
  let server: ServeProcess | undefined
  afterAll(() => stopServe(server))

  // deepseek32, glm-dsa and deepseek4: each sequence's own top-k (the indexer reads its own cache) in a shared batch;
  // kimi-k3: each sequence's own KDA state and checkpoints
  for (const family of ["minimax-m2", "deepseek32", "glm-dsa", "deepseek4", "kimi-k3"] as const) {
    it(`${family} on 2 stages, --parallel 4`, async () => {
      const path = writeConverted(family, join(dir, `${family}.gguf`), 7)
      server = await startServe(["--model", path, "--stages", "2", "--threads", "1", "--parallel", "4"])
      const client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: "none", maxRetries: 0, timeout: 60_000 })
      const ask = (prompt: string) =>
        client.completions
          .create({ model: "m", prompt, max_tokens: 24, temperature: 0 })
          .then((r) => r.choices[0]!.text)
      const alone: Array<string> = []
      for (const prompt of PROMPTS) alone.push(await ask(prompt))
      assert.strictEqual(new Set(alone).size, PROMPTS.length, "the prompts give different texts")
      const together = await Promise.all(PROMPTS.map(ask))
      assert.deepStrictEqual(together, alone)
      await stopServe(server)
      server = undefined
    }, 240_000)
  }
})
