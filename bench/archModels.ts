/**
 * Synthetic models of the non-llama architectures for bench:engine's extra rows (issue 21): gemma3 (sliding-window
 * blocks, one global in six, GELU feed-forward, tied output) and qwen35 (three gated DeltaNet blocks to one gated
 * attention block), at a few hundred MB each so that a row takes under a minute at one thread. One file per
 * architecture and type under the bench directory, written once with a fixed seed and kept.
 */
import { existsSync, mkdirSync } from "node:fs"
import { join } from "node:path"
import { Effect } from "effect"
import { type SyntheticModelOptions, type SyntheticType, writeSyntheticModel } from "../src/layers/gguf/Synthetic.js"

export type BenchArch = "gemma3" | "qwen35"

export const benchArchs: ReadonlyArray<BenchArch> = ["gemma3", "qwen35"]

type Shape = Omit<SyntheticModelOptions, "path" | "type" | "seed" | "contextLength">

/**
 * gemma3: Gemma 3 1B's block (hidden 1152, 4 heads / 1 KV head of 256, FFN 6912, window 512, pattern 6) at 12 blocks;
 * qwen35: hidden 1024, 8 heads / 2 KV heads of 256 (Qwen3.5's head size: RoPE over 64 of it, sections [11, 11, 10]),
 * FFN 3584, DeltaNet heads of 128 (8 key, 16 value heads, kernel 4), 12 blocks (9 DeltaNet, 3 attention). Vocabulary
 * 32000 for both.
 */
const shapes: Record<BenchArch, Shape> = {
  gemma3: {
    arch: "gemma3",
    layers: 12,
    hidden: 1152,
    ffn: 6912,
    heads: 4,
    kvHeads: 1,
    headDim: 256,
    vocab: 32000,
    tiedOutput: true,
    slidingWindow: 512,
    swaPattern: 6
  },
  qwen35: {
    arch: "qwen35",
    layers: 12,
    hidden: 1024,
    ffn: 3584,
    heads: 8,
    kvHeads: 2,
    headDim: 256,
    vocab: 32000,
    tiedOutput: true,
    ssmStateSize: 128,
    ssmGroups: 8,
    ssmHeads: 16,
    ssmConvKernel: 4,
    fullAttentionInterval: 4
  }
}

export const benchArchShape = (arch: BenchArch): Shape => shapes[arch]

/** The model's path, written first when it is not there yet. */
export const ensureArchBenchModel = async (dir: string, arch: BenchArch, type: SyntheticType): Promise<string> => {
  const s = shapes[arch]
  const path = join(dir, `${arch}-${s.layers}x${s.hidden}-ffn${s.ffn}-v${s.vocab}-${type}.gguf`)
  if (existsSync(path)) return path
  mkdirSync(dir, { recursive: true })
  process.stdout.write(`writing ${path} (once; it is kept) ... `)
  const r = await Effect.runPromise(writeSyntheticModel({ ...s, path, type, seed: 1, contextLength: 4096 }))
  console.log(`${(r.bytes / 2 ** 20).toFixed(0)} MiB in ${r.seconds.toFixed(1)} s`)
  return path
}
