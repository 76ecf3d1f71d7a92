/**
 * A stage's slice of a remote model, fetched straight from the hub (issue 38 part 3): only the byte ranges of the
 * stage's tensors (GgufSlice's `sliceTensors`: its blocks, and the embeddings or head where it needs them), each pinned
 * to the ETag its part's header was read with. The bytes land in `<dir>/<id>.fetch` in tensor order, so a fetch cut
 * off (a dropped connection, a killed node) resumes where the file ends; once complete they are written out as the
 * slice, a one-file GGUF (`<dir>/<id>.gguf`), which is parsed and checked against the header's tensor table before its
 * tensor hash is recorded beside it (`<id>.gguf.tensors`). A slice is reused only while its tensors still hash to that.
 */
import * as Fs from "node:fs"
import * as Path from "node:path"
import { Effect } from "effect"
import { type GgufFile, type GgufTensorInfo, ModelLoadError } from "../../domain/gguf.js"
import { readGgufFile } from "./GgufReader.js"
import { sliceHash, sliceHashOf, type SliceRange, sliceTensors, writeGgufSlice } from "./GgufSlice.js"
import { type HubAccess, hubAccessOf, type HubError, readRange } from "./HubClient.js"
import { Settings } from "../config/Settings.js"
import { type RemoteModel, remoteSliceId } from "./RemoteGguf.js"

/** Bytes between two tensors of one part that are fetched rather than split into two requests (alignment padding). */
const MAX_GAP = 4096

/** One byte range of one part, and the tensors it holds. */
interface Run {
  readonly part: number
  readonly start: number
  end: number
  readonly tensors: Array<GgufTensorInfo>
}

/** The ranges to fetch for a stage's tensors, in their order, neighbours in one part merged. */
export const sliceRuns = (file: GgufFile, range: SliceRange): ReadonlyArray<Run> => {
  const runs: Array<Run> = []
  for (const t of sliceTensors(file, range)) {
    const part = t.part ?? 0
    const last = runs.at(-1)
    if (last !== undefined && last.part === part && t.offset >= last.end && t.offset - last.end <= MAX_GAP) {
      last.end = t.offset + t.byteSize
      last.tensors.push(t)
    } else {
      runs.push({ part, start: t.offset, end: t.offset + t.byteSize, tensors: [t] })
    }
  }
  return runs
}

/** Bytes a stage's fetch asks for (its ranges, padding between merged neighbours included). */
export const sliceFetchBytes = (file: GgufFile, range: SliceRange): number =>
  sliceRuns(file, range).reduce((n, r) => n + (r.end - r.start), 0)

export interface FetchedSlice {
  readonly path: string
  /** The slice's stage-tensor hash (GgufSlice's `sliceHash`), recorded when it was fetched. */
  readonly tensorHash: string
  /** Bytes fetched from the hub now (0: the slice was in the cache). */
  readonly fetchedBytes: number
}

const ioError = (path: string) => (e: unknown) =>
  new ModelLoadError({ path, reason: "Io", message: `${path}: ${e instanceof Error ? e.message : String(e)}` })

/** The slice held for `id` in `dir`, when its tensors still hash to the recorded hash (else both files are removed). */
export const heldRemoteSlice = (
  dir: string,
  id: string,
  range: SliceRange
): Effect.Effect<{ readonly path: string; readonly tensorHash: string } | undefined> =>
  Effect.gen(function* () {
    const path = Path.join(dir, `${id}.gguf`)
    const sidecar = `${path}.tensors`
    if (!Fs.existsSync(path)) return undefined
    const recorded = Fs.existsSync(sidecar) ? Fs.readFileSync(sidecar, "utf8").trim() : ""
    const actual = /^[0-9a-f]{64}$/.test(recorded)
      ? yield* readGgufFile(path).pipe(
          Effect.flatMap((slice) => sliceHash(slice, range)),
          Effect.orElseSucceed(() => "")
        )
      : ""
    if (actual !== "" && actual === recorded) return { path, tensorHash: recorded }
    Fs.rmSync(path, { force: true })
    Fs.rmSync(sidecar, { force: true })
    return undefined
  })

/** The written slice's tensors must be the header's: names, types, shapes and sizes, in order. */
const checkAgainstHeader = (slice: GgufFile, expected: ReadonlyArray<GgufTensorInfo>, path: string) => {
  const problem =
    slice.tensors.length !== expected.length
      ? `${slice.tensors.length} tensors, the header says ${expected.length}`
      : slice.tensors
          .map((t, i) => {
            const e = expected[i]!
            return t.name !== e.name ||
              t.type !== e.type ||
              t.byteSize !== e.byteSize ||
              t.dims.join() !== e.dims.join()
              ? `tensor ${i} is ${t.name} ${t.type} [${t.dims}], the header says ${e.name} ${e.type} [${e.dims}]`
              : undefined
          })
          .find((p) => p !== undefined)
  return problem === undefined
    ? Effect.void
    : Effect.fail(new ModelLoadError({ path, reason: "TensorShapeMismatch", message: `the fetched slice: ${problem}` }))
}

/**
 * Writes the fetched bytes (`raw`, the stage's tensors at `mapped`'s offsets) out as the slice, as from a local model;
 * checks it against the header's tensor table and records its tensor hash beside it.
 */
const writeFetched = (
  model: RemoteModel,
  range: SliceRange,
  dir: string,
  id: string,
  raw: string,
  mapped: ReadonlyArray<GgufTensorInfo>,
  total: number
) =>
  Effect.gen(function* () {
    const { parts: _parts, ...whole } = model.file
    const fetched: GgufFile = {
      ...whole,
      path: raw,
      fileSize: total,
      tensors: mapped,
      tensorsByName: new Map(mapped.map((t) => [t.name, t]))
    }
    const path = Path.join(dir, `${id}.gguf`)
    // the slice's tensor hash computed as it is written: no second pass over its bytes
    const hashing = sliceHashOf()
    yield* writeGgufSlice(fetched, range, path, hashing.observe).pipe(
      Effect.mapError((e) => new ModelLoadError({ path, reason: "Io", message: `cannot write ${path}: ${e.message}` }))
    )
    const tensorHash = hashing.digest()
    yield* checkAgainstHeader(yield* readGgufFile(path), sliceTensors(model.file, range), path)
    yield* Effect.try({
      try: () => {
        Fs.writeFileSync(`${path}.tensors.${process.pid}.tmp`, tensorHash)
        Fs.renameSync(`${path}.tensors.${process.pid}.tmp`, `${path}.tensors`)
      },
      catch: ioError(path)
    })
    return { path, tensorHash }
  })

/**
 * Fetches (or finds) the slice of `range` of `model` in `dir`. `onProgress` sees the bytes held of the total as they
 * arrive. A part that changed on the hub since its header was read fails (`Changed`: the partial bytes are dropped);
 * a refusal (401, 404, 416) fails at once; a dropped connection is resumed (HubClient's `readRange`).
 */
export const fetchRemoteSlice = (
  model: RemoteModel,
  range: SliceRange,
  dir: string,
  options: { readonly access?: HubAccess; readonly onProgress?: (have: number, total: number) => void } = {}
): Effect.Effect<FetchedSlice, ModelLoadError | HubError> =>
  Effect.gen(function* () {
    const id = remoteSliceId(model, range)
    const held = yield* heldRemoteSlice(dir, id, range)
    if (held !== undefined) return { ...held, fetchedBytes: 0 }
    const access = options.access ?? hubAccessOf(yield* Settings)
    const runs = sliceRuns(model.file, range)
    const total = runs.reduce((n, r) => n + (r.end - r.start), 0)
    const raw = Path.join(dir, `${id}.fetch`)
    const planPath = `${raw}.json`
    const plan = JSON.stringify({
      parts: model.parts.map((p) => [p.url, p.etag, p.size]),
      runs: runs.map((r) => [r.part, r.start, r.end])
    })
    yield* Effect.try({
      try: () => {
        Fs.mkdirSync(dir, { recursive: true })
        const planned = Fs.existsSync(planPath) ? Fs.readFileSync(planPath, "utf8") : ""
        if (planned !== plan) {
          // another plan's bytes (or none): start over
          Fs.rmSync(raw, { force: true })
          Fs.writeFileSync(planPath, plan)
        }
      },
      catch: ioError(raw)
    })
    const fd = yield* Effect.acquireRelease(
      Effect.try({ try: () => Fs.openSync(raw, "a+"), catch: ioError(raw) }),
      (fd) => Effect.sync(() => Fs.closeSync(fd))
    )
    let have = yield* Effect.try({ try: () => Fs.fstatSync(fd).size, catch: ioError(raw) })
    if (have > total) {
      yield* Effect.try({ try: () => Fs.ftruncateSync(fd, 0), catch: ioError(raw) })
      have = 0
    }
    const resumedFrom = have
    options.onProgress?.(have, total)
    // Where each run starts in the fetched file, and each tensor's offset there.
    const mapped: Array<GgufTensorInfo> = []
    let runStart = 0
    for (const run of runs) {
      for (const t of run.tensors) {
        const { part: _part, ...rest } = t
        mapped.push({ ...rest, offset: runStart + (t.offset - run.start) })
      }
      const runEnd = runStart + (run.end - run.start)
      if (have < runEnd) {
        const part = model.parts[run.part]!
        yield* readRange(access, part.url, run.start + (have - runStart), run.end, part.etag, (chunk) => {
          Fs.writeSync(fd, chunk)
          have += chunk.length
          options.onProgress?.(have, total)
        }).pipe(
          Effect.tapError((e) =>
            Effect.sync(() => {
              if (e.reason === "Changed") {
                Fs.rmSync(raw, { force: true })
                Fs.rmSync(planPath, { force: true })
              }
            })
          )
        )
      }
      runStart = runEnd
    }
    const { path, tensorHash } = yield* writeFetched(model, range, dir, id, raw, mapped, total)
    yield* Effect.try({
      try: () => {
        Fs.rmSync(raw, { force: true })
        Fs.rmSync(planPath, { force: true })
      },
      catch: ioError(raw)
    })
    return { path, tensorHash, fetchedBytes: total - resumedFrom }
  }).pipe(Effect.scoped)
