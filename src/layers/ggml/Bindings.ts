/**
 * ggml through koffi, over the shared libraries that the pinned node-llama-cpp ships.
 *
 * The handle is created lazily on first use (`getGgml()`), checks the library version and the
 * `ggml_tensor` layout the bindings were written for, and refuses with a clear message otherwise.
 * ggml asserts abort the process: callers validate shapes and types in TypeScript first. Every ggml function swactor
 * calls is bound here, once, in one table (`bindTable`, reached as `getGgml().raw`): an architecture's new op is a line
 * in its group there, not a binding file of its own.
 */
import koffi, { type LibraryHandle } from "koffi"
import { join } from "node:path"
import { type GgmlLibraryDir, locateGgmlLibraries } from "./Platform.js"
import { GgmlType, ggmlTypeInfo } from "../../domain/ggmlTypes.js"
import { liveSettings, type SettingsValues } from "../config/Settings.js"

/** The node-llama-cpp build these bindings were written against (node-llama-cpp 3.21.1). */
export const expectedBuild = {
  ggmlVersion: "0.23.0",
  ggmlCommit: "5b4ebc5",
  release: "v0.4.0"
} as const

/** Byte layout of `struct ggml_tensor` on 64-bit targets (ggml.h of the pinned build). */
export const TensorLayout = {
  type: 0,
  buffer: 8,
  ne: 16,
  nb: 48,
  op: 80,
  opParams: 84,
  flags: 148,
  src: 152,
  viewSrc: 232,
  viewOffs: 240,
  data: 248,
  name: 256,
  extra: 320,
  size: 336,
  /** ggml_tensor_overhead() = sizeof(ggml_object) + sizeof(ggml_tensor) */
  overhead: 368
} as const

/** ggml type ids: the one table in src/domain/ggmlTypes.ts. */
export { GgmlType }

export const GgmlBackendDevType = { CPU: 0, GPU: 1, IGPU: 2, ACCEL: 3 } as const

/** ggml's device types by number (enum ggml_backend_dev_type), as a node reports them. */
const deviceKinds = ["cpu", "gpu", "igpu", "accel", "meta"] as const

/** One device of the loaded ggml package: its name, kind and memory (ggml_backend_dev_memory) now. */
export interface GgmlDevice {
  readonly name: string
  readonly description: string
  readonly kind: (typeof deviceKinds)[number] | "unknown"
  readonly freeBytes: number
  readonly totalBytes: number
}

/**
 * The device a GPU stage computes on, by index into `kinds`: the first discrete GPU, else the first integrated one
 * (an Intel or AMD laptop GPU through Vulkan, a DGX Spark or Jetson through CUDA); -1 when there is neither.
 */
export const gpuDeviceIndex = (kinds: ReadonlyArray<GgmlDevice["kind"]>): number => {
  const gpu = kinds.indexOf("gpu")
  return gpu >= 0 ? gpu : kinds.indexOf("igpu")
}

/** Thrown by `getGgml` when the libraries cannot be found, loaded, or do not match. */
export class GgmlBindingError extends Error {
  override readonly name = "GgmlBindingError"
}

/** A koffi function with its `.async` form. */
interface AsyncFn {
  (...args: Array<unknown>): unknown
  async: (...args: Array<unknown>) => void
}

/** An opaque native pointer as koffi hands it out. */
export type Ptr = unknown

const declareTypes = () => {
  const initParams = koffi.struct("swactor_ggml_init_params", {
    mem_size: "size_t",
    mem_buffer: "void *",
    no_alloc: "bool"
  })
  return { initParams }
}

/** A tensor-to-tensor op with one operand / two operands (the shape of most of ggml.h's ops). */
type Op1 = (ctx: Ptr, a: Ptr) => Ptr
type Op2 = (ctx: Ptr, a: Ptr, b: Ptr) => Ptr

/**
 * The one binding table: every ggml function swactor calls, with its C declaration as in the pinned ggml.h,
 * ggml-alloc.h and ggml-backend.h, grouped as those headers group them. A new op (for a new architecture too) goes
 * into its group here. `b` binds from ggml-base (ggml.h, ggml-alloc.h, buffers), `m` from the ggml library (the
 * backend registry and devices). koffi trusts each declaration: a wrong one corrupts memory, so each is copied from
 * the header.
 */
// long: one table of C declarations; cut up, the groups would be the same lines in more places to check against ggml.h
const bindTable = (base: LibraryHandle, main: LibraryHandle, types: ReturnType<typeof declareTypes>) => {
  const b = (decl: string) => base.func(decl)
  const m = (decl: string) => main.func(decl)
  return {
    // library, logging and type traits
    ggml_version: b("const char * ggml_version()"),
    ggml_commit: b("const char * ggml_commit()"),
    ggml_log_set: b("void ggml_log_set(void * callback, void * user_data)") as (
      callback: unknown,
      userData: null
    ) => void,
    ggml_type_size: b("size_t ggml_type_size(int type)") as (type: number) => number,
    ggml_blck_size: b("int64_t ggml_blck_size(int type)") as (type: number) => number,
    ggml_row_size: b("size_t ggml_row_size(int type, int64_t ne)") as (type: number, ne: number) => number,
    ggml_type_name: b("const char * ggml_type_name(int type)") as (type: number) => string | null,
    ggml_tensor_overhead: b("size_t ggml_tensor_overhead()") as () => number,

    // tensor predicates (OpChecks asks ggml itself before building an op)
    ggml_is_transposed: b("bool ggml_is_transposed(void * t)") as (t: Ptr) => boolean,
    ggml_is_contiguous: b("bool ggml_is_contiguous(void * t)") as (t: Ptr) => boolean,
    ggml_is_contiguous_1: b("bool ggml_is_contiguous_1(void * t)") as (t: Ptr) => boolean,
    ggml_is_contiguous_rows: b("bool ggml_is_contiguous_rows(void * t)") as (t: Ptr) => boolean,
    ggml_is_vector: b("bool ggml_is_vector(void * t)") as (t: Ptr) => boolean,
    ggml_are_same_shape: b("bool ggml_are_same_shape(void * t0, void * t1)") as (t0: Ptr, t1: Ptr) => boolean,
    ggml_can_repeat: b("bool ggml_can_repeat(void * t0, void * t1)") as (t0: Ptr, t1: Ptr) => boolean,

    // context and tensor creation
    ggml_init: base.func("ggml_init", "void *", [types.initParams]) as (params: {
      mem_size: number
      mem_buffer: Ptr | null
      no_alloc: boolean
    }) => Ptr,
    ggml_free: b("void ggml_free(void * ctx)") as (ctx: Ptr) => void,
    ggml_new_tensor_1d: b("void * ggml_new_tensor_1d(void * ctx, int type, int64_t ne0)") as (
      ctx: Ptr,
      type: number,
      ne0: number
    ) => Ptr,
    ggml_new_tensor_2d: b("void * ggml_new_tensor_2d(void * ctx, int type, int64_t ne0, int64_t ne1)") as (
      ctx: Ptr,
      type: number,
      ne0: number,
      ne1: number
    ) => Ptr,
    ggml_new_tensor_3d: b("void * ggml_new_tensor_3d(void * ctx, int type, int64_t ne0, int64_t ne1, int64_t ne2)") as (
      ctx: Ptr,
      type: number,
      ne0: number,
      ne1: number,
      ne2: number
    ) => Ptr,
    ggml_new_tensor_4d: b(
      "void * ggml_new_tensor_4d(void * ctx, int type, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3)"
    ) as (ctx: Ptr, type: number, ne0: number, ne1: number, ne2: number, ne3: number) => Ptr,
    ggml_get_first_tensor: b("void * ggml_get_first_tensor(void * ctx)") as (ctx: Ptr) => Ptr | null,
    ggml_get_next_tensor: b("void * ggml_get_next_tensor(void * ctx, void * t)") as (ctx: Ptr, t: Ptr) => Ptr | null,
    ggml_set_name: b("void * ggml_set_name(void * tensor, const char * name)") as (t: Ptr, name: string) => Ptr,
    ggml_set_input: b("void ggml_set_input(void * tensor)") as (t: Ptr) => void,
    ggml_set_output: b("void ggml_set_output(void * tensor)") as (t: Ptr) => void,
    ggml_nbytes: b("size_t ggml_nbytes(void * tensor)") as (t: Ptr) => number,
    ggml_op_desc: b("const char * ggml_op_desc(void * t)") as (t: Ptr) => string,

    // binary and arithmetic ops (the second operand broadcasts to the first)
    ggml_add: b("void * ggml_add(void * ctx, void * a, void * b)") as Op2,
    /** dst[i0, i1, i2] = a[i0, i1, i2] + b[i0, ids[i1, i2]]: per-expert biases of mul_mat_id's output */
    ggml_add_id: b("void * ggml_add_id(void * ctx, void * a, void * b, void * ids)") as (
      ctx: Ptr,
      a: Ptr,
      b: Ptr,
      ids: Ptr
    ) => Ptr,
    ggml_mul: b("void * ggml_mul(void * ctx, void * a, void * b)") as Op2,
    ggml_div: b("void * ggml_div(void * ctx, void * a, void * b)") as Op2,
    ggml_scale: b("void * ggml_scale(void * ctx, void * a, float s)") as (ctx: Ptr, a: Ptr, s: number) => Ptr,

    // reductions and sorting
    ggml_sum_rows: b("void * ggml_sum_rows(void * ctx, void * a)") as Op1,
    /** I32 indices of the k largest values of each row, largest first */
    ggml_argsort_top_k: b("void * ggml_argsort_top_k(void * ctx, void * a, int k)") as (
      ctx: Ptr,
      a: Ptr,
      k: number
    ) => Ptr,

    /** I32 indices of the k largest values of each row, in no order (ggml's own op; DSA's top-k positions) */
    ggml_top_k: b("void * ggml_top_k(void * ctx, void * a, int k)") as (ctx: Ptr, a: Ptr, k: number) => Ptr,

    // unary ops (elementwise)
    ggml_tanh: b("void * ggml_tanh(void * ctx, void * a)") as Op1,
    ggml_sigmoid: b("void * ggml_sigmoid(void * ctx, void * a)") as Op1,
    ggml_silu: b("void * ggml_silu(void * ctx, void * a)") as Op1,
    /** GELU (tanh approximation, ggml's table on CPU) */
    ggml_gelu: b("void * ggml_gelu(void * ctx, void * a)") as Op1,
    ggml_softplus: b("void * ggml_softplus(void * ctx, void * a)") as Op1,
    ggml_sqrt: b("void * ggml_sqrt(void * ctx, void * a)") as Op1,
    /** x * s + bias, elementwise */
    ggml_scale_bias: b("void * ggml_scale_bias(void * ctx, void * a, float s, float b)") as (
      ctx: Ptr,
      a: Ptr,
      s: number,
      bias: number
    ) => Ptr,
    /** DeepSeek-V4's clamped SwiGLU: min(silu(a), limit) x clamp(b, -limit, limit) */
    ggml_swiglu_clamp: b("void * ggml_swiglu_clamp(void * ctx, void * a, void * b, float limit)") as (
      ctx: Ptr,
      a: Ptr,
      b: Ptr,
      limit: number
    ) => Ptr,
    ggml_clamp: b("void * ggml_clamp(void * ctx, void * a, float min, float max)") as (
      ctx: Ptr,
      a: Ptr,
      min: number,
      max: number
    ) => Ptr,
    ggml_fill: b("void * ggml_fill(void * ctx, void * a, float c)") as (ctx: Ptr, a: Ptr, c: number) => Ptr,

    // gated linear units: a = gate, b = up (same shape)
    ggml_swiglu_split: b("void * ggml_swiglu_split(void * ctx, void * a, void * b)") as Op2,
    ggml_geglu_split: b("void * ggml_geglu_split(void * ctx, void * a, void * b)") as Op2,
    /** gpt-oss's clamped SwiGLU */
    ggml_swiglu_oai: b("void * ggml_swiglu_oai(void * ctx, void * a, void * b, float alpha, float limit)") as (
      ctx: Ptr,
      a: Ptr,
      b: Ptr,
      alpha: number,
      limit: number
    ) => Ptr,

    // normalization
    ggml_rms_norm: b("void * ggml_rms_norm(void * ctx, void * a, float eps)") as (ctx: Ptr, a: Ptr, eps: number) => Ptr,
    /** LayerNorm without weights: (a - mean) / sqrt(var + eps) per row */
    ggml_norm: b("void * ggml_norm(void * ctx, void * a, float eps)") as (ctx: Ptr, a: Ptr, eps: number) => Ptr,
    ggml_l2_norm: b("void * ggml_l2_norm(void * ctx, void * a, float eps)") as (ctx: Ptr, a: Ptr, eps: number) => Ptr,

    // matrix products
    ggml_mul_mat: b("void * ggml_mul_mat(void * ctx, void * a, void * b)") as Op2,
    /** as: [K, N, E] stacked matrices, b: [K, rows, T], ids: I32 [rows, T] -> [N, rows, T] */
    ggml_mul_mat_id: b("void * ggml_mul_mat_id(void * ctx, void * as, void * b, void * ids)") as (
      ctx: Ptr,
      as: Ptr,
      b: Ptr,
      ids: Ptr
    ) => Ptr,

    // copies, views, reshapes and rows
    ggml_cpy: b("void * ggml_cpy(void * ctx, void * a, void * b)") as Op2,
    ggml_cast: b("void * ggml_cast(void * ctx, void * a, int type)") as (ctx: Ptr, a: Ptr, type: number) => Ptr,
    ggml_cont: b("void * ggml_cont(void * ctx, void * a)") as Op1,
    ggml_cont_2d: b("void * ggml_cont_2d(void * ctx, void * a, int64_t ne0, int64_t ne1)") as (
      ctx: Ptr,
      a: Ptr,
      ne0: number,
      ne1: number
    ) => Ptr,
    ggml_reshape_2d: b("void * ggml_reshape_2d(void * ctx, void * a, int64_t ne0, int64_t ne1)") as (
      ctx: Ptr,
      a: Ptr,
      ne0: number,
      ne1: number
    ) => Ptr,
    ggml_reshape_3d: b("void * ggml_reshape_3d(void * ctx, void * a, int64_t ne0, int64_t ne1, int64_t ne2)") as (
      ctx: Ptr,
      a: Ptr,
      ne0: number,
      ne1: number,
      ne2: number
    ) => Ptr,
    ggml_reshape_4d: b(
      "void * ggml_reshape_4d(void * ctx, void * a, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3)"
    ) as (ctx: Ptr, a: Ptr, ne0: number, ne1: number, ne2: number, ne3: number) => Ptr,
    ggml_view_1d: b("void * ggml_view_1d(void * ctx, void * a, int64_t ne0, size_t offset)") as (
      ctx: Ptr,
      a: Ptr,
      ne0: number,
      offset: number
    ) => Ptr,
    ggml_view_2d: b(
      "void * ggml_view_2d(void * ctx, void * a, int64_t ne0, int64_t ne1, size_t nb1, size_t offset)"
    ) as (ctx: Ptr, a: Ptr, ne0: number, ne1: number, nb1: number, offset: number) => Ptr,
    ggml_view_3d: b(
      "void * ggml_view_3d(void * ctx, void * a, int64_t ne0, int64_t ne1, int64_t ne2, size_t nb1, size_t nb2, size_t offset)"
    ) as (ctx: Ptr, a: Ptr, ne0: number, ne1: number, ne2: number, nb1: number, nb2: number, offset: number) => Ptr,
    ggml_view_4d: b(
      "void * ggml_view_4d(void * ctx, void * a, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3, size_t nb1, size_t nb2, size_t nb3, size_t offset)"
    ) as (
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
    ) => Ptr,
    ggml_permute: b("void * ggml_permute(void * ctx, void * a, int a0, int a1, int a2, int a3)") as (
      ctx: Ptr,
      a: Ptr,
      a0: number,
      a1: number,
      a2: number,
      a3: number
    ) => Ptr,
    ggml_transpose: b("void * ggml_transpose(void * ctx, void * a)") as Op1,
    /** a and b joined along `dim` (all other dims equal) */
    ggml_concat: b("void * ggml_concat(void * ctx, void * a, void * b, int dim)") as (
      ctx: Ptr,
      a: Ptr,
      b: Ptr,
      dim: number
    ) => Ptr,
    /** a repeated to [ne0, ne1, ne2, ne3] (each a multiple of a's) */
    ggml_repeat_4d: b(
      "void * ggml_repeat_4d(void * ctx, void * a, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3)"
    ) as (ctx: Ptr, a: Ptr, ne0: number, ne1: number, ne2: number, ne3: number) => Ptr,
    ggml_get_rows: b("void * ggml_get_rows(void * ctx, void * a, void * b)") as Op2,
    ggml_set_rows: b("void * ggml_set_rows(void * ctx, void * a, void * b, void * c)") as (
      ctx: Ptr,
      dst: Ptr,
      src: Ptr,
      rows: Ptr
    ) => Ptr,

    // softmax, RoPE and attention
    ggml_soft_max: b("void * ggml_soft_max(void * ctx, void * a)") as Op1,
    ggml_soft_max_ext: b(
      "void * ggml_soft_max_ext(void * ctx, void * a, void * mask, float scale, float max_bias)"
    ) as (ctx: Ptr, a: Ptr, mask: Ptr | null, scale: number, maxBias: number) => Ptr,
    ggml_rope_ext: b(
      "void * ggml_rope_ext(void * ctx, void * a, void * b, void * c, int n_dims, int mode, int n_ctx_orig, " +
        "float freq_base, float freq_scale, float ext_factor, float attn_factor, float beta_fast, float beta_slow)"
    ) as (
      ctx: Ptr,
      a: Ptr,
      pos: Ptr,
      freqFactors: Ptr | null,
      nDims: number,
      mode: number,
      nCtxOrig: number,
      freqBase: number,
      freqScale: number,
      extFactor: number,
      attnFactor: number,
      betaFast: number,
      betaSlow: number
    ) => Ptr,
    ggml_flash_attn_ext: b(
      "void * ggml_flash_attn_ext(void * ctx, void * q, void * k, void * v, void * mask, float scale, " +
        "float max_bias, float logit_softcap)"
    ) as (ctx: Ptr, q: Ptr, k: Ptr, v: Ptr, mask: Ptr | null, scale: number, maxBias: number, softcap: number) => Ptr,
    ggml_flash_attn_ext_set_prec: b("void ggml_flash_attn_ext_set_prec(void * a, int prec)") as (
      a: Ptr,
      prec: number
    ) => void,
    /** The most cells a ggml_flash_attn_ext node's mask leaves open (DSA's top-k; a hint some backends use) */
    ggml_flash_attn_ext_set_n_kv_max: b("void ggml_flash_attn_ext_set_n_kv_max(void * a, int32_t n_kv_max)") as (
      a: Ptr,
      nKvMax: number
    ) => void,
    /**
     * DSA's lightning indexer: q F32 [d, heads, n], k [d, 1, nKv], weights F32 [heads, n], mask F16 [nKv, n] ->
     * F32 [nKv, n], sum over heads of relu(q.k) x weight, plus the mask
     */
    ggml_lightning_indexer: b(
      "void * ggml_lightning_indexer(void * ctx, void * q, void * k, void * weights, void * mask)"
    ) as (ctx: Ptr, q: Ptr, k: Ptr, weights: Ptr, mask: Ptr) => Ptr,
    /** A ggml_rope_ext / ggml_rope_ext_back node rotates the n_dims values from `n_offs` on (DeepSeek-V4's tail RoPE) */
    ggml_rope_set_offset: b("void * ggml_rope_set_offset(void * a, int n_offs)") as (a: Ptr, nOffs: number) => Ptr,
    /** The inverse rotation of ggml_rope_ext (DeepSeek-V4 rotates its attention output back) */
    ggml_rope_ext_back: b(
      "void * ggml_rope_ext_back(void * ctx, void * a, void * b, void * c, int n_dims, int mode, int n_ctx_orig, " +
        "float freq_base, float freq_scale, float ext_factor, float attn_factor, float beta_fast, float beta_slow)"
    ) as (
      ctx: Ptr,
      a: Ptr,
      pos: Ptr,
      freqFactors: Ptr | null,
      nDims: number,
      mode: number,
      nCtxOrig: number,
      freqBase: number,
      freqScale: number,
      extFactor: number,
      attnFactor: number,
      betaFast: number,
      betaSlow: number
    ) => Ptr,
    /**
     * DeepSeek-V4's hyper-connections: hc_pre x [n_embd, hc, n], weights [hc, n] -> [n_embd, n] (the streams'
     * weighted sum); hc_comb mixes [mix, n], scale [3], base [mix] -> the Sinkhorn-normalised [hc, hc, n]; hc_post x
     * [n_embd, n], residual [n_embd, hc, n], post [hc, n], comb [hc, hc, n] -> [n_embd, hc, n]
     */
    ggml_dsv4_hc_pre: b("void * ggml_dsv4_hc_pre(void * ctx, void * x, void * weights)") as Op2,
    ggml_dsv4_hc_comb: b(
      "void * ggml_dsv4_hc_comb(void * ctx, void * mixes, void * scale, void * base, float eps, int32_t n_iter)"
    ) as (ctx: Ptr, mixes: Ptr, scale: Ptr, base: Ptr, eps: number, nIter: number) => Ptr,
    ggml_dsv4_hc_post: b(
      "void * ggml_dsv4_hc_post(void * ctx, void * x, void * residual, void * post, void * comb)"
    ) as (ctx: Ptr, x: Ptr, residual: Ptr, post: Ptr, comb: Ptr) => Ptr,
    /** Attention sinks (F32 [n_head]) of a ggml_flash_attn_ext node */
    ggml_flash_attn_ext_add_sinks: b("void ggml_flash_attn_ext_add_sinks(void * a, void * sinks)") as (
      a: Ptr,
      sinks: Ptr
    ) => void,

    // state-space and recurrent ops (qwen35's gated DeltaNet)
    /** sx [d_conv - 1 + n, channels, n_seqs] convolved with c [d_conv, channels]: [channels, n, n_seqs] */
    ggml_ssm_conv: b("void * ggml_ssm_conv(void * ctx, void * sx, void * c)") as (ctx: Ptr, sx: Ptr, c: Ptr) => Ptr,
    /** q, k [S, Hk, n, s], v [S, Hv, n, s], g/beta [1, Hv, n, s], state [S, S, Hv, s]: outputs then K state snapshots */
    ggml_gated_delta_net: b(
      "void * ggml_gated_delta_net(void * ctx, void * q, void * k, void * v, void * g, void * beta, void * state, int64_t K)"
    ) as (ctx: Ptr, q: Ptr, k: Ptr, v: Ptr, g: Ptr, beta: Ptr, state: Ptr, K: number) => Ptr,

    // graphs
    ggml_graph_overhead_custom: b("size_t ggml_graph_overhead_custom(size_t size, bool grads)") as (
      size: number,
      grads: boolean
    ) => number,
    ggml_new_graph_custom: b("void * ggml_new_graph_custom(void * ctx, size_t size, bool grads)") as (
      ctx: Ptr,
      size: number,
      grads: boolean
    ) => Ptr,
    ggml_build_forward_expand: b("void ggml_build_forward_expand(void * graph, void * tensor)") as (
      graph: Ptr,
      t: Ptr
    ) => void,
    ggml_graph_n_nodes: b("int ggml_graph_n_nodes(void * graph)") as (graph: Ptr) => number,
    ggml_graph_node: b("void * ggml_graph_node(void * graph, int i)") as (graph: Ptr, i: number) => Ptr,

    // quantization
    ggml_quantize_init: b("void ggml_quantize_init(int type)") as (type: number) => void,
    ggml_quantize_requires_imatrix: b("bool ggml_quantize_requires_imatrix(int type)") as (type: number) => boolean,
    ggml_quantize_chunk: b(
      "size_t ggml_quantize_chunk(int type, const float * src, void * dst, int64_t start, int64_t nrows, " +
        "int64_t n_per_row, const float * imatrix)"
    ) as (
      type: number,
      src: Float32Array,
      dst: Uint8Array,
      start: number,
      nrows: number,
      nPerRow: number,
      imatrix: Float32Array | null
    ) => number,

    // backend API, graph allocator (ggml-alloc.h)
    ggml_gallocr_new: b("void * ggml_gallocr_new(void * buft)") as (buft: Ptr) => Ptr,
    ggml_gallocr_free: b("void ggml_gallocr_free(void * galloc)") as (galloc: Ptr) => void,
    ggml_gallocr_reserve: b("bool ggml_gallocr_reserve(void * galloc, void * graph)") as (
      galloc: Ptr,
      graph: Ptr
    ) => boolean,
    ggml_gallocr_alloc_graph: b("bool ggml_gallocr_alloc_graph(void * galloc, void * graph)") as (
      galloc: Ptr,
      graph: Ptr
    ) => boolean,
    ggml_gallocr_get_buffer_size: b("size_t ggml_gallocr_get_buffer_size(void * galloc, int id)") as (
      galloc: Ptr,
      id: number
    ) => number,
    ggml_backend_alloc_ctx_tensors_from_buft: b(
      "void * ggml_backend_alloc_ctx_tensors_from_buft(void * ctx, void * buft)"
    ) as (ctx: Ptr, buft: Ptr) => Ptr | null,

    // backend API, buffer types and buffers (ggml-backend.h, in ggml-base)
    ggml_backend_buft_name: b("const char * ggml_backend_buft_name(void * buft)") as (buft: Ptr) => string,
    ggml_backend_buft_alloc_buffer: b("void * ggml_backend_buft_alloc_buffer(void * buft, size_t size)") as (
      buft: Ptr,
      size: number
    ) => Ptr | null,
    ggml_backend_buft_get_alignment: b("size_t ggml_backend_buft_get_alignment(void * buft)") as (buft: Ptr) => number,
    ggml_backend_buft_get_alloc_size: b("size_t ggml_backend_buft_get_alloc_size(void * buft, void * tensor)") as (
      buft: Ptr,
      t: Ptr
    ) => number,
    ggml_backend_buft_is_host: b("bool ggml_backend_buft_is_host(void * buft)") as (buft: Ptr) => boolean,
    ggml_backend_buffer_free: b("void ggml_backend_buffer_free(void * buffer)") as (buffer: Ptr) => void,
    ggml_backend_buffer_get_base: b("void * ggml_backend_buffer_get_base(void * buffer)") as (buffer: Ptr) => Ptr,
    ggml_backend_buffer_get_size: b("size_t ggml_backend_buffer_get_size(void * buffer)") as (buffer: Ptr) => number,
    ggml_backend_buffer_get_alignment: b("size_t ggml_backend_buffer_get_alignment(void * buffer)") as (
      buffer: Ptr
    ) => number,
    ggml_backend_buffer_clear: b("void ggml_backend_buffer_clear(void * buffer, uint8_t value)") as (
      buffer: Ptr,
      value: number
    ) => void,
    ggml_backend_buffer_set_usage: b("void ggml_backend_buffer_set_usage(void * buffer, int usage)") as (
      buffer: Ptr,
      usage: number
    ) => void,
    ggml_backend_buffer_get_type: b("void * ggml_backend_buffer_get_type(void * buffer)") as (buffer: Ptr) => Ptr,
    ggml_backend_buffer_is_host: b("bool ggml_backend_buffer_is_host(void * buffer)") as (buffer: Ptr) => boolean,
    // weights mapped from the file (Native.ts): a CPU buffer over foreign memory, tensors placed at addresses in it
    ggml_backend_cpu_buffer_from_ptr: b("void * ggml_backend_cpu_buffer_from_ptr(void * ptr, size_t size)") as (
      ptr: unknown,
      size: number
    ) => Ptr | null,
    ggml_backend_tensor_alloc: base.func("ggml_backend_tensor_alloc", "int", ["void *", "void *", "uintptr_t"]) as (
      buffer: Ptr,
      t: Ptr,
      addr: bigint
    ) => number,

    // backend API, tensor data
    ggml_backend_tensor_set: b(
      "void ggml_backend_tensor_set(void * tensor, const void * data, size_t offset, size_t size)"
    ) as (t: Ptr, data: ArrayBufferView, offset: number, size: number) => void,
    /** ggml_backend_tensor_set from an address (e.g. inside a file mapping) instead of a JS buffer. */
    ggml_backend_tensor_set_from: base.func("ggml_backend_tensor_set", "void", [
      "void *",
      "uintptr_t",
      "size_t",
      "size_t"
    ]) as (t: Ptr, data: bigint, offset: number, size: number) => void,
    ggml_backend_tensor_get: b(
      "void ggml_backend_tensor_get(void * tensor, void * data, size_t offset, size_t size)"
    ) as (t: Ptr, data: ArrayBufferView, offset: number, size: number) => void,

    // backend API, registry, devices and backends (ggml-backend.h, in the ggml library)
    ggml_backend_load_all_from_path: m("void ggml_backend_load_all_from_path(const char * dir)") as (
      dir: string
    ) => void,
    ggml_backend_reg_by_name: m("void * ggml_backend_reg_by_name(const char * name)") as (name: string) => Ptr | null,
    ggml_backend_reg_get_proc_address: m("void * ggml_backend_reg_get_proc_address(void * reg, const char * name)") as (
      reg: Ptr,
      name: string
    ) => Ptr | null,
    ggml_backend_reg_dev_count: m("size_t ggml_backend_reg_dev_count(void * reg)") as (reg: Ptr) => number,
    ggml_backend_reg_dev_get: m("void * ggml_backend_reg_dev_get(void * reg, size_t index)") as (
      reg: Ptr,
      index: number
    ) => Ptr | null,
    ggml_backend_dev_by_type: m("void * ggml_backend_dev_by_type(int type)") as (type: number) => Ptr | null,
    ggml_backend_dev_count: m("size_t ggml_backend_dev_count()") as () => number,
    ggml_backend_dev_get: m("void * ggml_backend_dev_get(size_t index)") as (index: number) => Ptr,
    ggml_backend_dev_name: m("const char * ggml_backend_dev_name(void * dev)") as (dev: Ptr) => string,
    ggml_backend_dev_description: m("const char * ggml_backend_dev_description(void * dev)") as (dev: Ptr) => string,
    ggml_backend_dev_type: m("int ggml_backend_dev_type(void * dev)") as (dev: Ptr) => number,
    ggml_backend_dev_memory: m(
      "void ggml_backend_dev_memory(void * dev, _Out_ size_t * free, _Out_ size_t * total)"
    ) as (dev: Ptr, free: Array<number>, total: Array<number>) => void,
    ggml_backend_dev_buffer_type: m("void * ggml_backend_dev_buffer_type(void * dev)") as (dev: Ptr) => Ptr,
    ggml_backend_dev_init: m("void * ggml_backend_dev_init(void * dev, const char * params)") as (
      dev: Ptr,
      params: string | null
    ) => Ptr | null,
    ggml_backend_dev_supports_op: m("bool ggml_backend_dev_supports_op(void * dev, void * op)") as (
      dev: Ptr,
      op: Ptr
    ) => boolean,
    ggml_backend_dev_supports_buft: m("bool ggml_backend_dev_supports_buft(void * dev, void * buft)") as (
      dev: Ptr,
      buft: Ptr
    ) => boolean,
    ggml_backend_free: m("void ggml_backend_free(void * backend)") as (backend: Ptr) => void,
    ggml_backend_name: m("const char * ggml_backend_name(void * backend)") as (backend: Ptr) => string,
    ggml_backend_get_default_buffer_type: m("void * ggml_backend_get_default_buffer_type(void * backend)") as (
      backend: Ptr
    ) => Ptr,
    ggml_backend_supports_op: m("bool ggml_backend_supports_op(void * backend, void * op)") as (
      backend: Ptr,
      op: Ptr
    ) => boolean,
    ggml_backend_graph_compute: m("int ggml_backend_graph_compute(void * backend, void * graph)") as AsyncFn,
    ggml_backend_synchronize: m("void ggml_backend_synchronize(void * backend)") as (backend: Ptr) => void,

    // the scheduler of a GPU stage: ops its device does not compute, and blocks left in host memory, run on the CPU
    ggml_graph_size: b("int ggml_graph_size(void * graph)") as (graph: Ptr) => number,
    ggml_backend_sched_new: b(
      "void * ggml_backend_sched_new(void ** backends, void ** bufts, int n_backends, size_t graph_size, bool parallel, bool op_offload)"
    ) as (
      backends: ReadonlyArray<Ptr>,
      bufts: null,
      nBackends: number,
      graphSize: number,
      parallel: boolean,
      opOffload: boolean
    ) => Ptr | null,
    ggml_backend_sched_free: b("void ggml_backend_sched_free(void * sched)") as (sched: Ptr) => void,
    ggml_backend_sched_reset: b("void ggml_backend_sched_reset(void * sched)") as (sched: Ptr) => void,
    ggml_backend_sched_alloc_graph: b("bool ggml_backend_sched_alloc_graph(void * sched, void * graph)") as (
      sched: Ptr,
      graph: Ptr
    ) => boolean,
    ggml_backend_sched_graph_compute: b("int ggml_backend_sched_graph_compute(void * sched, void * graph)") as AsyncFn,
    ggml_backend_sched_get_n_splits: b("int ggml_backend_sched_get_n_splits(void * sched)") as (sched: Ptr) => number,
    ggml_backend_sched_get_buffer_size: b(
      "size_t ggml_backend_sched_get_buffer_size(void * sched, void * backend)"
    ) as (sched: Ptr, backend: Ptr) => number
  }
}

export type GgmlRaw = ReturnType<typeof bindTable>

export interface Ggml {
  readonly library: GgmlLibraryDir
  readonly version: string
  readonly commit: string
  readonly raw: GgmlRaw
  readonly ggml_type_size: (type: number) => number
  readonly ggml_blck_size: (type: number) => number
  readonly ggml_row_size: (type: number, ne: number) => number
  /**
   * Quantizes (or converts, for F32/F16/BF16) `nrows` rows of `nPerRow` floats to `type`.
   * `nPerRow` must be a multiple of the type's block size; the result has
   * `nrows * ggml_row_size(type, nPerRow)` bytes.
   */
  readonly quantizeChunk: (type: number, src: Float32Array, nrows: number, nPerRow: number) => Uint8Array
  /** Reads `ne[0..3]` and `nb[0..3]` of a tensor. */
  readonly tensorShape: (t: Ptr) => { readonly type: number; readonly ne: Array<number>; readonly nb: Array<number> }
  /** ggml_backend_set_n_threads through the CPU registry's proc address. */
  readonly setThreads: (backend: Ptr, threads: number) => void
  /** Repacked "extra" buffer types of the CPU device (llama.cpp's CPU_REPACK etc.). */
  readonly cpuExtraBufferTypes: () => ReadonlyArray<Ptr>
  readonly cpuDevice: () => Ptr
  /** The GPU device of the loaded package, by gpuDeviceIndex (null with the CPU-only package or no GPU). */
  readonly gpuDevice: () => Ptr | null
  /** Every device the loaded package registered, in ggml's order, with its memory now. */
  readonly devices: () => ReadonlyArray<GgmlDevice>
  /** Every device the loaded package registered, as "NAME (description)", comma-separated (an error's context). */
  readonly deviceSummary: () => string
  /** Points `tensor->buffer` at `buffer` (or null): llama.cpp's trick to ask supports_op about a buffer type. */
  readonly setTensorBuffer: (t: Ptr, buffer: Ptr | null) => void
  /** Runs the graph on a koffi worker thread (the event loop keeps running). */
  readonly computeAsync: (backend: Ptr, graph: Ptr) => Promise<number>
  /** Runs an allocated graph through a scheduler on a koffi worker thread. */
  readonly schedComputeAsync: (sched: Ptr, graph: Ptr) => Promise<number>
}

let cached: Ggml | undefined
let cachedError: GgmlBindingError | undefined

const ptrView = (p: Ptr, len: number) => new DataView(koffi.view(p, len))

const checkLayout = (raw: GgmlRaw): void => {
  const overhead = raw.ggml_tensor_overhead()
  if (overhead !== TensorLayout.overhead) {
    throw new GgmlBindingError(
      `ggml_tensor layout mismatch: ggml_tensor_overhead() is ${overhead}, the bindings were written for ${TensorLayout.overhead}`
    )
  }
  const ctx = raw.ggml_init({ mem_size: overhead * 4 + 1024, mem_buffer: null, no_alloc: true })
  if (ctx === null) throw new GgmlBindingError("ggml_init failed during the layout check")
  try {
    const t = raw.ggml_new_tensor_3d(ctx, GgmlType.F16, 6, 5, 3)
    raw.ggml_set_name(t, "swactor-layout")
    raw.ggml_set_input(t)
    const v = ptrView(t, TensorLayout.size)
    const ne = [0, 1, 2, 3].map((i) => Number(v.getBigInt64(TensorLayout.ne + 8 * i, true)))
    const nb = [0, 1, 2, 3].map((i) => Number(v.getBigUint64(TensorLayout.nb + 8 * i, true)))
    const type = v.getInt32(TensorLayout.type, true)
    const flags = v.getInt32(TensorLayout.flags, true)
    const nameBytes = new Uint8Array(v.buffer, v.byteOffset + TensorLayout.name, 14)
    const name = Buffer.from(nameBytes).toString("latin1")
    const expectNe = [6, 5, 3, 1]
    const expectNb = [2, 12, 60, 180]
    const ok =
      type === GgmlType.F16 &&
      ne.every((x, i) => x === expectNe[i]) &&
      nb.every((x, i) => x === expectNb[i]) &&
      (flags & 1) === 1 &&
      name === "swactor-layout" &&
      raw.ggml_nbytes(t) === 180
    if (!ok) {
      throw new GgmlBindingError(
        `ggml_tensor layout mismatch: read type=${type} ne=[${ne}] nb=[${nb}] flags=${flags} name=${JSON.stringify(
          name
        )}, expected type=1 ne=[${expectNe}] nb=[${expectNb}] input flag and name "swactor-layout"`
      )
    }
  } finally {
    raw.ggml_free(ctx)
  }
}

let logCallback: unknown

/**
 * ggml's default logger prints every level (a repacked weight logs one debug line each). Keep warnings and
 * errors on stderr, drop debug/info unless SWACTOR_GGML_LOG=debug. Done once, before any backend is loaded.
 */
const installLogFilter = (raw: GgmlRaw, debugLog: boolean) => {
  if (debugLog || logCallback !== undefined) return
  const proto = koffi.proto("void swactor_ggml_log(int level, const char * text, void * user_data)")
  let last = 0
  logCallback = koffi.register((level: number, text: string | null) => {
    const effective = level === 5 ? last : level
    if (level !== 5) last = level
    if (effective >= 3 && text !== null) process.stderr.write(text)
  }, koffi.pointer(proto))
  raw.ggml_log_set(logCallback, null)
}

/** The loaded package's devices: the GPU a stage computes on, each device with its memory, a one-line summary. */
const deviceQueries = (raw: GgmlRaw, ensureCpu: () => void): Pick<Ggml, "gpuDevice" | "devices" | "deviceSummary"> => {
  const kindOf = (dev: Ptr): GgmlDevice["kind"] => deviceKinds[raw.ggml_backend_dev_type(dev)] ?? "unknown"
  return {
    gpuDevice: () => {
      ensureCpu()
      const n = raw.ggml_backend_dev_count()
      const handles = Array.from({ length: n }, (_, i) => raw.ggml_backend_dev_get(i))
      const index = gpuDeviceIndex(handles.map(kindOf))
      return index < 0 ? null : handles[index]!
    },
    devices: () => {
      ensureCpu()
      return Array.from({ length: raw.ggml_backend_dev_count() }, (_, i) => {
        const dev = raw.ggml_backend_dev_get(i)
        const free = [0]
        const total = [0]
        raw.ggml_backend_dev_memory(dev, free, total)
        return {
          name: raw.ggml_backend_dev_name(dev),
          description: raw.ggml_backend_dev_description(dev),
          kind: kindOf(dev),
          freeBytes: free[0]!,
          totalBytes: total[0]!
        }
      })
    },
    deviceSummary: () => {
      ensureCpu()
      const n = raw.ggml_backend_dev_count()
      return Array.from({ length: n }, (_, i) => {
        const dev = raw.ggml_backend_dev_get(i)
        return `${raw.ggml_backend_dev_name(dev)} (${raw.ggml_backend_dev_description(dev)})`
      }).join(", ")
    }
  }
}

/**
 * The loaded package's ggml libraries: `swactor node --backend` / SWACTOR_GGML_PACKAGE: "cpu" (default), "cuda",
 * "vulkan" or "auto" (the CUDA package when an NVIDIA driver is visible, else the Vulkan one with a Vulkan loader;
 * config/Settings.ts), from the llama.cpp release the bindings were written for.
 */
const locateChecked = (load: GgmlLoad) => {
  if (process.arch !== "x64" && process.arch !== "arm64") {
    throw new GgmlBindingError(`swactor's ggml bindings assume a 64-bit target, this is ${process.arch}`)
  }
  // A stage computes on the package's GPU when its backend asks for one (StageExecutorLive), else on its CPU device.
  const located = locateGgmlLibraries({ backend: load.ggmlPackage, ggmlDir: load.ggmlDir })
  if ("tried" in located) {
    throw new GgmlBindingError(
      `node-llama-cpp's ggml libraries were not found for ${process.platform}-${process.arch}; looked in: ${located.tried.join(
        ", "
      )}`
    )
  }
  if (located.release !== undefined && located.release !== expectedBuild.release) {
    throw new GgmlBindingError(
      `${located.packageName} was built from llama.cpp release ${located.release}, swactor's ggml bindings ` +
        `were written for ${expectedBuild.release} (node-llama-cpp 3.21.1); install node-llama-cpp 3.21.1`
    )
  }
  return located
}

/** Loads ggml's two libraries, checks ggml's version and commit, and binds the table. */
const loadAndBind = (located: GgmlLibraryDir): GgmlRaw => {
  let baseLib: LibraryHandle
  let mainLib: LibraryHandle
  try {
    baseLib = koffi.load(join(located.dir, located.baseLib))
    mainLib = koffi.load(join(located.dir, located.mainLib))
  } catch (e) {
    throw new GgmlBindingError(`cannot load ggml from ${located.dir}: ${String(e)}`)
  }
  const types = declareTypes()
  try {
    const version = baseLib.func("const char * ggml_version()")() as string
    const commit = baseLib.func("const char * ggml_commit()")() as string
    if (version !== expectedBuild.ggmlVersion || commit !== expectedBuild.ggmlCommit) {
      throw new GgmlBindingError(
        `ggml in ${located.dir} is version ${version} (commit ${commit}); swactor's bindings were written for ` +
          `${expectedBuild.ggmlVersion} (commit ${expectedBuild.ggmlCommit}, node-llama-cpp 3.21.1)`
      )
    }
    return bindTable(baseLib, mainLib, types)
  } catch (e) {
    if (e instanceof GgmlBindingError) throw e
    throw new GgmlBindingError(`ggml in ${located.dir} lacks a function the bindings need: ${String(e)}`)
  }
}

/**
 * The CPU backend, loaded on first use (`ensure`): its device, its set_n_threads and its extra (repacked) buffer
 * types through the CPU registry's proc addresses.
 */
const cpuBackendOf = (raw: GgmlRaw, dir: string) => {
  const cpu = {
    ready: false,
    setThreadsPtr: null as Ptr | null,
    extraBufts: [] as ReadonlyArray<Ptr>,
    dev: null as Ptr | null
  }
  const setThreadsProto = koffi.proto("void swactor_set_n_threads(void * backend, int n)")
  const extraBuftsProto = koffi.proto("void * swactor_get_extra_bufts(void * dev)")
  const ensure = () => {
    if (cpu.ready) return
    // node-llama-cpp may already have loaded the backends into this process (same libraries).
    if (raw.ggml_backend_reg_by_name("CPU") === null) raw.ggml_backend_load_all_from_path(dir)
    const reg = raw.ggml_backend_reg_by_name("CPU")
    if (reg === null) throw new GgmlBindingError(`no ggml CPU backend could be loaded from ${dir}`)
    cpu.setThreadsPtr = raw.ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads")
    cpu.dev = raw.ggml_backend_dev_by_type(GgmlBackendDevType.CPU)
    if (cpu.dev === null) throw new GgmlBindingError("the ggml CPU backend has no device")
    const getExtra = raw.ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts")
    if (getExtra !== null) {
      const list = koffi.call(getExtra, extraBuftsProto, cpu.dev) as Ptr | null
      const out: Array<Ptr> = []
      if (list !== null) {
        for (let i = 0; i < 16; i++) {
          const p = koffi.decode(list, i * 8, "void *") as Ptr | null
          if (p === null) break
          out.push(p)
        }
      }
      cpu.extraBufts = out
    }
    cpu.ready = true
  }
  return { cpu, ensure, setThreadsProto }
}

/** Ggml.quantizeChunk: ggml's preconditions checked first (a failed GGML_ASSERT aborts the process). */
const quantizeChunkWith = (raw: GgmlRaw, type: number, src: Float32Array, nrows: number, nPerRow: number) => {
  // ggml_quantize_chunk's switch (ggml.c): f32, f16, bf16 and every quantized type but q8_1 / q8_K; any other type
  // (or an id past the type table, read out of bounds by ggml_blck_size) fails its GGML_ASSERT and aborts
  const info = ggmlTypeInfo(type)
  if (
    info === undefined ||
    !(info.quantized || type === GgmlType.F32 || type === GgmlType.F16 || type === GgmlType.BF16) ||
    type === GgmlType.Q8_1 ||
    type === GgmlType.Q8_K
  ) {
    throw new RangeError(`quantizeChunk: ggml cannot quantize to type ${type}`)
  }
  const blck = raw.ggml_blck_size(type)
  if (!Number.isInteger(nrows) || !Number.isInteger(nPerRow) || nrows < 0 || nPerRow <= 0) {
    throw new RangeError(`quantizeChunk: bad shape nrows=${nrows} nPerRow=${nPerRow}`)
  }
  if (blck <= 0 || raw.ggml_type_size(type) === 0) throw new RangeError(`quantizeChunk: unknown ggml type ${type}`)
  if (nPerRow % blck !== 0) {
    throw new RangeError(`quantizeChunk: nPerRow ${nPerRow} is not a multiple of block size ${blck} of type ${type}`)
  }
  if (src.length < nrows * nPerRow) {
    throw new RangeError(`quantizeChunk: src has ${src.length} floats, need ${nrows * nPerRow}`)
  }
  if (raw.ggml_quantize_requires_imatrix(type)) {
    throw new RangeError(`quantizeChunk: type ${type} needs an importance matrix`)
  }
  const rowBytes = raw.ggml_row_size(type, nPerRow)
  const dst = new Uint8Array(rowBytes * nrows)
  if (nrows === 0) return dst
  raw.ggml_quantize_init(type)
  const written = raw.ggml_quantize_chunk(type, src, dst, 0, nrows, nPerRow, null)
  if (written !== dst.length) {
    throw new Error(`ggml_quantize_chunk wrote ${written} bytes, expected ${dst.length}`)
  }
  return dst
}

/** Ggml.tensorShape: a tensor's type, `ne[0..3]` and `nb[0..3]` read from its struct. */
const tensorShapeOf = (t: Ptr) => {
  const v = ptrView(t, TensorLayout.size)
  return {
    type: v.getInt32(TensorLayout.type, true),
    ne: [0, 1, 2, 3].map((i) => Number(v.getBigInt64(TensorLayout.ne + 8 * i, true))),
    nb: [0, 1, 2, 3].map((i) => Number(v.getBigUint64(TensorLayout.nb + 8 * i, true)))
  }
}

const init = (load: GgmlLoad): Ggml => {
  const located = locateChecked(load)
  const raw = loadAndBind(located)
  checkLayout(raw)
  installLogFilter(raw, load.ggmlDebugLog)
  const { cpu, ensure: ensureCpu, setThreadsProto } = cpuBackendOf(raw, located.dir)
  return {
    library: located,
    version: expectedBuild.ggmlVersion,
    commit: expectedBuild.ggmlCommit,
    raw,
    ggml_type_size: raw.ggml_type_size,
    ggml_blck_size: raw.ggml_blck_size,
    ggml_row_size: raw.ggml_row_size,
    quantizeChunk: (type, src, nrows, nPerRow) => quantizeChunkWith(raw, type, src, nrows, nPerRow),
    tensorShape: tensorShapeOf,
    setThreads: (backend, threads) => {
      ensureCpu()
      if (cpu.setThreadsPtr !== null) koffi.call(cpu.setThreadsPtr, setThreadsProto, backend, threads)
    },
    cpuExtraBufferTypes: () => {
      ensureCpu()
      return cpu.extraBufts
    },
    cpuDevice: () => {
      ensureCpu()
      return cpu.dev
    },
    ...deviceQueries(raw, ensureCpu),
    setTensorBuffer: (t, buffer) => {
      koffi.encode(t, TensorLayout.buffer, "void *", buffer)
    },
    computeAsync: (backend, graph) => statusOnWorker(raw.ggml_backend_graph_compute, backend, graph),
    schedComputeAsync: (sched, graph) => statusOnWorker(raw.ggml_backend_sched_graph_compute, sched, graph)
  }
}

/** Calls a native function returning a ggml status on a koffi worker thread (the event loop keeps running). */
const statusOnWorker = (fn: AsyncFn, ...args: Array<unknown>): Promise<number> =>
  new Promise<number>((resolve, reject) => {
    fn.async(...args, (err: unknown, status: number) => {
      if (err) reject(err instanceof Error ? err : new Error(String(err)))
      else resolve(status)
    })
  })

/** What loading ggml reads of the settings: the package, a folder tried first, whether ggml's debug lines are kept. */
export type GgmlLoad = Pick<SettingsValues, "ggmlPackage" | "ggmlDir" | "ggmlDebugLog">

/**
 * The ggml handle (loaded on first call, with `load`: default, this process's settings from its environment; a
 * `swactor node --backend` passes its own). Throws GgmlBindingError with a clear message on mismatch.
 */
export const getGgml = (load?: GgmlLoad): Ggml => {
  if (cached !== undefined) return cached
  if (cachedError !== undefined) throw cachedError
  try {
    cached = init(load ?? liveSettings())
    return cached
  } catch (e) {
    cachedError = e instanceof GgmlBindingError ? e : new GgmlBindingError(String(e))
    throw cachedError
  }
}
