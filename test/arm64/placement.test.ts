/**
 * Placement by measured speed (issue 42) on a mixed pipeline under qemu-user: an arm64 node (the arm64 Node binary and
 * native builds under `qemu-aarch64-static`, started as test/arm64/arm64.test.ts starts them) and x64 nodes, each
 * measuring its speed at start (SpeedProbe.ts). `swactor run --agents A,B` without --placement sizes each node's share
 * of stories260K's 5 blocks by the speed it reported: the emulated node, measured about 100 times slower here, gets
 * fewer blocks than the x64 node, in both orders, and the text is the one-stage run's. Forced the other way round
 * (an x64 node started with `--speed 2e6`, a declared 0.002 GB/s, below the emulated node's), the x64 node gets fewer:
 * the share follows the speed, not the architecture. (SWACTOR_BENCH_SLOWDOWN, which divides the measured speed, also
 * slows the engine by as much: at the 1000 needed to fall below the emulated node, a run misses its token deadline.)
 */
import { type ChildProcess, execFile } from "node:child_process"
import { join } from "node:path"
import { promisify } from "node:util"
import { afterAll, assert, beforeAll, describe, it } from "vitest"
import { generateToken, swactorMain } from "../../src/layers/agent/AgentProcesses.js"
import {
  type Arch,
  type Arm64Runtime,
  arm64Runtime,
  lastJson,
  startSwactorNode,
  stopChildren
} from "../support/arm64.js"
import { repoRoot, requireModel } from "../support/models.js"
import { runJsonArgs, runJsonOutput } from "../support/runJson.js"

const execFileP = promisify(execFile)
const PROMPT = "Once upon a time"
const N = 24
const env = { ...process.env, SWACTOR_CLUSTER_TOKEN: generateToken() }
/** The speed the forced x64 node declares (`swactor node --speed`), in bytes per second. */
const DECLARED = 2e6

interface Node {
  readonly name: string
  readonly address: string
  /** The speed it measured (or was declared) at start and reports to placement, in GB/s (its start line). */
  readonly gbps: number
}

interface RunOut {
  readonly text: string
  readonly tokens: ReadonlyArray<number>
  /** Per stage: its node's address and its block count. */
  readonly stages: ReadonlyArray<{ readonly address: string; readonly blocks: number }>
}

let runtime: Arm64Runtime
let model = ""
/** The one-stage run's text and tokens (equal to node-llama-cpp's). */
let single: RunOut

/** `swactor run --json` on x64 with `extra`: text, tokens, and each stage's node and block count. */
const swactorRun = async (extra: ReadonlyArray<string>): Promise<RunOut> => {
  const { stdout } = await execFileP(process.execPath, [swactorMain(), ...runJsonArgs(model, PROMPT, N, extra)], {
    env,
    cwd: repoRoot
  })
  const out = runJsonOutput<{
    text: string
    tokens: Array<{ id: number }>
    summary: { stages: Array<{ address: string; layers: [number, number] }> }
  }>(stdout)
  return {
    text: out.text,
    tokens: out.tokens.map((t) => t.id),
    stages: out.summary.stages.map((s) => ({ address: s.address, blocks: s.layers[1] - s.layers[0] }))
  }
}

const children: Array<ChildProcess> = []

/** `swactor node` on `arch` (speed measured at start, or `extra` flags), resolved at its line naming its speed. */
const startNode = (name: string, arch: Arch, extra: ReadonlyArray<string> = []) =>
  startSwactorNode<Node>({
    runtime,
    arch,
    extra,
    env,
    children,
    name,
    ready: (out, port) => {
      const speed = / backend, .*, (\d+\.\d\d) GB\/s (?:measured|declared)/.exec(out)
      return speed === null ? undefined : { name, address: `127.0.0.1:${port}`, gbps: Number(speed[1]) }
    }
  })

afterAll(() => stopChildren(children))

beforeAll(async () => {
  model = requireModel("stories260K.gguf")
  runtime = await arm64Runtime()
  const reference = execFileP(
    process.execPath,
    [join(repoRoot, "test", "support", "cpuReference.mjs"), model, PROMPT, `${N}`],
    { cwd: repoRoot, env }
  )
  single = await swactorRun(["--stages", "1"])
  const { stdout } = await reference
  const oracle = lastJson<{ tokens: Array<number> }>(stdout)
  assert.deepStrictEqual(single.tokens, oracle.tokens, "the one-stage run gives node-llama-cpp's tokens")
}, 600_000)

/** Each node's blocks in a run over `order` (a node's stages summed). */
const blocksOn = (run: RunOut, node: Node) =>
  run.stages.filter((s) => s.address === node.address).reduce((n, s) => n + s.blocks, 0)

describe("placement by measured speed on an x64 + arm64 pipeline under qemu-user: stories260K", () => {
  let arm: Node
  let x64: Node
  let declaredSlow: Node
  beforeAll(async () => {
    ;[arm, x64, declaredSlow] = await Promise.all([
      startNode("arm64", "arm64"),
      startNode("x64", "x64"),
      startNode("x64 declared 0.002 GB/s", "x64", ["--speed", String(DECLARED)])
    ])
  }, 240_000)

  /** A run over `order` (no --placement: by speed), stage i on node i; `fewer` gets fewer blocks than `more`. */
  const assertFewer = async (order: ReadonlyArray<Node>, fewer: Node, more: Node) => {
    const names = order.map((n) => `${n.name} (${n.gbps} GB/s)`).join(" -> ")
    const run = await swactorRun(["--agents", order.map((n) => n.address).join(",")])
    assert.deepStrictEqual(
      run.stages.map((s) => s.address),
      order.map((n) => n.address),
      `one stage per node, in order: ${names}`
    )
    assert.isBelow(blocksOn(run, fewer), blocksOn(run, more), `${names}: ${JSON.stringify(run.stages)}`)
    assert.strictEqual(blocksOn(run, fewer) + blocksOn(run, more), 5)
    assert.strictEqual(run.text, single.text, `${names}: the one-stage run's text`)
    assert.deepStrictEqual(run.tokens, single.tokens, names)
  }

  it("the arm64 node, measured slower, gets fewer blocks than the x64 node in both orders; the text is unchanged", async () => {
    assert.isBelow(arm.gbps * 5, x64.gbps, "the emulated node measured at least 5 times slower")
    await assertFewer([arm, x64], arm, x64)
    await assertFewer([x64, arm], arm, x64)
  }, 240_000)

  it("an x64 node declared 0.002 GB/s gets fewer blocks than the arm64 node (measured), in both orders", async () => {
    assert.isAbove(arm.gbps * 1e9, 5 * DECLARED, "the x64 node declares under a fifth of the emulated node's speed")
    await assertFewer([arm, declaredSlow], declaredSlow, arm)
    await assertFewer([declaredSlow, arm], declaredSlow, arm)
  }, 240_000)

  it("--dry-run shows each node's measured speed and its share; --placement balanced keeps the equal split", async () => {
    const dryRun = async (extra: ReadonlyArray<string>) =>
      (
        await execFileP(
          process.execPath,
          [swactorMain(), "run", "--model", model, "--agents", `${arm.address},${x64.address}`, "--dry-run", ...extra],
          { env, cwd: repoRoot }
        )
      ).stdout
    const bySpeed = await dryRun([])
    for (const [i, n] of [arm, x64].entries()) {
      assert.match(bySpeed, new RegExp(`node ${i + 1} ${n.address}: .*, \\d+\\.\\d\\d GB/s measured`), n.name)
    }
    assert.include(bySpeed, "speed placement, in the planner's cost model:")
    const share = /blocks by measured speed: (\d+) \+ (\d+) of 5 over the stages in order; the equal split would take/
    const shares = share.exec(bySpeed)
    assert.isNotNull(shares, bySpeed)
    assert.isBelow(Number(shares![1]), Number(shares![2]), bySpeed)
    // one block on the emulated node is still the slowest stage: the plan says so, and what would leave it out
    assert.include(bySpeed, "the slowest stage, on node 1, holds one block, the fewest a stage can", bySpeed)
    const balanced = await dryRun(["--placement", "balanced"])
    assert.include(balanced, "balanced placement, in the planner's cost model:")
    assert.match(balanced, /stage 0: blocks \[0, 3\) on /)
  }, 240_000)
})
