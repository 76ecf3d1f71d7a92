/**
 * A node agent's prompt cache: finished stages' KV sessions kept under the entry id their run named
 * (ProvisionRequest.promptCache.keep), until the orchestrator drops them (DropCached), the agent's own bound evicts
 * the least recently used, or the agent's scope closes. A later run's stage copies a prefix of one into its fresh
 * session (StageExecutor.copyPrefix): the entry stays, so runs sharing a prefix may adopt it at the same time.
 *
 * An entry's session keeps its own hold on the loaded weights (the scope it was opened in), so the weights outlive
 * every session still held on them. An entry id once dropped is never kept after (a run that stops after the drop
 * of its own entry, e.g. a cancelled request, frees its session instead).
 */
import { Effect, Exit, Scope } from "effect"
import type { StageSession } from "../../services/StageExecutor.js"

export interface HeldSession {
  readonly session: StageSession
  /** Closing it frees the session (and its hold on the weights). */
  readonly scope: Scope.CloseableScope
  /** KV positions [0, positions) hold the entry's tokens. */
  readonly positions: number
  /** The loaded weights it is on (the agent's model cache key): only a stage on the same weights may adopt it. */
  readonly weightsKey: string
}

export interface PromptCacheHost {
  /** The held session of `entry` for stage `stageIndex` on `weightsKey`, if any (counts as a use). */
  readonly find: (entry: number, stageIndex: number, weightsKey: string) => HeldSession | undefined
  /** Keeps `held` as `entry` for `stageIndex`; false (nothing kept, the caller frees it) when that entry was dropped. */
  readonly keep: (entry: number, stageIndex: number, held: HeldSession) => Effect.Effect<boolean>
  /** Drops entries (every held one when `all`), freeing their sessions. */
  readonly drop: (entries: ReadonlyArray<number>, all: boolean) => Effect.Effect<void>
  /** Sessions held now (all stages). */
  readonly size: () => number
}

/** Dropped entry ids remembered (a keep of one of them is refused). */
const TOMBSTONES = 4096

/** Held sessions are freed with the current scope. `maxSessions`: the agent's own bound (least recently used go). */
export const makePromptCacheHost = (maxSessions = 64): Effect.Effect<PromptCacheHost, never, Scope.Scope> =>
  Effect.gen(function* () {
    // insertion order = least recently used first (a use moves it to the end)
    const held = new Map<string, HeldSession & { readonly entry: number }>()
    const dropped = new Set<number>()
    const keyOf = (entry: number, stageIndex: number) => `${entry}/${stageIndex}`
    const free = (h: HeldSession) => Scope.close(h.scope, Exit.void)

    const drop = (entries: ReadonlyArray<number>, all: boolean) =>
      Effect.suspend(() => {
        const wanted = new Set(entries)
        for (const entry of entries) {
          dropped.delete(entry)
          dropped.add(entry)
        }
        while (dropped.size > TOMBSTONES) dropped.delete(dropped.values().next().value!)
        const gone = [...held].filter(([, h]) => all || wanted.has(h.entry))
        for (const [key] of gone) held.delete(key)
        return Effect.forEach(gone, ([, h]) => free(h), { discard: true })
      })

    yield* Effect.addFinalizer(() => drop([], true))

    return {
      find: (entry, stageIndex, weightsKey) => {
        const key = keyOf(entry, stageIndex)
        const h = held.get(key)
        if (h === undefined || h.weightsKey !== weightsKey) return undefined
        held.delete(key)
        held.set(key, h)
        return h
      },
      keep: (entry, stageIndex, session) =>
        Effect.suspend(() => {
          const key = keyOf(entry, stageIndex)
          if (dropped.has(entry) || held.has(key)) return Effect.succeed(false)
          held.set(key, { ...session, entry })
          const over: Array<HeldSession> = []
          for (const [k, h] of held) {
            if (held.size <= maxSessions) break
            held.delete(k)
            over.push(h)
          }
          return Effect.forEach(over, free, { discard: true }).pipe(Effect.as(true))
        }),
      drop,
      size: () => held.size
    }
  })
