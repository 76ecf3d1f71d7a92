// What a node's announcements say it holds (issue 39): the complete slices of its slice cache, each with its model,
// blocks and size, newest first and at most MAX_ANNOUNCED_SLICES, read from the files' headers; partial, foreign and
// unreadable files are left out; the field decodes from an announcement and is optional for older nodes.
import { assert, describe, it } from "@effect/vitest"
import { mkdtempSync, rmSync, statSync, utimesSync, writeFileSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { Effect, Schema } from "effect"
import { NodeResources } from "../../src/domain/discovery.js"
import { readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { sliceHash, writeGgufSlice } from "../../src/layers/gguf/GgufSlice.js"
import { heldSlices } from "../../src/layers/gguf/SliceCache.js"
import { requireModel } from "../support/models.js"

/** Writes stories260K's slice of blocks [start, end) into `dir` as the cache names it; its hash. */
const cacheSlice = (dir: string, start: number, end: number) =>
  Effect.gen(function* () {
    const file = yield* readGgufFile(requireModel("stories260K.gguf"))
    const range = { layerStart: start, layerEndExclusive: end, numLayers: 5 }
    const hash = yield* sliceHash(file, range)
    yield* writeGgufSlice(file, range, join(dir, `${hash}.gguf`))
    return hash
  })

describe("a node's cached slices, for its announcements", () => {
  it.effect("lists each complete slice with its model, blocks and size, newest first; skips what is not one", () =>
    Effect.gen(function* () {
      const dir = mkdtempSync(join(tmpdir(), "swactor-held-"))
      yield* Effect.addFinalizer(() => Effect.sync(() => rmSync(dir, { recursive: true, force: true })))
      const head = yield* cacheSlice(dir, 0, 2)
      const tail = yield* cacheSlice(dir, 2, 5)
      // the head slice is the newer one
      utimesSync(join(dir, `${tail}.gguf`), new Date(1_000_000), new Date(1_000_000))
      // a partial transfer, a corrupt file under a slice's name, and a file that is not a slice's
      writeFileSync(join(dir, `${"a".repeat(64)}.gguf.partial`), "partial")
      writeFileSync(join(dir, `${"b".repeat(64)}.gguf`), "not a gguf file")
      writeFileSync(join(dir, "notes.gguf"), "other")
      const held = yield* heldSlices(dir)
      assert.deepStrictEqual(held, [
        {
          model: "llama",
          hash: head.slice(0, 16),
          layerStart: 0,
          layerEndExclusive: 2,
          numLayers: 5,
          bytes: statSync(join(dir, `${head}.gguf`)).size
        },
        {
          model: "llama",
          hash: tail.slice(0, 16),
          layerStart: 2,
          layerEndExclusive: 5,
          numLayers: 5,
          bytes: statSync(join(dir, `${tail}.gguf`)).size
        }
      ])
      // a missing folder holds nothing
      assert.deepStrictEqual(yield* heldSlices(join(dir, "missing")), [])
    }).pipe(Effect.scoped)
  )

  it("the resources of a node that announces no cache (an older node) still decode", () => {
    const older = { totalMemoryBytes: 8, freeMemoryBytes: 4, cores: 2, backend: "cpu" }
    assert.deepStrictEqual(Schema.decodeUnknownSync(NodeResources)(older), older)
    const slice = { model: "m", hash: "0123456789abcdef", layerStart: 0, layerEndExclusive: 2, numLayers: 5, bytes: 9 }
    assert.deepStrictEqual(Schema.decodeUnknownSync(NodeResources)({ ...older, cached: [slice] }).cached, [slice])
  })
})
