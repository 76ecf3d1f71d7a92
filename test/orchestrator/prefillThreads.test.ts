/**
 * When a run's stages take more threads for its prompt (StageHosting.prefillThreadsOf, PipelineOptions.prefillThreads):
 * only a run alone on the pipeline, whose prompt runs in one piece and replays nothing, so that every other stage
 * waits while one computes; by default only with local agents, as many as the stages have together on this machine.
 */
import { assert, describe, it } from "@effect/vitest"
import { prefillThreadsOf } from "../../src/layers/orchestrator/StageHosting.js"
import { MIN_PIECE_ROWS, promptPieces } from "../../src/services/PromptPieces.js"

const base = {
  alone: true,
  promptTokens: 7,
  replayTail: undefined,
  stageCount: 2,
  threads: 1,
  option: undefined,
  localAgents: true,
  cores: 2
} as const

describe("prefillThreadsOf", () => {
  it("local agents: the stages' threads together, at most the machine's cores; none when that is the stage's own", () => {
    assert.strictEqual(prefillThreadsOf(base), 2)
    assert.strictEqual(prefillThreadsOf({ ...base, stageCount: 4 }), 2)
    assert.strictEqual(prefillThreadsOf({ ...base, stageCount: 4, cores: 16 }), 4)
    assert.strictEqual(prefillThreadsOf({ ...base, threads: 3, stageCount: 2, cores: 16 }), 6)
    assert.strictEqual(prefillThreadsOf({ ...base, stageCount: 1 }), undefined)
    assert.strictEqual(prefillThreadsOf({ ...base, cores: 1 }), undefined)
    // threads left to the agents (every core already): nothing to add
    assert.strictEqual(prefillThreadsOf({ ...base, threads: undefined }), undefined)
  })

  it("remote agents: only what the pipeline was told", () => {
    assert.strictEqual(prefillThreadsOf({ ...base, localAgents: false }), undefined)
    assert.strictEqual(prefillThreadsOf({ ...base, localAgents: false, option: 4 }), 4)
    assert.strictEqual(prefillThreadsOf({ ...base, option: 1 }), undefined)
    assert.strictEqual(prefillThreadsOf({ ...base, option: 3 }), 3)
  })

  it("never beside another run, for a prompt that travels in pieces, or for a resumed generation", () => {
    assert.strictEqual(prefillThreadsOf({ ...base, alone: false }), undefined)
    assert.strictEqual(prefillThreadsOf({ ...base, alone: false, option: 4 }), undefined)
    assert.strictEqual(prefillThreadsOf({ ...base, replayTail: 3 }), undefined)
    const longest = 2 * MIN_PIECE_ROWS - 1
    // the boundary is where a prompt starts to travel in pieces (at the batcher's default chunk of 128)
    assert.strictEqual(promptPieces(longest, 128).length, 1)
    assert.strictEqual(promptPieces(longest + 1, 128).length, 2)
    assert.strictEqual(prefillThreadsOf({ ...base, promptTokens: longest }), 2)
    assert.strictEqual(prefillThreadsOf({ ...base, promptTokens: longest + 1 }), undefined)
  })
})
