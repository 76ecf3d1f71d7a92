/**
 * Which CPU kernel a matrix product of a few rows (a decode step of a few sequences) should take, measured on the
 * machine that runs it.
 *
 * ggml's CPU mul_mat hands any src1 of 2+ rows to llamafile's tinyBLAS; given as [K, 1, rows] the rows instead go
 * through the one-row vec_dot kernel (Toolkit.mulMatSmall), which reads the weights once per 16 rows and gives
 * every row exactly the bits of its lone product. Which is faster depends on the CPU: on an AMD EPYC 2-vCPU VM
 * (Q8_0 2048x8192, 1 thread) tinyBLAS took 145 ms for 2 rows against 80 ms; on an Intel Xeon (Sapphire Rapids)
 * 2-vCPU VM tinyBLAS is the faster one at every row count (2 rows: 10.7 against 8.8 sequence tok/s).
 *
 * So, per weight type of the stage, on its largest matrix (at most 4096 rows of it): both kernels run on the same
 * random rows. If their bits differ at any row count (F32/F16: tinyBLAS sums in another order), the one-row
 * kernel stays, up to 7 rows, so a batched row keeps its lone bits. If the bits are the same (Q8_0: both sum the
 * same int8 blocks in the same order), the faster one wins: the one-row kernel is used up to the largest of 2, 4
 * and 7 rows at which it was faster, without a loss below it. Each is timed best of 3 after one warm-up.
 */
import { type Ggml, GgmlType, type Ptr } from "../ggml/Bindings.js"

/** Up to this many rows the one-row kernel keeps a batched row's lone bits when the other kernel would not. */
export const exactRowsDefault = 7

const ROW_COUNTS = [2, 4, 7] as const
const MAX_CAL_ROWS = 4096
const REPEATS = 3

/** What one weight type measured (for logs and tests). */
export interface SmallBatchTrial {
  readonly type: number
  readonly tensor: string
  readonly sameBits: boolean
  /** Best milliseconds per row count: [rows, one-row kernel, tinyBLAS]. */
  readonly millis: ReadonlyArray<readonly [number, number, number]>
  readonly maxRows: number
}

/**
 * The largest matrix (2-D, at least 2 rows) of each weight type. token_embd is left out: a first stage only looks
 * rows up in it; a type measured on no matrix keeps the one-row kernel (`exactRowsDefault`), which is always exact.
 */
const largestPerType = (g: Ggml, tensors: ReadonlyMap<string, Ptr>) => {
  const best = new Map<number, { name: string; p: Ptr; size: number }>()
  for (const [name, p] of tensors) {
    if (name === "token_embd.weight") continue
    const { type, ne } = g.tensorShape(p)
    if (ne[1]! < 2 || ne[2] !== 1 || ne[3] !== 1) continue
    const size = ne[0]! * ne[1]!
    const seen = best.get(type)
    if (seen === undefined || size > seen.size) best.set(type, { name, p, size })
  }
  return [...best.values()]
}

/** Deterministic values in [-1, 1) with full mantissas (xorshift32). */
const randomRows = (n: number, seed: number): Float32Array => {
  const out = new Float32Array(n)
  let s = seed >>> 0 || 1
  for (let i = 0; i < n; i++) {
    s ^= s << 13
    s >>>= 0
    s ^= s >>> 17
    s ^= s << 5
    s >>>= 0
    out[i] = s / 2 ** 31 - 1
  }
  return out
}

/** Measures one weight type on `w` (see the module comment). */
const trial = async (g: Ggml, backend: Ptr, buft: Ptr, name: string, w: Ptr): Promise<SmallBatchTrial> => {
  const raw = g.raw
  const { type, ne, nb } = g.tensorShape(w)
  const k = ne[0]!
  const m = Math.min(ne[1]!, MAX_CAL_ROWS)
  const slots = ROW_COUNTS.length * 2
  const ctx = raw.ggml_init({
    mem_size: raw.ggml_tensor_overhead() * (slots * 4 + 8) + raw.ggml_graph_overhead_custom(16, false) * slots,
    mem_buffer: null,
    no_alloc: true
  })
  if (ctx === null) throw new Error("ggml_init failed for the small-batch measurement")
  let buffer: Ptr | null = null
  try {
    const wv = raw.ggml_view_2d(ctx, w, k, m, nb[1]!, 0)
    const cases = ROW_COUNTS.map((rows) => {
      const x = raw.ggml_new_tensor_2d(ctx, GgmlType.F32, k, rows)
      raw.ggml_set_input(x)
      const tiny = raw.ggml_mul_mat(ctx, wv, x)
      const gemv = raw.ggml_mul_mat(ctx, wv, raw.ggml_reshape_3d(ctx, x, k, 1, rows))
      const graphOf = (y: Ptr) => {
        raw.ggml_set_output(y)
        const gr = raw.ggml_new_graph_custom(ctx, 16, false)
        raw.ggml_build_forward_expand(gr, y)
        return gr
      }
      return { rows, x, tiny, gemv, tinyGraph: graphOf(tiny), gemvGraph: graphOf(gemv) }
    })
    buffer = raw.ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft)
    if (buffer === null) throw new Error("could not allocate the small-batch measurement")
    let sameBits = true
    const millis: Array<readonly [number, number, number]> = []
    const time = async (graph: Ptr): Promise<number> => {
      let best = Infinity
      for (let i = 0; i <= REPEATS; i++) {
        const t0 = performance.now()
        const status = await g.computeAsync(backend, graph)
        const dt = performance.now() - t0
        if (status !== 0) throw new Error(`ggml_backend_graph_compute failed with status ${status}`)
        if (i > 0) best = Math.min(best, dt)
      }
      return best
    }
    for (const c of cases) {
      raw.ggml_backend_tensor_set(c.x, randomRows(k * c.rows, 7919 * c.rows), 0, k * c.rows * 4)
      const tGemv = await time(c.gemvGraph)
      const tTiny = await time(c.tinyGraph)
      const a = new Uint32Array(m * c.rows)
      const b = new Uint32Array(m * c.rows)
      raw.ggml_backend_tensor_get(c.gemv, a, 0, a.byteLength)
      raw.ggml_backend_tensor_get(c.tiny, b, 0, b.byteLength)
      if (!a.every((v, i) => v === b[i])) sameBits = false
      millis.push([c.rows, tGemv, tTiny])
    }
    return { type, tensor: name, sameBits, millis, maxRows: chooseMaxRows(sameBits, millis) }
  } finally {
    if (buffer !== null) raw.ggml_backend_buffer_free(buffer)
    raw.ggml_free(ctx)
  }
}

/**
 * The rule: other bits → the one-row kernel up to 7 rows; same bits → the one-row kernel up to the largest measured
 * row count at which it was faster at that count and every smaller one (0 when tinyBLAS is faster at 2 rows).
 */
export const chooseMaxRows = (sameBits: boolean, millis: ReadonlyArray<readonly [number, number, number]>): number => {
  if (!sameBits) return exactRowsDefault
  let max = 0
  for (const [rows, gemv, tiny] of millis) {
    if (gemv >= tiny) break
    max = rows
  }
  return max
}

/** Measures every matrix weight type of a CPU stage; the result decides Toolkit.mulMatSmall per type. */
export const measureSmallBatch = async (
  g: Ggml,
  backend: Ptr,
  buft: Ptr,
  tensors: ReadonlyMap<string, Ptr>,
  threads: number
): Promise<ReadonlyArray<SmallBatchTrial>> => {
  g.setThreads(backend, threads)
  const out: Array<SmallBatchTrial> = []
  for (const { name, p } of largestPerType(g, tensors)) out.push(await trial(g, backend, buft, name, p))
  return out
}

/**
 * Per weight type, the most rows of a CPU product that take the one-row kernel: what `measureSmallBatch` chose
 * (`exactRowsDefault` for a type not measured). A fixed count (loadWeights' `smallBatchRows`, from
 * SWACTOR_GEMV_MAX_ROWS) skips this.
 */
export const chooseSmallBatchRows = async (
  g: Ggml,
  backend: Ptr,
  buft: Ptr,
  tensors: ReadonlyMap<string, Ptr>,
  threads: number
): Promise<(type: number) => number> => {
  const rows = new Map((await measureSmallBatch(g, backend, buft, tensors, threads)).map((t) => [t.type, t.maxRows]))
  return (type) => rows.get(type) ?? exactRowsDefault
}
