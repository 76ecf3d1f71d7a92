/**
 * Where a CPU stage's weights live, and which matrix products its graphs may build over them: the one rule.
 *
 * ggml's CPU backend hands a product whose weight sits in an *extra* buffer type (CPU_REPACK, AMX, ...) to that
 * type's own kernel, whatever the product's shape: at compute time nothing asks the type again. llama.cpp therefore
 * places a weight in an extra type only after its device agreed, through `supports_op`, to the product that uses
 * it (`weight_buft_supported`, src/llama-model.cpp), and its scheduler moves any other product to a backend that
 * computes it. A stage has no scheduler, so the rule is stricter here:
 *
 * 1. A weight goes into an extra buffer type only when the CPU device supports, with the weight in that type, the
 *    product of every row count the stage's graphs build over it (`PRODUCT_ROWS`: a decode step, a decode step of a
 *    few sequences, micro-batches, prefill chunks; the input always F32 `[K, rows]`). Otherwise it stays in the plain
 *    CPU buffer (or in place in the file mapping).
 * 2. The few-row route (an input given as `[K, 1, rows]`, Toolkit.mulMatSmall) runs only over weights in the plain
 *    buffer. It exists to reach ggml's own one-row kernel, which only plain weights take; over an extra type the
 *    type's kernel would run instead, and its `supports_op` cannot be trusted for that shape: AMX's agrees to any
 *    contiguous input, then its batched path offsets the weight by the input's plane stride and the output by a byte
 *    count added to a `float *` (ggml-cpu/amx/mmq.cpp, `ggml_backend_amx_mul_mat`), writing outside the buffer.
 * 3. Before a graph computes, `checkGraph` asks the device about every node as built, and refuses a product over an
 *    extra-type weight in any shape rule 1 did not agree to.
 *
 * Stacked expert matrices (3-D, `[K, rows, n_expert]`, multiplied only through ggml_mul_mat_id) follow rule 1 with
 * mul_mat_id products instead: the device must agree, with the experts in the extra type, to the product of every row
 * count in PRODUCT_ROWS, the input given both ways the MoE graph gives it (`[K, 1, rows]` broadcast to every chosen
 * expert, and `[K, used, rows]` one input per chosen expert), as llama.cpp's `weight_buft_supported` asks with its
 * GGML_OP_MUL_MAT_ID probe. ggml's repacked mul_mat_id runs a one-row gemv per (row, expert) pair, so a row's bits do
 * not depend on the batch.
 */
import koffi from "koffi"
import { type Ggml, GgmlType, type Ptr, TensorLayout } from "../ggml/Bindings.js"

/** Row counts of the products a stage's graphs build over a weight (rule 1 asks about each). */
export const PRODUCT_ROWS: ReadonlyArray<number> = [1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 512]

/** Where a weight lives: the plain CPU buffer (copied or mapped), or an extra (repacked) buffer type. */
export type WeightHome = "plain" | "extra"

/** Rule 2: may a product over a weight living here take the few-row route? */
export const fewRowRouteAllowed = (home: WeightHome): boolean => home === "plain"

/**
 * Rule 1 for one extra buffer type: with a `type` weight of `[ne0, ne1]` in `buft`, does `dev` compute the product of
 * every row count in PRODUCT_ROWS? (A zero-size buffer of the type stands in, as llama.cpp does.)
 */
export const extraTypeSupports = (g: Ggml, dev: Ptr, buft: Ptr, type: number, ne0: number, ne1: number): boolean =>
  withProbeWeight(g, buft, 2 * PRODUCT_ROWS.length + 2, [type, ne0, ne1], (ctx, w) =>
    PRODUCT_ROWS.every((rows) =>
      g.raw.ggml_backend_dev_supports_op(
        dev,
        g.raw.ggml_mul_mat(ctx, w, g.raw.ggml_new_tensor_2d(ctx, GgmlType.F32, ne0, rows))
      )
    )
  )

/**
 * Runs `probe` over a weight of `[type, ne0, ne1(, ne2)]` placed in a zero-size buffer of `buft` (llama.cpp's way to ask
 * `supports_op` about a buffer type without allocating), in a context of `tensors` tensors; false when ggml cannot
 * make the context or the buffer. Frees both.
 */
const withProbeWeight = (
  g: Ggml,
  buft: Ptr,
  tensors: number,
  [type, ne0, ne1, ne2]: readonly [number, number, number, number?],
  probe: (ctx: Ptr, w: Ptr) => boolean
): boolean => {
  const raw = g.raw
  const ctx = raw.ggml_init({ mem_size: raw.ggml_tensor_overhead() * tensors, mem_buffer: null, no_alloc: true })
  if (ctx === null) return false
  try {
    const w =
      ne2 === undefined ? raw.ggml_new_tensor_2d(ctx, type, ne0, ne1) : raw.ggml_new_tensor_3d(ctx, type, ne0, ne1, ne2)
    const buf = raw.ggml_backend_buft_alloc_buffer(buft, 0)
    if (buf === null) return false
    g.setTensorBuffer(w, buf)
    try {
      return probe(ctx, w)
    } finally {
      g.setTensorBuffer(w, null)
      raw.ggml_backend_buffer_free(buf)
    }
  } finally {
    raw.ggml_free(ctx)
  }
}

/**
 * Rule 1 for stacked experts in one extra buffer type: with a `type` weight of `[ne0, ne1, ne2]` (ne2 experts) in
 * `buft`, does `dev` compute ggml_mul_mat_id of every row count in PRODUCT_ROWS, the input `[ne0, 1, rows]` and
 * `[ne0, used, rows]` with I32 expert ids `[used, rows]`?
 */
const extraTypeSupportsExperts = (
  g: Ggml,
  dev: Ptr,
  buft: Ptr,
  type: number,
  ne0: number,
  ne1: number,
  ne2: number
): boolean => {
  const raw = g.raw
  const used = Math.min(ne2, 2)
  return withProbeWeight(g, buft, 5 * PRODUCT_ROWS.length + 2, [type, ne0, ne1, ne2], (ctx, w) =>
    PRODUCT_ROWS.every((rows) => {
      const ids = raw.ggml_new_tensor_2d(ctx, GgmlType.I32, used, rows)
      return [1, used].every((perRow) =>
        raw.ggml_backend_dev_supports_op(
          dev,
          raw.ggml_mul_mat_id(ctx, w, raw.ggml_new_tensor_3d(ctx, GgmlType.F32, ne0, perRow, rows), ids)
        )
      )
    })
  )
}

/**
 * The buffer type a matrix weight goes into: the first extra type that passes rule 1, else null (the plain buffer).
 * Candidates: 2-D matrices used by ggml_mul_mat, 3-D stacked experts used by ggml_mul_mat_id (any other shape stays
 * plain: the products are built over those only).
 */
export const chooseExtraBuffer = (
  g: Ggml,
  extras: ReadonlyArray<Ptr>,
  product: "mul_mat" | "mul_mat_id",
  type: number,
  dims: ReadonlyArray<number>
): Ptr | null => {
  if (extras.length === 0) return null
  const dev = g.cpuDevice()
  if (product === "mul_mat_id") {
    if (dims.length !== 3) return null
    return extras.find((b) => extraTypeSupportsExperts(g, dev, b, type, dims[0]!, dims[1]!, dims[2]!)) ?? null
  }
  if (dims.length !== 2) return null
  return extras.find((b) => extraTypeSupports(g, dev, b, type, dims[0]!, dims[1]!)) ?? null
}

/** ggml_op ids this module compares against, read once from tensors ggml built (no hand-kept enum). */
let mulMatOp: number | undefined
const opOf = (t: Ptr): number => koffi.decode(t, TensorLayout.op, "int32_t") as number
const mulMatOpId = (g: Ggml): number => {
  if (mulMatOp !== undefined) return mulMatOp
  const raw = g.raw
  const ctx = raw.ggml_init({ mem_size: raw.ggml_tensor_overhead() * 4, mem_buffer: null, no_alloc: true })
  if (ctx === null) throw new Error("ggml_init failed")
  try {
    const a = raw.ggml_new_tensor_2d(ctx, GgmlType.F32, 4, 4)
    mulMatOp = opOf(raw.ggml_mul_mat(ctx, a, a))
    return mulMatOp
  } finally {
    raw.ggml_free(ctx)
  }
}

const srcOf = (t: Ptr, i: number): Ptr | null => koffi.decode(t, TensorLayout.src + 8 * i, "void *") as Ptr | null

/**
 * Rule 3, before a graph first computes: every node must be one `dev` computes as built, and a product over a weight
 * in an extra buffer type must have an F32 `[K, rows]` input (the shapes rule 1 agreed to). Throws a one-line error
 * naming the node otherwise. `extraWeights` holds the addresses of the stage's weights in extra types.
 */
export const checkGraph = (g: Ggml, dev: Ptr, graph: Ptr, extraWeights: ReadonlySet<bigint>): void => {
  const raw = g.raw
  const mulMat = mulMatOpId(g)
  const nodes = raw.ggml_graph_n_nodes(graph)
  for (let i = 0; i < nodes; i++) {
    const node = raw.ggml_graph_node(graph, i)
    if (extraWeights.size > 0 && opOf(node) === mulMat) {
      const w = srcOf(node, 0)
      if (w !== null && extraWeights.has(koffi.address(w))) {
        const x = g.tensorShape(srcOf(node, 1))
        if (x.type !== GgmlType.F32 || x.ne[2] !== 1 || x.ne[3] !== 1) {
          throw new Error(
            `graph node ${i} (${raw.ggml_op_desc(node)}): a product over a repacked weight with an input of shape ` +
              `[${x.ne}] (type ${x.type}); repacked weights take F32 [K, rows] inputs only`
          )
        }
      }
    }
    if (!raw.ggml_backend_dev_supports_op(dev, node)) {
      throw new Error(
        `graph node ${i} (${raw.ggml_op_desc(node)}): the ${raw.ggml_backend_dev_name(dev)} device does not compute ` +
          "it in the shape and buffers this graph builds"
      )
    }
  }
}

/**
 * A GPU stage's weight goes into device memory only when the device computes every product the graphs build over it
 * there (rule 1's probes with the device's own buffer type; a gather by I32 ids for a table looked up by token):
 * llama.cpp's `weight_buft_supported`. Otherwise it stays in host memory and the scheduler runs those products on the
 * CPU (GraphCache.ts), never a crash.
 */
export const deviceComputesWeight = (
  g: Ggml,
  dev: Ptr,
  use: "get_rows" | "mul_mat" | "mul_mat_id" | "vector",
  type: number,
  dims: ReadonlyArray<number>
): boolean => {
  const buft = g.raw.ggml_backend_dev_buffer_type(dev)
  if (use === "vector") return true
  if (use === "mul_mat_id") {
    return dims.length === 3 && extraTypeSupportsExperts(g, dev, buft, type, dims[0]!, dims[1]!, dims[2]!)
  }
  if (use === "mul_mat") return dims.length === 2 && extraTypeSupports(g, dev, buft, type, dims[0]!, dims[1] ?? 1)
  return gatherSupported(g, dev, buft, type, dims[0]!, dims[1] ?? 1)
}

const gatherSupported = (g: Ggml, dev: Ptr, buft: Ptr, type: number, ne0: number, ne1: number): boolean =>
  withProbeWeight(g, buft, 4, [type, ne0, ne1], (ctx, w) =>
    g.raw.ggml_backend_dev_supports_op(dev, g.raw.ggml_get_rows(ctx, w, g.raw.ggml_new_tensor_1d(ctx, GgmlType.I32, 8)))
  )

/** The tensor whose memory a node writes in place (itself, or the tensor it views), when it has memory already. */
const preallocatedBuffer = (t: Ptr): Ptr | null => {
  const own = koffi.decode(t, TensorLayout.buffer, "void *") as Ptr | null
  if (own !== null) return own
  const src = koffi.decode(t, TensorLayout.viewSrc, "void *") as Ptr | null
  return src === null ? null : (koffi.decode(src, TensorLayout.buffer, "void *") as Ptr | null)
}

/**
 * Before a GPU stage's graph goes to its scheduler: every node must be one that the device or the CPU computes (else
 * ggml_backend_sched aborts the process: "all nodes should be assigned"), and a node writing into memory it already
 * has (a KV cache row) must be one the device holding that memory computes (else "pre-allocated tensor ... cannot run
 * the operation"). Throws a one-line error naming the node otherwise.
 */
export const checkScheduledGraph = (g: Ggml, gpu: Ptr, graph: Ptr): void => {
  const raw = g.raw
  const cpu = g.cpuDevice()
  const cpuBuft = raw.ggml_backend_dev_buffer_type(cpu)
  const nodes = raw.ggml_graph_n_nodes(graph)
  for (let i = 0; i < nodes; i++) {
    const node = raw.ggml_graph_node(graph, i)
    const buffer = preallocatedBuffer(node)
    const owner =
      buffer === null
        ? null
        : raw.ggml_backend_buffer_get_type(buffer) === cpuBuft || raw.ggml_backend_buffer_is_host(buffer)
          ? cpu
          : gpu
    const ok =
      owner !== null
        ? raw.ggml_backend_dev_supports_op(owner, node)
        : raw.ggml_backend_dev_supports_op(gpu, node) || raw.ggml_backend_dev_supports_op(cpu, node)
    if (!ok) {
      throw new Error(
        `graph node ${i} (${raw.ggml_op_desc(node)}): neither the ${raw.ggml_backend_dev_name(gpu)} device nor the ` +
          "CPU computes it in the shape and buffers this graph builds"
      )
    }
  }
}
