// `--join` (issue 39), for networks that drop multicast. In-process over real UDP sockets on loopback: a joiner sends
// only by unicast (no LAN) to a pool node's listener, which relays the verified join onto its LAN (here `lo`, to the
// orchestrator's port): the orchestrator verifies the joiner as from the joiner, never having heard it; a pool member's
// plain LAN announcement is not relayed; a relay whose address is altered is refused. Through the real program: a node
// whose multicast goes to another discovery port than the orchestrator's (it reaches nobody) joins with only an
// invite (`swactor invite`, no token in its environment), and `run --discover` finds it and gives node-llama-cpp's
// text. Needs dist/ (npm run build) like the other command-line tests.
import { assert, describe, it } from "@effect/vitest"
import { type ChildProcess, execFileSync, spawn } from "node:child_process"
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { Effect, Redacted } from "effect"
import {
  type Announcement,
  decodeDatagram,
  type DiscoveryView,
  emptyDiscovered,
  hear,
  viewOf
} from "../../src/domain/discovery.js"
import { generateToken, swactorMain } from "../../src/layers/agent/AgentProcesses.js"
import { makeAnnouncer } from "../../src/layers/discovery/Announcer.js"
import { makeDiscoveryListener } from "../../src/layers/discovery/DiscoveryListener.js"
import { readDatagram, relayedDatagram, signedDatagram } from "../../src/layers/discovery/DiscoveryProof.js"
import { repoRoot, requireModel } from "../support/models.js"

const token = Redacted.make("a-cluster-token-9f3b27c1d4e5")
const loopback = { only: ["lo"] }
const resources = () => ({ totalMemoryBytes: 8e9, freeMemoryBytes: 4e9, cores: 4, backend: "cpu" })

const until = (view: Effect.Effect<DiscoveryView>, check: (v: DiscoveryView) => boolean) =>
  Effect.gen(function* () {
    const end = Date.now() + 5000
    let v = yield* view
    while (!check(v) && Date.now() < end) {
      yield* Effect.sleep("50 millis")
      v = yield* view
    }
    return v
  })

const ids = (v: DiscoveryView) => v.verified.map((n) => n.nodeId).sort()

describe("--join", () => {
  it("a relayed join is heard as from the joiner; an altered relay is refused; a relay is never relayed", () => {
    const join: Announcement = {
      kind: "announce",
      nodeId: "joiner",
      address: "0.0.0.0:7003",
      startedAt: 1,
      counter: 0,
      ttlMillis: 5000,
      resources: resources(),
      join: true
    }
    const relayed = relayedDatagram(token, signedDatagram(token, join), "10.0.2.9:50000")!
    const heard = readDatagram(token, relayed, "10.0.1.5:41739")
    assert.deepInclude(heard, { _tag: "Verified", from: "10.0.2.9:50000", relayed: true })
    const state = hear(emptyDiscovered, heard, 0, 1000)
    assert.deepStrictEqual(
      viewOf(state).verified.map((n) => n.address),
      ["10.0.2.9:7003"]
    )
    assert.isUndefined(relayedDatagram(token, relayed, "10.0.1.5:41739"))
    const datagram = JSON.parse(relayed.toString("utf8"))
    const altered = Buffer.from(JSON.stringify({ ...datagram, relay: { ...datagram.relay, from: "10.9.9.9:1" } }))
    assert.strictEqual(readDatagram(token, altered, "10.0.1.5:41739")._tag, "Refused")
    assert.isTrue(decodeDatagram(relayed.toString("utf8"))._tag === "Right")
  })

  it.live(
    "a joiner reaches the orchestrator only through a pool node's relay; a plain announcement is not relayed",
    () =>
      Effect.gen(function* () {
        const orchestrator = yield* makeDiscoveryListener({ token, port: 0, interfaces: loopback })
        const poolNode = yield* makeAnnouncer({
          token,
          nodeId: "pool-a",
          address: "127.0.0.1:7001",
          resources,
          interfaces: loopback,
          port: orchestrator.port,
          intervalMillis: 100
        })
        const relaying = yield* makeDiscoveryListener({ token, port: 0, interfaces: loopback, relay: poolNode.relay })
        yield* makeAnnouncer({
          token,
          nodeId: "joiner",
          address: "127.0.0.1:7003",
          resources,
          lan: false,
          targets: [`127.0.0.1:${relaying.port}`],
          intervalMillis: 100
        })
        // a LAN announcement reaching the pool node's listener (not a join): heard there, never relayed
        yield* makeAnnouncer({
          token,
          nodeId: "plain",
          address: "127.0.0.1:7004",
          resources,
          interfaces: loopback,
          port: relaying.port,
          intervalMillis: 100
        })
        const view = yield* until(orchestrator.view, (v) => v.verified.length >= 2)
        assert.deepStrictEqual(ids(view), ["joiner", "pool-a"])
        assert.deepStrictEqual(view.verified.find((n) => n.nodeId === "joiner")?.address, "127.0.0.1:7003")
        assert.deepStrictEqual(ids(yield* until(relaying.view, (v) => v.verified.length >= 2)), ["joiner", "plain"])
        yield* Effect.sleep("500 millis")
        assert.deepStrictEqual(ids(yield* orchestrator.view), ["joiner", "pool-a"])
      }).pipe(Effect.scoped)
  )

  it.live(
    "a node with only an invite, its multicast reaching no orchestrator, is found by run --discover: node-llama-cpp's text",
    () =>
      Effect.gen(function* () {
        const dir = mkdtempSync(join(tmpdir(), "swactor-join-"))
        const children: Array<ChildProcess> = []
        yield* Effect.addFinalizer(() =>
          Effect.sync(() => {
            for (const child of children) child.kill("SIGKILL")
            rmSync(dir, { recursive: true, force: true })
          })
        )
        const clusterToken = generateToken()
        const orchestratorPort = 20000 + ((process.pid + 7) % 20000)
        const nodePort = 20000 + ((process.pid + 13) % 20000)
        const invite = execFileSync(
          process.execPath,
          [swactorMain(), "invite", "--address", `127.0.0.1:${orchestratorPort}`],
          {
            cwd: repoRoot,
            encoding: "utf8",
            env: { ...process.env, SWACTOR_CLUSTER_TOKEN: clusterToken }
          }
        ).trim()
        const nodeEnv: NodeJS.ProcessEnv = {
          ...process.env,
          SWACTOR_DISCOVERY_PORT: String(nodePort),
          XDG_STATE_HOME: dir
        }
        delete nodeEnv["SWACTOR_CLUSTER_TOKEN"]
        const node = spawn(
          process.execPath,
          [swactorMain(), "node", "--listen", "127.0.0.1:0", "--threads", "1", "--join", invite],
          { cwd: repoRoot, stdio: ["ignore", "pipe", "pipe"], env: nodeEnv }
        )
        children.push(node)
        let nodeErr = ""
        node.stderr.on("data", (chunk) => (nodeErr += chunk))
        yield* Effect.async<void, Error>((resume) => {
          node.stdout.on("data", (chunk) => String(chunk).includes("swactor-node-ready") && resume(Effect.void))
          node.on("exit", (code) => resume(Effect.fail(new Error(`swactor node exited ${code}: ${nodeErr}`))))
        })
        const run = spawn(
          process.execPath,
          [
            swactorMain(),
            "run",
            "--model",
            requireModel("stories260K.gguf"),
            "--prompt",
            "Once upon a time",
            "--max-tokens",
            "32",
            "--threads",
            "1",
            "--quiet",
            "--discover"
          ],
          {
            cwd: repoRoot,
            stdio: ["ignore", "pipe", "pipe"],
            env: {
              ...process.env,
              SWACTOR_CLUSTER_TOKEN: clusterToken,
              SWACTOR_DISCOVERY_PORT: String(orchestratorPort)
            }
          }
        )
        children.push(run)
        const result = yield* Effect.async<{ code: number | null; stdout: string; stderr: string }>((resume) => {
          let stdout = ""
          let stderr = ""
          run.stdout.on("data", (chunk) => (stdout += chunk))
          run.stderr.on("data", (chunk) => (stderr += chunk))
          run.on("exit", (code) => resume(Effect.succeed({ code, stdout, stderr })))
        })
        assert.strictEqual(result.code, 0, result.stderr)
        assert.strictEqual(result.stderr.match(/swactor: discovered node [0-9a-f]{32} at 127\.0\.0\.1:\d+/g)?.length, 1)
        assert.include(nodeErr, `and to 127.0.0.1:${orchestratorPort} (--join)`)
        assert.notInclude(nodeErr, clusterToken)
        assert.strictEqual(
          result.stdout.trim(),
          "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, she saw"
        )
      }).pipe(Effect.scoped),
    120_000
  )
})
