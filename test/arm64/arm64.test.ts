/**
 * Linux arm64 nodes (issue 42), proven under emulation: scripts/arm64-runtime.mjs fetches the arm64 Node binary and
 * the arm64 builds of koffi and node-llama-cpp (pinned there), and every arm64 process here is started as
 * `qemu-aarch64-static -L /usr/aarch64-linux-gnu NODE ...` (no binfmt_misc). An arm64 process is checked to be one: its
 * /proc/PID/maps holds the arm64 koffi.node and node-llama-cpp's linux-arm64 libggml-base.so, and no x64 build.
 * The oracle is node-llama-cpp itself, on its arm64 build under the same emulation and on its x64 build
 * (test/support/cpuReference.mjs): greedy stories260K tokens, equal on both.
 *
 * `swactor run --stages 2` starts its agents as process.execPath, which the kernel cannot exec without binfmt_misc, so
 * the arm64 run here is `swactor run --agents A,B --stages 2` over two arm64 nodes started the same way.
 */
import { type ChildProcess, execFile } from "node:child_process"
import { readFileSync } from "node:fs"
import { join } from "node:path"
import { promisify } from "node:util"
import { afterAll, assert, beforeAll, describe, it } from "vitest"
import { generateToken, swactorMain } from "../../src/layers/agent/AgentProcesses.js"
import {
  type Arch,
  type Arm64Runtime,
  arm64Runtime,
  lastJson,
  nodeArgv,
  startSwactorNode,
  stopChildren
} from "../support/arm64.js"
import { repoRoot, requireModel } from "../support/models.js"
import { runJsonArgs, runJsonOutput } from "../support/runJson.js"

const execFileP = promisify(execFile)
const PROMPT = "Once upon a time"
const N = 24
const token = generateToken()
const env = { ...process.env, SWACTOR_CLUSTER_TOKEN: token }

let runtime: Arm64Runtime
let model = ""
let reference: ReadonlyArray<number> = []

const argvOf = (arch: Arch, args: ReadonlyArray<string>) => nodeArgv(runtime, arch, args)

/** The native builds a live process has mapped: koffi.node's and libggml-base.so's paths. */
const nativeBuilds = (pid: number) => [
  ...new Set(
    readFileSync(`/proc/${pid}/maps`, "utf8")
      .split("\n")
      .map((line) => line.split(/\s+/).at(-1) ?? "")
      .filter((path) => path.endsWith("/koffi.node") || path.endsWith("/libggml-base.so"))
  )
]

const assertArm64 = (pid: number) => {
  const builds = nativeBuilds(pid)
  assert.isTrue(
    builds.some((p) => p.endsWith("/linux_arm64/koffi.node")),
    `koffi's arm64 build is loaded: ${builds}`
  )
  assert.isTrue(
    builds.some((p) => p.endsWith("/@node-llama-cpp/linux-arm64/bins/linux-arm64/libggml-base.so")),
    `node-llama-cpp's linux-arm64 ggml is loaded: ${builds}`
  )
  assert.isFalse(
    builds.some((p) => p.includes("x64")),
    `no x64 build is loaded: ${builds}`
  )
}

/** node-llama-cpp's greedy tokens on its CPU build for `arch`, in a process of its own. */
const nodeLlamaCpp = async (arch: Arch) => {
  const { command, args } = argvOf(arch, [join(repoRoot, "test", "support", "cpuReference.mjs"), model, PROMPT, `${N}`])
  const { stdout } = await execFileP(command, args, {
    cwd: repoRoot,
    env: { ...env, SWACTOR_TEST_QEMU: arch === "arm64" ? `${runtime.qemu} ${runtime.sysroot}` : "" }
  })
  const out = lastJson<{ arch: string; tokens: Array<number> }>(stdout)
  assert.strictEqual(out.arch, arch, "node-llama-cpp's process ran on the asked architecture")
  return out.tokens
}

beforeAll(async () => {
  model = requireModel("stories260K.gguf")
  runtime = await arm64Runtime()
  const [onX64, onArm64] = await Promise.all([nodeLlamaCpp("x64"), nodeLlamaCpp("arm64")])
  assert.deepStrictEqual(onArm64, onX64, "node-llama-cpp gives the same tokens on arm64 and x64")
  assert.strictEqual(onX64.length, N)
  reference = onX64
}, 600_000)

/** `swactor run --json`'s token ids and stage addresses. */
const swactorRun = async (arch: Arch, args: ReadonlyArray<string>) => {
  const { command, args: argv } = argvOf(arch, [swactorMain(), ...runJsonArgs(model, PROMPT, N, args)])
  const { stdout } = await execFileP(command, argv, { env, cwd: repoRoot })
  const out = runJsonOutput<{
    tokens: Array<{ id: number }>
    summary: { stages: Array<{ address: string; layers: [number, number] }> }
  }>(stdout)
  for (const s of out.summary.stages) assert.isAbove(s.layers[1], s.layers[0], `stage on ${s.address} holds blocks`)
  return { tokens: out.tokens.map((t) => t.id), stages: out.summary.stages }
}

interface Node {
  readonly arch: Arch
  readonly address: string
  readonly pid: number
}

const children: Array<ChildProcess> = []
afterAll(() => stopChildren(children))

/** `swactor node` on `arch`, resolved at its ready line and the line naming its backend. */
const startNode = (arch: Arch) =>
  startSwactorNode<Node>({
    runtime,
    arch,
    env,
    children,
    name: `on ${arch}`,
    ready: (out, port, pid) => (/ backend, /.test(out) ? { arch, address: `127.0.0.1:${port}`, pid } : undefined)
  })

describe("swactor on Linux arm64 under qemu-user: stories260K", () => {
  let nodes: ReadonlyArray<Node> = []
  beforeAll(async () => {
    nodes = await Promise.all([startNode("arm64"), startNode("arm64"), startNode("x64")])
  }, 240_000)

  it("the arm64 nodes load the arm64 builds of koffi and node-llama-cpp", () => {
    for (const node of nodes.filter((n) => n.arch === "arm64")) assertArm64(node.pid)
    assert.isTrue(
      nativeBuilds(nodes[2]!.pid).every((p) => p.includes("x64")),
      "the x64 node loads x64 builds"
    )
  })

  it("an arm64 run over two arm64 stages gives node-llama-cpp's tokens, and x64 run --stages 2 the same", async () => {
    const [a, b] = nodes
    const onArm64 = await swactorRun("arm64", ["--agents", `${a!.address},${b!.address}`, "--stages", "2"])
    assert.deepStrictEqual(
      onArm64.stages.map((s) => s.address),
      [a!.address, b!.address]
    )
    assert.deepStrictEqual(onArm64.tokens, reference, "arm64 swactor = node-llama-cpp")
    const onX64 = await swactorRun("x64", ["--stages", "2"])
    assert.deepStrictEqual(onX64.tokens, onArm64.tokens, "x64 swactor = arm64 swactor")
  }, 240_000)

  it("one arm64 node and one x64 node, in both orders, give the same tokens", async () => {
    const [arm, , x] = nodes
    for (const order of [
      [arm!, x!],
      [x!, arm!]
    ]) {
      const names = order.map((n) => n.arch).join(" -> ")
      const { stages, tokens } = await swactorRun("x64", [
        "--agents",
        order.map((n) => n.address).join(","),
        "--stages",
        "2"
      ])
      assert.deepStrictEqual(
        stages.map((s) => s.address),
        order.map((n) => n.address),
        `stages on ${names}`
      )
      assert.deepStrictEqual(tokens, reference, names)
    }
  }, 240_000)
})
