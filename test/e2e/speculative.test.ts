/**
 * Speculative decoding through the pipeline (RunRequest.speculative): the text with drafts is the text without them.
 * stories260K on real agent processes (Unix sockets, shared-memory rings), threads 1, the token loop on (2+ stages):
 * - greedy, prompt lookup, 1 to 4 stages: node-llama-cpp's tokens, with drafts both kept and not kept;
 * - a seeded sampled run: the same text with and without drafts (the sampler sees the same rows, makes the same draws);
 * - every draft kept (the prediction is the output) and none kept (every predicted token off by one): the same text,
 *   and the summary says so. Each is red with the rollback removed (stage 0 starting its next step after the rows
 *   not kept: `startPos: position - rolledBack` in SpeculativeStep.ts).
 * - a draft model (stories260K drafting for itself) at 1 to 3 stages, greedy and seeded: the same text, nearly every
 *   draft kept; a draft model of another vocabulary, or none at the path, refused before the run in one line.
 */
import { assert, describe, it } from "@effect/vitest"
import { Chunk, Effect, Schedule, Stream } from "effect"
import { join } from "node:path"
import { layerRemote, run } from "../../src/api/generate.js"
import * as AgentControlRpc from "../../src/layers/agent/AgentControlRpc.js"
import { generateToken, spawnLocalAgents } from "../../src/layers/agent/AgentProcesses.js"
import { NodeId } from "../../src/domain/ids.js"
import { AgentControl } from "../../src/services/AgentLinks.js"
import { writeSyntheticModel } from "../../src/layers/gguf/Synthetic.js"
import type { GenerateRequest, RunSummary } from "../../src/services/Orchestrator.js"
import { referenceRun } from "../support/engine.js"
import { requireModel } from "../support/models.js"
import { modelFolder } from "../support/synthFiles.js"

// a prompt that repeats itself: prompt lookup finds drafts, some of which the model does not follow
const prompt = "Once upon a time, there was a little girl. Once upon a time, there was a little"
const maxTokens = 80
const dir = modelFolder("swactor-speculative-draft-")

interface Generated {
  readonly tokens: ReadonlyArray<number>
  readonly text: string
  readonly summary: RunSummary
}

const generate = (agents: ReadonlyArray<string>, token: string, request: Omit<GenerateRequest, "model">) =>
  Effect.gen(function* () {
    const model = requireModel("stories260K.gguf")
    const updates = Chunk.toReadonlyArray(
      yield* Stream.runCollect(run({ model, threads: 1, maxTokens, ...request })).pipe(
        Effect.provide(layerRemote({ agents, token, listenHost: "127.0.0.1" }))
      )
    )
    const finished = updates.find((u) => u._tag === "Finished")
    if (finished?._tag !== "Finished") return assert.fail("the run did not finish")
    return {
      tokens: updates.flatMap((u) => (u._tag === "Token" && u.token.tokenId >= 0 ? [u.token.tokenId] : [])),
      text: finished.summary.text,
      summary: finished.summary
    } satisfies Generated
  })

const withAgents = <A, E>(count: number, f: (agents: ReadonlyArray<string>, token: string) => Effect.Effect<A, E>) =>
  Effect.gen(function* () {
    const token = generateToken()
    const agents = yield* spawnLocalAgents({ count, token, threads: 1 })
    return yield* f(
      agents.map((a) => a.address),
      token
    ).pipe(
      // a run that fails: what each agent wrote last (a crash's words are there)
      Effect.tapErrorCause(() =>
        Effect.sync(() => {
          for (const a of agents) console.error(`agent ${a.address} pid ${a.pid}:\n${a.stderrTail()}`)
        })
      )
    )
  }).pipe(Effect.scoped)

/** A recovery in a run whose agents nobody killed: say which (its reason names the agent), without failing the text. */
const reportGone = (...runs: ReadonlyArray<Generated>) =>
  Effect.sync(() => {
    for (const r of runs)
      for (const rec of r.summary.recoveries) console.error(`a run recovered (attempt ${rec.attempt}): ${rec.reason}`)
  })

const reference = Effect.promise(() =>
  referenceRun(requireModel("stories260K.gguf"), prompt, maxTokens, { threads: 1, contextLength: 256 })
)

describe("speculative decoding through the pipeline: the same text as without drafts", () => {
  // Each stage count on agents of its own, one more than its stages: in one clean-clone CI run an agent of a single
  // set of 4, used for all 8 runs, was found gone at a run's start ('cannot connect ... ECONNREFUSED'; why is not known:
  // the runs before it passed, so a recovery onto a spare may have hidden its death; a recovery is now printed). Not reproduced in 5 runs beside 2 busy loops; an agent that fails now
  // prints what it wrote last (withAgents).
  for (const stages of [1, 2, 3, 4]) {
    it.live(
      `greedy, prompt lookup, ${stages} stage(s): node-llama-cpp's tokens, drafts kept and not kept`,
      () =>
        withAgents(stages + 1, (agents, token) =>
          Effect.gen(function* () {
            const expected = [...(yield* reference).tokens]
            const off = yield* generate(agents, token, { prompt, stages })
            const on = yield* generate(agents, token, { prompt, stages, speculative: { mode: "ngram", fixed: true } })
            assert.deepStrictEqual(off.tokens, expected, `${stages} stages without drafts`)
            assert.deepStrictEqual(on.tokens, expected, `${stages} stages with drafts`)
            const spec = on.summary.speculative
            assert.isDefined(spec)
            // the path under test was taken both ways: steps with drafts, some kept, some not
            assert.isAbove(spec!.steps, 0, `${stages} stages: steps that drafted`)
            assert.isAbove(spec!.accepted, 0, `${stages} stages: drafts kept`)
            assert.isAbove(spec!.drafted, spec!.accepted, `${stages} stages: drafts not kept`)
            assert.isUndefined(off.summary.speculative)
            yield* reportGone(off, on)
          })
        ),
      120_000
    )
  }

  it.live(
    "a seeded sampled run: the same text with and without drafts, at 2 stages",
    () =>
      withAgents(2, (agents, token) =>
        Effect.gen(function* () {
          const sampling = { temperature: 0.8, topK: 40, seed: 1234 }
          const off = yield* generate(agents, token, { prompt, stages: 2, sampling })
          const on = yield* generate(agents, token, {
            prompt,
            stages: 2,
            sampling,
            speculative: { mode: "ngram", fixed: true }
          })
          assert.deepStrictEqual(on.tokens, off.tokens)
          assert.isAbove(on.summary.speculative!.drafted, 0)
          // and reproducible: the same seed again gives it again
          const again = yield* generate(agents, token, {
            prompt,
            stages: 2,
            sampling,
            speculative: { mode: "ngram", fixed: true }
          })
          assert.deepStrictEqual(again.tokens, off.tokens)
        })
      ),
    120_000
  )

  it.live(
    "every draft kept, and none kept: the same text, at 3 stages",
    () =>
      withAgents(3, (agents, token) =>
        Effect.gen(function* () {
          const expected = [...(yield* reference).tokens]
          const all = yield* generate(agents, token, {
            prompt,
            stages: 3,
            speculative: { mode: "ngram", fixed: true, predicted: expected }
          })
          assert.deepStrictEqual(all.tokens, expected)
          const kept = all.summary.speculative!
          assert.isAbove(kept.drafted, maxTokens / 2)
          assert.strictEqual(kept.accepted, kept.drafted)
          // about maxTokens / 7 steps of 6 drafts each, not one step per token
          assert.isBelow(kept.steps, maxTokens / 4)
          const wrong = expected.map((t) => (t + 1) % 512)
          const none = yield* generate(agents, token, {
            prompt,
            stages: 3,
            speculative: { mode: "ngram", fixed: true, predicted: wrong }
          })
          assert.deepStrictEqual(none.tokens, expected)
          assert.isAbove(none.summary.speculative!.drafted, 0)
          assert.strictEqual(none.summary.speculative!.accepted, 0)
        })
      ),
    120_000
  )
})

/** The engine sessions each agent holds now (a run's stages and a draft model's), asked over its control link. */
const openSessions = (agents: ReadonlyArray<string>, token: string) =>
  Effect.gen(function* () {
    const control = yield* AgentControl
    return yield* Effect.forEach(agents, (address, i) =>
      Effect.scoped(
        Effect.flatMap(control.connect({ nodeId: NodeId.make(i + 1), address }, token), (link) => link.capacity)
      ).pipe(Effect.map((capacity) => capacity.openSessions?.sessions ?? -1))
    )
  }).pipe(Effect.provide(AgentControlRpc.layer))

describe("draft-model speculation (mode draft): a small model of the same vocabulary drafts on stage 0's node", () => {
  // stories260K drafts for itself: its greedy drafts are the target's greedy tokens, so nearly all are kept, and only
  // while the draft's cache follows the accepted tokens (fed the ones it has not seen, rewound after a refusal)
  const draft = () => ({ mode: "draft" as const, fixed: true, draftModel: requireModel("stories260K.gguf") })
  for (const stages of [1, 2, 3]) {
    it.live(
      `greedy, ${stages} stage(s): node-llama-cpp's tokens, nearly every draft kept`,
      () =>
        withAgents(stages + 1, (agents, token) =>
          Effect.gen(function* () {
            const expected = [...(yield* reference).tokens]
            const off = yield* generate(agents, token, { prompt, stages })
            const on = yield* generate(agents, token, { prompt, stages, speculative: draft() })
            assert.deepStrictEqual(off.tokens, expected, `${stages} stages without drafts`)
            assert.deepStrictEqual(on.tokens, expected, `${stages} stages with a draft model`)
            assert.strictEqual(on.text, off.text)
            const spec = on.summary.speculative
            assert.isDefined(spec)
            // about maxTokens / 7 steps of 6 drafts each
            assert.isAbove(spec!.drafted, maxTokens / 2, `${stages} stages: tokens drafted`)
            assert.isAtLeast(spec!.accepted / spec!.drafted, 0.9, `${stages} stages: drafts kept`)
            assert.isBelow(spec!.steps, maxTokens / 4, `${stages} stages: steps`)
            // nothing left allocated: the stages' and the draft's sessions are freed with the run (the weights stay
            // in the model cache for the next run, as a stage's do)
            const open = yield* openSessions(agents, token).pipe(
              Effect.filterOrFail((counts) => counts.every((n) => n === 0)),
              Effect.retry({ times: 20, schedule: Schedule.spaced("100 millis") }),
              Effect.orElse(() => openSessions(agents, token))
            )
            assert.deepStrictEqual(
              open,
              agents.map(() => 0),
              `${stages} stages: sessions left open`
            )
            yield* reportGone(off, on)
          })
        ),
      120_000
    )
  }

  it.live(
    "a seeded sampled run: the same text with and without a draft model, at 2 stages",
    () =>
      withAgents(2, (agents, token) =>
        Effect.gen(function* () {
          const sampling = { temperature: 0.8, topK: 40, seed: 1234 }
          const off = yield* generate(agents, token, { prompt, stages: 2, sampling })
          const on = yield* generate(agents, token, { prompt, stages: 2, sampling, speculative: draft() })
          assert.deepStrictEqual(on.tokens, off.tokens)
          assert.isAbove(on.summary.speculative!.drafted, 0)
        })
      ),
    120_000
  )

  it.live(
    "a draft model of another vocabulary is refused before the run, in one line",
    () =>
      withAgents(1, (agents, token) =>
        Effect.gen(function* () {
          // stories260K has 512 tokens: a synthetic model of 512 tokens names others, one of 600 has more
          for (const vocab of [512, 600]) {
            const path = join(dir, `other-vocab-${vocab}.gguf`)
            yield* writeSyntheticModel({
              path,
              arch: "llama",
              layers: 1,
              hidden: 64,
              ffn: 128,
              heads: 1,
              kvHeads: 1,
              vocab,
              contextLength: 256,
              type: "f32",
              seed: 5
            })
            const refused = yield* Effect.flip(
              generate(agents, token, { prompt, stages: 1, speculative: { mode: "draft", draftModel: path } })
            )
            assert.strictEqual(refused._tag, "InvalidRequest")
            const message = (refused as { readonly message: string }).message
            assert.match(message, /^speculative draft: the draft model's vocabulary differs from the model's/)
            assert.notInclude(message, "\n")
          }
          const missing = yield* Effect.flip(
            generate(agents, token, {
              prompt,
              stages: 1,
              speculative: { mode: "draft", draftModel: join(dir, "absent.gguf") }
            })
          )
          assert.match((missing as { readonly message: string }).message, /^speculative draft: cannot read the draft/)
        })
      ),
    120_000
  )
})
