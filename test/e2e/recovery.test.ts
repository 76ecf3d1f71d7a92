import { assert, describe, it } from "@effect/vitest"
import { readdirSync } from "node:fs"
import { Context, Effect, Either, Layer, Stream } from "effect"
import { layerLocal, run } from "../../src/api/generate.js"
import type { LocalAgent } from "../../src/layers/agent/AgentProcesses.js"
import { type GenerateRequest, Orchestrator, type RunSummary, type RunUpdate } from "../../src/services/Orchestrator.js"
import { choosePlacement } from "../../src/services/Placement.js"
import { readModelLayout } from "../../src/layers/gguf/ModelCatalogLive.js"
import { absorbPlacement } from "../../src/layers/orchestrator/Recovery.js"
import { childPids, eventually, isAlive, startAgents } from "../support/e2e.js"
import { requireModel } from "../support/models.js"

const request = (patch: Partial<GenerateRequest> = {}): GenerateRequest => ({
  model: requireModel("stories260K.gguf"),
  prompt: "Once upon a time",
  maxTokens: 160,
  threads: 1,
  ...patch
})

const seeded = { temperature: 0.9, topK: 40, seed: 1234 }

interface Outcome {
  readonly updates: ReadonlyArray<RunUpdate>
  readonly result: Either.Either<void, { readonly _tag: string; readonly message?: string }>
  readonly agents: ReadonlyArray<LocalAgent>
  readonly tokens: ReadonlyArray<number>
  readonly steps: ReadonlyArray<number>
  readonly text: string
  readonly summary: RunSummary | undefined
  readonly millis: number
}

/** One generation on local agents; `act` sees every update (and the agents) as it arrives. */
const generate = (
  req: GenerateRequest,
  act: (update: RunUpdate, agents: ReadonlyArray<LocalAgent>) => void = () => {}
) =>
  Effect.gen(function* () {
    let agents: ReadonlyArray<LocalAgent> = []
    const updates: Array<RunUpdate> = []
    const started = Date.now()
    const result = yield* run(req).pipe(
      Stream.provideLayer(layerLocal({ threads: 1, onStarted: (a) => (agents = a) })),
      Stream.runForEach((update) =>
        Effect.sync(() => {
          updates.push(update)
          act(update, agents)
        })
      ),
      Effect.either
    )
    const tokenUpdates = updates.flatMap((u) => (u._tag === "Token" && u.token.tokenId >= 0 ? [u.token] : []))
    const finished = updates.find((u) => u._tag === "Finished")
    return {
      updates,
      result,
      agents,
      tokens: tokenUpdates.map((t) => t.tokenId),
      steps: tokenUpdates.map((t) => t.step),
      text: updates.flatMap((u) => (u._tag === "Token" ? [u.token.text] : [])).join(""),
      summary: finished?._tag === "Finished" ? finished.summary : undefined,
      millis: Date.now() - started
    } satisfies Outcome
  })

/** Kills `agentIndex` with SIGKILL when the token of `step` arrives (once). */
const killAt = (step: number, agentIndex: number) => {
  let done = false
  return (update: RunUpdate, agents: ReadonlyArray<LocalAgent>) => {
    if (!done && update._tag === "Token" && update.token.step === step) {
      done = true
      process.kill(agents[agentIndex]!.pid, "SIGKILL")
    }
  }
}

/** Nothing left behind: agents gone, no shared-memory ring in /dev/shm. */
const assertNothingLeft = (outcome: Outcome) =>
  Effect.gen(function* () {
    const pids = outcome.agents.map((a) => a.pid)
    assert.isTrue(yield* eventually(() => pids.every((pid) => !isAlive(pid))))
    assert.deepStrictEqual(
      childPids(process.pid).filter((pid) => pids.includes(pid)),
      []
    )
    assert.deepStrictEqual(
      readdirSync("/dev/shm").filter((name) => name.startsWith("swactor-")),
      []
    )
  })

/** The stream is one: steps 0..n-1, each once. */
const assertOneStream = (outcome: Outcome) =>
  assert.deepStrictEqual(
    outcome.steps,
    outcome.tokens.map((_, i) => i)
  )

describe("end to end recovery: a generation survives a killed stage agent", () => {
  for (const [name, sampling] of [
    ["greedy", undefined],
    ["seeded-sampled", seeded]
  ] as const) {
    // 3 stages + 1 spare; the middle stage's agent is killed with SIGKILL mid-generation: the spare takes its
    // stage, the prompt and the tokens so far are replayed, and the stream goes on to the same output as an
    // uninterrupted run's, with one recovery in the summary and nothing left behind.
    it.live(
      `kill -9 of a stage agent with a spare: the ${name} output equals the uninterrupted run's`,
      () =>
        Effect.gen(function* () {
          const reference = yield* generate(request({ stages: 3, ...(sampling ? { sampling } : {}) }))
          assert.isTrue(Either.isRight(reference.result))
          assert.strictEqual(reference.tokens.length, 160)

          const outcome = yield* generate(
            request({ stages: 3, spares: 1, ...(sampling ? { sampling } : {}) }),
            killAt(40, 1)
          )
          assert.isTrue(Either.isRight(outcome.result), JSON.stringify(outcome.result))
          assert.deepStrictEqual(outcome.tokens, reference.tokens)
          assert.strictEqual(outcome.text, reference.text)
          assertOneStream(outcome)
          const summary = outcome.summary!
          assert.strictEqual(summary.generatedTokens, 160)
          assert.strictEqual(summary.text, reference.text)
          assert.strictEqual(summary.recoveries.length, 1)
          // It resumes right after the last token delivered before the fault: token 40 was (the kill waited for it),
          // and a token already on its way when the kill landed may have been too (stories260K decodes in ~1 ms).
          const recovering = outcome.updates.findIndex((u) => u._tag === "Recovering")
          const delivered = outcome.updates.slice(0, recovering).filter((u) => u._tag === "Token").length
          assert.isAtLeast(delivered, 41)
          assert.strictEqual(summary.recoveries[0]!.resumedAt, delivered)
          // The spare (the fourth agent) hosts the lost stage; the survivors keep theirs.
          assert.deepStrictEqual(
            summary.recoveries[0]!.stages.map((s) => s.address),
            [outcome.agents[0]!.address, outcome.agents[3]!.address, outcome.agents[2]!.address]
          )
          const tags = outcome.updates.map((u) => u._tag)
          assert.strictEqual(tags.filter((t) => t === "Recovering").length, 1)
          assert.strictEqual(tags.filter((t) => t === "Recovered").length, 1)
          assert.isBelow(tags.indexOf("Recovering"), tags.indexOf("Recovered"))
          yield* assertNothingLeft(outcome)
        }),
      180_000
    )
  }

  // Speculative decoding (RunRequest.speculative) with a prediction equal to the output: every step is a verification
  // of 6 drafts through the 3 stages, so the kill lands in one; the replay resumes after the tokens delivered and the
  // text is the uninterrupted run's.
  it.live(
    "kill -9 of a stage agent mid-verification (speculative decoding): the greedy output equals the uninterrupted run's",
    () =>
      Effect.gen(function* () {
        const reference = yield* generate(request({ stages: 3 }))
        assert.isTrue(Either.isRight(reference.result))
        const speculative = { mode: "ngram" as const, fixed: true, predicted: reference.tokens }
        const outcome = yield* generate(request({ stages: 3, spares: 1, speculative }), killAt(40, 1))
        assert.isTrue(Either.isRight(outcome.result), JSON.stringify(outcome.result))
        assert.deepStrictEqual(outcome.tokens, reference.tokens)
        assertOneStream(outcome)
        const summary = outcome.summary!
        assert.strictEqual(summary.recoveries.length, 1)
        // the resumed run drafted too (its prediction is off by the tokens replayed: it keeps fewer)
        assert.isAbove(summary.speculative!.drafted, 0)
        yield* assertNothingLeft(outcome)
      }),
    180_000
  )

  // No spare: the two survivors absorb the lost stage's layers in a 2-stage pipeline; same greedy output.
  it.live(
    "kill -9 of a stage agent without a spare: the survivors absorb its layers, same output",
    () =>
      Effect.gen(function* () {
        const reference = yield* generate(request({ stages: 3 }))
        const outcome = yield* generate(request({ stages: 3 }), killAt(30, 2))
        assert.isTrue(Either.isRight(outcome.result), JSON.stringify(outcome.result))
        assert.deepStrictEqual(outcome.tokens, reference.tokens)
        assertOneStream(outcome)
        assert.strictEqual(outcome.summary!.recoveries.length, 1)
        assert.deepStrictEqual(
          outcome.summary!.recoveries[0]!.stages.map((s) => s.address),
          [outcome.agents[0]!.address, outcome.agents[1]!.address]
        )
        assert.strictEqual(outcome.summary!.stages.length, 2)
        yield* assertNothingLeft(outcome)
      }),
    180_000
  )

  // No spare, and the survivors' declared memory (`--memory-limit`) holds their own third of the model but not the
  // lost one's blocks on top: the generation faults at once with RecoveryOverMemory naming the memory figures and
  // the run's fault; no new run is planned (nothing is tried that could not load).
  it.live(
    "kill -9 without a spare, survivors too small for the lost blocks: a typed fault naming the memory, no attempt",
    () =>
      Effect.gen(function* () {
        const model = requireModel("stories260K.gguf")
        const layout = yield* readModelLayout(model)
        // `swactor run` budgets KV for prompt + max tokens, padded to 256: 256 cells here.
        const unlimited = [1, 2, 3].map((id) => ({
          nodeId: id,
          freeMemoryBytes: Number.MAX_SAFE_INTEGER,
          speedBytesPerSecond: 1e9
        }))
        const three = choosePlacement({ _tag: "Balanced", stageCount: 3 }, layout, unlimited as never, {
          contextTokens: 256
        })
        assert.isTrue(Either.isRight(three))
        const limit = Math.max(...Either.getOrThrow(three).stages.map((s) => s.memoryBytes)) + 1024
        // Precondition: two nodes with this limit cannot hold the model.
        const two = unlimited.slice(0, 2).map((n) => ({ ...n, freeMemoryBytes: limit, address: "x" }))
        assert.isTrue(Either.isLeft(absorbPlacement(layout, two as never, 256)))

        const { agents, layer } = yield* startAgents(3, { extraArgs: () => ["--memory-limit", String(limit)] })
        const orchestrator = yield* Layer.build(layer).pipe(Effect.map(Context.get(Orchestrator)))
        const updates: Array<RunUpdate> = []
        let killed = false
        const started = Date.now()
        const result = yield* orchestrator.run(request({ model, stages: 3 })).pipe(
          Stream.runForEach((update) =>
            Effect.sync(() => {
              updates.push(update)
              if (!killed && update._tag === "Token" && update.token.step === 30) {
                killed = true
                process.kill(agents[1]!.pid, "SIGKILL")
              }
            })
          ),
          Effect.either
        )
        assert.isTrue(Either.isLeft(result), "the generation must fault")
        const error = (result as Either.Left<{ _tag: string; message: string }, void>).left
        assert.strictEqual(error._tag, "RecoveryOverMemory", error.message)
        assert.match(
          error.message,
          /^cannot recover: the 2 node\(s\) left lack the memory for the lost blocks: blocks \[0, 3\) on /
        )
        assert.match(
          error.message,
          /need \d+\.\d MiB \(weights \+ KV cache \+ compute buffers\) and it has \d+\.\d MiB free/
        )
        assert.match(error.message, /\(after run 1: /)
        const fault = error as unknown as {
          survivors: ReadonlyArray<{ address: string; requiredBytes: number; freeBytes: number }>
        }
        assert.deepStrictEqual(
          fault.survivors.map((s) => s.address),
          [agents[0]!.address, agents[2]!.address]
        )
        assert.isTrue(fault.survivors.some((s) => s.requiredBytes > s.freeBytes))
        assert.isTrue(fault.survivors.every((s) => s.freeBytes === limit))
        // One recovery considered, no run planned after it.
        const tags = updates.map((u) => u._tag)
        assert.strictEqual(tags.filter((t) => t === "Recovering").length, 1)
        assert.strictEqual(tags.filter((t) => t === "Planned").length, 1)
        assert.isBelow(Date.now() - started, 30_000)
      }).pipe(Effect.scoped),
    120_000
  )

  // A spare whose declared memory cannot hold the lost stage is not given it: the survivors absorb the blocks
  // (their memory holds them) and the generation goes on to the uninterrupted run's output.
  it.live(
    "kill -9 with a spare too small for the lost stage: the survivors absorb it instead, same output",
    () =>
      Effect.gen(function* () {
        const reference = yield* generate(request({ stages: 3, maxTokens: 60 }))
        const { agents, layer } = yield* startAgents(4, {
          extraArgs: (i) => (i === 3 ? ["--memory-limit", String(2 ** 20)] : [])
        })
        const orchestrator = yield* Layer.build(layer).pipe(Effect.map(Context.get(Orchestrator)))
        const updates: Array<RunUpdate> = []
        const kill = killAt(20, 1)
        const result = yield* orchestrator.run(request({ stages: 3, maxTokens: 60 })).pipe(
          Stream.runForEach((update) =>
            Effect.sync(() => {
              updates.push(update)
              kill(update, agents)
            })
          ),
          Effect.either
        )
        assert.isTrue(Either.isRight(result), JSON.stringify(result))
        const tokens = updates.flatMap((u) => (u._tag === "Token" && u.token.tokenId >= 0 ? [u.token.tokenId] : []))
        assert.deepStrictEqual(tokens, reference.tokens)
        const recovered = updates.find((u) => u._tag === "Recovered")
        assert.deepStrictEqual(recovered?._tag === "Recovered" ? recovered.recovery.stages.map((s) => s.address) : [], [
          agents[0]!.address,
          agents[2]!.address
        ])
      }).pipe(Effect.scoped),
    120_000
  )

  // A kill while the stages load (as soon as the run is planned): the spare takes the stage before any token.
  it.live(
    "kill -9 of a stage agent while loading: recovered before the first token, same output",
    () =>
      Effect.gen(function* () {
        const reference = yield* generate(request({ stages: 3 }))
        let killed = false
        const outcome = yield* generate(request({ stages: 3, spares: 1 }), (update, agents) => {
          if (!killed && update._tag === "Planned") {
            killed = true
            process.kill(agents[2]!.pid, "SIGKILL")
          }
        })
        assert.isTrue(Either.isRight(outcome.result), JSON.stringify(outcome.result))
        assert.deepStrictEqual(outcome.tokens, reference.tokens)
        assertOneStream(outcome)
        assert.strictEqual(outcome.summary!.recoveries.length, 1)
        assert.strictEqual(outcome.summary!.recoveries[0]!.resumedAt, 0)
        yield* assertNothingLeft(outcome)
      }),
    180_000
  )

  // One stage, no spare: nothing can host the model after the kill; the typed fault names the attempt.
  it.live(
    "kill -9 of the only agent: a typed fault naming the attempts, quickly",
    () =>
      Effect.gen(function* () {
        const outcome = yield* generate(request({ stages: 1 }), killAt(10, 0))
        assert.isTrue(Either.isLeft(outcome.result))
        const error = (outcome.result as Either.Left<{ _tag: string; message: string }, void>).left
        assert.strictEqual(error._tag, "RunFaulted")
        assert.match(error.message, /no node left to host the model after 1 recovery attempt: run 1: /)
        assert.isBelow(outcome.millis, 30_000)
        assert.strictEqual(outcome.updates.filter((u) => u._tag === "Recovering").length, 1)
        yield* assertNothingLeft(outcome)
      }),
    120_000
  )

  // A second kill while the first recovery replays (the spare dies as soon as the new run is planned on it):
  // the generation recovers again on the survivors (or faults within the budget), never hangs.
  it.live(
    "a kill during recovery: recovers again with the same output, or faults within the budget",
    () =>
      Effect.gen(function* () {
        const reference = yield* generate(request({ stages: 3 }))
        let recovering = false
        let secondKill = false
        const first = killAt(40, 1)
        const outcome = yield* generate(
          request({ stages: 3, spares: 1, recovery: { maxAttempts: 3, budget: "60 seconds" } }),
          (update, agents) => {
            first(update, agents)
            if (update._tag === "Recovering") recovering = true
            if (recovering && !secondKill && update._tag === "Planned") {
              secondKill = true
              process.kill(agents[3]!.pid, "SIGKILL")
            }
          }
        )
        assert.isTrue(secondKill)
        assert.isBelow(outcome.millis, 90_000)
        if (Either.isRight(outcome.result)) {
          assert.deepStrictEqual(outcome.tokens, reference.tokens)
          assertOneStream(outcome)
          assert.isAtLeast(outcome.updates.filter((u) => u._tag === "Recovering").length, 2)
          assert.deepStrictEqual(
            outcome.summary!.stages.map((s) => s.address),
            [outcome.agents[0]!.address, outcome.agents[2]!.address]
          )
        } else {
          assert.strictEqual(outcome.result.left._tag, "RunFaulted")
          assert.match(outcome.result.left.message ?? "", /run 1: .*run 2: /)
        }
        yield* assertNothingLeft(outcome)
      }),
    180_000
  )
})
