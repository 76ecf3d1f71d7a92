/**
 * qwen35 (issue 21): a cancelled request frees its DeltaNet state on every stage. `swactor serve` over a synthetic
 * qwen35 file (blocks 0-2 gated DeltaNet, block 3 gated attention) at 2 stages, prompt cache off so that no session
 * outlives its request. Each agent reports the sessions its process holds open and the DeltaNet state bytes in them
 * (NativeSession's tally, KvCache.ts, through the heartbeat's NodeCapacity into /metrics). A streamed request cut off
 * mid-generation leaves every agent with no open session, no state and no cache bytes; the requests afterwards, one
 * alone and 8 at once, each get exactly the text of their lone greedy run (a leaked or stale state would change it).
 */
import { afterAll, beforeAll } from "vitest"
import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { writeSyntheticModel } from "../../src/layers/gguf/Synthetic.js"
import { metricOf, type ServeProcess, startServe, stopServe, waitForIdle } from "../support/serve.js"

const dir = mkdtempSync(join(tmpdir(), "swactor-serve-qwen35-cancel-"))
const path = join(dir, "qwen35.gguf")
const PROMPTS = [
  "Once upon a time",
  "The little dog",
  "Lily went to the park",
  "A big red ball",
  "Tom and his sister",
  "In the forest there was",
  "The sun was bright",
  "She found a box"
]
const TOKENS = 24

/** Each agent's open sessions and the DeltaNet state / cache bytes they hold, from /metrics. */
const sessionsOf = async (url: string) => {
  const text = await fetch(`${url}/metrics`).then((r) => r.text())
  const read = (name: string) =>
    new Map(
      [...text.matchAll(new RegExp(`^${name}\\{address="[^"]+",pid="(\\d+)"\\} (\\S+)$`, "gm"))].map((m) => [
        m[1]!,
        Number(m[2])
      ])
    )
  const sessions = read("swactor_agent_open_sessions")
  const state = read("swactor_agent_state_bytes")
  const cache = read("swactor_agent_cache_bytes")
  return [...sessions.keys()].sort().map((pid) => ({
    pid,
    sessions: sessions.get(pid)!,
    stateBytes: state.get(pid)!,
    cacheBytes: cache.get(pid)!
  }))
}

describe("swactor serve: a cancelled qwen35 request frees its DeltaNet state on every stage", () => {
  let server: ServeProcess
  const lone = new Map<string, string>()

  beforeAll(async () => {
    await Effect.runPromise(
      writeSyntheticModel({
        path,
        arch: "qwen35",
        layers: 4,
        hidden: 256,
        ffn: 512,
        heads: 4,
        kvHeads: 2,
        headDim: 64,
        vocab: 400,
        contextLength: 1024,
        type: "f32",
        seed: 21
      })
    )
    server = await startServe([
      "--model",
      path,
      "--stages",
      "2",
      "--threads",
      "1",
      "--parallel",
      "8",
      "--prompt-cache",
      "off"
    ])
  }, 180_000)
  afterAll(async () => {
    await stopServe(server)
    rmSync(dir, { recursive: true, force: true })
  })

  const complete = async (prompt: string) => {
    const response = await fetch(`${server.url}/v1/completions`, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ prompt, max_tokens: TOKENS, temperature: 0 })
    })
    assert.strictEqual(response.status, 200)
    const body = (await response.json()) as { choices: Array<{ text: string }>; usage: { completion_tokens: number } }
    return { text: body.choices[0]!.text, tokens: body.usage.completion_tokens }
  }

  it("lone runs: every prompt alone; afterwards no agent holds a session", async () => {
    for (const prompt of PROMPTS) {
      const { text, tokens } = await complete(prompt)
      assert.isAbove(tokens, 4, prompt)
      lone.set(prompt, text)
    }
    // the lone texts differ from each other: a state leaking between sequences would show
    assert.isAbove(new Set(lone.values()).size, PROMPTS.length / 2)
    await waitForIdle(server.url)
    const agents = await sessionsOf(server.url)
    assert.strictEqual(agents.length, 2)
    assert.deepStrictEqual(
      agents.map((a) => [a.sessions, a.stateBytes, a.cacheBytes]),
      [
        [0, 0, 0],
        [0, 0, 0]
      ]
    )
  }, 120_000)

  it("a disconnect mid-generation frees the state and KV on every stage; later requests get their lone text", async () => {
    assert.strictEqual(lone.size, PROMPTS.length, "the lone runs")
    const cancelledBefore = await metricOf(server.url, 'swactor_requests_total{outcome="cancelled"}')
    const abort = new AbortController()
    const response = await fetch(`${server.url}/v1/completions`, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ prompt: PROMPTS[0], max_tokens: 900, temperature: 0, stream: true }),
      signal: abort.signal
    })
    const reader = response.body!.getReader()
    await reader.read()
    await reader.read()
    // mid-generation: each stage's agent holds the sequence's session, both with DeltaNet blocks (state bytes > 0);
    // the cut is between DeltaNet blocks and attention: one stage holds DeltaNet state only, the other also K/V
    const during = await sessionsOf(server.url)
    console.log(`qwen35 cancel: during the stream ${JSON.stringify(during)}`)
    assert.deepStrictEqual(
      during.map((a) => a.sessions),
      [1, 1]
    )
    for (const a of during) assert.isAbove(a.stateBytes, 0, `agent ${a.pid} state`)
    const [deltaOnly, withAttention] = [...during].sort((a, b) => a.cacheBytes - b.cacheBytes)
    assert.strictEqual(deltaOnly!.cacheBytes, deltaOnly!.stateBytes)
    assert.isAbove(withAttention!.cacheBytes, withAttention!.stateBytes)
    assert.strictEqual(await metricOf(server.url, "swactor_requests_in_flight"), 1)
    abort.abort()
    await waitForIdle(server.url)
    const after = await sessionsOf(server.url)
    assert.deepStrictEqual(
      after.map((a) => [a.sessions, a.stateBytes, a.cacheBytes]),
      [
        [0, 0, 0],
        [0, 0, 0]
      ]
    )
    assert.strictEqual(await metricOf(server.url, "swactor_kv_reserved_bytes"), 0)
    assert.strictEqual(await metricOf(server.url, 'swactor_requests_total{outcome="cancelled"}'), cancelledBefore + 1)

    // one request after the cancel, then 8 at once: each exactly its lone run's text
    assert.strictEqual((await complete(PROMPTS[0]!)).text, lone.get(PROMPTS[0]!))
    const together = await Promise.all(PROMPTS.map(complete))
    assert.deepStrictEqual(
      together.map((r) => r.text),
      PROMPTS.map((p) => lone.get(p))
    )
    assert.isAbove(await metricOf(server.url, 'swactor_stage_max_batch_sequences{stage="0"}'), 1)
    await waitForIdle(server.url)
    assert.deepStrictEqual(
      (await sessionsOf(server.url)).map((a) => [a.sessions, a.stateBytes]),
      [
        [0, 0],
        [0, 0]
      ]
    )
  }, 120_000)
})
