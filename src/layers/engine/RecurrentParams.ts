/**
 * Gated DeltaNet sizes (qwen35, archs/qwen35.ts): which blocks are recurrent, and the per-sequence state each keeps
 * in place of a KV cache (llama.cpp's llama-memory-recurrent: a conv state and an SSM state per sequence, constant
 * size whatever the context).
 */
export interface RecurrentParams {
  /** Per block of the model: true for a DeltaNet (recurrent) block, false for a full-attention one. */
  readonly layers: ReadonlyArray<boolean>
  /** `ssm.conv_kernel` */
  readonly convKernel: number
  /** Channels of the causal convolution: q and k of kHeads, v of vHeads, each stateSize wide. */
  readonly convDim: number
  /** `ssm.state_size`: width of one key / value head */
  readonly stateSize: number
  /** `ssm.group_count` */
  readonly kHeads: number
  /** `ssm.time_step_rank` */
  readonly vHeads: number
}

/** F32 elements of a recurrent block's state per sequence: the last conv_kernel - 1 inputs, the S x S x Hv matrix. */
export const recurrentStateElems = (r: RecurrentParams): { readonly conv: number; readonly ssm: number } => ({
  conv: (r.convKernel - 1) * r.convDim,
  ssm: r.stateSize * r.stateSize * r.vHeads
})
