/**
 * olmo2 (OLMo 2 and OLMo 3, llama.cpp src/models/olmo2.cpp), on files llama.cpp's own gguf-py writes as its converter
 * (conversion/olmo.py Olmo2Model) does: no pre-norms, q/k norms over the whole projection, norms after attention and
 * after the feed-forward; OLMo 3's sliding-window blocks (window 16, three sliding and one global, the pattern written
 * as one bool per block) with plain RoPE. The oracle is node-llama-cpp's greedy tokens at every split into 1-3 stages,
 * generated past the window, and after a killed stage agent on 3 local agents.
 */
import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import { readFileSync } from "node:fs"
import { join } from "node:path"
import type { ModelLoadError } from "../../src/domain/gguf.js"
import { readModelHParams } from "../../src/layers/engine/StageLayout.js"
import { readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { writeGgufFile } from "../../src/layers/gguf/GgufWriter.js"
import { type ConvertedFamily, writeConverted } from "../support/convertedModels.js"
import { allSplits, greedyRun, nodeLlamaReference, splitsMatchReference } from "../support/engine.js"
import { killedStageResumes } from "../support/resume.js"
import { modelFolder, REFERENCE_OPTIONS, STORY_PROMPT } from "../support/synthFiles.js"

const dir = modelFolder("swactor-engine-olmo2-")
const N_TOKENS = 48

/** `path`'s file again at `out` with metadata `key` set to `value` (a bool array here). */
const withPattern = (path: string, out: string, pattern: ReadonlyArray<boolean>) =>
  Effect.gen(function* () {
    const file = yield* readGgufFile(path)
    const bytes = readFileSync(path)
    const key = "olmo2.attention.sliding_window_pattern"
    yield* writeGgufFile(out, {
      metadata: [...file.metadataTypes].map(
        ([k, kind]) => [k, { ...kind, value: k === key ? pattern : file.metadata.get(k)! }] as const
      ),
      alignment: file.alignment,
      tensors: file.tensors.map((t) => ({
        name: t.name,
        type: t.type,
        dims: t.dims,
        data: () => new Uint8Array(bytes.buffer, bytes.byteOffset + t.offset, t.byteSize)
      }))
    })
    return out
  })

describe("olmo2 as its converter writes it: node-llama-cpp's tokens at every split", () => {
  for (const [family, sliding] of [
    ["olmo2", undefined],
    ["olmo3", [true, true, true, false]]
  ] as const satisfies ReadonlyArray<readonly [ConvertedFamily, ReadonlyArray<boolean> | undefined]>) {
    it.effect(
      `${family}: ${N_TOKENS} greedy tokens of all 7 splits into 1-3 stages equal node-llama-cpp's`,
      () =>
        Effect.gen(function* () {
          const path = writeConverted(family, join(dir, `${family}.gguf`), 7)
          const { hp } = yield* readModelHParams(yield* readGgufFile(path))
          // the file is what the family is about: no pre-norms; OLMo 3's window read as llama.cpp reads it
          assert.isFalse((yield* readGgufFile(path)).tensorsByName.has("blk.0.attn_norm.weight"))
          assert.deepStrictEqual(hp.swa?.layers, sliding)
          if (sliding !== undefined) assert.strictEqual(hp.swa?.window, 16)
          const ref = yield* nodeLlamaReference(path, STORY_PROMPT, N_TOKENS, REFERENCE_OPTIONS)
          assert.isAbove(new Set(ref.tokens).size, 1, "the reference is not one repeated token")
          yield* splitsMatchReference(path, ref, allSplits(4, 3), REFERENCE_OPTIONS)
        }),
      240_000
    )
  }

  it.live(
    "olmo3 on 3 local agents: node-llama-cpp's tokens; the middle agent killed at token 12 resumes to the same tokens",
    () =>
      Effect.gen(function* () {
        const path = writeConverted("olmo3", join(dir, "olmo3-resume.gguf"), 11)
        const { reference } = yield* killedStageResumes(
          { model: path, prompt: "Once upon a time", maxTokens: 48, threads: 1, stages: 3 },
          { atToken: 12 }
        )
        const ref = yield* nodeLlamaReference(path, "Once upon a time", 48, REFERENCE_OPTIONS)
        assert.deepStrictEqual(reference.tokens, ref.tokens)
      }),
    240_000
  )

  it.effect("olmo3 with a per-block pattern llama.cpp would not follow: a ModelLoadError naming the key", () =>
    Effect.gen(function* () {
      const path = writeConverted("olmo3", join(dir, "olmo3-pattern.gguf"), 7)
      const out = yield* withPattern(path, join(dir, "olmo3-other-pattern.gguf"), [true, false, true, false])
      const error = (yield* Effect.flip(greedyRun(out, [0, 4], [1], 1, REFERENCE_OPTIONS))) as ModelLoadError
      assert.strictEqual(error.reason, "InvalidMetadata")
      assert.include(error.message, "olmo2.attention.sliding_window_pattern")
      // the same pattern as llama.cpp's period of 4 is accepted
      const same = yield* withPattern(path, join(dir, "olmo3-same-pattern.gguf"), [true, true, true, false])
      const tokens = yield* greedyRun(same, [0, 4], [1], 1, REFERENCE_OPTIONS)
      assert.strictEqual(tokens.tokens.length, 1)
    })
  )
})
