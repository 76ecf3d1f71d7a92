/**
 * Kimi K3 (issue 40): kimi-k3 as llama.cpp's converter writes it (test/support/convertedModels.py, gguf-py): KDA blocks
 * with an MLA block every 4th, a dense leading block, the latent MoE, situ, the MLA output gate, and the attention
 * residuals banked every 3 blocks (blocks 0, 3 and 6). The oracle is node-llama-cpp's greedy tokens at 1, 2 and 3
 * stages; what crosses a stage boundary is the residual stream plus every checkpoint banked before it.
 */
import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import { join } from "node:path"
import { activationWidth } from "../../src/layers/engine/PerLayerInputs.js"
import { readModelHParams } from "../../src/layers/engine/StageLayout.js"
import { readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { readModelFacts, readModelLayout } from "../../src/layers/gguf/ModelCatalogLive.js"
import { activationFrameBytes } from "../../src/services/Planner.js"
import { writeConverted } from "../support/convertedModels.js"
import { nodeLlamaReference, splitsMatchReference } from "../support/engine.js"
import { modelFolder, REFERENCE_OPTIONS, STORY_PROMPT } from "../support/synthFiles.js"

const dir = modelFolder("swactor-engine-kimi-k3-")
const N_TOKENS = 16

describe("kimi-k3 (gguf-py file): node-llama-cpp's greedy tokens at 1, 2 and 3 stages", () => {
  it.effect(
    "KDA and MLA blocks, attention residuals, latent MoE with situ: splits around the checkpoint blocks",
    () =>
      Effect.gen(function* () {
        const path = writeConverted("kimi-k3", join(dir, "kimi-k3.gguf"), 7)
        const ref = yield* nodeLlamaReference(path, STORY_PROMPT, N_TOKENS, REFERENCE_OPTIONS)
        assert.isAbove(new Set(ref.tokens).size, 2, "the reference is not one repeated token")
        yield* splitsMatchReference(
          path,
          ref,
          [
            [0, 8],
            // right after the dense leading block (1 checkpoint crosses), on either side of checkpoint block 3
            // (1 and 2 checkpoints cross), after the last checkpoint block (3 cross)
            [0, 1, 8],
            [0, 3, 8],
            [0, 4, 8],
            [0, 7, 8],
            [0, 1, 4, 8],
            [0, 3, 4, 8],
            [0, 2, 6, 8]
          ],
          REFERENCE_OPTIONS
        )
      }),
    240_000
  )

  it.effect(
    "what crosses a stage boundary is n_embd x (1 + checkpoints banked before it): frames, planner, layout",
    () =>
      Effect.gen(function* () {
        const path = writeConverted("kimi-k3", join(dir, "kimi-k3-layout.gguf"), 7)
        const { hp } = yield* readModelHParams(yield* readGgufFile(path))
        // blocks 0, 3 and 6 bank: 1 checkpoint before blocks 1-3, 2 before 4-6, 3 before 7
        assert.deepStrictEqual(
          [1, 2, 3, 4, 5, 6, 7].map((layer) => activationWidth(hp, layer)),
          [2, 2, 2, 3, 3, 3, 4].map((streams) => 64 * streams)
        )
        // the planner's frame holds the widest boundary's rows
        const facts = yield* readModelFacts(path)
        assert.strictEqual(facts.hiddenDim, 64 * 4)
        assert.strictEqual(activationFrameBytes(facts, 64), 64 * 4 * 4)
        assert.strictEqual((yield* readModelLayout(path)).hiddenDim, 64 * 4)
      })
  )
})
