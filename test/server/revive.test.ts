/**
 * Issue 24, item 2: a stall longer than the heartbeat deadline in every agent must not break `swactor serve` for good.
 * While every agent is lost the server is Reviving: /health (503) names what it waits for, requests get 503 with
 * Retry-After in OpenAI's error shape; attempts back off (0.5 s doubling to 10 s), one stderr line each; once the
 * agents answer again (SIGCONT) a run succeeds on them and it serves again, without a restart. Local agents that
 * never come back are stopped and replaced by fresh ones.
 */
import { afterAll, beforeAll } from "vitest"
import { assert, describe, it } from "@effect/vitest"
import { Context, Effect, Layer, Stream } from "effect"
import type { LocalAgent } from "../../src/layers/agent/AgentProcesses.js"
import { layerLocal } from "../../src/api/generate.js"
import * as ServerLive from "../../src/layers/server/ServerLive.js"
import { Server } from "../../src/services/Server.js"
import { isAlive } from "../support/e2e.js"
import { requireModel } from "../support/models.js"
import { agentsOf, metricOf, type ServeProcess, startServe, startServeOverNodes } from "../support/serve.js"
import { until } from "../support/until.js"

const model = requireModel("stories260K.gguf")
const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms))
/** The heartbeat deadline `swactor serve` uses (PipelineSetup's default): a stall longer than this loses an agent. */
const DEADLINE_MS = 10_000

const complete = (url: string) =>
  fetch(`${url}/v1/completions`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ prompt: "Once upon a time", max_tokens: 24, temperature: 0 })
  })
const greedyText = async (url: string) => {
  const response = await complete(url)
  assert.strictEqual(response.status, 200, await response.clone().text())
  const body = (await response.json()) as { choices: Array<{ text: string }>; usage: { completion_tokens: number } }
  assert.strictEqual(body.usage.completion_tokens, 24)
  return body.choices[0]!.text
}

interface RevivingBody {
  status: string
  error: string
  since: string
  attempts: number
  nextAttemptAt: string
  waitingFor: Array<{ address: string; pid: number; state: string; detail: string }>
  freshAgentsAt?: string
  lastAttempt?: string
}

/** Polls /health until `until` holds of its status; returns that response's status, headers and body, and when. */
const healthUntil = async (url: string, until: (status: number) => boolean, timeoutMs: number) => {
  const deadline = Date.now() + timeoutMs
  while (Date.now() < deadline) {
    const response = await fetch(`${url}/health`)
    const at = Date.now()
    const body = (await response.json()) as unknown
    if (until(response.status)) return { status: response.status, headers: response.headers, body, at }
    await sleep(50)
  }
  throw new Error(`/health did not reach the expected status within ${timeoutMs} ms`)
}

/**
 * SIGSTOP every agent past the heartbeat deadline: Reviving, with /health naming each agent it waits for and a
 * completion refused with 503 + Retry-After at once; SIGCONT: /health 200 again, the same greedy text, nothing in
 * flight, the same agent processes (reused, not replaced). Returns the milliseconds from SIGCONT to /health 200.
 */
const stallAndResume = async (
  server: ServeProcess,
  agents: ReadonlyArray<{ address: string; pid: number }>,
  before: string
) => {
  const stoppedAt = Date.now()
  for (const agent of agents) process.kill(agent.pid, "SIGSTOP")
  let resumed = false
  try {
    const reviving = await healthUntil(server.url, (status) => status !== 200, DEADLINE_MS + 15_000)
    // Lost by their heartbeats only: not before the deadline (counted from the last answer, up to 1 s, the heartbeat
    // interval, before the stall began).
    assert.isAtLeast(reviving.at - stoppedAt, DEADLINE_MS - 1500)
    assert.strictEqual(reviving.status, 503)
    assert.isAtLeast(Number(reviving.headers.get("retry-after")), 1)
    const body = reviving.body as RevivingBody
    assert.strictEqual(body.status, "reviving", JSON.stringify(body))
    assert.match(body.error, /every agent of the pipeline was lost/)
    // What it waits for: each agent by address and pid, lost by its heartbeats.
    assert.deepStrictEqual(
      body.waitingFor.map((a) => [a.address, a.pid, a.state]),
      agents.map((a) => [a.address, a.pid, "lost"])
    )
    for (const agent of body.waitingFor) assert.match(agent.detail, /no heartbeat answer/)

    // A completion meanwhile: 503 at once, Retry-After, OpenAI's error shape, the revival in words.
    const askedAt = Date.now()
    const refused = await complete(server.url)
    assert.isBelow(Date.now() - askedAt, 2000)
    assert.strictEqual(refused.status, 503)
    assert.isAtLeast(Number(refused.headers.get("retry-after")), 1)
    const error = (await refused.json()) as { error: { message: string; type: string; param: null; code: string } }
    assert.deepInclude(error.error, { type: "server_error", param: null, code: "reviving" })
    assert.match(error.error.message, /the pipeline is being revived: every agent of the pipeline was lost/)

    // The stall ends: served again without a restart.
    const continuedAt = Date.now()
    for (const agent of agents) process.kill(agent.pid, "SIGCONT")
    resumed = true
    const ok = await healthUntil(server.url, (status) => status === 200, 30_000)
    const millis = ok.at - continuedAt
    assert.deepStrictEqual(ok.body, { status: "ok" })
    assert.strictEqual(await greedyText(server.url), before)
    assert.strictEqual(await metricOf(server.url, "swactor_requests_in_flight"), 0)
    assert.strictEqual(await metricOf(server.url, "swactor_pipeline_revivals_total"), 1)
    assert.deepStrictEqual(
      (await agentsOf(server.url)).map((a) => [a.address, a.pid]),
      agents.map((a) => [a.address, a.pid])
    )
    // One line per attempt on stderr, the last one says it serves again.
    const lines = server
      .stderr()
      .split("\n")
      .filter((line) => line.includes("reviving the pipeline"))
    assert.match(lines[0] ?? "", /^swactor serve: every agent of the pipeline was lost: .*; reviving the pipeline/)
    assert.match(lines[1] ?? "", /^swactor serve: reviving the pipeline: attempt 1: /)
    assert.match(
      lines.at(-1) ?? "",
      /^swactor serve: reviving the pipeline: attempt \d+: a run succeeded on the agents that answer again: .*; serving again/
    )
    return millis
  } finally {
    if (!resumed) for (const agent of agents) process.kill(agent.pid, "SIGCONT")
  }
}

describe("swactor serve: every local agent stalls past the heartbeat deadline (stories260K, 2 stages)", () => {
  let server: ServeProcess
  beforeAll(async () => {
    server = await startServe(["--model", model, "--stages", "2", "--threads", "1"])
  }, 180_000)
  afterAll(async () => {
    if (server?.child.exitCode === null) server.child.kill("SIGTERM")
    await server?.exited
  })

  // kill -STOP A1 A2; sleep > 10 s; kill -CONT A1 A2: /health 503 `reviving` naming both agents, a completion 503 with
  // Retry-After meanwhile; after SIGCONT /health 200 again, the same greedy text as before the stall, nothing in
  // flight, the same two agents; SIGTERM then leaves no agent process behind.
  it("SIGSTOP of every agent, then SIGCONT: 503 reviving meanwhile, then served again with the same text", async () => {
    const before = await greedyText(server.url)
    const agents = await agentsOf(server.url)
    assert.strictEqual(agents.length, 2)
    const millis = await stallAndResume(server, agents, before)
    process.stderr.write(`serve.revive: local agents: SIGCONT to /health 200 in ${millis} ms\n`)
    assert.isBelow(millis, 10_000)
    server.child.kill("SIGTERM")
    const exit = await server.exited
    assert.strictEqual(exit.code, 143, server.stderr())
    for (const agent of agents) assert.isFalse(isAlive(agent.pid), `agent ${agent.pid} left running`)
  }, 90_000)
})

describe("swactor serve --agents: every remote node stalls past the heartbeat deadline", () => {
  let server: ServeProcess
  let nodes: ReadonlyArray<LocalAgent>
  let close: (() => Promise<void>) | undefined
  beforeAll(async () => {
    ;({ server, nodes, close } = await startServeOverNodes(["--model", model]))
  }, 180_000)
  afterAll(() => close?.())

  // The same through remote nodes: the server waits for them (no fresh agents to start), reconnects when they answer.
  it("SIGSTOP of every node, then SIGCONT: 503 reviving meanwhile, then served again with the same text", async () => {
    const before = await greedyText(server.url)
    const agents = await agentsOf(server.url)
    assert.deepStrictEqual(
      agents.map((a) => a.pid),
      nodes.map((n) => n.pid)
    )
    const millis = await stallAndResume(server, agents, before)
    process.stderr.write(`serve.revive: remote nodes: SIGCONT to /health 200 in ${millis} ms\n`)
    assert.isBelow(millis, 10_000)
  }, 90_000)
})

describe("Server (library, local agents): stalled agents that never come back", () => {
  // With a 1.5 s heartbeat deadline and fresh agents after 2 s: both agents SIGSTOPped for good are lost, then
  // stopped (a stopped process is killed too) and two fresh local agents serve the same greedy text.
  it.live(
    "are stopped after freshAgentsAfter and fresh local agents serve the same text",
    () =>
      Effect.gen(function* () {
        const lines: Array<string> = []
        const server = yield* Layer.build(
          ServerLive.layer({
            model,
            stages: 2,
            heartbeat: { interval: "200 millis", deadline: "1500 millis" },
            revive: { freshAgentsAfter: "2 seconds" },
            log: (line) => lines.push(line)
          }).pipe(Layer.provide(layerLocal({ threads: 1 })))
        ).pipe(Effect.map(Context.get(Server)))
        yield* server.ready
        const run = Stream.runFold(server.generate({ prompt: "Once upon a time", maxTokens: 24 }), "", (text, event) =>
          event._tag === "Text" ? text + event.text : text
        )
        const before = yield* run
        const old = (yield* server.metrics).agents
        assert.strictEqual(old.length, 2)
        for (const agent of old) process.kill(agent.pid, "SIGSTOP")
        let status = yield* until("the server to start reviving", server.status, (s) => s._tag === "Reviving")
        assert.strictEqual(status._tag, "Reviving")
        if (status._tag === "Reviving") {
          assert.deepStrictEqual(
            status.waitingFor.map((a) => [a.pid, a.state]),
            old.map((a) => [a.pid, "lost"])
          )
          assert.strictEqual(status.freshAgentsAtMillis, status.sinceMillis + 2000)
        }
        const refused = yield* Effect.flip(run)
        assert.strictEqual(refused._tag, "ServerReviving")
        status = yield* until("the revived server to be ready", server.status, (s) => s._tag === "Ready")
        assert.deepStrictEqual(status, { _tag: "Ready" })
        assert.strictEqual(yield* run, before)
        const fresh = (yield* server.metrics).agents
        assert.strictEqual(fresh.length, 2)
        for (const agent of fresh)
          assert.notInclude(
            old.map((a) => a.pid),
            agent.pid
          )
        // The stalled ones were stopped (SIGKILL reaches a stopped process), not left behind.
        for (const agent of old) assert.isFalse(isAlive(agent.pid), `stalled agent ${agent.pid} left running`)
        assert.strictEqual((yield* server.metrics).revivals, 1)
        assert.match(
          lines.at(-1) ?? "",
          /attempt \d+: a run succeeded on 2 fresh local agents .*the old ones were stopped; serving again/
        )
      }).pipe(Effect.scoped),
    60_000
  )
})
