/**
 * A Vulkan node serves run after run (issue 42), on Mesa's lavapipe (forced in every process, as in vulkan.test.ts).
 * A stage's GPU backend outlives its sessions: each run frees its session's caches and its scheduler's compute buffers
 * on the device, and ggml's Vulkan backend reuses its descriptor sets, writing only the bindings a shader uses. Lavapipe
 * (Debian 12's Mesa 22.3) binds every binding of a set, so one left naming a buffer since destroyed made it take a
 * reference on freed memory: the node died some runs later (SIGSEGV, "double free or corruption"; before the fix 10 of
 * 10 nodes died within 20 runs, at runs 4 to 17). The stage now replaces such a backend before it computes again
 * (NativeWeights.renewStaleBackend). Here: one Vulkan node, RUNS runs in a row over two prompts, each run's tokens
 * those of the first run of its prompt, and the node alive after every run.
 */
import { type ChildProcess, execFile, spawn } from "node:child_process"
import { existsSync } from "node:fs"
import { promisify } from "node:util"
import { afterAll, assert, beforeAll, describe, it } from "vitest"
import { generateToken, swactorMain } from "../../src/layers/agent/AgentProcesses.js"
import { repoRoot, requireModel } from "../support/models.js"
import { runJsonArgs, runJsonOutput } from "../support/runJson.js"

const run = promisify(execFile)
const ICD = "/usr/share/vulkan/icd.d/lvp_icd.x86_64.json"
const PROMPTS = ["Once upon a time", "Lily went to the park"] as const
const N = 16
const RUNS = 20
const token = generateToken()
/** lavapipe, device 0, and the cluster token, in every process this file starts. */
const env = { ...process.env, VK_ICD_FILENAMES: ICD, GGML_VK_VISIBLE_DEVICES: "0", SWACTOR_CLUSTER_TOKEN: token }

let model = ""
let node: ChildProcess | undefined
let address = ""
let log = ""

/** Starts `swactor node --backend vulkan`; resolves with its control address once it named its backend. */
const startNode = () =>
  new Promise<string>((resolve, reject) => {
    const child = spawn(
      process.execPath,
      [swactorMain(), "node", "--listen", "127.0.0.1:0", "--threads", "1", "--backend", "vulkan"],
      { cwd: repoRoot, stdio: ["ignore", "pipe", "pipe"], env }
    )
    node = child
    const collect = (chunk: Buffer) => {
      log += chunk
      const ready = /swactor-node-ready (\{.*\})/.exec(log)
      if (ready !== null && / backend, /.test(log))
        resolve(`127.0.0.1:${(JSON.parse(ready[1]!) as { port: number }).port}`)
    }
    child.stdout.on("data", collect)
    child.stderr.on("data", collect)
    child.on("exit", (code, signal) => reject(new Error(`swactor node exited (${code ?? signal}):\n${log}`)))
  })

const alive = () => node !== undefined && node.exitCode === null && node.signalCode === null

beforeAll(async () => {
  if (!existsSync(ICD)) {
    throw new Error(`Mesa's lavapipe is not installed (looked for ${ICD}): apt-get install mesa-vulkan-drivers`)
  }
  model = requireModel("stories260K.gguf")
  address = await startNode()
  assert.match(log, /vulkan backend/)
}, 120_000)

afterAll(async () => {
  if (!alive()) return
  const exited = new Promise((r) => node!.on("exit", r))
  node!.kill("SIGTERM")
  await exited
})

describe("one Vulkan node, run after run", () => {
  it(`${RUNS} runs in a row: each run's tokens those of its prompt's first run, the node alive after each`, async () => {
    const first = new Map<string, ReadonlyArray<number>>()
    for (let i = 0; i < RUNS; i++) {
      const prompt = PROMPTS[i % PROMPTS.length]!
      const outcome = await run(
        process.execPath,
        [swactorMain(), ...runJsonArgs(model, prompt, N, ["--agents", address, "--stages", "1"])],
        { env, cwd: repoRoot }
      ).then(
        ({ stdout }) =>
          runJsonOutput<{ tokens: Array<{ id: number }>; summary: { stages: Array<{ backend?: string }> } }>(stdout),
        (e: { stderr?: string }) => new Error(`run ${i + 1} failed: ${e.stderr ?? String(e)}`)
      )
      // the node first: a run fails when its node died, and the node's log says how
      assert.isTrue(alive(), `the node died during run ${i + 1} of ${RUNS}:\n${log.slice(-2000)}`)
      if (outcome instanceof Error) throw outcome
      assert.deepStrictEqual(
        outcome.summary.stages.map((s) => s.backend),
        ["vulkan"],
        "the stage ran on the Vulkan device"
      )
      const tokens = outcome.tokens.map((t) => t.id)
      assert.strictEqual(tokens.length, N)
      if (!first.has(prompt)) first.set(prompt, tokens)
      assert.deepStrictEqual(tokens, first.get(prompt), `run ${i + 1} ("${prompt}") against that prompt's first run`)
    }
    assert.notDeepEqual(first.get(PROMPTS[0]), first.get(PROMPTS[1]), "the two prompts give different tokens")
  }, 180_000)
})
