/**
 * The agent's measured speed for placement: a short timed matrix-vector product on the ggml CPU backend with the
 * agent's thread count, over a Q8_0 matrix (the weights a decode step reads), in weight bytes per second. Decode is
 * bound by reading weights, so this predicts a stage's ms per token as bytes / speed. Takes a few tens of ms.
 */
import { GgmlType } from "../../domain/ggmlTypes.js"
import { type GgmlLoad, getGgml } from "../ggml/Bindings.js"

export interface SpeedProbeOptions {
  readonly threads: number
  /** Matrix columns x rows (default 4096 x 4096: 17.8 MB of Q8_0, more than most CPU caches). */
  readonly cols?: number
  readonly rows?: number
  /** Stop timing after this long (default 60 ms) or `maxRepeats` products (default 64). */
  readonly budgetMillis?: number
  readonly maxRepeats?: number
  /** Which ggml package to load, if the probe is the first to load ggml (default: the Settings service's). */
  readonly ggml?: GgmlLoad
}

/** Weight bytes per second of one Q8_0 matrix-vector product on the CPU backend. Throws if ggml cannot run it. */
export const measureSpeed = async (options: SpeedProbeOptions): Promise<number> => {
  const cols = options.cols ?? 4096
  const rows = options.rows ?? 4096
  // Checked here: ggml asserts (and aborts the process) on shapes it cannot hold.
  if (!Number.isSafeInteger(cols) || cols <= 0 || cols % 32 !== 0 || !Number.isSafeInteger(rows) || rows <= 0) {
    throw new RangeError(`speed probe: a ${cols} x ${rows} Q8_0 matrix needs whole rows of 32-value blocks`)
  }
  const g = getGgml(options.ggml)
  const raw = g.raw
  const dev = g.cpuDevice()
  const buft = raw.ggml_backend_dev_buffer_type(dev)
  const weights = raw.ggml_init({ mem_size: raw.ggml_tensor_overhead() * 4, mem_buffer: null, no_alloc: true })
  if (weights === null) throw new Error("ggml_init failed for the speed probe")
  let buffer: unknown = null
  let graphCtx: unknown = null
  let galloc: unknown = null
  let backend: unknown = null
  try {
    const w = raw.ggml_new_tensor_2d(weights, GgmlType.Q8_0, cols, rows)
    const x = raw.ggml_new_tensor_2d(weights, GgmlType.F32, cols, 1)
    buffer = raw.ggml_backend_alloc_ctx_tensors_from_buft(weights, buft)
    if (buffer === null) throw new Error("could not allocate the speed probe's matrix")
    // One quantized row repeated: the values do not matter to the speed, the bytes read do.
    const row = g.quantizeChunk(
      GgmlType.Q8_0,
      Float32Array.from({ length: cols }, (_, i) => Math.sin(i)),
      1,
      cols
    )
    const q = new Uint8Array(row.length * rows)
    for (let r = 0; r < rows; r++) q.set(row, r * row.length)
    raw.ggml_backend_tensor_set(w, q, 0, q.length)
    const v = Float32Array.from({ length: cols }, (_, i) => Math.cos(i))
    raw.ggml_backend_tensor_set(x, v, 0, v.byteLength)

    const nodes = 16
    const gctx = raw.ggml_init({
      mem_size: raw.ggml_tensor_overhead() * nodes + raw.ggml_graph_overhead_custom(nodes, false),
      mem_buffer: null,
      no_alloc: true
    })
    if (gctx === null) throw new Error("ggml_init failed for the speed probe's graph")
    graphCtx = gctx
    const y = raw.ggml_mul_mat(gctx, w, x)
    const graph = raw.ggml_new_graph_custom(gctx, nodes, false)
    raw.ggml_build_forward_expand(graph, y)
    const allocator = raw.ggml_gallocr_new(buft)
    galloc = allocator
    if (!raw.ggml_gallocr_alloc_graph(allocator, graph)) throw new Error("could not allocate the speed probe's graph")
    const be = raw.ggml_backend_dev_init(dev, null)
    if (be === null) throw new Error("could not start the ggml CPU backend")
    backend = be
    g.setThreads(be, Math.max(1, options.threads))

    for (let i = 0; i < 2; i++) await g.computeAsync(be, graph)
    const budget = options.budgetMillis ?? 60
    const maxRepeats = options.maxRepeats ?? 64
    const start = performance.now()
    let repeats = 0
    while (repeats < maxRepeats && (repeats < 3 || performance.now() - start < budget)) {
      const status = await g.computeAsync(be, graph)
      if (status !== 0) throw new Error(`the speed probe's compute failed with status ${status}`)
      repeats++
    }
    const seconds = (performance.now() - start) / 1000
    return (q.length * repeats) / seconds
  } finally {
    if (backend !== null) raw.ggml_backend_free(backend as never)
    if (galloc !== null) raw.ggml_gallocr_free(galloc as never)
    if (graphCtx !== null) raw.ggml_free(graphCtx as never)
    if (buffer !== null) raw.ggml_backend_buffer_free(buffer as never)
    raw.ggml_free(weights)
  }
}
