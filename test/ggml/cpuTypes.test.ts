import { assert, describe, it } from "@effect/vitest"
import { GGML_TYPE_COUNT, GgmlType, ggmlTypeName } from "../../src/domain/ggmlTypes.js"
import { getGgml } from "../../src/layers/ggml/Bindings.js"
import { cpuComputesWeightType } from "../../src/layers/ggml/CpuTypeSupport.js"

/** The weight types of issue 20: every one the shipped CPU backend computes. */
const computed = [
  GgmlType.F32,
  GgmlType.F16,
  GgmlType.BF16,
  GgmlType.Q4_0,
  GgmlType.Q4_1,
  GgmlType.Q5_0,
  GgmlType.Q5_1,
  GgmlType.Q8_0,
  GgmlType.Q2_K,
  GgmlType.Q3_K,
  GgmlType.Q4_K,
  GgmlType.Q5_K,
  GgmlType.Q6_K,
  GgmlType.IQ1_S,
  GgmlType.IQ1_M,
  GgmlType.IQ2_XXS,
  GgmlType.IQ2_XS,
  GgmlType.IQ2_S,
  GgmlType.IQ3_XXS,
  GgmlType.IQ3_S,
  GgmlType.IQ4_NL,
  GgmlType.IQ4_XS,
  GgmlType.TQ1_0,
  GgmlType.TQ2_0,
  GgmlType.MXFP4
]

/** Types of the pinned ggml without a CPU dot product (Q8_1/Q8_K are only ever products' input side; ints; f64). */
const notComputed = [GgmlType.Q8_1, GgmlType.Q8_K, GgmlType.I8, GgmlType.I16, GgmlType.I32, GgmlType.I64, GgmlType.F64]

/** Ids ggml removed, and ids outside 0..GGML_TYPE_COUNT-1: answered in TypeScript (a native call could abort). */
const notTypes = [4, 5, 31, 32, 33, 36, 37, 38, -1, GGML_TYPE_COUNT, GGML_TYPE_COUNT + 7, 1.5, Number.NaN]

describe("weight types the CPU backend computes, asked of ggml (type traits + supports_op)", () => {
  it("answers true for every weight type of the issue, false for types without a CPU dot product", () => {
    const g = getGgml()
    for (const t of computed) assert.isTrue(cpuComputesWeightType(g, t), ggmlTypeName(t))
    for (const t of notComputed) assert.isFalse(cpuComputesWeightType(g, t), ggmlTypeName(t))
  })

  it("answers false for removed and out-of-range ids without aborting, and every id 0..COUNT-1 is answered", () => {
    const g = getGgml()
    for (const t of notTypes) assert.isFalse(cpuComputesWeightType(g, t), String(t))
    // and quantizeChunk refuses in TypeScript what ggml_quantize_chunk would abort on
    for (const t of [GgmlType.Q8_K, GgmlType.Q8_1, GgmlType.I32, GgmlType.F64, 31, GGML_TYPE_COUNT, 1000]) {
      assert.throws(() => g.quantizeChunk(t, new Float32Array(256), 1, 256), /cannot quantize/, String(t))
    }
    const answered = Array.from({ length: GGML_TYPE_COUNT }, (_, t) => cpuComputesWeightType(g, t))
    // the types the pinned ggml added after the issue was written (nvfp4, q1_0, q2_0) have CPU kernels too
    assert.deepStrictEqual(
      answered.flatMap((ok, t) => (ok ? [ggmlTypeName(t)] : [])).sort(),
      [...computed, GgmlType.NVFP4, GgmlType.Q1_0, GgmlType.Q2_0].map(ggmlTypeName).sort()
    )
  })
})
