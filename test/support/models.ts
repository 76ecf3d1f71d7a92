import type * as StageExecutorTest from "../../src/layers/engine/StageExecutorTest.js"
import { existsSync } from "node:fs"
import { dirname, join, resolve } from "node:path"
import { fileURLToPath } from "node:url"

/** Repository root (this file is test/support/models.ts). */
export const repoRoot = resolve(dirname(fileURLToPath(import.meta.url)), "..", "..")

/** Where test models live: SWACTOR_MODELS_DIR, default ../shared/models relative to the repository root. */
export const modelsDir = (): string =>
  resolve(repoRoot, process.env["SWACTOR_MODELS_DIR"] ?? join("..", "shared", "models"))

/** Absolute path of a test model, or an error that says where it was looked for. */
export const requireModel = (name: string): string => {
  const path = join(modelsDir(), name)
  if (!existsSync(path)) {
    throw new Error(
      `test model ${name} not found at ${path} (set SWACTOR_MODELS_DIR to the folder that holds it; ` +
        `default is ../shared/models relative to ${repoRoot})`
    )
  }
  return path
}

/**
 * The deterministic test engine's model with stories260K's facts (5 blocks, hidden 64, EOS 2, BOS 1), for runs that
 * plan on the real file's facts but compute with the double.
 */
export const storiesTestModel: StageExecutorTest.TestModel = {
  numLayers: 5,
  hiddenDim: 64,
  vocabSize: 512,
  contextLength: 2048,
  eosTokenId: 2,
  bosTokenId: 1
}
