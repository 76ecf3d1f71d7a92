/**
 * Synthetic GGUF models: any shape of the `syntheticArchs` architectures, weights from a seeded generator, tensor
 * names, shapes and metadata as llama.cpp's loader expects them, and a small SPM ("llama") vocabulary that
 * node-llama-cpp accepts. They make equivalence tests and benchmarks at real model shapes possible without downloads.
 * The metadata is written per architecture (Synthetic<Arch>.ts); the tensors are the ones the architecture's engine
 * module declares for that metadata (SyntheticTensors.ts).
 *
 * Weights: every tensor has its own generator seeded from (seed, tensor name), so the same seed and shape give the same
 * F32 values whatever the storage type; an F32 file and a Q8_0 file of one seed hold the same model up to rounding.
 * - projections (attn_q/k/v/output, ffn_gate/up/down, output): N(0, 1/sqrt(fan_in))
 * - token_embd: N(0, 0.02) (small beside the block outputs, so a tied output head does not just echo the input)
 * - norm weights: 1 + N(0, 0.1); qwen2 q/k/v biases: N(0, 0.02)
 *
 * Storage types (SyntheticTypes.ts): 1-D tensors (norms, biases) are always F32. 2-D matrices use the requested type
 * (every weight type ggml's CPU backend computes), or for a mixed recipe (q4_k_m, q3_k_m) the type llama.cpp's
 * quantizer would pick for that tensor, when their ne0 is a multiple of its block size (32 for q8_0/q4_0, 256 for
 * the k- and i-quants) and F16 otherwise (listed in `fallbacks`). Quantization runs through ggml's own
 * ggml_quantize_chunk (iq1_s / iq2_xxs / iq2_xs with an all-ones importance matrix); F16/BF16 are converted in
 * TypeScript with round-to-nearest-even.
 */
import { Data, Effect } from "effect"
import { GgmlType, ggmlTypeName } from "../../domain/ggmlTypes.js"
import { GgufValueType } from "../../domain/gguf.js"
import { toBf16Bytes, toF16Bytes } from "./Float16.js"
import { type GgufTensorSpec, type GgufTypedValue, GgufValues, writeGgufFile } from "./GgufWriter.js"
import { deepseek2Metadata, type SyntheticDeepseek2Options, validateDeepseek2Options } from "./SyntheticDeepseek2.js"
import { gptOssMetadata, gptOssTensorType, validateGptOssOptions } from "./SyntheticGptOss.js"
import { gemmaMetadata, validateGemmaOptions } from "./SyntheticGemma.js"
import {
  gemma4FfnValue,
  gemma4KvHeadsValue,
  gemma4Metadata,
  type SyntheticGemma4Options,
  validateGemma4Options
} from "./SyntheticGemma4.js"
import {
  mistral3Ffn,
  mistral3Metadata,
  type SyntheticMistral3Options,
  validateMistral3Options
} from "./SyntheticMistral3.js"
import {
  nextnMetadata,
  syntheticBlockCount,
  type SyntheticNextnOptions,
  validateNextnOptions
} from "./SyntheticNextn.js"
import {
  isQwen35Family,
  qwen35Metadata,
  type SyntheticQwen35Options,
  validateQwen35Options
} from "./SyntheticQwen35.js"
import { moeMetadata, moeTensorType, type SyntheticMoeOptions, validateMoeOptions } from "./SyntheticMoe.js"
import { type SyntheticChatTemplate, syntheticChatTemplates, syntheticTemplateSpec } from "./SyntheticTemplates.js"
import { plannedTensors } from "./SyntheticTensors.js"
import {
  quantizeRows,
  syntheticDefaultTypeId,
  syntheticFileType,
  syntheticStorageType,
  type SyntheticWeightType,
  syntheticWeightTypes
} from "./SyntheticTypes.js"

export type SyntheticArch =
  | "llama"
  | "qwen2"
  | "qwen3"
  | "gemma3"
  | "gemma4"
  | "qwen3moe"
  | "glm4moe"
  | "mistral3"
  | "gpt-oss"
  | "deepseek2"
  | "qwen35"
  | "qwen35moe"
export type SyntheticType = SyntheticWeightType

export const syntheticArchs: ReadonlyArray<SyntheticArch> = [
  "llama",
  "qwen2",
  "qwen3",
  "gemma3",
  "gemma4",
  "qwen3moe",
  "glm4moe",
  "mistral3",
  "gpt-oss",
  "deepseek2",
  "qwen35",
  "qwen35moe"
]
export const syntheticTypes: ReadonlyArray<SyntheticType> = syntheticWeightTypes

export interface SyntheticModelOptions
  extends
    SyntheticGemma4Options,
    SyntheticMoeOptions,
    SyntheticMistral3Options,
    SyntheticDeepseek2Options,
    SyntheticQwen35Options,
    SyntheticNextnOptions {
  readonly path: string
  readonly arch: SyntheticArch
  readonly layers: number
  readonly hidden: number
  readonly ffn: number
  readonly heads: number
  readonly kvHeads: number
  /** Per-head dimension; default hidden / heads. Written as attention.key_length / value_length when set or qwen3. */
  readonly headDim?: number
  /** At least 259 (3 specials + 256 byte tokens). */
  readonly vocab: number
  readonly contextLength: number
  readonly type: SyntheticType
  readonly seed: number
  /** No output.weight: llama.cpp reuses token_embd as the output head. Default false. */
  readonly tiedOutput?: boolean
  /** Default 10000 (llama) or 1000000 (qwen2, qwen3). */
  readonly ropeFreqBase?: number
  /** Default 1e-5 (llama) or 1e-6 (qwen2, qwen3). */
  readonly normEps?: number
  /**
   * A chat template written into `tokenizer.chat_template` (SyntheticTemplates.ts), its special tokens taking the
   * vocabulary's last places and its end-of-turn token the end-of-generation id. Default: none.
   */
  readonly chatTemplate?: SyntheticChatTemplate
}

export interface SyntheticModelSummary {
  readonly path: string
  readonly bytes: number
  readonly tensors: number
  /** Tensor count per ggml type name. */
  readonly tensorTypes: Readonly<Record<string, number>>
  /** 2-D tensors stored as F16 because their ne0 is not a multiple of the requested type's block size. */
  readonly fallbacks: ReadonlyArray<string>
  readonly seconds: number
}

export class SyntheticModelError extends Data.TaggedError("SyntheticModelError")<{
  readonly message: string
}> {}

// ---------------------------------------------------------------------------------------------------------------
// Seeded generator: sfc32 seeded by splitmix32 from (seed, name).

const splitmix32 = (state: number): (() => number) => {
  let s = state >>> 0
  return () => {
    s = (s + 0x9e3779b9) >>> 0
    let z = s
    z = Math.imul(z ^ (z >>> 16), 0x85ebca6b) >>> 0
    z = Math.imul(z ^ (z >>> 13), 0xc2b2ae35) >>> 0
    return (z ^ (z >>> 16)) >>> 0
  }
}

const fnv1a = (s: string, h0: number): number => {
  let h = h0 >>> 0
  for (let i = 0; i < s.length; i++) {
    h ^= s.charCodeAt(i)
    h = Math.imul(h, 0x01000193) >>> 0
  }
  return h
}

/** Uniform [0, 1) generator for one tensor. */
export const tensorRandom = (seed: number, name: string): (() => number) => {
  const sm = splitmix32(fnv1a(name, 0x811c9dc5 ^ Math.imul(seed | 0, 0x9e3779b1)))
  let a = sm()
  let b = sm()
  let c = sm()
  let d = sm()
  const next = (): number => {
    const t = (((a + b) | 0) + d) | 0
    d = (d + 1) | 0
    a = b ^ (b >>> 9)
    b = (c + (c << 3)) | 0
    c = (c << 21) | (c >>> 11)
    c = (c + t) | 0
    return (t >>> 0) / 4294967296
  }
  for (let i = 0; i < 12; i++) next()
  return next
}

/**
 * The endless stream of mean + std * N(0, 1) samples (Box-Muller pairs) of one named tensor; `fill` continues where the
 * previous call stopped, so a tensor generated in chunks equals the tensor generated at once.
 */
export const gaussianStream = (seed: number, name: string, mean: number, std: number) => {
  const rnd = tensorRandom(seed, name)
  let spare: number | undefined
  return {
    fill: (out: Float32Array): Float32Array => {
      const n = out.length
      let i = 0
      if (spare !== undefined && n > 0) {
        out[i++] = spare
        spare = undefined
      }
      for (; i + 1 < n; i += 2) {
        const r = Math.sqrt(-2 * Math.log(1 - rnd())) * std
        const th = 2 * Math.PI * rnd()
        out[i] = mean + r * Math.cos(th)
        out[i + 1] = mean + r * Math.sin(th)
      }
      if (i < n) {
        const r = Math.sqrt(-2 * Math.log(1 - rnd())) * std
        const th = 2 * Math.PI * rnd()
        out[i] = mean + r * Math.cos(th)
        spare = mean + r * Math.sin(th)
      }
      return out
    }
  }
}

/** `n` samples of mean + std * N(0, 1) for one named tensor (the start of its gaussianStream). */
export const syntheticValues = (seed: number, name: string, n: number, mean: number, std: number): Float32Array =>
  gaussianStream(seed, name, mean, std).fill(new Float32Array(n))

// ---------------------------------------------------------------------------------------------------------------
// Vocabulary

const WORDS = (
  "the a and to was he she it of in is that her his with for on they you said day one little time upon once there " +
  "big girl boy dog cat happy play saw had were very Lily Tom named loved friend park tree sun home mom went not " +
  "but so all be at as up do we my me can will out what see like ball red blue bird fun sad help look came new " +
  "toy run car box book water sky good nice wanted asked wanted smiled started together"
).split(" ")

const BIGRAMS = (
  "th he in er an re on at en nd ti es or te of ed is it al ar st to nt ng se ha as ou io le ve co me de hi ri ro " +
  "ic ne ea ra ce li ch ll be ma si om ur"
).split(" ")

const LETTERS = "abcdefghijklmnopqrstuvwxyz"

/** Vocabulary pieces after the 259 specials and byte tokens, `count` of them, unique. */
const vocabPieces = (count: number): Array<string> => {
  const out: Array<string> = []
  const seen = new Set<string>()
  const add = (p: string) => {
    if (out.length < count && !seen.has(p)) {
      seen.add(p)
      out.push(p)
    }
  }
  add("▁")
  for (const ch of LETTERS) add(ch)
  for (const ch of LETTERS) add(`▁${ch}`)
  for (const p of [".", ",", "!", "?", '"', "'", "'s", '▁"']) add(p)
  for (const w of WORDS) add(`▁${w}`)
  for (const b of BIGRAMS) add(b)
  for (const ch of LETTERS.toUpperCase()) add(`▁${ch}`)
  for (const ch of "0123456789") add(ch)
  outer: for (let len = 2; ; len++) {
    // "▁" + every word of `len` letters, in order, until enough.
    const idx = new Array<number>(len).fill(0)
    for (;;) {
      if (out.length >= count) break outer
      add("▁" + idx.map((i) => LETTERS[i]).join(""))
      let k = len - 1
      while (k >= 0 && idx[k] === LETTERS.length - 1) idx[k--] = 0
      if (k < 0) break
      idx[k] = idx[k]! + 1
    }
  }
  return out
}

/**
 * SPM tokenizer metadata: <unk>, <s>, </s>, <0x00>..<0xFF>, then pieces with descending scores; with a chat template,
 * its special tokens last (control, then user-defined) and its end-of-turn token as EOS.
 */
export const syntheticVocab = (
  vocab: number,
  chat?: SyntheticChatTemplate
): ReadonlyArray<readonly [string, GgufTypedValue]> => {
  const spec = chat === undefined ? undefined : syntheticTemplateSpec(chat)
  const specials =
    spec === undefined
      ? []
      : [...spec.control.map((t) => [t, 3] as const), ...spec.userDefined.map((t) => [t, 4] as const)]
  const tokens: Array<string> = ["<unk>", "<s>", "</s>"]
  const scores: Array<number> = [0, 0, 0]
  const types: Array<number> = [2, 3, 3]
  for (let b = 0; b < 256; b++) {
    tokens.push(`<0x${b.toString(16).toUpperCase().padStart(2, "0")}>`)
    scores.push(0)
    types.push(6)
  }
  vocabPieces(vocab - tokens.length - specials.length).forEach((p, i) => {
    tokens.push(p)
    scores.push(-i)
    types.push(1)
  })
  for (const [text, type] of specials) {
    tokens.push(text)
    scores.push(0)
    types.push(type)
  }
  return [
    ["tokenizer.ggml.model", GgufValues.string("llama")],
    ["tokenizer.ggml.tokens", GgufValues.array(GgufValueType.STRING, tokens)],
    ["tokenizer.ggml.scores", GgufValues.array(GgufValueType.FLOAT32, scores)],
    ["tokenizer.ggml.token_type", GgufValues.array(GgufValueType.INT32, types)],
    ["tokenizer.ggml.unknown_token_id", GgufValues.u32(0)],
    ["tokenizer.ggml.bos_token_id", GgufValues.u32(1)],
    ["tokenizer.ggml.eos_token_id", GgufValues.u32(spec === undefined ? 2 : tokens.indexOf(spec.endOfTurn))],
    ["tokenizer.ggml.add_bos_token", GgufValues.bool(true)],
    ["tokenizer.ggml.add_eos_token", GgufValues.bool(false)],
    ...(spec === undefined ? [] : [["tokenizer.chat_template", GgufValues.string(spec.template)] as const])
  ]
}

// ---------------------------------------------------------------------------------------------------------------
// Model layout

const positiveInt = (name: string, v: number | undefined): string | undefined =>
  v === undefined || (Number.isSafeInteger(v) && v > 0) ? undefined : `${name} must be a positive integer, got ${v}`

/** What is wrong with the options (a shape llama.cpp or this writer cannot honour), in one line; undefined: nothing. */
export const validateSyntheticModel = (o: SyntheticModelOptions): string | undefined => {
  if (!syntheticArchs.includes(o.arch)) return `arch must be one of ${syntheticArchs.join(", ")}, got ${o.arch}`
  if (!syntheticTypes.includes(o.type)) return `type must be one of ${syntheticTypes.join(", ")}, got ${o.type}`
  for (const [k, v] of [
    ["layers", o.layers],
    ["hidden", o.hidden],
    ["ffn", o.ffn],
    ["heads", o.heads],
    ["kvHeads", o.kvHeads],
    ["headDim", o.headDim],
    ["vocab", o.vocab],
    ["contextLength", o.contextLength]
  ] as const) {
    const e = positiveInt(k, v)
    if (e !== undefined) return e
  }
  if (o.vocab < 259) return `vocab must be at least 259 (3 specials + 256 byte tokens), got ${o.vocab}`
  if (o.chatTemplate !== undefined) {
    if (!syntheticChatTemplates.includes(o.chatTemplate)) {
      return `chat template must be one of ${syntheticChatTemplates.join(", ")}, got ${o.chatTemplate}`
    }
    const spec = syntheticTemplateSpec(o.chatTemplate)
    const least = 259 + spec.control.length + spec.userDefined.length
    if (o.vocab < least)
      return `vocab must be at least ${least} with --chat-template ${o.chatTemplate} (its special tokens), got ${o.vocab}`
  }
  if (o.heads % o.kvHeads !== 0) return `heads (${o.heads}) must be a multiple of kvHeads (${o.kvHeads})`
  if (o.headDim === undefined && o.hidden % o.heads !== 0) {
    return `hidden (${o.hidden}) must be a multiple of heads (${o.heads}) unless headDim is given`
  }
  const hd = o.headDim ?? o.hidden / o.heads
  if (hd % 2 !== 0) return `the head dimension ${hd} (headDim, or hidden / heads) must be even (RoPE rotates pairs)`
  // glm4moe rotates half of each head, as GLM-4.5/4.6's converter writes it (partial_rotary_factor 0.5)
  if (o.arch === "glm4moe" && hd % 4 !== 0) {
    return `glm4moe rotates half of each head: the head dimension ${hd} (headDim, or hidden / heads) must be a multiple of 4`
  }
  // llama.cpp's qwen2 sizes attn_q and attn_output by the embedding, whatever key_length says
  if (o.arch === "qwen2" && hd * o.heads !== o.hidden) {
    return `qwen2 attends over the whole embedding: headDim (${hd}) times heads (${o.heads}) must equal hidden (${o.hidden})`
  }
  if (!Number.isInteger(o.seed)) return `seed must be an integer, got ${o.seed}`
  if (o.ropeFreqBase !== undefined && !(o.ropeFreqBase > 0)) return `ropeFreqBase must be > 0`
  if (o.normEps !== undefined && !(o.normEps > 0)) return `normEps must be > 0`
  return (
    validateGemmaOptions(o) ??
    validateGemma4Options(o) ??
    validateMoeOptions(o) ??
    validateMistral3Options(o) ??
    validateDeepseek2Options(o) ??
    validateQwen35Options(o) ??
    validateGptOssOptions(o) ??
    validateNextnOptions(o)
  )
}

/**
 * The ggml type a tensor of this shape gets in a file of `type` (SyntheticTypes.ts; `name` and `model` matter to
 * mixed recipes such as q4_k_m only).
 */
export const syntheticTensorType = (
  type: SyntheticType,
  dims: ReadonlyArray<number>,
  name = "",
  model: { readonly layers: number; readonly tiedOutput: boolean; readonly experts?: number } = {
    layers: 1,
    tiedOutput: false
  }
): number => syntheticStorageType(type, name, dims, model)

const encode = (type: number, values: Float32Array, dims: ReadonlyArray<number>): Uint8Array => {
  switch (type) {
    case GgmlType.F32:
      return new Uint8Array(values.buffer, values.byteOffset, values.byteLength)
    case GgmlType.F16:
      return toF16Bytes(values)
    case GgmlType.BF16:
      return toBf16Bytes(values)
    default: {
      return quantizeRows(type, values, dims[0]!)
    }
  }
}

/** Rows are generated and encoded this many elements at a time (whole rows), so no tensor is held whole in memory. */
const DEFAULT_CHUNK_ELEMENTS = 1 << 22

function* chunks(
  type: number,
  stream: ReturnType<typeof gaussianStream>,
  n: number,
  ne0: number,
  chunkElements: number
): Generator<Uint8Array> {
  const rowsPerChunk = Math.max(1, Math.floor(chunkElements / ne0))
  for (let done = 0; done < n; done += rowsPerChunk * ne0) {
    const len = Math.min(rowsPerChunk * ne0, n - done)
    yield encode(type, stream.fill(new Float32Array(len)), [ne0])
  }
}

const metadataFor = (o: SyntheticModelOptions): Array<readonly [string, GgufTypedValue]> => {
  const a = o.arch
  const hd = o.headDim ?? o.hidden / o.heads
  const isQwen = a !== "llama"
  const md: Array<readonly [string, GgufTypedValue]> = [
    ["general.architecture", GgufValues.string(a)],
    ["general.name", GgufValues.string(`swactor synthetic ${a} ${o.layers}x${o.hidden} ${o.type} seed ${o.seed}`)],
    ["general.file_type", GgufValues.u32(syntheticFileType(o.type))],
    [`${a}.block_count`, GgufValues.u32(syntheticBlockCount(o))],
    [`${a}.context_length`, GgufValues.u32(o.contextLength)],
    [`${a}.embedding_length`, GgufValues.u32(o.hidden)],
    [`${a}.feed_forward_length`, a === "gemma4" ? gemma4FfnValue(o) : GgufValues.u32(mistral3Ffn(o))],
    [`${a}.attention.head_count`, GgufValues.u32(o.heads)],
    [`${a}.attention.head_count_kv`, a === "gemma4" ? gemma4KvHeadsValue(o) : GgufValues.u32(o.kvHeads)],
    [`${a}.attention.layer_norm_rms_epsilon`, GgufValues.f32(o.normEps ?? (isQwen ? 1e-6 : 1e-5))],
    [`${a}.rope.freq_base`, GgufValues.f32(o.ropeFreqBase ?? (isQwen ? 1_000_000 : 10_000))],
    // glm4moe: half the head, as GLM-4.5/4.6's converter writes it (partial_rotary_factor 0.5)
    [`${a}.rope.dimension_count`, GgufValues.u32(a === "glm4moe" ? hd / 2 : hd)]
  ]
  if (a === "gemma3") md.push(...gemmaMetadata(o))
  if (a === "gemma4") md.push(...gemma4Metadata(o, o.layers, hd))
  if (a === "mistral3") md.push(...mistral3Metadata(o, o.contextLength))
  if (a === "gpt-oss") md.push(...gptOssMetadata(o, o.contextLength))
  md.push(...moeMetadata(o), ...nextnMetadata(o))
  if (
    a === "qwen3" ||
    a === "qwen3moe" ||
    a === "gemma3" ||
    a === "gemma4" ||
    a === "gpt-oss" ||
    o.headDim !== undefined
  ) {
    md.push([`${a}.attention.key_length`, GgufValues.u32(hd)])
    md.push([`${a}.attention.value_length`, GgufValues.u32(hd)])
  }
  const own = a === "deepseek2" ? deepseek2Metadata(md, o) : isQwen35Family(a) ? qwen35Metadata(md, o) : md
  return [...own, ...syntheticVocab(o.vocab, o.chatTemplate)]
}

/** The tensor specs (lazy data) and metadata of a synthetic model, for callers that write it themselves. */
export const syntheticModelSpec = (
  o: SyntheticModelOptions,
  chunkElements = DEFAULT_CHUNK_ELEMENTS
): {
  readonly metadata: ReadonlyArray<readonly [string, GgufTypedValue]>
  readonly tensors: ReadonlyArray<GgufTensorSpec>
  readonly fallbacks: ReadonlyArray<string>
} => {
  const fallbacks: Array<string> = []
  const metadata = metadataFor(o)
  const tensors = plannedTensors(o, metadata).map((t): GgufTensorSpec => {
    const model = { layers: o.layers, tiedOutput: o.tiedOutput === true }
    // a vector (norms, biases, ssm_conv1d, gpt-oss's expert biases) is F32, as the engine requires of it
    const kept =
      (t.kind === "vector" ? GgmlType.F32 : undefined) ??
      moeTensorType(t.name) ??
      (o.arch === "gpt-oss" ? gptOssTensorType(o.type, t.name, t.dims, model) : undefined)
    const type =
      kept ??
      syntheticTensorType(o.type, t.dims, t.name, {
        layers: o.layers,
        tiedOutput: o.tiedOutput === true,
        // the recipes' expert rules are checked against llama.cpp's quantizer for these two (synth.moeRecipe)
        ...(o.arch === "qwen3moe" || o.arch === "glm4moe" ? { experts: o.experts ?? 8 } : {})
      })
    if (
      kept === undefined &&
      t.dims.length >= 2 &&
      type === GgmlType.F16 &&
      syntheticDefaultTypeId(o.type) !== GgmlType.F16
    ) {
      fallbacks.push(t.name)
    }
    const n = t.dims.reduce((x, y) => x * y, 1)
    return {
      name: t.name,
      type,
      dims: t.dims,
      data: () => chunks(type, gaussianStream(o.seed, t.name, t.mean, t.std), n, t.dims[0]!, chunkElements)
    }
  })
  return { metadata, tensors, fallbacks }
}

/** Writes a synthetic model file. */
export const writeSyntheticModel = (
  options: SyntheticModelOptions
): Effect.Effect<SyntheticModelSummary, SyntheticModelError> =>
  Effect.gen(function* () {
    const invalid = validateSyntheticModel(options)
    if (invalid !== undefined) return yield* Effect.fail(new SyntheticModelError({ message: invalid }))
    const started = performance.now()
    const spec = syntheticModelSpec(options)
    const written = yield* writeGgufFile(options.path, { metadata: spec.metadata, tensors: spec.tensors }).pipe(
      Effect.mapError((e) => new SyntheticModelError({ message: `writing ${e.path}: ${e.message}` }))
    )
    const tensorTypes: Record<string, number> = {}
    for (const t of spec.tensors) {
      const n = ggmlTypeName(t.type)
      tensorTypes[n] = (tensorTypes[n] ?? 0) + 1
    }
    return {
      path: written.path,
      bytes: written.bytes,
      tensors: written.tensors,
      tensorTypes,
      fallbacks: spec.fallbacks,
      seconds: (performance.now() - started) / 1000
    }
  }).pipe(Effect.withSpan("Synthetic.writeSyntheticModel", { attributes: { path: options.path } }))
