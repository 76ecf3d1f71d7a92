/**
 * The token loop (ProvisionRequest.tokenLoop, PipelineOptions.tokenLoop): in a run of two stages or more the last
 * stage sends each token the run goes on from straight to stage 0, and the orchestrator sends stage 0 the prompt
 * only. Counted on the in-memory data plane, frame by frame and edge by edge, against the same run with the loop off.
 */
import { assert, describe, it } from "@effect/vitest"
import { Chunk, Effect, Layer, Stream } from "effect"
import type { DataFrame } from "../../src/domain/frames.js"
import * as MembershipLive from "../../src/layers/agent/MembershipLive.js"
import { makeMemoryWorld } from "../../src/layers/agent/AgentLinksTest.js"
import * as StageExecutorTest from "../../src/layers/engine/StageExecutorTest.js"
import * as ModelCatalogLive from "../../src/layers/gguf/ModelCatalogLive.js"
import * as TokenizerLive from "../../src/layers/gguf/TokenizerLive.js"
import * as OrchestratorLive from "../../src/layers/orchestrator/OrchestratorLive.js"
import type { EdgeRef, StageReport } from "../../src/services/AgentLinks.js"
import { type GenerateRequest, Orchestrator, type RunUpdate } from "../../src/services/Orchestrator.js"
import { tapReports } from "../support/memoryWorld.js"
import { requireModel, storiesTestModel as testModel } from "../support/models.js"

interface Sent {
  readonly edge: EdgeRef
  readonly frame: DataFrame
}

/** In-memory agents (the real StageHost over the deterministic engine) and an orchestrator; every frame sent is kept. */
const world = (agents: number) =>
  Effect.gen(function* () {
    const sent: Array<Sent> = []
    const reports: Array<StageReport> = []
    const memory = yield* makeMemoryWorld(agents, (edge, frame) => sent.push({ edge, frame })).pipe(
      Effect.provide(StageExecutorTest.layerWith(testModel))
    )
    const links = tapReports(memory, (r) => reports.push(r))
    const orchestrator = yield* Effect.provide(
      Orchestrator,
      OrchestratorLive.layer.pipe(
        Layer.provide(Layer.mergeAll(links, TokenizerLive.layerTest, MembershipLive.layer, ModelCatalogLive.layer))
      )
    )
    return { orchestrator, sent, reports, memory }
  })

const request = (patch: Partial<GenerateRequest> = {}): GenerateRequest => ({
  model: requireModel("stories260K.gguf"),
  prompt: "Once upon a time",
  maxTokens: 12,
  recovery: { maxAttempts: 0 },
  ...patch
})

const tokensOf = (updates: ReadonlyArray<RunUpdate>) =>
  updates.flatMap((u) => (u._tag === "Token" && u.token.tokenId >= 0 ? [u.token.tokenId] : []))

// The byte-level test tokenizer: BOS then byte + 3.
const promptTokens = (text: string) => [1, ...Array.from(new TextEncoder().encode(text), (b) => b + 3)]

/** The frames of one run's token-in edge (the one its prompt went on) and its other decode-token frames (the loop). */
const tokenTraffic = (sent: ReadonlyArray<Sent>) => {
  const prompt = sent.find((s) => s.frame._tag === "TokenFrame" && s.frame.payload._tag === "Prompt")
  assert.isDefined(prompt, "no prompt frame was sent")
  const tokenIn = sent.filter((s) => s.edge.runId === prompt!.edge.runId && s.edge.edgeId === prompt!.edge.edgeId)
  const loop = sent.filter(
    (s) =>
      s.frame._tag === "TokenFrame" &&
      s.frame.payload._tag === "Decode" &&
      !(s.edge.runId === prompt!.edge.runId && s.edge.edgeId === prompt!.edge.edgeId)
  )
  return { tokenIn, loop, loopEdges: new Set(loop.map((s) => `${s.edge.runId}/${s.edge.edgeId}`)) }
}

const decodeTokens = (frames: ReadonlyArray<Sent>) =>
  frames.flatMap((s) =>
    s.frame._tag === "TokenFrame" && s.frame.payload._tag === "Decode" ? [s.frame.payload.tokenId] : []
  )

describe("the token loop (in-memory agents, deterministic engine)", () => {
  it.live(
    "at 2-4 stages token-in carries the prompt only and the loop steps 1..n-1; off, token-in carries them all; the same tokens",
    () =>
      Effect.gen(function* () {
        const expected = StageExecutorTest.testModelGreedy(testModel, promptTokens("Once upon a time"), 12)
        assert.notInclude(expected, testModel.eosTokenId, "the prompt must run to max tokens here")
        for (const stages of [2, 3, 4]) {
          const on = yield* world(stages)
          const onUpdates = Chunk.toReadonlyArray(yield* Stream.runCollect(on.orchestrator.run(request({ stages }))))
          assert.deepStrictEqual(tokensOf(onUpdates), expected, `stages=${stages}, loop on`)
          const onTraffic = tokenTraffic(on.sent)
          assert.strictEqual(onTraffic.tokenIn.length, 1, `stages=${stages}: token-in carried more than the prompt`)
          assert.strictEqual(onTraffic.loopEdges.size, 1)
          assert.deepStrictEqual(
            onTraffic.loop.map((s) => s.frame.step),
            Array.from({ length: 11 }, (_, i) => i + 1),
            `stages=${stages}: loop steps`
          )
          // step k's input is the token sampled at step k-1
          assert.deepStrictEqual(decodeTokens(onTraffic.loop), expected.slice(0, 11))
          const lastReady = on.reports.find((r) => r._tag === "StageReady" && r.stageIndex === stages - 1)
          assert.isTrue(lastReady?._tag === "StageReady" && lastReady.tokenLoop === true)

          const off = yield* world(stages)
          const offUpdates = Chunk.toReadonlyArray(
            yield* Stream.runCollect(off.orchestrator.run(request({ stages, tokenLoop: false })))
          )
          assert.deepStrictEqual(tokensOf(offUpdates), expected, `stages=${stages}, loop off`)
          const offTraffic = tokenTraffic(off.sent)
          assert.strictEqual(offTraffic.loop.length, 0)
          assert.deepStrictEqual(
            offTraffic.tokenIn.map((s) => s.frame.step),
            Array.from({ length: 12 }, (_, i) => i)
          )
          assert.deepStrictEqual(decodeTokens(offTraffic.tokenIn), expected.slice(0, 11))
          assert.isTrue(
            off.reports.every((r) => r._tag !== "StageReady" || r.tokenLoop === undefined),
            "a stage said it loops with the loop off"
          )
        }
      }).pipe(Effect.scoped)
  )

  it.live("a generation that ends in EOS loops every token before it and not the EOS token", () =>
    Effect.gen(function* () {
      const greedy = StageExecutorTest.testModelGreedy(testModel, promptTokens("Once"), 100)
      const eosAt = greedy.indexOf(testModel.eosTokenId)
      assert.isTrue(eosAt > 0 && eosAt < 99, `the test model's greedy run of "Once" must hit EOS early (at ${eosAt})`)
      const { orchestrator, sent } = yield* world(3)
      const updates = Chunk.toReadonlyArray(
        yield* Stream.runCollect(orchestrator.run(request({ stages: 3, prompt: "Once", maxTokens: 100 })))
      )
      assert.deepStrictEqual(tokensOf(updates), greedy.slice(0, eosAt))
      const finished = updates.at(-1)
      assert.isTrue(finished?._tag === "Finished" && finished.summary.outcome === "Eos")
      const traffic = tokenTraffic(sent)
      assert.strictEqual(traffic.tokenIn.length, 1)
      assert.deepStrictEqual(
        traffic.loop.map((s) => s.frame.step),
        Array.from({ length: eosAt }, (_, i) => i + 1)
      )
    }).pipe(Effect.scoped)
  )

  it.live("a one-stage run has no loop: token-in carries every step", () =>
    Effect.gen(function* () {
      const expected = StageExecutorTest.testModelGreedy(testModel, promptTokens("Once upon a time"), 12)
      const { orchestrator, sent, reports } = yield* world(1)
      const updates = Chunk.toReadonlyArray(yield* Stream.runCollect(orchestrator.run(request({ stages: 1 }))))
      assert.deepStrictEqual(tokensOf(updates), expected)
      const traffic = tokenTraffic(sent)
      assert.strictEqual(traffic.loop.length, 0)
      assert.strictEqual(traffic.tokenIn.length, 12)
      assert.isTrue(reports.every((r) => r._tag !== "StageReady" || r.tokenLoop === undefined))
    }).pipe(Effect.scoped)
  )
})
