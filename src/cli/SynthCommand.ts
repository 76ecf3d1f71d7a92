/**
 * `swactor synth`: writes a synthetic GGUF model (llama, qwen2 or qwen3, any shape, any of the supported storage types,
 * weights from a seeded generator) and prints what it wrote.
 */
import * as Command from "@effect/cli/Command"
import { Console, Effect, Option } from "effect"
import {
  type SyntheticArch,
  syntheticArchs,
  SyntheticModelError,
  type SyntheticModelOptions,
  type SyntheticModelSummary,
  type SyntheticType,
  syntheticTypes,
  validateSyntheticModel,
  writeSyntheticModel
} from "../layers/gguf/Synthetic.js"
import { type SyntheticChatTemplate, syntheticChatTemplates } from "../layers/gguf/SyntheticTemplates.js"
import * as Flag from "./FlagSpec.js"
import { commandDoc, optionsOf } from "./FlagSpec.js"

export interface SynthArgs {
  readonly arch: SyntheticArch
  readonly layers: number
  readonly hidden: number
  readonly ffn: number
  readonly heads: Option.Option<number>
  readonly kvHeads: Option.Option<number>
  readonly headDim: Option.Option<number>
  readonly vocab: number
  readonly contextLength: number
  readonly type: SyntheticType
  readonly seed: number
  readonly tiedOutput: boolean
  readonly ropeFreqBase: Option.Option<number>
  readonly normEps: Option.Option<number>
  readonly chatTemplate: Option.Option<SyntheticChatTemplate>
  readonly slidingWindow: Option.Option<number>
  readonly swaPattern: Option.Option<number>
  readonly logitSoftcap: Option.Option<number>
  readonly kEqV: boolean
  readonly perLayerEmbd: Option.Option<number>
  readonly sharedKvLayers: Option.Option<number>
  readonly swaHeadDim: Option.Option<number>
  readonly globalKvHeads: Option.Option<number>
  readonly doubleWideSharedFfn: boolean
  readonly experts: Option.Option<number>
  readonly expertsUsed: Option.Option<number>
  readonly expertFfn: Option.Option<number>
  readonly sharedExperts: Option.Option<number>
  readonly nextnLayers: Option.Option<number>
  readonly denseBlocks: Option.Option<number>
  readonly kvLoraRank: Option.Option<number>
  readonly qLoraRank: Option.Option<number>
  readonly output: string
}

/**
 * Attention heads when `--heads` is not given: a head dimension of 128 (the usual one from 2048 up), else 64, else
 * one head.
 */
export const defaultHeads = (hidden: number): number =>
  hidden >= 2048 && hidden % 128 === 0 ? hidden / 128 : hidden % 64 === 0 && hidden >= 64 ? hidden / 64 : 1

export const synthOptionsFromArgs = (args: SynthArgs): SyntheticModelOptions => {
  const heads = Option.getOrElse(args.heads, () => defaultHeads(args.hidden))
  return {
    path: args.output,
    arch: args.arch,
    layers: args.layers,
    hidden: args.hidden,
    ffn: args.ffn,
    heads,
    kvHeads: Option.getOrElse(args.kvHeads, () => heads),
    vocab: args.vocab,
    contextLength: args.contextLength,
    type: args.type,
    seed: args.seed,
    tiedOutput: args.tiedOutput,
    ...(Option.isSome(args.headDim) ? { headDim: args.headDim.value } : {}),
    ...(Option.isSome(args.ropeFreqBase) ? { ropeFreqBase: args.ropeFreqBase.value } : {}),
    ...(Option.isSome(args.normEps) ? { normEps: args.normEps.value } : {}),
    ...(Option.isSome(args.chatTemplate) ? { chatTemplate: args.chatTemplate.value } : {}),
    ...(Option.isSome(args.slidingWindow) ? { slidingWindow: args.slidingWindow.value } : {}),
    ...(Option.isSome(args.swaPattern) ? { swaPattern: args.swaPattern.value } : {}),
    ...(Option.isSome(args.logitSoftcap) ? { logitSoftcap: args.logitSoftcap.value } : {}),
    ...(args.kEqV ? { kEqV: true } : {}),
    ...(Option.isSome(args.perLayerEmbd) ? { perLayerEmbd: args.perLayerEmbd.value } : {}),
    ...(Option.isSome(args.sharedKvLayers) ? { sharedKvLayers: args.sharedKvLayers.value } : {}),
    ...(Option.isSome(args.swaHeadDim) ? { swaHeadDim: args.swaHeadDim.value } : {}),
    ...(Option.isSome(args.globalKvHeads) ? { globalKvHeads: args.globalKvHeads.value } : {}),
    ...(args.doubleWideSharedFfn ? { doubleWideSharedFfn: true } : {}),
    ...(Option.isSome(args.experts) ? { experts: args.experts.value } : {}),
    ...(Option.isSome(args.expertsUsed) ? { expertsUsed: args.expertsUsed.value } : {}),
    ...(Option.isSome(args.expertFfn) ? { expertFfn: args.expertFfn.value } : {}),
    ...(Option.isSome(args.sharedExperts) ? { sharedExperts: args.sharedExperts.value } : {}),
    ...(Option.isSome(args.nextnLayers) ? { nextnLayers: args.nextnLayers.value } : {}),
    ...(Option.isSome(args.denseBlocks) ? { denseBlocks: args.denseBlocks.value } : {}),
    ...(Option.isSome(args.kvLoraRank) ? { kvLoraRank: args.kvLoraRank.value } : {}),
    ...(Option.isSome(args.qLoraRank) ? { qLoraRank: args.qLoraRank.value } : {})
  }
}

/** Each option of the library that a flag sets, and that flag. */
const flagOfOption: { readonly [K in Exclude<keyof SynthArgs, "output">]: string } = {
  arch: "--arch",
  layers: "--layers",
  hidden: "--hidden",
  ffn: "--ffn",
  heads: "--heads",
  kvHeads: "--kv-heads",
  headDim: "--head-dim",
  vocab: "--vocab",
  contextLength: "--context-length",
  type: "--type",
  seed: "--seed",
  tiedOutput: "--tied-output",
  ropeFreqBase: "--rope-freq-base",
  normEps: "--norm-eps",
  chatTemplate: "--chat-template",
  slidingWindow: "--sliding-window",
  swaPattern: "--swa-pattern",
  logitSoftcap: "--logit-softcap",
  kEqV: "--k-eq-v",
  perLayerEmbd: "--per-layer-embd",
  sharedKvLayers: "--shared-kv-layers",
  swaHeadDim: "--swa-head-dim",
  globalKvHeads: "--global-kv-heads",
  doubleWideSharedFfn: "--double-wide-shared-ffn",
  experts: "--experts",
  expertsUsed: "--experts-used",
  expertFfn: "--expert-ffn",
  sharedExperts: "--shared-experts",
  nextnLayers: "--nextn-layers",
  denseBlocks: "--dense-blocks",
  kvLoraRank: "--kv-lora-rank",
  qLoraRank: "--q-lora-rank"
}

/** A refusal of the library (which names its options: `expertsUsed`) in this command's terms (`--experts-used`). */
const withFlagNames = (message: string): string =>
  message.replace(/(?<![\w.-])[a-z][A-Za-z]*(?![\w.])/g, (word) =>
    Object.hasOwn(flagOfOption, word) ? flagOfOption[word as keyof typeof flagOfOption] : word
  )

const mib = (bytes: number) => (bytes / (1024 * 1024)).toFixed(1)

/** What was written, in words. */
export const renderSynthSummary = (options: SyntheticModelOptions, s: SyntheticModelSummary): string => {
  const types = Object.entries(s.tensorTypes)
    .map(([t, n]) => `${t} ${n}`)
    .join(", ")
  const lines = [
    `wrote ${s.path}: ${options.arch}, ${options.layers} layers, hidden ${options.hidden}, ffn ${options.ffn}, ` +
      `heads ${options.heads}/${options.kvHeads}, vocab ${options.vocab}, ${options.type}, seed ${options.seed}`,
    `  ${s.bytes} bytes (${mib(s.bytes)} MiB), ${s.tensors} tensors (${types}), ${s.seconds.toFixed(2)} s`
  ]
  if (s.fallbacks.length > 0) {
    const shown = s.fallbacks.slice(0, 4).join(", ")
    lines.push(
      `  ${s.fallbacks.length} matrices stored as f16 (rows not a multiple of ${options.type}'s block size): ${shown}` +
        (s.fallbacks.length > 4 ? ", ..." : "")
    )
  }
  return lines.join("\n")
}

export const runSynthCommand = (args: SynthArgs) => {
  const options = synthOptionsFromArgs(args)
  // a shape the writer refuses is refused here first, in terms of the flags
  const invalid = validateSyntheticModel(options)
  const write =
    invalid === undefined
      ? writeSyntheticModel(options)
      : Effect.fail(new SyntheticModelError({ message: withFlagNames(invalid) }))
  return write.pipe(
    Effect.matchEffect({
      onSuccess: (summary) => Console.log(renderSynthSummary(options, summary)),
      onFailure: (error) => Effect.zipRight(Console.error(`swactor synth: ${error.message}`), Effect.fail(error))
    })
  )
}

const shape = "Shape"
const file = "File"
const sliding = "Sliding window (gemma3, gemma4, gpt-oss)"
const gemma = "Gemma (gemma3, gemma4)"
const moe = "Mixture of experts (qwen3moe, qwen35moe, glm4moe, deepseek2, gpt-oss, mistral3)"
const deepseek = "Latent attention and more (deepseek2, glm4moe, qwen35)"

const int = (name: string, group: string, text: string) => Flag.integer(name, { group, text })

/** The flags of `swactor synth`: what they parse into and what `--help` says of them. */
const synthFlags = {
  arch: Flag.choice("arch", syntheticArchs, { group: shape, value: "ARCH", text: "architecture" }).withDefault("llama"),
  layers: int("layers", shape, "transformer blocks"),
  hidden: int("hidden", shape, "embedding length"),
  ffn: int("ffn", shape, "feed-forward length"),
  heads: int("heads", shape, "attention heads").optional("hidden / 128 from 2048 up, else hidden / 64"),
  kvHeads: int("kv-heads", shape, "key/value heads, divides --heads").optional("--heads"),
  headDim: int("head-dim", shape, "per-head dimension").optional("hidden / heads"),
  vocab: int("vocab", shape, "vocabulary size, at least 259").withDefault(32000),
  contextLength: int("context-length", shape, "context length").withDefault(2048),
  tiedOutput: Flag.boolean("tied-output", {
    group: shape,
    text: "no output.weight: the token embedding is the output head"
  }),
  ropeFreqBase: Flag.float("rope-freq-base", { group: shape, text: "RoPE base frequency" }).optional(),
  normEps: Flag.float("norm-eps", { group: shape, text: "RMS norm epsilon" }).optional(),
  chatTemplate: Flag.choice("chat-template", syntheticChatTemplates, {
    group: shape,
    value: "NAME",
    text: "a chat template with its special tokens (chatml-tools: ChatML with tools, Hermes/Qwen style; minimax-m2: MiniMax-M2's own, XML calls and <think>; glm: GLM-4.7/GLM-5's own, <arg_key>/<arg_value> calls and <think>)"
  }).optional(),
  type: Flag.choice("type", syntheticTypes, {
    group: file,
    value: "TYPE",
    text: "storage type of the weight matrices: a ggml type or a mixed recipe"
  }).withDefault("f32"),
  seed: int("seed", file, "generator seed").withDefault(1),
  slidingWindow: int("sliding-window", sliding, "sliding window of the local blocks").optional("32; gpt-oss 16"),
  swaPattern: int("swa-pattern", sliding, "one global block every N blocks").optional(
    "6 (5 local, 1 global); gpt-oss 2"
  ),
  logitSoftcap: Flag.float("logit-softcap", { group: gemma, text: "final logit soft-capping" }).optional("none"),
  kEqV: Flag.boolean("k-eq-v", {
    group: gemma,
    text: "gemma4: global blocks without attn_v (V is K's projection, as Gemma 4 ships them)"
  }),
  perLayerEmbd: int(
    "per-layer-embd",
    gemma,
    "gemma4: per-layer embedding width, embedding_length_per_layer_input (E2B/E4B: 256; 0: none)"
  ).optional("0"),
  sharedKvLayers: int(
    "shared-kv-layers",
    gemma,
    "gemma4: last blocks that read an earlier block's KV cache, attention.shared_kv_layers"
  ).optional("none"),
  swaHeadDim: int(
    "swa-head-dim",
    gemma,
    "gemma4: head size of the sliding-window blocks, key_length_swa (31B: half the global)"
  ).optional("the model's"),
  globalKvHeads: int(
    "global-kv-heads",
    gemma,
    "gemma4: KV heads of the global blocks, head_count_kv per block"
  ).optional("--kv-heads"),
  doubleWideSharedFfn: Flag.boolean("double-wide-shared-ffn", {
    group: gemma,
    text: "gemma4: the --shared-kv-layers blocks' feed-forward twice --ffn (E2B), feed_forward_length per block"
  }),
  experts: int(
    "experts",
    moe,
    "experts per block; mistral3: its mixture-of-experts variant, every block routed"
  ).optional("8"),
  expertsUsed: int("experts-used", moe, "experts each token goes through, at most --experts").optional("2"),
  expertFfn: int(
    "expert-ffn",
    moe,
    "feed-forward length of one expert (mistral3 writes it as feed_forward_length, which sizes its experts)"
  ).optional("--ffn"),
  sharedExperts: int(
    "shared-experts",
    moe,
    "glm4moe, deepseek2: shared experts per routed block (at least 1); qwen35moe: its shared expert's width in --expert-ffn units"
  ).optional("1"),
  nextnLayers: int(
    "nextn-layers",
    deepseek,
    "glm4moe, qwen35, qwen35moe: MTP blocks after the --layers trunk blocks, as GLM-4.5/4.6 and Qwen3.5/3.6 carry them"
  ).optional("0"),
  denseBlocks: int("dense-blocks", deepseek, "glm4moe, deepseek2: leading blocks with a dense feed-forward").optional(
    "1"
  ),
  kvLoraRank: int("kv-lora-rank", deepseek, "deepseek2: size of the cached latent, attention.kv_lora_rank").optional(
    "64"
  ),
  qLoraRank: int(
    "q-lora-rank",
    deepseek,
    "deepseek2: Q's compressed size, attention.q_lora_rank; 0: one attn_q"
  ).optional("64"),
  output: Flag.text("output", { group: file, value: "PATH", text: "GGUF file to write" }).withAlias("o")
}

/** What `swactor synth --help` says. */
export const synthDoc = commandDoc(
  "synth",
  "Write a synthetic GGUF model of any shape with seeded weights",
  [shape, file, sliding, gemma, moe, deepseek],
  synthFlags,
  [
    {
      what: "a small llama in q8_0",
      command: "swactor synth --arch llama --layers 4 --hidden 256 --ffn 768 --vocab 512 --type q8_0 -o m.gguf"
    },
    {
      what: "the benchmarks' shape",
      command: "swactor synth --layers 16 --hidden 2048 --ffn 8192 --type q4_k_m -o bench.gguf"
    }
  ]
)

export const synthCommand = Command.make("synth", optionsOf(synthFlags), runSynthCommand).pipe(
  Command.withDescription(synthDoc.summary)
)
