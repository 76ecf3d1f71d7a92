/**
 * The server's prompt cache keeper: the index of the prefixes the agents hold (services/PromptCacheIndex.ts), what
 * each run adopts and keeps, and the drops sent to the agents. A finished run's KV stays on every stage as an entry
 * counted against the KV budget; a later prompt that starts with an entry's tokens prefills only the rest (PC4).
 */
import { Chunk, Effect, Queue, type Scope } from "effect"
import type { Pipeline } from "../../services/Orchestrator.js"
import { makePromptCacheIndex, type PromptCacheIndex, type PromptCacheMatch } from "../../services/PromptCacheIndex.js"
import type { PromptCacheOptions, ServerMetrics } from "../../services/Server.js"
import type { HeldKv } from "./Admission.js"

/** In the drop queue: every entry. */
const DROP_ALL = -1

/** What one run takes from the cache and gives back to it. */
export interface RunCache {
  /** The entry this run continues from (pinned until the run ends), if admission left it. */
  readonly adopt: PromptCacheMatch | undefined
  /** The id this run's KV is kept under, when the cache is on. */
  readonly keepId: number | undefined
  /** The stages reported how many prompt tokens came from the adopted entry. */
  readonly promptCached: (cachedTokens: number) => void
  /** The run's admission ends: its KV becomes an entry of `tokens` (`bytes` per stage), or is dropped (none kept). */
  readonly keep: (tokens: ReadonlyArray<number>, bytes: number, overBudget: () => boolean) => void
  /** The run no longer uses the adopted entry. */
  readonly unpin: () => void
  readonly cachedTokens: () => number
}

export interface PromptCacheKeeper {
  readonly enabled: boolean
  /** The entries' bytes for admission, and their eviction when a request needs the memory. */
  readonly held: HeldKv
  /** The agents' entries are gone or unusable (another pipeline, a recovery replaced a stage): forget them all. */
  readonly forget: () => void
  /** The longest held prefix of `prompt`, now the most recently used entry (so admission's eviction takes it last). */
  readonly match: (prompt: ReadonlyArray<number>) => PromptCacheMatch | undefined
  /** One admitted run on `pipeline`: the entry it adopts (pinned until the scope closes) and the id it keeps. */
  readonly forRun: (
    match: PromptCacheMatch | undefined,
    pipeline: Pipeline
  ) => Effect.Effect<RunCache, never, Scope.Scope>
  readonly metrics: () => NonNullable<ServerMetrics["promptCache"]>
}

/** What the keeper's runs share: the index, its counters, and the way drops reach the agents. */
interface KeeperParts {
  readonly index: PromptCacheIndex
  readonly counts: { hits: number; misses: number; cachedTokens: number }
  readonly enabled: boolean
  readonly held: HeldKv
  readonly dropOnAgents: (ids: ReadonlyArray<number>) => void
  readonly live: () => Pipeline | undefined
}

/** One admitted run's part of the cache: the entry it adopts (pinned until its scope closes) and the id it keeps. */
const runCacheOf =
  ({ counts, dropOnAgents, enabled, held, index, live }: KeeperParts) =>
  (match: PromptCacheMatch | undefined, pipeline: Pipeline): Effect.Effect<RunCache, never, Scope.Scope> =>
    Effect.gen(function* () {
      const adopt = match !== undefined && index.has(match.entry) ? match : undefined
      if (adopt !== undefined) index.pin(adopt.entry)
      let pinned = adopt !== undefined
      const unpin = () => {
        if (pinned && adopt !== undefined) index.unpin(adopt.entry)
        pinned = false
      }
      yield* Effect.addFinalizer(() => Effect.sync(unpin))
      const keepId = enabled ? index.nextId() : undefined
      let cachedTokens = 0
      const run: RunCache = {
        adopt,
        keepId,
        cachedTokens: () => cachedTokens,
        promptCached: (n) => {
          cachedTokens = n
          counts.cachedTokens += n
          if (n > 0) counts.hits++
          else counts.misses++
        },
        unpin,
        keep: (tokens, bytes, overBudget) => {
          unpin()
          if (keepId === undefined) return
          if (tokens.length === 0 || live() !== pipeline) return dropOnAgents([keepId])
          dropOnAgents(index.add({ id: keepId, tokens, bytes }))
          // over the budget with it (requests admitted meanwhile): the least recently used not in use go
          held.evictWhile(overBudget)
        }
      }
      return run
    })

/**
 * A keeper whose drops reach the agents of the pipeline live at the time (`live`), through a queue drained in the
 * background for the scope's life.
 */
export const make = (
  options: PromptCacheOptions | undefined,
  live: () => Pipeline | undefined
): Effect.Effect<PromptCacheKeeper, never, Scope.Scope> =>
  Effect.gen(function* () {
    const enabled = options?.enabled ?? true
    const index = makePromptCacheIndex({
      ...(options?.maxEntries === undefined ? {} : { maxEntries: options.maxEntries }),
      ...(options?.minTokens === undefined ? {} : { minTokens: options.minTokens })
    })
    const counts = { hits: 0, misses: 0, cachedTokens: 0 }
    const dropQueue = yield* Queue.unbounded<number>()
    const dropOnAgents = (ids: ReadonlyArray<number>) => {
      for (const id of ids) Queue.unsafeOffer(dropQueue, id)
    }
    yield* Queue.takeBetween(dropQueue, 1, 1024).pipe(
      Effect.flatMap((ids) => {
        const all = Chunk.some(ids, (id) => id === DROP_ALL)
        return live()?.dropCached?.(all ? [] : Chunk.toArray(ids), all) ?? Effect.void
      }),
      Effect.forever,
      Effect.forkScoped
    )
    const held: HeldKv = {
      bytes: () => index.bytes(),
      evictWhile: (needMore) => dropOnAgents(index.evictWhile(needMore))
    }
    const forRun = runCacheOf({ index, counts, enabled, held, dropOnAgents, live })
    return {
      enabled,
      held,
      forget: () => {
        index.clear()
        dropOnAgents([DROP_ALL])
      },
      match: (prompt) => (enabled ? index.match(prompt) : undefined),
      forRun,
      metrics: () => ({
        enabled,
        hits: counts.hits,
        misses: counts.misses,
        evictions: index.evictions(),
        cachedTokens: counts.cachedTokens,
        entries: index.size(),
        bytes: index.bytes(),
        lru: index.order().map((e) => ({ entry: e.id, tokens: e.tokens.length }))
      })
    } satisfies PromptCacheKeeper
  })
