/**
 * The ggml ops of qwen35's gated DeltaNet blocks (archs/qwen35.ts, after llama.cpp's qwen35.cpp and
 * delta-net-base.cpp) beyond Bindings.ts, bound through koffi from the same ggml-base library (signatures as in the
 * pinned ggml.h). Raw: the caller builds shapes that agree (ggml asserts them).
 */
import koffi from "koffi"
import { join } from "node:path"
import type { Ggml, Ptr } from "./Bindings.js"

export interface DeltaNetOps {
  /** sx [d_conv - 1 + n, channels, n_seqs] convolved with c [d_conv, channels]: [channels, n, n_seqs] */
  readonly ggml_ssm_conv: (ctx: Ptr, sx: Ptr, c: Ptr) => Ptr
  /** q, k [S, Hk, n, s], v [S, Hv, n, s], g/beta [1, Hv, n, s], state [S, S, Hv, s]: outputs then K state snapshots */
  readonly ggml_gated_delta_net: (ctx: Ptr, q: Ptr, k: Ptr, v: Ptr, g: Ptr, beta: Ptr, state: Ptr, K: number) => Ptr
  readonly ggml_l2_norm: (ctx: Ptr, a: Ptr, eps: number) => Ptr
  readonly ggml_softplus: (ctx: Ptr, a: Ptr) => Ptr
  readonly ggml_sigmoid: (ctx: Ptr, a: Ptr) => Ptr
  readonly ggml_silu: (ctx: Ptr, a: Ptr) => Ptr
  readonly ggml_transpose: (ctx: Ptr, a: Ptr) => Ptr
  readonly ggml_concat: (ctx: Ptr, a: Ptr, b: Ptr, dim: number) => Ptr
  readonly ggml_reshape_4d: (ctx: Ptr, a: Ptr, ne0: number, ne1: number, ne2: number, ne3: number) => Ptr
  readonly ggml_view_4d: (
    ctx: Ptr,
    a: Ptr,
    ne0: number,
    ne1: number,
    ne2: number,
    ne3: number,
    nb1: number,
    nb2: number,
    nb3: number,
    offset: number
  ) => Ptr
  readonly ggml_cont_2d: (ctx: Ptr, a: Ptr, ne0: number, ne1: number) => Ptr
}

const bound = new WeakMap<object, DeltaNetOps>()

/** The DeltaNet ops of a loaded ggml handle (bound once per handle). */
export const deltaNetOps = (g: Ggml): DeltaNetOps => {
  const known = bound.get(g)
  if (known !== undefined) return known
  const lib = koffi.load(join(g.library.dir, g.library.baseLib))
  const ops: DeltaNetOps = {
    ggml_ssm_conv: lib.func("void * ggml_ssm_conv(void * ctx, void * sx, void * c)") as never,
    ggml_gated_delta_net: lib.func(
      "void * ggml_gated_delta_net(void * ctx, void * q, void * k, void * v, void * g, void * beta, void * state, int64_t K)"
    ) as never,
    ggml_l2_norm: lib.func("void * ggml_l2_norm(void * ctx, void * a, float eps)") as never,
    ggml_softplus: lib.func("void * ggml_softplus(void * ctx, void * a)") as never,
    ggml_sigmoid: lib.func("void * ggml_sigmoid(void * ctx, void * a)") as never,
    ggml_silu: lib.func("void * ggml_silu(void * ctx, void * a)") as never,
    ggml_transpose: lib.func("void * ggml_transpose(void * ctx, void * a)") as never,
    ggml_concat: lib.func("void * ggml_concat(void * ctx, void * a, void * b, int dim)") as never,
    ggml_reshape_4d: lib.func(
      "void * ggml_reshape_4d(void * ctx, void * a, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3)"
    ) as never,
    ggml_view_4d: lib.func(
      "void * ggml_view_4d(void * ctx, void * a, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3, size_t nb1, size_t nb2, size_t nb3, size_t offset)"
    ) as never,
    ggml_cont_2d: lib.func("void * ggml_cont_2d(void * ctx, void * a, int64_t ne0, int64_t ne1)") as never
  }
  bound.set(g, ops)
  return ops
}
