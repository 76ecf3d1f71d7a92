import { assert, describe, it } from "@effect/vitest"
import { Effect, Either } from "effect"
import { readFileSync } from "node:fs"
import { GgmlType } from "../../src/domain/ggmlTypes.js"
import { GgufValueType, type ModelLoadError, type ModelLoadReason } from "../../src/domain/gguf.js"
import { GgufLimits, parseGgufBytes } from "../../src/layers/gguf/GgufReader.js"
import { encodeGguf, GgufValues } from "../../src/layers/gguf/GgufWriter.js"
import { type Field, fieldLayout, findField, readInt, withInt } from "./fields.js"
import { requireModel } from "../support/models.js"

const stories = new Uint8Array(readFileSync(requireModel("stories260K.gguf")))
const storiesLayout = fieldLayout(stories)

const small = Effect.runSync(
  encodeGguf({
    metadata: [
      ["general.architecture", GgufValues.string("llama")],
      ["flag", GgufValues.bool(true)],
      ["list", GgufValues.array(GgufValueType.STRING, ["x", "yy"])],
      ["count", GgufValues.u32(3)]
    ],
    tensors: [
      { name: "a", type: GgmlType.F32, dims: [8, 4], data: () => new Uint8Array(128).fill(1) },
      { name: "b", type: GgmlType.Q8_0, dims: [64, 2], data: () => new Uint8Array(136).fill(2) },
      { name: "c", type: GgmlType.F16, dims: [16], data: () => new Uint8Array(32).fill(3) },
      { name: "d", type: GgmlType.F32, dims: [4], data: () => new Uint8Array(16).fill(4) }
    ]
  })
)
const smallLayout = fieldLayout(small)

const parse = (bytes: Uint8Array) => Effect.runSync(Effect.either(parseGgufBytes(bytes, "corpus.gguf")))

/** The parse fails with `reason`; the message mentions every string in `mentions`. */
const rejects = (bytes: Uint8Array, reason: ModelLoadReason, ...mentions: ReadonlyArray<string>): ModelLoadError => {
  const r = parse(bytes)
  if (Either.isRight(r)) return assert.fail(`expected ${reason}, the file parsed`)
  assert.strictEqual(r.left.reason, reason, r.left.message)
  assert.strictEqual(r.left.path, "corpus.gguf")
  for (const m of mentions) assert.include(r.left.message, m)
  return r.left
}

const set = (bytes: Uint8Array, field: Field, value: bigint | number) => withInt(bytes, field, value)

describe("GGUF broken-file corpus", () => {
  // The untouched files parse: the corpus below corrupts exactly one fact of each.
  it("the canonical files parse", () => {
    assert.isTrue(Either.isRight(parse(stories)))
    assert.isTrue(Either.isRight(parse(small)))
  })

  // A file cut anywhere (every ~1% and at every field boundary) is Truncated, never parsed or crashed.
  it("truncation at every 1% and every header field boundary is Truncated", () => {
    for (const [bytes, layout] of [
      [stories, storiesLayout],
      [small, smallLayout]
    ] as const) {
      const cuts = new Set<number>()
      for (let i = 1; i < 100; i++) cuts.add(Math.floor((bytes.length * i) / 100))
      // Every structural field; of the thousands of array elements, every 16th.
      const elements = new Set(["stringLength", "stringBytes", "scalar"])
      let element = 0
      for (const f of layout.fields) {
        if (elements.has(f.kind) && element++ % 16 !== 0) continue
        cuts.add(f.at)
        cuts.add(f.at + 1)
        cuts.add(f.at + f.size)
      }
      cuts.add(layout.tableEnd + 1)
      cuts.add(bytes.length - 1)
      cuts.delete(bytes.length)
      let checked = 0
      for (const cut of cuts) {
        if (cut < 4) {
          rejects(bytes.subarray(0, cut), "NotGguf")
        } else {
          rejects(bytes.subarray(0, cut), "Truncated")
        }
        checked++
      }
      assert.isAbove(checked, bytes === stories ? 500 : 50)
    }
  })

  // Not a GGUF file at all.
  it("wrong magic is NotGguf", () => {
    const b = stories.slice()
    b.set([0x47, 0x47, 0x4d, 0x4c], 0)
    rejects(b, "NotGguf", "GGML")
    rejects(new TextEncoder().encode("hello world, not a model"), "NotGguf")
  })

  // Versions other than 2 and 3 (including v1 and a byte-swapped 3).
  it("unsupported versions", () => {
    const field = findField(storiesLayout, "version")
    for (const v of [0, 1, 4, 0x03000000]) rejects(set(stories, field, v), "UnsupportedVersion", String(v))
    // A big-endian GGUF is named as such (issue 42: slices and models are little-endian everywhere).
    rejects(set(stories, field, 0x03000000), "UnsupportedVersion", "version 3 byte-swapped: a big-endian GGUF")
    assert.isTrue(Either.isRight(parse(set(stories, field, 2))))
  })

  // A tensor or metadata count the file cannot hold is rejected before any loop or allocation.
  it("lying tensor and kv counts", () => {
    const tc = findField(storiesLayout, "tensorCount")
    const kc = findField(storiesLayout, "kvCount")
    for (const n of [2n ** 63n - 1n, 2n ** 40n, 100_000n]) rejects(set(stories, tc, n), "Truncated", String(n))
    for (const n of [2n ** 64n - 1n, 2n ** 33n, 1_000_000n]) rejects(set(stories, kc, n), "Truncated", String(n))
    // One too few tensors: the data section would shift; the leftover bytes betray it.
    rejects(set(stories, tc, 47), "OffsetOutOfBounds", "47 tensors")
    rejects(set(small, findField(smallLayout, "tensorCount"), 3), "OffsetOutOfBounds")
    // One too many: the extra "tensor" is read from padding/data and fails somewhere, always typed.
    for (const [bytes, layout] of [
      [stories, storiesLayout],
      [small, smallLayout]
    ] as const) {
      const t = findField(layout, "tensorCount")
      const k = findField(layout, "kvCount")
      for (const b of [
        set(bytes, t, readInt(bytes, t) + 1n),
        set(bytes, k, readInt(bytes, k) + 1n),
        set(bytes, k, 1)
      ]) {
        const r = parse(b)
        assert.isTrue(Either.isLeft(r))
      }
    }
    // Zero tensors but tensor data present: the table does not describe the file.
    rejects(set(small, findField(smallLayout, "tensorCount"), 0), "OffsetOutOfBounds")
  })

  // Offsets that are misaligned, out of order, overlapping or outside the file.
  it("lying tensor offsets are OffsetOutOfBounds naming the tensor", () => {
    const off = (name: string) => findField(storiesLayout, "tensorOffset", name)
    const q = "blk.0.attn_q.weight"
    const cur = readInt(stories, off(q))
    rejects(set(stories, off(q), cur + 1n), "OffsetOutOfBounds", q, "alignment")
    rejects(set(stories, off(q), cur + 32n), "OffsetOutOfBounds", q)
    rejects(set(stories, off(q), cur - 32n), "OffsetOutOfBounds", q, "overlaps")
    rejects(set(stories, off(q), 0n), "OffsetOutOfBounds", q)
    rejects(set(stories, off(q), 2n ** 62n), "OffsetOutOfBounds", q)
    rejects(set(stories, off(q), 2n ** 64n - 32n), "OffsetOutOfBounds", q)
    const last = storiesLayout.tensorNames[storiesLayout.tensorNames.length - 1]!
    rejects(set(stories, off(last), BigInt(stories.length)), "OffsetOutOfBounds", last)
    rejects(set(small, findField(smallLayout, "tensorOffset", "c"), 0), "OffsetOutOfBounds", '"c"')
  })

  // Shapes that are absurd, or inconsistent with where the data lies.
  it("lying shapes", () => {
    const dim = (name: string, i: number) => findField(storiesLayout, "dim", name, i)
    const nd = (name: string) => findField(storiesLayout, "nDims", name)
    const k = "blk.0.attn_k.weight"
    rejects(set(stories, dim(k, 0), 0), "TensorShapeMismatch", k)
    rejects(set(stories, dim(k, 1), -1n), "TensorShapeMismatch", k)
    rejects(set(stories, dim(k, 1), 2n ** 62n), "TensorShapeMismatch", k)
    rejects(set(stories, nd(k), 0), "TensorShapeMismatch", k)
    rejects(set(stories, nd(k), 5), "TensorShapeMismatch", k)
    rejects(set(stories, nd(k), 0xffffffff), "TensorShapeMismatch", k)
    // A middle tensor twice as big as its data slot: the next tensor's offset no longer fits.
    rejects(set(stories, dim(k, 1), 64), "OffsetOutOfBounds", "blk.0.attn_v.weight")
    // The last tensor grown past the end of the file.
    const last = storiesLayout.tensorNames[storiesLayout.tensorNames.length - 1]!
    rejects(set(stories, dim(last, 0), 128), "Truncated", last)
    // Fewer dimensions than stored: the table itself shifts and parsing fails, typed.
    assert.isTrue(Either.isLeft(parse(set(stories, nd(k), 1))))
    // A row that is not whole blocks of its type.
    rejects(set(small, findField(smallLayout, "dim", "b", 0), 48), "TensorShapeMismatch", '"b"', "block size")
  })

  // Lengths larger than the file (or than any sane string) cannot allocate.
  it("huge string and array lengths", () => {
    const keyLen = storiesLayout.fields.find((f) => f.kind === "keyLength")!
    for (const n of [2n ** 64n - 1n, 2n ** 53n, 2n ** 31n, BigInt(stories.length)])
      rejects(set(stories, keyLen, n), "Truncated")
    const tokLen = findField(storiesLayout, "arrayLength", "tokenizer.ggml.tokens")
    for (const n of [2n ** 62n, 1_000_000n]) rejects(set(stories, tokLen, n), "Truncated", "tokenizer.ggml.tokens")
    const strLen = findField(storiesLayout, "stringLength", "tokenizer.ggml.tokens")
    rejects(set(stories, strLen, 2n ** 40n), "Truncated")
    const nameLen = findField(storiesLayout, "nameLength")
    rejects(set(stories, nameLen, 2n ** 63n), "Truncated")
    // A string within the file but over the sanity limit.
    const big = new Uint8Array(GgufLimits.maxStringBytes + 64)
    big.set(small.subarray(0, 24))
    const dv = new DataView(big.buffer)
    dv.setBigUint64(16, 1n, true) // one kv
    dv.setBigUint64(8, 0n, true) // no tensors
    dv.setBigUint64(24, BigInt(GgufLimits.maxStringBytes + 1), true)
    rejects(big, "InvalidMetadata", "limit")
  })

  // Sanity caps hold even where the file is big enough (shown with lowered limits on the real vocabulary).
  it("array, string and header size caps are InvalidMetadata", () => {
    const lowered = (limits: Parameters<typeof parseGgufBytes>[2]) =>
      Effect.runSync(Effect.flip(parseGgufBytes(stories, "corpus.gguf", limits)))
    const arr = lowered({ maxArrayLength: 100 })
    assert.strictEqual(arr.reason, "InvalidMetadata")
    assert.include(arr.message, "tokenizer.ggml.tokens")
    const hdr = lowered({ maxHeaderBytes: 4096 })
    assert.strictEqual(hdr.reason, "InvalidMetadata")
    assert.include(hdr.message, "4096")
    const str = lowered({ maxStringBytes: 4 })
    assert.strictEqual(str.reason, "InvalidMetadata")
    assert.include(str.message, "limit")
  })

  // Metadata of a type GGUF does not define, and arrays of arrays.
  it("unknown metadata value types", () => {
    const vt = findField(storiesLayout, "valueType", "general.architecture")
    for (const t of [13, 99, 0xffffffff])
      rejects(set(stories, vt, t), "InvalidMetadata", "general.architecture", String(t))
    const it_ = findField(storiesLayout, "itemType", "tokenizer.ggml.scores")
    rejects(set(stories, it_, 9), "InvalidMetadata", "tokenizer.ggml.scores", "nested")
    rejects(set(stories, it_, 77), "InvalidMetadata", "tokenizer.ggml.scores")
    const flag = findField(smallLayout, "scalar", "flag")
    rejects(set(small, flag, 2), "InvalidMetadata", "flag")
  })

  // Tensor types ggml does not know (or removed from GGUF).
  it("unknown ggml types are UnsupportedTensorType", () => {
    const gt = findField(storiesLayout, "ggmlType", "output_norm.weight")
    for (const t of [4, 5, 31, 36, 43, 1000, 0xffffffff]) {
      rejects(set(stories, gt, t), "UnsupportedTensorType", "output_norm.weight", String(t))
    }
  })

  // Names must be unique (tensors and keys), non-empty and shorter than GGML_MAX_NAME.
  it("duplicate and bad names are InvalidMetadata", () => {
    const v = findField(storiesLayout, "nameBytes", "blk.0.attn_v.weight")
    const dup = stories.slice()
    dup.set(new TextEncoder().encode("blk.0.attn_k.weight"), v.at)
    rejects(dup, "InvalidMetadata", "duplicate", "blk.0.attn_k.weight")
    const key = findField(storiesLayout, "keyBytes")
    const f = storiesLayout.fields.find((x) => x.kind === "keyBytes" && x.at > key.at && x.size === key.size)
    if (f !== undefined) {
      const dk = stories.slice()
      dk.set(stories.subarray(key.at, key.at + key.size), f.at)
      rejects(dk, "InvalidMetadata", "duplicate")
    }
    const nameLen = findField(smallLayout, "nameLength")
    rejects(set(small, nameLen, 0), "InvalidMetadata", "empty")
    const longName = Effect.runSync(
      encodeGguf({
        metadata: [],
        tensors: [{ name: "n".repeat(63), type: GgmlType.F32, dims: [1], data: () => new Uint8Array(4) }]
      })
    )
    const l = fieldLayout(longName)
    const grown = new Uint8Array(longName.length + 1)
    grown.set(longName.subarray(0, l.fields[5]!.at))
    grown.set(longName.subarray(l.fields[5]!.at), l.fields[5]!.at + 1)
    new DataView(grown.buffer).setBigUint64(l.fields[4]!.at, 64n, true)
    grown[l.fields[5]!.at + 63] = 0x6e
    rejects(grown, "InvalidMetadata", "64 bytes")
  })

  // general.alignment must be a UINT32 power of two.
  it("bad alignment is InvalidMetadata", () => {
    // The writer refuses these, so write another key of the same length and rename it in place.
    const mk = (v: ReturnType<typeof GgufValues.u32>) => {
      const b = Effect.runSync(encodeGguf({ metadata: [["general.alignmenX", v]], tensors: [] }))
      b.set(new TextEncoder().encode("general.alignment"), findField(fieldLayout(b), "keyBytes").at)
      return b
    }
    rejects(mk(GgufValues.u32(48)), "InvalidMetadata", "general.alignment", "48")
    rejects(mk(GgufValues.u32(0)), "InvalidMetadata", "general.alignment")
    rejects(mk(GgufValues.u64(32n)), "InvalidMetadata", "general.alignment", "UINT32")
    rejects(mk(GgufValues.u32(2 ** 30)), "InvalidMetadata", "general.alignment")
  })

  // Bytes after the data the table describes.
  it("trailing garbage is OffsetOutOfBounds", () => {
    const grown = new Uint8Array(stories.length + 4096)
    grown.set(stories)
    rejects(grown, "OffsetOutOfBounds", "after the end")
    const padded = new Uint8Array(stories.length + 16)
    padded.set(stories)
    assert.isTrue(Either.isRight(parse(padded)))
  })
})
