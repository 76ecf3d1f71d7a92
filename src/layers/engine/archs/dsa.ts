/**
 * DeepSeek sparse attention (DSA): deepseek32 (DeepSeek-V3.2; llama.cpp src/models/deepseek32.cpp) and glm-dsa
 * (GLM-5; src/models/glm-dsa.cpp). Each is deepseek2's latent attention (archs/deepseek2.ts) plus a lightning indexer
 * per block that picks, for every query row, the `attention.indexer.top_k` cached positions attention reads:
 * - q: attn_q_a's normed latent through indexer.attn_q_b, [key_length, indexer heads, n]; k: the block's normed input
 *   through indexer.attn_k, LayerNormed with weight and bias (indexer.k_norm), one head. Both are RoPE'd on their
 *   first rope.dimension_count elements (NEOX for deepseek32, NORM for glm-dsa), then rotated by the orthonormal
 *   Walsh-Hadamard matrix of key_length (a graph input, `hadamardRotation`).
 * - k goes into the block's indexer cache (the block's V cache: a latent block has none, BlockMemory.ts); the score of
 *   a cell is the sum over heads of relu(q.k) x the head's weight (indexer.proj of the input, scaled by
 *   1 / sqrt(key_length x heads)), ggml_lightning_indexer; attention's mask opens only each row's top-k cells (ggml_top_k)
 *   that the causal mask opens.
 * - glm-dsa: a block whose `attention.indexer.types` entry is false has no indexer and reuses the top-k of the last
 *   block before it that has one; a stage cannot start at it (the block it reuses must be on the same stage).
 * Refused naming the key: no q_lora_rank (the indexer reads the Q latent), a key_length that is not a power of two
 * >= 64 or is below the RoPE width, or equals the latent cache's row (llama.cpp then rotates the latent cache too).
 */
import { Effect } from "effect"
import type { GgufFile, ModelLoadError } from "../../../domain/gguf.js"
import { GgmlType, type Ptr } from "../../ggml/Bindings.js"
import { getArray, getOptional, getU32 } from "../../gguf/GgufReader.js"
import type { ArchModule } from "../Arch.js"
import { type DsaParams, type HParams, RopeMode } from "../HParams.js"
import { invalidMetadata } from "../MetadataErrors.js"
import { type AttentionSegment, type BlockWeights, llamaOutputHead, type TensorSpec, type Toolkit } from "../Toolkit.js"
import { type MlaFamily, mlaBlock, mlaBlockSpecs, readMlaModel, type SparseMask } from "./deepseek2.js"

const f = Math.fround

/**
 * llama.cpp's ggml_gen_hadamard (llama-kv-cache.cpp): the n x n orthonormal Walsh-Hadamard matrix, row-major, each
 * entry +-(1 / sqrtf(n)) as float, the sign (-1)^popcount(i & j).
 */
export const hadamardRotation = (n: number): Float32Array => {
  const out = new Float32Array(n * n)
  const v = f(1 / f(Math.sqrt(n)))
  for (let i = 0; i < n; i++) {
    for (let j = 0; j < n; j++) {
      let bits = i & j
      let odd = 0
      while (bits !== 0) {
        odd ^= bits & 1
        bits >>>= 1
      }
      out[i * n + j] = odd === 0 ? v : -v
    }
  }
  return out
}

/** GLM-5.2's indexer pattern when its file has no `attention.indexer.types` (glm-dsa.cpp's default): 1, 1, then 1, 0, 0, 0. */
const glm52Types = (nLayer: number): ReadonlyArray<boolean> =>
  Array.from({ length: nLayer }, (_, il) => il < 2 || (il - 2) % 4 === 0)

const readDsa =
  (family: Exclude<MlaFamily, "deepseek2">) =>
  (file: GgufFile, hp0: HParams): Effect.Effect<HParams, ModelLoadError> =>
    Effect.gen(function* () {
      const hp = yield* readMlaModel(file, hp0, family)
      const mla = hp.mla!
      const k = (s: string) => `${hp.arch}.attention.indexer.${s}`
      const fail = (key: string, message: string) => Effect.fail(invalidMetadata(file, key, message))
      const nHead = yield* getU32(file, k("head_count"))
      const headSize = yield* getU32(file, k("key_length"))
      const topK = yield* getU32(file, k("top_k"))
      if (nHead <= 0) return yield* fail(k("head_count"), `= ${nHead} must be > 0`)
      if (topK <= 0) return yield* fail(k("top_k"), `= ${topK} must be > 0`)
      if (!(headSize >= 64 && (headSize & (headSize - 1)) === 0)) {
        return yield* fail(k("key_length"), `= ${headSize} must be a power of two >= 64 (its Hadamard rotation)`)
      }
      if (headSize < hp.nRot) {
        return yield* fail(k("key_length"), `= ${headSize} is below rope.dimension_count = ${hp.nRot}`)
      }
      if (headSize === hp.headDimK) {
        return yield* fail(
          k("key_length"),
          `= ${headSize} equals the latent cache's row (attention.key_length): llama.cpp then rotates that cache too, which swactor does not`
        )
      }
      if (mla.qLoraRank === 0) {
        return yield* fail(`${hp.arch}.attention.q_lora_rank`, `is 0: the indexer reads the Q latent (attn_q_a)`)
      }
      const full = yield* indexerTypes(file, hp, family)
      const dsa: DsaParams = {
        nHead,
        headSize,
        topK,
        ropeMode: family === "deepseek32" ? RopeMode.NEOX : RopeMode.NORM,
        normEps: family === "deepseek32" ? 1e-6 : 0,
        full
      }
      return { ...hp, dsa }
    })

/** Which blocks have an indexer of their own: every one (deepseek32, GLM-5/5.1), or glm-dsa's `indexer.types`. */
const indexerTypes = (
  file: GgufFile,
  hp: HParams,
  family: Exclude<MlaFamily, "deepseek2">
): Effect.Effect<ReadonlyArray<boolean>, ModelLoadError> =>
  Effect.gen(function* () {
    const all = Array.from({ length: hp.nLayer }, () => true)
    if (family === "deepseek32") return all
    const key = `${hp.arch}.attention.indexer.types`
    const raw = yield* getOptional(file, key, getArray)
    let types: ReadonlyArray<boolean>
    if (raw === undefined) {
      // llama.cpp: files before GLM-5.2 (context < 1M) have an indexer in every block; GLM-5.2's default pattern
      const context = yield* getU32(file, `${hp.arch}.context_length`)
      types = context < 1048576 ? all : glm52Types(hp.nLayer)
    } else {
      if (raw.length < hp.nLayer || !raw.every((v) => typeof v === "boolean" || typeof v === "number")) {
        return yield* Effect.fail(invalidMetadata(file, key, `must hold one flag per block (${hp.nLayer})`))
      }
      types = raw.slice(0, hp.nLayer).map((v) => v === true || v === 1)
    }
    if (types[0] !== true) {
      return yield* Effect.fail(
        invalidMetadata(file, key, `block 0 must have an indexer (later blocks reuse its top-k)`)
      )
    }
    return types
  })

const dsaOf = (hp: HParams): DsaParams => {
  if (hp.dsa === undefined) throw new Error("DSA hyperparameters were not read")
  return hp.dsa
}

const dsaSpecs = (hp: HParams, il: number): ReadonlyArray<TensorSpec> => {
  const dsa = dsaOf(hp)
  const base = mlaBlockSpecs(hp, il)
  if (dsa.full[il] !== true) return base
  const m = (name: string, dims: ReadonlyArray<number>): TensorSpec => ({ name, dims, kind: "matrix", required: true })
  const vec = (name: string, n: number): TensorSpec => ({ name, dims: [n], kind: "vector", required: true })
  return [
    ...base,
    vec("indexer.k_norm.weight", dsa.headSize),
    vec("indexer.k_norm.bias", dsa.headSize),
    m("indexer.proj.weight", [hp.nEmbd, dsa.nHead]),
    m("indexer.attn_k.weight", [hp.nEmbd, dsa.headSize]),
    m("indexer.attn_q_b.weight", [hp.mla!.qLoraRank, dsa.nHead * dsa.headSize])
  ]
}

/** Per graph build: each sequence's top-k mask of the last block with an indexer (glm-dsa's shared blocks reuse it). */
const lastMasks = new WeakMap<Toolkit, Map<number, { readonly mask: Ptr; readonly open: number }>>()

/**
 * One sequence's top-k mask: its indexer keys into the block's indexer cache, the cells' scores
 * (ggml_lightning_indexer), the top-k of each row opened in an all -inf mask, plus the causal mask.
 */
const topKMask = (t: Toolkit, seg: AttentionSegment, q: Ptr, k: Ptr, weights: Ptr) => {
  const g = t.g
  const ctx = t.ctx
  const dsa = dsaOf(t.hp)
  const d = dsa.headSize
  const cache = seg.kv(t.layer).v
  const k2 = g.ggml_view_2d(ctx, k, d, seg.n, g.ggml_row_size(GgmlType.F32, d), 0)
  g.ggml_build_forward_expand(t.graph, g.ggml_set_rows(ctx, cache, k2, seg.kvIdx))
  const row = g.ggml_row_size(GgmlType.F16, d)
  const keys = g.ggml_view_3d(ctx, cache, d, 1, seg.nKv, row, row, 0)
  const w2 = g.ggml_view_2d(ctx, weights, dsa.nHead, seg.n, g.ggml_row_size(GgmlType.F32, dsa.nHead), 0)
  const scores = g.ggml_lightning_indexer(ctx, q, keys, w2, seg.mask)
  const open = Math.min(seg.nKv, dsa.topK)
  const top = g.ggml_top_k(ctx, scores, open)
  // the causal mask's shape filled with -inf, seen as rows of one cell: [1, nKv, n]; 0 written at each top-k cell
  const half = 2
  const closed = g.ggml_fill(ctx, seg.mask, -Infinity)
  const cells = g.ggml_view_4d(ctx, closed, 1, seg.nKv, seg.n, 1, half, half * seg.nKv, half * seg.nKv * seg.n, 0)
  const zeros = g.ggml_fill(ctx, g.ggml_new_tensor_4d(ctx, GgmlType.F32, 1, open, seg.n, 1), 0)
  const picked = g.ggml_set_rows(
    ctx,
    cells,
    zeros,
    g.ggml_view_4d(ctx, top, open, seg.n, 1, 1, 4 * open, 4 * open * seg.n, 4 * open * seg.n, 0)
  )
  const back = g.ggml_view_4d(
    ctx,
    picked,
    seg.nKv,
    seg.n,
    1,
    1,
    half * seg.nKv,
    half * seg.nKv * seg.n,
    half * seg.nKv * seg.n,
    0
  )
  return { mask: g.ggml_add(ctx, back, seg.mask), open }
}

/** The indexer's rows of the whole batch (a block with an indexer), and each sequence's top-k mask from them. */
const indexer = (t: Toolkit, w: BlockWeights, h: Ptr, qr: Ptr): SparseMask => {
  const g = t.g
  const ctx = t.ctx
  const hp = t.hp
  const dsa = dsaOf(hp)
  const n = t.nTokens
  const rot = t.inputs.hadamard
  if (rot === undefined || rot === null) throw new Error("the graph has no Hadamard rotation input")
  const d = dsa.headSize
  let q = g.ggml_reshape_3d(ctx, t.linear(w.get("indexer.attn_q_b.weight"), qr), d, dsa.nHead, n)
  q = g.ggml_mul_mat(ctx, rot, t.rope(q, null, dsa.ropeMode))
  const kNorm = g.ggml_add(
    ctx,
    g.ggml_mul(
      ctx,
      g.ggml_norm(ctx, t.linear(w.get("indexer.attn_k.weight"), h), dsa.normEps),
      w.get("indexer.k_norm.weight")
    ),
    w.get("indexer.k_norm.bias")
  )
  const k = g.ggml_mul_mat(ctx, rot, t.rope(g.ggml_reshape_3d(ctx, kNorm, d, 1, n), null, dsa.ropeMode))
  const weights = g.ggml_scale(ctx, t.linear(w.get("indexer.proj.weight"), h), f(1 / f(Math.sqrt(d * dsa.nHead))))
  const masks = new Map<number, { readonly mask: Ptr; readonly open: number }>()
  lastMasks.set(t, masks)
  return {
    parts: [
      { x: q, ne0: d, ne1: dsa.nHead },
      { x: k, ne0: d, ne1: 1 },
      { x: weights, ne0: dsa.nHead, ne1: 1 }
    ],
    maskOf: (seg, [qs, ks, ws]) => {
      const m = topKMask(t, seg, qs!, ks!, ws!)
      masks.set(seg.offset, m)
      return m
    }
  }
}

/** A glm-dsa block without an indexer: each sequence's mask of the last block with one, in this graph. */
const reusedMask = (t: Toolkit): SparseMask => {
  const masks = lastMasks.get(t)
  if (masks === undefined) {
    throw new Error(`block ${t.layer} reuses an earlier block's indexer top-k, but its stage holds no such block`)
  }
  return {
    parts: [],
    maskOf: (seg) => {
      const m = masks.get(seg.offset)
      if (m === undefined) throw new Error(`block ${t.layer}: no top-k of the sequence at row ${seg.offset}`)
      return m
    }
  }
}

const dsaModule = (family: Exclude<MlaFamily, "deepseek2">): ArchModule => ({
  name: family,
  ropeMode: RopeMode.NORM,
  ownHeadShape: true,
  hparams: readDsa(family),
  blockTensors: dsaSpecs,
  buildOutput: llamaOutputHead,
  buildBlock: (t, w, x) =>
    mlaBlock(t, w, x, (h, qr) => (dsaOf(t.hp).full[t.layer] === true ? indexer(t, w, h, qr) : reusedMask(t)))
})

export const deepseek32 = dsaModule("deepseek32")
export const glmDsa = dsaModule("glm-dsa")
