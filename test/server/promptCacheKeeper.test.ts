/**
 * The server's prompt cache keeper (src/layers/server/PromptCacheKeeper.ts) over a pipeline stand-in that records what
 * it is told to drop: a run's KV kept as an entry, the least recently used entries evicted when the budget is passed
 * after a keep (requests admitted meanwhile), a run of a pipeline no longer live or that kept nothing dropped on the
 * agents, an adopted entry never evicted while its run uses it, and `forget` dropping everything.
 */
import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import type { Pipeline } from "../../src/services/Orchestrator.js"
import * as PromptCacheKeeper from "../../src/layers/server/PromptCacheKeeper.js"

/** A pipeline stand-in: only `dropCached` is used by the keeper; every call is recorded. */
const fakePipeline = () => {
  const drops: Array<{ readonly ids: ReadonlyArray<number>; readonly all: boolean }> = []
  const pipeline = {
    dropCached: (ids: ReadonlyArray<number>, all: boolean) => Effect.sync(() => void drops.push({ ids, all }))
  } as unknown as Pipeline
  return { pipeline, drops }
}

/** The ids the agents were told to drop (-1: all), in order. */
const dropped = (drops: ReadonlyArray<{ readonly ids: ReadonlyArray<number>; readonly all: boolean }>) =>
  drops.flatMap((d) => (d.all ? [-1] : d.ids))

/** Lets the keeper's drop fiber (which sends the ids queued meanwhile in one call) run until `n` ids reached them. */
const dropsReach = (drops: ReadonlyArray<{ readonly ids: ReadonlyArray<number>; readonly all: boolean }>, n: number) =>
  Effect.gen(function* () {
    for (let i = 0; i < 200 && dropped(drops).length < n; i++) yield* Effect.sleep("5 millis")
    assert.strictEqual(dropped(drops).length, n, "ids dropped on the agents")
  })

const tokens = (n: number, from = 1) => Array.from({ length: n }, (_, i) => from + i)

describe("PromptCacheKeeper", () => {
  it.scopedLive("keeps runs as entries and evicts the least recently used when a keep passes the budget", () =>
    Effect.gen(function* () {
      const { pipeline, drops } = fakePipeline()
      const keeper = yield* PromptCacheKeeper.make({ minTokens: 2 }, () => pipeline)
      const budget = 250
      const overBudget = () => keeper.held.bytes() > budget
      for (const from of [100, 200]) {
        const run = yield* Effect.scoped(keeper.forRun(undefined, pipeline))
        run.keep(tokens(10, from), 100, overBudget)
      }
      assert.strictEqual(keeper.metrics().entries, 2)
      assert.strictEqual(keeper.held.bytes(), 200)
      // a third entry passes the budget: the least recently used (from 100) goes to the agents
      const third = yield* Effect.scoped(keeper.forRun(undefined, pipeline))
      third.keep(tokens(10, 300), 100, overBudget)
      assert.strictEqual(keeper.metrics().entries, 2)
      assert.strictEqual(keeper.metrics().evictions, 1)
      assert.deepStrictEqual(
        keeper.metrics().lru.map((e) => e.tokens),
        [10, 10]
      )
      yield* dropsReach(drops, 1)
      assert.deepStrictEqual(dropped(drops), [1])
    })
  )

  it.scopedLive("a run that kept nothing, or of a pipeline no longer live, is dropped on the agents", () =>
    Effect.gen(function* () {
      const { pipeline, drops } = fakePipeline()
      const other = fakePipeline()
      let live: Pipeline = pipeline
      const keeper = yield* PromptCacheKeeper.make({ minTokens: 2 }, () => live)
      const nothing = yield* Effect.scoped(keeper.forRun(undefined, pipeline))
      nothing.keep([], 100, () => false)
      const stale = yield* Effect.scoped(keeper.forRun(undefined, pipeline))
      live = other.pipeline
      stale.keep(tokens(10), 100, () => false)
      assert.strictEqual(keeper.metrics().entries, 0)
      yield* dropsReach(other.drops, 2)
      assert.deepStrictEqual(dropped(other.drops), [nothing.keepId, stale.keepId])
      assert.strictEqual(drops.length, 0)
    })
  )

  it.scopedLive("an adopted entry is never evicted while its run uses it; forget drops every entry", () =>
    Effect.gen(function* () {
      const { pipeline, drops } = fakePipeline()
      const keeper = yield* PromptCacheKeeper.make({ minTokens: 2 }, () => pipeline)
      const first = yield* Effect.scoped(keeper.forRun(undefined, pipeline))
      first.keep(tokens(10), 100, () => false)
      const match = keeper.match([...tokens(10), 99])
      assert.deepStrictEqual(match, { entry: first.keepId!, length: 10 })
      yield* Effect.scoped(
        Effect.gen(function* () {
          const run = yield* keeper.forRun(match, pipeline)
          assert.deepStrictEqual(run.adopt, match)
          run.promptCached(10)
          keeper.held.evictWhile(() => true)
          assert.strictEqual(keeper.metrics().entries, 1, "the adopted entry stays while in use")
        })
      )
      // its run ended (scope closed): unpinned, so it may go now
      keeper.held.evictWhile(() => true)
      assert.strictEqual(keeper.metrics().entries, 0)
      assert.deepStrictEqual([keeper.metrics().hits, keeper.metrics().cachedTokens], [1, 10])
      yield* dropsReach(drops, 1)
      keeper.forget()
      yield* dropsReach(drops, 2)
      assert.deepStrictEqual(dropped(drops), [first.keepId, -1])
    })
  )
})
