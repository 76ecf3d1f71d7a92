/**
 * Files as llama.cpp's converter writes them (issue 38, "metadata as the real converters write it"), written by
 * llama.cpp's own gguf-py (test/support/convertedModels.py), not by `swactor synth`: a mistake shared by swactor's
 * writer and its engine cannot hide here. The oracle is node-llama-cpp's greedy tokens, at 1 and 3 stages.
 *
 * glm4moe as GLM-4.5/4.6 convert: `rope.dimension_count` = half the head size (the checkpoint's
 * partial_rotary_factor 0.5: RoPE on the first half of each head, the rest passed through), head_dim apart from
 * hidden / heads (key_length), q/k/v biases, one leading dense block, sigmoid routing with the correction bias,
 * a shared expert, and one MTP block after the trunk.
 */
import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import { readFileSync } from "node:fs"
import { join } from "node:path"
import type { ModelLoadError } from "../../src/domain/gguf.js"
import { getU32, readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { writeGgufFile } from "../../src/layers/gguf/GgufWriter.js"
import { readModelFacts } from "../../src/layers/gguf/ModelCatalogLive.js"
import { writeConverted } from "../support/convertedModels.js"
import { killedStageResumes } from "../support/resume.js"
import { greedyRun, nodeLlamaReference, splitsMatchReference } from "../support/engine.js"
import { modelFolder, REFERENCE_OPTIONS, STORY_PROMPT } from "../support/synthFiles.js"

const dir = modelFolder("swactor-engine-converted-")
const N_TOKENS = 16

describe("converter-shaped files (gguf-py): node-llama-cpp's greedy tokens at 1 and 3 stages", () => {
  it.effect(
    "glm4moe with partial rotary (rope.dimension_count = head size / 2), biases, a dense block, an MTP block",
    () =>
      Effect.gen(function* () {
        const path = writeConverted("glm4moe", join(dir, "glm4moe.gguf"), 45)
        const file = yield* readGgufFile(path)
        // the file is what the converter writes: partial rotary, the MTP block counted in block_count
        assert.strictEqual(yield* getU32(file, "glm4moe.rope.dimension_count"), 16)
        assert.strictEqual(yield* getU32(file, "glm4moe.attention.key_length"), 32)
        assert.strictEqual(yield* getU32(file, "glm4moe.block_count"), 5)
        assert.strictEqual((yield* readModelFacts(path)).numLayers, 4)
        const ref = yield* nodeLlamaReference(path, STORY_PROMPT, N_TOKENS, REFERENCE_OPTIONS)
        assert.isAbove(new Set(ref.tokens).size, 1, "the reference is not one repeated token")
        yield* splitsMatchReference(
          path,
          ref,
          [
            [0, 4],
            [0, 1, 2, 4],
            [0, 1, 3, 4]
          ],
          REFERENCE_OPTIONS
        )
      }),
    240_000
  )

  // The families as their converters write the released checkpoints: Llama 3.2 (tied embeddings, llama3 RoPE
  // scaling as rope_freqs.weight), Qwen2.5 (q/k/v biases, tied, no rope.dimension_count), Qwen3 (head_dim twice
  // hidden / heads, q/k norms, tied), Qwen3-30B-A3B (every block routed, no expert_weights_norm key), Gemma 3
  // 4B (no sliding_window_pattern key: every 6th block global; linear RoPE scaling on the global blocks),
  // Ministral 3 (YaRN with the log multiplier, the attention temperature past the original context), DeepSeek-V3
  // (MLA as the converter splits kv_b_proj, v_head_dim apart, group-limited sigmoid routing, YaRN), gpt-oss (MXFP4
  // experts with biases, attention sinks, alternate sliding-window blocks, YaRN), Qwen3.5 (DeltaNet blocks, head_dim
  // 256 with a quarter rotated under the MRoPE sections the converter always writes, an MTP block) and its MoE, and Gemma 4 31B (per-block window
  // pattern and KV heads, K = V global block, proportional RoPE as rope_freqs, the layer scalar).
  const families = {
    llama: { blocks: 4, tied: true },
    qwen2: { blocks: 4, tied: true },
    qwen3: { blocks: 4, tied: true },
    qwen3moe: { blocks: 4, tied: false },
    gemma3: { blocks: 7, tied: true },
    gemma4: { blocks: 8, tied: true },
    "gemma4-moe": { blocks: 8, tied: true },
    "minimax-m2": { blocks: 4, tied: false },
    mistral3: { blocks: 4, tied: true },
    deepseek2: { blocks: 4, tied: false },
    "gpt-oss": { blocks: 4, tied: false },
    qwen35: { blocks: 4, tied: false },
    qwen35moe: { blocks: 4, tied: false }
  } as const
  for (const family of Object.keys(families) as ReadonlyArray<keyof typeof families>) {
    const { blocks, tied } = families[family]
    it.effect(
      `${family} as its converter writes the released checkpoints`,
      () =>
        Effect.gen(function* () {
          const path = writeConverted(family, join(dir, `${family}.gguf`), 7)
          const file = yield* readGgufFile(path)
          assert.strictEqual(file.tensorsByName.has("output.weight"), !tied, "tied embeddings: no output.weight")
          const ref = yield* nodeLlamaReference(path, STORY_PROMPT, N_TOKENS, REFERENCE_OPTIONS)
          assert.isAbove(new Set(ref.tokens).size, 1, "the reference is not one repeated token")
          const splits = [
            [0, blocks],
            [0, 1, 2, blocks],
            [0, 2, blocks - 1, blocks]
          ]
          yield* splitsMatchReference(path, ref, splits, REFERENCE_OPTIONS)
        }),
      240_000
    )
  }

  // Gemma 4 E2B as its converter writes it: per-layer embeddings (the first stage computes them), the last 5 blocks
  // reading the KV of blocks 3 (sliding) and 4 (global), so every cut falls before block 3; double-wide shared MLPs.
  it.effect(
    "gemma4 E2B as its converter writes it (per-layer embeddings, shared KV, double-wide MLP)",
    () =>
      Effect.gen(function* () {
        const path = writeConverted("gemma4-e2b", join(dir, "gemma4-e2b.gguf"), 7)
        const file = yield* readGgufFile(path)
        assert.strictEqual(yield* getU32(file, "gemma4.attention.shared_kv_layers"), 5)
        assert.isTrue(file.tensorsByName.has("per_layer_token_embd.weight"))
        const ref = yield* nodeLlamaReference(path, STORY_PROMPT, N_TOKENS, REFERENCE_OPTIONS)
        assert.isAbove(new Set(ref.tokens).size, 1, "the reference is not one repeated token")
        yield* splitsMatchReference(
          path,
          ref,
          [
            [0, 10],
            [0, 1, 3, 10],
            [0, 2, 3, 10]
          ],
          REFERENCE_OPTIONS
        )
      }),
    240_000
  )

  it.live(
    "minimax-m2 on 3 local agents: node-llama-cpp's tokens; the middle agent killed at token 12 resumes to the same tokens",
    () =>
      Effect.gen(function* () {
        const path = writeConverted("minimax-m2", join(dir, "minimax-m2-resume.gguf"), 7)
        const { reference } = yield* killedStageResumes(
          { model: path, prompt: "Once upon a time", maxTokens: 48, threads: 1, stages: 3 },
          { atToken: 12 }
        )
        const ref = yield* nodeLlamaReference(path, "Once upon a time", 48, REFERENCE_OPTIONS)
        assert.deepStrictEqual(reference.tokens, ref.tokens)
      }),
    240_000
  )

  it.effect("minimax-m2 without expert_gating_func: a ModelLoadError naming the key (llama.cpp's graph aborts)", () =>
    Effect.gen(function* () {
      const path = writeConverted("minimax-m2", join(dir, "minimax-m2-gating.gguf"), 7)
      const file = yield* readGgufFile(path)
      const bytes = readFileSync(path)
      const out = join(dir, "minimax-m2-no-gating.gguf")
      yield* writeGgufFile(out, {
        metadata: [...file.metadataTypes]
          .filter(([key]) => key !== "minimax-m2.expert_gating_func")
          .map(([key, kind]) => [key, { ...kind, value: file.metadata.get(key)! }] as const),
        alignment: file.alignment,
        tensors: file.tensors.map((t) => ({
          name: t.name,
          type: t.type,
          dims: t.dims,
          data: () => new Uint8Array(bytes.buffer, bytes.byteOffset + t.offset, t.byteSize)
        }))
      })
      const error = (yield* Effect.flip(greedyRun(out, [0, 4], [1], 1, REFERENCE_OPTIONS))) as ModelLoadError
      assert.strictEqual(error._tag, "ModelLoadError")
      assert.match(error.message, /metadata "minimax-m2\.expert_gating_func" is missing/)
    })
  )

  // `convert_hf_to_gguf.py --fuse-gate-up-exps`: the routed experts' gate and up stacked in one ffn_gate_up_exps
  // [n_embd, 2 x n_ff_exp, n_expert] (gate rows first). llama.cpp reads it for deepseek2 and qwen35moe (and keeps the
  // same weights, so the same tokens as the file written apart); for qwen3moe it does not, and swactor says so.
  for (const family of ["deepseek2", "qwen35moe"] as const) {
    it.effect(
      `${family} with fused gate/up experts: node-llama-cpp's tokens, the same as the unfused file's`,
      () =>
        Effect.gen(function* () {
          const path = writeConverted(`${family}+fused`, join(dir, `${family}-fused.gguf`), 7)
          const file = yield* readGgufFile(path)
          assert.isTrue(file.tensorsByName.has("blk.1.ffn_gate_up_exps.weight"))
          assert.isFalse(file.tensorsByName.has("blk.1.ffn_gate_exps.weight"))
          const ref = yield* nodeLlamaReference(path, STORY_PROMPT, N_TOKENS, REFERENCE_OPTIONS)
          const apart = writeConverted(family, join(dir, `${family}-apart.gguf`), 7)
          const refApart = yield* nodeLlamaReference(apart, STORY_PROMPT, N_TOKENS, REFERENCE_OPTIONS)
          assert.deepStrictEqual(ref.tokens, refApart.tokens, "fusing keeps the weights")
          yield* splitsMatchReference(
            path,
            ref,
            [
              [0, 4],
              [0, 1, 2, 4],
              [0, 2, 3, 4]
            ],
            REFERENCE_OPTIONS
          )
        }),
      240_000
    )
  }

  it.effect(
    "qwen3moe with fused gate/up experts: a ModelLoadError naming the tensor (llama.cpp does not read it)",
    () =>
      Effect.gen(function* () {
        const path = writeConverted("qwen3moe+fused", join(dir, "qwen3moe-fused.gguf"), 7)
        const error = (yield* Effect.flip(greedyRun(path, [0, 4], [1], 1, REFERENCE_OPTIONS))) as ModelLoadError
        assert.strictEqual(error._tag, "ModelLoadError")
        assert.match(
          error.message,
          /tensor "blk\.0\.ffn_gate_up_exps\.weight": fused gate\/up experts are not read for qwen3moe/
        )
      })
  )
})
