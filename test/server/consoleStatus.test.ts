/**
 * The console's status from the server's status and metrics (ConsoleStatus.ts consoleStatusOf), for the states a
 * short test server does not hold still: loading with each node's progress (its stages' StageLoading reports and
 * weights delivered), reviving (the agents it waits for; those exited are lost) and faulted. Every result decodes with
 * the domain's schema.
 */
import { assert, describe, it } from "@effect/vitest"
import { Schema } from "effect"
import { ConsoleStatus } from "../../src/domain/consoleStatus.js"
import { consoleStatusOf } from "../../src/layers/server/ConsoleStatus.js"
import type { ServerMetrics, ServerStatus } from "../../src/services/Server.js"

const capacity = (free: number, total: number) => ({
  freeMemoryBytes: free,
  totalMemoryBytes: total,
  threads: 4,
  backend: "cpu",
  hostname: "h",
  activeStages: 1
})

const metrics = (extra: Partial<ServerMetrics>): ServerMetrics => ({
  requests: { completed: 0, cancelled: 0, failed: 0, refused: 0 },
  promptTokens: 0,
  completionTokens: 0,
  inFlight: 0,
  queued: 0,
  kvReservedBytes: 0,
  kvBudgetBytes: 0,
  stages: [],
  firstToken: {
    requests: 0,
    totalSeconds: 0,
    tokenize: 0,
    admit: 0,
    setup: 0,
    prefillWait: 0,
    prefill: 0,
    sample: 0,
    hops: 0
  },
  recoveries: 0,
  speculative: { steps: 0, drafted: 0, accepted: 0 },
  stragglers: 0,
  revivals: 0,
  revivalAttempts: 0,
  agents: [],
  ...extra
})

const plan = {
  contextTokens: 4096,
  stages: [
    { stageIndex: 0, address: "a:1", layers: [0, 3] as const, weightBytes: 300, kvBytes: 30 },
    { stageIndex: 1, address: "b:1", layers: [3, 5] as const, weightBytes: 200, kvBytes: 20 }
  ]
}

const statusOf = (status: ServerStatus, m: ServerMetrics) =>
  Schema.decodeUnknownSync(ConsoleStatus)(
    consoleStatusOf(status, m, { id: "m.gguf", info: undefined }, { tokensPerSecond: 0, eventStreams: 0 })
  )

describe("the console's status", () => {
  it("loading: each node's progress from its stages' loading and its weights delivered; its set-up capacity", () => {
    const s = statusOf(
      { _tag: "Loading" },
      metrics({
        plan,
        setup: {
          nodes: [
            { address: "a:1", capacity: capacity(6, 16) },
            { address: "b:1", capacity: capacity(2, 8) }
          ],
          loading: [
            { stageIndex: 0, loadedBytes: 150, totalBytes: 300, done: false },
            { stageIndex: 1, loadedBytes: 0, totalBytes: 200, done: true }
          ]
        },
        weights: [{ stageIndex: 1, address: "c:1", source: "orchestrator", bytes: 10, totalBytes: 40 }]
      })
    )
    assert.strictEqual(s.status, "loading")
    const byAddress = Object.fromEntries(s.nodes.map((n) => [n.address, n]))
    assert.deepStrictEqual(Object.keys(byAddress).sort(), ["a:1", "b:1"])
    assert.strictEqual(byAddress["a:1"]!.state, "loading")
    assert.strictEqual(byAddress["a:1"]!.progress, 0.5)
    assert.strictEqual(byAddress["b:1"]!.progress, 1)
    assert.strictEqual(byAddress["a:1"]!.memoryUsedBytes, 10)
    assert.strictEqual(byAddress["a:1"]!.memoryTotalBytes, 16)
    assert.strictEqual(byAddress["a:1"]!.cores, 4)
    assert.deepStrictEqual(
      s.plan.stages.map((st) => [st.address, st.layers, st.weightBytes, st.kvBytes]),
      [
        ["a:1", [0, 3], 300, 30],
        ["b:1", [3, 5], 200, 20]
      ]
    )
    assert.isNull(s.live.timeToFirstTokenSeconds)
  })

  it("reviving: the agents it waits for are reviving, an exited one is lost; faulted: every node lost", () => {
    const reviving = statusOf(
      {
        _tag: "Reviving",
        message: "every agent of the pipeline was lost",
        sinceMillis: 0,
        attempts: 2,
        nextAttemptAtMillis: null,
        waitingFor: [
          { address: "a:1", pid: 1, state: "waiting", detail: "no answer yet" },
          { address: "b:1", pid: 2, state: "exited", detail: "exited with signal SIGKILL" }
        ]
      },
      metrics({ plan })
    )
    assert.strictEqual(reviving.status, "reviving")
    assert.strictEqual(reviving.detail, "every agent of the pipeline was lost")
    assert.deepStrictEqual(
      reviving.nodes.map((n) => [n.address, n.state, n.detail]),
      [
        ["a:1", "reviving", "no answer yet"],
        ["b:1", "lost", "exited with signal SIGKILL"]
      ]
    )
    const faulted = statusOf({ _tag: "Faulted", message: "lost agent b:1" }, metrics({ plan }))
    assert.strictEqual(faulted.status, "faulted")
    assert.deepStrictEqual(
      faulted.nodes.map((n) => n.state),
      ["lost", "lost"]
    )
  })

  it("ready: live agents' capacity now, a lost agent without stale figures; the mean time to first token", () => {
    const s = statusOf(
      { _tag: "Ready", lostAgents: ["b:1"] },
      metrics({
        plan,
        setup: { nodes: [{ address: "b:1", capacity: capacity(2, 8) }], loading: [] },
        agents: [{ address: "a:1", pid: 1, activeStages: 1, capacity: capacity(4, 16) }],
        firstToken: {
          requests: 2,
          totalSeconds: 0.5,
          tokenize: 0,
          admit: 0,
          setup: 0,
          prefillWait: 0,
          prefill: 0,
          sample: 0,
          hops: 0
        }
      })
    )
    const [a, b] = [s.nodes.find((n) => n.address === "a:1")!, s.nodes.find((n) => n.address === "b:1")!]
    assert.strictEqual(a.state, "ready")
    assert.strictEqual(a.memoryUsedBytes, 12)
    assert.strictEqual(b.state, "lost")
    assert.isNull(b.memoryTotalBytes)
    assert.strictEqual(s.live.timeToFirstTokenSeconds, 0.25)
  })
})
