/**
 * GPU stages on Vulkan (issue 42), proven on a software device: Mesa's lavapipe (Debian's mesa-vulkan-drivers, which
 * .ci/run installs), forced in every process by VK_ICD_FILENAMES and GGML_VK_VISIBLE_DEVICES, so the machine does not
 * choose the device. The oracle is node-llama-cpp's Vulkan build on the same device (test/support/vulkanReference.mjs,
 * a process of its own). Each swactor process loads node-llama-cpp's Vulkan package by the backend's name.
 * SWACTOR_GPU_TEST_BACKEND=cuda runs the same tests on the machine's CUDA device (test/support/gpuTarget.ts).
 */
import { execFile, spawn } from "node:child_process"
import { join } from "node:path"
import { promisify } from "node:util"
import { afterAll, assert, beforeAll, describe, it } from "vitest"
import { generateToken, swactorMain } from "../../src/layers/agent/AgentProcesses.js"
import {
  gpuBackend,
  gpuDescriptionPattern,
  gpuDeviceEnv,
  gpuDeviceName,
  type GpuTestBackend,
  noGpuDeviceEnv,
  requireGpuDevice
} from "../support/gpuTarget.js"
import { repoRoot, requireModel } from "../support/models.js"
import { runJsonArgs, runJsonOutput } from "../support/runJson.js"

const run = promisify(execFile)
const PROMPT = "Once upon a time"
const N = 24
/** lavapipe, device 0 (or the CUDA device), in every process this file starts. */
const vulkanEnv = { ...process.env, ...gpuDeviceEnv }

let model = ""
let reference: ReadonlyArray<number> = []

beforeAll(async () => {
  requireGpuDevice()
  model = requireModel("stories260K.gguf")
  const { stdout } = await run(
    process.execPath,
    [join(repoRoot, "test", "support", "vulkanReference.mjs"), model, PROMPT, String(N)],
    { env: vulkanEnv, cwd: repoRoot }
  )
  const ref = JSON.parse(stdout.trim().split("\n").at(-1)!) as { gpu: string; tokens: Array<number> }
  assert.strictEqual(ref.gpu, gpuBackend, `node-llama-cpp ran on its ${gpuBackend} build`)
  reference = ref.tokens
  assert.strictEqual(reference.length, N)
}, 120_000)

/** `swactor run --json`'s generated token ids, and its stderr. */
const swactorRun = async (args: ReadonlyArray<string>, env: NodeJS.ProcessEnv = vulkanEnv) => {
  const { stdout, stderr } = await run(process.execPath, [swactorMain(), ...runJsonArgs(model, PROMPT, N, args)], {
    env,
    cwd: repoRoot
  })
  const out = runJsonOutput<{
    ok: boolean
    tokens: Array<{ id: number }>
    summary: { stages: Array<{ backend?: string }> }
  }>(stdout)
  return { tokens: out.tokens.map((t) => t.id), backends: out.summary.stages.map((s) => s.backend), stderr }
}

describe("Vulkan stages on lavapipe: node-llama-cpp's Vulkan tokens", () => {
  for (const stages of [1, 2, 3]) {
    it(`stories260K, --backend ${gpuBackend}, ${stages} stage(s)`, async () => {
      const { backends, tokens } = await swactorRun(["--stages", String(stages), "--backend", gpuBackend])
      assert.deepStrictEqual(backends, Array(stages).fill(gpuBackend), "every stage computed on the GPU device")
      assert.deepStrictEqual(tokens, reference)
    }, 120_000)
  }

  it(`--backend ${gpuBackend} with no ${gpuBackend} device: one line naming the backend and the node's devices`, async () => {
    const failed = await swactorRun(["--stages", "1", "--backend", gpuBackend], {
      ...vulkanEnv,
      ...noGpuDeviceEnv
    }).then(
      () => undefined,
      (e: { code: number; stderr: string }) => e
    )
    assert.isDefined(failed, "the run failed")
    assert.notStrictEqual(failed!.code, 0)
    assert.match(
      failed!.stderr,
      new RegExp(`no ${gpuBackend} device in @node-llama-cpp/linux-x64-${gpuBackend}: this node has CPU`)
    )
  }, 120_000)
})

describe("a pipeline of one Vulkan node and one CPU node", () => {
  const token = generateToken()
  const nodes: Array<{ stop: () => Promise<void>; address: string; log: () => string }> = []
  const startNode = (backend: GpuTestBackend | "cpu") =>
    new Promise<(typeof nodes)[number]>((resolve, reject) => {
      const child = spawn(
        process.execPath,
        [swactorMain(), "node", "--listen", "127.0.0.1:0", "--threads", "1", "--backend", backend],
        {
          cwd: repoRoot,
          stdio: ["ignore", "pipe", "pipe"],
          env: { ...vulkanEnv, SWACTOR_CLUSTER_TOKEN: token }
        }
      )
      let out = ""
      const collect = (chunk: Buffer) => {
        out += chunk
        const ready = /swactor-node-ready (\{.*\})/.exec(out)
        // the ready line (stdout), then the node's line naming its backend (stderr)
        if (ready !== null && / backend, /.test(out)) {
          const { port } = JSON.parse(ready[1]!) as { port: number }
          resolve({
            address: `127.0.0.1:${port}`,
            log: () => out,
            stop: async () => {
              child.kill("SIGTERM")
              if (child.exitCode === null && child.signalCode === null) await new Promise((r) => child.on("exit", r))
            }
          })
        }
      }
      child.stdout.on("data", collect)
      child.stderr.on("data", collect)
      child.on("exit", (code) => reject(new Error(`swactor node --backend ${backend} exited (${code}):\n${out}`)))
    })
  afterAll(async () => {
    for (const n of nodes) await n.stop()
  })

  it("--dry-run and /metrics show each node's devices: lavapipe as a GPU on the Vulkan node, the CPU on both", async () => {
    const [vk, cpu] = nodes.length === 2 ? nodes : [await startNode(gpuBackend), await startNode("cpu")]
    if (nodes.length === 0) nodes.push(vk!, cpu!)
    const agents = ["--agents", `${vk!.address},${cpu!.address}`]
    const { stdout } = await run(
      process.execPath,
      [swactorMain(), "run", "--model", model, "--stages", "2", "--dry-run", ...agents],
      { env: { ...vulkanEnv, SWACTOR_CLUSTER_TOKEN: token }, cwd: repoRoot }
    )
    const nodeBlock = (address: string) => {
      const lines = stdout.split("\n")
      const at = lines.findIndex((l) => l.includes(` ${address}: `))
      assert.isAtLeast(at, 0, stdout)
      const devices: Array<string> = []
      for (const l of lines.slice(at + 1)) {
        if (!l.startsWith("    device ")) break
        devices.push(l)
      }
      return devices
    }
    const vkDevices = nodeBlock(vk!.address)
    const gpuLine = `device ${gpuDeviceName} \\(${gpuDescriptionPattern}\\): gpu, [\\d.]+ GiB free of [\\d.]+ GiB`
    assert.match(vkDevices[0] ?? "", new RegExp(gpuLine), stdout)
    assert.match(vkDevices.at(-1) ?? "", /device CPU \(.*\): cpu, /, stdout)
    const cpuDevices = nodeBlock(cpu!.address)
    assert.strictEqual(cpuDevices.length, 1, stdout)
    assert.match(cpuDevices[0]!, /device CPU \(.*\): cpu, [\d.]+ GiB free of [\d.]+ GiB/)

    const server = spawn(
      process.execPath,
      [swactorMain(), "serve", "--model", model, "--stages", "2", "--port", "0", ...agents],
      { cwd: repoRoot, stdio: ["ignore", "ignore", "pipe"], env: { ...vulkanEnv, SWACTOR_CLUSTER_TOKEN: token } }
    )
    try {
      let stderr = ""
      const url = await new Promise<string | undefined>((resolve) => {
        server.stderr.on("data", (chunk) => {
          stderr += chunk
          const at = /listening on (http:\/\/\S+)/.exec(stderr)
          if (at !== null && stderr.includes("ready:")) resolve(at[1])
        })
        server.on("exit", () => resolve(undefined))
      })
      assert.isDefined(url, stderr)
      const metrics = await fetch(`${url}/metrics`).then((r) => r.text())
      const gpuTotal = new RegExp(
        `swactor_agent_device_memory_bytes\\{address="${vk!.address}",pid="\\d+",device="${gpuDeviceName}",kind="gpu",state="total"\\} (\\d+)`
      ).exec(metrics)
      assert.isNotNull(gpuTotal, metrics)
      assert.isAbove(Number(gpuTotal![1]), 0)
      assert.match(
        metrics,
        new RegExp(
          `device_memory_bytes\\{address="${cpu!.address}",pid="\\d+",device="CPU",kind="cpu",state="free"\\} \\d+`
        )
      )
      assert.notMatch(metrics, new RegExp(`address="${cpu!.address}"[^}]*kind="gpu"`))
    } finally {
      server.kill("SIGTERM")
      if (server.exitCode === null) await new Promise((r) => server.on("exit", r))
    }
  }, 120_000)

  it("Vulkan then CPU, and CPU then Vulkan: node-llama-cpp's Vulkan tokens both ways", async () => {
    if (nodes.length === 0) nodes.push(await startNode(gpuBackend), await startNode("cpu"))
    const [vk, cpu] = nodes as [(typeof nodes)[number], (typeof nodes)[number]]
    assert.match(vk.log(), new RegExp(`${gpuBackend} backend`))
    assert.match(cpu.log(), /cpu backend/)
    for (const order of [
      [vk, cpu],
      [cpu, vk]
    ]) {
      const { backends, tokens } = await swactorRun(
        ["--agents", order.map((n) => n.address).join(","), "--stages", "2"],
        { ...vulkanEnv, SWACTOR_CLUSTER_TOKEN: token }
      )
      const names = order.map((n) => (n === vk ? gpuBackend : "cpu"))
      assert.deepStrictEqual(backends, names, "each stage on its node's backend")
      assert.deepStrictEqual(tokens, reference, names.join(" -> "))
    }
  }, 240_000)
})
