import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import { existsSync, mkdtempSync, readdirSync, readFileSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { afterAll } from "vitest"
import { GgmlType, tensorBytes } from "../../src/domain/ggmlTypes.js"
import { GgufValueType } from "../../src/domain/gguf.js"
import { bf16BitsToF32, f16BitsToF32, f32ToBf16Bits, f32ToF16Bits } from "../../src/layers/gguf/Float16.js"
import { getF32, parseGgufBytes, readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import {
  encodeGguf,
  type GgufTensorSpec,
  GgufValues,
  type GgufWriteSpec,
  writeGgufFile
} from "../../src/layers/gguf/GgufWriter.js"

const dir = mkdtempSync(join(tmpdir(), "swactor-gguf-rt-"))
afterAll(() => rmSync(dir, { recursive: true, force: true }))

const bytesOf = (n: number, salt: number) => {
  const out = new Uint8Array(n)
  for (let i = 0; i < n; i++) out[i] = (i * 31 + salt * 7) & 0xff
  return out
}

const tensor = (name: string, type: number, dims: ReadonlyArray<number>, salt: number): GgufTensorSpec => ({
  name,
  type,
  dims,
  data: () => bytesOf(tensorBytes(type, dims), salt)
})

const spec: GgufWriteSpec = {
  metadata: [
    ["general.architecture", GgufValues.string("llama")],
    ["t.u8", GgufValues.u8(255)],
    ["t.i8", GgufValues.i8(-128)],
    ["t.u16", GgufValues.u16(65535)],
    ["t.i16", GgufValues.i16(-32768)],
    ["t.u32", GgufValues.u32(4294967295)],
    ["t.i32", GgufValues.i32(-2147483648)],
    ["t.f32", GgufValues.f32(1.5)],
    ["t.bool", GgufValues.bool(true)],
    ["t.string", GgufValues.string("héllo ▁wörld")],
    ["t.u64", GgufValues.u64(18446744073709551615n)],
    ["t.i64", GgufValues.i64(-9223372036854775808n)],
    ["t.f64", GgufValues.f64(Math.PI)],
    ["t.arr.u8", GgufValues.array(GgufValueType.UINT8, [0, 1, 255])],
    ["t.arr.i32", GgufValues.array(GgufValueType.INT32, [-1, 0, 7])],
    ["t.arr.f32", GgufValues.array(GgufValueType.FLOAT32, [0.25, -2])],
    ["t.arr.bool", GgufValues.array(GgufValueType.BOOL, [true, false])],
    ["t.arr.string", GgufValues.array(GgufValueType.STRING, ["a", "", "<0x0A>"])],
    ["t.arr.u64", GgufValues.array(GgufValueType.UINT64, [1n, 2n ** 60n])],
    ["t.arr.f64", GgufValues.array(GgufValueType.FLOAT64, [1e300])],
    ["t.arr.empty", GgufValues.array(GgufValueType.INT16, [])]
  ],
  tensors: [
    tensor("a.f32", GgmlType.F32, [3, 5], 1),
    tensor("b.q8_0", GgmlType.Q8_0, [64, 2], 2),
    tensor("c.f16", GgmlType.F16, [7], 3),
    tensor("d.q4_k", GgmlType.Q4_K, [256, 1, 2], 4),
    tensor("e.bf16", GgmlType.BF16, [2, 2, 2, 2], 5)
  ]
}

describe("GgufWriter → GgufReader round trip", () => {
  // Whatever the writer writes, the reader reads back: every value type, the tensor table and the data bytes.
  it.effect("same metadata, types, tensor table and data", () =>
    Effect.gen(function* () {
      for (const alignment of [32, 64, 1]) {
        const path = join(dir, `rt-${alignment}.gguf`)
        const summary = yield* writeGgufFile(path, { ...spec, alignment })
        const file = yield* readGgufFile(path)
        assert.strictEqual(file.fileSize, summary.bytes)
        assert.strictEqual(file.alignment, alignment)
        assert.strictEqual(file.version, 3)
        const expected = [...spec.metadata.map(([k, v]) => [k, v.value] as const)]
        if (alignment !== 32) expected.push(["general.alignment", alignment])
        assert.deepStrictEqual([...file.metadata.entries()], expected)
        for (const [k, v] of spec.metadata) {
          assert.deepStrictEqual(
            file.metadataTypes.get(k),
            v.itemType === undefined
              ? { type: v.type }
              : {
                  type: v.type,
                  itemType: v.itemType
                },
            k
          )
        }
        assert.strictEqual(yield* getF32(file, "t.f32"), 1.5)
        const raw = readFileSync(path)
        assert.deepStrictEqual(
          file.tensors.map((t) => t.name),
          spec.tensors.map((t) => t.name)
        )
        spec.tensors.forEach((t, i) => {
          const got = file.tensors[i]!
          assert.deepStrictEqual(got.dims, t.dims)
          assert.strictEqual(got.type, t.type)
          assert.strictEqual(got.byteSize, tensorBytes(t.type, t.dims))
          assert.strictEqual(got.offset % alignment, 0)
          assert.deepStrictEqual(new Uint8Array(raw.subarray(got.offset, got.offset + got.byteSize)), t.data(), t.name)
        })
      }
    })
  )

  // In-memory encoding equals the file, and a version-2 file reads as version 2.
  it.effect("encodeGguf matches the file; version 2 reads back", () =>
    Effect.gen(function* () {
      const path = join(dir, "rt-mem.gguf")
      yield* writeGgufFile(path, spec)
      const mem = yield* encodeGguf(spec)
      assert.deepStrictEqual(mem, new Uint8Array(readFileSync(path)))
      const v2 = yield* parseGgufBytes(yield* encodeGguf({ ...spec, version: 2 }))
      assert.strictEqual(v2.version, 2)
      assert.strictEqual(v2.tensors.length, 5)
    })
  )

  // A write that fails half-way leaves neither the target nor its temporary file behind.
  it.effect("a failed write leaves nothing behind", () =>
    Effect.gen(function* () {
      const path = join(dir, "half.gguf")
      const err = yield* Effect.flip(
        writeGgufFile(path, {
          metadata: [],
          tensors: [
            tensor("ok", GgmlType.F32, [4], 0),
            { name: "boom", type: GgmlType.F32, dims: [4], data: () => new Uint8Array(15) }
          ]
        })
      )
      assert.strictEqual(err._tag, "GgufWriteError")
      assert.include(err.message, "boom")
      assert.isFalse(existsSync(path))
      assert.deepStrictEqual(
        readdirSync(dir).filter((f) => f.startsWith("half.gguf")),
        []
      )
    })
  )

  // The writer refuses what the reader would refuse.
  it.effect("rejects invalid specs as GgufWriteError", () =>
    Effect.gen(function* () {
      const dup = yield* Effect.flip(encodeGguf({ ...spec, tensors: [...spec.tensors, spec.tensors[0]!] }))
      assert.include(dup.message, "a.f32")
      const block = yield* Effect.flip(encodeGguf({ metadata: [], tensors: [tensor("x", GgmlType.Q8_0, [48], 0)] }))
      assert.include(block.message, "block size")
      const range = yield* Effect.flip(encodeGguf({ metadata: [["k", GgufValues.u8(256)]], tensors: [] }))
      assert.include(range.message, "k")
      const size = yield* Effect.flip(
        encodeGguf({
          metadata: [],
          tensors: [{ name: "x", type: GgmlType.F32, dims: [4], data: () => new Uint8Array(3) }]
        })
      )
      assert.include(size.message, "x")
      const chunks = yield* encodeGguf({
        metadata: [],
        tensors: [{ name: "y", type: GgmlType.F32, dims: [4], data: () => [new Uint8Array(8), new Uint8Array(8)] }]
      })
      assert.strictEqual(
        chunks.length,
        (yield* encodeGguf({ metadata: [], tensors: [tensor("y", GgmlType.F32, [4], 0)] })).length
      )
      const over = yield* Effect.flip(
        encodeGguf({
          metadata: [],
          tensors: [{ name: "z", type: GgmlType.F32, dims: [4], data: () => [new Uint8Array(12), new Uint8Array(8)] }]
        })
      )
      assert.include(over.message, "z")
      const align = yield* Effect.flip(encodeGguf({ ...spec, alignment: 48 }))
      assert.include(align.message, "48")
    })
  )
})

describe("F16 / BF16 conversion", () => {
  // Known encodings, including overflow, underflow, subnormals, NaN and ties to even.
  it("converts known values", () => {
    assert.strictEqual(f32ToF16Bits(1), 0x3c00)
    assert.strictEqual(f32ToF16Bits(-2), 0xc000)
    assert.strictEqual(f32ToF16Bits(0.1), 0x2e66)
    assert.strictEqual(f32ToF16Bits(65504), 0x7bff)
    assert.strictEqual(f32ToF16Bits(65520), 0x7c00)
    assert.strictEqual(f32ToF16Bits(2 ** -24), 0x0001)
    assert.strictEqual(f32ToF16Bits(2 ** -26), 0x0000)
    assert.strictEqual(f32ToF16Bits(-0), 0x8000)
    assert.strictEqual(f32ToF16Bits(Infinity), 0x7c00)
    assert.strictEqual(f32ToF16Bits(NaN) & 0x7c00, 0x7c00)
    assert.notStrictEqual(f32ToF16Bits(NaN) & 0x3ff, 0)
    assert.strictEqual(f32ToF16Bits(1 + 2 ** -11), 0x3c00) // tie → even
    assert.strictEqual(f32ToF16Bits(1 + 3 * 2 ** -11), 0x3c02) // tie → even
    assert.strictEqual(f32ToBf16Bits(1), 0x3f80)
    assert.strictEqual(f32ToBf16Bits(1 + 2 ** -8), 0x3f80)
    assert.strictEqual(f32ToBf16Bits(1 + 3 * 2 ** -8), 0x3f82)
    assert.strictEqual(bf16BitsToF32(0xc040), -3)
  })

  // Every conversion lands on the nearest representable value (checked against its neighbours).
  it("rounds to nearest for random values", () => {
    let s = 12345
    const rnd = () => {
      s = (Math.imul(s, 1103515245) + 12345) >>> 0
      return s / 4294967296
    }
    const f32 = new Float32Array(1)
    for (let i = 0; i < 20000; i++) {
      f32[0] = (rnd() - 0.5) * 2 ** Math.floor(rnd() * 40 - 28)
      const x = f32[0]!
      const h = f32ToF16Bits(x)
      const v = f16BitsToF32(h)
      if (Math.abs(x) < 65504) {
        for (const n of [h - 1, h + 1]) {
          if ((n & 0x7fff) >= 0x7c00 || (n & 0x7fff) === 0x7fff) continue
          assert.isAtMost(Math.abs(v - x), Math.abs(f16BitsToF32(n & 0xffff) - x), `f16 ${x}`)
        }
      }
      const b = f32ToBf16Bits(x)
      const bv = bf16BitsToF32(b)
      for (const n of [b - 1, b + 1]) assert.isAtMost(Math.abs(bv - x), Math.abs(bf16BitsToF32(n & 0xffff) - x))
    }
  })
})
