/**
 * The kill-and-resume harness of the engine tests' end-to-end cases: a generation on local agents (one child process
 * per stage, spares extra), one agent killed with SIGKILL when a given token arrives, compared with the same request
 * run uninterrupted.
 */
import { assert } from "@effect/vitest"
import { Effect, Either, Stream } from "effect"
import { layerLocal, run } from "../../src/api/generate.js"
import type { LocalAgent } from "../../src/layers/agent/AgentProcesses.js"
import type { GenerateRequest, RunSummary, RunUpdate } from "../../src/services/Orchestrator.js"

export interface KilledGeneration {
  readonly result: Either.Either<void, unknown>
  /** Generated token ids (sentinels below 0 left out). */
  readonly tokens: ReadonlyArray<number>
  readonly summary: RunSummary | undefined
  /** The blocks the killed agent hosted in the first planned run (undefined when nothing was killed). */
  readonly killedLayers: readonly [number, number] | undefined
}

/**
 * One generation on local agents (1 engine thread each). With `kill`, the agent at index `kill.agent` (stage i on
 * agent i; spares come after the stages) is killed with SIGKILL when token `kill.atToken` (its step number) comes
 * back.
 */
export const generateKilling = (
  request: GenerateRequest,
  kill?: { readonly atToken: number; readonly agent: number }
): Effect.Effect<KilledGeneration> =>
  Effect.gen(function* () {
    let agents: ReadonlyArray<LocalAgent> = []
    let killedLayers: readonly [number, number] | undefined
    const updates: Array<RunUpdate> = []
    const result = yield* run(request).pipe(
      Stream.provideLayer(layerLocal({ threads: 1, onStarted: (a) => (agents = a) })),
      Stream.runForEach((u) =>
        Effect.sync(() => {
          updates.push(u)
          if (kill !== undefined && killedLayers === undefined && u._tag === "Token" && u.token.step === kill.atToken) {
            const victim = agents[kill.agent]!
            const planned = updates.find((p) => p._tag === "Planned")
            const stage =
              planned?._tag === "Planned" ? planned.stages.find((s) => s.address === victim.address) : undefined
            killedLayers = stage?.layers ?? [-1, -1]
            process.kill(victim.pid, "SIGKILL")
          }
        })
      ),
      Effect.either
    )
    const tokens = updates.flatMap((u) => (u._tag === "Token" && u.token.tokenId >= 0 ? [u.token.tokenId] : []))
    const finished = updates.find((u) => u._tag === "Finished")
    return { result, tokens, summary: finished?._tag === "Finished" ? finished.summary : undefined, killedLayers }
  })

/**
 * `request` run uninterrupted (`maxTokens` tokens, a stream of at least 4 distinct ones), then again with one spare
 * and agent `agent` (default 1: the middle stage of 3) killed at token `atToken`: the second run recovers exactly once
 * and its tokens and text equal the first's.
 */
export const killedStageResumes = (
  request: GenerateRequest & { readonly maxTokens: number },
  { agent = 1, atToken }: { readonly atToken: number; readonly agent?: number }
) =>
  Effect.gen(function* () {
    const reference = yield* generateKilling(request)
    assert.isTrue(Either.isRight(reference.result), JSON.stringify(reference.result))
    assert.strictEqual(reference.tokens.length, request.maxTokens)
    assert.isAtLeast(new Set(reference.tokens).size, 4, "the stream is not trivial")
    const outcome = yield* generateKilling({ ...request, spares: 1 }, { atToken, agent })
    assert.isTrue(Either.isRight(outcome.result), JSON.stringify(outcome.result))
    assert.isDefined(outcome.killedLayers, `token ${atToken} came back and agent ${agent} was killed`)
    assert.strictEqual(outcome.summary!.recoveries.length, 1)
    assert.deepStrictEqual(outcome.tokens, reference.tokens)
    assert.strictEqual(outcome.summary!.text, reference.summary!.text)
    return { reference, outcome, killedLayers: outcome.killedLayers! }
  })
