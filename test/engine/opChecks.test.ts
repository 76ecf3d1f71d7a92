/**
 * The graph ops are checked in TypeScript before ggml sees them (OpChecks.ts): each precondition that ggml would abort
 * the process on (or, for views, not check at all) is a GraphOpError naming the op, and the same op with good operands
 * builds. Every case here would kill the test process if it reached ggml unchecked.
 */
import { assert, describe, it } from "vitest"
import { getGgml, GgmlType, type Ptr } from "../../src/layers/ggml/Bindings.js"
import { checkedOps, GraphOpError } from "../../src/layers/engine/OpChecks.js"

const g = getGgml()
const op = checkedOps(g)
const raw = g.raw

const withCtx = (f: (ctx: Ptr) => void) => {
  const ctx = raw.ggml_init({ mem_size: raw.ggml_tensor_overhead() * 128, mem_buffer: null, no_alloc: true })
  try {
    f(ctx)
  } finally {
    raw.ggml_free(ctx)
  }
}

const refuses = (name: string, build: () => unknown) => {
  let error: unknown
  try {
    build()
  } catch (e) {
    error = e
  }
  assert.instanceOf(error, GraphOpError, `${name} was not refused`)
  assert.match((error as Error).message, new RegExp(`^${name}: `))
}

describe("graph ops: ggml's preconditions are checked before the call", () => {
  it("each bad op is a GraphOpError naming it; the same op with good operands builds", () =>
    withCtx((ctx) => {
      const f32 = (...ne: Array<number>) =>
        ne.length === 1
          ? raw.ggml_new_tensor_1d(ctx, GgmlType.F32, ne[0]!)
          : ne.length === 2
            ? raw.ggml_new_tensor_2d(ctx, GgmlType.F32, ne[0]!, ne[1]!)
            : raw.ggml_new_tensor_3d(ctx, GgmlType.F32, ne[0]!, ne[1]!, ne[2]!)
      const w = f32(64, 32)
      // mul_mat: inner dimensions
      refuses("ggml_mul_mat", () => op.ggml_mul_mat(ctx, w, f32(63, 4)))
      assert.isNotNull(op.ggml_mul_mat(ctx, w, f32(64, 4)))
      // add / mul: broadcast
      refuses("ggml_add", () => op.ggml_add(ctx, f32(64, 4), f32(48)))
      refuses("ggml_mul", () => op.ggml_mul(ctx, f32(64, 4), f32(64, 3)))
      assert.isNotNull(op.ggml_add(ctx, f32(64, 4), f32(64)))
      // reshape: element count, contiguity
      refuses("ggml_reshape_2d", () => op.ggml_reshape_2d(ctx, f32(64, 4), 64, 5))
      refuses("ggml_reshape_3d", () =>
        op.ggml_reshape_3d(ctx, raw.ggml_permute(ctx, f32(8, 4, 2), 1, 0, 2, 3), 4, 8, 2)
      )
      assert.isNotNull(op.ggml_reshape_3d(ctx, f32(64, 4), 8, 8, 4))
      // views past their source's end (ggml aborts in ggml_new_tensor_impl)
      refuses("ggml_view_1d", () => op.ggml_view_1d(ctx, f32(64), 16, 49 * 4))
      refuses("ggml_view_2d", () => op.ggml_view_2d(ctx, f32(64, 4), 64, 2, 256, 3 * 256))
      refuses("ggml_view_3d", () => op.ggml_view_3d(ctx, f32(8, 4, 2), 8, 4, 3, 32, 128, 0))
      assert.isNotNull(op.ggml_view_2d(ctx, f32(64, 4), 64, 2, 256, 2 * 256))
      // get_rows: I32 ids
      const ids64 = raw.ggml_new_tensor_1d(ctx, GgmlType.I64, 3)
      refuses("ggml_get_rows", () => op.ggml_get_rows(ctx, w, ids64))
      assert.isNotNull(op.ggml_get_rows(ctx, w, raw.ggml_new_tensor_1d(ctx, GgmlType.I32, 3)))
      // set_rows: as many ids as rows
      const cache = raw.ggml_new_tensor_2d(ctx, GgmlType.F16, 64, 256)
      refuses("ggml_set_rows", () =>
        op.ggml_set_rows(ctx, cache, f32(64, 3), raw.ggml_new_tensor_1d(ctx, GgmlType.I64, 2))
      )
      assert.isNotNull(op.ggml_set_rows(ctx, cache, f32(64, 3), ids64))
      // rope: one I32 position per token
      const pos = raw.ggml_new_tensor_1d(ctx, GgmlType.I32, 5)
      const rope = (x: Ptr, p: Ptr) => op.ggml_rope_ext(ctx, x, p, null, 16, 0, 512, 10000, 1, 0, 1, 32, 1)
      refuses("ggml_rope_ext", () => rope(f32(16, 4, 4), pos))
      assert.isNotNull(rope(f32(16, 4, 5), pos))
      // flash attention: an F16 mask over q x kv
      const q = f32(16, 5, 4)
      const k = raw.ggml_new_tensor_3d(ctx, GgmlType.F16, 16, 256, 2)
      const v = raw.ggml_new_tensor_3d(ctx, GgmlType.F16, 16, 256, 2)
      refuses("ggml_flash_attn_ext", () => op.ggml_flash_attn_ext(ctx, q, k, v, f32(256, 5), 0.25, 0, 0))
      refuses("ggml_flash_attn_ext", () =>
        op.ggml_flash_attn_ext(ctx, q, k, v, raw.ggml_new_tensor_2d(ctx, GgmlType.F16, 256, 4), 0.25, 0, 0)
      )
      assert.isNotNull(
        op.ggml_flash_attn_ext(ctx, q, k, v, raw.ggml_new_tensor_2d(ctx, GgmlType.F16, 256, 5), 0.25, 0, 0)
      )
      // swiglu: one shape
      refuses("ggml_swiglu_split", () => op.ggml_swiglu_split(ctx, f32(64, 4), f32(64, 3)))
      assert.isNotNull(op.ggml_swiglu_split(ctx, f32(64, 4), f32(64, 4)))
      // DeepSeek-V4's hyper-connections: 4 streams, 24 mixes, the shapes of each operand
      refuses("ggml_dsv4_hc_pre", () => op.ggml_dsv4_hc_pre(ctx, f32(16, 4, 3), f32(4, 2)))
      assert.isNotNull(op.ggml_dsv4_hc_pre(ctx, f32(16, 4, 3), f32(4, 3)))
      refuses("ggml_dsv4_hc_comb", () => op.ggml_dsv4_hc_comb(ctx, f32(15, 3), f32(3), f32(15), 1e-6, 20))
      refuses("ggml_dsv4_hc_comb", () => op.ggml_dsv4_hc_comb(ctx, f32(24, 3), f32(3), f32(24), 1e-6, 0))
      assert.isNotNull(op.ggml_dsv4_hc_comb(ctx, f32(24, 3), f32(3), f32(24), 1e-6, 20))
      refuses("ggml_dsv4_hc_post", () => op.ggml_dsv4_hc_post(ctx, f32(16, 3), f32(16, 4, 3), f32(4, 3), f32(4, 4, 2)))
      assert.isNotNull(op.ggml_dsv4_hc_post(ctx, f32(16, 3), f32(16, 4, 3), f32(4, 3), f32(4, 4, 3)))
    }))

  it("the recurrent blocks' ops (DeltaNet, KDA) and the layout ops: refused with bad shapes, built with good ones", () =>
    withCtx((ctx) => {
      const f32 = (...ne: Array<number>) =>
        raw.ggml_new_tensor_4d(ctx, GgmlType.F32, ne[0]!, ne[1] ?? 1, ne[2] ?? 1, ne[3] ?? 1)
      // ssm_conv: kernel - 1 + n columns over the weights' channels
      refuses("ggml_ssm_conv", () => op.ggml_ssm_conv(ctx, f32(5, 32, 1), f32(4, 16)))
      refuses("ggml_ssm_conv", () => op.ggml_ssm_conv(ctx, f32(2, 32, 1), f32(4, 32)))
      assert.isNotNull(op.ggml_ssm_conv(ctx, f32(5, 32, 1), f32(4, 32)))
      // gated delta net: KDA's vector gate [S, H, n, 1] or DeltaNet's scalar one [1, H, n, 1]; the state [S, S, H, 1]
      const [q, k, v, beta, state] = [f32(16, 4, 3), f32(16, 4, 3), f32(16, 4, 3), f32(1, 4, 3), f32(16, 16, 4)]
      refuses("ggml_gated_delta_net", () => op.ggml_gated_delta_net(ctx, q, k, v, f32(8, 4, 3), beta, state, 1))
      refuses("ggml_gated_delta_net", () =>
        op.ggml_gated_delta_net(ctx, q, k, v, f32(16, 4, 3), beta, f32(16, 16, 3), 1)
      )
      refuses("ggml_gated_delta_net", () =>
        op.ggml_gated_delta_net(ctx, f32(16, 3, 3), k, v, f32(1, 4, 3), beta, state, 1)
      )
      assert.isNotNull(op.ggml_gated_delta_net(ctx, q, k, v, f32(16, 4, 3), beta, state, 1))
      assert.isNotNull(op.ggml_gated_delta_net(ctx, q, k, v, f32(1, 4, 3), beta, state, 1))
      // concat: one type, equal but along the axis
      refuses("ggml_concat", () => op.ggml_concat(ctx, f32(64, 1, 3), f32(64, 2, 4), 1))
      refuses("ggml_concat", () =>
        op.ggml_concat(ctx, f32(64, 1, 3), raw.ggml_new_tensor_3d(ctx, GgmlType.F16, 64, 1, 3), 1)
      )
      assert.isNotNull(op.ggml_concat(ctx, f32(64, 1, 3), f32(64, 2, 3), 1))
      // 4-D reshapes and views, copies, 2-D conts
      refuses("ggml_reshape_4d", () => op.ggml_reshape_4d(ctx, f32(64, 4), 16, 4, 2, 3))
      assert.isNotNull(op.ggml_reshape_4d(ctx, f32(64, 4), 16, 4, 2, 2))
      refuses("ggml_view_4d", () => op.ggml_view_4d(ctx, f32(16, 4, 3), 16, 4, 4, 1, 64, 256, 768, 0))
      assert.isNotNull(op.ggml_view_4d(ctx, f32(16, 4, 3), 16, 4, 3, 1, 64, 256, 768, 0))
      refuses("ggml_cpy", () => op.ggml_cpy(ctx, f32(64, 3), f32(64, 4)))
      assert.isNotNull(op.ggml_cpy(ctx, f32(64, 3), f32(32, 6)))
      refuses("ggml_cont_2d", () => op.ggml_cont_2d(ctx, f32(16, 4, 3), 64, 4))
      assert.isNotNull(op.ggml_cont_2d(ctx, f32(16, 4, 3), 64, 3))
    }))
})
