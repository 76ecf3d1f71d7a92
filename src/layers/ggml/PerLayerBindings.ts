/**
 * The ggml ops gemma4's per-layer embeddings need beyond Bindings.ts (llama.cpp's gemma4.cpp gates each block's
 * per-layer input through GELU; a stage joins the residual stream with the per-layer inputs later stages read), bound
 * through koffi from the same ggml-base library (signatures as in the pinned ggml.h). Raw: the callers
 * (archs/gemma4PerLayer.ts, engine/PerLayerInputs.ts) build shapes that agree.
 */
import koffi from "koffi"
import { join } from "node:path"
import type { Ggml, Ptr } from "./Bindings.js"

export interface PerLayerOps {
  /** GELU (tanh approximation, ggml's table on CPU), elementwise */
  readonly ggml_gelu: (ctx: Ptr, a: Ptr) => Ptr
  /** a and b joined along `dim` (all other dims equal) */
  readonly ggml_concat: (ctx: Ptr, a: Ptr, b: Ptr, dim: number) => Ptr
}

const bound = new WeakMap<object, PerLayerOps>()

/** The per-layer embedding ops of a loaded ggml handle (bound once per handle). */
export const perLayerOps = (g: Ggml): PerLayerOps => {
  const known = bound.get(g)
  if (known !== undefined) return known
  const lib = koffi.load(join(g.library.dir, g.library.baseLib))
  const ops: PerLayerOps = {
    ggml_gelu: lib.func("void * ggml_gelu(void * ctx, void * a)") as never,
    ggml_concat: lib.func("void * ggml_concat(void * ctx, void * a, void * b, int dim)") as never
  }
  bound.set(g, ops)
  return ops
}
