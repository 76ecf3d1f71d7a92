/**
 * The ggml ops of mixture-of-experts routing (llama.cpp's build_moe_ffn, src/llama-graph.cpp), bound through koffi
 * from the same ggml-base library as Bindings.ts (signatures as in the pinned ggml.h). Raw: every caller checks the
 * shapes first (src/layers/engine/Moe.ts), since a failed GGML_ASSERT aborts the process.
 */
import koffi from "koffi"
import { join } from "node:path"
import type { Ggml, Ptr } from "./Bindings.js"

export interface MoeOps {
  /** as: [K, N, E] stacked matrices, b: [K, rows, T], ids: I32 [rows, T] -> [N, rows, T] */
  readonly ggml_mul_mat_id: (ctx: Ptr, as: Ptr, b: Ptr, ids: Ptr) => Ptr
  /** I32 indices of the k largest values of each row, largest first */
  readonly ggml_argsort_top_k: (ctx: Ptr, a: Ptr, k: number) => Ptr
  readonly ggml_soft_max: (ctx: Ptr, a: Ptr) => Ptr
  readonly ggml_sigmoid: (ctx: Ptr, a: Ptr) => Ptr
  readonly ggml_sum_rows: (ctx: Ptr, a: Ptr) => Ptr
  readonly ggml_div: (ctx: Ptr, a: Ptr, b: Ptr) => Ptr
  readonly ggml_clamp: (ctx: Ptr, a: Ptr, min: number, max: number) => Ptr
  readonly ggml_reshape_4d: (ctx: Ptr, a: Ptr, ne0: number, ne1: number, ne2: number, ne3: number) => Ptr
  readonly ggml_set_rows: (ctx: Ptr, a: Ptr, b: Ptr, c: Ptr) => Ptr
  readonly ggml_fill: (ctx: Ptr, a: Ptr, c: number) => Ptr
  /** a repeated to [ne0, ne1, ne2, ne3] (each a multiple of a's) */
  readonly ggml_repeat_4d: (ctx: Ptr, a: Ptr, ne0: number, ne1: number, ne2: number, ne3: number) => Ptr
}

const bound = new WeakMap<object, MoeOps>()

/** The MoE ops of a loaded ggml handle (bound once per handle). */
export const moeOps = (g: Ggml): MoeOps => {
  const known = bound.get(g)
  if (known !== undefined) return known
  const lib = koffi.load(join(g.library.dir, g.library.baseLib))
  const f = (decl: string) => lib.func(decl) as never
  const ops: MoeOps = {
    ggml_mul_mat_id: f("void * ggml_mul_mat_id(void * ctx, void * as, void * b, void * ids)"),
    ggml_argsort_top_k: f("void * ggml_argsort_top_k(void * ctx, void * a, int k)"),
    ggml_soft_max: f("void * ggml_soft_max(void * ctx, void * a)"),
    ggml_sigmoid: f("void * ggml_sigmoid(void * ctx, void * a)"),
    ggml_sum_rows: f("void * ggml_sum_rows(void * ctx, void * a)"),
    ggml_div: f("void * ggml_div(void * ctx, void * a, void * b)"),
    ggml_clamp: f("void * ggml_clamp(void * ctx, void * a, float min, float max)"),
    ggml_reshape_4d: f(
      "void * ggml_reshape_4d(void * ctx, void * a, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3)"
    ),
    ggml_set_rows: f("void * ggml_set_rows(void * ctx, void * a, void * b, void * c)"),
    ggml_fill: f("void * ggml_fill(void * ctx, void * a, float c)"),
    ggml_repeat_4d: f("void * ggml_repeat_4d(void * ctx, void * a, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3)")
  }
  bound.set(g, ops)
  return ops
}
