/**
 * The blocks a model decodes with: `<arch>.block_count` less the multi-token-prediction (MTP, "NextN") blocks that
 * `<arch>.nextn_predict_layers` says trail the trunk (GLM-4.5/4.6 files carry one). llama.cpp counts the same
 * (llama_hparams::n_layer() = n_layer_all - n_layer_nextn) and never runs those blocks when decoding; planning,
 * placement and the weights a stage loads cover the trunk only.
 */
import { Effect } from "effect"
import { type GgufFile, ModelLoadError } from "../../domain/gguf.js"
import { getOptional, getU32 } from "./GgufReader.js"

export const trunkBlockCount = (file: GgufFile, arch: string): Effect.Effect<number, ModelLoadError> =>
  Effect.gen(function* () {
    const blocks = yield* getU32(file, `${arch}.block_count`)
    const key = `${arch}.nextn_predict_layers`
    const nextn = (yield* getOptional(file, key, getU32)) ?? 0
    if (nextn >= blocks) {
      return yield* new ModelLoadError({
        path: file.path,
        reason: "InvalidMetadata",
        message: `metadata "${key}" = ${nextn} leaves no trunk blocks of "${arch}.block_count" = ${blocks}`
      })
    }
    return blocks - nextn
  })
