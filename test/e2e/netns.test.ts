import { assert, describe, it } from "@effect/vitest"
import { type ChildProcess, execFileSync, spawn } from "node:child_process"
import { Effect } from "effect"
import { generateToken, swactorCommand } from "../../src/layers/agent/AgentProcesses.js"
import { repoRoot, requireModel } from "../support/models.js"

// Agents in two network namespaces, the orchestrator in a third, joined by veth pairs on a bridge:
// the same `swactor run --agents` a multi-machine cluster uses, over real (virtual) interfaces.
const prefix = `swa${process.pid % 10000}`
const namespaces = { orchestrator: `${prefix}-o`, a: `${prefix}-a`, b: `${prefix}-b` } as const
const addresses = { orchestrator: "10.231.0.1", a: "10.231.0.2", b: "10.231.0.3" } as const
const bridge = `${prefix}br`

const sh = (args: ReadonlyArray<string>) => execFileSync(args[0]!, args.slice(1), { stdio: "pipe", encoding: "utf8" })

/** Why this machine cannot run the test, or undefined when it can. */
const unavailable = (): string | undefined => {
  if (process.platform !== "linux") return "network namespaces need Linux"
  if (process.getuid?.() !== 0) return "creating network namespaces needs root (CI runs as root)"
  try {
    sh(["ip", "netns", "list"])
  } catch (error) {
    return `\`ip netns\` is unavailable: ${String(error).split("\n")[0]}`
  }
  try {
    sh(["ip", "netns", "add", `${prefix}-probe`])
    sh(["ip", "netns", "del", `${prefix}-probe`])
  } catch (error) {
    return `cannot create a network namespace here: ${String(error).split("\n")[0]}`
  }
  try {
    sh(["ip", "link", "add", `${prefix}pb`, "type", "bridge"])
    sh(["ip", "link", "del", `${prefix}pb`])
    sh(["ip", "link", "add", `${prefix}pv`, "type", "veth", "peer", "name", `${prefix}pw`])
    sh(["ip", "link", "del", `${prefix}pv`])
  } catch (error) {
    return `cannot create bridge / veth links here: ${String(error).split("\n")[0]}`
  }
  return undefined
}

const setUp = () => {
  sh(["ip", "link", "add", bridge, "type", "bridge"])
  sh(["ip", "link", "set", bridge, "up"])
  for (const [role, ns] of Object.entries(namespaces) as Array<[keyof typeof namespaces, string]>) {
    const host = `${prefix}${role[0]}h`
    const peer = `${prefix}${role[0]}n`
    sh(["ip", "netns", "add", ns])
    sh(["ip", "link", "add", host, "type", "veth", "peer", "name", peer])
    sh(["ip", "link", "set", peer, "netns", ns])
    sh(["ip", "link", "set", host, "master", bridge])
    sh(["ip", "link", "set", host, "up"])
    sh(["ip", "netns", "exec", ns, "ip", "addr", "add", `${addresses[role]}/24`, "dev", peer])
    sh(["ip", "netns", "exec", ns, "ip", "link", "set", peer, "up"])
    sh(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"])
  }
}

const tearDown = () => {
  for (const ns of Object.values(namespaces)) {
    try {
      sh(["ip", "netns", "del", ns])
    } catch {}
  }
  for (const role of ["o", "a", "b"]) {
    try {
      sh(["ip", "link", "del", `${prefix}${role}h`])
    } catch {}
  }
  try {
    sh(["ip", "link", "del", bridge])
  } catch {}
}

const inNamespace = (ns: string, args: ReadonlyArray<string>, env: Record<string, string>): ChildProcess => {
  const { args: argv, command } = swactorCommand(args)
  return spawn("ip", ["netns", "exec", ns, command, ...argv], {
    cwd: repoRoot,
    stdio: ["pipe", "pipe", "pipe"],
    env: { ...process.env, ...env }
  })
}

const waitForLine = (child: ChildProcess, prefix: string, timeoutMs: number) =>
  Effect.async<string, Error>((resume) => {
    let buffered = ""
    let stderr = ""
    const timer = setTimeout(
      () => resume(Effect.fail(new Error(`no "${prefix}" line in ${timeoutMs} ms: ${stderr}`))),
      timeoutMs
    )
    child.stderr?.on("data", (chunk) => (stderr += chunk))
    child.stdout?.on("data", (chunk) => {
      buffered += chunk
      const line = buffered.split("\n").find((l) => l.startsWith(prefix))
      if (line !== undefined) {
        clearTimeout(timer)
        resume(Effect.succeed(line))
      }
    })
  })

const reason = unavailable()
if (reason !== undefined) console.log(`e2e.netns: skipped — ${reason}`)

describe("multi-host: agents in two network namespaces, the orchestrator in a third", () => {
  it.live.skipIf(reason !== undefined)(
    "swactor run --agents across namespaces gives node-llama-cpp's greedy text",
    () =>
      Effect.gen(function* () {
        const token = generateToken()
        const children: Array<ChildProcess> = []
        yield* Effect.addFinalizer(() =>
          Effect.sync(() => {
            for (const child of children) child.kill("SIGKILL")
            tearDown()
          })
        )
        tearDown()
        setUp()
        const agentEnv = { SWACTOR_CLUSTER_TOKEN: token, SWACTOR_PARENT_WATCH: "stdin" }
        for (const role of ["a", "b"] as const) {
          const agent = inNamespace(
            namespaces[role],
            ["node", "--listen", `${addresses[role]}:7070`, "--threads", "1"],
            agentEnv
          )
          children.push(agent)
          yield* waitForLine(agent, "swactor-node-ready", 60_000)
        }
        const orchestrator = inNamespace(
          namespaces.orchestrator,
          [
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
            "--agents",
            `${addresses.a}:7070,${addresses.b}:7070`
          ],
          { SWACTOR_CLUSTER_TOKEN: token }
        )
        children.push(orchestrator)
        orchestrator.stdin?.end()
        const result = yield* Effect.async<{ code: number | null; stdout: string; stderr: string }>((resume) => {
          let stdout = ""
          let stderr = ""
          orchestrator.stdout?.on("data", (chunk) => (stdout += chunk))
          orchestrator.stderr?.on("data", (chunk) => (stderr += chunk))
          orchestrator.on("exit", (code) => resume(Effect.succeed({ code, stdout, stderr })))
        })
        assert.strictEqual(result.code, 0, result.stderr)
        assert.strictEqual(
          result.stdout.trim(),
          "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, she saw"
        )
      }).pipe(Effect.scoped),
    120_000
  )
})
