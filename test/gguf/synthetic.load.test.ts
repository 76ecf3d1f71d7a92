import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { getLlama, type Llama, type Token } from "node-llama-cpp"
import { afterAll, beforeAll } from "vitest"
import { GgmlType, ggmlTypeName } from "../../src/domain/ggmlTypes.js"
import { getString, getStringArray, getU32, readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { encodeGguf } from "../../src/layers/gguf/GgufWriter.js"
import {
  gaussianStream,
  type SyntheticArch,
  type SyntheticModelOptions,
  syntheticModelSpec,
  type SyntheticType,
  syntheticValues,
  writeSyntheticModel
} from "../../src/layers/gguf/Synthetic.js"

let dir = ""
let llama: Llama
beforeAll(async () => {
  dir = mkdtempSync(join(tmpdir(), "swactor-synth-"))
  llama = await getLlama({ gpu: false, build: "never", logLevel: "error" as never })
})
afterAll(() => {
  rmSync(dir, { recursive: true, force: true })
})

const base = (arch: SyntheticArch, type: SyntheticType): SyntheticModelOptions => ({
  path: join(dir, `${arch}-${type}.gguf`),
  arch,
  layers: 2,
  hidden: 256,
  ffn: 512,
  heads: 4,
  kvHeads: 2,
  vocab: 400,
  contextLength: 512,
  type,
  seed: 7
})

/** node-llama-cpp loads the file and greedily generates 16 tokens after "Once upon a time". */
const generate = (path: string) =>
  Effect.promise(async () => {
    const model = await llama.loadModel({ modelPath: path })
    try {
      const ctx = await model.createContext({ threads: 1, contextSize: 256 })
      try {
        const seq = ctx.getSequence()
        const prompt = [...(model.tokens.bos !== null ? [model.tokens.bos] : []), ...model.tokenize("Once upon a time")]
        const out: Array<Token> = []
        for await (const t of seq.evaluate(prompt, { temperature: 0 })) {
          out.push(t)
          if (out.length >= 16) break
        }
        return { prompt, out }
      } finally {
        await ctx.dispose()
      }
    } finally {
      await model.dispose()
    }
  })

describe("synthetic models load in node-llama-cpp", () => {
  const cases: ReadonlyArray<readonly [SyntheticArch, SyntheticType]> = [
    ["llama", "f32"],
    ["qwen2", "f32"],
    ["qwen3", "f32"],
    ["llama", "f16"],
    ["llama", "bf16"],
    ["llama", "q8_0"],
    ["llama", "q4_0"],
    ["llama", "q4_k"],
    ["llama", "q6_k"],
    ["qwen2", "q8_0"],
    ["qwen3", "q4_k"],
    ["qwen3", "q6_k"]
  ]
  for (const [arch, type] of cases) {
    // Every architecture and storage type produces a file llama.cpp loads and that generates varied text.
    it.live(`${arch} ${type}: loads, tokenizes and greedy-generates a non-degenerate stream`, () =>
      Effect.gen(function* () {
        const options = base(arch, type)
        const summary = yield* writeSyntheticModel(options)
        assert.deepStrictEqual(summary.fallbacks, [])
        const { out, prompt } = yield* generate(summary.path)
        assert.isAbove(prompt.length, 2)
        assert.strictEqual(out.length, 16)
        assert.isAtLeast(new Set(out).size, 3, `stream ${out.join(",")}`)
      })
    )
  }

  // Tied output (no output.weight) loads too: llama.cpp reuses token_embd.
  it.live("a tied-output qwen3 model with an explicit head dimension loads", () =>
    Effect.gen(function* () {
      const options = { ...base("qwen3", "f16"), tiedOutput: true, headDim: 128, path: join(dir, "tied.gguf") }
      yield* writeSyntheticModel(options)
      const file = yield* readGgufFile(options.path)
      assert.isFalse(file.tensorsByName.has("output.weight"))
      assert.deepStrictEqual(file.tensorsByName.get("blk.0.attn_q.weight")?.dims, [256, 512])
      assert.deepStrictEqual(file.tensorsByName.get("blk.0.attn_output.weight")?.dims, [512, 256])
      assert.strictEqual(yield* getU32(file, "qwen3.attention.key_length"), 128)
      const { out } = yield* generate(options.path)
      assert.isAtLeast(new Set(out).size, 3, `stream ${out.join(",")}`)
    })
  )
})

describe("synthetic model contents", () => {
  // The table holds exactly the tensors llama.cpp's loader asks for, with the shapes it checks.
  it.effect("qwen2 tensor names, shapes, types and metadata", () =>
    Effect.gen(function* () {
      const options = { ...base("qwen2", "q8_0"), hidden: 96, heads: 3, kvHeads: 1, path: join(dir, "shapes.gguf") }
      const summary = yield* writeSyntheticModel(options)
      const file = yield* readGgufFile(options.path)
      assert.strictEqual(summary.bytes, file.fileSize)
      assert.strictEqual(yield* getString(file, "general.architecture"), "qwen2")
      assert.strictEqual(yield* getU32(file, "qwen2.block_count"), 2)
      assert.strictEqual(yield* getU32(file, "qwen2.embedding_length"), 96)
      assert.strictEqual(yield* getU32(file, "qwen2.attention.head_count_kv"), 1)
      assert.strictEqual(yield* getU32(file, "general.file_type"), 7)
      const tokens = yield* getStringArray(file, "tokenizer.ggml.tokens")
      assert.strictEqual(tokens.length, 400)
      assert.strictEqual(new Set(tokens).size, 400)
      assert.strictEqual(tokens[3 + 0x41], "<0x41>")
      const expect = (name: string, dims: ReadonlyArray<number>, type: number) => {
        const t = file.tensorsByName.get(name)
        assert.isDefined(t, name)
        assert.deepStrictEqual(t!.dims, dims, name)
        assert.strictEqual(ggmlTypeName(t!.type), ggmlTypeName(type), name)
      }
      expect("token_embd.weight", [96, 400], GgmlType.Q8_0)
      expect("output.weight", [96, 400], GgmlType.Q8_0)
      expect("output_norm.weight", [96], GgmlType.F32)
      expect("blk.1.attn_q.weight", [96, 96], GgmlType.Q8_0)
      expect("blk.1.attn_k.weight", [96, 32], GgmlType.Q8_0)
      expect("blk.1.attn_v.bias", [32], GgmlType.F32)
      expect("blk.1.attn_output.weight", [96, 96], GgmlType.Q8_0)
      expect("blk.1.ffn_down.weight", [512, 96], GgmlType.Q8_0)
      assert.strictEqual(file.tensors.length, 3 + 2 * 12)
    })
  )

  // Matrices whose rows are not whole blocks of the requested type fall back to F16, and are reported.
  it.effect("q4_k falls back to F16 for rows that are not multiples of 256", () =>
    Effect.gen(function* () {
      const options = {
        ...base("llama", "q4_k"),
        hidden: 64,
        ffn: 256,
        heads: 2,
        kvHeads: 1,
        path: join(dir, "fb.gguf")
      }
      const summary = yield* writeSyntheticModel(options)
      const file = yield* readGgufFile(options.path)
      assert.strictEqual(file.tensorsByName.get("blk.0.ffn_down.weight")?.type, GgmlType.Q4_K)
      assert.strictEqual(file.tensorsByName.get("blk.0.ffn_up.weight")?.type, GgmlType.F16)
      assert.include(summary.fallbacks, "blk.0.ffn_up.weight")
      assert.notInclude(summary.fallbacks, "blk.0.ffn_down.weight")
    })
  )

  // Same seed, same name: the same values whatever the file type; a different seed changes them.
  it("weights are a pure function of (seed, tensor name)", () => {
    const a = syntheticValues(1, "blk.0.attn_q.weight", 1000, 0, 0.5)
    const b = syntheticValues(1, "blk.0.attn_q.weight", 1000, 0, 0.5)
    const c = syntheticValues(2, "blk.0.attn_q.weight", 1000, 0, 0.5)
    assert.deepStrictEqual(a, b)
    assert.notDeepEqual(a, c)
    const mean = a.reduce((s, x) => s + x, 0) / a.length
    const std = Math.sqrt(a.reduce((s, x) => s + (x - mean) ** 2, 0) / a.length)
    assert.closeTo(mean, 0, 0.05)
    assert.closeTo(std, 0.5, 0.05)
  })

  // Tensors are generated in row chunks; the bytes do not depend on the chunk size (odd rows carry a spare sample).
  it.effect("chunked generation writes the same bytes as whole-tensor generation", () =>
    Effect.gen(function* () {
      const stream = gaussianStream(4, "t", 0, 1)
      const parts = [
        stream.fill(new Float32Array(3)),
        stream.fill(new Float32Array(0)),
        stream.fill(new Float32Array(6))
      ]
      assert.deepStrictEqual(Float32Array.from(parts.flatMap((p) => [...p])), syntheticValues(4, "t", 9, 0, 1))
      for (const type of ["f32", "q8_0", "q4_k"] as const) {
        const o = { ...base("qwen2", type), ffn: 257 + 256, vocab: 300 }
        const whole = yield* encodeGguf(syntheticModelSpec(o))
        const chunked = yield* encodeGguf(syntheticModelSpec(o, 1000))
        assert.deepStrictEqual(chunked, whole, type)
      }
    })
  )

  // Bad options are typed errors, not files.
  it.effect("rejects impossible shapes", () =>
    Effect.gen(function* () {
      const e1 = yield* Effect.flip(writeSyntheticModel({ ...base("llama", "f32"), vocab: 100 }))
      assert.include(e1.message, "vocab")
      const e2 = yield* Effect.flip(writeSyntheticModel({ ...base("llama", "f32"), heads: 4, kvHeads: 3 }))
      assert.include(e2.message, "kvHeads")
      const e3 = yield* Effect.flip(writeSyntheticModel({ ...base("llama", "f32"), hidden: 250 }))
      assert.include(e3.message, "hidden")
    })
  )
})
