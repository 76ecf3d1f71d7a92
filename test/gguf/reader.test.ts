import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import { readGgufFileInfo } from "node-llama-cpp"
import { GgmlType, ggmlTypeInfo, GgmlShapeError, rowBytes, tensorBytes } from "../../src/domain/ggmlTypes.js"
import { GgufValueType } from "../../src/domain/gguf.js"
import {
  getArchitecture,
  getArray,
  getBool,
  getF32,
  getInt,
  getOptional,
  getString,
  getStringArray,
  getU32,
  readGgufFile
} from "../../src/layers/gguf/GgufReader.js"
import { requireModel } from "../support/models.js"

const stories = requireModel("stories260K.gguf")

describe("ggml type table", () => {
  // The table matches ggml's type_traits for the types the project writes.
  it("has the block and type sizes of the pinned ggml", () => {
    assert.deepStrictEqual(ggmlTypeInfo(GgmlType.F32), {
      id: 0,
      name: "f32",
      blockSize: 1,
      typeSize: 4,
      quantized: false
    })
    assert.strictEqual(ggmlTypeInfo(GgmlType.Q8_0)?.typeSize, 34)
    assert.strictEqual(ggmlTypeInfo(GgmlType.Q4_0)?.typeSize, 18)
    assert.strictEqual(ggmlTypeInfo(GgmlType.Q4_K)?.typeSize, 144)
    assert.strictEqual(ggmlTypeInfo(GgmlType.Q6_K)?.typeSize, 210)
    assert.strictEqual(ggmlTypeInfo(GgmlType.BF16)?.typeSize, 2)
    assert.strictEqual(ggmlTypeInfo(4), undefined)
    assert.strictEqual(ggmlTypeInfo(43), undefined)
  })

  // Row and tensor sizes reject row lengths that are not whole blocks.
  it("computes sizes and rejects partial blocks", () => {
    assert.strictEqual(rowBytes(GgmlType.Q8_0, 64), 68)
    assert.strictEqual(tensorBytes(GgmlType.Q4_K, [512, 3]), 2 * 144 * 3)
    assert.throws(() => rowBytes(GgmlType.Q8_0, 48), GgmlShapeError)
    assert.throws(() => tensorBytes(GgmlType.F32, [4, 0]), GgmlShapeError)
    assert.throws(() => tensorBytes(99, [4]), GgmlShapeError)
  })
})

describe("GgufReader on stories260K", () => {
  // The real llama model reads with the architecture and shapes its README states.
  it.effect("reads the header, metadata and tensor table", () =>
    Effect.gen(function* () {
      const file = yield* readGgufFile(stories)
      assert.strictEqual(file.version, 3)
      assert.strictEqual(file.alignment, 32)
      assert.strictEqual(file.fileSize, 1_185_376)
      assert.strictEqual(yield* getArchitecture(file), "llama")
      assert.strictEqual(yield* getU32(file, "llama.block_count"), 5)
      assert.strictEqual(yield* getU32(file, "llama.embedding_length"), 64)
      assert.strictEqual(yield* getU32(file, "llama.feed_forward_length"), 172)
      assert.strictEqual(yield* getU32(file, "llama.attention.head_count"), 8)
      assert.strictEqual(yield* getU32(file, "llama.attention.head_count_kv"), 4)
      assert.strictEqual(yield* getU32(file, "llama.context_length"), 2048)
      assert.closeTo(yield* getF32(file, "llama.attention.layer_norm_rms_epsilon"), 1e-5, 1e-9)
      assert.strictEqual(yield* getString(file, "tokenizer.ggml.model"), "llama")
      const tokens = yield* getStringArray(file, "tokenizer.ggml.tokens")
      assert.strictEqual(tokens.length, 512)
      assert.deepStrictEqual(tokens.slice(0, 4), ["<unk>", "<s>", "</s>", "<0x00>"])
      assert.deepStrictEqual(file.metadataTypes.get("tokenizer.ggml.scores"), {
        type: GgufValueType.ARRAY,
        itemType: GgufValueType.FLOAT32
      })

      assert.strictEqual(file.tensors.length, 3 + 5 * 9)
      const expect = (name: string, dims: ReadonlyArray<number>) => {
        const t = file.tensorsByName.get(name)
        assert.isDefined(t, name)
        assert.deepStrictEqual(t!.dims, dims, name)
        assert.strictEqual(t!.type, GgmlType.F32, name)
        assert.strictEqual(
          t!.byteSize,
          dims.reduce((a, b) => a * b, 4),
          name
        )
      }
      expect("token_embd.weight", [64, 512])
      expect("output_norm.weight", [64])
      expect("output.weight", [64, 512])
      for (let b = 0; b < 5; b++) {
        expect(`blk.${b}.attn_norm.weight`, [64])
        expect(`blk.${b}.attn_q.weight`, [64, 64])
        expect(`blk.${b}.attn_k.weight`, [64, 32])
        expect(`blk.${b}.attn_v.weight`, [64, 32])
        expect(`blk.${b}.attn_output.weight`, [64, 64])
        expect(`blk.${b}.ffn_norm.weight`, [64])
        expect(`blk.${b}.ffn_gate.weight`, [64, 172])
        expect(`blk.${b}.ffn_up.weight`, [64, 172])
        expect(`blk.${b}.ffn_down.weight`, [172, 64])
      }
      const last = file.tensors[file.tensors.length - 1]!
      assert.isAtMost(last.offset + last.byteSize, file.fileSize)
    })
  )

  // Our table agrees with node-llama-cpp's own GGUF reader on every name, shape, type and file offset.
  it.effect("agrees with node-llama-cpp's readGgufFileInfo", () =>
    Effect.gen(function* () {
      const file = yield* readGgufFile(stories)
      const info = yield* Effect.promise(() => readGgufFileInfo(stories, { readTensorInfo: true }))
      const theirs = info.fullTensorInfo ?? []
      assert.strictEqual(theirs.length, file.tensors.length)
      theirs.forEach((t, i) => {
        const ours = file.tensors[i]!
        assert.strictEqual(ours.name, t.name)
        assert.deepStrictEqual(ours.dims, t.dimensions.map(Number))
        assert.strictEqual(ours.type, t.ggmlType)
        assert.strictEqual(ours.offset, Number(t.fileOffset))
        assert.strictEqual(ours.offset - file.dataOffset, Number(t.offset))
      })
    })
  )

  // Accessors fail with InvalidMetadata naming the key when it is missing or of another type.
  it.effect("typed accessors reject missing keys and wrong types", () =>
    Effect.gen(function* () {
      const file = yield* readGgufFile(stories)
      const missing = yield* Effect.flip(getU32(file, "llama.nope"))
      assert.strictEqual(missing.reason, "InvalidMetadata")
      assert.include(missing.message, "llama.nope")
      const wrong = yield* Effect.flip(getString(file, "llama.block_count"))
      assert.strictEqual(wrong.reason, "InvalidMetadata")
      assert.include(wrong.message, "llama.block_count")
      assert.include(wrong.message, "UINT32")
      assert.strictEqual((yield* Effect.flip(getF32(file, "general.name"))).reason, "InvalidMetadata")
      assert.strictEqual((yield* Effect.flip(getBool(file, "general.name"))).reason, "InvalidMetadata")
      assert.strictEqual((yield* Effect.flip(getArray(file, "general.name"))).reason, "InvalidMetadata")
      assert.strictEqual((yield* Effect.flip(getStringArray(file, "tokenizer.ggml.scores"))).reason, "InvalidMetadata")
      assert.strictEqual(yield* getInt(file, "tokenizer.ggml.padding_token_id"), 4294967295)
      assert.strictEqual(yield* getOptional(file, "general.file_type", getU32), undefined)
      assert.strictEqual(yield* getOptional(file, "llama.block_count", getU32), 5)
    })
  )

  // A path that does not exist is an Io error, not a defect.
  it.effect("a missing file is an Io error", () =>
    Effect.gen(function* () {
      const err = yield* Effect.flip(readGgufFile("/nonexistent/model.gguf"))
      assert.strictEqual(err.reason, "Io")
      assert.include(err.message, "/nonexistent/model.gguf")
    })
  )
})
