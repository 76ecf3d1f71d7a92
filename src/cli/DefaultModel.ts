/** The model `swactor run` uses when no --model is given: a small synthetic GGUF, written once to the user's cache. */
import { existsSync, mkdirSync, renameSync } from "node:fs"
import { join } from "node:path"
import { Console, Effect } from "effect"
import { Settings } from "../layers/config/Settings.js"
import { writeSyntheticModel } from "../layers/gguf/Synthetic.js"

/** The small model `swactor run` uses when no --model is given: written once with the synthetic GGUF writer. */
export const defaultSyntheticModel = Effect.gen(function* () {
  const dir = (yield* Settings).cacheDir
  const path = join(dir, "synthetic-llama-4x256-q8_0-v1.gguf")
  if (existsSync(path)) {
    yield* Console.error(
      `swactor run: no --model given; using the cached synthetic model ${path} (random weights: the text is noise)`
    )
    return path
  }
  mkdirSync(dir, { recursive: true })
  yield* Console.error(
    `swactor run: no --model given; writing a small synthetic llama model (random weights) to ${path} ...`
  )
  // Written under a temporary name and renamed, so an interrupted write never looks cached.
  const partial = `${path}.partial-${process.pid}`
  yield* writeSyntheticModel({
    path: partial,
    arch: "llama",
    layers: 4,
    hidden: 256,
    ffn: 768,
    heads: 4,
    kvHeads: 4,
    vocab: 512,
    contextLength: 1024,
    type: "q8_0",
    seed: 1
  })
  renameSync(partial, path)
  return path
})
