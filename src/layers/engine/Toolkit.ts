/**
 * The shared graph toolkit: norm, projections, RoPE, attention over the stage's KV cache, SwiGLU feed-forward.
 * It mirrors llama.cpp's llm_graph_context (llama-graph.cpp) op for op, so that a stage computes what
 * llama.cpp computes: flash attention with an F16 mask over an F16 KV cache, F32 precision.
 */
import { GgmlType, type GgmlRaw, type Ptr } from "../ggml/Bindings.js"
import { type BlockHeads, type HParams, headsOf } from "./HParams.js"
import { PLAIN_ROPE, type RopeExt } from "./PositionScaling.js"

export const GGML_PREC_F32 = 10

/** A tensor the architecture needs: short name (`attn_q.weight`), ggml dims, and what it is used for. */
export interface TensorSpec {
  readonly name: string
  readonly dims: ReadonlyArray<number>
  /** matrix: any type mul_mat/get_rows accept; vector (norms, biases, rope factors): F32 only */
  readonly kind: "matrix" | "vector"
  readonly required: boolean
  /** A matrix the graph multiplies only through ggml_mul_mat_id (stacked experts, 3-D); default ggml_mul_mat. */
  readonly product?: "mul_mat_id"
  /** A table the graph only gathers rows of, of exactly this ggml type (deepseek4's I32 ffn_gate_tid2eid). */
  readonly exactType?: number
}

/** The loaded weights of one block, by short name. */
export interface BlockWeights {
  readonly get: (name: string) => Ptr
  readonly opt: (name: string) => Ptr | null
  /** A model-wide tensor (e.g. `rope_freqs.weight`). */
  readonly global: (name: string) => Ptr | null
}

/**
 * A verify step's snapshot tensors of one recurrent block (RecurrentSnapshots.ts): `rows` conv states, then `rows` SSM
 * states (F32, contiguous).
 */
export interface StateSnapshots {
  readonly conv: Ptr
  readonly ssm: Ptr
  /** F32 elements of one conv / SSM state. */
  readonly convElems: number
  readonly ssmElems: number
}

export interface KvLayer {
  /** [headDimK * nHeadKv, kvSize] F16 */
  readonly k: Ptr
  /** [headDimV * nHeadKv, kvSize] F16 */
  readonly v: Ptr
}

/**
 * One sequence of a batch: rows offset..offset+n-1 of the batch are its tokens; it attends over the first nKv
 * cells of its own KV cache.
 */
export interface AttentionSegment {
  readonly offset: number
  readonly n: number
  readonly nKv: number
  /** The KV cache of a block (index in the whole model) of this sequence. */
  readonly kv: (il: number) => KvLayer
  /** A verify step on recurrent blocks: where block il keeps each row's states (RecurrentSnapshots.ts). */
  readonly snapshots?: (il: number) => StateSnapshots | undefined
  /** I64 [n] KV cell of each of its tokens */
  readonly kvIdx: Ptr
  /** F16 [nKv, n] 0 / -inf, contiguous (flash attention needs it so) */
  readonly mask: Ptr
  /**
   * The mask of sliding-window blocks, F16 [swaNKv, n]: -inf where a cell holds no position of this sequence, a later
   * one, or one outside the window (null when the stage has none). Built from the positions the ring's cells hold.
   */
  readonly swaMask: Ptr | null
  /** Cells attended to in a sliding-window block's cache (a ring capped near the window, KvCache.ts). */
  readonly swaNKv: number
  /** I64 [n] the ring cell of each of its tokens in sliding-window blocks (position mod ring size); null: none */
  readonly swaKvIdx: Ptr | null
  /** I64 [n] its rows in the batch (where its attention output goes); null when it is the whole batch */
  readonly rows: Ptr | null
}

/** A tensor of all the batch's rows, [ne0, ne1, n], contiguous F32: Toolkit.perSequence takes each sequence's rows. */
export interface SequenceRows {
  readonly x: Ptr
  readonly ne0: number
  readonly ne1: number
}

export interface GraphInputs {
  /** I32 [nTokens] positions (each sequence's own) */
  readonly pos: Ptr
  /** I32 [nOutputs] rows kept after the model's last block (last stage only): each sequence's last row */
  readonly outIds: Ptr | null
  /** The sequences of the batch, in row order, covering every row. */
  readonly segments: ReadonlyArray<AttentionSegment>
  /** F32 [n, n] the orthonormal Walsh-Hadamard rotation of DSA's indexer q and k (HParams.dsa; absent or null: none) */
  readonly hadamard?: Ptr | null
  /** I32 [nTokens] the token ids (first stage only; deepseek4's hash-routed blocks read them) */
  readonly tokens?: Ptr | null
  /** deepseek4's compressor inputs (GraphBuild.ts dsv4Inputs; absent: none) */
  readonly dsv4?: Dsv4Inputs
  /** F32 [1, 1, nTokens] attention temperature of each token (HParams.attnTemp; absent or null: none) */
  readonly attnScale?: Ptr | null
  /**
   * Per-layer embedding inputs (HParams.perLayer, archs/gemma4PerLayer.ts): F32 rows of `stride` floats, block il's
   * `width` values of a token at float `offset + (il - first) * width` of its row.
   */
  readonly perLayer?: { readonly rows: Ptr; readonly stride: number; readonly offset: number; readonly first: number }
}

/**
 * deepseek4's inputs of the compressed blocks (archs/deepseek4.ts): every row's position within its block of 4, and
 * per sequence (by segment) the cells the compressor reads and writes and the compressed rows' visibility.
 */
export interface Dsv4Inputs {
  /** I32 [nTokens]: position mod 4 (the compressor's ape row). */
  readonly statePos: Ptr
  readonly segments: ReadonlyArray<Dsv4Segment>
  /** The heavily compressed blocks' (ratio 128) inputs, when the stage holds one. */
  readonly hca?: { readonly statePos: Ptr; readonly segments: ReadonlyArray<HcaSegment> }
}

/**
 * One sequence's inputs of the heavily compressed blocks (ratio 128): only its rows that end a block of 128 positions
 * (`m` of them) compress it.
 */
export interface HcaSegment {
  readonly m: number
  /** I32 [128 x m]: the cells of each completed block's positions (null when m is 0). */
  readonly read: Ptr | null
  /** I64 [m]: each completed block's compressed row. */
  readonly write: Ptr | null
  /** I32 [m]: each completed block's first position. */
  readonly pos: Ptr | null
  /** Compressed rows attended (0: none complete yet). */
  readonly nComp: number
  /** F16 [nComp, n]: 0 where a compressed row is complete at the row's position, else -inf (null when nComp is 0). */
  readonly mask: Ptr | null
}

export interface Dsv4Segment {
  /** Compressed rows attended (0: this call sees none yet, attention reads the window only). */
  readonly nComp: number
  /** Blocks of 4 positions this call completes (each compressed into its row); the four below are null when 0. */
  readonly m: number
  /** I32 [8 x m]: the cells of each completed block's previous block's 4 positions (all blocks), then of its own. */
  readonly read: Ptr | null
  /** F32 [1, 4, m]: 0, or -inf where the previous block does not exist (block 0). */
  readonly prevBias: Ptr | null
  /** I64 [m]: each completed block's compressed row. */
  readonly write: Ptr | null
  /** I32 [m]: each completed block's first position (its compressed row's RoPE position). */
  readonly compPos: Ptr | null
  /** F16 [nComp, n]: 0 where a compressed row is complete at the row's position, else -inf (null when nComp is 0). */
  readonly mask: Ptr | null
}

/**
 * Products built on the few-row route (Toolkit.mulMatSmall) in this process, counted as graphs are built: what a test
 * reads to know the route was taken (test/support/engineRoutes.mjs).
 */
export const fewRowProducts = { count: 0 }

/** Matrix products over a few rows through ggml's one-row kernel (CPU; see Toolkit.mulMatSmall). */
export interface SmallBatchMatMul {
  /** Per weight type: most rows that take the one-row kernel (2..n; 0 or 1: never). */
  readonly maxRowsFor: (type: number) => number
  /** May a product over this weight take the route (WeightPlacement.ts, rule 2: plain-buffer weights only)? */
  readonly allowed: (w: Ptr) => boolean
  readonly shapeOf: (t: Ptr) => {
    readonly type: number
    readonly ne: ReadonlyArray<number>
    readonly nb: ReadonlyArray<number>
  }
  /**
   * A speculative step's rows (StageInput.verify): every row must get its lone bits, so where the route cannot take
   * the rows (a repacked weight, more rows than the route's reach) they go in groups it can, one row at a time over a
   * repacked weight, joined again.
   */
  readonly verify?: boolean
}

export class Toolkit {
  /** Index (in the whole model) of the block being built. */
  layer = 0

  constructor(
    readonly g: GgmlRaw,
    readonly ctx: Ptr,
    readonly graph: Ptr,
    readonly hp: HParams,
    readonly nTokens: number,
    readonly inputs: GraphInputs,
    private readonly small: SmallBatchMatMul | null = null
  ) {}

  /**
   * The batch's attention output rows before wo (several sequences only): one buffer all blocks of one output width
   * reuse (by width: gemma4's blocks differ).
   */
  private readonly attnRows = new Map<number, Ptr>()

  /** The attention shape of the block being built (HParams.blockHeads, else the model-wide one). */
  get heads(): BlockHeads {
    return headsOf(this.hp, this.layer)
  }

  add(a: Ptr, b: Ptr): Ptr {
    return this.g.ggml_add(this.ctx, a, b)
  }

  /** RMS norm then scale by the weight (LLM_NORM_RMS). */
  rmsNorm(x: Ptr, w: Ptr): Ptr {
    return this.g.ggml_mul(this.ctx, this.g.ggml_rms_norm(this.ctx, x, this.hp.rmsEps), w)
  }

  linear(w: Ptr, x: Ptr, b: Ptr | null = null): Ptr {
    const y = this.small === null ? this.g.ggml_mul_mat(this.ctx, w, x) : this.mulMatSmall(w, x, this.small)
    return b === null ? y : this.g.ggml_add(this.ctx, y, b)
  }

  /**
   * ggml's CPU mul_mat hands any src1 of 2+ rows to llamafile's tinyBLAS. Given as [K, 1, rows] (ne11 = 1) the
   * rows skip tinyBLAS and go through the vec_dot kernel of a one-row product, 16 weight rows at a time over all
   * input rows: the weights are read once and each row gets the same bits as alone. Which is faster depends on the
   * CPU; SmallBatch.ts measures it per weight type (`maxRowsFor`).
   */
  private mulMatSmall(w: Ptr, x: Ptr, small: SmallBatchMatMul): Ptr {
    const g = this.g
    const { nb, ne, type } = small.shapeOf(x)
    const rows = ne[1]!
    const contiguous = type === GgmlType.F32 && nb[0] === 4 && nb[1] === ne[0]! * 4 && ne[2] === 1 && ne[3] === 1
    if (rows < 2 || !contiguous) return g.ggml_mul_mat(this.ctx, w, x)
    if (!small.allowed(w)) return small.verify === true ? this.inGroups(w, x, 1, small) : g.ggml_mul_mat(this.ctx, w, x)
    const weight = small.shapeOf(w)
    const reach = small.maxRowsFor(weight.type)
    if (rows > reach) {
      // a reach under 2: both kernels give the same bits for this type (SmallBatch.ts), the multi-row one is exact
      return small.verify === true && reach >= 2 ? this.inGroups(w, x, reach, small) : g.ggml_mul_mat(this.ctx, w, x)
    }
    fewRowProducts.count++
    const y = g.ggml_mul_mat(this.ctx, w, g.ggml_reshape_3d(this.ctx, x, ne[0]!, 1, rows))
    return g.ggml_reshape_2d(this.ctx, y, weight.ne[1]!, rows)
  }

  /**
   * A verify step's product in groups of at most `group` rows (1: each row alone, [K, 1], the one-row kernel of
   * whatever buffer holds the weight), each group as `mulMatSmall` would take it, joined along the rows.
   */
  private inGroups(w: Ptr, x: Ptr, group: number, small: SmallBatchMatMul): Ptr {
    const g = this.g
    const { nb, ne } = small.shapeOf(x)
    const rows = ne[1]!
    let out: Ptr | null = null
    for (let r = 0; r < rows; r += group) {
      const n = Math.min(group, rows - r)
      const part = g.ggml_view_2d(this.ctx, x, ne[0]!, n, nb[1]!, r * nb[1]!)
      const y = n === 1 ? g.ggml_mul_mat(this.ctx, w, part) : this.mulMatSmall(w, part, { ...small, verify: false })
      out = out === null ? y : g.ggml_concat(this.ctx, out, y, 1)
    }
    return out!
  }

  /** Separate Q/K/V projections (+ optional biases), reshaped to [headDim, heads, nTokens]. */
  qkv(w: BlockWeights, x: Ptr): { q: Ptr; k: Ptr; v: Ptr } {
    const { headDimK, headDimV, nHeadKv } = this.heads
    const nHead = this.hp.nHead
    const q = this.linear(w.get("attn_q.weight"), x, w.opt("attn_q.bias"))
    const k = this.linear(w.get("attn_k.weight"), x, w.opt("attn_k.bias"))
    const v = this.linear(w.get("attn_v.weight"), x, w.opt("attn_v.bias"))
    return {
      q: this.g.ggml_reshape_3d(this.ctx, q, headDimK, nHead, this.nTokens),
      k: this.g.ggml_reshape_3d(this.ctx, k, headDimK, nHeadKv, this.nTokens),
      v: this.g.ggml_reshape_3d(this.ctx, v, headDimV, nHeadKv, this.nTokens)
    }
  }

  /** Is the block being built a sliding-window block (HParams.swa)? */
  get slidingWindow(): boolean {
    return this.hp.swa?.layers[this.layer] === true
  }

  /**
   * RoPE with the model's base and scale, or the sliding-window blocks' own (llama.cpp's get_rope_freq_base), and
   * YaRN's settings when the model has them (HParams.ropeExt).
   */
  rope(x: Ptr, freqFactors: Ptr | null = null, mode: number = this.hp.ropeMode): Ptr {
    const hp = this.hp
    const swa = this.slidingWindow ? hp.swa! : null
    const ext = swa?.plainRope === true ? { ...PLAIN_ROPE, ...betasOf(hp.ropeExt) } : (hp.ropeExt ?? PLAIN_ROPE)
    return this.g.ggml_rope_ext(
      this.ctx,
      x,
      this.inputs.pos,
      freqFactors,
      this.heads.nRot,
      mode,
      hp.nCtxOrig,
      swa === null ? hp.ropeFreqBase : swa.ropeFreqBase,
      swa === null ? hp.ropeFreqScale : swa.ropeFreqScale,
      ext.extFactor,
      ext.attnFactor,
      ext.betaFast,
      ext.betaSlow
    )
  }

  /**
   * q or k [headDim, heads, n] RMS-normed over the whole projection (all heads of a token as one row, llama.cpp's
   * attn_q_norm of width heads x headDim: minimax-m2, olmo2), then back to heads.
   */
  rmsNormWide(p: Ptr, heads: number, weight: Ptr): Ptr {
    const d = this.heads.headDimK
    const g = this.g
    return g.ggml_reshape_3d(
      this.ctx,
      this.rmsNorm(g.ggml_reshape_2d(this.ctx, p, d * heads, this.nTokens), weight),
      d,
      heads,
      this.nTokens
    )
  }

  /** q [headDim, nHead, n] times each token's attention temperature (llama 4 / mistral3), when the graph has one. */
  attnTemperature(q: Ptr): Ptr {
    const scale = this.inputs.attnScale
    return scale === undefined || scale === null ? q : this.g.ggml_mul(this.ctx, q, scale)
  }

  /**
   * Stores each sequence's K and V in its own cache, attends per sequence over the first nKv cells of that cache
   * (flash attention, causal F16 mask), projects all rows together with wo.
   * q: [headDimK, nHead, n], k: [headDimK, nHeadKv, n], v: [headDimV, nHeadKv, n] (contiguous, all sequences' rows).
   * Sliding-window blocks take each sequence's window mask. `kqScale`: the scale inside flash attention. `sinks`:
   * per-head attention sinks, F32 [nHead] (gpt-oss; ggml_flash_attn_ext_add_sinks), checked by the caller.
   */
  attention(
    q: Ptr,
    k: Ptr,
    v: Ptr,
    wo: Ptr,
    woBias: Ptr | null = null,
    kqScale = this.hp.kqScale,
    sinks: Ptr | null = null,
    gate: Ptr | null = null
  ): Ptr {
    const g = this.g
    const { headDimK, headDimV, nHeadKv } = this.heads
    const nHead = this.hp.nHead
    // same expansion order as llama.cpp: q, v, k, then the cache writes
    g.ggml_build_forward_expand(this.graph, q)
    g.ggml_build_forward_expand(this.graph, v)
    g.ggml_build_forward_expand(this.graph, k)
    const cur = this.perSequence(
      headDimV * nHead,
      [
        { x: q, ne0: headDimK, ne1: nHead },
        { x: k, ne0: headDimK, ne1: nHeadKv },
        { x: v, ne0: headDimV, ne1: nHeadKv }
      ],
      (seg, [qs, ks, vs]) => this.attendSegment(seg, qs!, ks!, vs!, kqScale, sinks),
      true
    )
    return this.linear(wo, this.outputGate(cur, gate), woBias)
  }

  /**
   * Runs `attend` over each sequence of the batch, its rows of `parts` in, its output rows [width, seg.n] out, and
   * returns all the output rows [width, n]. A lone sequence gets the tensors whole; several get views of their own
   * rows ([ne0, ne1, seg.n] of each part, in the parts' order), and each one's output is written in place into one
   * [width, n] buffer at its rows. With `shared`, that buffer is a graph leaf shared by all blocks of this width: block
   * l + 1 writes it only after reading block l's output, on which its own inputs depend, so the data dependencies
   * order the reuse (Toolkit.attention); else each call makes its own.
   */
  perSequence(
    width: number,
    parts: ReadonlyArray<SequenceRows>,
    attend: (seg: AttentionSegment, rows: ReadonlyArray<Ptr>) => Ptr,
    shared = false
  ): Ptr {
    const g = this.g
    const ctx = this.ctx
    const segments = this.inputs.segments
    const whole = parts.map((p) => p.x)
    if (segments.length === 1) return attend(segments[0]!, whole)
    const f32 = (ne: number) => g.ggml_row_size(GgmlType.F32, ne)
    let cur = shared ? this.attnRows.get(width) : undefined
    if (cur === undefined) {
      cur = g.ggml_new_tensor_2d(ctx, GgmlType.F32, width, this.nTokens)
      if (shared) this.attnRows.set(width, cur)
    }
    for (const seg of segments) {
      const rows = parts.map(({ ne0, ne1, x }) =>
        g.ggml_view_3d(ctx, x, ne0, ne1, seg.n, f32(ne0), f32(ne0 * ne1), seg.offset * f32(ne0 * ne1))
      )
      cur = g.ggml_set_rows(ctx, cur, attend(seg, rows), seg.rows!)
    }
    return cur
  }

  /** The attention output times sigmoid(gate) before wo (qwen35's gated attention; gate [headDimV * nHead, n]). */
  private outputGate(cur: Ptr, gate: Ptr | null): Ptr {
    return gate === null ? cur : this.g.ggml_mul(this.ctx, cur, this.g.ggml_sigmoid(this.ctx, gate))
  }

  /** One sequence: cache writes, flash attention over its cells; [headDimV * nHead, seg.n]. */
  private attendSegment(seg: AttentionSegment, q: Ptr, k: Ptr, v: Ptr, kqScale: number, sinks: Ptr | null): Ptr {
    const g = this.g
    const ctx = this.ctx
    const { headDimK, headDimV, nHeadKv } = this.heads
    const nHead = this.hp.nHead
    const cache = seg.kv(this.layer)
    // sliding-window blocks: the ring's cells, its own cell indices and mask (full blocks: cell = position)
    const ring = this.slidingWindow
    const kvIdx = ring ? seg.swaKvIdx : seg.kvIdx
    const nKv = ring ? seg.swaNKv : seg.nKv
    if (kvIdx === null) throw new Error(`block ${this.layer} is a sliding-window block but the graph has no ring cells`)
    const nEmbdK = headDimK * nHeadKv
    const nEmbdV = headDimV * nHeadKv
    const k2 = g.ggml_view_2d(ctx, k, nEmbdK, seg.n, g.ggml_row_size(GgmlType.F32, nEmbdK), 0)
    g.ggml_build_forward_expand(this.graph, g.ggml_set_rows(ctx, cache.k, k2, kvIdx))
    const v2 = g.ggml_view_2d(ctx, v, nEmbdV, seg.n, g.ggml_row_size(GgmlType.F32, nEmbdV), 0)
    g.ggml_build_forward_expand(this.graph, g.ggml_set_rows(ctx, cache.v, v2, kvIdx))

    const kView = g.ggml_view_3d(
      ctx,
      cache.k,
      headDimK,
      nHeadKv,
      nKv,
      g.ggml_row_size(GgmlType.F16, headDimK),
      g.ggml_row_size(GgmlType.F16, nEmbdK),
      0
    )
    const vView = g.ggml_view_3d(
      ctx,
      cache.v,
      headDimV,
      nHeadKv,
      nKv,
      g.ggml_row_size(GgmlType.F16, headDimV),
      g.ggml_row_size(GgmlType.F16, nEmbdV),
      0
    )
    const qp = g.ggml_permute(ctx, q, 0, 2, 1, 3)
    const kp = g.ggml_permute(ctx, kView, 0, 2, 1, 3)
    const vp = g.ggml_permute(ctx, vView, 0, 2, 1, 3)
    const mask = ring ? seg.swaMask : seg.mask
    if (mask === null) throw new Error(`block ${this.layer} is a sliding-window block but the graph has no window mask`)
    const fa = g.ggml_flash_attn_ext(ctx, qp, kp, vp, mask, kqScale, 0, 0)
    if (sinks !== null) g.ggml_flash_attn_ext_add_sinks(fa, sinks)
    g.ggml_flash_attn_ext_set_prec(fa, GGML_PREC_F32)
    return g.ggml_reshape_2d(ctx, fa, headDimV * nHead, seg.n)
  }

  /** On the model's last block of the last stage: keep only the output rows (llama.cpp's inp_out_ids). */
  outputRows(x: Ptr): Ptr {
    if (this.inputs.outIds === null || this.layer !== this.hp.nLayer - 1) return x
    return this.g.ggml_get_rows(this.ctx, x, this.inputs.outIds)
  }

  /** SwiGLU feed-forward (LLM_FFN_SILU, LLM_FFN_PAR): down(silu(gate x) * up x). */
  ffnSwiglu(x: Ptr, w: BlockWeights): Ptr {
    const up = this.linear(w.get("ffn_up.weight"), x, w.opt("ffn_up.bias"))
    const gate = this.linear(w.get("ffn_gate.weight"), x, w.opt("ffn_gate.bias"))
    const act = this.g.ggml_swiglu_split(this.ctx, gate, up)
    return this.linear(w.get("ffn_down.weight"), act, w.opt("ffn_down.bias"))
  }
}

/** The YaRN betas of a model's RoPE settings (kept by a block that rotates without YaRN: ggml reads them anyway). */
const betasOf = (ext: RopeExt | undefined) =>
  ext === undefined ? {} : { betaFast: ext.betaFast, betaSlow: ext.betaSlow }

/** Tensor specs shared by the llama family (short names, per block). */
export const llamaBlockSpecs = (
  hp: HParams,
  extra: ReadonlyArray<TensorSpec> = [],
  options: { readonly qkvBias?: boolean } = {}
): ReadonlyArray<TensorSpec> => {
  const qDim = hp.headDimK * hp.nHead
  const kDim = hp.headDimK * hp.nHeadKv
  const vDim = hp.headDimV * hp.nHeadKv
  const m = (name: string, dims: ReadonlyArray<number>): TensorSpec => ({ name, dims, kind: "matrix", required: true })
  const vec = (name: string, n: number, required = true): TensorSpec => ({ name, dims: [n], kind: "vector", required })
  const biasRequired = options.qkvBias ?? false
  return [
    vec("attn_norm.weight", hp.nEmbd),
    m("attn_q.weight", [hp.nEmbd, qDim]),
    m("attn_k.weight", [hp.nEmbd, kDim]),
    m("attn_v.weight", [hp.nEmbd, vDim]),
    vec("attn_q.bias", qDim, biasRequired),
    vec("attn_k.bias", kDim, biasRequired),
    vec("attn_v.bias", vDim, biasRequired),
    m("attn_output.weight", [hp.headDimV * hp.nHead, hp.nEmbd]),
    vec("attn_output.bias", hp.nEmbd, false),
    vec("ffn_norm.weight", hp.nEmbd),
    m("ffn_gate.weight", [hp.nEmbd, hp.nFf]),
    m("ffn_up.weight", [hp.nEmbd, hp.nFf]),
    m("ffn_down.weight", [hp.nFf, hp.nEmbd]),
    vec("ffn_gate.bias", hp.nFf, false),
    vec("ffn_up.bias", hp.nFf, false),
    vec("ffn_down.bias", hp.nEmbd, false),
    ...extra
  ]
}

/** The llama family's output head (llama.cpp's llm_build_llama and kin): RMS norm, then the output projection. */
export const llamaOutputHead = (
  t: Toolkit,
  w: { readonly get: (name: string) => Ptr; readonly opt: (name: string) => Ptr | null },
  x: Ptr
): Ptr => t.linear(w.get("output.weight"), t.rmsNorm(x, w.get("output_norm.weight")), w.opt("output.bias"))
