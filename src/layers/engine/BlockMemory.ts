/**
 * What each block of a model keeps per sequence, from its HParams alone: the one source of an architecture's per-block
 * memory facts. The engine's KV cache allocates by it (KvCache.ts), a loaded stage reports it (StageInfo), and the model
 * catalog's layout is built from it (ModelCatalogLive.ts), which placement, `--dry-run` and the server's admission read.
 * An architecture states these facts once, in its module's hyperparameters (HParams.swa, kvShare, mla, recurrent,
 * blockHeads); nothing else derives them.
 */
import type { ModelLayout } from "../../domain/plan.js"
import { tokenSourcesOf, topKSourcesOf } from "../../services/KvShare.js"
import { kvBytesPerTokenOfBlock } from "../../services/KvSize.js"
import { type HParams, headsOf } from "./HParams.js"
import { recurrentStateElems } from "./RecurrentParams.js"

/** One block's memory per sequence. */
export type BlockMemory =
  /**
   * Its own F16 K and V cache: `kRow` and `vRow` elements per token (head size x KV heads, per block: headsOf). `vRow`
   * 0: latent attention (HParams.mla), V is a view of the K row; with sparse attention (HParams.dsa) the V cache holds
   * the lightning indexer's keys instead (`vRow` = its key size) on a block with an indexer of its own. `window`: a sliding-window block, its cache capped.
   */
  | {
      readonly kind: "kv"
      readonly kRow: number
      readonly vRow: number
      readonly window: number | undefined
      /**
       * The V cache is F32, vRow / 2 values a cell (vRow counts F16 places, so bytes stay 2 x vRow): deepseek4's
       * compressor rows, kept at full precision as llama.cpp's compressor state; absent: F16.
       */
      readonly vF32?: true
    }
  /** No cache of its own: it attends over block `source`'s (HParams.kvShare, gemma4's shared KV layers). */
  | { readonly kind: "sharedKv"; readonly source: number }
  /** A DeltaNet block (HParams.recurrent): a constant F32 state, `conv` + `ssm` elements, whatever the context. */
  | { readonly kind: "state"; readonly conv: number; readonly ssm: number }

/** Block `il`'s memory per sequence. */
export const blockMemory = (hp: HParams, il: number): BlockMemory => {
  if (hp.recurrent?.layers[il] === true) return { kind: "state", ...recurrentStateElems(hp.recurrent) }
  const source = hp.kvShare?.sources[il]
  if (source !== undefined && source !== il) return { kind: "sharedKv", source }
  if (hp.dsv4 !== undefined) return dsv4Memory(hp, il)
  const h = headsOf(hp, il)
  return {
    kind: "kv",
    kRow: h.headDimK * h.nHeadKv,
    vRow: hp.mla === undefined ? h.headDimV * h.nHeadKv : hp.dsa?.full[il] === true ? hp.dsa.headSize : 0,
    window: hp.swa?.layers[il] === true ? hp.swa.window : undefined
  }
}

/**
 * A deepseek4 block: its K row is the window's K=V row (key_length), then on a compressed block the compressed row of
 * the block of 4 positions ending there (key_length) and its indexer key (the indexer's key_length); its V row (F32) the
 * compressor's rows of each position: K and score, 2 x key_length each, the indexer's, 2 x its key_length each. One
 * cell per position (the window's cache uncapped, HParams.SwaParams.uncapped).
 */
const dsv4Memory = (hp: HParams, il: number): BlockMemory => {
  const d = hp.dsv4!
  const compressed = d.ratios[il] === 4
  const ih = d.indexer.headSize
  // a heavily compressed block: the compressed row beside the window's; the compressor's K and score rows, F32
  if (d.ratios[il] === 128)
    return { kind: "kv", kRow: 2 * hp.headDimK, vRow: 2 * 2 * hp.headDimK, window: undefined, vF32: true }
  return {
    kind: "kv",
    kRow: hp.headDimK + (compressed ? hp.headDimK + ih : 0),
    vRow: compressed ? 2 * (4 * hp.headDimK + 4 * ih) : 0,
    window: undefined,
    ...(compressed ? { vF32: true as const } : {})
  }
}

/** KV bytes per token a block keeps (0 for a state or a shared cache). */
export const kvBytesPerTokenOfMemory = (m: BlockMemory): number =>
  m.kind === "kv" ? kvBytesPerTokenOfBlock(m.kRow, m.vRow) : 0

/** State bytes a block keeps per sequence (0 for a KV block). */
export const stateBytesOfMemory = (m: BlockMemory): number => (m.kind === "state" ? 4 * (m.conv + m.ssm) : 0)

/** The catalog layout's memory fields of the model's first `numLayers` blocks (ModelLayout). */
export type KvLayout = Pick<
  ModelLayout,
  "kvBytesPerToken" | "slidingWindow" | "stateBytes" | "kvSources" | "topKSources" | "tokenSources" | "rewind"
>

/** The model's per-block memory as the catalog's layout holds it. */
export const kvLayoutOf = (hp: HParams, numLayers: number = hp.nLayer): KvLayout => {
  const blocks = Array.from({ length: numLayers }, (_, il) => blockMemory(hp, il))
  const stateBytes = blocks.map(stateBytesOfMemory)
  return {
    kvBytesPerToken: blocks.map(kvBytesPerTokenOfMemory),
    ...(hp.swa === undefined || hp.swa.uncapped === true
      ? {}
      : {
          slidingWindow: {
            window: hp.swa.window,
            blocks: Array.from({ length: numLayers }, (_, il) => hp.swa!.layers[il] === true)
          }
        }),
    ...(stateBytes.some((b) => b > 0) ? { stateBytes } : {}),
    // recurrent states roll back through a verify step's per-row snapshots (RecurrentSnapshots.ts); deepseek4's
    // compressed caches do not
    ...(hp.dsv4 !== undefined ? { rewind: false as const } : {}),
    ...(hp.kvShare === undefined ? {} : { kvSources: hp.kvShare.sources.slice(0, numLayers) }),
    ...(hp.dsa === undefined || hp.dsa.full.every((f) => f)
      ? {}
      : { topKSources: topKSourcesOf(hp.dsa.full).slice(0, numLayers) }),
    ...((hp.dsv4?.hashLayers ?? 0) > 1
      ? { tokenSources: tokenSourcesOf(hp.nLayer, hp.dsv4!.hashLayers).slice(0, numLayers) }
      : {})
  }
}

/** A stage's memory per sequence over blocks [start, end) as StageInfo reports it. */
export const stageMemoryOf = (
  hp: HParams,
  start: number,
  end: number
): {
  readonly kvBytesPerToken: number
  readonly stateBytes?: number
  readonly kvWindow?: { readonly window: number; readonly bytesPerToken: number }
} => {
  let kvBytesPerToken = 0
  let stateBytes = 0
  let windowBytes = 0
  let window: number | undefined
  for (let il = start; il < end; il++) {
    const m = blockMemory(hp, il)
    kvBytesPerToken += kvBytesPerTokenOfMemory(m)
    stateBytes += stateBytesOfMemory(m)
    if (m.kind === "kv" && m.window !== undefined) {
      window = m.window
      windowBytes += kvBytesPerTokenOfMemory(m)
    }
  }
  return {
    kvBytesPerToken,
    ...(stateBytes === 0 ? {} : { stateBytes }),
    ...(window === undefined ? {} : { kvWindow: { window, bytesPerToken: windowBytes } })
  }
}
