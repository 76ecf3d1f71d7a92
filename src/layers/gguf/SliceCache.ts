/**
 * A node's cache of received GGUF slices (weight delivery, receiving side), one file per content hash
 * (`GgufSlice.sliceHash`): `<dir>/<hash>.gguf` once complete and verified, `<dir>/<hash>.gguf.partial` while bytes
 * arrive. Appends must continue exactly where the partial file ends, so an interrupted transfer resumes from
 * `status().have`; `finish` parses the file and checks its stage-tensor hash before it becomes the slice, and a
 * complete slice is checked again before reuse, so a corrupted one is reported missing (and fetched again).
 * Bytes arrive by `append` (control RPC chunks) or straight into `partialPath` (the byte stream of SliceStream.ts, which
 * checks the whole file's SHA-256 as it goes; `promote` then makes it the slice without hashing it again).
 */
import * as Fs from "node:fs"
import * as Path from "node:path"
import { Data, Effect } from "effect"
import { type CachedSlice, MAX_ANNOUNCED_SLICES } from "../../domain/discovery.js"
import { type GgufFile } from "../../domain/gguf.js"
import { readGgufFile } from "./GgufReader.js"
import { sliceHash, type SliceRange } from "./GgufSlice.js"

export class SliceCacheError extends Data.TaggedError("SliceCacheError")<{
  readonly hash: string
  readonly reason: "BadHash" | "OutOfOrder" | "Corrupt" | "Io"
  readonly message: string
}> {}

export type SliceStatus =
  { readonly _tag: "Complete"; readonly path: string } | { readonly _tag: "Partial"; readonly have: number }

const HASH = /^[0-9a-f]{64}$/

const completePath = (dir: string, hash: string) => Path.join(dir, `${hash}.gguf`)
const partialPathIn = (dir: string, hash: string) => `${completePath(dir, hash)}.partial`

const checkHash = (hash: string) =>
  HASH.test(hash)
    ? Effect.void
    : Effect.fail(new SliceCacheError({ hash, reason: "BadHash", message: `"${hash}" is not a SHA-256 hex digest` }))

const io = (hash: string) => (e: unknown) => new SliceCacheError({ hash, reason: "Io", message: String(e) })

/** Whether the slice's tensors hash to `hash` (a file that does not parse does not). */
const verified = (path: string, hash: string, range: SliceRange) =>
  readGgufFile(path).pipe(
    Effect.flatMap((file) => sliceHash(file, range)),
    Effect.map((actual) => actual === hash),
    Effect.orElseSucceed(() => false)
  )

/** What the cache in `dir` holds for `hash`: a verified slice, or how many bytes of a partial one (0: none). */
const sliceStatus = (dir: string, hash: string, range: SliceRange): Effect.Effect<SliceStatus, SliceCacheError> =>
  Effect.gen(function* () {
    const complete = completePath(dir, hash)
    const partial = partialPathIn(dir, hash)
    yield* checkHash(hash)
    if (Fs.existsSync(complete)) {
      if (yield* verified(complete, hash, range)) return { _tag: "Complete", path: complete } as const
      // Corrupted since it was verified: drop it, so it is fetched again.
      yield* Effect.try({ try: () => Fs.rmSync(complete, { force: true }), catch: io(hash) })
    }
    const have = yield* Effect.try({
      try: () => (Fs.existsSync(partial) ? Fs.statSync(partial).size : 0),
      catch: io(hash)
    })
    return { _tag: "Partial", have } as const
  })

/** Appends `bytes` at `offset`, which must be where the partial file ends (a resumed transfer continues there). */
const appendChunk = (
  dir: string,
  hash: string,
  offset: number,
  bytes: Uint8Array
): Effect.Effect<number, SliceCacheError> =>
  Effect.gen(function* () {
    yield* checkHash(hash)
    const partial = partialPathIn(dir, hash)
    return yield* Effect.try({
      try: () => {
        Fs.mkdirSync(dir, { recursive: true })
        const have = Fs.existsSync(partial) ? Fs.statSync(partial).size : 0
        if (offset !== have)
          return new SliceCacheError({
            hash,
            reason: "OutOfOrder",
            message: `chunk at ${offset}, the partial slice has ${have} bytes`
          })
        Fs.appendFileSync(partial, bytes)
        return have + bytes.length
      },
      catch: io(hash)
    }).pipe(Effect.flatMap((r) => (typeof r === "number" ? Effect.succeed(r) : Effect.fail(r))))
  })

/** Verifies the partial slice and makes it the slice; a mismatch deletes it and fails `Corrupt`. */
const finishSlice = (dir: string, hash: string, range: SliceRange): Effect.Effect<string, SliceCacheError> =>
  Effect.gen(function* () {
    yield* checkHash(hash)
    const partial = partialPathIn(dir, hash)
    if (!(yield* verified(partial, hash, range))) {
      yield* Effect.try({ try: () => Fs.rmSync(partial, { force: true }), catch: io(hash) })
      return yield* new SliceCacheError({
        hash,
        reason: "Corrupt",
        message: "the received slice does not parse or its tensors do not match the hash; it was discarded"
      })
    }
    yield* Effect.try({ try: () => Fs.renameSync(partial, completePath(dir, hash)), catch: io(hash) })
    return completePath(dir, hash)
  })

/** Makes the partial slice the slice as it is (its bytes were verified on arrival); `Corrupt` when none is there. */
const promoteSlice = (dir: string, hash: string): Effect.Effect<string, SliceCacheError> =>
  Effect.gen(function* () {
    yield* checkHash(hash)
    const partial = partialPathIn(dir, hash)
    if (!Fs.existsSync(partial)) {
      return yield* new SliceCacheError({ hash, reason: "Corrupt", message: "no received slice to finish" })
    }
    yield* Effect.try({ try: () => Fs.renameSync(partial, completePath(dir, hash)), catch: io(hash) })
    return completePath(dir, hash)
  })

export const makeSliceCache = (dir: string) => ({
  /** What the cache holds for `hash`: a verified slice, or how many bytes of a partial one (0: none). */
  status: (hash: string, range: SliceRange) => sliceStatus(dir, hash, range),
  /** Appends `bytes` at `offset`, which must be where the partial file ends (a resumed transfer continues there). */
  append: (hash: string, offset: number, bytes: Uint8Array) => appendChunk(dir, hash, offset, bytes),
  /** Verifies the partial slice and makes it the slice; a mismatch deletes it and fails `Corrupt`. */
  finish: (hash: string, range: SliceRange) => finishSlice(dir, hash, range),
  /** The partial file of `hash` (a `BadHash` failure for a malformed hash). */
  partialPath: (hash: string): Effect.Effect<string, SliceCacheError> =>
    checkHash(hash).pipe(Effect.as(partialPathIn(dir, hash))),
  /** Makes the partial slice the slice as it is (its bytes were verified on arrival); `Corrupt` when none is there. */
  promote: (hash: string) => promoteSlice(dir, hash),
  dir
})

/** What a complete slice file holds: its model, its blocks (from its tensors' block numbers) and its size. */
const describeSlice = (file: GgufFile, hash: string): CachedSlice | undefined => {
  const architecture = file.metadata.get("general.architecture")
  const name = file.metadata.get("general.name")
  const numLayers = typeof architecture === "string" ? file.metadata.get(`${architecture}.block_count`) : undefined
  const blocks = file.tensors.flatMap((t) => {
    const block = /^blk\.(\d+)\./.exec(t.name)
    return block === null ? [] : [Number(block[1])]
  })
  if (typeof architecture !== "string" || typeof numLayers !== "number" || blocks.length === 0) return undefined
  return {
    model: typeof name === "string" && name !== "" ? name : architecture,
    hash: hash.slice(0, 16),
    layerStart: Math.min(...blocks),
    layerEndExclusive: Math.max(...blocks) + 1,
    numLayers,
    bytes: file.fileSize
  }
}

/** The complete slice files in `dir` (`<hash>.gguf`), newest first, at most `limit`; none when it cannot be read. */
const completeSliceFiles = (dir: string, limit: number) => {
  const files: Array<{ path: string; hash: string; mtime: number }> = []
  try {
    for (const name of Fs.readdirSync(dir)) {
      const hash = name.slice(0, -".gguf".length)
      if (!name.endsWith(".gguf") || !HASH.test(hash)) continue
      const path = Path.join(dir, name)
      files.push({ path, hash, mtime: Fs.statSync(path).mtimeMs })
    }
  } catch {
    // no cache folder yet, or a file gone between the listing and its stat: what was read so far
  }
  return files.sort((a, b) => b.mtime - a.mtime).slice(0, limit)
}

/**
 * The complete slices in the cache folder `dir`, newest first, at most MAX_ANNOUNCED_SLICES (for a node's
 * announcements). Reads each file's header only; a file that does not parse, a partial one and a missing folder
 * give nothing.
 */
export const heldSlices = (dir: string): Effect.Effect<ReadonlyArray<CachedSlice>> =>
  Effect.forEach(completeSliceFiles(dir, MAX_ANNOUNCED_SLICES), ({ path, hash }) =>
    readGgufFile(path).pipe(
      Effect.map((file) => describeSlice(file, hash)),
      Effect.orElseSucceed(() => undefined)
    )
  ).pipe(Effect.map((described) => described.filter((d): d is CachedSlice => d !== undefined)))
