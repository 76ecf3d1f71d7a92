/**
 * Split GGUF sets (issue 38) through the engine: sets gguf-py wrote (test/support/convertedModels.py, the writer
 * llama.cpp's converter and llama-gguf-split use), named by their first part. The oracle is node-llama-cpp loading the
 * same set from its first part: every split gives its greedy tokens, each stage maps only the parts that hold its
 * tensors, and a run whose middle stage is killed resumes to the same tokens.
 */
import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import { readFileSync } from "node:fs"
import { join } from "node:path"
import { tensorFilePath } from "../../src/domain/gguf.js"
import { readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { sliceTensors } from "../../src/layers/gguf/GgufSlice.js"
import { layerWith } from "../../src/layers/engine/StageExecutorLive.js"
import { StageExecutor } from "../../src/services/StageExecutor.js"
import { writeConverted } from "../support/convertedModels.js"
import { allSplits, nodeLlamaReference, splitsMatchReference } from "../support/engine.js"
import { killedStageResumes } from "../support/resume.js"
import { modelFolder, REFERENCE_OPTIONS, STORY_PROMPT } from "../support/synthFiles.js"

const dir = modelFolder("swactor-engine-split-set-")
const N_TOKENS = 16

/** qwen3moe (4 routed blocks) in 3 parts: token_embd + blk.0, blk.1, then blk.2.. with the output. */
const qwen3moeSet = () =>
  writeConverted("qwen3moe", join(dir, "q3.gguf"), 2, {
    cuts: ["blk.1.attn_norm.weight", "blk.2.attn_norm.weight"]
  })

/** The files (parts) the process has mapped now, among `paths`. */
const mappedFiles = (paths: ReadonlyArray<string>): ReadonlySet<string> => {
  const maps = readFileSync("/proc/self/maps", "utf8").split("\n")
  return new Set(paths.filter((p) => maps.some((line) => line.endsWith(` ${p}`))))
}

describe("split GGUF sets (gguf-py): node-llama-cpp's greedy tokens at every split", () => {
  it.effect(
    "qwen3moe in 3 parts (a part per block boundary): every split of up to 3 stages",
    () =>
      Effect.gen(function* () {
        const parts = qwen3moeSet()
        assert.strictEqual(parts.length, 3)
        const file = yield* readGgufFile(parts[0]!)
        assert.deepStrictEqual(
          file.parts?.map((p) => p.path),
          parts,
          "the set is read from its first part"
        )
        const ref = yield* nodeLlamaReference(parts[0]!, STORY_PROMPT, N_TOKENS, REFERENCE_OPTIONS)
        assert.isAtLeast(new Set(ref.tokens).size, 4, "the reference is not trivial")
        const splits = allSplits(4, 3)
        assert.strictEqual(splits.length, 7)
        yield* splitsMatchReference(parts[0]!, ref, splits, REFERENCE_OPTIONS)
      }),
    240_000
  )

  it.effect(
    "llama as gguf-py cuts it (a metadata-only first part, at most 5 tensors a part): 1 and 3 stages",
    () =>
      Effect.gen(function* () {
        const parts = writeConverted("llama", join(dir, "llama.gguf"), 3, { smallFirst: true, maxTensors: 5 })
        assert.isAtLeast(parts.length, 4)
        const file = yield* readGgufFile(parts[0]!)
        assert.isFalse(
          file.tensors.some((t) => tensorFilePath(file, t) === parts[0]),
          "the first part holds no tensor"
        )
        const ref = yield* nodeLlamaReference(parts[0]!, STORY_PROMPT, N_TOKENS, REFERENCE_OPTIONS)
        assert.isAtLeast(new Set(ref.tokens).size, 4, "the reference is not trivial")
        yield* splitsMatchReference(
          parts[0]!,
          ref,
          [
            [0, 4],
            [0, 1, 3, 4]
          ],
          REFERENCE_OPTIONS
        )
      }),
    240_000
  )

  it.effect(
    "each stage maps exactly the parts that hold its tensors",
    () =>
      Effect.gen(function* () {
        const parts = qwen3moeSet()
        const file = yield* readGgufFile(parts[0]!)
        const numLayers = 4
        const stages: ReadonlyArray<readonly [number, number]> = [
          [0, 1],
          [1, 2],
          [2, 4],
          [0, 4],
          [1, 4]
        ]
        const seen = new Set<string>()
        for (const [layerStart, layerEndExclusive] of stages) {
          const expected = new Set(
            sliceTensors(file, { layerStart, layerEndExclusive, numLayers }).map((t) => tensorFilePath(file, t))
          )
          const mapped = yield* Effect.scoped(
            Effect.gen(function* () {
              const executor = yield* StageExecutor
              yield* executor.load({
                path: parts[0]!,
                layerStart,
                layerEndExclusive,
                isFirst: layerStart === 0,
                isLast: layerEndExclusive === numLayers
              })
              return mappedFiles(parts)
            })
          ).pipe(Effect.provide(layerWith({ mmap: true })))
          assert.deepStrictEqual([...mapped].sort(), [...expected].sort(), `blocks ${layerStart}..${layerEndExclusive}`)
          for (const p of mapped) seen.add(p)
          assert.strictEqual(mappedFiles(parts).size, 0, "the mappings go with the stage")
        }
        // the cases reach a stage of one part, of two, and of all three
        assert.strictEqual(seen.size, 3)
      }),
    240_000
  )
})

describe("split GGUF sets end to end", () => {
  it.live(
    "a run on 3 local agents named by the first part: node-llama-cpp's tokens; the middle agent killed at token 12, it resumes to the same tokens",
    () =>
      Effect.gen(function* () {
        const parts = qwen3moeSet()
        const { reference } = yield* killedStageResumes(
          { model: parts[0]!, prompt: "Once upon a time", maxTokens: 48, threads: 1, stages: 3 },
          { atToken: 12 }
        )
        const ref = yield* nodeLlamaReference(parts[0]!, "Once upon a time", 48, REFERENCE_OPTIONS)
        assert.deepStrictEqual(reference.tokens, ref.tokens)
      }),
    240_000
  )
})
