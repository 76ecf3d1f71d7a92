/**
 * Kimi K3 (issue 40): kimi-k3 as llama.cpp's converter writes it (test/support/convertedModels.py, gguf-py): KDA blocks
 * with an MLA block every 4th, a dense leading block, the latent MoE, situ, the MLA output gate, and the attention
 * residuals banked every 3 blocks (blocks 0, 3 and 6). The oracle is node-llama-cpp's greedy tokens at 1, 2 and 3
 * stages; what crosses a stage boundary is the residual stream plus every checkpoint banked before it.
 */
import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import { join } from "node:path"
import { writeConverted } from "../support/convertedModels.js"
import { nodeLlamaReference, splitsMatchReference } from "../support/engine.js"
import { modelFolder, REFERENCE_OPTIONS, STORY_PROMPT } from "../support/synthFiles.js"

const dir = modelFolder("swactor-engine-kimi-k3-")
const N_TOKENS = 16

describe("kimi-k3 (gguf-py file): node-llama-cpp's greedy tokens at 1, 2 and 3 stages", () => {
  it.effect(
    "KDA and MLA blocks, attention residuals, latent MoE with situ: one stage",
    () =>
      Effect.gen(function* () {
        const path = writeConverted("kimi-k3", join(dir, "kimi-k3.gguf"), 7)
        const ref = yield* nodeLlamaReference(path, STORY_PROMPT, N_TOKENS, REFERENCE_OPTIONS)
        assert.isAbove(new Set(ref.tokens).size, 2, "the reference is not one repeated token")
        yield* splitsMatchReference(path, ref, [[0, 8]], REFERENCE_OPTIONS)
      }),
    240_000
  )
})
