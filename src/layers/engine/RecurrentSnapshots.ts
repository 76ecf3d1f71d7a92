/**
 * Rolling back a recurrent block's state (qwen35's DeltaNet, Kimi K3's KDA) after a speculative step.
 *
 * A speculative step (StageInput.verify) of n rows advances a recurrent block's state through all n of its rows, but
 * the last stage may keep only the first m + 1 of them; the next step then starts at the position after row m, where
 * the state must be that of row m. A state cannot be computed backwards, so a verify step keeps every row's state: the
 * conv state after each row (a view of the convolution's input, copied per row) and the SSM state after each row
 * (ggml_gated_delta_net's snapshot slots, K = n: slot s is the state s tokens before the last). A step starting inside
 * the last verify step's rows first copies that row's states back (`restore`). Each row's arithmetic is the one-row
 * call's (the op runs the tokens in order; a snapshot is a copy), so a kept row's state is the decode's, bit for bit.
 *
 * The snapshots live beside the session's caches, allocated at its first verify step for that many rows (at least
 * MIN_ROWS) and grown when a step has more; a step that is not a verify step makes them stale.
 */
import type { Ptr } from "../ggml/Bindings.js"
import type { StateSnapshots, Toolkit } from "./Toolkit.js"

/**
 * In a verify step's graph: the conv state after each of its `n` rows into the snapshots. `convIn` is
 * [K - 1 + n, channels] (the state's K - 1 inputs, then the rows'); row i's state is its columns i + 1 .. i + K - 1.
 * `partOffset`: where this convolution's state starts within the block's conv state (elements; KDA keeps q, k and v's).
 */
export const snapshotConv = (
  t: Toolkit,
  snaps: StateSnapshots,
  convIn: Ptr,
  n: number,
  taps: number,
  channels: number,
  partOffset: number
): void => {
  const g = t.g
  const ctx = t.ctx
  const width = taps + n
  for (let i = 0; i < n; i++) {
    const src = g.ggml_view_2d(ctx, convIn, taps, channels, 4 * width, 4 * (i + 1))
    const dst = g.ggml_view_2d(ctx, snaps.conv, taps, channels, 4 * taps, 4 * (i * snaps.convElems + partOffset))
    g.ggml_build_forward_expand(t.graph, g.ggml_cpy(ctx, src, dst))
  }
}

/**
 * In a verify step's graph: ggml_gated_delta_net's `n` snapshot slots (its call with K = n; they follow the
 * `attnElems` attention outputs in `result`) into the snapshots.
 */
export const snapshotStates = (t: Toolkit, snaps: StateSnapshots, result: Ptr, attnElems: number, n: number): void => {
  const g = t.g
  const src = g.ggml_view_1d(t.ctx, result, n * snaps.ssmElems, 4 * attnElems)
  const dst = g.ggml_view_1d(t.ctx, snaps.ssm, n * snaps.ssmElems, 0)
  g.ggml_build_forward_expand(t.graph, g.ggml_cpy(t.ctx, src, dst))
}
