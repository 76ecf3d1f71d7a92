/**
 * The prompt cache of `swactor serve` (stories260K, 2 local stages): a finished request's KV stays on every stage as
 * an entry; a later prompt sharing its prefix prefills only the rest, with the text of a server that has the cache off
 * (greedy and seeded). Concurrent requests share one entry; a cancelled request keeps nothing; a killed stage agent
 * (its spare takes the stage, without the entry) means a full prefill with the same text; under a small KV budget the
 * least recently used entry not in use is evicted (checked through /metrics).
 */
import { afterAll, beforeAll } from "vitest"
import { assert, describe, it } from "@effect/vitest"
import { agentsOf, metricOf, readSse, type ServeProcess, startServe, stopServe } from "../support/serve.js"
import { requireModel } from "../support/models.js"
import { untilAsync } from "../support/until.js"

const model = requireModel("stories260K.gguf")

interface Completion {
  readonly text: string
  readonly promptTokens: number
  readonly completionTokens: number
  readonly cachedTokens: number
}

const complete = async (url: string, body: Record<string, unknown>): Promise<Completion> => {
  const response = await fetch(`${url}/v1/completions`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ temperature: 0, ...body })
  })
  const json = (await response.json()) as {
    choices: Array<{ text: string }>
    usage: { prompt_tokens: number; completion_tokens: number; prompt_tokens_details: { cached_tokens: number } }
  }
  assert.strictEqual(response.status, 200, JSON.stringify(json))
  return {
    text: json.choices[0]!.text,
    promptTokens: json.usage.prompt_tokens,
    completionTokens: json.usage.completion_tokens,
    cachedTokens: json.usage.prompt_tokens_details.cached_tokens
  }
}

/** The entries /metrics lists, least recently used first: [entry id, tokens]. */
const lruOf = async (url: string) => {
  const text = await fetch(`${url}/metrics`).then((r) => r.text())
  return [...text.matchAll(/^swactor_prompt_cache_entry_tokens\{entry="(\d+)",lru="(\d+)"\} (\d+)$/gm)]
    .sort((a, b) => Number(a[2]) - Number(b[2]))
    .map((m) => [Number(m[1]), Number(m[3])] as const)
}

const base = ["--model", model, "--stages", "2", "--threads", "1"]
/**
 * The agents' prompt chunk: an entry is adopted in whole chunks (the rest then runs in the chunks a full prefill runs),
 * so these short prompts are chunked by 8 (default 128) on every server here, the cache-off one included.
 */
const CHUNK = 8
const env = { SWACTOR_PREFILL_CHUNK: String(CHUNK) }
const aligned = (n: number) => n - (n % CHUNK)
const P =
  "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her friends."
const Q = "The old dog sat by the door every morning and waited for the boy to come home from school."

describe("swactor serve: prompt cache", () => {
  // What a server with the cache off answers (the reference texts), computed first.
  const ref: Record<string, Completion> = {}
  let P2 = ""
  let server: ServeProcess | undefined
  beforeAll(async () => {
    const off = await startServe([...base, "--prompt-cache", "off"], env)
    try {
      ref["t1"] = await complete(off.url, { prompt: P, max_tokens: 40 })
      P2 = `${P}${ref["t1"].text} Then`
      ref["t2"] = await complete(off.url, { prompt: P2, max_tokens: 30 })
      ref["seeded"] = await complete(off.url, { prompt: P2, max_tokens: 30, temperature: 0.8, seed: 7 })
      ref["then"] = await complete(off.url, { prompt: `${P} Then`, max_tokens: 30 })
      ref["later"] = await complete(off.url, { prompt: `${P} Later`, max_tokens: 30 })
      ref["again"] = await complete(off.url, { prompt: P2, max_tokens: 30 })
      ref["q"] = await complete(off.url, { prompt: Q, max_tokens: 30 })
      ref["qAnd"] = await complete(off.url, { prompt: `${Q} And`, max_tokens: 20 })
      // off: nothing held, nothing reused
      assert.strictEqual(ref["again"].cachedTokens, 0)
      assert.strictEqual(await metricOf(off.url, "swactor_prompt_cache_entries"), 0)
      assert.strictEqual(await metricOf(off.url, "swactor_prompt_cache_hits_total"), 0)
    } finally {
      await stopServe(off)
    }
    server = await startServe([...base, "--spares", "1"], env)
  }, 240_000)
  afterAll(async () => {
    await stopServe(server)
  })

  // Turn 2 of a conversation (turn 1's prompt + its text + more) starts after turn 1's held KV: its prompt's whole
  // chunks (the reply's KV, computed one decode step at a time, is not kept). Same text as without the cache, greedy
  // and seeded.
  it("turn 2 reuses turn 1's KV on every stage, with the text of a server without the cache", async () => {
    const url = server!.url
    const t1 = await complete(url, { prompt: P, max_tokens: 40 })
    assert.strictEqual(t1.text, ref["t1"]!.text)
    assert.strictEqual(t1.cachedTokens, 0)
    const t2 = await complete(url, { prompt: P2, max_tokens: 30 })
    assert.strictEqual(t2.text, ref["t2"]!.text)
    assert.strictEqual(t2.cachedTokens, aligned(t1.promptTokens))
    // the same prompt again: its whole chunks before its last token held (turn 2's entry holds the prompt)
    const seeded = await complete(url, { prompt: P2, max_tokens: 30, temperature: 0.8, seed: 7 })
    assert.strictEqual(seeded.text, ref["seeded"]!.text)
    assert.strictEqual(seeded.cachedTokens, aligned(seeded.promptTokens - 1))
    assert.strictEqual(await metricOf(url, "swactor_prompt_cache_hits_total"), 2)
    assert.strictEqual(await metricOf(url, "swactor_prompt_cache_misses_total"), 1)
    assert.strictEqual(
      await metricOf(url, "swactor_prompt_cache_cached_tokens_total"),
      t2.cachedTokens + seeded.cachedTokens
    )
  })

  // Two prompts that share turn 1's prompt, at once: both start after its tokens, from the same held entry.
  it("concurrent requests sharing a prefix both reuse it, each with its own text", async () => {
    const url = server!.url
    const [then, later] = await Promise.all([
      complete(url, { prompt: `${P} Then`, max_tokens: 30 }),
      complete(url, { prompt: `${P} Later`, max_tokens: 30 })
    ])
    assert.strictEqual(then.text, ref["then"]!.text)
    assert.strictEqual(later.text, ref["later"]!.text)
    assert.strictEqual(then.cachedTokens, aligned(ref["t1"]!.promptTokens))
    assert.strictEqual(later.cachedTokens, aligned(ref["t1"]!.promptTokens))
  })

  // A request ended by a stop string still leaves its prompt's KV as an entry: a later prompt extending it reuses it,
  // with the text of a server without the cache.
  it("a request ended by a stop string leaves an entry; the next prompt reuses it with the same text", async () => {
    const url = server!.url
    const entries = await metricOf(url, "swactor_prompt_cache_entries")
    const word = ref["q"]!.text.trim().split(/\s+/)[2]!
    const stopped = await complete(url, { prompt: Q, max_tokens: 30, stop: [word] })
    assert.strictEqual(stopped.text, ref["q"]!.text.slice(0, ref["q"]!.text.indexOf(word)))
    assert.strictEqual(await metricOf(url, "swactor_prompt_cache_entries"), entries + 1)
    const next = await complete(url, { prompt: `${Q} And`, max_tokens: 20 })
    assert.strictEqual(next.text, ref["qAnd"]!.text)
    assert.strictEqual(next.cachedTokens, aligned(stopped.promptTokens))
    assert.isAbove(next.cachedTokens, 0)
  })

  // A stream cancelled mid-generation: its KV is freed on every stage, not kept (no new entry), nothing stays reserved.
  it("a cancelled request keeps nothing and leaves no KV reserved", async () => {
    const url = server!.url
    const before = await lruOf(url)
    const bytesBefore = await metricOf(url, "swactor_prompt_cache_bytes")
    const abort = new AbortController()
    const response = await fetch(`${url}/v1/completions`, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ prompt: `${P} Later on`, max_tokens: 1500, temperature: 0, stream: true }),
      signal: abort.signal
    })
    let chunks = 0
    await readSse(response, () => {
      if (++chunks === 5) abort.abort()
    }).catch(() => undefined)
    await untilAsync(
      "the cancelled request to end",
      () => metricOf(url, "swactor_requests_in_flight"),
      (n) => n === 0
    )
    assert.strictEqual(await metricOf(url, 'swactor_requests_total{outcome="cancelled"}'), 1)
    assert.strictEqual(await metricOf(url, "swactor_kv_reserved_bytes"), 0)
    // the entries held before, and only they (the one it adopted is not in use any more)
    assert.deepStrictEqual((await lruOf(url)).map(([id]) => id).sort(), before.map(([id]) => id).sort())
    assert.strictEqual(await metricOf(url, "swactor_prompt_cache_bytes"), bytesBefore)
    await untilAsync(
      "the agents to stop hosting",
      () => agentsOf(url),
      (all) => all.every((a) => a.activeStages === 0)
    )
    assert.isTrue((await agentsOf(url)).every((a) => a.activeStages === 0))
  })

  // kill -9 of the agent hosting stage 1: the spare takes the stage without the entry, so the run prefills the whole
  // prompt (cached 0) and gives the same text; its KV is kept on the new placement and the next turn reuses it.
  it("a killed stage agent: the next request prefills in full with the same text, then reuses again", async () => {
    const url = server!.url
    const agents = await agentsOf(url)
    assert.strictEqual(agents.length, 3)
    process.kill(agents[1]!.pid, "SIGKILL")
    const health = await untilAsync(
      "the killed agent to be reported lost",
      () => fetch(`${url}/health`).then((r) => r.json()) as Promise<{ lostAgents?: Array<string> }>,
      (h) => h.lostAgents?.length === 1
    )
    assert.deepStrictEqual(health.lostAgents, [agents[1]!.address])
    const after = await complete(url, { prompt: P2, max_tokens: 30 })
    assert.strictEqual(after.text, ref["again"]!.text)
    assert.strictEqual(after.cachedTokens, 0)
    const next = await complete(url, { prompt: P2, max_tokens: 30 })
    assert.strictEqual(next.text, ref["again"]!.text)
    assert.strictEqual(next.cachedTokens, aligned(next.promptTokens - 1))
  })
})

describe("swactor serve: prompt cache under a small KV budget", () => {
  let server: ServeProcess | undefined
  afterAll(async () => {
    await stopServe(server)
  })

  // --kv-budget-mib 1: a request of 1,024 tokens of context (a prompt of ~800 tokens + 60) takes 384 KiB per stage
  // (3 blocks x 128 B a token x 1,024 cells), so two entries and one running request do not fit. The least recently used entry not in use gives way; the entry a
  // request adopts is in use and stays.
  it("evicts the least recently used entry not in use when a request needs the memory", async () => {
    server = await startServe([...base, "--kv-budget-mib", "1", "--parallel", "1"], env)
    const url = server.url
    const A = Array.from({ length: 31 }, () => "A dog named Max lived in a small house with a big garden.").join(" ")
    const B = Array.from({ length: 31 }, () => "Tom had a red ball and he liked to throw it in the sky.").join(" ")
    const long = { max_tokens: 60 }
    const a = await complete(url, { prompt: A, ...long })
    const b = await complete(url, { prompt: B, ...long })
    for (const x of [a, b]) assert.isTrue(x.promptTokens + 61 > 768 && x.promptTokens + 61 <= 1024, `${x.promptTokens}`)
    assert.strictEqual(await metricOf(url, "swactor_prompt_cache_bytes"), 2 * 384 * 1024)
    assert.deepStrictEqual(
      (await lruOf(url)).map(([id]) => id),
      [1, 2]
    )
    assert.strictEqual(await metricOf(url, "swactor_prompt_cache_evictions_total"), 0)
    // adopts A (now in use and most recent): B, least recently used, is evicted to make room
    const a2 = await complete(url, { prompt: `${A} Then the sun went down.`, ...long })
    assert.strictEqual(a2.cachedTokens, aligned(a.promptTokens))
    assert.strictEqual(await metricOf(url, "swactor_prompt_cache_evictions_total"), 1)
    // entry 3 holds a2's prompt, A's with more: entry 1 is superseded (not counted as an eviction)
    assert.deepStrictEqual(
      (await lruOf(url)).map(([id]) => id),
      [3]
    )
    // B again: a miss (room for its run beside entry 3)
    const b2 = await complete(url, { prompt: B, ...long })
    assert.strictEqual(b2.cachedTokens, 0)
    assert.strictEqual(b2.text, b.text)
    assert.strictEqual(await metricOf(url, "swactor_prompt_cache_evictions_total"), 1)
    assert.deepStrictEqual(
      (await lruOf(url)).map(([id]) => id),
      [3, 4]
    )
    // a third story: a miss that needs the memory; entry 3, the least recently used, goes
    const C = Array.from({ length: 31 }, () => "Sue found a shiny shell on the beach and kept it in a box.").join(" ")
    const c = await complete(url, { prompt: C, ...long })
    assert.strictEqual(c.cachedTokens, 0)
    assert.strictEqual(await metricOf(url, "swactor_prompt_cache_evictions_total"), 2)
    assert.deepStrictEqual(
      (await lruOf(url)).map(([id]) => id),
      [4, 5]
    )
    assert.strictEqual(await metricOf(url, "swactor_kv_reserved_bytes"), 0)
  }, 240_000)
})
