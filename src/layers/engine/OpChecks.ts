/**
 * The graph ops a stage builds, with ggml's own preconditions checked in TypeScript first.
 *
 * A failed GGML_ASSERT aborts the process. `checkedOps` returns the same functions as the raw bindings for every op
 * the engine builds (Toolkit.ts, GraphBuild.ts, archs/*.ts), each refusing, with an Error that names the op and the
 * shapes, what ggml would abort on (the asserts of the pinned ggml.c, op by op; for views, ggml_new_tensor_impl's
 * bounds assert). Shape predicates that ggml exports (`ggml_is_contiguous`, `ggml_can_repeat`, ...) are asked of ggml itself.
 */
import { type Ggml, type GgmlRaw, GgmlType, type Ptr } from "../ggml/Bindings.js"

/** A bad op: what ggml would have aborted the process on. */
export class GraphOpError extends Error {
  override readonly name = "GraphOpError"
}

interface Shape {
  readonly type: number
  readonly ne: ReadonlyArray<number>
  readonly nb: ReadonlyArray<number>
}

interface Predicates {
  readonly isContiguous: (t: Ptr) => boolean
  readonly isContiguous1: (t: Ptr) => boolean
  readonly isContiguousRows: (t: Ptr) => boolean
  readonly isTransposed: (t: Ptr) => boolean
  readonly isVector: (t: Ptr) => boolean
  readonly canRepeat: (t0: Ptr, t1: Ptr) => boolean
  readonly sameShape: (t0: Ptr, t1: Ptr) => boolean
}

/** ggml's own tensor predicates (the binding table's group of them). */
const predicates = (raw: GgmlRaw): Predicates => ({
  isContiguous: raw.ggml_is_contiguous,
  isContiguous1: raw.ggml_is_contiguous_1,
  isContiguousRows: raw.ggml_is_contiguous_rows,
  isTransposed: raw.ggml_is_transposed,
  isVector: raw.ggml_is_vector,
  canRepeat: raw.ggml_can_repeat,
  sameShape: raw.ggml_are_same_shape
})

const describe = (s: Shape) => `[${s.ne.join(", ")}] (type ${s.type})`

const checkedOf = new WeakMap<object, GgmlRaw>()

/** The op functions of the raw bindings, each checked first; every other binding as it is (made once per handle). */
export const checkedOps = (g: Ggml): GgmlRaw => {
  const known = checkedOf.get(g)
  if (known !== undefined) return known
  const made = makeChecked(g)
  checkedOf.set(g, made)
  return made
}

/** What every op's check asks: the raw bindings, ggml's predicates, a tensor's shape, and the refusal. */
interface Checking {
  readonly raw: GgmlRaw
  readonly is: Predicates
  readonly shape: (t: Ptr) => Shape
  readonly fail: (op: string, why: string, ...ts: ReadonlyArray<Ptr>) => never
}

const makeChecked = (g: Ggml): GgmlRaw => {
  const raw = g.raw
  const shape = (t: Ptr): Shape => g.tensorShape(t)
  const fail = (op: string, why: string, ...ts: ReadonlyArray<Ptr>): never => {
    throw new GraphOpError(`${op}: ${why} (operands ${ts.map((t) => describe(shape(t))).join(", ")})`)
  }
  const c: Checking = { raw, is: predicates(raw), shape, fail }
  return {
    ...raw,
    ...productChecks(c),
    ...viewChecks(c),
    ...attentionChecks(c),
    ...sparseAttentionChecks(raw, shape, fail),
    ...hyperConnectionChecks(c),
    ...activationChecks(c),
    ...recurrentChecks(c),
    ...layoutChecks(c)
  }
}

/** Products, element-wise ops and row gathers and scatters. */
const productChecks = ({
  raw,
  is,
  shape,
  fail
}: Checking): Pick<GgmlRaw, "ggml_mul_mat" | "ggml_add" | "ggml_mul" | "ggml_get_rows" | "ggml_set_rows"> => ({
  ggml_mul_mat: (ctx, a, b) => {
    const sa = shape(a)
    const sb = shape(b)
    if (sa.ne[0] !== sb.ne[0] || sb.ne[2]! % sa.ne[2]! !== 0 || sb.ne[3]! % sa.ne[3]! !== 0) {
      fail("ggml_mul_mat", "the inner dimensions differ or the batch does not broadcast", a, b)
    }
    if (is.isTransposed(a)) fail("ggml_mul_mat", "the weight is transposed", a)
    return raw.ggml_mul_mat(ctx, a, b)
  },
  ggml_add: (ctx, a, b) => {
    if (!is.canRepeat(b, a)) fail("ggml_add", "the second operand does not repeat to the first", a, b)
    return raw.ggml_add(ctx, a, b)
  },
  ggml_mul: (ctx, a, b) => {
    if (!is.canRepeat(b, a)) fail("ggml_mul", "the second operand does not repeat to the first", a, b)
    return raw.ggml_mul(ctx, a, b)
  },
  ggml_get_rows: (ctx, a, b) => {
    const sa = shape(a)
    const sb = shape(b)
    if (sb.type !== GgmlType.I32 || sa.ne[2] !== sb.ne[1] || sa.ne[3] !== sb.ne[2] || sb.ne[3] !== 1) {
      fail("ggml_get_rows", "the row ids are not I32 or do not match the source's planes", a, b)
    }
    return raw.ggml_get_rows(ctx, a, b)
  },
  ggml_set_rows: (ctx, a, b, c) => {
    const [sa, sb, sc] = [shape(a), shape(b), shape(c)]
    const ok =
      sa.ne[0] === sb.ne[0] &&
      sa.ne[2] === sb.ne[2] &&
      sa.ne[3] === sb.ne[3] &&
      sb.ne[1] === sc.ne[0] &&
      sb.ne[2]! % sc.ne[1]! === 0 &&
      sb.ne[3]! % sc.ne[2]! === 0 &&
      sc.ne[3] === 1 &&
      (sb.type === GgmlType.F32 || sb.type === GgmlType.F16) &&
      (sc.type === GgmlType.I64 || sc.type === GgmlType.I32)
    if (!ok) fail("ggml_set_rows", "the rows, their ids and the destination do not match", a, b, c)
    if (!is.isContiguousRows(a) || !is.isContiguousRows(b)) fail("ggml_set_rows", "rows are not contiguous", a, b)
    // every id must address a row of the destination: checked where the ids are written (Forward.ts)
    return raw.ggml_set_rows(ctx, a, b, c)
  }
})

/** Bytes from a view's first byte to past its last element, in the source's layout. */
const extent = (raw: GgmlRaw, type: number, ne: ReadonlyArray<number>, nb: ReadonlyArray<number>) => {
  let bytes = raw.ggml_row_size(type, ne[0]!)
  for (let i = 1; i < ne.length; i++) bytes += (ne[i]! - 1) * nb[i]!
  return bytes
}

/** A view within its source's bytes (ggml_new_tensor_impl's bounds assert). */
const checkView = (
  { raw, fail }: Checking,
  op: string,
  a: Ptr,
  type: number,
  ne: ReadonlyArray<number>,
  nb: ReadonlyArray<number>,
  offset: number
) => {
  if (ne.some((n) => !Number.isSafeInteger(n) || n < 1) || offset < 0) fail(op, `view of [${ne}] at ${offset}`, a)
  const end = offset + extent(raw, type, ne, nb)
  const size = raw.ggml_nbytes(a)
  if (end > size) fail(op, `the view [${ne}] at byte ${offset} ends at ${end}, past its source's ${size} bytes`, a)
}

/** A reshape of a contiguous source to as many elements. */
const checkReshape = ({ is, shape, fail }: Checking, op: string, a: Ptr, ne: ReadonlyArray<number>) => {
  if (!is.isContiguous(a)) fail(op, "the source is not contiguous", a)
  const want = ne.reduce((x, y) => x * y, 1)
  const have = shape(a).ne.reduce((x, y) => x * y, 1)
  if (want !== have) fail(op, `${have} elements cannot be reshaped to [${ne}]`, a)
}

/** Reshapes and views. */
const viewChecks = (
  c: Checking
): Pick<GgmlRaw, "ggml_reshape_2d" | "ggml_reshape_3d" | "ggml_view_1d" | "ggml_view_2d" | "ggml_view_3d"> => {
  const { raw, shape } = c
  return {
    ggml_reshape_2d: (ctx, a, ne0, ne1) => {
      checkReshape(c, "ggml_reshape_2d", a, [ne0, ne1])
      return raw.ggml_reshape_2d(ctx, a, ne0, ne1)
    },
    ggml_reshape_3d: (ctx, a, ne0, ne1, ne2) => {
      checkReshape(c, "ggml_reshape_3d", a, [ne0, ne1, ne2])
      return raw.ggml_reshape_3d(ctx, a, ne0, ne1, ne2)
    },
    ggml_view_1d: (ctx, a, ne0, offset) => {
      const s = shape(a)
      checkView(c, "ggml_view_1d", a, s.type, [ne0], [s.nb[0]!], offset)
      return raw.ggml_view_1d(ctx, a, ne0, offset)
    },
    ggml_view_2d: (ctx, a, ne0, ne1, nb1, offset) => {
      const s = shape(a)
      checkView(c, "ggml_view_2d", a, s.type, [ne0, ne1], [s.nb[0]!, nb1], offset)
      return raw.ggml_view_2d(ctx, a, ne0, ne1, nb1, offset)
    },
    ggml_view_3d: (ctx, a, ne0, ne1, ne2, nb1, nb2, offset) => {
      const s = shape(a)
      checkView(c, "ggml_view_3d", a, s.type, [ne0, ne1, ne2], [s.nb[0]!, nb1, nb2], offset)
      return raw.ggml_view_3d(ctx, a, ne0, ne1, ne2, nb1, nb2, offset)
    }
  }
}

/** RoPE and flash attention. */
const attentionChecks = ({
  raw,
  is,
  shape,
  fail
}: Checking): Pick<GgmlRaw, "ggml_rope_ext" | "ggml_flash_attn_ext"> => ({
  ggml_rope_ext: (ctx, a, b, c, nDims, mode, ...rest) => {
    const sa = shape(a)
    const sb = shape(b)
    if ((mode & 1) !== 0) fail("ggml_rope_ext", `mode ${mode} is not supported`, a)
    if (!is.isVector(b) || sb.type !== GgmlType.I32 || sa.ne[2] !== sb.ne[0]) {
      fail("ggml_rope_ext", "positions must be an I32 vector of one id per token", a, b)
    }
    if (c !== null) {
      const sc = shape(c)
      if (sc.type !== GgmlType.F32 || sc.ne[0]! < nDims / 2) fail("ggml_rope_ext", "bad frequency factors", a, c)
    }
    if (nDims > sa.ne[0]!) fail("ggml_rope_ext", `${nDims} rotated dims exceed the head size`, a)
    return raw.ggml_rope_ext(ctx, a, b, c, nDims, mode, ...rest)
  },
  ggml_flash_attn_ext: (ctx, q, k, v, mask, ...rest) => {
    const [sq, sk, sv] = [shape(q), shape(k), shape(v)]
    const kqOk = sk.ne[0] === sq.ne[0] && sq.ne[2]! % sk.ne[2]! === 0 && sq.ne[3]! % sk.ne[3]! === 0
    if (!kqOk || sq.ne[3] !== sk.ne[3] || sq.ne[3] !== sv.ne[3]) {
      fail("ggml_flash_attn_ext", "q, k and v do not match", q, k, v)
    }
    if (mask === null) fail("ggml_flash_attn_ext", "a mask is required", q)
    const sm = shape(mask)
    if (
      sm.type !== GgmlType.F16 ||
      !is.isContiguous(mask) ||
      sq.ne[2]! % sm.ne[2]! !== 0 ||
      sq.ne[3]! % sm.ne[3]! !== 0
    ) {
      fail("ggml_flash_attn_ext", "the mask must be contiguous F16 and broadcast over the heads", q, mask)
    }
    if (sm.ne[0] !== sk.ne[1] || sm.ne[1]! < sq.ne[1]!)
      fail("ggml_flash_attn_ext", "the mask does not cover q x kv", q, k, mask)
    return raw.ggml_flash_attn_ext(ctx, q, k, v, mask, ...rest)
  }
})

/** The gated linear units and tanh. */
const activationChecks = ({
  raw,
  is,
  shape,
  fail
}: Checking): Pick<GgmlRaw, "ggml_swiglu_split" | "ggml_geglu_split" | "ggml_tanh"> => ({
  ggml_swiglu_split: (ctx, a, b) => {
    if (!is.isContiguous1(a) || !is.isContiguous1(b) || !is.sameShape(a, b) || shape(a).type !== shape(b).type) {
      fail("ggml_swiglu_split", "gate and up must be contiguous, of one shape and type", a, b)
    }
    return raw.ggml_swiglu_split(ctx, a, b)
  },
  ggml_geglu_split: (ctx, a, b) => {
    if (!is.isContiguous1(a) || !is.isContiguous1(b) || !is.sameShape(a, b) || shape(a).type !== shape(b).type) {
      fail("ggml_geglu_split", "gate and up must be contiguous, of one shape and type", a, b)
    }
    return raw.ggml_geglu_split(ctx, a, b)
  },
  ggml_tanh: (ctx, a) => {
    if (!is.isContiguous1(a)) fail("ggml_tanh", "the operand is not contiguous", a)
    return raw.ggml_tanh(ctx, a)
  }
})

/** The recurrent blocks' ops (qwen35's DeltaNet, kimi-k3's KDA): the causal convolution and the gated delta net. */
const recurrentChecks = ({
  raw,
  is,
  shape,
  fail
}: Checking): Pick<GgmlRaw, "ggml_ssm_conv" | "ggml_gated_delta_net"> => ({
  ggml_ssm_conv: (ctx, sx, c) => {
    const [ss, sc] = [shape(sx), shape(c)]
    if (ss.ne[3] !== 1 || sc.ne[2] !== 1 || sc.ne[3] !== 1 || ss.ne[1] !== sc.ne[1] || ss.ne[0]! < sc.ne[0]! - 1) {
      fail("ggml_ssm_conv", "x must be [kernel - 1 + n, channels, seqs], the weights [kernel, channels]", sx, c)
    }
    return raw.ggml_ssm_conv(ctx, sx, c)
  },
  ggml_gated_delta_net: (ctx, q, k, v, g, beta, state, K) => {
    const all = [q, k, v, g, beta, state]
    if (!all.every((t) => shape(t).type === GgmlType.F32)) fail("ggml_gated_delta_net", "operands must be F32", ...all)
    if (![q, k, v].every(is.isContiguousRows) || ![g, beta, state].every(is.isContiguous)) {
      fail("ggml_gated_delta_net", "q, k, v need contiguous rows; the gate, beta and the state contiguous", ...all)
    }
    const [S, H, n, seqs] = shape(v).ne as [number, number, number, number]
    const same = (t: Ptr, ne: ReadonlyArray<number>) => ne.every((x, i) => shape(t).ne[i] === x)
    const [gate0, hk] = [shape(g).ne[0]!, shape(q).ne[1]!]
    const ok =
      (gate0 === 1 || gate0 === S) &&
      same(g, [gate0, H, n, seqs]) &&
      same(beta, [1, H, n, seqs]) &&
      same(state, [S, S, H, seqs]) &&
      same(q, [S, hk, n, seqs]) &&
      same(k, [S, hk, n, seqs]) &&
      hk > 0 &&
      H % hk === 0 &&
      Number.isSafeInteger(K) &&
      K >= 1
    if (!ok) {
      fail(
        "ggml_gated_delta_net",
        "v [S, H, n, seqs], q and k [S, H_k | H, n, seqs], the gate [1 or S, H, n, seqs], beta [1, H, n, seqs], the state [S, S, H, seqs]",
        ...all
      )
    }
    return raw.ggml_gated_delta_net(ctx, q, k, v, g, beta, state, K)
  }
})

/** Concatenation, 4-D reshapes and views, copies and 2-D conts (element counts, bounds). */
const layoutChecks = (
  c: Checking
): Pick<GgmlRaw, "ggml_concat" | "ggml_reshape_4d" | "ggml_view_4d" | "ggml_cpy" | "ggml_cont_2d"> => {
  const { raw, shape, fail } = c
  const count = (t: Ptr) => shape(t).ne.reduce((x, y) => x * y, 1)
  return {
    ggml_concat: (ctx, a, b, dim) => {
      const [sa, sb] = [shape(a), shape(b)]
      const ok =
        Number.isSafeInteger(dim) &&
        dim >= 0 &&
        dim < 4 &&
        sa.type === sb.type &&
        sa.ne.every((n, d) => d === dim || n === sb.ne[d])
      if (!ok) fail("ggml_concat", `operands must be of one type and match but along dim ${dim}`, a, b)
      return raw.ggml_concat(ctx, a, b, dim)
    },
    ggml_reshape_4d: (ctx, a, ne0, ne1, ne2, ne3) => {
      checkReshape(c, "ggml_reshape_4d", a, [ne0, ne1, ne2, ne3])
      return raw.ggml_reshape_4d(ctx, a, ne0, ne1, ne2, ne3)
    },
    ggml_view_4d: (ctx, a, ne0, ne1, ne2, ne3, nb1, nb2, nb3, offset) => {
      const s = shape(a)
      checkView(c, "ggml_view_4d", a, s.type, [ne0, ne1, ne2, ne3], [s.nb[0]!, nb1, nb2, nb3], offset)
      return raw.ggml_view_4d(ctx, a, ne0, ne1, ne2, ne3, nb1, nb2, nb3, offset)
    },
    ggml_cpy: (ctx, a, b) => {
      if (count(a) !== count(b)) fail("ggml_cpy", "source and destination hold different element counts", a, b)
      return raw.ggml_cpy(ctx, a, b)
    },
    ggml_cont_2d: (ctx, a, ne0, ne1) => {
      if (count(a) !== ne0 * ne1) fail("ggml_cont_2d", `${count(a)} elements cannot be laid out as [${ne0}, ${ne1}]`, a)
      return raw.ggml_cont_2d(ctx, a, ne0, ne1)
    }
  }
}

/** DSA's ops (archs/dsa.ts): the lightning indexer's operands, top-k within its rows. */
/** ggml's asserts of DeepSeek-V4's fused hyper-connection ops (all F32; llama.cpp's graph takes hc = 4). */
const hyperConnectionChecks = ({
  raw,
  shape,
  fail
}: Checking): Pick<GgmlRaw, "ggml_dsv4_hc_pre" | "ggml_dsv4_hc_comb" | "ggml_dsv4_hc_post"> => {
  const f32 = (...ts: ReadonlyArray<Ptr>) => ts.every((t) => shape(t).type === GgmlType.F32)
  const is = (t: Ptr, ne: ReadonlyArray<number>) => ne.every((n, i) => shape(t).ne[i] === n)
  return {
    ggml_dsv4_hc_pre: (ctx, x, weights) => {
      const [, hc, n, one] = shape(x).ne as [number, number, number, number]
      if (!f32(x, weights) || hc < 1 || one !== 1 || !is(weights, [hc, n, 1, 1]))
        fail("ggml_dsv4_hc_pre", "x must be F32 [n_embd, hc, n], the weights F32 [hc, n]", x, weights)
      return raw.ggml_dsv4_hc_pre(ctx, x, weights)
    },
    ggml_dsv4_hc_comb: (ctx, mixes, scale, base, eps, nIter) => {
      const sm = shape(mixes)
      const ok =
        f32(mixes, scale, base) &&
        Number.isSafeInteger(nIter) &&
        nIter > 0 &&
        sm.ne[0] === 24 &&
        sm.ne[2] === 1 &&
        sm.ne[3] === 1 &&
        shape(scale).ne[0]! >= 3 &&
        is(scale, [shape(scale).ne[0]!, 1, 1, 1]) &&
        is(base, [24, 1, 1, 1])
      if (!ok)
        fail(
          "ggml_dsv4_hc_comb",
          `mixes must be F32 [24, n] (hc 4), scale [>= 3], base [24], ${nIter} > 0 iterations`,
          mixes,
          scale,
          base
        )
      return raw.ggml_dsv4_hc_comb(ctx, mixes, scale, base, eps, nIter)
    },
    ggml_dsv4_hc_post: (ctx, x, residual, post, comb) => {
      const [nEmbd, n] = shape(x).ne as [number, number]
      const hc = shape(residual).ne[1]!
      const ok =
        f32(x, residual, post, comb) &&
        hc > 0 &&
        is(x, [nEmbd, n, 1, 1]) &&
        is(residual, [nEmbd, hc, n, 1]) &&
        is(post, [hc, n, 1, 1]) &&
        is(comb, [hc, hc, n, 1])
      if (!ok)
        fail(
          "ggml_dsv4_hc_post",
          "x [n_embd, n], residual [n_embd, hc, n], post [hc, n] and comb [hc, hc, n] must be F32 and match",
          x,
          residual,
          post,
          comb
        )
      return raw.ggml_dsv4_hc_post(ctx, x, residual, post, comb)
    }
  }
}

const sparseAttentionChecks = (
  raw: GgmlRaw,
  shape: (t: Ptr) => Shape,
  fail: (op: string, why: string, ...ts: ReadonlyArray<Ptr>) => never
): Pick<GgmlRaw, "ggml_lightning_indexer" | "ggml_top_k"> => ({
  ggml_lightning_indexer: (ctx, q, k, w, mask) => {
    const [sq, sk, sw, sm] = [shape(q), shape(k), shape(w), shape(mask)]
    const typesOk = sq.type === GgmlType.F32 && sw.type === GgmlType.F32 && sm.type === GgmlType.F16
    const shapesOk =
      sq.ne[0] === sk.ne[0] &&
      sk.ne[1] === 1 &&
      sm.ne[0] === sk.ne[2] &&
      sq.ne[1] === sw.ne[0] &&
      sq.ne[2] === sw.ne[1] &&
      sm.ne[1] === sq.ne[2] &&
      sw.ne[2] === 1 &&
      sm.ne[2] === 1 &&
      sq.ne[3] === sk.ne[3] &&
      sk.ne[3] === sw.ne[3] &&
      sw.ne[3]! % sm.ne[3]! === 0
    if (!typesOk || !shapesOk)
      fail("ggml_lightning_indexer", "q, k, the weights and the mask do not match", q, k, w, mask)
    const elementRows = [q, k, w, mask].every((t) => {
      const s = shape(t)
      return s.nb[0] === raw.ggml_row_size(s.type, 1)
    })
    if (!elementRows) fail("ggml_lightning_indexer", "an operand's elements are not adjacent", q, k, w, mask)
    return raw.ggml_lightning_indexer(ctx, q, k, w, mask)
  },
  ggml_top_k: (ctx, a, k) => {
    const sa = shape(a)
    if (sa.type !== GgmlType.F32 || !(Number.isSafeInteger(k) && k >= 1 && k <= sa.ne[0]!)) {
      fail("ggml_top_k", `top ${k} of rows of ${sa.ne[0]}`, a)
    }
    return raw.ggml_top_k(ctx, a, k)
  }
})
