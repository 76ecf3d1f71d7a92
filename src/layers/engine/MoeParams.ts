/** Mixture-of-experts hyperparameters (types only: HParams.ts holds them, Moe.ts reads them and builds the graph). */

/**
 * llama.cpp's llama_expert_gating_func_type: the experts chosen by top-k over softmax(logits) or sigmoid(logits) and
 * weighted by those values, or (softmaxWeight, gpt-oss's SOFTMAX_WEIGHT) chosen over the raw logits and weighted by a
 * softmax over the k chosen logits; or (sqrtSoftplus, DeepSeek-V4's SQRT_SOFTPLUS) over sqrt(softplus(logits)).
 */
export type ExpertGating = "softmax" | "sigmoid" | "softmaxWeight" | "sqrtSoftplus"

export interface MoeParams {
  /** `<arch>.expert_count`: experts per routed block (the third dim of ffn_*_exps). */
  readonly nExpert: number
  /** `<arch>.expert_used_count`: experts each token goes through (top-k). */
  readonly nExpertUsed: number
  /** `<arch>.expert_feed_forward_length` (default feed_forward_length / expert_used_count). */
  readonly nFfExp: number
  readonly gating: ExpertGating
  /** Divide the k chosen weights by their sum. */
  readonly normWeights: boolean
  /** Multiply the weights by this (0 or 1: not at all). */
  readonly weightsScale: number
  /** Shared experts' feed-forward length (0: none). */
  readonly nFfShared: number
  /** The shared experts' output times sigmoid(ffn_gate_inp_shexp x), one gate value per token (qwen35moe). */
  readonly sharedGate: boolean
  /** Blocks 0..n-1 are dense (a plain SwiGLU feed-forward), the rest routed. */
  readonly nLeadingDense: number
  /**
   * Group-limited routing (`expert_group_count` > 1, DeepSeek V3's): the experts form this many groups of equal size,
   * each group scored by the sum of its two best selection scores; only the `nGroupUsed` best groups may be chosen.
   * 0 or 1: no groups.
   */
  readonly nExpertGroups: number
  readonly nGroupUsed: number
  /**
   * The routed blocks hold gate and up stacked in one tensor, `ffn_gate_up_exps` [n_embd, 2 x n_ff_exp, n_expert]
   * (gate rows first), as llama.cpp's converter writes with `--fuse-gate-up-exps`; false: ffn_gate_exps and
   * ffn_up_exps apart.
   */
  readonly fusedGateUp: boolean
}
