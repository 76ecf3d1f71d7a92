/**
 * Weight delivery, the orchestrator's side (issue 10): once per warm pipeline, after placement, each stage's agent is
 * asked whether it holds that stage's tensors (its own file at the model path with the same stage-tensor hash, or a
 * verified slice in its cache). If not, the orchestrator writes the stage's GGUF slice once into its outgoing folder
 * and pipes it to the agent from where the agent's partial file ends (an interrupted transfer resumes) on a byte stream
 * of its own (src/layers/gguf/SliceStream.ts: the agent checks the file's SHA-256 as bytes arrive; links without one
 * take control RPC chunks and a tensor-hash check at the end); a slice that fails the check is discarded by the agent
 * and sent again once. The agent then loads that file whenever a provision names the model path and block range.
 */
import { createHash } from "node:crypto"
import * as Fs from "node:fs"
import * as Path from "node:path"
import { Data, Effect } from "effect"
import { StageWeights, type WeightDeliveryError, type WeightsHeld } from "../../domain/controlRpc.js"
import { isRemoteModel } from "../../domain/modelName.js"
import { type GgufFile, type ModelLoadError, modelFilePaths } from "../../domain/gguf.js"
import type { LayerRange } from "../../domain/plan.js"
import { type AgentLink, AgentUnavailable } from "../../services/AgentLinks.js"
import type { RunUpdate } from "../../services/Orchestrator.js"
import { readGgufFile } from "../gguf/GgufReader.js"
import { sliceHash, type SliceRange, writeGgufSlice } from "../gguf/GgufSlice.js"
import { Settings } from "../config/Settings.js"
import { defaultSliceCacheDir } from "../gguf/SliceStore.js"
import { openRemoteModel, type RemoteModel, remoteSliceId } from "../gguf/RemoteGguf.js"
import { fetchRemoteSlice, sliceFetchBytes } from "../gguf/RemoteSlice.js"

export interface DeliveryInput {
  readonly modelPath: string
  readonly placement: ReadonlyArray<{ readonly stageIndex: number; readonly nodeId: number }>
  readonly layerRanges: ReadonlyArray<LayerRange>
  readonly linkOf: (nodeId: number) => AgentLink
  /** Where the orchestrator keeps the slices it sends (default: `outgoing` beside the default slice cache). */
  readonly outgoingDir?: string
  /** Bytes per chunk: per control RPC message, or per read of the byte stream (default 4 MiB). */
  readonly chunkBytes?: number
}

/** What happened for one stage: the agent held the weights (its model file or a cached slice), or they were sent. */
export interface StageDelivery {
  readonly stageIndex: number
  readonly nodeId: number
  /** Held (its model file, or a slice in its cache), fetched by the agent from the hub now, or sent. */
  readonly via: "ModelFile" | "Slice" | "Fetched" | "Sent"
  readonly hash: string
  /** Slice bytes sent now (0 when held). */
  readonly sentBytes: number
  /** Where the transfer started (> 0: a partial slice was resumed). */
  readonly resumedFrom: number
  readonly totalBytes: number
}

const DEFAULT_CHUNK = 4 << 20

/** Outgoing slices written by this process whose SHA-256 is not computed yet. */
const freshlyWritten = new Set<string>()

/** Hex SHA-256 of a file's bytes. */
const fileDigest = (path: string): Effect.Effect<string, unknown> =>
  Effect.tryPromise(async () => {
    const hash = createHash("sha256")
    for await (const chunk of Fs.createReadStream(path, { highWaterMark: 4 << 20 })) hash.update(chunk as Buffer)
    return hash.digest("hex")
  })

/**
 * The outgoing slice's SHA-256 (the byte stream's end-to-end check), kept beside it in `<slice>.sha256`. Computed
 * once, after the slice's own tensors were checked against `hash` (a slice that fails is written again from the
 * model): a file whose bytes match it holds the stage's tensors, so the agent need not hash them again.
 */
const certifiedSha256 = (
  file: GgufFile,
  range: SliceRange,
  hash: string,
  slicePath: string
): Effect.Effect<string, unknown> =>
  Effect.gen(function* () {
    const sidecar = `${slicePath}.sha256`
    const known = Fs.existsSync(sidecar) ? Fs.readFileSync(sidecar, "utf8").trim() : ""
    if (/^[0-9a-f]{64}$/.test(known)) return known
    // A slice this process just wrote from the model needs no tensor check.
    const sound =
      freshlyWritten.has(slicePath) ||
      (Fs.existsSync(slicePath) &&
        (yield* readGgufFile(slicePath).pipe(
          Effect.flatMap((slice) => sliceHash(slice, range)),
          Effect.map((actual) => actual === hash),
          Effect.orElseSucceed(() => false)
        )))
    freshlyWritten.delete(slicePath)
    if (!sound) {
      Fs.rmSync(slicePath, { force: true })
      yield* writeGgufSlice(file, range, slicePath)
    }
    const digest = yield* fileDigest(slicePath)
    const temporary = `${sidecar}.${process.pid}.tmp`
    Fs.writeFileSync(temporary, digest)
    Fs.renameSync(temporary, sidecar)
    return digest
  })

export const defaultOutgoingDir = (cacheDir: string): string =>
  Path.join(Path.dirname(defaultSliceCacheDir(cacheDir)), "outgoing")

const failed = (link: AgentLink, message: string) => new AgentUnavailable({ address: link.node.address, message })

/**
 * The stage-tensor hash of `file`'s `range`, remembered per file identity (path, size, mtime) and range in
 * `<outgoingDir>/hashes/` (and in this process), so later runs skip a pass over the model.
 */
const stageHash = (file: GgufFile, range: SliceRange, outgoingDir: string): Effect.Effect<string, ModelLoadError> =>
  Effect.suspend(() => {
    let key: string
    try {
      // every file of the model (a split set's parts): a part rewritten is another model
      const files = modelFilePaths(file).map((p) => {
        const stat = Fs.statSync(p)
        return [Path.resolve(p), stat.size, stat.mtimeMs]
      })
      key = createHash("sha256")
        .update(
          JSON.stringify([
            ...(files.length === 1 ? files[0]! : files),
            range.layerStart,
            range.layerEndExclusive,
            range.numLayers
          ])
        )
        .digest("hex")
    } catch {
      return sliceHash(file, range)
    }
    const known = knownHashes.get(key)
    if (known !== undefined) return Effect.succeed(known)
    const memo = Path.join(outgoingDir, "hashes", key)
    try {
      const text = Fs.readFileSync(memo, "utf8").trim()
      if (/^[0-9a-f]{64}$/.test(text)) {
        knownHashes.set(key, text)
        return Effect.succeed(text)
      }
    } catch {
      // not remembered yet
    }
    return sliceHash(file, range).pipe(
      Effect.tap((hash) =>
        Effect.sync(() => {
          knownHashes.set(key, hash)
          try {
            Fs.mkdirSync(Path.dirname(memo), { recursive: true })
            Fs.writeFileSync(`${memo}.${process.pid}.tmp`, hash)
            Fs.renameSync(`${memo}.${process.pid}.tmp`, memo)
          } catch {
            // an unwritable folder only costs the next run a hash
          }
        })
      )
    )
  })
const knownHashes = new Map<string, string>()

/** How often the orchestrator asks an agent fetching from the hub how far it got. */
const FETCH_POLL = "100 millis"

/**
 * A stage of a remote model: its agent fetches the slice from the hub itself (or holds it from before). The orchestrator
 * asks until it holds it, reporting the agent's bytes as `WeightsDelivery` updates from the hub; `Failed` when the
 * agent cannot reach the hub or the hub refuses it (the agent's reason), so the caller sends the slice instead.
 */
const hubDelivery = (
  model: RemoteModel,
  range: SliceRange,
  stageIndex: number,
  nodeId: number,
  link: AgentLink,
  progress: (update: RunUpdate) => Effect.Effect<void>
): Effect.Effect<
  | { readonly _tag: "Delivered"; readonly delivery: StageDelivery }
  | { readonly _tag: "Failed"; readonly message: string },
  AgentUnavailable
> =>
  Effect.gen(function* () {
    const rpc = link.weights!
    const hash = remoteSliceId(model, range)
    const weights = new StageWeights({ modelPath: model.named, ...range, hash, source: "Hub" })
    // What the node fetches (its ranges): known here from the header, whatever the node has said so far.
    const total = sliceFetchBytes(model.file, range)
    const report = (have: number) =>
      progress({
        _tag: "WeightsDelivery",
        stageIndex,
        address: link.node.address,
        sentBytes: have,
        totalBytes: total,
        source: "Hub"
      })
    let reported = -1
    for (;;) {
      const held = yield* rpc
        .check(weights)
        .pipe(Effect.mapError((e) => failed(link, `weight delivery of stage ${stageIndex}: ${e.message}`)))
      switch (held._tag) {
        case "Held": {
          const fetched = reported >= 0
          if (fetched && reported < total) yield* report(total)
          return {
            _tag: "Delivered",
            delivery: {
              stageIndex,
              nodeId,
              via: fetched ? "Fetched" : held.via,
              hash,
              sentBytes: 0,
              resumedFrom: 0,
              totalBytes: fetched ? total : 0
            }
          } as const
        }
        case "Fetching":
          if (held.have !== reported) {
            reported = held.have
            yield* report(held.have)
          }
          yield* Effect.sleep(FETCH_POLL)
          continue
        case "FetchFailed":
          return { _tag: "Failed", message: held.message } as const
        case "Missing":
          return { _tag: "Failed", message: "the agent does not fetch from a hub" } as const
      }
    }
  })

/**
 * The fallback for a node that cannot fetch from the hub: this process fetches the stage's slice (its bytes only) into
 * `<outgoingDir>/hub`, and puts it where a slice it sends is kept (`<outgoingDir>/<tensor hash>.gguf`). Returns the
 * slice's tensor hash, which names it in the delivery that follows.
 */
const fetchForward = (model: RemoteModel, range: SliceRange, outgoingDir: string) =>
  Effect.gen(function* () {
    const fetched = yield* fetchRemoteSlice(model, range, Path.join(outgoingDir, "hub"))
    const slicePath = Path.join(outgoingDir, `${fetched.tensorHash}.gguf`)
    if (!Fs.existsSync(slicePath)) {
      yield* Effect.try({
        try: () => {
          try {
            Fs.linkSync(fetched.path, slicePath)
          } catch {
            Fs.copyFileSync(fetched.path, slicePath)
          }
        },
        catch: (e) => new HubFallbackError({ message: `cannot keep the slice at ${slicePath}: ${String(e)}` })
      })
      freshlyWritten.add(slicePath)
    }
    return fetched.tensorHash
  })

class HubFallbackError extends Data.TaggedError("HubFallbackError")<{ readonly message: string }> {}

/** What a delivery answer may be (a hub fetch's answers are hubDelivery's). */
const isHeldOrMissing = (h: WeightsHeld): h is Extract<WeightsHeld, { _tag: "Held" | "Missing" }> =>
  h._tag === "Held" || h._tag === "Missing"

/**
 * The model's header and block count: a local file's, or a hub name's or URL's (RemoteGguf.ts, the header only: every
 * node fetches its own stage's bytes from the hub).
 */
const modelOf = (modelPath: string) =>
  Effect.gen(function* () {
    const cannotRead = (e: { readonly message: string }) =>
      new AgentUnavailable({ address: "orchestrator", message: `cannot read ${modelPath}: ${e.message}` })
    const remote = isRemoteModel(modelPath)
      ? yield* openRemoteModel(modelPath).pipe(Effect.mapError(cannotRead))
      : undefined
    const file = remote !== undefined ? remote.file : yield* readGgufFile(modelPath).pipe(Effect.mapError(cannotRead))
    const numLayers = file.tensors.reduce((n, t) => {
      const m = /^blk\.(\d+)\./.exec(t.name)
      return m === null ? n : Math.max(n, Number(m[1]) + 1)
    }, 0)
    return { remote, file, numLayers }
  })

/** What every stage's delivery shares: the input, the model (read once), where slices go and the chunk size. */
type DeliveryContext = Effect.Effect.Success<ReturnType<typeof modelOf>> & {
  readonly input: DeliveryInput
  readonly progress: (update: RunUpdate) => Effect.Effect<void>
  readonly outgoingDir: string
  readonly chunkBytes: number
}

/** One stage's slice on its way to its agent. */
interface SliceSend {
  readonly ctx: DeliveryContext
  readonly link: AgentLink
  readonly rpc: NonNullable<AgentLink["weights"]>
  readonly stageIndex: number
  readonly nodeId: number
  readonly range: SliceRange
  readonly hash: string
  readonly weights: StageWeights
  readonly slicePath: string
  readonly sidecar: string
  readonly totalBytes: number
  /** Bytes the agent has, and the last figure reported. */
  reached: number
  reported: number
}

const wordsOf = (link: AgentLink, stageIndex: number) => (e: { readonly message: string }) =>
  failed(link, `weight delivery of stage ${stageIndex}: ${e.message}`)

/** The slice to send, written once per content hash (the writer is deterministic, so offsets stay valid). */
const writeSliceOnce = (ctx: DeliveryContext, link: AgentLink, range: SliceRange, hash: string) =>
  Effect.gen(function* () {
    const { outgoingDir } = ctx
    const slicePath = Path.join(outgoingDir, `${hash}.gguf`)
    const sidecar = `${slicePath}.sha256`
    if (!Fs.existsSync(slicePath)) {
      yield* Effect.try({
        try: () => {
          Fs.mkdirSync(outgoingDir, { recursive: true })
          Fs.rmSync(sidecar, { force: true })
        },
        catch: (e) => failed(link, String(e))
      })
      yield* writeGgufSlice(ctx.file, range, slicePath).pipe(
        Effect.mapError((e) => failed(link, `cannot write the slice: ${e.message}`))
      )
      freshlyWritten.add(slicePath)
    }
    const totalBytes = yield* Effect.try({
      try: () => Fs.statSync(slicePath).size,
      catch: (e) => failed(link, String(e))
    })
    return { slicePath, sidecar, totalBytes }
  })

/** A `WeightsDelivery` update with the bytes reached, unless that figure was reported already. */
const reportReached = (send: SliceSend) =>
  Effect.suspend(() => {
    if (send.reached === send.reported) return Effect.void
    send.reported = send.reached
    return send.ctx.progress({
      _tag: "WeightsDelivery",
      stageIndex: send.stageIndex,
      address: send.link.node.address,
      sentBytes: send.reached,
      totalBytes: send.totalBytes
    })
  })

/** The bytes from `from` on the link's byte stream, progress read off it every 100 ms. */
const streamFrom = (send: SliceSend, stream: NonNullable<SliceSend["rpc"]["stream"]>, from: number) =>
  Effect.gen(function* () {
    const sha256 = yield* certifiedSha256(send.ctx.file, send.range, send.hash, send.slicePath).pipe(
      Effect.mapError((e) =>
        failed(send.link, `cannot prepare the slice: ${e instanceof Error ? e.message : String(e)}`)
      )
    )
    send.reached = from
    const piped = stream({
      hash: send.hash,
      path: send.slicePath,
      offset: from,
      sha256,
      chunkBytes: send.ctx.chunkBytes,
      onBytes: (offset) => (send.reached = offset)
    })
    const report = reportReached(send)
    yield* Effect.raceFirst(piped, report.pipe(Effect.delay("100 millis"), Effect.forever))
    yield* report
  })

/** The bytes from `from` as control RPC chunks, one at a time. */
const chunksFrom = (send: SliceSend, from: number) =>
  Effect.acquireUseRelease(
    Effect.try({ try: () => Fs.openSync(send.slicePath, "r"), catch: (e) => failed(send.link, String(e)) }),
    (fd) =>
      Effect.gen(function* () {
        const { chunkBytes } = send.ctx
        const { totalBytes } = send
        let offset = Math.min(from, totalBytes)
        const buffer = Buffer.allocUnsafe(chunkBytes)
        while (offset < totalBytes) {
          const n = Fs.readSync(fd, buffer, 0, Math.min(chunkBytes, totalBytes - offset), offset)
          offset = yield* send.rpc.chunk(send.hash, offset, buffer.subarray(0, n))
          send.reached = offset
          yield* reportReached(send)
        }
      }),
    (fd) => Effect.sync(() => Fs.closeSync(fd))
  )

/**
 * The bytes from `from`: a byte stream of their own when the link has one (progress read off it every
 * 100 ms), else control RPC chunks one at a time.
 */
const transferFrom = (send: SliceSend, from: number): Effect.Effect<void, AgentUnavailable | WeightDeliveryError> => {
  const stream = send.rpc.stream
  return stream !== undefined ? streamFrom(send, stream, from) : chunksFrom(send, from)
}

/** Sends the slice from where the agent's partial file ends, and once more whole if the agent found it corrupt. */
const sendSlice = (send: SliceSend, have: number) =>
  Effect.gen(function* () {
    const { stageIndex, nodeId, hash, totalBytes } = send
    const words = wordsOf(send.link, stageIndex)
    const attempt = (from: number) => transferFrom(send, from).pipe(Effect.zipRight(send.rpc.finish(send.weights)))
    const first = yield* attempt(have).pipe(Effect.either)
    if (first._tag === "Left") {
      // A partial file that was not a prefix of this slice: the agent discarded it; send it whole once more.
      // (Or the orchestrator's own slice changed on disk: its SHA-256 is computed again after a tensor check.)
      if (first.left._tag !== "WeightDeliveryError" || first.left.reason !== "Corrupt") return yield* words(first.left)
      yield* Effect.sync(() => Fs.rmSync(send.sidecar, { force: true }))
      yield* attempt(0).pipe(Effect.mapError(words))
      return {
        stageIndex,
        nodeId,
        via: "Sent",
        hash,
        sentBytes: totalBytes,
        resumedFrom: 0,
        totalBytes
      } satisfies StageDelivery
    }
    return {
      stageIndex,
      nodeId,
      via: "Sent",
      hash,
      sentBytes: totalBytes - Math.min(have, totalBytes),
      resumedFrom: have,
      totalBytes
    } satisfies StageDelivery
  })

/** One stage's weights to its agent: held already, fetched by the agent from the hub, or sent. */
const deliverStage = (
  ctx: DeliveryContext,
  stageIndex: number,
  nodeId: number,
  [layerStart, layerEndExclusive]: LayerRange
) =>
  Effect.gen(function* () {
    const { remote, file, numLayers, outgoingDir, input } = ctx
    const link = input.linkOf(nodeId)
    const range: SliceRange = { layerStart, layerEndExclusive, numLayers }
    if (link.weights === undefined) return yield* failed(link, "this link cannot take weight deliveries")
    const rpc = link.weights
    const words = wordsOf(link, stageIndex)
    if (remote !== undefined) {
      // The node fetches its slice from the hub; failing that, this process fetches it and sends it.
      const fromHub = yield* hubDelivery(remote, range, stageIndex, nodeId, link, ctx.progress)
      if (fromHub._tag === "Delivered") return fromHub.delivery
    }
    const hash = yield* (
      remote !== undefined ? fetchForward(remote, range, outgoingDir) : stageHash(file, range, outgoingDir)
    ).pipe(
      Effect.mapError((e) =>
        failed(link, `cannot ${remote ? "fetch the slice from the hub" : "hash the model"}: ${e.message}`)
      )
    )
    const weights = new StageWeights({ modelPath: input.modelPath, layerStart, layerEndExclusive, numLayers, hash })

    const held = yield* rpc.check(weights).pipe(
      Effect.mapError(words),
      Effect.filterOrFail(isHeldOrMissing, (h) => words({ message: `the agent answered ${h._tag} to a delivery` }))
    )
    if (held._tag === "Held") {
      return {
        stageIndex,
        nodeId,
        via: held.via,
        hash,
        sentBytes: 0,
        resumedFrom: 0,
        totalBytes: 0
      } satisfies StageDelivery
    }
    const slice = yield* writeSliceOnce(ctx, link, range, hash)
    const send: SliceSend = {
      ctx,
      link,
      rpc,
      stageIndex,
      nodeId,
      range,
      hash,
      weights,
      ...slice,
      reached: held.have,
      reported: -1
    }
    return yield* sendSlice(send, held.have)
  })

/** Delivers every stage's weights its agent lacks; reports `WeightsDelivery` updates as bytes go. */
export const deliverWeights = (
  input: DeliveryInput,
  progress: (update: RunUpdate) => Effect.Effect<void>
): Effect.Effect<ReadonlyArray<StageDelivery>, AgentUnavailable> =>
  Effect.gen(function* () {
    const { remote, file, numLayers } = yield* modelOf(input.modelPath)
    const outgoingDir = input.outgoingDir ?? defaultOutgoingDir((yield* Settings).cacheDir)
    const chunkBytes = input.chunkBytes ?? DEFAULT_CHUNK
    const ctx: DeliveryContext = { remote, file, numLayers, input, progress, outgoingDir, chunkBytes }
    return yield* Effect.forEach(
      input.placement,
      ({ nodeId, stageIndex }) => deliverStage(ctx, stageIndex, nodeId, input.layerRanges[stageIndex]!),
      { concurrency: "unbounded" }
    )
  })
