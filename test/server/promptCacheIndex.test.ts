/**
 * The server's prompt-cache index (services/PromptCacheIndex.ts): longest shared prefix, least-recently-used
 * eviction that never takes an entry in use, the entry bound, entries superseded by one that extends them.
 */
import { assert, describe, it } from "@effect/vitest"
import { makePromptCacheIndex } from "../../src/services/PromptCacheIndex.js"

const seq = (from: number, n: number) => Array.from({ length: n }, (_, i) => from + i)

describe("prompt cache index", () => {
  it("matches the longest shared prefix, at most prompt length - 1, at least minTokens", () => {
    const index = makePromptCacheIndex({ minTokens: 4 })
    const a = index.nextId()
    index.add({ id: a, tokens: [1, ...seq(100, 20)], bytes: 10 })
    const b = index.nextId()
    index.add({ id: b, tokens: [1, ...seq(100, 5), ...seq(500, 20)], bytes: 10 })
    assert.deepStrictEqual(index.match([1, ...seq(100, 10), 7]), { entry: a, length: 11 })
    assert.deepStrictEqual(index.match([1, ...seq(100, 5), 500, 501, 9]), { entry: b, length: 8 })
    // the whole entry is the prompt: the last prompt token is still prefilled
    assert.deepStrictEqual(index.match([1, ...seq(100, 20)]), { entry: a, length: 20 })
    // BOS and two tokens in common: under minTokens
    assert.strictEqual(index.match([1, 100, 101, 9, 9, 9]), undefined)
    assert.strictEqual(index.match([2, ...seq(100, 20)]), undefined)
  })

  it("evicts least recently used first, skips entries in use, and counts evictions", () => {
    const index = makePromptCacheIndex({ minTokens: 1 })
    const ids = [0, 1, 2].map((k) => {
      const id = index.nextId()
      index.add({ id, tokens: seq(1000 * (k + 1), 10), bytes: 100 })
      return id
    })
    // use the oldest: the middle one is now least recently used
    assert.strictEqual(index.match(seq(1000, 5))?.entry, ids[0])
    assert.deepStrictEqual(
      index.order().map((e) => e.id),
      [ids[1], ids[2], ids[0]]
    )
    index.pin(ids[1]!)
    const gone = index.evictWhile(() => index.bytes() > 100)
    assert.deepStrictEqual(gone, [ids[2]!, ids[0]!])
    assert.deepStrictEqual(
      index.order().map((e) => e.id),
      [ids[1]!]
    )
    assert.strictEqual(index.evictions(), 2)
    // pinned twice, unpinned once: still in use
    index.pin(ids[1]!)
    index.unpin(ids[1]!)
    assert.deepStrictEqual(
      index.evictWhile(() => index.size() > 0),
      []
    )
    index.unpin(ids[1]!)
    assert.deepStrictEqual(
      index.evictWhile(() => index.size() > 0),
      [ids[1]!]
    )
    assert.strictEqual(index.bytes(), 0)
  })

  it("bounds the entries, and an entry that extends another replaces it unless it is in use", () => {
    const index = makePromptCacheIndex({ maxEntries: 2, minTokens: 1 })
    const a = index.nextId()
    assert.deepStrictEqual(index.add({ id: a, tokens: seq(0, 10), bytes: 1 }), [])
    const b = index.nextId()
    index.pin(a)
    // extends a, but a is in use: both stay
    assert.deepStrictEqual(index.add({ id: b, tokens: seq(0, 15), bytes: 1 }), [])
    index.unpin(a)
    const c = index.nextId()
    // extends a and b: both replaced (not counted as evictions)
    assert.deepStrictEqual(index.add({ id: c, tokens: seq(0, 30), bytes: 1 }), [a, b])
    assert.strictEqual(index.evictions(), 0)
    const d = index.nextId()
    index.add({ id: d, tokens: seq(50, 5), bytes: 1 })
    const e = index.nextId()
    // a third entry: the least recently used goes
    assert.deepStrictEqual(index.add({ id: e, tokens: seq(70, 5), bytes: 1 }), [c])
    assert.deepStrictEqual(
      index.order().map((x) => x.id),
      [d, e]
    )
    assert.deepStrictEqual(index.clear(), [d, e])
    assert.strictEqual(index.size(), 0)
    // ids only grow
    assert.isAbove(index.nextId(), e)
  })
})
