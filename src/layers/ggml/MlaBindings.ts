/**
 * The ggml op deepseek2's latent attention needs beyond Bindings.ts (llama.cpp's deepseek2.cpp joins the absorbed Q
 * with its RoPE part, and the latent with the shared RoPE key), bound through koffi from the same ggml-base library
 * (signature as in the pinned ggml.h). Raw: the caller (archs/deepseek2.ts) builds shapes that agree.
 */
import koffi from "koffi"
import { join } from "node:path"
import type { Ggml, Ptr } from "./Bindings.js"

export interface MlaOps {
  /** a and b joined along `dim` (all other dims equal) */
  readonly ggml_concat: (ctx: Ptr, a: Ptr, b: Ptr, dim: number) => Ptr
}

const bound = new WeakMap<object, MlaOps>()

/** The latent-attention ops of a loaded ggml handle (bound once per handle). */
export const mlaOps = (g: Ggml): MlaOps => {
  const known = bound.get(g)
  if (known !== undefined) return known
  const lib = koffi.load(join(g.library.dir, g.library.baseLib))
  const ops: MlaOps = {
    ggml_concat: lib.func("void * ggml_concat(void * ctx, void * a, void * b, int dim)") as never
  }
  bound.set(g, ops)
  return ops
}
