/**
 * The ggml ops gpt-oss needs beyond Bindings.ts / MoeBindings.ts (llama.cpp src/models/openai-moe.cpp), bound through
 * koffi from the same ggml-base library (signatures as in the pinned ggml.h). Raw: callers check shapes and types
 * first (src/layers/engine/archs/gptOss.ts, Toolkit.attention), since a failed GGML_ASSERT aborts the process.
 */
import koffi from "koffi"
import { join } from "node:path"
import type { Ggml, Ptr } from "./Bindings.js"

export interface GptOssOps {
  /** gpt-oss's clamped SwiGLU: a = gate, b = up (same shape) */
  readonly ggml_swiglu_oai: (ctx: Ptr, a: Ptr, b: Ptr, alpha: number, limit: number) => Ptr
  /** dst[i0, i1, i2] = a[i0, i1, i2] + b[i0, ids[i1, i2]]: per-expert biases of mul_mat_id's output */
  readonly ggml_add_id: (ctx: Ptr, a: Ptr, b: Ptr, ids: Ptr) => Ptr
  /** Attention sinks (F32 [n_head]) of a ggml_flash_attn_ext node */
  readonly ggml_flash_attn_ext_add_sinks: (a: Ptr, sinks: Ptr) => void
}

const bound = new WeakMap<object, GptOssOps>()

/** The gpt-oss ops of a loaded ggml handle (bound once per handle). */
export const gptOssOps = (g: Ggml): GptOssOps => {
  const known = bound.get(g)
  if (known !== undefined) return known
  const lib = koffi.load(join(g.library.dir, g.library.baseLib))
  const f = (decl: string) => lib.func(decl) as never
  const ops: GptOssOps = {
    ggml_swiglu_oai: f("void * ggml_swiglu_oai(void * ctx, void * a, void * b, float alpha, float limit)"),
    ggml_add_id: f("void * ggml_add_id(void * ctx, void * a, void * b, void * ids)"),
    ggml_flash_attn_ext_add_sinks: f("void ggml_flash_attn_ext_add_sinks(void * a, void * sinks)")
  }
  bound.set(g, ops)
  return ops
}
