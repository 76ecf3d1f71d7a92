/**
 * swactor's library API, runnable:
 *
 *   npx tsx examples/generate.ts [model.gguf] [prompt]
 *
 * Splits the model into 2 stages, each in its own local agent process, streams the text as it is
 * generated, then prints the run's summary. The same program runs on remote agents with
 * `layerRemote({ nodes: ["10.0.0.2:7070", "10.0.0.3:7070"], token })` in place of `layerLocal()`.
 */
import { Console, Effect, Stream } from "effect"
import { generate, layerLocal } from "../src/index.js"

const model = process.argv[2] ?? "../shared/models/stories260K.gguf"
const prompt = process.argv[3] ?? "Once upon a time"

const program = generate({ model, prompt, stages: 2, maxTokens: 48, sampling: { temperature: 0 } }).pipe(
  Stream.runForEach((token) => Effect.sync(() => process.stdout.write(token.text))),
  Effect.zipRight(Console.log()),
  // Every failure is typed: plan rejections, model load errors, agent/pool errors, run faults.
  Effect.catchTags({
    RunFaulted: (fault) => Console.error(`run faulted: ${fault.message}`),
    ModelLoadError: (error) => Console.error(`cannot load ${error.path}: ${error.message}`)
  }),
  Effect.provide(layerLocal({ threads: 1 }))
)

process.stdout.write(prompt)
Effect.runPromise(program).then(
  async () => {
    // The same through the Promise facade, for code that does not use Effect.
    const { createClient } = await import("../src/index.js")
    const client = createClient({ threads: 1 })
    try {
      const { summary, text } = await client.complete({ model, prompt, stages: 2, maxTokens: 16 })
      console.log(`Promise API: "${prompt}${text}" — ${summary.decodeTokensPerSecond.toFixed(0)} tok/s`)
    } finally {
      await client.close()
    }
  },
  (error) => {
    console.error(error)
    process.exitCode = 1
  }
)
