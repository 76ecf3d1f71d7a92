import { assert, describe, it } from "@effect/vitest"
import { spawn } from "node:child_process"
import { existsSync, readdirSync } from "node:fs"
import { dirname, join } from "node:path"
import { Effect, Either, Stream } from "effect"
import { layerLocal, run } from "../../src/api/generate.js"
import * as AgentControlRpc from "../../src/layers/agent/AgentControlRpc.js"
import { type LocalAgent, swactorCommand } from "../../src/layers/agent/AgentProcesses.js"
import { NodeId } from "../../src/domain/ids.js"
import { AgentControl } from "../../src/services/AgentLinks.js"
import type { GenerateRequest, RunUpdate } from "../../src/services/Orchestrator.js"
import { childPids, cuttingProxy, eventually, isAlive, startAgents } from "../support/e2e.js"
import { agentEntry } from "../support/agentEntry.js"
import { repoRoot, requireModel } from "../support/models.js"
import { until } from "../support/until.js"

/** Data connections an agent refused because their run or edge was not registered there (from its log). */
const refusedAttaches = (agent: LocalAgent) =>
  agent
    .stderrTail()
    .split("\n")
    .filter((line) => /faulted: Unknown(Run|Edge)/.test(line))

const longRun = (patch: Partial<GenerateRequest> = {}): GenerateRequest => ({
  model: requireModel("stories260K.gguf"),
  prompt: "Once upon a time",
  maxTokens: 1500,
  threads: 1,
  // The contract of one run: its first fault is the end (recovery is test/e2e/recovery.test.ts's).
  recovery: { maxAttempts: 0 },
  ...patch
})

/** Stages each agent hosts right now, asked over its control link. */
const activeStages = (agents: ReadonlyArray<LocalAgent>, token: string) =>
  Effect.gen(function* () {
    const control = yield* AgentControl
    return yield* Effect.forEach(agents, (agent) =>
      Effect.scoped(
        Effect.flatMap(
          control.connect({ nodeId: NodeId.make(agent.index + 1), address: agent.address }, token),
          (link) => link.capacity
        )
      ).pipe(Effect.map((capacity) => capacity.activeStages))
    )
  }).pipe(Effect.provide(AgentControlRpc.layer))

/** Runs to the end, collecting updates; `onToken` may act mid-generation. */
const collect = (
  stream: Stream.Stream<RunUpdate, unknown>,
  onToken: (step: number) => Effect.Effect<void> = () => Effect.void
) =>
  Effect.gen(function* () {
    const updates: Array<RunUpdate> = []
    const result = yield* stream.pipe(
      Stream.runForEach((update) =>
        Effect.zipRight(
          Effect.sync(() => updates.push(update)),
          update._tag === "Token" ? onToken(update.token.step) : Effect.void
        )
      ),
      Effect.either
    )
    return { updates, result, endedAt: Date.now() }
  })

describe("end to end faults: real agent processes", () => {
  // A stage agent killed with SIGKILL mid-generation: the run ends Faulted with that stage's crash as the
  // first reason within 2 s, every other stage is stopped, the run is torn down once, and no agent
  // process is left once the orchestrator's scope closes.
  it.live(
    "kill -9 of a stage agent mid-generation faults the run within 2 s and tears everything down",
    () =>
      Effect.gen(function* () {
        let pids: ReadonlyArray<number> = []
        yield* Effect.gen(function* () {
          const { agents, layer, token } = yield* startAgents(3)
          pids = agents.map((a) => a.pid)
          let killedAt = 0
          const { endedAt, result, updates } = yield* collect(
            run(longRun({ stages: 3 })).pipe(Stream.provideLayer(layer)),
            (step) =>
              step === 5
                ? Effect.sync(() => {
                    killedAt = Date.now()
                    process.kill(agents[1]!.pid, "SIGKILL")
                  })
                : Effect.void
          )
          assert.isTrue(killedAt > 0)
          assert.isBelow(endedAt - killedAt, 2000)
          assert.isTrue(Either.isLeft(result))
          const error = (result as Either.Left<{ _tag: string; reason?: unknown; message?: string }, void>).left
          assert.strictEqual(error._tag, "RunFaulted")
          assert.deepStrictEqual(error.reason, {
            _tag: "StageFault",
            stageIndex: 1,
            reason: { _tag: "WorkerCrashed" }
          })
          assert.include(error.message, "stage 1")
          const tornDown = updates.filter((u) => u._tag === "TornDown")
          assert.strictEqual(tornDown.length, 1)
          assert.deepStrictEqual(tornDown[0], {
            _tag: "TornDown",
            outcome: "Faulted",
            unconfirmedStages: [],
            endpointsConfirmed: true
          })
          // The surviving agents host nothing any more.
          assert.deepStrictEqual(yield* activeStages([agents[0]!, agents[2]!], token), [0, 0])
        }).pipe(Effect.scoped)
        assert.isTrue(yield* eventually(() => pids.every((pid) => !isAlive(pid))))
        assert.deepStrictEqual(
          childPids(process.pid).filter((pid) => pids.includes(pid)),
          []
        )
      }),
    120_000
  )

  // The same crash in a local run, whose edges are Unix sockets carrying shared-memory rings: the run
  // faults within 2 s with the stage's crash, and neither a ring in /dev/shm nor the socket directory
  // outlives the run.
  it.live(
    "kill -9 of a local agent (Unix socket + shared-memory edges) faults the run within 2 s, leaving nothing behind",
    () =>
      Effect.gen(function* () {
        let agents: ReadonlyArray<LocalAgent> = []
        let killedAt = 0
        const { endedAt, result, updates } = yield* collect(
          run(longRun({ stages: 3 })).pipe(
            Stream.provideLayer(layerLocal({ threads: 1, onStarted: (started) => (agents = started) }))
          ),
          (step) =>
            step === 5
              ? Effect.sync(() => {
                  killedAt = Date.now()
                  process.kill(agents[1]!.pid, "SIGKILL")
                })
              : Effect.void
        )
        assert.isTrue(killedAt > 0)
        assert.isBelow(endedAt - killedAt, 2000)
        const error = (result as Either.Left<{ _tag: string; reason?: unknown; message?: string }, void>).left
        assert.strictEqual(error._tag, "RunFaulted")
        assert.deepStrictEqual(error.reason, { _tag: "StageFault", stageIndex: 1, reason: { _tag: "WorkerCrashed" } })
        assert.strictEqual(updates.filter((u) => u._tag === "TornDown").length, 1)
        const dataAddress = agents[0]!.dataAddress
        assert.strictEqual(dataAddress._tag, "Unix")
        assert.isFalse(existsSync(dirname(dataAddress._tag === "Unix" ? dataAddress.path : "/")))
        assert.deepStrictEqual(
          readdirSync("/dev/shm").filter((name) => name.startsWith("swactor-")),
          []
        )
      }),
    120_000
  )

  // The data connection into a stage is cut in the middle of a frame: the run faults with a typed
  // transport fault of a stage (not a hang, not a crash).
  it.live(
    "a stage socket stopped mid-frame gives a typed transport fault",
    () =>
      Effect.gen(function* () {
        const proxy = yield* cuttingProxy(2500)
        const { agents, layer } = yield* startAgents(2, {
          extraArgs: (index) => (index === 1 ? ["--data-advertise", `127.0.0.1:${proxy.port}`] : [])
        })
        proxy.setTarget(agents[1]!.dataPort)
        const { result, updates } = yield* collect(run(longRun({ stages: 2 })).pipe(Stream.provideLayer(layer)))
        assert.isTrue(proxy.cut())
        assert.isTrue(Either.isLeft(result))
        const error = (result as Either.Left<{ _tag: string; reason?: any; message?: string }, void>).left
        assert.strictEqual(error._tag, "RunFaulted")
        assert.strictEqual(error.reason._tag, "StageFault")
        assert.strictEqual(error.reason.reason._tag, "TransportFailed")
        assert.match(error.reason.reason.message, /Truncated|PeerClosed|Malformed/)
        assert.strictEqual(updates.filter((u) => u._tag === "TornDown").length, 1)
      }).pipe(Effect.scoped),
    120_000
  )

  // Agents whose stages never finish loading: the run faults at the readiness deadline, naming them. Meanwhile
  // the orchestrator does not poll stage 0 with token-in connections (it connects once stage 0 is ready), so the
  // agent logs no refused connection.
  it.live(
    "an agent that never becomes ready faults the run at the readiness deadline",
    () =>
      Effect.gen(function* () {
        const { agents, layer } = yield* startAgents(2, { entry: agentEntry, extraArgs: () => ["--stall-load"] })
        const started = Date.now()
        const { result, updates } = yield* collect(
          run(longRun({ stages: 2, readinessTimeout: "3 seconds" })).pipe(Stream.provideLayer(layer))
        )
        assert.isTrue(Either.isLeft(result))
        const error = (result as Either.Left<{ _tag: string; reason?: unknown; message?: string }, void>).left
        assert.deepStrictEqual(error.reason, {
          _tag: "ReadinessTimeout",
          missingStages: [0, 1],
          missingEndpoints: ["TokenIn"]
        })
        assert.include(error.message, "readiness deadline")
        assert.isAtLeast(Date.now() - started, 3000)
        assert.strictEqual(updates.filter((u) => u._tag === "TornDown").length, 1)
        for (const agent of agents) assert.deepStrictEqual(refusedAttaches(agent), [])
      }).pipe(Effect.scoped),
    60_000
  )

  // A stage whose next stage is still loading retries its outbound connect with a capped backoff, and the loading
  // agent holds each attach up to attachWait (2 s) before refusing it: over a 3 s readiness window it refuses one or
  // two attaches, not one per 25 ms (~120). Equal declared speeds keep the placement in node order: stage 1 on the
  // stalled agent 1.
  it.live(
    "a stage waiting for a loading next stage retries its connect with a capped backoff",
    () =>
      Effect.gen(function* () {
        const { agents, layer } = yield* startAgents(2, {
          entry: agentEntry,
          extraArgs: (index) => ["--speed", "1e9", ...(index === 1 ? ["--stall-load"] : [])]
        })
        const { result } = yield* collect(
          run(longRun({ stages: 2, readinessTimeout: "3 seconds" })).pipe(Stream.provideLayer(layer))
        )
        const error = (result as Either.Left<{ _tag: string; reason?: unknown }, void>).left
        assert.deepStrictEqual(error.reason, {
          _tag: "ReadinessTimeout",
          missingStages: [0, 1],
          missingEndpoints: ["TokenIn"]
        })
        const refused = refusedAttaches(agents[1]!)
        assert.isAtLeast(refused.length, 1, "stage 0 never tried to reach stage 1")
        assert.isAtMost(refused.length, 30, `${refused.length} refused attaches in 3 s`)
      }).pipe(Effect.scoped),
    60_000
  )

  // Closing the stream early is an operator stop: the stream's finalizer waits for the full teardown,
  // so right after it no agent hosts any stage.
  it.live(
    "interrupting the stream stops the run and tears every stage down",
    () =>
      Effect.gen(function* () {
        const { agents, layer, token } = yield* startAgents(2)
        const taken = yield* run(longRun({ stages: 2 })).pipe(
          Stream.filter((u) => u._tag === "Token"),
          Stream.take(5),
          Stream.runCollect,
          Effect.provide(layer)
        )
        assert.strictEqual(taken.length, 5)
        assert.deepStrictEqual(yield* activeStages(agents, token), [0, 0])
        // And an orchestrator without the cluster token gets nothing out of these agents.
        const refused = yield* Effect.flip(activeStages(agents, "not-the-cluster-token-0000"))
        assert.strictEqual(refused._tag, "AgentUnavailable")
      }).pipe(Effect.scoped),
    60_000
  )

  // An orchestrator killed with SIGKILL mid-generation: its agents notice the dropped control connection
  // and stop every stage they hosted for it (they keep running, ready for the next orchestrator).
  it.live(
    "agents stop the stages of an orchestrator that died",
    () =>
      Effect.gen(function* () {
        const { agents, token } = yield* startAgents(2)
        const { args, command } = swactorCommand([
          "run",
          "--model",
          requireModel("stories260K.gguf"),
          "--max-tokens",
          "1900",
          "--threads",
          "1",
          "--agents",
          agents.map((a) => a.address).join(",")
        ])
        yield* Effect.async<void>((resume) => {
          const child = spawn(command, args, {
            cwd: repoRoot,
            stdio: ["ignore", "pipe", "ignore"],
            env: { ...process.env, SWACTOR_CLUSTER_TOKEN: token }
          })
          child.stdout.once("data", () => child.kill("SIGKILL"))
          child.on("exit", () => resume(Effect.void))
        })
        const hosted = yield* until("the agents to stop hosting", activeStages(agents, token), (h) =>
          h.every((n) => n === 0)
        )
        assert.deepStrictEqual(hosted, [0, 0])
        for (const agent of agents) assert.isTrue(isAlive(agent.pid))
      }).pipe(Effect.scoped),
    60_000
  )

  // The orphan guard: agents watch a pipe from their parent and exit when it closes, so even a parent
  // killed with SIGKILL (no finalizers run) leaves no agent behind.
  it.live(
    "agents exit when their parent is killed with SIGKILL",
    () =>
      Effect.gen(function* () {
        const script = join(repoRoot, "test", "support", "agentsParent.mjs")
        const pids = yield* Effect.async<ReadonlyArray<number>>((resume) => {
          const child = spawn(process.execPath, [script], { cwd: repoRoot, stdio: ["ignore", "pipe", "inherit"] })
          child.stdout.once("data", (chunk) => {
            const started = JSON.parse(String(chunk)) as ReadonlyArray<number>
            child.kill("SIGKILL")
            resume(Effect.succeed(started))
          })
        })
        assert.strictEqual(pids.length, 2)
        assert.isTrue(yield* eventually(() => pids.every((pid) => !isAlive(pid))))
      }),
    60_000
  )

  // Ctrl-C on `swactor run`: the run is stopped, every stage torn down, and every agent process exits.
  it.live(
    "SIGINT to swactor run stops the run and leaves no agent process",
    () =>
      Effect.gen(function* () {
        const { args, command } = swactorCommand([
          "run",
          "--model",
          requireModel("stories260K.gguf"),
          "--stages",
          "2",
          "--max-tokens",
          "1900",
          "--threads",
          "1"
        ])
        let agentPids: ReadonlyArray<number> = []
        const result = yield* Effect.async<{
          code: number | null
          signal: string | null
          stderr: string
          waitedMs: number
        }>((resume) => {
          const child = spawn(command, args, { cwd: repoRoot, stdio: ["ignore", "pipe", "pipe"] })
          let stderr = ""
          let signalledAt = 0
          child.stderr.on("data", (chunk) => (stderr += chunk))
          child.stdout.on("data", () => {
            if (signalledAt !== 0) return
            agentPids = childPids(child.pid!)
            signalledAt = Date.now()
            child.kill("SIGINT")
          })
          child.on("exit", (code, signal) =>
            resume(Effect.succeed({ code, signal, stderr, waitedMs: Date.now() - signalledAt }))
          )
        })
        assert.strictEqual(agentPids.length, 2, `children at the first token: ${agentPids.join(", ")}`)
        assert.include(
          result.stderr,
          "stopped by the operator",
          `exit ${result.code} ${result.signal}: ${result.stderr}`
        )
        // 128 + SIGINT, as a shell expects of a program stopped by Ctrl-C
        assert.strictEqual(result.code, 130, `exit ${result.code} ${result.signal}: ${result.stderr}`)
        assert.isBelow(result.waitedMs, 10_000)
        assert.isTrue(yield* eventually(() => agentPids.every((pid) => !isAlive(pid))))
      }),
    60_000
  )
})
