/**
 * The mixed recipes (q4_k_m, q3_k_m) on mixture-of-experts files: every tensor of a synthetic qwen3moe / glm4moe gets
 * the type llama.cpp's own quantizer (llama_model_quantize of node-llama-cpp's libllama) picks for the f32 file of the
 * same model: the stacked ffn_down_exps (and glm4moe's ffn_down_shexp, its dense block's ffn_down) Q6_K in
 * use_more_bits blocks, and with exactly 8 experts attn_v / attn_k Q8_0 and attn_output Q5_K.
 */
import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { afterAll } from "vitest"
import { ggmlTypeName } from "../../src/domain/ggmlTypes.js"
import { getU32, readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { type SyntheticModelOptions, type SyntheticType, writeSyntheticModel } from "../../src/layers/gguf/Synthetic.js"
import { syntheticFileType } from "../../src/layers/gguf/SyntheticTypes.js"
import { llamaQuantize } from "../support/llamaQuantize.js"

const dir = mkdtempSync(join(tmpdir(), "swactor-moe-recipe-"))
afterAll(() => rmSync(dir, { recursive: true, force: true }))

// hidden and expert FFN 256: every row fits a K-quant block, so neither side falls back to another type
// (each with one tensor whose type shows the rule in question was reached)
const cases: ReadonlyArray<readonly [SyntheticModelOptions["arch"], SyntheticType, number, number, string, string]> = [
  ["qwen3moe", "q4_k_m", 16, 4, "blk.13.ffn_down_exps.weight", "q6_K"],
  ["qwen3moe", "q3_k_m", 8, 8, "blk.3.attn_output.weight", "q5_K"],
  ["glm4moe", "q4_k_m", 8, 8, "blk.7.ffn_down_shexp.weight", "q6_K"]
]

describe("mixed recipes on MoE files: the per-tensor types of llama.cpp's quantizer", () => {
  for (const [arch, type, layers, experts, reached, reachedType] of cases) {
    it.live(
      `${arch} ${type}, ${layers} blocks, ${experts} experts: every tensor's type equals llama_model_quantize's`,
      () =>
        Effect.gen(function* () {
          const o: SyntheticModelOptions = {
            path: join(dir, `${arch}-${type}-${layers}-${experts}.gguf`),
            arch,
            layers,
            hidden: 256,
            ffn: 256,
            heads: 4,
            kvHeads: 2,
            vocab: 300,
            contextLength: 256,
            type,
            seed: 3,
            experts,
            expertsUsed: 2,
            expertFfn: 256
          }
          const f32 = { ...o, type: "f32" as const, path: join(dir, `${arch}-${type}-${layers}-${experts}-f32.gguf`) }
          const refPath = join(dir, `${arch}-${type}-${layers}-${experts}-llama.gguf`)
          yield* writeSyntheticModel(o)
          yield* writeSyntheticModel(f32)
          llamaQuantize(f32.path, refPath, syntheticFileType(type))
          const ours = yield* readGgufFile(o.path)
          const ref = yield* readGgufFile(refPath)
          assert.deepStrictEqual(ours.tensors.map((t) => t.name).sort(), ref.tensors.map((t) => t.name).sort())
          const differ = ours.tensors.flatMap((t) => {
            const theirs = ref.tensorsByName.get(t.name)!.type
            return theirs === t.type
              ? []
              : [`${t.name}: ours ${ggmlTypeName(t.type)}, llama.cpp ${ggmlTypeName(theirs)}`]
          })
          assert.deepStrictEqual(differ, [])
          assert.strictEqual(ggmlTypeName(ours.tensorsByName.get(reached)!.type), reachedType)
          assert.strictEqual(yield* getU32(ours, "general.file_type"), yield* getU32(ref, "general.file_type"))
        })
    )
  }
})
