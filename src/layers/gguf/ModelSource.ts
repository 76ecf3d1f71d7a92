/**
 * The one way a model's header is read from what `--model` names (issue 38): a local file, a split set's first part
 * or a folder (GgufReader's `readGgufFile`), or a hub name / URL (RemoteGguf.ts, headers only, over HTTP). The
 * catalog, the tokenizers and weight delivery read through here; tensor bytes are read from local files only (the
 * model file, or a stage's slice: fetched from the hub by the node itself, RemoteSlice.ts).
 */
import * as Fs from "node:fs"
import * as Path from "node:path"
import { Effect } from "effect"
import { type GgufFile, ModelLoadError } from "../../domain/gguf.js"
import { isRemoteModel } from "../../domain/modelName.js"
import { Settings } from "../config/Settings.js"
import { readGgufFile } from "./GgufReader.js"
import { type GgufTypedValue, writeGgufFile } from "./GgufWriter.js"
import { openRemoteModel } from "./RemoteGguf.js"

/** The model's header, metadata and tensor table (a split set merged), local or remote. */
export const readModelHeader = (named: string): Effect.Effect<GgufFile, ModelLoadError> =>
  isRemoteModel(named) ? Effect.map(openRemoteModel(named), (m) => m.file) : readGgufFile(named)

/**
 * A local GGUF file with the model's metadata, for readers that need a path (node-llama-cpp's vocabulary-only load):
 * the model itself when it is local; for a remote model, a file of its metadata and no tensors, written once per
 * version into `<cache>/hub/vocab`.
 */
export const localMetadataFile = (named: string): Effect.Effect<string, ModelLoadError> =>
  Effect.gen(function* () {
    if (!isRemoteModel(named)) return named
    const model = yield* openRemoteModel(named)
    const path = Path.join((yield* Settings).cacheDir, "hub", "vocab", `${model.id}.gguf`)
    if (Fs.existsSync(path)) return path
    const metadata: Array<readonly [string, GgufTypedValue]> = []
    for (const [key, kind] of model.file.metadataTypes) {
      if (key.startsWith("split.")) continue
      const value = model.file.metadata.get(key)!
      metadata.push([key, kind.itemType === undefined ? { type: kind.type, value } : { ...kind, value }])
    }
    yield* Effect.try({
      try: () => Fs.mkdirSync(Path.dirname(path), { recursive: true }),
      catch: (e) => new ModelLoadError({ path, reason: "Io", message: `cannot create ${Path.dirname(path)}: ${e}` })
    })
    yield* writeGgufFile(path, {
      metadata,
      alignment: model.file.alignment,
      version: model.file.version === 2 ? 2 : 3,
      tensors: []
    }).pipe(
      Effect.mapError((e) => new ModelLoadError({ path, reason: "Io", message: `cannot write ${path}: ${e.message}` }))
    )
    return path
  })
