/**
 * Split GGUF sets (issue 38): the files `llama-gguf-split` and gguf-py's writer make when a model is cut into parts
 * (`<prefix>-00001-of-00005.gguf` …), as Hugging Face ships every model over 50 GB. The first part carries the
 * metadata and every part its `split.no` (0-based), `split.count` and `split.tensors.count`; each part has its own
 * tensor table, whose offsets are into that part. llama.cpp finds the other parts from the first part's name
 * (`llama_split_prefix` / `llama_split_path`), and so does this module.
 *
 * `mergeSplitSet` checks a set as a whole before anything is loaded from it: every part present and in its place,
 * the same count (and the same model, where a part names one) in each, no tensor in two parts, and as many tensors
 * as declared. The result is one `GgufFile` whose tensors say which part holds them (`GgufTensorInfo.part`): every
 * reader of tensor bytes (the engine's mappings, slices, weight hashes) opens that part, and a stage maps only the
 * parts that hold its tensors.
 */
import { readdirSync, statSync } from "node:fs"
import { basename, dirname, join } from "node:path"
import { Effect } from "effect"
import { type GgufFile, type GgufPart, type GgufTensorInfo, ModelLoadError } from "../../domain/gguf.js"

export const SPLIT_NO = "split.no"
export const SPLIT_COUNT = "split.count"
export const SPLIT_TENSORS_COUNT = "split.tensors.count"

/** More parts than this is not a model: a lying `split.count` must not open thousands of files. */
export const MAX_SPLIT_PARTS = 9999

const PART_NAME = /^(.*)-(\d{5})-of-(\d{5})\.gguf$/

/** The path of part `index` (0-based) of `count` beside `prefix` (llama.cpp's `llama_split_path`). */
export const splitPartPath = (prefix: string, index: number, count: number): string =>
  `${prefix}-${String(index + 1).padStart(5, "0")}-of-${String(count).padStart(5, "0")}.gguf`

/** The prefix of a part's path when its name says it is part `index` of `count`, else undefined. */
export const splitPrefix = (path: string, index: number, count: number): string | undefined => {
  const m = PART_NAME.exec(basename(path))
  if (m === null || Number(m[2]) !== index + 1 || Number(m[3]) !== count) return undefined
  return join(dirname(path), m[1]!)
}

const fail = (path: string, reason: ModelLoadError["reason"], message: string) =>
  Effect.fail(new ModelLoadError({ path, reason, message }))

/** An optional small integer key (split.no, split.count, split.tensors.count); a key of another type fails. */
const intKey = (file: GgufFile, key: string): Effect.Effect<number | undefined, ModelLoadError> => {
  const v = file.metadata.get(key)
  if (v === undefined) return Effect.succeed(undefined)
  const n = typeof v === "bigint" ? Number(v) : v
  if (typeof n !== "number" || !Number.isSafeInteger(n) || n < 0) {
    return fail(file.path, "InvalidMetadata", `metadata "${key}" must be a non-negative integer`)
  }
  return Effect.succeed(n)
}

/** Where a file stands in a split set: `count` 1 for a file that is not part of one. */
export const splitPosition = (file: GgufFile): Effect.Effect<{ index: number; count: number }, ModelLoadError> =>
  Effect.gen(function* () {
    const count = yield* intKey(file, SPLIT_COUNT)
    const index = yield* intKey(file, SPLIT_NO)
    if (count === undefined || count <= 1) {
      if (index !== undefined && index > 0) {
        return yield* fail(file.path, "InvalidMetadata", `metadata "split.no" = ${index} in a file that is not split`)
      }
      return { index: 0, count: 1 }
    }
    if (count > MAX_SPLIT_PARTS) {
      return yield* fail(file.path, "InvalidMetadata", `metadata "split.count" = ${count} is over ${MAX_SPLIT_PARTS}`)
    }
    if (index === undefined) {
      return yield* fail(file.path, "InvalidMetadata", `metadata "split.no" is missing in a part of a split set`)
    }
    if (index >= count) {
      return yield* fail(
        file.path,
        "InvalidMetadata",
        `metadata "split.no" = ${index} is past the set's ${count} parts ("split.count")`
      )
    }
    return { index, count }
  })

/**
 * Every part's path (the first's name must say where the others are, unless `partPaths` says it), each present;
 * else one line naming the first part missing.
 */
const partPathsOf = (
  first: GgufFile,
  count: number,
  exists: (path: string) => boolean,
  partPaths: ReadonlyArray<string> | undefined
): Effect.Effect<ReadonlyArray<string>, ModelLoadError> =>
  Effect.gen(function* () {
    const prefix = partPaths !== undefined ? "" : splitPrefix(first.path, 0, count)
    if (prefix === undefined) {
      const m = PART_NAME.exec(basename(first.path))
      const wanted = basename(splitPartPath(m?.[1] ?? basename(first.path).replace(/\.gguf$/, ""), 0, count))
      return yield* fail(
        first.path,
        "InvalidMetadata",
        `the first part of a ${count}-part split set must be named like ${wanted} (llama.cpp finds the other ` +
          `parts by that name); found ${basename(first.path)}`
      )
    }
    const paths = partPaths ?? Array.from({ length: count }, (_, i) => splitPartPath(prefix, i, count))
    const missing = paths.filter((p) => !exists(p))
    if (missing.length > 0) {
      const which = missing.map((p) => paths.indexOf(p) + 1)
      return yield* fail(
        missing[0]!,
        "Io",
        `the split set ${basename(first.path)} lacks part${which.length > 1 ? "s" : ""} ${which.join(", ")} of ` +
          `${count}: ${basename(missing[0]!)}${missing.length > 1 ? ` and ${missing.length - 1} more` : ""} ` +
          `not found in ${dirname(first.path)}`
      )
    }
    return paths
  })

/** Part `i` (its file `file`) is in its place in the set: its split keys and architecture agree with the first's. */
const checkPart = (
  file: GgufFile,
  i: number,
  count: number,
  declared: number | undefined,
  architecture: unknown
): Effect.Effect<void, ModelLoadError> =>
  Effect.gen(function* () {
    const position = yield* intKey(file, SPLIT_NO)
    const itsCount = yield* intKey(file, SPLIT_COUNT)
    if (position !== i) {
      return yield* fail(
        file.path,
        "InvalidMetadata",
        `part ${i + 1} of ${count} says "split.no" = ${position ?? "(missing)"}; it should be ${i}`
      )
    }
    if (itsCount !== count) {
      return yield* fail(
        file.path,
        "InvalidMetadata",
        `part ${i + 1} says "split.count" = ${itsCount ?? "(missing)"}, the first part says ${count}: ` +
          `the parts are from different sets`
      )
    }
    const itsDeclared = yield* intKey(file, SPLIT_TENSORS_COUNT)
    if (itsDeclared !== declared) {
      return yield* fail(
        file.path,
        "InvalidMetadata",
        `part ${i + 1} says "split.tensors.count" = ${itsDeclared ?? "(missing)"}, the first part says ` +
          `${declared ?? "(missing)"}: the parts are from different sets`
      )
    }
    const itsArchitecture = file.metadata.get("general.architecture")
    if (i > 0 && itsArchitecture !== undefined && itsArchitecture !== architecture) {
      return yield* fail(
        file.path,
        "InvalidMetadata",
        `part ${i + 1} is a ${String(itsArchitecture)} model, the first part a ${String(architecture)} model`
      )
    }
  })

/** Adds part `i`'s tensors (marked with their part) to the set's, each name in one part only. */
const addPartTensors = (
  file: GgufFile,
  i: number,
  tensors: Array<GgufTensorInfo>,
  byName: Map<string, GgufTensorInfo>
): Effect.Effect<void, ModelLoadError> => {
  for (const t of file.tensors) {
    const before = byName.get(t.name)
    if (before !== undefined) {
      return fail(
        file.path,
        "InvalidMetadata",
        `tensor "${t.name}" is in part ${(before.part ?? 0) + 1} and again in part ${i + 1}`
      )
    }
    const info = { ...t, part: i }
    byName.set(t.name, info)
    tensors.push(info)
  }
  return Effect.void
}

/**
 * Reads the whole set whose first part is `first` (already parsed, its `split.count` > 1), with `readPart` for every
 * other part, and merges it into one file. Each problem fails before anything else is read, with one line naming the
 * part and the key or tensor.
 */
export const mergeSplitSet = (
  first: GgufFile,
  count: number,
  readPart: (path: string) => Effect.Effect<GgufFile, ModelLoadError>,
  exists: (path: string) => boolean,
  /** Where every part is, when not beside the first by name (a remote set's URLs: RemoteGguf.ts). */
  partPaths?: ReadonlyArray<string>
): Effect.Effect<GgufFile, ModelLoadError> =>
  Effect.gen(function* () {
    const paths = yield* partPathsOf(first, count, exists, partPaths)
    const declared = yield* intKey(first, SPLIT_TENSORS_COUNT)
    const architecture = first.metadata.get("general.architecture")
    const parts: Array<GgufPart> = []
    const tensors: Array<GgufTensorInfo> = []
    const byName = new Map<string, GgufTensorInfo>()
    for (let i = 0; i < count; i++) {
      const file = i === 0 ? first : yield* readPart(paths[i]!)
      yield* checkPart(file, i, count, declared, architecture)
      yield* addPartTensors(file, i, tensors, byName)
      parts.push({
        path: file.path,
        fileSize: file.fileSize,
        dataOffset: file.dataOffset,
        tensorCount: file.tensors.length
      })
    }
    if (declared !== undefined && declared !== tensors.length) {
      return yield* fail(
        first.path,
        "MissingTensor",
        `the split set's ${count} parts hold ${tensors.length} tensors; "split.tensors.count" says ${declared}`
      )
    }
    return { ...first, tensors, tensorsByName: byName, parts } satisfies GgufFile
  })

/**
 * The files a model path names by its name alone: every part of a set when it is named as a first part
 * (`-00001-of-0000N.gguf`), else the path. For keys that must change when any part changes (header caches, hash memos);
 * the set itself is checked by `mergeSplitSet`.
 */
export const namedModelFiles = (named: string): ReadonlyArray<string> => {
  const resolved = resolveModelPath(named)
  const path = typeof resolved === "string" ? resolved : named
  const m = PART_NAME.exec(basename(path))
  if (m === null || Number(m[2]) !== 1) return [path]
  const count = Number(m[3])
  if (count <= 1 || count > MAX_SPLIT_PARTS) return [path]
  const prefix = join(dirname(path), m[1]!)
  return Array.from({ length: count }, (_, i) => splitPartPath(prefix, i, count))
}

/**
 * The model file a `--model` path names, or why it names none (one line). A folder names the one model it holds: a
 * lone `.gguf` file, or the first part of the one split set in it (its parts and nothing else); a later part of a
 * set (`-00003-of-00005.gguf`) names the set's first part. Anything else is itself. Existence and the set's checks
 * are the reader's (`readGgufFile`, `mergeSplitSet`).
 */
export const resolveModelPath = (path: string): string | { readonly message: string } => {
  let isFolder = false
  try {
    isFolder = statSync(path).isDirectory()
  } catch {
    // a missing path: the reader says so
  }
  if (isFolder) {
    let names: ReadonlyArray<string>
    try {
      names = readdirSync(path)
        .filter((n) => n.endsWith(".gguf"))
        .sort()
    } catch (e) {
      return { message: `the folder ${path} cannot be listed: ${e instanceof Error ? e.message : String(e)}` }
    }
    const models = new Set(
      names.map((n) => {
        const m = PART_NAME.exec(n)
        return m === null ? n : basename(splitPartPath(m[1]!, 0, Number(m[3])))
      })
    )
    if (models.size === 0) return { message: `the folder ${path} holds no .gguf file` }
    if (models.size > 1) {
      const list = [...models]
      return {
        message:
          `the folder ${path} holds ${list.length} models (${list.slice(0, 4).join(", ")}` +
          `${list.length > 4 ? ", ..." : ""}): name one file`
      }
    }
    return join(path, [...models][0]!)
  }
  const m = PART_NAME.exec(basename(path))
  if (m !== null && Number(m[2]) > 1) return splitPartPath(join(dirname(path), m[1]!), 0, Number(m[3]))
  return path
}
