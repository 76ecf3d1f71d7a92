import { assert, describe, it } from "@effect/vitest"
import { Cause, Effect, Exit, Option } from "effect"
import koffi from "koffi"
import { join } from "node:path"
import { GgmlType, ggmlTypeInfo, tensorBytes } from "../../src/domain/ggmlTypes.js"
import { type GgufFile, GgufValueType, ModelLoadReason } from "../../src/domain/gguf.js"
import { parseGgufBytes } from "../../src/layers/gguf/GgufReader.js"
import { encodeGguf, GgufValues } from "../../src/layers/gguf/GgufWriter.js"
import { syntheticModelSpec } from "../../src/layers/gguf/Synthetic.js"
import { locateGgmlLibraries } from "../../src/layers/ggml/Platform.js"
import { readFileSync } from "node:fs"
import { requireModel } from "../support/models.js"
import { type Field, fieldLayout, type Layout, readInt, withInt } from "./fields.js"

/** Seeded generator (mulberry32): the same seed replays the same cases. */
const rng = (seed: number) => {
  let s = seed >>> 0
  const next = () => {
    s = (s + 0x6d2b79f5) >>> 0
    let t = s
    t = Math.imul(t ^ (t >>> 15), t | 1)
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61)
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296
  }
  return {
    next,
    int: (n: number) => Math.floor(next() * n),
    pick: <A>(xs: ReadonlyArray<A>): A => xs[Math.floor(next() * xs.length)]!
  }
}
type Rng = ReturnType<typeof rng>

const tinyModel = Effect.runSync(
  encodeGguf(
    syntheticModelSpec({
      path: "",
      arch: "qwen3",
      layers: 1,
      hidden: 32,
      ffn: 64,
      heads: 2,
      kvHeads: 1,
      vocab: 300,
      contextLength: 64,
      type: "f32",
      seed: 3
    })
  )
)

const mixed = Effect.runSync(
  encodeGguf({
    metadata: [
      ["general.architecture", GgufValues.string("llama")],
      ["general.alignment", GgufValues.u32(64)],
      ["b", GgufValues.bool(false)],
      ["i64", GgufValues.i64(-5n)],
      ["f", GgufValues.array(GgufValueType.FLOAT64, [1, 2, 3])],
      ["s", GgufValues.array(GgufValueType.STRING, ["one", "two"])]
    ],
    tensors: [
      { name: "q", type: GgmlType.Q4_0, dims: [64, 3], data: () => new Uint8Array(108).fill(7) },
      { name: "h", type: GgmlType.BF16, dims: [5, 2, 3], data: () => new Uint8Array(60).fill(9) },
      { name: "k", type: GgmlType.Q6_K, dims: [256], data: () => new Uint8Array(210).fill(1) }
    ]
  })
)

const interesting = (cur: bigint, size: number): ReadonlyArray<bigint> => {
  const max = (1n << BigInt(size * 8)) - 1n
  return [
    0n,
    1n,
    2n,
    3n,
    31n,
    32n,
    33n,
    255n,
    256n,
    0x7fffn,
    0x8000n,
    0xffffn,
    0x7fffffffn,
    0x80000000n,
    0xffffffffn,
    0x100000000n,
    2n ** 53n,
    2n ** 53n + 1n,
    2n ** 62n,
    2n ** 63n - 1n,
    2n ** 63n,
    max,
    max - 1n,
    cur + 1n,
    cur - 1n,
    cur * 2n,
    cur + 32n,
    cur - 32n,
    cur / 2n
  ].map((v) => BigInt.asUintN(size * 8, v))
}

const mutate = (r: Rng, base: Uint8Array, layout: Layout): { bytes: Uint8Array; what: string } => {
  let bytes = base
  const what: Array<string> = []
  const headerEnd = layout.tableEnd + 64
  const pos = () => (r.next() < 0.85 ? r.int(Math.min(headerEnd, bytes.length)) : r.int(bytes.length))
  const rounds = 1 + (r.next() < 0.25 ? r.int(3) : 0)
  for (let k = 0; k < rounds; k++) {
    const op = r.int(6)
    if (op === 0) {
      bytes = bytes.slice()
      const n = 1 + r.int(8)
      for (let i = 0; i < n; i++) {
        const p = pos()
        bytes[p] = r.next() < 0.5 ? bytes[p]! ^ (1 << r.int(8)) : r.int(256)
      }
      what.push(`flip ${n}`)
    } else if (op === 1) {
      const p = pos()
      const n = 1 + r.int(16)
      const ins = new Uint8Array(n).map(() => r.int(256))
      const out = new Uint8Array(bytes.length + n)
      out.set(bytes.subarray(0, p))
      out.set(ins, p)
      out.set(bytes.subarray(p), p + n)
      bytes = out
      what.push(`insert ${n}@${p}`)
    } else if (op === 2) {
      const p = pos()
      const n = 1 + r.int(16)
      const end = Math.min(bytes.length, p + n)
      const out = new Uint8Array(bytes.length - (end - p))
      out.set(bytes.subarray(0, p))
      out.set(bytes.subarray(end), p)
      bytes = out
      what.push(`delete ${n}@${p}`)
    } else if (op === 3) {
      const n = r.int(bytes.length)
      bytes = bytes.subarray(0, n)
      what.push(`truncate ${n}`)
    } else {
      // Field-targeted integer mutation (only meaningful while the layout still matches).
      const numeric = layout.fields.filter(
        (f: Field) =>
          f.kind !== "keyBytes" &&
          f.kind !== "nameBytes" &&
          f.kind !== "stringBytes" &&
          f.size <= 8 &&
          f.at + f.size <= bytes.length
      )
      const f = numeric.length > 0 ? r.pick(numeric) : undefined
      if (f !== undefined && (f.size === 1 || f.size === 2 || f.size === 4 || f.size === 8)) {
        const v = r.next() < 0.8 ? r.pick(interesting(readInt(bytes, f), f.size)) : BigInt(r.int(2 ** 31))
        bytes = withInt(bytes, f, v)
        what.push(`${f.kind}(${f.owner ?? ""}${f.index !== undefined ? `[${f.index}]` : ""})@${f.at}=${v}`)
      }
    }
  }
  return { bytes, what: what.join(", ") }
}

/** ggml's own GGUF parser (gguf_init_from_buffer, no tensor data), to confirm it accepts what we accept. */
const ggmlGguf = (() => {
  const located = locateGgmlLibraries()
  if ("tried" in located) throw new Error(`ggml libraries not found (tried ${located.tried.join(", ")})`)
  const lib = koffi.load(join(located.dir, located.baseLib))
  const Params = koffi.struct("swactor_fuzz_gguf_init_params", { no_alloc: "bool", ctx: "void *" })
  const init = lib.func("gguf_init_from_buffer", "void *", ["void *", "size_t", Params])
  const free = lib.func("gguf_free", "void", ["void *"])
  const nTensors = lib.func("gguf_get_n_tensors", "int64_t", ["void *"])
  const dataOffset = lib.func("gguf_get_data_offset", "size_t", ["void *"])
  const tensorOffset = lib.func("gguf_get_tensor_offset", "size_t", ["void *", "int64_t"])
  const tensorType = lib.func("gguf_get_tensor_type", "int", ["void *", "int64_t"])
  const tensorSize = lib.func("gguf_get_tensor_size", "size_t", ["void *", "int64_t"])
  return (bytes: Uint8Array) => {
    const ctx = init(bytes, bytes.length, { no_alloc: true, ctx: null })
    if (ctx === null) return undefined
    try {
      const n = Number(nTensors(ctx))
      const base = Number(dataOffset(ctx))
      const tensors = Array.from({ length: n }, (_, i) => ({
        offset: base + Number(tensorOffset(ctx, i)),
        type: Number(tensorType(ctx, i)),
        size: Number(tensorSize(ctx, i))
      }))
      return { dataOffset: base, tensors }
    } finally {
      free(ctx)
    }
  }
})()

/** ggml parses the file to the same table (when it has tensors; its data offset is unpadded otherwise). */
const checkGgmlAgrees = (file: GgufFile, bytes: Uint8Array, what: string) => {
  const theirs = ggmlGguf(bytes)
  if (theirs === undefined) return assert.fail(`${what}: ggml's gguf parser rejects a file the reader accepted`)
  assert.strictEqual(theirs.tensors.length, file.tensors.length, what)
  if (file.tensors.length > 0) assert.strictEqual(theirs.dataOffset, file.dataOffset, what)
  file.tensors.forEach((t, i) => {
    assert.deepStrictEqual(theirs.tensors[i], { offset: t.offset, type: t.type, size: t.byteSize }, what)
  })
}

/** What an accepted file must satisfy: nothing ggml could trip over. */
const checkAccepted = (file: GgufFile, size: number, what: string) => {
  let end = file.dataOffset
  for (const t of file.tensors) {
    const info = ggmlTypeInfo(t.type)
    assert.isDefined(info, what)
    assert.isTrue(t.dims.length >= 1 && t.dims.length <= 4, what)
    for (const d of t.dims) assert.isTrue(Number.isSafeInteger(d) && d > 0, what)
    assert.strictEqual(t.byteSize, tensorBytes(t.type, t.dims), what)
    assert.strictEqual((t.offset - file.dataOffset) % file.alignment, 0, what)
    assert.isAtLeast(t.offset, end, what)
    assert.isAtMost(t.offset + t.byteSize, size, what)
    end = t.offset + t.byteSize
  }
  assert.strictEqual(file.tensorsByName.size, file.tensors.length, what)
}

describe("GGUF reader fuzz", () => {
  // ggml's own parser reads the unmutated files to the same tensor table.
  it("ggml's gguf parser agrees on the base files", () => {
    const stories = new Uint8Array(readFileSync(requireModel("stories260K.gguf")))
    for (const bytes of [tinyModel, mixed, stories])
      checkGgmlAgrees(Effect.runSync(parseGgufBytes(bytes)), bytes, "base")
  })

  // Seeded random corruption of valid files: every case is parsed or rejected as a typed ModelLoadError,
  // never a thrown defect, and whatever is accepted is internally consistent and parsed identically by ggml.
  // SWACTOR_FUZZ_SEED / SWACTOR_FUZZ_CASES run a longer or different campaign locally.
  const seed = Number(process.env["SWACTOR_FUZZ_SEED"] ?? 20261129)
  const cases = Number(process.env["SWACTOR_FUZZ_CASES"] ?? 1200)
  it(`${cases} mutated files (seed ${seed}) end in success or a typed ModelLoadError`, () => {
    const bases = [
      { name: "tiny qwen3", bytes: tinyModel, layout: fieldLayout(tinyModel) },
      { name: "mixed types", bytes: mixed, layout: fieldLayout(mixed) }
    ]
    const r = rng(seed)
    const reasons = new Map<string, number>()
    let accepted = 0
    const started = performance.now()
    for (let i = 0; i < cases; i++) {
      const base = bases[i % bases.length]!
      const { bytes, what } = mutate(r, base.bytes, base.layout)
      const label = `case ${i} (${base.name}: ${what})`
      const exit = Effect.runSyncExit(parseGgufBytes(bytes, "fuzz.gguf"))
      if (Exit.isSuccess(exit)) {
        accepted++
        checkAccepted(exit.value, bytes.length, label)
        checkGgmlAgrees(exit.value, bytes, label)
        continue
      }
      const failure = Cause.failureOption(exit.cause)
      if (Option.isNone(failure)) assert.fail(`${label}: defect ${Cause.pretty(exit.cause)}`)
      const e = failure.value
      assert.strictEqual(e._tag, "ModelLoadError", label)
      assert.include(ModelLoadReason.literals, e.reason, label)
      assert.isAbove(e.message.length, 10, label)
      reasons.set(e.reason, (reasons.get(e.reason) ?? 0) + 1)
    }
    const seconds = (performance.now() - started) / 1000
    // The corpus exercises many distinct rejections, and some mutations (e.g. in tensor data) stay valid.
    assert.isAtLeast(reasons.size, 5, JSON.stringify([...reasons]))
    assert.isAbove(accepted, 0)
    assert.isBelow(seconds, 20 * Math.max(1, cases / 1200))
    if (process.env["SWACTOR_FUZZ_REPORT"] !== undefined) console.log(accepted, [...reasons], seconds)
  })
})
