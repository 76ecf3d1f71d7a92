// A node's cache of received slices (weight delivery, receiving side; issue 10): resumable appends, verification by
// the stage-tensor hash, reuse, and a corrupted slice reported missing so it is fetched again.
import * as Fs from "node:fs"
import * as Os from "node:os"
import * as Path from "node:path"
import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import * as Gguf from "../../src/layers/gguf/GgufReader.js"
import { sliceHash, writeGgufSlice } from "../../src/layers/gguf/GgufSlice.js"
import { makeSliceCache } from "../../src/layers/gguf/SliceCache.js"
import { requireModel } from "../support/models.js"

const range = { layerStart: 2, layerEndExclusive: 5, numLayers: 5 }

/** A cache in a fresh folder and the bytes of the stage's slice, as a sender would stream them. */
const fixture = Effect.gen(function* () {
  const dir = Fs.mkdtempSync(Path.join(Os.tmpdir(), "swactor-slice-cache-"))
  yield* Effect.addFinalizer(() => Effect.sync(() => Fs.rmSync(dir, { recursive: true, force: true })))
  const source = yield* Gguf.readGgufFile(requireModel("stories260K.gguf"))
  const sent = Path.join(dir, "sender.gguf")
  yield* writeGgufSlice(source, range, sent)
  const bytes = Fs.readFileSync(sent)
  Fs.rmSync(sent)
  return { cache: makeSliceCache(Path.join(dir, "cache")), bytes, hash: yield* sliceHash(source, range) }
})

describe("slice cache", () => {
  it.scoped("an interrupted transfer resumes where it stopped; the verified slice is reused", () =>
    Effect.gen(function* () {
      const { bytes, cache, hash } = yield* fixture
      assert.deepStrictEqual(yield* cache.status(hash, range), { _tag: "Partial", have: 0 })
      const cut = Math.floor(bytes.length / 3)
      yield* cache.append(hash, 0, bytes.subarray(0, cut))
      // The transfer broke here; the next one asks where to continue.
      const resumed = yield* cache.status(hash, range)
      assert.deepStrictEqual(resumed, { _tag: "Partial", have: cut })
      const refused = yield* Effect.flip(cache.append(hash, 0, bytes.subarray(0, cut)))
      assert.strictEqual(refused.reason, "OutOfOrder")
      yield* cache.append(hash, cut, bytes.subarray(cut))
      const path = yield* cache.finish(hash, range)
      assert.isTrue(Fs.readFileSync(path).equals(bytes))
      // A later run finds it complete: nothing to transfer.
      assert.deepStrictEqual(yield* cache.status(hash, range), { _tag: "Complete", path })
    })
  )

  it.scoped("a corrupted transfer is refused, and a slice corrupted in the cache is fetched again", () =>
    Effect.gen(function* () {
      const { bytes, cache, hash } = yield* fixture
      const bad = Buffer.from(bytes)
      bad[bad.length - 10] = bad[bad.length - 10]! ^ 0xff
      yield* cache.append(hash, 0, bad)
      const corrupt = yield* Effect.flip(cache.finish(hash, range))
      assert.strictEqual(corrupt.reason, "Corrupt")
      assert.deepStrictEqual(yield* cache.status(hash, range), { _tag: "Partial", have: 0 })

      yield* cache.append(hash, 0, bytes)
      const path = yield* cache.finish(hash, range)
      const onDisk = Fs.readFileSync(path)
      onDisk[onDisk.length - 10] = onDisk[onDisk.length - 10]! ^ 0xff
      Fs.writeFileSync(path, onDisk)
      assert.deepStrictEqual(yield* cache.status(hash, range), { _tag: "Partial", have: 0 })
      assert.isFalse(Fs.existsSync(path))
    })
  )

  it.scoped("a hash that is not a SHA-256 digest is refused before touching the disk", () =>
    Effect.gen(function* () {
      const { cache } = yield* fixture
      const refused = yield* Effect.flip(cache.status("../../etc/passwd", range))
      assert.strictEqual(refused.reason, "BadHash")
    })
  )
})
