/**
 * Split GGUF sets (issue 38 part 1): the sets gguf-py's writer makes (llama.cpp's own writer, as `convert_hf_to_gguf.py
 * --split-max-tensors` and Hugging Face's >50 GB models use), read as one model from their first part, and every
 * broken set refused in one line naming the part, before anything loads.
 */
import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import { spawnSync } from "node:child_process"
import { copyFileSync, mkdirSync, readFileSync, renameSync, rmSync, truncateSync } from "node:fs"
import { basename, join } from "node:path"
import { type GgufFile, type GgufTensorInfo, type ModelLoadError, tensorFilePath } from "../../src/domain/gguf.js"
import { readGgufFile, readGgufPart } from "../../src/layers/gguf/GgufReader.js"
import { sliceHash, sliceTensors, writeGgufSlice } from "../../src/layers/gguf/GgufSlice.js"
import { writeGgufFile } from "../../src/layers/gguf/GgufWriter.js"
import { readModelFacts, readModelLayout } from "../../src/layers/gguf/ModelCatalogLive.js"
import { writeConverted } from "../support/convertedModels.js"
import { swactorCommand } from "../../src/layers/agent/AgentProcesses.js"
import { modelFolder } from "../support/synthFiles.js"

const dir = modelFolder("swactor-split-set-")

/** A fresh folder holding a 3-part llama set (gguf-py; the middle part holds block 1 alone) and its one-file twin. */
const fixture = (name: string) => {
  const folder = join(dir, name)
  rmSync(folder, { recursive: true, force: true })
  mkdirSync(folder, { recursive: true })
  const whole = writeConverted("llama", join(folder, "whole.gguf"), 3)
  const parts = writeConverted("llama", join(folder, "llama.gguf"), 3, {
    cuts: ["blk.1.attn_norm.weight", "blk.2.attn_norm.weight"]
  })
  return { folder, whole, parts }
}

const refusal = (path: string) => Effect.flip(readGgufFile(path)) as Effect.Effect<ModelLoadError>

/** Rewrites part `part` (keeping its metadata, split keys included) with `tensors` from `from`. */
const rewritePart = (part: GgufFile, from: GgufFile, tensors: ReadonlyArray<GgufTensorInfo>, out: string) =>
  writeGgufFile(out, {
    metadata: [...part.metadataTypes].map(([key, kind]) => [key, { ...kind, value: part.metadata.get(key)! }] as const),
    alignment: part.alignment,
    tensors: tensors.map((t) => ({
      name: t.name,
      type: t.type,
      dims: t.dims,
      data: () => {
        const bytes = readFileSync(tensorFilePath(from, t))
        return new Uint8Array(bytes.buffer, bytes.byteOffset + t.offset, t.byteSize)
      }
    }))
  })

describe("split GGUF sets", () => {
  it.effect(
    "a set gguf-py wrote reads as one model: every tensor from its own part, bytes as in the one-file twin",
    () =>
      Effect.gen(function* () {
        const { parts, whole } = fixture("good")
        assert.deepStrictEqual(
          parts.map((p) => basename(p)),
          ["llama-00001-of-00003.gguf", "llama-00002-of-00003.gguf", "llama-00003-of-00003.gguf"]
        )
        const set = yield* readGgufFile(parts[0]!)
        const single = yield* readGgufFile(whole)
        assert.deepStrictEqual(
          set.parts?.map((p) => p.path),
          parts,
          "the parts, in split.no order"
        )
        assert.deepStrictEqual(
          set.tensors.map((t) => t.name),
          single.tensors.map((t) => t.name)
        )
        // the middle part holds block 1 and nothing else
        const second = set.tensors.filter((t) => t.part === 1).map((t) => t.name)
        assert.isAbove(second.length, 0)
        assert.isTrue(
          second.every((n) => n.startsWith("blk.1.")),
          second.join(", ")
        )
        assert.strictEqual(single.tensors.filter((t) => t.name.startsWith("blk.1.")).length, second.length)
        // the model's facts and layout are the one file's
        assert.deepStrictEqual(
          { ...(yield* readModelFacts(parts[0]!)), modelId: "", ggufSource: { _tag: "LocalPath", path: "" } },
          { ...(yield* readModelFacts(whole)), modelId: "", ggufSource: { _tag: "LocalPath", path: "" } }
        )
        assert.deepStrictEqual(yield* readModelLayout(parts[0]!), yield* readModelLayout(whole))
        // the tensor bytes, read through each tensor's part, equal the one file's (stage hashes across the cuts)
        for (const [layerStart, layerEndExclusive] of [
          [0, 4],
          [0, 1],
          [1, 2],
          [1, 3],
          [3, 4]
        ] as const) {
          const range = { layerStart, layerEndExclusive, numLayers: 4 }
          assert.strictEqual(yield* sliceHash(set, range), yield* sliceHash(single, range), `blocks ${range}`)
        }
        // a stage of block 1 reads part 2 only (and the shared rope factors, where the first part holds them)
        const stageParts = new Set(
          sliceTensors(set, { layerStart: 1, layerEndExclusive: 2, numLayers: 4 })
            .filter((t) => t.name.startsWith("blk."))
            .map((t) => t.part)
        )
        assert.deepStrictEqual([...stageParts], [1])
      })
  )

  it.effect("gguf-py's own cuts (a metadata-only first part, at most 5 tensors a part) read as one model", () =>
    Effect.gen(function* () {
      const folder = join(dir, "small-first")
      mkdirSync(folder, { recursive: true })
      const whole = writeConverted("llama", join(folder, "whole.gguf"), 3)
      const parts = writeConverted("llama", join(folder, "llama.gguf"), 3, { maxTensors: 5, smallFirst: true })
      assert.isAtLeast(parts.length, 5)
      const set = yield* readGgufFile(parts[0]!)
      assert.strictEqual(set.parts![0]!.tensorCount, 0, "the first part holds the metadata only")
      const single = yield* readGgufFile(whole)
      assert.strictEqual(set.tensors.length, single.tensors.length)
      const range = { layerStart: 0, layerEndExclusive: 4, numLayers: 4 }
      assert.strictEqual(yield* sliceHash(set, range), yield* sliceHash(single, range))
    })
  )

  it.effect("a missing part: one line naming it", () =>
    Effect.gen(function* () {
      const { parts } = fixture("missing")
      rmSync(parts[1]!)
      const e = yield* refusal(parts[0]!)
      assert.strictEqual(e.reason, "Io")
      assert.strictEqual(
        e.message,
        `the split set llama-00001-of-00003.gguf lacks part 2 of 3: llama-00002-of-00003.gguf not found in ${join(dir, "missing")}`
      )
    })
  )

  it.effect("a later part, or a folder holding the set alone, names the same set", () =>
    Effect.gen(function* () {
      const { parts, folder, whole } = fixture("later")
      const fromFirst = yield* readGgufFile(parts[0]!)
      const samePaths = (f: GgufFile) => f.parts?.map((p) => p.path)
      for (const named of [parts[1]!, parts[2]!]) {
        const f = yield* readGgufFile(named)
        assert.strictEqual(f.path, parts[0], named)
        assert.deepStrictEqual(samePaths(f), samePaths(fromFirst), named)
        assert.deepStrictEqual(
          f.tensors.map((t) => [t.name, t.part, t.offset]),
          fromFirst.tensors.map((t) => [t.name, t.part, t.offset])
        )
      }
      // the folder holds the set and its one-file twin: two models, so it names neither
      const two = yield* refusal(folder)
      assert.strictEqual(
        two.message,
        `the folder ${folder} holds 2 models (llama-00001-of-00003.gguf, whole.gguf): name one file`
      )
      rmSync(whole)
      const f = yield* readGgufFile(folder)
      assert.strictEqual(f.path, parts[0])
      assert.deepStrictEqual(samePaths(f), samePaths(fromFirst))
      // a folder with one lone file names that file
      const lone = join(dir, "lone")
      rmSync(lone, { recursive: true, force: true })
      mkdirSync(lone)
      copyFileSync(fixture("lone-src").whole, join(lone, "m.gguf"))
      assert.strictEqual((yield* readGgufFile(lone)).path, join(lone, "m.gguf"))
      const empty = join(dir, "empty")
      mkdirSync(empty, { recursive: true })
      assert.strictEqual((yield* refusal(empty)).message, `the folder ${empty} holds no .gguf file`)
    })
  )

  it.effect("a first part renamed: the error says how llama.cpp names it", () =>
    Effect.gen(function* () {
      const { parts, folder } = fixture("renamed")
      const renamed = join(folder, "my-model.gguf")
      renameSync(parts[0]!, renamed)
      const e = yield* refusal(renamed)
      assert.match(e.message, /first part of a 3-part split set must be named like my-model-00001-of-00003\.gguf/)
    })
  )

  it.effect("parts from two sets (another split.count): refused naming the part", () =>
    Effect.gen(function* () {
      const { parts, folder } = fixture("mixed")
      const other = writeConverted("llama", join(folder, "other.gguf"), 3, {
        cuts: ["blk.1.attn_norm.weight", "blk.2.attn_norm.weight", "blk.3.attn_norm.weight"]
      })
      copyFileSync(other[1]!, parts[1]!)
      const e = yield* refusal(parts[0]!)
      assert.strictEqual(e.path, parts[1])
      assert.strictEqual(
        e.message,
        `part 2 says "split.count" = 4, the first part says 3: the parts are from different sets`
      )
    })
  )

  it.effect("parts swapped: refused by split.no", () =>
    Effect.gen(function* () {
      const { parts, folder } = fixture("swapped")
      const spare = join(folder, "spare")
      renameSync(parts[1]!, spare)
      renameSync(parts[2]!, parts[1]!)
      renameSync(spare, parts[2]!)
      const e = yield* refusal(parts[0]!)
      assert.strictEqual(e.message, `part 2 of 3 says "split.no" = 2; it should be 1`)
    })
  )

  it.effect("a tensor in two parts, and a set short of its declared tensor count: refused", () =>
    Effect.gen(function* () {
      const { parts } = fixture("forged")
      const set = yield* readGgufFile(parts[0]!)
      const last = yield* readGgufPart(parts[2]!)
      const lastTensors = set.tensors.filter((t) => t.part === 2)
      const fromSecond = set.tensors.find((t) => t.part === 1)!
      // part 3 again, with a tensor of part 2 added
      yield* rewritePart(last, set, [...lastTensors, fromSecond], parts[2]!)
      const twice = yield* refusal(parts[0]!)
      assert.strictEqual(twice.message, `tensor "${fromSecond.name}" is in part 2 and again in part 3`)
      // part 3 without its last tensor: the set holds one fewer than split.tensors.count
      yield* rewritePart(last, set, lastTensors.slice(0, -1), parts[2]!)
      const short = yield* refusal(parts[0]!)
      assert.strictEqual(short.reason, "MissingTensor")
      assert.strictEqual(
        short.message,
        `the split set's 3 parts hold ${set.tensors.length - 1} tensors; "split.tensors.count" says ${set.tensors.length}`
      )
    })
  )

  it.effect("a part that is not a GGUF file: refused naming that part", () =>
    Effect.gen(function* () {
      const { parts } = fixture("garbage")
      truncateSync(parts[1]!, 10)
      const e = yield* refusal(parts[0]!)
      assert.strictEqual(e.path, parts[1])
    })
  )

  it("swactor run on a broken set: one line, exit 1, before any agent starts", () => {
    const { parts } = fixture("cli")
    rmSync(parts[2]!)
    const { command, args } = swactorCommand([
      "run",
      "--model",
      parts[0]!,
      "--prompt",
      "x",
      "--stages",
      "3",
      "--threads",
      "1"
    ])
    const r = spawnSync(command, args, { encoding: "utf8", timeout: 120_000 })
    assert.strictEqual(r.status, 1, r.stderr)
    const lines = r.stderr.trim().split("\n")
    assert.strictEqual(lines.length, 1, r.stderr)
    assert.match(lines[0]!, /lacks part 3 of 3: llama-00003-of-00003\.gguf not found/)
    assert.notMatch(r.stdout, /stage 0/, "no stage was placed")
  })

  it("swactor run --dry-run on a folder holding one set plans the set's 4 blocks", () => {
    const { folder, whole } = fixture("cli-folder")
    rmSync(whole)
    const { command, args } = swactorCommand(["run", "--model", folder, "--stages", "3", "--dry-run"])
    const r = spawnSync(command, args, { encoding: "utf8", timeout: 120_000 })
    assert.strictEqual(r.status, 0, r.stderr)
    assert.match(r.stdout + r.stderr, /stage 2 on node 3 \(.*\): 1 blocks \[3, 4\)/)
  })

  it.effect("a slice of a split set is one file without the split keys", () =>
    Effect.gen(function* () {
      const { parts, folder } = fixture("slice")
      const set = yield* readGgufFile(parts[0]!)
      const out = join(folder, "slice.gguf")
      const range = { layerStart: 1, layerEndExclusive: 3, numLayers: 4 }
      yield* writeGgufSlice(set, range, out)
      const slice = yield* readGgufFile(out)
      assert.isUndefined(slice.parts)
      assert.isFalse([...slice.metadata.keys()].some((k) => k.startsWith("split.")))
      assert.strictEqual(yield* sliceHash(slice, range), yield* sliceHash(set, range))
    })
  )
})
