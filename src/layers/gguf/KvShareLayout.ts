/**
 * The catalog's view of shared KV layers (gemma4 E2B/E4B `attention.shared_kv_layers`, services/KvShare.ts): which
 * block's cache each block reads (ModelLayout.kvSources, so placement never cuts between them) and no KV bytes for the
 * blocks that keep none. A value the engine would refuse is left out here (the stage load names the key).
 */
import type { GgufFile } from "../../domain/gguf.js"
import type { ModelLayout } from "../../domain/plan.js"
import { kvShareSources } from "../../services/KvShare.js"

/**
 * gemma4 E2B/E4B's per-layer tables (`per_layer_token_embd`, `per_layer_model_proj`, `per_layer_proj_norm`): the first
 * stage's, counted with its input embedding (ModelLayout.inputBytes).
 */
export const withPerLayerTables = (layout: ModelLayout, file: GgufFile): ModelLayout => {
  const tables = file.tensors.filter((t) => t.name.startsWith("per_layer_")).reduce((s, t) => s + t.byteSize, 0)
  return tables === 0 ? layout : { ...layout, inputBytes: layout.inputBytes + tables }
}

export const withKvShare = (layout: ModelLayout, file: GgufFile, arch: string, numLayers: number): ModelLayout => {
  const raw = file.metadata.get(`${arch}.attention.shared_kv_layers`)
  const shared = typeof raw === "bigint" ? Number(raw) : raw
  if (typeof shared !== "number" || !Number.isSafeInteger(shared) || shared <= 0 || numLayers - shared < 2)
    return layout
  const kvSources = kvShareSources(numLayers, shared, layout.slidingWindow?.blocks ?? [])
  return {
    ...layout,
    kvBytesPerToken: layout.kvBytesPerToken.map((b, i) => (kvSources[i] === i ? b : 0)),
    kvSources
  }
}
