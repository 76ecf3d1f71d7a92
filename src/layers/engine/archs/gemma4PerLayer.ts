/**
 * gemma4 E2B/E4B's two additions to the dense block (llama.cpp src/models/gemma4.cpp, llama-model.cpp's KV reuse):
 *
 * Per-layer embeddings (`embedding_length_per_layer_input` = width > 0). On the first stage, from the token ids and the
 * scaled token embeddings x: per_layer_token_embd rows x sqrt(width), plus RMS-norm(per_layer_model_proj x / sqrt(n_embd))
 * x per_layer_proj_norm, the sum / sqrt(2): width values per block per token (build_inp_per_layer,
 * project_per_layer_inputs). After each block's feed-forward residual: out + post_norm(proj(gelu(inp_gate out) x its
 * per-layer input)), before the block's output scale. The first stage computes all blocks' inputs and they travel with
 * the activations (engine/PerLayerInputs.ts says why); only the first stage loads the per-layer tables.
 *
 * Shared KV layers (`attention.shared_kv_layers` = s > 0): blocks from n_layer - s on compute Q only and attend over
 * the cache of block from - 2 (a sliding-window block) or from - 1 (a global one), as llama.cpp's reuse callback does;
 * they keep no cache. The source must be of the block's own kind (else refused, naming the key). A stage must hold a
 * reusing block together with its source (StageLayout refuses a range that separates them; the catalog's layout keeps
 * placement from cutting there).
 */
import { Effect } from "effect"
import type { GgufFile, ModelLoadError } from "../../../domain/gguf.js"
import { getGgml, GgmlType, type Ptr } from "../../ggml/Bindings.js"
import { getU32 } from "../../gguf/GgufReader.js"
import { kvShareSources } from "../../../services/KvShare.js"
import type { OutputWeights } from "../Arch.js"
import type { HParams, KvShare, PerLayerEmbd } from "../HParams.js"
import { invalidMetadata, scalarKey } from "../MetadataErrors.js"
import { perLayerSlice } from "../PerLayerInputs.js"
import { type AttentionSegment, GGML_PREC_F32, type BlockWeights, type TensorSpec, type Toolkit } from "../Toolkit.js"

/**
 * `embedding_length_per_layer_input` (required by llama.cpp) and `attention.shared_kv_layers` (default 0), checked:
 * at least 2 blocks keep their cache (llama.cpp asserts it), and each reusing block's source is of its own kind.
 */
export const gemma4PerLayerParams = (
  file: GgufFile,
  hp: HParams,
  slides: ReadonlyArray<boolean>
): Effect.Effect<{ perLayer?: PerLayerEmbd; kvShare?: KvShare }, ModelLoadError> =>
  Effect.gen(function* () {
    const k = (s: string) => `${hp.arch}.${s}`
    const width = yield* scalarKey(file, k("embedding_length_per_layer_input"), getU32)
    if (width === undefined) {
      return yield* Effect.fail(
        invalidMetadata(file, k("embedding_length_per_layer_input"), "is missing (llama.cpp requires it for gemma4)")
      )
    }
    const shared = (yield* scalarKey(file, k("attention.shared_kv_layers"), getU32)) ?? 0
    const out: { perLayer?: PerLayerEmbd; kvShare?: KvShare } = width > 0 ? { perLayer: { width } } : {}
    if (shared === 0) return out
    const from = hp.nLayer - shared
    if (from < 2) {
      return yield* Effect.fail(
        invalidMetadata(
          file,
          k("attention.shared_kv_layers"),
          `= ${shared} leaves ${Math.max(from, 0)} of ${hp.nLayer} blocks with a KV cache (llama.cpp needs at least 2)`
        )
      )
    }
    const sources = kvShareSources(hp.nLayer, shared, slides)
    for (let il = from; il < hp.nLayer; il++) {
      const source = sources[il]!
      if (slides[source] !== slides[il]) {
        const kind = (s: boolean | undefined) => (s ? "sliding-window" : "global")
        return yield* Effect.fail(
          invalidMetadata(
            file,
            k("attention.shared_kv_layers"),
            `= ${shared}: block ${il} (${kind(slides[il])}) would read the cache of block ${source} (${kind(slides[source])})`
          )
        )
      }
    }
    return { ...out, kvShare: { from, sources } }
  })

/** Does block `il` read an earlier block's cache? */
export const reusesKv = (hp: HParams, il: number): boolean => hp.kvShare !== undefined && hp.kvShare.sources[il] !== il

/** The first stage's per-layer tables (full names). */
export const perLayerInputTensors = (hp: HParams): ReadonlyArray<TensorSpec> => {
  if (hp.perLayer === undefined) return []
  const all = hp.perLayer.width * hp.nLayer
  return [
    { name: "per_layer_token_embd.weight", dims: [all, hp.nVocab], kind: "matrix", required: true },
    { name: "per_layer_model_proj.weight", dims: [hp.nEmbd, all], kind: "matrix", required: true },
    { name: "per_layer_proj_norm.weight", dims: [hp.perLayer.width], kind: "vector", required: true }
  ]
}

/** A block's per-layer tensors (short names). */
export const perLayerBlockSpecs = (hp: HParams): ReadonlyArray<TensorSpec> =>
  hp.perLayer === undefined
    ? []
    : [
        { name: "inp_gate.weight", dims: [hp.nEmbd, hp.perLayer.width], kind: "matrix", required: true },
        { name: "proj.weight", dims: [hp.perLayer.width, hp.nEmbd], kind: "matrix", required: true },
        { name: "post_norm.weight", dims: [hp.nEmbd], kind: "vector", required: true }
      ]

/** A block that reads another's cache loads no K/V projection or K norm (llama.cpp: not required without has_kv). */
export const withoutOwnKv = (specs: ReadonlyArray<TensorSpec>): ReadonlyArray<TensorSpec> =>
  specs.filter((s) => !/^attn_(k|v)\.|^attn_k_norm\./.test(s.name))

const f = Math.fround

/** The per-layer inputs of every block, F32 [width x nLayer, n] (block il's at row offset il x width). */
export const gemma4PerLayerInputs = (t: Toolkit, w: OutputWeights, tokens: Ptr, x: Ptr): Ptr => {
  const g = t.g
  const ctx = t.ctx
  const { nEmbd, nLayer } = t.hp
  const width = t.hp.perLayer!.width
  const n = t.nTokens
  let selected = g.ggml_get_rows(ctx, w.get("per_layer_token_embd.weight"), tokens)
  selected = g.ggml_scale(ctx, g.ggml_reshape_3d(ctx, selected, width, nLayer, n), f(Math.sqrt(width)))
  let proj = t.linear(w.get("per_layer_model_proj.weight"), x)
  proj = g.ggml_scale(ctx, proj, f(1 / f(Math.sqrt(nEmbd))))
  proj = t.rmsNorm(g.ggml_reshape_3d(ctx, proj, width, nLayer, n), w.get("per_layer_proj_norm.weight"))
  const sum = g.ggml_scale(ctx, g.ggml_add(ctx, proj, selected), f(1 / f(Math.sqrt(2))))
  return g.ggml_reshape_2d(ctx, sum, width * nLayer, n)
}

/** After the block's feed-forward residual `out`: out + post_norm(proj(gelu(inp_gate out) x the block's input)). */
export const perLayerBlockOut = (t: Toolkit, w: BlockWeights, out: Ptr): Ptr => {
  const p = t.inputs.perLayer
  if (t.hp.perLayer === undefined) return out
  if (p === undefined) throw new Error(`block ${t.layer}: the graph has no per-layer inputs`)
  const g = t.g
  const ctx = t.ctx
  // the model's last block keeps only the output rows (Toolkit.outputRows), its input too
  const mine = t.outputRows(perLayerSlice(g, ctx, t.hp, p, t.layer, t.nTokens))
  const gated = g.ggml_gelu(ctx, t.linear(w.get("inp_gate.weight"), out))
  const cur = t.rmsNorm(t.linear(w.get("proj.weight"), g.ggml_mul(ctx, gated, mine)), w.get("post_norm.weight"))
  return g.ggml_add(ctx, out, cur)
}

/**
 * Attention of a block that reads block `source`'s cache (written earlier in this graph by that block): per sequence,
 * flash attention of q [headDim, nHead, n] over the source's cells with the source's mask (same kind of block), then
 * wo. No cache write.
 */
export const sharedKvAttention = (t: Toolkit, q: Ptr, wo: Ptr, source: number, kqScale: number): Ptr => {
  const g = t.g
  const ctx = t.ctx
  const shape = getGgml().tensorShape
  const [headDim, nHead] = shape(q).ne as [number, number]
  const ring = t.hp.swa?.layers[source] === true
  g.ggml_build_forward_expand(t.graph, q)
  const attend = (seg: AttentionSegment, qs: Ptr): Ptr => {
    const cache = seg.kv(source)
    const nHeadKv = shape(cache.k).ne[0]! / headDim
    const nKv = ring ? seg.swaNKv : seg.nKv
    const mask = ring ? seg.swaMask : seg.mask
    if (mask === null)
      throw new Error(`block ${t.layer} reads sliding-window block ${source}'s cache but the graph has no window mask`)
    const view = (c: Ptr) =>
      g.ggml_permute(
        ctx,
        g.ggml_view_3d(
          ctx,
          c,
          headDim,
          nHeadKv,
          nKv,
          g.ggml_row_size(GgmlType.F16, headDim),
          g.ggml_row_size(GgmlType.F16, headDim * nHeadKv),
          0
        ),
        0,
        2,
        1,
        3
      )
    const fa = g.ggml_flash_attn_ext(
      ctx,
      g.ggml_permute(ctx, qs, 0, 2, 1, 3),
      view(cache.k),
      view(cache.v),
      mask,
      kqScale,
      0,
      0
    )
    g.ggml_flash_attn_ext_set_prec(fa, GGML_PREC_F32)
    return g.ggml_reshape_2d(ctx, fa, headDim * nHead, seg.n)
  }
  const rows = t.perSequence(headDim * nHead, [{ x: q, ne0: headDim, ne1: nHead }], (seg, [qs]) => attend(seg, qs!))
  return t.linear(wo, rows)
}
