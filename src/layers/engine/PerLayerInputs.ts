/**
 * Per-layer inputs between stages (gemma4 E2B/E4B, HParams.perLayer; the math in archs/gemma4PerLayer.ts).
 *
 * Design: the first stage computes every block's per-layer input from the token ids (the huge per_layer_token_embd
 * table, which only the first stage loads) and the scaled token embeddings, and they travel with the activations: a
 * row leaving a stage that ends at block e is the residual stream (nEmbd floats) followed by the per-layer inputs of
 * blocks e..nLayer-1 (width floats each), so each hop carries only what the stages after it read. A stage's input
 * width is `activationWidth(hp, layerStart)`, its output width `activationWidth(hp, layerEndExclusive)`; frames say
 * their width and the executor checks it (StageExecutor's hiddenDim is the stage's input width). Recomputing the inputs
 * on every stage would instead need the token ids on every hop and the table on every stage.
 *
 * Shared KV layers (HParams.kvShare): `kvShareCut` says why a block range separates a block from the block whose cache
 * it reads (the stage load refuses it; the catalog's layout keeps placement from proposing it).
 */
import type { Ptr } from "../ggml/Bindings.js"
import type { GgmlRaw } from "../ggml/Bindings.js"
import { checkpointsBefore, type HParams } from "./HParams.js"
import { kvShareRangeProblem, stageRangeProblem, tokenSourcesOf, topKSourcesOf } from "../../services/KvShare.js"

/**
 * Floats per token of the activation entering block `layer` (nLayer: the last stage's output rows): the residual
 * stream, `hcMult` streams of nEmbd for deepseek4's hyper-connections (HParams.dsv4), then Kimi K3's checkpoints banked
 * before `layer` (nEmbd each, HParams.kimi), then gemma4's per-layer inputs.
 */
export const activationWidth = (hp: HParams, layer: number): number =>
  hp.nEmbd * ((hp.dsv4?.hcMult ?? 1) + checkpointsBefore(hp, layer)) +
  (hp.perLayer === undefined ? 0 : hp.perLayer.width * (hp.nLayer - layer))

/** Why blocks [start, end) cannot be one stage (a block reads the cache of a block before `start`), or undefined. */
export const kvShareCut = (hp: HParams, start: number, end: number): string | undefined => {
  const problem = kvShareRangeProblem(hp.kvShare?.sources, start, end)
  if (problem !== undefined) {
    return `block range [${start}, ${end}): ${problem} (${hp.arch}.attention.shared_kv_layers)`
  }
  const hash = hp.dsv4?.hashLayers ?? 0
  if (hash > 1) {
    const tokens = stageRangeProblem({ tokenSources: tokenSourcesOf(hp.nLayer, hash) }, start, end)
    if (tokens !== undefined) return `block range [${start}, ${end}): ${tokens} (${hp.arch}.hash_layer_count)`
  }
  const topK =
    hp.dsa === undefined ? undefined : stageRangeProblem({ topKSources: topKSourcesOf(hp.dsa.full) }, start, end)
  return topK === undefined ? undefined : `block range [${start}, ${end}): ${topK} (${hp.arch}.attention.indexer.types)`
}

/** Per-layer input rows as GraphInputs.perLayer describes them. */
export interface PerLayerRows {
  readonly rows: Ptr
  readonly stride: number
  readonly offset: number
  readonly first: number
}

/** A non-first stage's input [width, n]: the residual stream (contiguous) and where its per-layer inputs are. */
export const splitStageInput = (
  g: GgmlRaw,
  ctx: Ptr,
  hp: HParams,
  input: Ptr,
  layerStart: number,
  n: number
): { readonly x: Ptr; readonly perLayer: PerLayerRows | undefined } => {
  const width = activationWidth(hp, layerStart)
  if (hp.perLayer === undefined) return { x: input, perLayer: undefined }
  const x = g.ggml_cont(ctx, g.ggml_view_2d(ctx, input, hp.nEmbd, n, width * 4, 0))
  return { x, perLayer: { rows: input, stride: width, offset: hp.nEmbd, first: layerStart } }
}

/** Block `il`'s per-layer input, F32 [width, n] contiguous. */
export const perLayerSlice = (g: GgmlRaw, ctx: Ptr, hp: HParams, p: PerLayerRows, il: number, n: number): Ptr => {
  const width = hp.perLayer!.width
  return g.ggml_cont(ctx, g.ggml_view_2d(ctx, p.rows, width, n, p.stride * 4, (p.offset + (il - p.first) * width) * 4))
}

/** A non-last stage's output rows: the residual stream `x` [nEmbd, n], then blocks end.. per-layer inputs. */
export const joinStageOutput = (
  g: GgmlRaw,
  ctx: Ptr,
  hp: HParams,
  x: Ptr,
  p: PerLayerRows | undefined,
  layerEnd: number,
  n: number
): Ptr => {
  const tail = activationWidth(hp, layerEnd) - hp.nEmbd
  if (tail === 0 || p === undefined) return x
  const width = hp.perLayer!.width
  const rest = g.ggml_cont(
    ctx,
    g.ggml_view_2d(ctx, p.rows, tail, n, p.stride * 4, (p.offset + (layerEnd - p.first) * width) * 4)
  )
  return g.ggml_concat(ctx, x, rest, 0)
}
