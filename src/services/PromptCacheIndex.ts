/**
 * The server's index of prompt-cache entries (pure, no I/O): which token sequences' KV the pipeline's agents hold,
 * under which entry id, how many bytes each takes per stage, which are in use by running requests, and in which
 * order they were last used. The server (layers/server/ServerLive.ts) asks it for the longest held prefix of a new
 * prompt, adds the KV a finished request kept, and evicts the least recently used entries not in use when a new
 * request needs the memory or the entry bound is passed; it tells the agents to drop what the index let go.
 */

export interface PromptCacheEntry {
  readonly id: number
  /** The tokens whose KV the entry holds (positions 0..tokens.length-1). */
  readonly tokens: ReadonlyArray<number>
  /** KV bytes per stage (the heaviest stage): what it counts against the admission budget. */
  readonly bytes: number
}

export interface PromptCacheMatch {
  readonly entry: number
  /** Positions to adopt: the shared prefix, at most prompt length - 1. */
  readonly length: number
}

export interface PromptCacheIndex {
  /** A new entry id (ids only grow: an agent refuses to keep one it was told to drop). */
  readonly nextId: () => number
  /**
   * The entry sharing the longest prefix with `prompt` (at least `minTokens`; ties: the most recently used), counted as
   * a use; undefined when none does.
   */
  readonly match: (prompt: ReadonlyArray<number>) => PromptCacheMatch | undefined
  /** In use by a running request: never evicted until unpinned (pins count). */
  readonly pin: (id: number) => void
  readonly unpin: (id: number) => void
  /**
   * Adds an entry (the most recently used). Entries not in use whose tokens are a prefix of its tokens are removed
   * (it holds all they hold), then the least recently used beyond `maxEntries`. Returns every id removed.
   */
  readonly add: (entry: PromptCacheEntry) => ReadonlyArray<number>
  /**
   * Evicts least recently used entries not in use while `needMore()` says so; returns their ids in eviction order.
   */
  readonly evictWhile: (needMore: () => boolean) => ReadonlyArray<number>
  /** Forgets every entry (the agents lost them); returns their ids. */
  readonly clear: () => ReadonlyArray<number>
  readonly has: (id: number) => boolean
  /** Bytes held by all entries. */
  readonly bytes: () => number
  readonly size: () => number
  /** Evictions so far (for the metric; superseded entries are not counted). */
  readonly evictions: () => number
  /** Entries, least recently used first. */
  readonly order: () => ReadonlyArray<PromptCacheEntry>
}

export interface PromptCacheIndexOptions {
  /** Most entries held (default 16). */
  readonly maxEntries?: number
  /** A shorter shared prefix is no match (default 8 tokens: a BOS and a few words are not worth a copy). */
  readonly minTokens?: number
}

const sharedPrefix = (a: ReadonlyArray<number>, b: ReadonlyArray<number>): number => {
  const n = Math.min(a.length, b.length)
  let i = 0
  while (i < n && a[i] === b[i]) i++
  return i
}

export const makePromptCacheIndex = (options: PromptCacheIndexOptions = {}): PromptCacheIndex => {
  const maxEntries = Math.max(1, Math.floor(options.maxEntries ?? 16))
  const minTokens = Math.max(1, Math.floor(options.minTokens ?? 8))
  // insertion order = least recently used first
  const entries = new Map<number, PromptCacheEntry>()
  const pins = new Map<number, number>()
  let lastId = 0
  let evicted = 0
  const touch = (id: number) => {
    const e = entries.get(id)
    if (e === undefined) return
    entries.delete(id)
    entries.set(id, e)
  }
  const pinned = (id: number) => (pins.get(id) ?? 0) > 0
  const evictWhile = (needMore: () => boolean): ReadonlyArray<number> => {
    const gone: Array<number> = []
    for (const id of [...entries.keys()]) {
      if (!needMore()) break
      if (pinned(id)) continue
      entries.delete(id)
      evicted++
      gone.push(id)
    }
    return gone
  }
  return {
    nextId: () => ++lastId,
    match: (prompt) => {
      let best: PromptCacheMatch | undefined
      // most recently used last: a tie goes to it
      for (const e of entries.values()) {
        const length = Math.min(sharedPrefix(e.tokens, prompt), prompt.length - 1)
        if (length >= minTokens && length >= (best?.length ?? 0)) best = { entry: e.id, length }
      }
      if (best !== undefined) touch(best.entry)
      return best
    },
    pin: (id) => void pins.set(id, (pins.get(id) ?? 0) + 1),
    unpin: (id) => {
      const n = (pins.get(id) ?? 0) - 1
      if (n > 0) pins.set(id, n)
      else pins.delete(id)
    },
    add: (entry) => {
      const gone: Array<number> = []
      for (const e of [...entries.values()]) {
        if (
          !pinned(e.id) &&
          e.tokens.length <= entry.tokens.length &&
          sharedPrefix(e.tokens, entry.tokens) === e.tokens.length
        ) {
          entries.delete(e.id)
          gone.push(e.id)
        }
      }
      entries.set(entry.id, entry)
      return [...gone, ...evictWhile(() => entries.size > maxEntries)]
    },
    evictWhile,
    clear: () => {
      const ids = [...entries.keys()]
      entries.clear()
      return ids
    },
    has: (id) => entries.has(id),
    bytes: () => {
      let sum = 0
      for (const e of entries.values()) sum += e.bytes
      return sum
    },
    size: () => entries.size,
    evictions: () => evicted,
    order: () => [...entries.values()]
  }
}
