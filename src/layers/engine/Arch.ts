import type { Effect } from "effect"
import type { GgufFile, ModelLoadError } from "../../domain/gguf.js"
import type { Ptr } from "../ggml/Bindings.js"
import type { HParams } from "./HParams.js"
import type { BlockWeights, TensorSpec, Toolkit } from "./Toolkit.js"

/** One architecture: its RoPE mode, the tensors of a block, and how a block is computed. */
export interface ArchModule {
  readonly name: string
  /** ggml RoPE mode (0 = NORM, 2 = NEOX). */
  readonly ropeMode: number
  /** Optional: the architecture checks head sizes and RoPE width itself (readHParams' ownHeadShape; deepseek2). */
  readonly ownHeadShape?: boolean
  /** Optional: `attention.head_count_kv` may vary per block (readHParams' kvHeadsPerBlock; gemma4 sets blockHeads). */
  readonly kvHeadsPerBlock?: boolean
  /** Optional: `attention.head_count_kv` per block with 0 marking a recurrent block (readHParams' recurrentKvZero; kimi-k3). */
  readonly recurrentKvZero?: boolean
  /** Optional: `feed_forward_length` may vary per block (readHParams' ffPerBlock, HParams.blockFf; gemma4 E2B). */
  readonly ffPerBlock?: boolean
  /** Optional: `feed_forward_length` may be absent (readHParams' ffOptional: every block routed, deepseek4). */
  readonly ffOptional?: boolean
  /** Optional: the architecture's own hyperparameters read (and checked) on top of the common ones. */
  readonly hparams?: (file: GgufFile, hp: HParams) => Effect.Effect<HParams, ModelLoadError>
  /** Optional: a factor the token embeddings are scaled by before the first block (gemma: sqrt(n_embd)). */
  readonly embedScale?: (hp: HParams) => number
  /** Tensors of block `il` (its index in the model), short names (`attn_q.weight`). */
  readonly blockTensors: (hp: HParams, il: number) => ReadonlyArray<TensorSpec>
  /** Optional model-wide tensors that blocks use (full names, e.g. `rope_freqs.weight`). */
  readonly sharedTensors?: (hp: HParams) => ReadonlyArray<TensorSpec>
  /** Optional model-wide tensors only the first stage loads (full names; gemma4's per-layer embedding tables). */
  readonly inputTensors?: (hp: HParams) => ReadonlyArray<TensorSpec>
  /**
   * Optional, first stage: per-layer inputs from the token ids and the scaled embeddings `x` (gemma4 E2B/E4B), F32
   * [perLayer.width x nLayer, nTokens], block il's values at row offset il x width (PerLayerInputs.ts).
   */
  readonly perLayerInputs?: (t: Toolkit, w: OutputWeights, tokens: Ptr, x: Ptr) => Ptr
  /** Optional tensors of the output head besides output_norm / output (full names, e.g. `output.bias`). */
  readonly outputTensors?: (hp: HParams) => ReadonlyArray<TensorSpec>
  /** One block: residual stream in, residual stream out (t.layer is the block's index in the model). */
  readonly buildBlock: (t: Toolkit, w: BlockWeights, x: Ptr) => Ptr
  /**
   * The output head on the last stage: the residual stream after the model's last block (its output rows only) in,
   * logits out. Model-wide tensors by full name (`output_norm.weight`, `output.weight`: token_embd when tied).
   */
  readonly buildOutput: (t: Toolkit, w: OutputWeights, x: Ptr) => Ptr
}

/** The output head's weights by full name. */
export interface OutputWeights {
  readonly get: (name: string) => Ptr
  readonly opt: (name: string) => Ptr | null
}
