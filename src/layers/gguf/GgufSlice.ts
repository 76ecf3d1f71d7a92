/**
 * A stage's slice of a GGUF model: a valid GGUF file with the source's metadata and only the tensors one stage needs
 * (its blocks, plus `token_embd` on the first stage and the output head on the last; `token_embd` also when the last
 * stage's output is tied to it). Tensor names keep their block numbers, so a stage loads its range from the slice
 * exactly as from the whole file. The slice's identity is a SHA-256 over the needed tensors (name, type, shape,
 * bytes): the same for the whole file and for its slice, so a node can tell whether what it holds is what the
 * orchestrator's file has. Weight delivery (issue 10) sends slices: src/layers/orchestrator/WeightDelivery.ts.
 */
import { createHash } from "node:crypto"
import * as Fs from "node:fs"
import { Effect } from "effect"
import { type GgufFile, type GgufTensorInfo, ModelLoadError, tensorFilePath } from "../../domain/gguf.js"
import { type GgufTypedValue, type GgufWriteError, type GgufWriteSummary, writeGgufFile } from "./GgufWriter.js"

export interface SliceRange {
  readonly layerStart: number
  readonly layerEndExclusive: number
  /** The model's block count (the last stage carries the output head). */
  readonly numLayers: number
}

/** The tensors a stage of `range` needs, in the source's order. */
export const sliceTensors = (file: GgufFile, range: SliceRange): ReadonlyArray<GgufTensorInfo> => {
  const first = range.layerStart === 0
  const last = range.layerEndExclusive === range.numLayers
  const tied = !file.tensorsByName.has("output.weight")
  return file.tensors.filter((t) => {
    const block = /^blk\.(\d+)\./.exec(t.name)
    if (block !== null) {
      const i = Number(block[1])
      return i >= range.layerStart && i < range.layerEndExclusive
    }
    if (t.name === "token_embd.weight") return first || (last && tied)
    if (t.name.startsWith("output")) return last
    // gemma4 E2B/E4B's per-layer tables: the first stage computes the per-layer inputs (engine/PerLayerInputs.ts)
    if (t.name.startsWith("per_layer_")) return first
    // RoPE frequency factors (llama 3.1, mistral3, gemma4's global blocks): every stage's blocks read them
    if (t.name.startsWith("rope_")) return true
    return first || last
  })
}

const READ_CHUNK = 16 << 20

/** The bytes of one tensor, read from `fd` in chunks. */
function* tensorChunks(fd: number, tensor: GgufTensorInfo): Generator<Uint8Array> {
  for (let off = 0; off < tensor.byteSize; off += READ_CHUNK) {
    const n = Math.min(READ_CHUNK, tensor.byteSize - off)
    const chunk = Buffer.allocUnsafe(n)
    let got = 0
    while (got < n) {
      const r = Fs.readSync(fd, chunk, got, n - got, tensor.offset + off + got)
      if (r === 0) throw new Error(`unexpected end of file reading ${tensor.name}`)
      got += r
    }
    yield chunk
  }
}

/** One read-only descriptor per file of the model (the parts of a split set), opened on first use. */
const withFiles = <A, E>(file: GgufFile, use: (fdOf: (tensor: GgufTensorInfo) => number) => Effect.Effect<A, E>) =>
  Effect.acquireUseRelease(
    Effect.sync(() => new Map<string, number>()),
    (fds) =>
      Effect.suspend(() =>
        use((tensor) => {
          const path = tensorFilePath(file, tensor)
          let fd = fds.get(path)
          if (fd === undefined) {
            fd = Fs.openSync(path, "r")
            fds.set(path, fd)
          }
          return fd
        })
      ),
    (fds) => Effect.sync(() => fds.forEach((fd) => Fs.closeSync(fd)))
  )

/** The split set's own keys, which a slice (one file) must not carry. */
const isSplitKey = (key: string) => key.startsWith("split.")

function* observed(
  chunks: Iterable<Uint8Array>,
  tensor: GgufTensorInfo,
  observe: (tensor: GgufTensorInfo, chunk: Uint8Array, first: boolean) => void
): Generator<Uint8Array> {
  let first = true
  for (const chunk of chunks) {
    observe(tensor, chunk, first)
    first = false
    yield chunk
  }
  if (first) observe(tensor, new Uint8Array(0), true)
}

/** The name, type and shape that open each tensor's part of the stage-tensor hash. */
const hashPrefix = (t: GgufTensorInfo) => `${t.name}\0${t.type}\0${t.dims.join(",")}\0`

/** A `writeGgufSlice` observer that computes `sliceHash` of what it writes: `digest()` once the write is done. */
export const sliceHashOf = () => {
  const hash = createHash("sha256")
  return {
    observe: (tensor: GgufTensorInfo, chunk: Uint8Array, first: boolean) => {
      if (first) hash.update(hashPrefix(tensor))
      hash.update(chunk)
    },
    digest: () => hash.digest("hex")
  }
}

/** SHA-256 (hex) over the stage's tensors of `file`: name, type, shape and bytes of each, in order. */
export const sliceHash = (file: GgufFile, range: SliceRange): Effect.Effect<string, ModelLoadError> =>
  withFiles(file, (fdOf) =>
    Effect.try({
      try: () => {
        const hash = createHash("sha256")
        // One buffer for every read (hashing consumes each chunk before the next read).
        const buffer = Buffer.allocUnsafe(READ_CHUNK)
        for (const t of sliceTensors(file, range)) {
          hash.update(hashPrefix(t))
          const fd = fdOf(t)
          for (let off = 0; off < t.byteSize;) {
            const got = Fs.readSync(fd, buffer, 0, Math.min(READ_CHUNK, t.byteSize - off), t.offset + off)
            if (got === 0) throw new Error(`unexpected end of file reading ${t.name}`)
            hash.update(buffer.subarray(0, got))
            off += got
          }
        }
        return hash.digest("hex")
      },
      catch: (e) =>
        new ModelLoadError({ path: file.path, reason: "Io", message: `cannot hash ${file.path}: ${String(e)}` })
    })
  )

/**
 * Writes the stage's slice of `file` to `path` (atomically: a temporary file renamed when complete): one file, also
 * from a split set (its tensors read from their parts, the set's `split.*` keys left out).
 */
export const writeGgufSlice = (
  file: GgufFile,
  range: SliceRange,
  path: string,
  /** Sees each tensor's data as it is written: `sliceHashOf` hashes the slice on the way (RemoteSlice.ts). */
  observe?: (tensor: GgufTensorInfo, chunk: Uint8Array, first: boolean) => void
): Effect.Effect<GgufWriteSummary, ModelLoadError | GgufWriteError> =>
  withFiles(file, (fdOf) => {
    const metadata: Array<readonly [string, GgufTypedValue]> = []
    for (const [key, kind] of file.metadataTypes) {
      if (isSplitKey(key)) continue
      const value = file.metadata.get(key)!
      metadata.push([key, kind.itemType === undefined ? { type: kind.type, value } : { ...kind, value }])
    }
    return writeGgufFile(path, {
      metadata,
      alignment: file.alignment,
      version: file.version === 2 ? 2 : 3,
      tensors: sliceTensors(file, range).map((t) => ({
        name: t.name,
        type: t.type,
        dims: t.dims,
        data: () => (observe === undefined ? tensorChunks(fdOf(t), t) : observed(tensorChunks(fdOf(t), t), t, observe))
      }))
    })
  }).pipe(
    Effect.catchAllDefect((e) =>
      Effect.fail(
        new ModelLoadError({ path: file.path, reason: "Io", message: `cannot read ${file.path}: ${String(e)}` })
      )
    )
  )
