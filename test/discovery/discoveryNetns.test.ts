// Discovery across network namespaces (issue 39): three namespaces joined by veth pairs, two on one bridge (one
// subnet), the third on another bridge (another subnet). The two on one bridge find each other by multicast and
// broadcast on their real (virtual) interfaces; the third finds only itself. Skipped, saying why, where network
// namespaces cannot be made (not Linux, not root, no `ip netns`).
import { assert, describe, it } from "@effect/vitest"
import { execFileSync, spawn } from "node:child_process"
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { Effect } from "effect"
import { repoRoot } from "../support/models.js"

const prefix = `swd${process.pid % 10000}`
const nodes = [
  { role: "a", bridge: `${prefix}b1`, address: "10.239.1.1" },
  { role: "b", bridge: `${prefix}b1`, address: "10.239.1.2" },
  { role: "c", bridge: `${prefix}b2`, address: "10.239.2.1" }
] as const
const bridges = [`${prefix}b1`, `${prefix}b2`]
const namespaceOf = (role: string) => `${prefix}-${role}`

const sh = (args: ReadonlyArray<string>) => execFileSync(args[0]!, args.slice(1), { stdio: "pipe", encoding: "utf8" })

/** Why this machine cannot run the test, or undefined when it can. */
const unavailable = (): string | undefined => {
  if (process.platform !== "linux") return "network namespaces need Linux"
  if (process.getuid?.() !== 0) return "creating network namespaces needs root (CI runs as root)"
  try {
    sh(["ip", "netns", "add", `${prefix}-probe`])
    sh(["ip", "netns", "del", `${prefix}-probe`])
    sh(["ip", "link", "add", `${prefix}pb`, "type", "bridge"])
    sh(["ip", "link", "del", `${prefix}pb`])
  } catch (error) {
    return `cannot create a network namespace or a bridge here: ${String(error).split("\n")[0]}`
  }
  return undefined
}

const tearDown = () => {
  for (const { role } of nodes) {
    for (const args of [
      ["ip", "netns", "del", namespaceOf(role)],
      ["ip", "link", "del", `${prefix}${role}h`]
    ]) {
      try {
        sh(args)
      } catch {}
    }
  }
  for (const bridge of bridges) {
    try {
      sh(["ip", "link", "del", bridge])
    } catch {}
  }
}

const setUp = () => {
  for (const bridge of bridges) {
    sh(["ip", "link", "add", bridge, "type", "bridge"])
    sh(["ip", "link", "set", bridge, "up"])
  }
  for (const { role, bridge, address } of nodes) {
    const ns = namespaceOf(role)
    const host = `${prefix}${role}h`
    const peer = `${prefix}${role}n`
    sh(["ip", "netns", "add", ns])
    sh(["ip", "link", "add", host, "type", "veth", "peer", "name", peer])
    sh(["ip", "link", "set", peer, "netns", ns])
    sh(["ip", "link", "set", host, "master", bridge])
    sh(["ip", "link", "set", host, "up"])
    sh(["ip", "netns", "exec", ns, "ip", "addr", "add", `${address}/24`, "dev", peer])
    sh(["ip", "netns", "exec", ns, "ip", "link", "set", peer, "up"])
    sh(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"])
  }
}

/** Runs test/support/discoveryNode.ts in a namespace; its `view` line. */
const runNode = (role: string, address: string, stateDir: string) =>
  Effect.async<{ nodeId: string; verified: Array<string> }, Error>((resume) => {
    const child = spawn(
      "ip",
      ["netns", "exec", namespaceOf(role), process.execPath, "--import", "tsx", "test/support/discoveryNode.ts"],
      {
        cwd: repoRoot,
        stdio: ["ignore", "pipe", "pipe"],
        env: {
          ...process.env,
          SWACTOR_TEST_TOKEN: "a-cluster-token-9f3b27c1d4e5",
          SWACTOR_TEST_STATE_DIR: stateDir,
          SWACTOR_TEST_ADDRESS: `${address}:7000`,
          SWACTOR_TEST_EXPECT: "2",
          SWACTOR_TEST_DEADLINE_MS: "10000"
        }
      }
    )
    let out = ""
    let err = ""
    child.stdout.on("data", (chunk) => (out += chunk))
    child.stderr.on("data", (chunk) => (err += chunk))
    child.on("close", (code) => {
      const line = out.split("\n").find((l) => l.startsWith("view "))
      resume(
        line === undefined
          ? Effect.fail(new Error(`node ${role} exited ${code} without a view: ${err}`))
          : Effect.succeed(JSON.parse(line.slice(5)))
      )
    })
  })

/** A watching node in a namespace: its id and the ids it verified in its last `seen` line, as they come. */
const watchNode = (role: string, address: string, stateDir: string) => {
  const child = spawn(
    "ip",
    ["netns", "exec", namespaceOf(role), process.execPath, "--import", "tsx", "test/support/discoveryNode.ts"],
    {
      cwd: repoRoot,
      stdio: ["ignore", "pipe", "pipe"],
      env: {
        ...process.env,
        SWACTOR_TEST_TOKEN: "a-cluster-token-9f3b27c1d4e5",
        SWACTOR_TEST_STATE_DIR: stateDir,
        SWACTOR_TEST_ADDRESS: `${address}:7000`,
        SWACTOR_TEST_TTL_MS: "600",
        SWACTOR_TEST_WATCH_MS: "60000"
      }
    }
  )
  const last = { nodeId: "", verified: [] as Array<string> }
  let buffered = ""
  child.stdout.on("data", (chunk) => {
    buffered += chunk
    const lines = buffered.split("\n")
    buffered = lines.pop() ?? ""
    for (const line of lines) if (line.startsWith("seen ")) Object.assign(last, JSON.parse(line.slice(5)))
  })
  return { child, last }
}

/** Waits (up to 20 s) for `check`; whether it held. */
const waitFor = (check: () => boolean) =>
  Effect.gen(function* () {
    const end = Date.now() + 20_000
    while (!check() && Date.now() < end) yield* Effect.sleep("50 millis")
    return check()
  })

const reason = unavailable()
if (reason !== undefined) console.log(`discovery.netns: skipped — ${reason}`)

describe("discovery across network namespaces", () => {
  it.live.skipIf(reason !== undefined)(
    "two namespaces on one bridge find each other; a third on another bridge finds neither",
    () =>
      Effect.gen(function* () {
        const dir = mkdtempSync(join(tmpdir(), "swactor-netns-"))
        yield* Effect.addFinalizer(() =>
          Effect.sync(() => {
            tearDown()
            rmSync(dir, { recursive: true, force: true })
          })
        )
        tearDown()
        setUp()
        const [a, b, c] = yield* Effect.all(
          nodes.map(({ role, address }) => runNode(role, address, join(dir, role))),
          { concurrency: "unbounded" }
        )
        assert.deepStrictEqual([...a!.verified].sort(), [a!.nodeId, b!.nodeId].sort())
        assert.deepStrictEqual([...b!.verified].sort(), [a!.nodeId, b!.nodeId].sort())
        assert.deepStrictEqual(c!.verified, [c!.nodeId])
      }).pipe(Effect.scoped),
    60_000
  )

  it.live.skipIf(reason !== undefined)(
    "an interface that goes down and up again: the node expires meanwhile and is announced again after",
    () =>
      Effect.gen(function* () {
        const dir = mkdtempSync(join(tmpdir(), "swactor-netns-"))
        const watchers: Array<ReturnType<typeof watchNode>> = []
        yield* Effect.addFinalizer(() =>
          Effect.sync(() => {
            for (const w of watchers) w.child.kill("SIGKILL")
            tearDown()
            rmSync(dir, { recursive: true, force: true })
          })
        )
        tearDown()
        setUp()
        const a = watchNode("a", nodes[0].address, join(dir, "a"))
        const b = watchNode("b", nodes[1].address, join(dir, "b"))
        watchers.push(a, b)
        const link = (state: "up" | "down") =>
          sh(["ip", "netns", "exec", namespaceOf("a"), "ip", "link", "set", `${prefix}an`, state])
        assert.isTrue(yield* waitFor(() => a.last.nodeId !== "" && b.last.verified.includes(a.last.nodeId)), "found")
        link("down")
        assert.isTrue(yield* waitFor(() => !b.last.verified.includes(a.last.nodeId)), "expired while down")
        link("up")
        assert.isTrue(yield* waitFor(() => b.last.verified.includes(a.last.nodeId)), "announced again once up")
      }).pipe(Effect.scoped),
    90_000
  )
})
