/** Whether the model can serve what `swactor run` asks, checked before any agent starts. */
import { Effect } from "effect"
import * as TokenizerLive from "../layers/gguf/TokenizerLive.js"
import { contextProblem, fitsContext } from "../services/RequestChecks.js"
import { Tokenizer } from "../services/Tokenizer.js"
import { modelFactsOf, UsageError } from "./Flags.js"
import { checkStagesFit } from "./PipelineFlags.js"

/**
 * What the model allows, checked before any agent starts, from its metadata (the GGUF header; no weights): the
 * stages against its blocks, and prompt + max tokens against its context (services/RequestChecks.ts: the same rule
 * and words as `swactor serve` and the library), instead of ~100 agents started for a plan that cannot be, or a
 * ContextOverflow fault at the end of a long generation.
 */
export const checkModelFit = (model: string, prompt: string, maxTokens: number, stages: number | undefined) =>
  Effect.gen(function* () {
    const facts = yield* modelFactsOf(model)
    yield* checkStagesFit(stages, facts)
    // Every prompt token covers at least one byte of the text, plus BOS and a leading-space token at most: when that
    // bound fits, the (slow: node-llama-cpp) vocabulary load is left to the run itself.
    if (fitsContext(Buffer.byteLength(prompt, "utf8") + 4, maxTokens, facts.maxSeqLen)) return
    const tokenizer = yield* Effect.flatMap(Tokenizer, (t) => t.open(model))
    const problem = contextProblem(tokenizer.tokenize(prompt).length, maxTokens, facts.maxSeqLen, "--max-tokens")
    if (problem !== undefined) return yield* new UsageError({ message: problem })
  }).pipe(Effect.scoped, Effect.provide(TokenizerLive.layer))
