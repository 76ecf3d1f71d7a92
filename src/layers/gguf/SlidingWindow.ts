/**
 * Which blocks of a model attend over a sliding window, from its GGUF metadata alone (no weights): what the model
 * catalog's layout (placement, --dry-run) and the server's admission need to size capped sliding-window KV caches
 * (services/KvSize.ts swaCacheSize). The engine reads the same keys in its architecture modules (archs/gemma3.ts, archs/gptOss.ts).
 */
import type { GgufFile } from "../../domain/gguf.js"
import { swaLayerPattern } from "../engine/archs/gemma3.js"
import { gemma4SwaPattern } from "../engine/archs/gemma4.js"

/** A model's sliding window and, per block, whether that block slides (its cache is capped) or is global. */
export interface SlidingWindowLayout {
  readonly window: number
  readonly blocks: ReadonlyArray<boolean>
}

const positiveInteger = (v: unknown): number | undefined =>
  typeof v === "number" && Number.isSafeInteger(v) && v > 0
    ? v
    : typeof v === "bigint" && v > 0n
      ? Number(v)
      : undefined

/**
 * gemma4's `attention.sliding_window` and its `attention.sliding_window_pattern`, one bool per block (archs/gemma4.ts
 * reads them the same way); undefined when either is missing or malformed (the stage load then names the key).
 */
const gemma4Layout = (file: GgufFile, numLayers: number): SlidingWindowLayout | undefined => {
  const window = positiveInteger(file.metadata.get("gemma4.attention.sliding_window"))
  const blocks = gemma4SwaPattern(file.metadata.get("gemma4.attention.sliding_window_pattern"), numLayers)
  return window === undefined || typeof blocks === "string" ? undefined : { window, blocks }
}

/**
 * The sliding-window architectures and their default `attention.sliding_window_pattern` (llama.cpp's
 * set_swa_pattern period when the key is absent): gemma3 one global block in six (src/models/gemma3.cpp), gpt-oss
 * every other block (src/models/openai-moe.cpp: blocks 0, 2, 4, ... slide). mistral3 has no sliding window in llama.cpp.
 */
const defaultPeriods: ReadonlyMap<string, number> = new Map([
  ["gemma3", 6],
  ["gpt-oss", 2]
])

/**
 * `<arch>.attention.sliding_window` and `<arch>.attention.sliding_window_pattern` of a sliding-window architecture
 * (default period per architecture above; 0: every block slides); undefined for other architectures, without the
 * window key, or with a value the engine would refuse (it then names the key when the stage loads).
 */
export const slidingWindowOf = (file: GgufFile, arch: string, numLayers: number): SlidingWindowLayout | undefined => {
  if (arch === "gemma4") return gemma4Layout(file, numLayers)
  const defaultPeriod = defaultPeriods.get(arch)
  if (defaultPeriod === undefined) return undefined
  const value = (key: string) => file.metadata.get(`${arch}.${key}`)
  const window = positiveInteger(value("attention.sliding_window"))
  if (window === undefined) return undefined
  const rawPeriod = value("attention.sliding_window_pattern")
  const period =
    rawPeriod === undefined ? defaultPeriod : rawPeriod === 0 || rawPeriod === 0n ? 0 : positiveInteger(rawPeriod)
  if (period === undefined) return undefined
  return { window, blocks: swaLayerPattern(numLayers, period) }
}
