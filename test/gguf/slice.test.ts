// A stage's GGUF slice (issue 10, first piece of weight delivery): only the stage's tensors, valid GGUF, the same
// content hash as the source's tensors, and a corrupted slice detected by that hash.
import * as Fs from "node:fs"
import * as Os from "node:os"
import * as Path from "node:path"
import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import * as Gguf from "../../src/layers/gguf/GgufReader.js"
import { sliceHash, writeGgufSlice } from "../../src/layers/gguf/GgufSlice.js"
import { openInProcessPipeline } from "../../src/services/InProcessPipeline.js"
import { greedyRun, liveExecutor } from "../support/engine.js"
import { requireModel } from "../support/models.js"

const tmp = (name: string) => Path.join(Os.tmpdir(), `swactor-slice-${process.pid}-${name}.gguf`)

describe("GGUF slices (stories260K)", () => {
  it.effect("the last stage's slice holds its blocks and the output head, the source's metadata and tensor hash", () =>
    Effect.gen(function* () {
      const source = yield* Gguf.readGgufFile(requireModel("stories260K.gguf"))
      const range = { layerStart: 2, layerEndExclusive: 5, numLayers: 5 }
      const path = tmp("last")
      yield* Effect.addFinalizer(() => Effect.sync(() => Fs.rmSync(path, { force: true })))
      yield* writeGgufSlice(source, range, path)
      const slice = yield* Gguf.readGgufFile(path)
      const tied = !source.tensorsByName.has("output.weight")
      const expected = source.tensors
        .map((t) => t.name)
        .filter(
          (name) => /^blk\.[234]\./.test(name) || name.startsWith("output") || (tied && name === "token_embd.weight")
        )
      assert.deepStrictEqual(
        slice.tensors.map((t) => t.name),
        expected
      )
      assert.isFalse(slice.tensors.some((t) => /^blk\.[01]\./.test(t.name)))
      assert.deepStrictEqual(slice.metadata, source.metadata)
      assert.isBelow(slice.fileSize, source.fileSize)
      assert.strictEqual(yield* sliceHash(slice, range), yield* sliceHash(source, range))
      // Another range of the same file hashes differently.
      assert.notStrictEqual(yield* sliceHash(source, { ...range, layerStart: 3 }), yield* sliceHash(source, range))
    }).pipe(Effect.scoped)
  )

  it.effect("a corrupted slice no longer matches the source's hash", () =>
    Effect.gen(function* () {
      const source = yield* Gguf.readGgufFile(requireModel("stories260K.gguf"))
      const range = { layerStart: 0, layerEndExclusive: 2, numLayers: 5 }
      const path = tmp("corrupt")
      yield* Effect.addFinalizer(() => Effect.sync(() => Fs.rmSync(path, { force: true })))
      yield* writeGgufSlice(source, range, path)
      const slice = yield* Gguf.readGgufFile(path)
      const target = slice.tensorsByName.get("blk.1.attn_q.weight")!
      const fd = Fs.openSync(path, "r+")
      const byte = Buffer.alloc(1)
      Fs.readSync(fd, byte, 0, 1, target.offset + 7)
      byte[0] = byte[0]! ^ 0xff
      Fs.writeSync(fd, byte, 0, 1, target.offset + 7)
      Fs.closeSync(fd)
      assert.notStrictEqual(yield* sliceHash(yield* Gguf.readGgufFile(path), range), yield* sliceHash(source, range))
    }).pipe(Effect.scoped)
  )

  it.live(
    "a whole-model slice runs the same greedy tokens as the source file",
    () =>
      Effect.gen(function* () {
        const modelPath = requireModel("stories260K.gguf")
        const source = yield* Gguf.readGgufFile(modelPath)
        const path = tmp("whole")
        yield* Effect.addFinalizer(() => Effect.sync(() => Fs.rmSync(path, { force: true })))
        yield* writeGgufSlice(source, { layerStart: 0, layerEndExclusive: 5, numLayers: 5 }, path)
        const options = { threads: 1, contextLength: 256 }
        const prompt = [1, 403, 407, 261, 378]
        const fromSource = yield* greedyRun(modelPath, [0, 2, 5], prompt, 8, options)
        const fromSlice = yield* greedyRun(path, [0, 2, 5], prompt, 8, options)
        assert.deepStrictEqual(fromSlice.tokens, fromSource.tokens)
      }).pipe(Effect.scoped),
    60_000
  )

  // Each stage loads only its own slice ([0, 2) without the output head, [2, 5) without blocks 0-1) and the split
  // gives exactly the logits of the source file.
  it.live(
    "two stages each loading only its slice give the source file's logits",
    () =>
      Effect.gen(function* () {
        const modelPath = requireModel("stories260K.gguf")
        const source = yield* Gguf.readGgufFile(modelPath)
        const paths = [tmp("stage0"), tmp("stage1")]
        yield* Effect.addFinalizer(() => Effect.sync(() => paths.forEach((p) => Fs.rmSync(p, { force: true }))))
        yield* writeGgufSlice(source, { layerStart: 0, layerEndExclusive: 2, numLayers: 5 }, paths[0]!)
        yield* writeGgufSlice(source, { layerStart: 2, layerEndExclusive: 5, numLayers: 5 }, paths[1]!)
        const options = { threads: 1, contextLength: 256 }
        const prompt = [1, 403, 407, 261, 378]
        const fromSource = yield* openInProcessPipeline(modelPath, [0, 2, 5], options)
        const fromSlices = yield* openInProcessPipeline(modelPath, [0, 2, 5], options, (i) => paths[i]!)
        const a = yield* fromSource.run(0, prompt)
        const b = yield* fromSlices.run(0, prompt)
        assert.deepStrictEqual(Array.from(b), Array.from(a))
      }).pipe(Effect.scoped, Effect.provide(liveExecutor)),
    60_000
  )
})
