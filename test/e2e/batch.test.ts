import { assert, describe, it } from "@effect/vitest"
import { Chunk, Effect, Stream } from "effect"
import { run } from "../../src/api/generate.js"
import type { RunSummary, RunUpdate } from "../../src/services/Orchestrator.js"
import { startAgents } from "../support/e2e.js"
import { requireModel } from "../support/models.js"

const prompts = [
  "Once upon a time",
  "The little dog",
  "Lily and Ben went to the park",
  "One day, a big red ball",
  "Tom had a toy car. He",
  "The sun was shining and the birds"
]

const collect = (updates: Chunk.Chunk<RunUpdate>) => {
  const all = Chunk.toReadonlyArray(updates)
  const tokens = all.flatMap((u) => (u._tag === "Token" && u.token.tokenId >= 0 ? [u.token.tokenId] : []))
  const finished = all.find((u) => u._tag === "Finished")
  assert.isTrue(finished !== undefined, "the run finished")
  return { tokens, summary: (finished as { summary: RunSummary }).summary }
}

describe("end to end: the agents' stage batcher, stories260K", () => {
  // Runs in flight on the same agents share micro-batches (one ggml graph per stage step for several runs), and
  // every run's greedy tokens equal the same run alone on the same agents. Prompts are prefilled in chunks of 4
  // tokens (SWACTOR_PREFILL_CHUNK), interleaved with the other runs' decode steps.
  it.live(
    "6 concurrent runs over 2 agents are batched (> 1 sequence per micro-batch) and give their lone tokens",
    () =>
      Effect.gen(function* () {
        const { layer } = yield* startAgents(2, { env: { SWACTOR_PREFILL_CHUNK: "4" } })
        const once = (prompt: string) =>
          Stream.runCollect(
            run({ model: requireModel("stories260K.gguf"), prompt, stages: 2, maxTokens: 32, threads: 1 })
          ).pipe(Effect.map(collect), Effect.provide(layer))
        const alone = yield* Effect.forEach(prompts, once)
        for (const a of alone) {
          // alone, every micro-batch carried this run only
          for (const s of a.summary.stages) assert.strictEqual(s.maxBatchSequences, 1, `lone run stage ${s.stageIndex}`)
        }
        const together = yield* Effect.forEach(prompts, once, { concurrency: "unbounded" })
        together.forEach((t, i) => assert.deepStrictEqual(t.tokens, alone[i]!.tokens, `prompt ${i}: ${prompts[i]}`))
        const most = Math.max(...together.flatMap((t) => t.summary.stages.map((s) => s.maxBatchSequences)))
        const batches = together.reduce((n, t) => n + t.summary.stages[1]!.microBatches, 0)
        const rows = together.reduce((n, t) => n + t.summary.stages[1]!.batchRows, 0)
        console.log(
          `6 concurrent runs: largest micro-batch ${most} sequences; last stage: mean ${(rows / batches).toFixed(2)} rows ` +
            `per micro-batch seen by a run`
        )
        assert.isAbove(most, 1)
        // a lone run: one micro-batch per decode step and ceil(prompt / 4) for its prompt, per stage
        const a0 = alone[0]!.summary
        assert.strictEqual(a0.stages[0]!.microBatches, Math.ceil(a0.promptTokens / 4) + a0.generatedTokens - 1)
      }).pipe(Effect.scoped),
    180_000
  )
})
