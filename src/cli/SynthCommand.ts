/**
 * `swactor synth`: writes a synthetic GGUF model (llama, qwen2 or qwen3, any shape, any of the supported storage types,
 * weights from a seeded generator) and prints what it wrote.
 */
import * as Command from "@effect/cli/Command"
import * as Options from "@effect/cli/Options"
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
import { withShownDefault } from "./Flags.js"

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

const int = (name: string, description: string) => Options.integer(name).pipe(Options.withDescription(description))

export const synthCommand = Command.make(
  "synth",
  {
    arch: Options.choice("arch", syntheticArchs).pipe(
      Options.withDescription("architecture"),
      withShownDefault("llama" as const)
    ),
    layers: int("layers", "transformer blocks"),
    hidden: int("hidden", "embedding length"),
    ffn: int("ffn", "feed-forward length"),
    heads: int("heads", "attention heads (default: hidden / 128 from 2048 up, else hidden / 64)").pipe(
      Options.optional
    ),
    kvHeads: int("kv-heads", "key/value heads, divides --heads (default: --heads)").pipe(Options.optional),
    headDim: int("head-dim", "per-head dimension (default hidden / heads)").pipe(Options.optional),
    vocab: int("vocab", "vocabulary size, at least 259").pipe(withShownDefault(32000)),
    contextLength: int("context-length", "context length").pipe(withShownDefault(2048)),
    type: Options.choice("type", syntheticTypes).pipe(
      Options.withDescription("storage type of the weight matrices: a ggml type, or a mixed recipe (q4_k_m, q3_k_m)"),
      withShownDefault("f32" as const)
    ),
    seed: int("seed", "generator seed").pipe(withShownDefault(1)),
    tiedOutput: Options.boolean("tied-output").pipe(
      Options.withDescription("no output.weight: the token embedding is the output head")
    ),
    ropeFreqBase: Options.float("rope-freq-base").pipe(
      Options.withDescription("RoPE base frequency"),
      Options.optional
    ),
    normEps: Options.float("norm-eps").pipe(Options.withDescription("RMS norm epsilon"), Options.optional),
    chatTemplate: Options.choice("chat-template", syntheticChatTemplates).pipe(
      Options.withDescription(
        "a chat template with its special tokens (chatml-tools: ChatML with tools, Hermes/Qwen style)"
      ),
      Options.optional
    ),
    slidingWindow: int(
      "sliding-window",
      "gemma3, gemma4, gpt-oss: sliding window of the local blocks (default 32; gpt-oss 16)"
    ).pipe(Options.optional),
    swaPattern: int(
      "swa-pattern",
      "gemma3, gemma4, gpt-oss: one global block every N blocks (default 6: 5 local, 1 global; gpt-oss 2)"
    ).pipe(Options.optional),
    logitSoftcap: Options.float("logit-softcap").pipe(
      Options.withDescription("gemma3, gemma4: final logit soft-capping (default: none)"),
      Options.optional
    ),
    kEqV: Options.boolean("k-eq-v").pipe(
      Options.withDescription("gemma4: global blocks without attn_v (V is K's projection, as Gemma 4 ships them)")
    ),
    perLayerEmbd: int(
      "per-layer-embd",
      "gemma4: per-layer embedding width, embedding_length_per_layer_input (E2B/E4B: 256; default 0: none)"
    ).pipe(Options.optional),
    sharedKvLayers: int(
      "shared-kv-layers",
      "gemma4: last blocks that read an earlier block's KV cache, attention.shared_kv_layers (default none)"
    ).pipe(Options.optional),
    swaHeadDim: int(
      "swa-head-dim",
      "gemma4: head size of the sliding-window blocks, key_length_swa (default the model's; 31B: half the global)"
    ).pipe(Options.optional),
    globalKvHeads: int(
      "global-kv-heads",
      "gemma4: KV heads of the global blocks, head_count_kv per block (default --kv-heads)"
    ).pipe(Options.optional),
    doubleWideSharedFfn: Options.boolean("double-wide-shared-ffn").pipe(
      Options.withDescription(
        "gemma4: the --shared-kv-layers blocks' feed-forward twice --ffn (E2B), feed_forward_length per block"
      )
    ),
    experts: int(
      "experts",
      "qwen3moe, qwen35moe, glm4moe, deepseek2, gpt-oss: experts per block (default 8); mistral3: its mixture-of-experts variant, every block routed"
    ).pipe(Options.optional),
    expertsUsed: int(
      "experts-used",
      "qwen3moe, qwen35moe, glm4moe, deepseek2, gpt-oss, mistral3: experts each token goes through, at most --experts (default 2)"
    ).pipe(Options.optional),
    expertFfn: int(
      "expert-ffn",
      "qwen3moe, qwen35moe, glm4moe, deepseek2, gpt-oss, mistral3: feed-forward length of one expert (default --ffn; mistral3 writes it as feed_forward_length, which sizes its experts)"
    ).pipe(Options.optional),
    sharedExperts: int(
      "shared-experts",
      "glm4moe, deepseek2: shared experts per routed block; qwen35moe: its shared expert's width in --expert-ffn units (default 1)"
    ).pipe(Options.optional),
    nextnLayers: int(
      "nextn-layers",
      "glm4moe, qwen35, qwen35moe: MTP blocks after the --layers trunk blocks, as GLM-4.5/4.6 and Qwen3.5/3.6 files carry them (default 0)"
    ).pipe(Options.optional),
    denseBlocks: int("dense-blocks", "glm4moe, deepseek2: leading blocks with a dense feed-forward (default 1)").pipe(
      Options.optional
    ),
    kvLoraRank: int("kv-lora-rank", "deepseek2: size of the cached latent, attention.kv_lora_rank (default 64)").pipe(
      Options.optional
    ),
    qLoraRank: int(
      "q-lora-rank",
      "deepseek2: Q's compressed size, attention.q_lora_rank; 0: one attn_q (default 64)"
    ).pipe(Options.optional),
    output: Options.text("output").pipe(Options.withAlias("o"), Options.withDescription("GGUF file to write"))
  },
  runSynthCommand
).pipe(Command.withDescription("Write a synthetic GGUF model of any shape with seeded weights"))
