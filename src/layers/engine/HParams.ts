/**
 * Hyperparameters of a llama-family model, read from GGUF metadata and checked before ggml sees any of them.
 */
import { Effect } from "effect"
import type { GgufFile, ModelLoadError } from "../../domain/gguf.js"
import {
  getArchitecture,
  getF32,
  getNumberArray,
  getOptional,
  getString,
  getStringArray,
  getU32
} from "../gguf/GgufReader.js"
import { invalidMetadata } from "./MetadataErrors.js"
import type { MoeParams } from "./MoeParams.js"
import type { RecurrentParams } from "./RecurrentParams.js"
import { type AttnTemp, type RopeExt, yarnRopeExt } from "./PositionScaling.js"

export const RopeMode = { NORM: 0, NEOX: 2 } as const

export interface HParams {
  readonly arch: string
  readonly nLayer: number
  readonly nEmbd: number
  readonly nFf: number
  readonly nHead: number
  readonly nHeadKv: number
  /** Per-head size of Q and K (`attention.key_length`, default nEmbd / nHead). */
  readonly headDimK: number
  /** Per-head size of V (`attention.value_length`, default headDimK). */
  readonly headDimV: number
  readonly nRot: number
  readonly nVocab: number
  readonly nCtxTrain: number
  readonly rmsEps: number
  readonly ropeMode: number
  readonly ropeFreqBase: number
  readonly ropeFreqScale: number
  /** n_ctx_orig passed to ggml_rope_ext. */
  readonly nCtxOrig: number
  readonly kqScale: number
  readonly eosTokenId: number
  readonly bosTokenId: number | undefined
  /** Sliding-window attention (gemma3), set by the architecture's own hyperparameters; absent: every block is global. */
  readonly swa?: SwaParams
  /** Final logit soft-capping (`final_logit_softcapping`, gemma): logits = cap * tanh(logits / cap); absent: none. */
  readonly logitSoftcap?: number
  /** Mixture-of-experts routing (set by an MoE architecture's own hyperparameters, Moe.ts); absent: dense. */
  readonly moe?: MoeParams
  /** YaRN's ggml_rope_ext settings (`rope.scaling.type` yarn, PositionScaling.ts); absent: plain RoPE. */
  readonly ropeExt?: RopeExt
  /** Attention temperature tuning (mistral3's `attention.temperature_scale`); absent: none. */
  readonly attnTemp?: AttnTemp
  /** Per-layer embeddings (gemma4 E2B/E4B, archs/gemma4PerLayer.ts): each block's input width; absent: none. */
  readonly perLayer?: PerLayerEmbd
  /** Blocks that read an earlier block's KV cache (gemma4 E2B/E4B `attention.shared_kv_layers`); absent: none. */
  readonly kvShare?: KvShare
  /**
   * Multi-head latent attention (deepseek2, archs/deepseek2.ts): the cache holds one K row per token (headDimK x
   * nHeadKv = the latent then the RoPE part) and V is a view of its first headDimV elements (no V cache); absent: none.
   */
  readonly mla?: MlaParams
  /**
   * DeepSeek sparse attention over the latent (deepseek32, glm-dsa; archs/dsa.ts): a lightning indexer per block scores
   * the cached positions, and attention reads only its top-k. Its keys have a cache of their own (the block's V row,
   * BlockMemory.ts); absent: dense attention.
   */
  readonly dsa?: DsaParams
  /**
   * DeepSeek-V4's hyper-connections, attention and routing (archs/deepseek4.ts): the residual stream is `hcMult`
   * streams of nEmbd (what crosses a stage boundary, PerLayerInputs.activationWidth); absent: none.
   */
  readonly dsv4?: Dsv4Params
  /** Gated DeltaNet blocks (qwen35, RecurrentParams.ts): a state per sequence in place of their KV cache; absent: none. */
  readonly recurrent?: RecurrentParams
  /**
   * Kimi K3's attention residuals, situ activation, KDA gate and latent experts (archs/kimiK3.ts): every
   * `resBlockSize`-th block banks its input, and what crosses a stage boundary is the residual stream plus every
   * checkpoint banked before it (PerLayerInputs.activationWidth); absent: none.
   */
  readonly kimi?: KimiParams
  /**
   * Per block of the model: its own head sizes, KV heads and RoPE width (gemma4 31B: sliding-window blocks 256-wide
   * heads, global ones 512-wide with fewer KV heads); absent: every block has the model-wide ones (`headsOf`).
   */
  readonly blockHeads?: ReadonlyArray<BlockHeads>
  /**
   * Per block of the model: its feed-forward width when `feed_forward_length` varies per block (gemma4 E2B's
   * double-wide MLP on the shared-KV blocks; llama.cpp's n_ff(il)); absent: every block has nFf (`ffOf`).
   */
  readonly blockFf?: ReadonlyArray<number>
}

/** Block `il`'s feed-forward width: its own (HParams.blockFf) or the model-wide one. */
export const ffOf = (hp: HParams, il: number): number => hp.blockFf?.[il] ?? hp.nFf

/** One block's attention shape: per-head Q/K and V sizes, KV heads, RoPE width (llama.cpp's n_embd_head_k(il) etc.). */
export interface BlockHeads {
  readonly headDimK: number
  readonly headDimV: number
  readonly nHeadKv: number
  readonly nRot: number
}

/** Block `il`'s attention shape: its own (HParams.blockHeads) or the model-wide one. */
export const headsOf = (hp: HParams, il: number): BlockHeads =>
  hp.blockHeads?.[il] ?? { headDimK: hp.headDimK, headDimV: hp.headDimV, nHeadKv: hp.nHeadKv, nRot: hp.nRot }

/** gemma4's per-layer embeddings: `embedding_length_per_layer_input` values per block and token. */
export interface PerLayerEmbd {
  readonly width: number
}

/**
 * gemma4's shared KV layers: blocks `from`..nLayer-1 keep no cache and attend over block `sources[il]`'s (llama.cpp's
 * n_layer_kv_from_start and its reuse callback); `sources[il] === il` for a block with its own cache.
 */
export interface KvShare {
  readonly from: number
  readonly sources: ReadonlyArray<number>
}

/** deepseek2's latent attention sizes (`attention.q_lora_rank`, `kv_lora_rank`, `key_length_mla`, `value_length_mla`). */
export interface MlaParams {
  /** 0: Q is one projection (attn_q), else attn_q_a -> norm -> attn_q_b. */
  readonly qLoraRank: number
  readonly kvLoraRank: number
  /** Per-head Q/K size after decompression (no-RoPE part + nRot). */
  readonly headDimK: number
  /** Per-head V size after decompression (attn_v_b's output). */
  readonly headDimV: number
}

/** The lightning indexer's sizes (`attention.indexer.head_count`, `key_length`, `top_k`) and its RoPE. */
export interface DsaParams {
  readonly nHead: number
  /** Per-head key size: the first nRot elements rotated, the rest not. A power of two >= 64 (its Hadamard rotation). */
  readonly headSize: number
  readonly topK: number
  /** ggml RoPE mode of the indexer's q and k (NEOX for deepseek32, NORM for glm-dsa). */
  readonly ropeMode: number
  /** LayerNorm epsilon of the indexer's k (llama.cpp's f_norm_eps: 1e-6 for deepseek32, 0 for glm-dsa). */
  readonly normEps: number
  /**
   * Per block of the model: true when the block has its own indexer (and indexer cache); false for a glm-dsa block that
   * reuses the top-k of the block before it that has one (`attention.indexer.types`).
   */
  readonly full: ReadonlyArray<boolean>
}

/** DeepSeek-V4's own sizes (`hyper_connection.*`, `attention.output_*`, `attention.compress_*`, `hash_layer_count`). */
export interface Dsv4Params {
  /** Streams of the residual stream (`hyper_connection.count`, 4). */
  readonly hcMult: number
  readonly sinkhornIters: number
  readonly hcEps: number
  readonly qLoraRank: number
  /** The attention output's groups and the rank of each group's LoRA (`attention.output_group_count`, `_lora_rank`). */
  readonly oGroups: number
  readonly oLoraRank: number
  /**
   * Per block: 0 (sliding window only), 4 (plus the compressed sparse attention of every 4 positions) or 128 (plus every
   * complete block of 128 positions compressed into one row).
   */
  readonly ratios: ReadonlyArray<number>
  readonly compressRopeBase: number
  /** Blocks 0..hashLayers-1 route each token to the experts its id names (`ffn_gate_tid2eid`). */
  readonly hashLayers: number
  /** Per block: the routed / shared experts' SwiGLU clamp (0: none). */
  readonly clampExp: ReadonlyArray<number>
  readonly clampShexp: ReadonlyArray<number>
  /** The lightning indexer of the compressed blocks. */
  readonly indexer: { readonly nHead: number; readonly headSize: number; readonly topK: number }
}

/** Kimi K3's own sizes (`attn_res.block_size`, `activation.situ_*`, `kda.*`, `expert_latent_length`). */
export interface KimiParams {
  /** Blocks il with il % resBlockSize === 0 bank their input (`attn_res.block_size`); 0: no attention residuals. */
  readonly resBlockSize: number
  readonly situBeta: number
  /** 0 or less: the up branch is not squashed. */
  readonly situLinearBeta: number
  /** `kda.gate_lower_bound`: the decay gate is lowerBound x sigmoid(...) when finite, else -exp(A_log) x softplus(...). */
  readonly gateLowerBound: number
  /** The routed experts' width (`expert_latent_length`, between ffn_routed_down and ffn_routed_up); nEmbd when absent. */
  readonly latent: number
}

/** Checkpoints Kimi K3's blocks before `layer` banked (blocks il < layer with il % resBlockSize === 0). */
export const checkpointsBefore = (hp: HParams, layer: number): number => {
  const size = hp.kimi?.resBlockSize ?? 0
  return size > 0 ? Math.ceil(Math.min(layer, hp.nLayer) / size) : 0
}

/** deepseek4's heavily compressed blocks compress this many positions into one row. */
export const HCA_RATIO = 128

/** Blocks of `ratio` positions (deepseek4's compressed blocks) a call over positions [start, used) completes. */
export const blocksEnded = (start: number, used: number, ratio: number): number =>
  Math.floor(used / ratio) - Math.floor(start / ratio)

/** Blocks that attend over a sliding window (llama.cpp's LLAMA_SWA_TYPE_STANDARD) and their own RoPE settings. */
export interface SwaParams {
  /** A position p attends to cells c with p - window < c <= p. */
  readonly window: number
  /** Per block of the model: true when it is a sliding-window block. */
  readonly layers: ReadonlyArray<boolean>
  readonly ropeFreqBase: number
  readonly ropeFreqScale: number
  /**
   * The window's cache is not capped: one cell per position as a full block's (deepseek4, whose blocks keep the
   * compressed rows of every position beside the window's); absent: a ring near the window.
   */
  readonly uncapped?: boolean
  /** The sliding blocks rotate without the model's YaRN (ext factor 0, attention factor 1: olmo2.cpp); absent: with it. */
  readonly plainRope?: boolean
}

const positive = (file: GgufFile, key: string, n: number) =>
  Number.isSafeInteger(n) && n > 0 ? Effect.succeed(n) : Effect.fail(invalidMetadata(file, key, `= ${n} must be > 0`))

/** A per-model integer that may also be stored as one value per layer (then all must be equal). */
const uniformInt = (file: GgufFile, key: string) =>
  Effect.gen(function* () {
    const v = file.metadata.get(key)
    if (Array.isArray(v)) {
      const arr = yield* getNumberArray(file, key)
      const first = arr[0]
      if (first === undefined || arr.some((x) => x !== first)) {
        return yield* Effect.fail(invalidMetadata(file, key, "varies per layer, which swactor does not support"))
      }
      return yield* positive(file, key, first)
    }
    return yield* positive(file, key, yield* getU32(file, key))
  })

/** One positive integer per block (`nLayer` of them). */
const perBlockInt = (file: GgufFile, key: string, nLayer: number) =>
  Effect.gen(function* () {
    const arr = yield* getNumberArray(file, key)
    if (arr.length !== nLayer) {
      return yield* Effect.fail(invalidMetadata(file, key, `has ${arr.length} entries for ${nLayer} blocks`))
    }
    for (const n of arr) yield* positive(file, key, n)
    return arr
  })

/** Per block KV heads where 0 marks a recurrent block (kimi-k3): the attention blocks' (one value), [1] when none. */
const attentionKvHeads = (file: GgufFile, key: string, nLayer: number) =>
  Effect.gen(function* () {
    const arr = yield* getNumberArray(file, key)
    if (arr.length !== nLayer) {
      return yield* Effect.fail(invalidMetadata(file, key, `has ${arr.length} entries for ${nLayer} blocks`))
    }
    if (arr.some((n) => !(Number.isSafeInteger(n) && n >= 0))) {
      return yield* Effect.fail(invalidMetadata(file, key, "must be integers >= 0 (0: a recurrent block)"))
    }
    const attention = arr.filter((n) => n > 0)
    if (attention.some((n) => n !== attention[0])) {
      return yield* Effect.fail(
        invalidMetadata(file, key, "varies between attention blocks, which swactor does not support")
      )
    }
    return [attention[0] ?? 1]
  })

type ReadOptions = {
  readonly ownHeadShape?: boolean
  readonly kvHeadsPerBlock?: boolean
  readonly ffPerBlock?: boolean
  readonly ffOptional?: boolean
  readonly recurrentKvZero?: boolean
}

/** An architecture's keys in `file`: `k("x")` is `<arch>.x`; `refuse` fails naming such a key. */
interface ArchKeys {
  readonly file: GgufFile
  readonly k: (s: string) => string
  readonly refuse: (key: string, message: string) => Effect.Effect<never, ModelLoadError>
}

const archKeys = (file: GgufFile, arch: string): ArchKeys => {
  const k = (s: string) => `${arch}.${s}`
  return { file, k, refuse: (key, message) => Effect.fail(invalidMetadata(file, k(key), message)) }
}

/** Blocks, widths and head counts (each block's KV heads dividing the heads). */
const readWidths = ({ file, k, refuse }: ArchKeys, options: ReadOptions) =>
  Effect.gen(function* () {
    const nLayer = yield* positive(file, k("block_count"), yield* getU32(file, k("block_count")))
    const nEmbd = yield* positive(file, k("embedding_length"), yield* getU32(file, k("embedding_length")))
    const ffs =
      options.ffOptional === true && !file.metadata.has(k("feed_forward_length"))
        ? [0]
        : options.ffPerBlock === true && Array.isArray(file.metadata.get(k("feed_forward_length")))
          ? yield* perBlockInt(file, k("feed_forward_length"), nLayer)
          : [yield* uniformInt(file, k("feed_forward_length"))]
    const nHead = yield* uniformInt(file, k("attention.head_count"))
    const kvHeads = !file.metadata.has(k("attention.head_count_kv"))
      ? [nHead]
      : options.recurrentKvZero === true && Array.isArray(file.metadata.get(k("attention.head_count_kv")))
        ? yield* attentionKvHeads(file, k("attention.head_count_kv"), nLayer)
        : options.kvHeadsPerBlock === true && Array.isArray(file.metadata.get(k("attention.head_count_kv")))
          ? yield* perBlockInt(file, k("attention.head_count_kv"), nLayer)
          : [yield* uniformInt(file, k("attention.head_count_kv"))]
    for (const n of kvHeads) {
      if (nHead % n !== 0) {
        return yield* refuse("attention.head_count", `= ${nHead} is not a multiple of head_count_kv = ${n}`)
      }
    }
    return { nLayer, nEmbd, ffs, nHead, nHeadKv: kvHeads[0]! }
  })

/** The head sizes of K and V and the rotated width of a head. */
const readHeadSizes = (arch: string, keys: ArchKeys, nEmbd: number, nHead: number, options: ReadOptions) =>
  Effect.gen(function* () {
    const { file, k, refuse } = keys
    const keyLength = yield* getOptional(file, k("attention.key_length"), getU32)
    if (keyLength === undefined && nEmbd % nHead !== 0) {
      return yield* refuse("embedding_length", `= ${nEmbd} is not a multiple of head_count = ${nHead}`)
    }
    const headDimK = yield* positive(file, k("attention.key_length"), keyLength ?? nEmbd / nHead)
    const headDimV = yield* positive(
      file,
      k("attention.value_length"),
      (yield* getOptional(file, k("attention.value_length"), getU32)) ?? headDimK
    )
    if (headDimV !== headDimK && options.ownHeadShape !== true) {
      return yield* refuse("attention.value_length", `= ${headDimV} != key_length = ${headDimK} is not supported`)
    }
    // Partial rotary (RoPE on the first nRot values of each head, the rest passed through) as llama.cpp's loader
    // allows it: any even width up to the head size, except for llama, whose loader requires the whole head.
    // GLM-4.5/4.6's converter writes half the head (partial_rotary_factor 0.5).
    const nRot = (yield* getOptional(file, k("rope.dimension_count"), getU32)) ?? headDimK
    if (options.ownHeadShape !== true) {
      if (arch === "llama" && nRot !== headDimK) {
        return yield* refuse("rope.dimension_count", `= ${nRot} must equal the head size ${headDimK} for ${arch}`)
      }
      if (nRot === 0 || nRot > headDimK || nRot % 2 !== 0) {
        return yield* refuse(
          "rope.dimension_count",
          `= ${nRot} must be even, > 0 and at most the head size ${headDimK}`
        )
      }
    }
    if (headDimK % 2 !== 0) return yield* refuse("attention.key_length", `= ${headDimK}: the head size must be even`)
    return { headDimK, headDimV, nRot }
  })

/** RoPE's frequency scale from `rope.scaling.type` (none, linear, yarn) and, for YaRN, its extension. */
const readRopeScaling = ({ file, k, refuse }: ArchKeys) =>
  Effect.gen(function* () {
    const scalingType = (yield* getOptional(file, k("rope.scaling.type"), getString)) ?? "none"
    let ropeFreqScale = 1
    let ropeExt: RopeExt | undefined
    if (scalingType === "yarn") {
      // llama_context: ext_factor 1 and the attention factor from the scaling factor; an architecture that reads
      // YaRN's own keys (mistral3) derives them again in its hparams hook
      const factor = (yield* getOptional(file, k("rope.scaling.factor"), getF32)) ?? 0
      if (!(factor > 0 && Number.isFinite(factor))) {
        return yield* refuse("rope.scaling.factor", `= ${factor} must be > 0 for YaRN`)
      }
      const ropeAttnFactor = (yield* getOptional(file, k("rope.scaling.attn_factor"), getF32)) ?? 1
      if (!(ropeAttnFactor > 0 && Number.isFinite(ropeAttnFactor))) {
        return yield* refuse("rope.scaling.attn_factor", `= ${ropeAttnFactor} must be > 0`)
      }
      ropeFreqScale = Math.fround(1 / factor)
      ropeExt = yarnRopeExt(ropeFreqScale, { logMul: 0, betaFast: 32, betaSlow: 1, ropeAttnFactor })
    } else if (scalingType === "linear") {
      const factor =
        (yield* getOptional(file, k("rope.scaling.factor"), getF32)) ??
        (yield* getOptional(file, k("rope.scale_linear"), getF32)) ??
        1
      if (!(factor > 0)) return yield* refuse("rope.scaling.factor", `= ${factor} must be > 0`)
      ropeFreqScale = 1 / factor
    } else if (scalingType !== "none") {
      return yield* refuse("rope.scaling.type", `= "${scalingType}" is not supported (supported: none, linear, yarn)`)
    } else {
      const linear = yield* getOptional(file, k("rope.scale_linear"), getF32)
      if (linear !== undefined && linear > 0) ropeFreqScale = 1 / linear
    }
    return { ropeFreqScale, ropeExt }
  })

/** The vocabulary size: the token list's, else `vocab_size`, else the embeddings' rows. */
const readVocabSize = ({ file, k }: ArchKeys) =>
  Effect.gen(function* () {
    let nVocab: number | undefined
    if (file.metadata.has("tokenizer.ggml.tokens")) {
      nVocab = (yield* getStringArray(file, "tokenizer.ggml.tokens")).length
    } else if (file.metadata.has(k("vocab_size"))) nVocab = yield* getU32(file, k("vocab_size"))
    const embd = file.tensorsByName.get("token_embd.weight")
    if (nVocab === undefined) nVocab = embd?.dims[1]
    if (nVocab === undefined || nVocab <= 0) {
      return yield* Effect.fail(
        invalidMetadata(file, "tokenizer.ggml.tokens", "is missing or empty, so the vocabulary size is unknown")
      )
    }
    return nVocab
  })

/**
 * Reads the llama-family hyperparameters. `ropeMode` comes from the architecture table, the vocabulary size
 * from the token list (checked against `token_embd` when the table has it).
 */
export const readHParams = (
  file: GgufFile,
  ropeMode: number,
  /**
   * ownHeadShape: the architecture checks the head sizes and the RoPE width itself (deepseek2's latent attention).
   * kvHeadsPerBlock: `attention.head_count_kv` may vary per block (each entry checked here, nHeadKv the first; the
   * architecture sets HParams.blockHeads, gemma4).
   * ffPerBlock: `feed_forward_length` may vary per block (each entry checked here, HParams.blockFf; nFf the first).
   * ffOptional: `feed_forward_length` may be absent (nFf 0: a model without dense feed-forwards, deepseek4).
   * recurrentKvZero: `attention.head_count_kv` per block with 0 on a recurrent block (kimi-k3, which reads the pattern
   * itself); nHeadKv is the attention blocks' value.
   */
  options: ReadOptions = {}
): Effect.Effect<HParams, ModelLoadError> =>
  Effect.gen(function* () {
    const arch = yield* getArchitecture(file)
    const keys = archKeys(file, arch)
    const { k, refuse } = keys
    const { nLayer, nEmbd, ffs, nHead, nHeadKv } = yield* readWidths(keys, options)
    const nFf = ffs[0]!
    const { headDimK, headDimV, nRot } = yield* readHeadSizes(arch, keys, nEmbd, nHead, options)
    const rmsEps = yield* getF32(file, k("attention.layer_norm_rms_epsilon"))
    if (!(rmsEps > 0 && rmsEps < 1)) {
      return yield* refuse("attention.layer_norm_rms_epsilon", `= ${rmsEps} is out of range`)
    }
    const nCtxTrain = yield* positive(file, k("context_length"), yield* getU32(file, k("context_length")))
    const ropeFreqBase = (yield* getOptional(file, k("rope.freq_base"), getF32)) ?? 10000
    if (!(ropeFreqBase > 0 && Number.isFinite(ropeFreqBase))) {
      return yield* refuse("rope.freq_base", `= ${ropeFreqBase} must be > 0`)
    }
    const { ropeFreqScale, ropeExt } = yield* readRopeScaling(keys)
    const nCtxOrig = (yield* getOptional(file, k("rope.scaling.original_context_length"), getU32)) ?? nCtxTrain
    const attnScale = (yield* getOptional(file, k("attention.scale"), getF32)) ?? 0
    const kqScale = attnScale === 0 ? 1 / Math.sqrt(headDimK) : attnScale
    const nVocab = yield* readVocabSize(keys)
    const eos = (yield* getOptional(file, "tokenizer.ggml.eos_token_id", getU32)) ?? -1
    const bos = yield* getOptional(file, "tokenizer.ggml.bos_token_id", getU32)
    return {
      arch,
      nLayer,
      nEmbd,
      nFf,
      nHead,
      nHeadKv,
      headDimK,
      headDimV,
      nRot,
      nVocab,
      nCtxTrain,
      rmsEps,
      ropeMode,
      ropeFreqBase,
      ropeFreqScale,
      nCtxOrig,
      kqScale,
      eosTokenId: eos >= nVocab ? -1 : eos,
      bosTokenId: bos !== undefined && bos < nVocab ? bos : undefined,
      ...(ropeExt === undefined ? {} : { ropeExt }),
      ...(ffs.some((n) => n !== nFf) ? { blockFf: ffs } : {})
    }
  })
