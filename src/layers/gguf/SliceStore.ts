/**
 * A node agent's weight store (weight delivery, receiving side; issue 10): answers the control plane's
 * `WeightsCheck` / `SliceChunk` / `SliceFinish` over its slice cache (SliceCache.ts), and tells provisioning which
 * file to load for a model path and block range: the model path itself when the agent holds that file with the
 * same stage-tensor hash, else the verified slice it received. With `slicesOnly` the agent never reads the
 * orchestrator's model path (a node without the shared file): a stage whose weights were not delivered is refused.
 */
import * as Fs from "node:fs"
import * as Path from "node:path"
import { Effect } from "effect"
import { type StageWeights, WeightDeliveryError, type WeightsHeld } from "../../domain/controlRpc.js"
import { ModelLoadError } from "../../domain/gguf.js"
import { isRemoteModel } from "../../domain/modelName.js"
import { readGgufFile } from "./GgufReader.js"
import { openRemoteModel, remoteSliceId } from "./RemoteGguf.js"
import { fetchRemoteSlice, heldRemoteSlice } from "./RemoteSlice.js"
import { namedModelFiles } from "./GgufSplit.js"
import { sliceHash } from "./GgufSlice.js"
import { makeSliceCache, type SliceCacheError } from "./SliceCache.js"
import type { SliceSink } from "./SliceStream.js"

export interface WeightStoreOptions {
  /** Where received slices live (`swactor node --cache-dir`). */
  readonly cacheDir: string
  /** Never read the orchestrator's model path: only delivered slices (`swactor node --slices-only`). */
  readonly slicesOnly?: boolean
  /** Where the store says what it received and what a stage loads (the agent's stderr). */
  readonly log?: (line: string) => void
}

/** `$XDG_CACHE_HOME/swactor/slices` (default `~/.cache/swactor/slices`; config/Settings.ts). */
export const defaultSliceCacheDir = (cacheDir: string): string => Path.join(cacheDir, "slices")

export interface WeightStore {
  readonly check: (weights: StageWeights) => Effect.Effect<WeightsHeld, WeightDeliveryError>
  readonly chunk: (hash: string, offset: number, bytes: Uint8Array) => Effect.Effect<number, WeightDeliveryError>
  readonly finish: (weights: StageWeights) => Effect.Effect<string, WeightDeliveryError>
  /**
   * The file to load for `modelPath`'s blocks [layerStart, layerEndExclusive): a held or delivered one, else the
   * model path itself (undefined with `slicesOnly`: nothing was delivered for it).
   */
  readonly resolve: (modelPath: string, layerStart: number, layerEndExclusive: number) => string | undefined
  /** Slices received complete since the agent started (tests and logs). */
  readonly received: () => number
  /** Where slice byte streams (SliceStream.ts `receiveSlice`) write. */
  readonly sink: SliceSink
}

const deliveryError = (error: SliceCacheError) =>
  new WeightDeliveryError({ reason: error.reason, message: error.message })

const rangeOf = (w: StageWeights) => ({
  layerStart: w.layerStart,
  layerEndExclusive: w.layerEndExclusive,
  numLayers: w.numLayers
})

/**
 * A slice of a remote model that the agent fetches from the hub itself (`source` "Hub"; RemoteSlice.ts): held
 * (fetched before and its tensors still match), else fetched in the background while the orchestrator asks again
 * (`Fetching`, with the bytes so far), or why it could not be (`FetchFailed`: the orchestrator then sends it).
 */
const makeHubFetches = (
  options: WeightStoreOptions,
  remember: (w: StageWeights, path: string) => Effect.Effect<void>
) => {
  const fetches = new Map<string, { have: number; total: number; path?: string; failed?: string }>()
  return (w: StageWeights) =>
    Effect.gen(function* () {
      const state = fetches.get(w.hash)
      if (state !== undefined && state.path === undefined) {
        if (state.failed === undefined) return { _tag: "Fetching", have: state.have, total: state.total } as const
        fetches.delete(w.hash)
        return { _tag: "FetchFailed", message: state.failed } as const
      }
      fetches.delete(w.hash)
      if (state?.path !== undefined) {
        // fetched just now, its tensor hash computed as it was written: no second pass over it
        yield* remember(w, state.path)
        return { _tag: "Held", via: "Slice", path: state.path } as const
      }
      const held = yield* heldRemoteSlice(options.cacheDir, w.hash, rangeOf(w))
      if (held !== undefined) {
        yield* remember(w, held.path)
        return { _tag: "Held", via: "Slice", path: held.path } as const
      }
      const fresh: { have: number; total: number; path?: string; failed?: string } = { have: 0, total: 0 }
      fetches.set(w.hash, fresh)
      const started = Date.now()
      yield* openRemoteModel(w.modelPath).pipe(
        Effect.filterOrFail(
          (model) => remoteSliceId(model, rangeOf(w)) === w.hash,
          () =>
            new ModelLoadError({
              path: w.modelPath,
              reason: "InvalidMetadata",
              message: `${w.modelPath} on the hub is not the version the orchestrator planned with (it changed since)`
            })
        ),
        Effect.flatMap((model) =>
          fetchRemoteSlice(model, rangeOf(w), options.cacheDir, {
            onProgress: (have, total) => {
              fresh.have = have
              fresh.total = total
            }
          })
        ),
        Effect.match({
          onFailure: (e) => {
            fresh.failed = e.message
            options.log?.(
              `cannot fetch blocks [${w.layerStart}, ${w.layerEndExclusive}) of ${w.modelPath}: ${e.message}`
            )
          },
          onSuccess: (fetched) => {
            fresh.path = fetched.path
            options.log?.(
              `fetched blocks [${w.layerStart}, ${w.layerEndExclusive}) of ${w.modelPath} from the hub: ` +
                `${fetched.fetchedBytes} bytes in ${((Date.now() - started) / 1000).toFixed(1)} s: ${fetched.path}`
            )
          }
        }),
        Effect.forkDaemon
      )
      return { _tag: "Fetching", have: 0, total: 0 } as const
    })
}

type SliceCache = ReturnType<typeof makeSliceCache>

/**
 * Transfers running now (one at a time per hash; a check waits for the one running), and the sizes of partial files
 * whose SHA-256 a byte stream verified; the sink byte streams write through.
 */
const makeTransfers = (cache: SliceCache) => {
  const busy = new Map<string, Promise<void>>()
  const streamed = new Map<string, number>()
  const idle = (hash: string) => Effect.promise(() => busy.get(hash) ?? Promise.resolve())
  /** Holds `hash` for one transfer (waiting while another holds it); the function releases it. */
  const hold = (hash: string): Effect.Effect<() => void> =>
    Effect.suspend(() => {
      const running = busy.get(hash)
      if (running !== undefined) return Effect.promise(() => running).pipe(Effect.zipRight(hold(hash)))
      let done = () => {}
      busy.set(hash, new Promise<void>((resolve) => (done = resolve)))
      streamed.delete(hash)
      return Effect.succeed(() => {
        busy.delete(hash)
        done()
      })
    })
  const sink: SliceSink = {
    open: (hash) =>
      cache.partialPath(hash).pipe(
        Effect.mapError(deliveryError),
        Effect.flatMap((path) => Effect.map(hold(hash), (release) => ({ path, release })))
      ),
    verified: (hash, size) => void streamed.set(hash, size)
  }
  return { idle, streamed, sink }
}

type Transfers = ReturnType<typeof makeTransfers>

/**
 * The stage-tensor hash of the agent's own file at the model path (undefined: none, unreadable, or slicesOnly).
 * Hashing a whole model is not free: remembered per file identity (size, mtime) and range.
 */
const makeLocalHash = (options: WeightStoreOptions) => {
  const modelHashes = new Map<string, string>()
  return (w: StageWeights) =>
    Effect.suspend(() => {
      if (options.slicesOnly === true || isRemoteModel(w.modelPath)) return Effect.succeed(undefined)
      let stats: Array<readonly [number, number]>
      try {
        // every part of a split set: a part rewritten is another model
        stats = namedModelFiles(w.modelPath).map((p) => {
          const stat = Fs.statSync(p)
          return [stat.size, stat.mtimeMs] as const
        })
      } catch {
        return Effect.succeed(undefined)
      }
      const id = JSON.stringify([w.modelPath, stats, w.layerStart, w.layerEndExclusive, w.numLayers])
      const known = modelHashes.get(id)
      if (known !== undefined) return Effect.succeed(known)
      return readGgufFile(w.modelPath).pipe(
        Effect.flatMap((file) => sliceHash(file, rangeOf(w))),
        Effect.tap((hash) => Effect.sync(() => modelHashes.set(id, hash))),
        Effect.orElseSucceed(() => undefined)
      )
    })
}

/** The partial file's size (-1: none, or a malformed hash). */
const partialSize = (cache: SliceCache, hash: string) =>
  cache.partialPath(hash).pipe(
    Effect.map((path) => (Fs.existsSync(path) ? Fs.statSync(path).size : -1)),
    Effect.orElseSucceed(() => -1)
  )

/** Makes the received slice the slice once no transfer of it runs: as it is when a byte stream verified it. */
const finishTransfer = (cache: SliceCache, transfers: Transfers, w: StageWeights) =>
  Effect.gen(function* () {
    yield* transfers.idle(w.hash)
    // A byte stream checked the file's SHA-256 on arrival: no second pass over it. Else parse and hash its tensors.
    const verifiedSize = transfers.streamed.get(w.hash)
    transfers.streamed.delete(w.hash)
    return verifiedSize !== undefined && verifiedSize === (yield* partialSize(cache, w.hash))
      ? yield* cache.promote(w.hash)
      : yield* cache.finish(w.hash, rangeOf(w))
  })

export const makeWeightStore = (options: WeightStoreOptions): WeightStore => {
  const cache = makeSliceCache(options.cacheDir)
  const resolved = new Map<string, string>()
  const key = (modelPath: string, layerStart: number, layerEndExclusive: number) =>
    JSON.stringify([modelPath, layerStart, layerEndExclusive])
  let received = 0
  const transfers = makeTransfers(cache)
  const { idle, streamed } = transfers
  const remember = (w: StageWeights, path: string) =>
    Effect.sync(() => void resolved.set(key(w.modelPath, w.layerStart, w.layerEndExclusive), path))
  const localHash = makeLocalHash(options)
  const hubCheck = makeHubFetches(options, remember)

  const check = (w: StageWeights) =>
    Effect.gen(function* () {
      if (w.source === "Hub") return yield* hubCheck(w)
      yield* idle(w.hash)
      if ((yield* localHash(w)) === w.hash) {
        yield* remember(w, w.modelPath)
        return { _tag: "Held", via: "ModelFile", path: w.modelPath } as const
      }
      const status = yield* cache.status(w.hash, rangeOf(w)).pipe(Effect.mapError(deliveryError))
      if (status._tag === "Complete") {
        yield* remember(w, status.path)
        return { _tag: "Held", via: "Slice", path: status.path } as const
      }
      return { _tag: "Missing", have: status.have } as const
    })

  const finish = (w: StageWeights) =>
    finishTransfer(cache, transfers, w).pipe(
      Effect.mapError(deliveryError),
      Effect.tap((path) => remember(w, path)),
      Effect.tap((path) =>
        Effect.sync(() => {
          received++
          options.log?.(
            `received the slice for blocks [${w.layerStart}, ${w.layerEndExclusive}) of ${w.modelPath}: ${path}`
          )
        })
      )
    )

  return {
    check,
    chunk: (hash, offset, bytes) =>
      idle(hash).pipe(
        Effect.tap(() => streamed.delete(hash)),
        Effect.zipRight(cache.append(hash, offset, bytes)),
        Effect.mapError(deliveryError)
      ),
    finish,
    resolve: (modelPath, layerStart, layerEndExclusive) =>
      resolved.get(key(modelPath, layerStart, layerEndExclusive)) ??
      (options.slicesOnly === true || isRemoteModel(modelPath) ? undefined : modelPath),
    received: () => received,
    sink: transfers.sink
  }
}
