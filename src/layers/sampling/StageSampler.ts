/**
 * The last stage's sampler for one run: the policy checked against the model (samplingPolicyProblem), the vocabulary
 * loaded vocab-only from the file the stage loaded (a whole model or its slice) when the grammar or DRY need it, and
 * the sequence's chain, freed with the scope. Any problem is one line for a ProvisionFailed fault: the run is refused
 * before its first token, and the stage's process lives on.
 */
import { Effect, type Scope } from "effect"
import type { SamplingPolicy } from "../../domain/plan.js"
import { samplingPolicyProblem } from "../../services/RequestChecks.js"
import { makeSequenceSampler, needsVocab, type SequenceSampler } from "./ChainSampler.js"
import { loadVocab } from "./LlamaLib.js"

export const openStageSampler = (
  policy: SamplingPolicy,
  path: string,
  vocabSize: number,
  contextLength: number
): Effect.Effect<SequenceSampler, string, Scope.Scope> =>
  Effect.acquireRelease(
    Effect.suspend(() => {
      const problem = samplingPolicyProblem(policy, vocabSize)
      if (problem !== undefined) return Effect.fail(`sampling: ${problem}`)
      return Effect.try({
        try: () => {
          const vocab = needsVocab(policy) ? loadVocab(path) : undefined
          if (vocab !== undefined && vocab.nTokens !== vocabSize) {
            throw new Error(`the vocabulary of ${path} has ${vocab.nTokens} tokens, the model's output ${vocabSize}`)
          }
          return makeSequenceSampler(policy, { vocabSize, contextLength, ...(vocab === undefined ? {} : { vocab }) })
        },
        catch: (e) => `sampling: ${e instanceof Error ? e.message : String(e)}`
      })
    }),
    (sampler) => Effect.sync(() => sampler.free())
  )
