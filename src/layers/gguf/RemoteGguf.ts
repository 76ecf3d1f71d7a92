/**
 * A GGUF model on a hub or at a URL (issue 38 part 3), known by its headers alone: each part's header, metadata and
 * tensor table are read with HTTP Range requests that grow until the table parses (GgufReader's `parseGgufPrefix`),
 * never the tensor data. Planning, placement, KV sizing and the tokenizer work from that; each node then fetches only
 * its own stage's tensor bytes (RemoteSlice.ts).
 *
 * Headers are kept on disk (`<cache>/hub/headers`), by the file's version: for an `hf:user/repo:TAG` name the
 * manifest's SHA-256 of the first part identifies the whole set, so a warm start asks the hub for the manifest and
 * nothing else; a file named by path or URL is identified by its ETag (one HEAD request). A split set's later parts
 * are taken to change with its first (they are published together); every byte range is pinned to the ETag its part
 * had when read, so a part that changed anyway is refused rather than mixed in.
 */
import { createHash } from "node:crypto"
import * as Fs from "node:fs"
import * as Path from "node:path"
import { Effect } from "effect"
import { type GgufFile, ModelLoadError } from "../../domain/gguf.js"
import { type ModelName, parseModelName } from "../../domain/modelName.js"
import { Settings } from "../config/Settings.js"
import { NeedMoreBytes, parseGgufPrefix } from "./GgufReader.js"
import { mergeSplitSet, splitPosition } from "./GgufSplit.js"
import {
  type HubAccess,
  hubAccessOf,
  type HubError,
  headFile,
  readRange,
  type ResolvedName,
  resolveName,
  shownUrl
} from "./HubClient.js"

/** One file of a remote model, at the version its header was read from. */
export interface RemotePart {
  readonly url: string
  readonly size: number
  readonly etag: string
  /** The hub's SHA-256 of the whole file (its LFS object id), when known. */
  readonly sha256?: string
}

/** A remote model: its merged header (tensor offsets into each part) and where each part is. */
export interface RemoteModel {
  /** What `--model` said. */
  readonly named: string
  /** This version of the model (a digest of the manifest's SHA-256, or of the first part's URL and ETag). */
  readonly id: string
  readonly file: GgufFile
  readonly parts: ReadonlyArray<RemotePart>
}

/** The folder remote headers are kept in (`$XDG_CACHE_HOME/swactor/hub/headers`). */
export const defaultHeaderCacheDir = (cacheDir: string): string => Path.join(cacheDir, "hub", "headers")

const FIRST_READ = 64 * 1024
const READ_AHEAD = 64 * 1024

const loadError = (path: string) => (e: HubError | ModelLoadError) =>
  e._tag === "ModelLoadError" ? e : new ModelLoadError({ path, reason: "Io", message: e.message })

/**
 * Reads one part's header over HTTP: 64 KiB first, then as far as the parser asks (at least doubling), every range
 * pinned to the ETag of the first. A file that changes part way is read again from its start, once.
 */
export const readRemotePart = (
  access: HubAccess,
  url: string,
  pinnedEtag?: string
): Effect.Effect<
  { readonly file: GgufFile; readonly part: RemotePart; readonly prefix: Uint8Array },
  ModelLoadError
> => {
  const once = Effect.gen(function* () {
    const chunks: Array<Uint8Array> = []
    let have = 0
    const sink = (c: Uint8Array) => {
      chunks.push(Uint8Array.from(c))
      have += c.length
    }
    let info = yield* readRange(access, url, 0, FIRST_READ, pinnedEtag, sink)
    for (;;) {
      const buffer = chunks.length === 1 ? chunks[0]! : Buffer.concat(chunks)
      chunks.length = 0
      chunks.push(buffer)
      const size = info.size
      const parsed = yield* parseGgufPrefix(
        {
          size,
          readAhead: READ_AHEAD,
          read: (position, length) => {
            if (position + length > have && have < size) throw new NeedMoreBytes(position + length)
            return buffer.subarray(position, Math.min(have, position + length))
          }
        },
        shownUrl(url)
      )
      if (!(parsed instanceof NeedMoreBytes)) {
        return {
          file: parsed,
          part: { url, size, etag: info.etag, ...(info.sha256 === undefined ? {} : { sha256: info.sha256 }) },
          prefix: buffer
        }
      }
      const upTo = Math.min(size, Math.max(parsed.upTo, have * 2))
      info = yield* readRange(access, url, have, upTo, info.etag, sink)
    }
  })
  return once.pipe(
    Effect.catchIf(
      (e) => e._tag === "HubError" && e.reason === "Changed" && pinnedEtag === undefined,
      () => once
    ),
    Effect.mapError(loadError(shownUrl(url)))
  )
}

// ---------------------------------------------------------------------------------------------------------------
// The header cache

interface CachedSet {
  readonly parts: ReadonlyArray<RemotePart & { readonly key: string }>
}

const digest = (text: string) => createHash("sha256").update(text).digest("hex")

const partKey = (part: RemotePart) => digest(JSON.stringify([shownUrl(part.url), part.etag, part.size]))

const writeAtomically = (path: string, data: string | Uint8Array) => {
  const temporary = `${path}.${process.pid}.tmp`
  Fs.writeFileSync(temporary, data)
  Fs.renameSync(temporary, path)
}

const storeSet = (dir: string, setKey: string, read: ReadonlyArray<{ part: RemotePart; prefix: Uint8Array }>) => {
  try {
    Fs.mkdirSync(dir, { recursive: true })
    const parts = read.map(({ part, prefix }) => {
      const key = partKey(part)
      writeAtomically(Path.join(dir, `${key}.bin`), prefix)
      return { ...part, key }
    })
    writeAtomically(Path.join(dir, `${setKey}.set.json`), JSON.stringify({ parts } satisfies CachedSet))
  } catch {
    // an unwritable cache only costs the next start its header reads
  }
}

/** The set's parts from the cache, each parsed from its kept prefix; undefined when anything is missing or off. */
const cachedSet = (
  dir: string,
  setKey: string
): Effect.Effect<{ readonly files: ReadonlyArray<GgufFile>; readonly parts: ReadonlyArray<RemotePart> } | undefined> =>
  Effect.gen(function* () {
    let set: CachedSet
    try {
      set = JSON.parse(Fs.readFileSync(Path.join(dir, `${setKey}.set.json`), "utf8")) as CachedSet
    } catch {
      return undefined
    }
    if (!Array.isArray(set.parts) || set.parts.length === 0) return undefined
    const files: Array<GgufFile> = []
    for (const part of set.parts) {
      if (typeof part.url !== "string" || typeof part.size !== "number" || partKey(part) !== part.key) return undefined
      let prefix: Uint8Array
      try {
        prefix = Fs.readFileSync(Path.join(dir, `${part.key}.bin`))
      } catch {
        return undefined
      }
      const parsed = yield* parseGgufPrefix(
        {
          size: part.size,
          readAhead: READ_AHEAD,
          read: (position, length) => {
            if (position + length > prefix.length && prefix.length < part.size) throw new NeedMoreBytes(0)
            return prefix.subarray(position, Math.min(prefix.length, position + length))
          }
        },
        shownUrl(part.url)
      ).pipe(Effect.orElseSucceed(() => undefined))
      if (parsed === undefined || parsed instanceof NeedMoreBytes) return undefined
      files.push(parsed)
    }
    return { files, parts: set.parts.map(({ key: _key, ...part }) => part) }
  })

// ---------------------------------------------------------------------------------------------------------------

const PART_IN_URL = /-(\d{5})-of-(\d{5})\.gguf$/

/** The URL of part `index` (0-based) of a set whose first part is at `first`. */
const partUrl = (first: string, index: number, count: number): string => {
  const url = new URL(first)
  url.pathname = url.pathname.replace(
    PART_IN_URL,
    `-${String(index + 1).padStart(5, "0")}-of-${String(count).padStart(5, "0")}.gguf`
  )
  return url.href
}

/** Merges the parts' headers into one model (GgufSplit's checks, the parts named by URL). */
const merge = (named: string, files: ReadonlyArray<GgufFile>): Effect.Effect<GgufFile, ModelLoadError> =>
  Effect.gen(function* () {
    const first = files[0]!
    const { index, count } = yield* splitPosition(first)
    if (count === 1) return first
    if (index !== 0) {
      return yield* new ModelLoadError({
        path: first.path,
        reason: "InvalidMetadata",
        message: `${named} names part ${index + 1} of a ${count}-part split set; name its first part`
      })
    }
    return yield* mergeSplitSet(
      first,
      count,
      (path) => {
        const file = files.find((f) => f.path === path)
        return file === undefined
          ? Effect.fail(new ModelLoadError({ path, reason: "Io", message: `${path}: not read` }))
          : Effect.succeed(file)
      },
      () => true,
      files.map((f) => f.path)
    )
  })

/**
 * Reads every part's header over HTTP: the first, then (a split set, named by its first part) the others beside it.
 * `keep` stores what was read (the header cache).
 */
const readRemoteSet = (
  access: HubAccess,
  named: string,
  resolved: ResolvedName,
  firstEtag: string | undefined,
  keep: (read: ReadonlyArray<{ part: RemotePart; prefix: Uint8Array }>) => void
) =>
  Effect.gen(function* () {
    const first = yield* readRemotePart(access, resolved.url, firstEtag)
    const { index, count } = yield* splitPosition(first.file)
    const read = [first]
    const wanted = `-00001-of-${String(count).padStart(5, "0")}.gguf`
    const refuse = (message: string) =>
      new ModelLoadError({ path: shownUrl(resolved.url), reason: "InvalidMetadata", message })
    if (index > 0) {
      return yield* refuse(
        `${named} is part ${index + 1} of a ${count}-part split set by its "split.no": name its first part (${wanted})`
      )
    }
    if (count > 1) {
      if (!new URL(resolved.url).pathname.endsWith(wanted)) {
        return yield* refuse(
          `${named}: the file belongs to a ${count}-part split set, but its name does not end in ${wanted} ` +
            `(the other parts are found by that name)`
        )
      }
      for (let i = 1; i < count; i++) read.push(yield* readRemotePart(access, partUrl(resolved.url, i, count)))
    }
    const parts = read.map((r) => (r === first ? withSha256(r.part, resolved.sha256) : r.part))
    keep(read.map((r, i) => ({ part: parts[i]!, prefix: r.prefix })))
    return { files: read.map((r) => r.file), parts }
  })

/** Models opened by this process, by the version that identifies them. */
const opened = new Map<string, RemoteModel>()
/** What a name resolved to a moment ago (the hub is asked again after this long: the model may change). */
const recently = new Map<string, { readonly at: number; readonly model: RemoteModel }>()
const RESOLVE_MEMO_MS = 30_000

/**
 * Opens a remote model by name (`hf:…`, `https://…`): resolves it, reads (or recalls) every part's header, and checks
 * the set. Every failure is a ModelLoadError with one line that names the model and what went wrong.
 */
export const openRemoteModel = (
  named: string,
  options: {
    readonly access?: HubAccess
    readonly cacheDir?: string
    /** Keep (and reuse) the opened model in this process (default true); false reads the disk cache or the hub. */
    readonly remember?: boolean
  } = {}
): Effect.Effect<RemoteModel, ModelLoadError> =>
  Effect.gen(function* () {
    const name = parseModelName(named)
    if ("message" in name) return yield* new ModelLoadError({ path: named, reason: "Io", message: name.message })
    if (name._tag === "Local") {
      return yield* new ModelLoadError({ path: named, reason: "Io", message: `${named} is not a hub name or URL` })
    }
    const settings = yield* Settings
    const access = options.access ?? hubAccessOf(settings)
    const dir = options.cacheDir ?? defaultHeaderCacheDir(settings.cacheDir)
    // One start opens the model several times (catalog, tokenizer, delivery): the hub is asked once a while.
    const asked = `${access.endpoint}|${named}|${dir}`
    const fresh = options.remember === false ? undefined : recently.get(asked)
    if (fresh !== undefined && Date.now() - fresh.at < RESOLVE_MEMO_MS) return fresh.model
    const resolved = yield* resolveName(access, name as Exclude<ModelName, { _tag: "Local" }>).pipe(
      Effect.mapError(loadError(named))
    )
    // What identifies this version of the model: the manifest's SHA-256, else the first part's ETag (a HEAD).
    let firstEtag: string | undefined
    let setKey: string
    if (resolved.sha256 !== undefined) {
      setKey = digest(JSON.stringify(["sha256", resolved.sha256]))
    } else {
      const head = yield* headFile(access, resolved.url).pipe(Effect.mapError(loadError(named)))
      firstEtag = head.etag
      setKey = digest(JSON.stringify(["etag", shownUrl(resolved.url), head.etag, head.size]))
    }
    const known = options.remember === false ? undefined : opened.get(setKey)
    if (known !== undefined) {
      recently.set(asked, { at: Date.now(), model: { ...known, named } })
      return { ...known, named }
    }
    const cached = yield* cachedSet(dir, setKey)
    const { files, parts } =
      cached ?? (yield* readRemoteSet(access, named, resolved, firstEtag, (read) => storeSet(dir, setKey, read)))
    const file = yield* merge(named, files)
    const model = { named, id: setKey, file, parts } satisfies RemoteModel
    opened.set(setKey, model)
    recently.set(asked, { at: Date.now(), model })
    return model
  }).pipe(Effect.withSpan("RemoteGguf.openRemoteModel", { attributes: { named } }))

/** A part with the manifest's SHA-256 where the ranges gave none. */
const withSha256 = (part: RemotePart, sha256: string | undefined): RemotePart =>
  part.sha256 !== undefined || sha256 === undefined ? part : { ...part, sha256 }

/**
 * The identity of a stage's slice of a remote model: the parts' versions (SHA-256, else URL and ETag) and the block
 * range. The orchestrator cannot hash tensor bytes it never downloads, so this names the slice in weight delivery;
 * the fetched slice's own tensor hash is recorded beside it and checked on every reuse (RemoteSlice.ts).
 */
export const remoteSliceId = (
  model: RemoteModel,
  range: { readonly layerStart: number; readonly layerEndExclusive: number; readonly numLayers: number }
): string =>
  digest(
    JSON.stringify([
      "swactor-remote-slice-1",
      model.parts.map((p) => p.sha256 ?? `${shownUrl(p.url)}|${p.etag}|${p.size}`),
      range.layerStart,
      range.layerEndExclusive,
      range.numLayers
    ])
  )
