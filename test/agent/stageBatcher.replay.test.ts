/**
 * A resumed generation's prompt in the agent's stage batcher (layers/agent/StageBatcher.ts, `replayTail`): the prompt
 * ends with the tokens the interrupted run produced, and those rows run one per forward, as the decode steps that
 * produced them ran; the rows before them run in the chunks a prefill of the original prompt runs. Over the
 * deterministic StageExecutor double, recording the rows of every forwardBatch. The end-to-end consequence (a killed
 * gpt-oss stage resumes with the uninterrupted run's tokens) is engine.gptOss's kill -9 case.
 */
import { assert, describe, it } from "@effect/vitest"
import { Effect, Layer } from "effect"
import type { StageInput } from "../../src/domain/engine.js"
import { emptyBatchCounters, makeStageBatcher } from "../../src/layers/agent/StageBatcher.js"
import { make as makeDouble } from "../../src/layers/engine/StageExecutorTest.js"
import { StageExecutor, type StageExecutorService } from "../../src/services/StageExecutor.js"

/** The double, recording each forwardBatch's (startPos, rows) per item. */
const recording = () => {
  const base = makeDouble()
  const calls: Array<ReadonlyArray<readonly [number, number]>> = []
  const service: StageExecutorService = {
    ...base,
    forwardBatch: (items) =>
      Effect.suspend(() => {
        calls.push(
          items.map((i) => [i.startPos, i.input._tag === "Tokens" ? i.input.tokens.length : i.input.nTokens] as const)
        )
        return base.forwardBatch(items)
      })
  }
  return { calls, layer: Layer.succeed(StageExecutor, service) }
}

const prompt = (n: number): StageInput => ({ _tag: "Tokens", tokens: Int32Array.from({ length: n }, (_, i) => 3 + i) })

const run = (total: number, replayTail: number | undefined) =>
  Effect.gen(function* () {
    const { calls, layer } = recording()
    const out = yield* Effect.gen(function* () {
      const batcher = yield* makeStageBatcher({ maxRows: 64, prefillChunk: 8, promptGatherMillis: 0 })
      const executor = yield* StageExecutor
      const stage = yield* executor.load({
        path: "m",
        layerStart: 0,
        layerEndExclusive: 6,
        isFirst: true,
        isLast: true
      })
      const session = yield* executor.session(stage)
      return yield* batcher.submit(session, 0, prompt(total), emptyBatchCounters(), 1, replayTail)
    }).pipe(Effect.provide(layer))
    return { calls, out }
  })

describe("stage batcher: a resumed generation's replayed tokens", () => {
  it.scoped(
    "a 19-token prompt whose last 6 are replayed: chunks [0, 8) [8, 13), then one forward per replayed row",
    () =>
      Effect.gen(function* () {
        const { calls, out } = yield* run(19, 6)
        assert.deepStrictEqual(calls, [
          [[0, 8]],
          [[8, 5]],
          [[13, 1]],
          [[14, 1]],
          [[15, 1]],
          [[16, 1]],
          [[17, 1]],
          [[18, 1]]
        ])
        // the caller still gets one output: the logits of the last position, as from a prefill
        const whole = yield* run(19, undefined)
        assert.deepStrictEqual(whole.calls, [[[0, 8]], [[8, 8]], [[16, 3]]], "without a replay: the prompt's chunks")
        assert.deepStrictEqual(out, whole.out)
      })
  )

  it.scoped("no tail, a tail of 0 or past the prompt: as many one-row forwards as the prompt allows", () =>
    Effect.gen(function* () {
      assert.deepStrictEqual((yield* run(5, 0)).calls, [[[0, 5]]])
      assert.deepStrictEqual((yield* run(3, 10)).calls, [[[0, 1]], [[1, 1]], [[2, 1]]])
      assert.deepStrictEqual((yield* run(9, 1)).calls, [[[0, 8]], [[8, 1]]])
    })
  )
})
