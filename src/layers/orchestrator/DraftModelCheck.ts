/**
 * A `draft` run's draft model (SpeculativeOptions.draftModel) checked before any stage hears of it: a GGUF file the
 * orchestrator can read, whose vocabulary is the target's token for token (services/Speculation.ts
 * draftVocabularyProblem). Each refusal is an InvalidRequest of one line. Stage 0's node then loads it whole: its block
 * count goes with the options (draftBlocks) into stage 0's provision (StageHosting.ts).
 */
import { Effect } from "effect"
import type { GgufFile, ModelLoadError } from "../../domain/gguf.js"
import { ModelCatalog } from "../../services/ModelCatalog.js"
import { InvalidRequest } from "../../services/Orchestrator.js"
import { draftVocabularyProblem, type SpeculativeOptions } from "../../services/Speculation.js"
import * as Gguf from "../gguf/GgufReader.js"

const firstLine = (text: string) => text.split("\n", 1)[0] ?? ""

/** A file's token strings (tokenizer.ggml.tokens), undefined when it names none. */
const tokensOf = (file: GgufFile) =>
  Effect.orElseSucceed(Gguf.getOptional(file, "tokenizer.ggml.tokens", Gguf.getStringArray), () => undefined)

/**
 * The speculative options with the draft model checked and its block count set (`draft` only; others as given).
 * `model`: the target model's file.
 */
export const checkedDraft = (
  model: string,
  options: SpeculativeOptions | undefined
): Effect.Effect<SpeculativeOptions | undefined, InvalidRequest, ModelCatalog> =>
  Effect.gen(function* () {
    if (options?.mode !== "draft" || options.draftModel === undefined) return options
    const catalog = yield* ModelCatalog
    const path = options.draftModel
    const unreadable = (which: string, file: string) => (error: ModelLoadError) =>
      new InvalidRequest({ message: `speculative draft: cannot read ${which} ${file}: ${firstLine(error.message)}` })
    const draft = yield* catalog.header(path).pipe(Effect.mapError(unreadable("the draft model", path)))
    const facts = yield* catalog.facts(path).pipe(Effect.mapError(unreadable("the draft model", path)))
    const target = yield* catalog.header(model).pipe(Effect.mapError(unreadable("the model", model)))
    const problem = draftVocabularyProblem(yield* tokensOf(target), yield* tokensOf(draft))
    if (problem !== undefined) return yield* new InvalidRequest({ message: `${problem}: ${path}` })
    return { ...options, draftBlocks: facts.numLayers }
  })
