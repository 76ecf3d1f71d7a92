// llama.cpp's sampler chain on the last stage (specs/BEHAVIOR_GUARANTEES.md, "Sampling with llama.cpp's chain"):
// grammars constrain the text, a grammar that does not parse refuses the run in words while the agents live on, bad
// values never reach native code, a stage's GGUF slice keeps the vocabulary libllama loads, and a seeded, penalised,
// grammar-constrained generation resumed after its last stage's agent is killed gives the uninterrupted run's tokens.
import { assert, describe, it } from "@effect/vitest"
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { Effect, Either, Stream } from "effect"
import { layerLocal, run } from "../../src/api/generate.js"
import type { LocalAgent } from "../../src/layers/agent/AgentProcesses.js"
import { readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { writeGgufSlice } from "../../src/layers/gguf/GgufSlice.js"
import { makeSequenceSampler } from "../../src/layers/sampling/ChainSampler.js"
import { loadVocab } from "../../src/layers/sampling/LlamaLib.js"
import type { SamplingPolicy } from "../../src/domain/plan.js"
import { type GenerateRequest, type RunUpdate, type SamplingOptions } from "../../src/services/Orchestrator.js"
import { samplingPolicyProblem } from "../../src/services/RequestChecks.js"
import { isAlive, startAgents } from "../support/e2e.js"
import { requireModel } from "../support/models.js"

const request = (sampling: SamplingOptions, patch: Partial<GenerateRequest> = {}): GenerateRequest => ({
  model: requireModel("stories260K.gguf"),
  prompt: "Once upon a time",
  maxTokens: 40,
  threads: 1,
  stages: 2,
  sampling,
  ...patch
})

const collect = (stream: Stream.Stream<RunUpdate, unknown>, act: (u: RunUpdate) => void = () => {}) =>
  Effect.gen(function* () {
    const updates: Array<RunUpdate> = []
    const result = yield* stream.pipe(
      Stream.runForEach((u) => Effect.sync(() => (updates.push(u), act(u)))),
      Effect.either
    )
    const tokens = updates.flatMap((u) => (u._tag === "Token" && u.token.tokenId >= 0 ? [u.token.tokenId] : []))
    const text = updates.flatMap((u) => (u._tag === "Token" ? [u.token.text] : [])).join("")
    return { updates, result, tokens, text }
  })

const local = (
  sampling: SamplingOptions,
  patch: Partial<GenerateRequest> = {},
  onStarted?: (a: ReadonlyArray<LocalAgent>) => void,
  act?: (u: RunUpdate) => void
) =>
  collect(
    run(request(sampling, patch)).pipe(
      Stream.provideLayer(layerLocal({ threads: 1, ...(onStarted ? { onStarted } : {}) }))
    ),
    act
  )

describe("the sampler chain on the last stage", () => {
  it.live(
    "a grammar constrains the text: yes or no; a small JSON object that parses",
    () =>
      Effect.gen(function* () {
        for (const seed of [1, 2, 3]) {
          const out = yield* local({ temperature: 0.8, seed, grammar: { text: 'root ::= "yes" | "no"' } })
          assert.isTrue(Either.isRight(out.result), JSON.stringify(out.result))
          assert.include(["yes", "no"], out.text)
        }
        const json =
          'root ::= "{" ws "\\"name\\":" ws "\\"" [a-z]{1,12} "\\"" ws "," ws "\\"age\\":" ws [1-9] [0-9]? ws "}"\nws ::= " "?'
        const out = yield* local({ temperature: 0.9, seed: 4, grammar: { text: json } }, { maxTokens: 80 })
        assert.isTrue(Either.isRight(out.result), JSON.stringify(out.result))
        const parsed = JSON.parse(out.text) as { name: string; age: number }
        assert.match(parsed.name, /^[a-z]{1,12}$/)
        assert.isAtLeast(parsed.age, 1)
      }),
    120_000
  )

  it.live(
    "a grammar that does not parse refuses the run in words; the agents live on and serve the next run",
    () =>
      Effect.scoped(
        Effect.gen(function* () {
          const { agents, layer } = yield* startAgents(2)
          const bad = yield* collect(
            run(request({ temperature: 0.5, seed: 1, grammar: { text: 'root ::= ("a" | ' } })).pipe(
              Stream.provideLayer(layer)
            )
          )
          assert.isTrue(Either.isLeft(bad.result))
          const message = String((bad.result as Either.Left<{ message?: string }, void>).left.message)
          // Gbnf.ts (services) refuses it before llama.cpp's parser sees it, with where it goes wrong
          assert.match(message, /grammar: .* at line 1, column \d+/)
          assert.notInclude(message, "WorkerCrashed")
          assert.isTrue(agents.every((a) => isAlive(a.pid)))
          const good = yield* collect(
            run(request({ temperature: 0.5, seed: 1, grammar: { text: 'root ::= "yes" | "no"' } })).pipe(
              Stream.provideLayer(layer)
            )
          )
          assert.isTrue(Either.isRight(good.result), JSON.stringify(good.result))
          assert.include(["yes", "no"], good.text)
          assert.isTrue(agents.every((a) => isAlive(a.pid)))
        })
      ),
    120_000
  )

  it.live(
    "values native code would abort on are refused before any stage is provisioned, naming the field",
    () =>
      Effect.gen(function* () {
        const cases: ReadonlyArray<readonly [SamplingOptions, string]> = [
          [{ temperature: Number.NaN }, "temperature"],
          [{ temperature: 0.5, repeatPenalty: 0 }, "repeatPenalty"],
          [{ temperature: 0.5, logitBias: [{ tokenId: 512, bias: 1 }] }, "logitBias token 512"],
          [{ temperature: 0.5, logitBias: [{ tokenId: 3, bias: Number.POSITIVE_INFINITY }] }, "logitBias for token 3"],
          [{ temperature: 0.5, dry: { multiplier: 0.8, sequenceBreakers: ["a\u0000b"] } }, "dry.sequenceBreakers[0]"],
          [
            { temperature: 0.5, grammar: { text: `root ::= ${"(".repeat(500)}"a"${")".repeat(500)}` } },
            "grammar: groups nest deeper than 64"
          ],
          [{ temperature: 0.5, grammar: { text: 'root ::= "a"', root: "no such\nrule" } }, "grammar root"],
          [{ logprobs: 21 }, "logprobs"]
        ]
        for (const [sampling, words] of cases) {
          const out = yield* collect(run(request(sampling)).pipe(Stream.provideLayer(layerLocal({ threads: 1 }))))
          assert.isTrue(Either.isLeft(out.result), words)
          const left = (out.result as Either.Left<{ _tag: string; message: string }, void>).left
          assert.strictEqual(left._tag, "InvalidRequest", words)
          assert.include(left.message, words)
          // refused before planning: no stage was provisioned (local agents start early, while the model is read)
          assert.isFalse(
            out.updates.some((u) => u._tag === "Planned" || u._tag === "StageLoading"),
            words
          )
        }
      }),
    120_000
  )

  it("a stage's GGUF slice keeps the tokenizer metadata: libllama loads its vocabulary and builds a grammar on it", () => {
    const dir = mkdtempSync(join(tmpdir(), "swactor-slice-vocab-"))
    try {
      const model = requireModel("stories260K.gguf")
      const path = join(dir, "last.gguf")
      Effect.runSync(
        Effect.flatMap(readGgufFile(model), (file) =>
          writeGgufSlice(file, { layerStart: 3, layerEndExclusive: 5, numLayers: 5 }, path)
        )
      )
      const whole = loadVocab(model)
      const slice = loadVocab(path)
      assert.strictEqual(slice.nTokens, whole.nTokens)
      assert.strictEqual(slice.isEndOfGeneration(2), true)
      const policy: SamplingPolicy = {
        temperatureMillis: 800,
        topK: 40,
        seed: 1,
        grammar: { text: 'root ::= "yes" | "no"', root: "root" }
      }
      assert.isUndefined(samplingPolicyProblem(policy, slice.nTokens))
      const sampler = makeSequenceSampler(policy, { vocabSize: slice.nTokens, contextLength: 64, vocab: slice })
      const logits = Float32Array.from({ length: slice.nTokens }, (_, i) => Math.sin(i))
      const first = sampler.sample(logits)
      assert.isAtLeast(first.tokenId, 0)
      sampler.free()
    } finally {
      rmSync(dir, { recursive: true, force: true })
    }
  })

  // Runs in flight together share the stage batcher's micro-batches; each sequence keeps its own chain: its seeded,
  // penalised tokens and its log-probs are those of the same run alone.
  it.live(
    "batched sequences: each run's sampled tokens and log-probs equal its lone run's",
    () =>
      Effect.scoped(
        Effect.gen(function* () {
          const { layer } = yield* startAgents(2)
          const prompts = [
            "Once upon a time",
            "The little dog",
            "Lily and Ben went to the park",
            "One day, a big red ball"
          ]
          const once = (prompt: string, i: number) =>
            collect(
              run(
                request({ temperature: 0.8, seed: 10 + i, repeatPenalty: 1.2, logprobs: 3 }, { prompt, maxTokens: 24 })
              ).pipe(Stream.provideLayer(layer))
            ).pipe(
              Effect.map((out) => ({
                tokens: out.tokens,
                logprobs: out.updates.flatMap((u) =>
                  u._tag === "Token" && u.token.tokenId >= 0 ? [u.token.logprob] : []
                ),
                batched: out.updates.flatMap((u) =>
                  u._tag === "Finished" ? u.summary.stages.map((st) => st.maxBatchSequences) : []
                )
              }))
            )
          const alone = yield* Effect.forEach(prompts, once)
          const together = yield* Effect.forEach(prompts, once, { concurrency: "unbounded" })
          together.forEach((t, i) => {
            assert.deepStrictEqual(t.tokens, alone[i]!.tokens, prompts[i])
            assert.strictEqual(t.logprobs.length, t.tokens.length)
            t.logprobs.forEach((lp, k) => {
              assert.strictEqual(lp!.top.length, 3)
              const lone = alone[i]!.logprobs[k]!
              assert.closeTo(lp!.logprob, lone.logprob, 1e-4)
              assert.deepStrictEqual(
                lp!.top.map((x) => x.tokenId),
                lone.top.map((x) => x.tokenId)
              )
            })
          })
          assert.isAbove(Math.max(...together.flatMap((t) => t.batched)), 1)
        })
      ),
    180_000
  )

  // The last stage's agent (the sampler's host) is killed mid-generation; the spare rebuilds the sampler from the
  // tokens so far and the draws its generator made (more than one per token when the grammar rejected a pick).
  it.live(
    "a seeded, penalised, grammar-constrained generation resumed after its last stage is killed: the same tokens",
    () =>
      Effect.gen(function* () {
        const sampling: SamplingOptions = {
          temperature: 1,
          seed: 77,
          repeatPenalty: 1.3,
          presencePenalty: 0.2,
          frequencyPenalty: 0.2,
          grammar: { text: 'root ::= (" " [a-z]+ [.,]?)+' }
        }
        const patch = { stages: 2, maxTokens: 60 }
        const reference = yield* local(sampling, patch)
        assert.isTrue(Either.isRight(reference.result), JSON.stringify(reference.result))
        assert.isAtLeast(reference.tokens.length, 30)
        const draws = reference.updates.flatMap((u) =>
          u._tag === "Token" && u.samplerDraws !== undefined ? [u.samplerDraws] : []
        )
        // the grammar made the generator draw again at least once before the kill point
        assert.isAbove(draws[20]!, 21)

        let agents: ReadonlyArray<LocalAgent> = []
        let killed = false
        const resumed = yield* local(
          sampling,
          { ...patch, spares: 1 },
          (a) => (agents = a),
          (u) => {
            if (!killed && u._tag === "Token" && u.token.step === 20) {
              killed = true
              process.kill(agents[1]!.pid, "SIGKILL")
            }
          }
        )
        assert.isTrue(Either.isRight(resumed.result), JSON.stringify(resumed.result))
        assert.isTrue(resumed.updates.some((u) => u._tag === "Recovered"))
        assert.deepStrictEqual(resumed.tokens, reference.tokens)
        assert.strictEqual(resumed.text, reference.text)
      }),
    180_000
  )
})
