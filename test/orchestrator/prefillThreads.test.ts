/**
 * When a run's stages take more threads for its prompt (StageHosting.prefillThreadsOf, PipelineOptions.prefillThreads):
 * only a run alone on the pipeline, whose prompt runs in one piece and replays nothing, so that every other stage
 * waits while one computes; by default only with local agents, as many as the stages have together on this machine.
 */
import { assert, describe, it } from "@effect/vitest"
import { Deferred, Effect, Fiber, Stream } from "effect"
import { makeMemoryWorld } from "../../src/layers/agent/AgentLinksTest.js"
import { prefillThreadsOf } from "../../src/layers/orchestrator/StageHosting.js"
import type { ProvisionRequest } from "../../src/services/AgentLinks.js"
import type { RunRequest } from "../../src/services/Orchestrator.js"
import { MIN_PIECE_ROWS, promptPieces } from "../../src/services/PromptPieces.js"
import { delayedTestExecutor, memoryOrchestrator, tapProvisions } from "../support/memoryWorld.js"
import { requireModel } from "../support/models.js"

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

describe("prefill threads on a pipeline (in-memory agents, every provision request seen)", () => {
  it.live(
    "a run alone gets them on every stage; a run beside another, one announced behind, or a long prompt gets none",
    () =>
      Effect.gen(function* () {
        const requests: Array<ProvisionRequest> = []
        const memory = yield* makeMemoryWorld(2).pipe(Effect.provide(delayedTestExecutor(20)))
        const links = tapProvisions(memory, (r) => requests.push(r))
        const orchestrator = yield* memoryOrchestrator(memory, links)
        const pipeline = yield* orchestrator.pipeline({
          model: requireModel("stories260K.gguf"),
          stages: 2,
          threads: 1,
          prefillThreads: 2
        })
        /** The prefill threads of each stage's provision of one run (by stage), the run given its own first. */
        const seenFor = (runIds: ReadonlyArray<number>) =>
          runIds.map((runId) =>
            requests
              .filter((r) => r.provision.runId === runId)
              .sort((a, b) => a.provision.stageIndex - b.provision.stageIndex)
              .map((r) => r.prefillThreads)
          )
        const runOf = (request: RunRequest, started?: Deferred.Deferred<void>) =>
          pipeline
            .run(request)
            .pipe(
              Stream.runForEach((u) =>
                u._tag === "Token" && started !== undefined ? Deferred.succeed(started, undefined) : Effect.void
              )
            )
        const runIdsBefore = () => new Set<number>(requests.map((r) => r.provision.runId))
        const newRun = (before: Set<number>) => requests.find((r) => !before.has(r.provision.runId))!.provision.runId

        // alone, a short prompt: both stages
        const aloneBefore = runIdsBefore()
        yield* runOf({ prompt: "Once upon a time", maxTokens: 4 })
        assert.deepStrictEqual(seenFor([newRun(aloneBefore)]), [[2, 2]])

        // beside another: the first (alone when it started) has them, the second not
        const before = runIdsBefore()
        const firstToken = yield* Deferred.make<void>()
        const first = yield* Effect.fork(runOf({ prompt: "Once upon a time", maxTokens: 24 }, firstToken))
        yield* Deferred.await(firstToken)
        const firstId = newRun(before)
        const besideBefore = runIdsBefore()
        yield* runOf({ prompt: "One day", maxTokens: 2 })
        const besideId = newRun(besideBefore)
        yield* Fiber.join(first)
        assert.deepStrictEqual(seenFor([firstId, besideId]), [
          [2, 2],
          [undefined, undefined]
        ])

        // one announced behind it, and a prompt that travels in pieces (the byte tokenizer: BOS + one per byte)
        const arrivingBefore = runIdsBefore()
        yield* runOf({ prompt: "Once upon a time", maxTokens: 2, arriving: 1 })
        const arrivingId = newRun(arrivingBefore)
        const longBefore = runIdsBefore()
        yield* runOf({ prompt: "x".repeat(2 * MIN_PIECE_ROWS), maxTokens: 2 })
        const longId = newRun(longBefore)
        assert.deepStrictEqual(seenFor([arrivingId, longId]), [
          [undefined, undefined],
          [undefined, undefined]
        ])
        // and alone again afterwards: the count of runs went back to none
        const againBefore = runIdsBefore()
        yield* runOf({ prompt: "Once upon a time", maxTokens: 2 })
        assert.deepStrictEqual(seenFor([newRun(againBefore)]), [[2, 2]])
      }).pipe(Effect.scoped),
    60_000
  )
})
