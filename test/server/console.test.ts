/**
 * The console's routes (issue 39, "The console") through a real `swactor serve` of stories260K on two local agents,
 * with an API key: `GET /` is the self-contained page, open without the key; `GET /api/status` is the status
 * (domain/consoleStatus.ts) with both nodes ready, their memory, cores and backend, and the plan over both; both
 * `/api/*` routes need the key and follow the Host/Origin rules; `GET /api/events` pushes the status as server-sent
 * events (a chat's tokens show in it), and a client that goes away leaves no stream open.
 */
import { afterAll, beforeAll } from "vitest"
import { assert, describe, it } from "@effect/vitest"
import { randomBytes } from "node:crypto"
import { Schema } from "effect"
import { ConsoleStatus } from "../../src/domain/consoleStatus.js"
import { requireModel } from "../support/models.js"
import { type ServeProcess, startServe, stopServe } from "../support/serve.js"
import { untilAsync } from "../support/until.js"
import { rawRequest } from "../support/abuse.js"

const model = requireModel("stories260K.gguf")
const key = randomBytes(24).toString("hex")
const auth = { authorization: `Bearer ${key}` }
const decode = Schema.decodeUnknownSync(ConsoleStatus)

const statusOf = async (url: string) =>
  decode(await fetch(`${url}/api/status`, { headers: auth }).then((r) => r.json()))

/** Server-sent events of a response, read on demand: `until` reads until one event holds and returns it. */
const eventsOf = (response: Response) => {
  const reader = response.body!.pipeThrough(new TextDecoderStream()).getReader()
  let buffer = ""
  return {
    reader,
    until: async (holds: (event: ConsoleStatus) => boolean): Promise<ConsoleStatus> => {
      for (;;) {
        let end: number
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const data = buffer
            .slice(0, end)
            .split("\n")
            .find((line) => line.startsWith("data: "))
          buffer = buffer.slice(end + 2)
          if (data === undefined) continue
          const event = decode(JSON.parse(data.slice(6)))
          if (holds(event)) return event
        }
        const { done, value } = await reader.read()
        if (done) throw new Error("the event stream ended")
        buffer += value
      }
    }
  }
}

describe("swactor serve's console routes (two stages, an API key)", () => {
  let server: ServeProcess
  beforeAll(async () => {
    server = await startServe(["--model", model, "--stages", "2", "--threads", "1"], { SWACTOR_API_KEY: key })
  }, 180_000)
  afterAll(async () => {
    await stopServe(server)
  })

  it("GET / is the console page, open without the key, inline only (no other origin)", async () => {
    const page = await fetch(`${server.url}/`)
    assert.strictEqual(page.status, 200)
    assert.match(page.headers.get("content-type") ?? "", /^text\/html/)
    assert.match(page.headers.get("content-security-policy") ?? "", /default-src 'none'/)
    const html = await page.text()
    assert.include(html, "swactor console")
    assert.include(html, "api/events")
    assert.notMatch(html, /<script[^>]+src=|<link[^>]+href=|https?:\/\//)
  })

  it("GET /api/status: both nodes ready with their resources, the plan over both, the model", async () => {
    const status = await statusOf(server.url)
    assert.strictEqual(status.status, "ready")
    assert.strictEqual(status.nodes.length, 2)
    for (const node of status.nodes) {
      assert.strictEqual(node.state, "ready")
      assert.isAbove(node.memoryTotalBytes ?? 0, 0)
      assert.isAtLeast(node.memoryUsedBytes ?? -1, 0)
      assert.isAtLeast(node.cores ?? 0, 1)
      assert.strictEqual(node.backend, "cpu")
    }
    const stages = status.plan.stages
    assert.deepStrictEqual(
      stages.map((s) => s.stageIndex),
      [0, 1]
    )
    assert.strictEqual(stages[0]!.layers[0], 0)
    assert.strictEqual(stages[0]!.layers[1], stages[1]!.layers[0])
    assert.strictEqual(stages[1]!.layers[1], status.models[0]!.layers)
    assert.sameMembers(
      stages.map((s) => s.address),
      status.nodes.map((n) => n.address)
    )
    for (const s of stages) {
      assert.isAbove(s.weightBytes, 0)
      assert.isAbove(s.kvBytes, 0)
    }
    assert.isAbove(status.plan.contextTokens, 0)
    assert.strictEqual(status.models[0]!.id, "stories260K.gguf")
    assert.strictEqual(status.live.inFlight, 0)
  })

  it("/api/status and /api/events need the key and follow the Host and Origin rules", async () => {
    for (const path of ["/api/status", "/api/events"]) {
      assert.strictEqual((await fetch(`${server.url}${path}`)).status, 401, path)
      assert.strictEqual((await fetch(`${server.url}${path}`, { headers: { authorization: "Bearer no" } })).status, 401)
      const rebound = await rawRequest(
        server.url,
        [`GET ${path} HTTP/1.1`, "Host: rebound.example:8080", `Authorization: Bearer ${key}`].join("\r\n"),
        [],
        { timeoutMs: 5000 }
      )
      assert.strictEqual(rebound.status, 403, path)
      const origin = await fetch(`${server.url}${path}`, { headers: { ...auth, origin: "https://evil.example" } })
      assert.strictEqual(origin.status, 403, path)
    }
    const page = await rawRequest(server.url, ["GET / HTTP/1.1", "Host: rebound.example"].join("\r\n"), [], {
      timeoutMs: 5000
    })
    assert.strictEqual(page.status, 403)
  })

  it("GET /api/events pushes the status (a chat's tokens show); a client gone leaves no stream open", async () => {
    const abort = new AbortController()
    const response = await fetch(`${server.url}/api/events`, { headers: auth, signal: abort.signal })
    assert.strictEqual(response.status, 200)
    assert.match(response.headers.get("content-type") ?? "", /^text\/event-stream/)
    const events = eventsOf(response)
    const first = await events.until(() => true)
    assert.strictEqual(first.status, "ready")
    assert.strictEqual(first.live.eventStreams, 1)
    const chat = await fetch(`${server.url}/v1/chat/completions`, {
      method: "POST",
      headers: { ...auth, "content-type": "application/json" },
      body: JSON.stringify({ messages: [{ role: "user", content: "Once upon a time" }], max_tokens: 24 })
    })
    assert.strictEqual(chat.status, 200)
    const generated = ((await chat.json()) as { usage: { completion_tokens: number } }).usage.completion_tokens
    assert.isAbove(generated, 0)
    // the same stream goes on: an event with the chat's tokens counted and the request completed
    const counted = await events.until((e) => e.live.completionTokens >= first.live.completionTokens + generated)
    assert.isAbove(counted.live.completed, first.live.completed)
    abort.abort()
    await events.reader.cancel().catch(() => undefined)
    const closed = await untilAsync(
      "the event stream closed on the server",
      () => statusOf(server.url),
      (s) => s.live.eventStreams === 0
    )
    assert.strictEqual(closed.live.eventStreams, 0)
  })
})
