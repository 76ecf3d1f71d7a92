/**
 * Shared KV layers (gemma4 E2B/E4B `attention.shared_kv_layers`): the last `shared` blocks keep no KV cache and attend
 * over an earlier block's (llama.cpp llama-model.cpp: block il >= from = nLayer - shared reads block from - 2 when it
 * slides, from - 1 when it is global). A block and the block whose cache it reads must be on one stage, so a stage
 * boundary may not fall between them. Pure: the engine (archs/gemma4PerLayer.ts, StageLayout), the catalog's layout
 * and placement (Placement.ts) share it.
 */

/** Per block, the block whose KV cache it reads (itself when it keeps its own), after llama.cpp's reuse rule. */
export const kvShareSources = (
  nLayer: number,
  shared: number,
  slides: ReadonlyArray<boolean>
): ReadonlyArray<number> => {
  const from = nLayer - shared
  return Array.from({ length: nLayer }, (_, il) => (il < from ? il : from - (slides[il] === true ? 2 : 1)))
}

/** May a stage boundary fall before block `cut` (no block at or after it reads a cache before it)? */
export const cutAllowed = (sources: ReadonlyArray<number> | undefined, cut: number): boolean => {
  if (sources === undefined) return true
  for (let il = cut; il < sources.length; il++) if (sources[il]! < cut) return false
  return true
}

/** Why blocks [start, end) cannot be one stage (a block of it reads a cache before `start`), or undefined. */
export const kvShareRangeProblem = (
  sources: ReadonlyArray<number> | undefined,
  start: number,
  end: number
): string | undefined => {
  if (sources === undefined) return undefined
  for (let il = start; il < end; il++) {
    const source = sources[il]!
    if (source < start) {
      return `block ${il} reads block ${source}'s KV cache (shared KV layers), so blocks ${source}..${il} must be on one stage`
    }
  }
  return undefined
}

/** A layout's links between blocks that must share a stage (ModelLayout.kvSources and topKSources). */
export interface StageLinks {
  readonly kvSources?: ReadonlyArray<number> | undefined
  readonly topKSources?: ReadonlyArray<number> | undefined
  readonly tokenSources?: ReadonlyArray<number> | undefined
}

/**
 * Per block, the earliest block it must share a stage with: the block whose KV cache it reads (kvSources), the block
 * whose indexer top-k it reuses (topKSources: glm-dsa's shared indexers), or itself; undefined when no block has one.
 */
export const stageSources = (links: StageLinks): ReadonlyArray<number> | undefined => {
  const all = [links.kvSources, links.topKSources, links.tokenSources].filter((s) => s !== undefined)
  if (all.length <= 1) return all[0]
  return all[0]!.map((s, il) => Math.min(s, ...all.slice(1).map((o) => o[il] ?? il)))
}

/** Per block, 0 for the first `n` (deepseek4's hash-routed blocks read the token ids, which only the first stage has). */
export const tokenSourcesOf = (nLayer: number, n: number): ReadonlyArray<number> =>
  Array.from({ length: nLayer }, (_, il) => (il < n ? 0 : il))

/** Why blocks [start, end) cannot be one stage under a layout's links, or undefined. */
export const stageRangeProblem = (links: StageLinks, start: number, end: number): string | undefined => {
  const kv = kvShareRangeProblem(links.kvSources, start, end)
  if (kv !== undefined) return kv
  const tokens = links.tokenSources
  if (tokens !== undefined && start > 0 && start < tokens.length && tokens[start] === 0) {
    return `block ${start} routes by token id (hash routing), so blocks 0..${start} must be on the first stage`
  }
  const topK = links.topKSources
  if (topK === undefined) return undefined
  for (let il = start; il < end; il++) {
    const source = topK[il]!
    if (source < start) {
      return `block ${il} reuses block ${source}'s indexer top-k (shared indexer), so blocks ${source}..${il} must be on one stage`
    }
  }
  return undefined
}

/** Per block, the block whose DSA top-k it reads: itself when it has an indexer, else the last one before it that has. */
export const topKSourcesOf = (full: ReadonlyArray<boolean>): ReadonlyArray<number> => {
  let last = 0
  return full.map((has, il) => {
    if (has) last = il
    return last
  })
}
