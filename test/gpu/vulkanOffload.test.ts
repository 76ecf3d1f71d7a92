/**
 * GPU stages through ggml's scheduler (issue 42), on Mesa's lavapipe (forced in every process, as in vulkan.test.ts):
 * - a stage larger than `--gpu-memory` keeps its last blocks on the device and the rest in host memory, run by the
 *   CPU, like llama.cpp's `-ngl`; the oracle is node-llama-cpp's Vulkan build with the same split (`gpuLayers` =
 *   blocks on the device + 1, the output head), on the same device;
 * - weights of a type the device does not compute (TQ1_0: lavapipe has no TQ1_0 product) stay in host memory and
 *   their products run on the CPU, found by the device's `supports_op`, never a crash; node-llama-cpp does the same;
 * - the device memory a stage reports planning (services/DeviceFit.ts) is within 5% of what its backend allocated
 *   (ggml's buffer sizes), for the weights and the caches, and the compute buffer it kept room for covers what it used.
 * The budget is forced by the flag in each test, so the machine's free device memory never chooses the split.
 * SWACTOR_GPU_TEST_BACKEND=cuda runs the same tests on the machine's CUDA device (test/support/gpuTarget.ts).
 */
import { Effect, Exit } from "effect"
import { execFile } from "node:child_process"
import { join } from "node:path"
import { promisify } from "node:util"
import { assert, beforeAll, describe, it } from "vitest"
import { swactorMain } from "../../src/layers/agent/AgentProcesses.js"
import type { StageSummary } from "../../src/services/Orchestrator.js"
import { gpuBackend, gpuDeviceEnv, gpuDeviceName, requireGpuDevice } from "../support/gpuTarget.js"
import { repoRoot } from "../support/models.js"
import { runJsonArgs, runJsonOutput } from "../support/runJson.js"
import { runSynthCli } from "../support/synthCli.js"
import { modelFolder } from "../support/synthFiles.js"

const exec = promisify(execFile)
const PROMPT = "Once upon a time"
const N = 16
const vulkanEnv = { ...process.env, ...gpuDeviceEnv }
const dir = modelFolder("swactor-vulkan-offload-")

/** A 4-block F16 llama whose context is the run's (256), so the planned caches are the allocated ones. */
const LLAMA = { layers: 4, hidden: 256, ffn: 512, heads: 4, vocab: 400, context: 256 }
const llamaPath = join(dir, "llama-f16.gguf")
const tq1Path = join(dir, "llama-tq1_0.gguf")
/** Heads of 36: lavapipe's flash attention takes head sizes that are multiples of 8 only (its supports_op). */
const head36Path = join(dir, "llama-head36.gguf")

/** Bytes of one block of LLAMA in F16: q, k, v, o (hidden²), gate, up, down (hidden x ffn), two norms; its F16 KV. */
const blockWeightBytes = 2 * (4 * LLAMA.hidden * LLAMA.hidden + 3 * LLAMA.hidden * LLAMA.ffn) + 2 * 4 * LLAMA.hidden
const blockCacheBytes = 2 * 2 * LLAMA.hidden * LLAMA.context
/** token_embd, F16 (the input table a partial stage keeps in host memory). */
const inputBytes = 2 * LLAMA.vocab * LLAMA.hidden

const synth = async (path: string, type: string, hidden = LLAMA.hidden, layers = LLAMA.layers) => {
  const flags = [
    ["--arch", "llama"],
    ["--layers", String(layers)],
    ["--hidden", String(hidden)],
    ["--ffn", String(2 * hidden)],
    ["--heads", String(LLAMA.heads)],
    ["--vocab", String(LLAMA.vocab)],
    ["--context-length", String(LLAMA.context)],
    ["--type", type],
    ["--seed", "7"],
    ["-o", path]
  ].flat()
  const exit = await Effect.runPromise(runSynthCli(flags))
  assert.isTrue(Exit.isSuccess(exit), `swactor synth ${path}: ${String(exit)}`)
}

beforeAll(async () => {
  requireGpuDevice()
  await synth(llamaPath, "f16")
  await synth(tq1Path, "tq1_0")
  await synth(head36Path, "f16", 144, 3)
}, 60_000)

/** node-llama-cpp's Vulkan build, greedy; `gpuLayers` as llama.cpp's -ngl (default every block and the head). */
const reference = async (model: string, gpuLayers?: number): Promise<ReadonlyArray<number>> => {
  const { stdout } = await exec(
    process.execPath,
    [
      join(repoRoot, "test", "support", "vulkanReference.mjs"),
      model,
      PROMPT,
      String(N),
      ...(gpuLayers === undefined ? [] : [String(gpuLayers)])
    ],
    { env: vulkanEnv, cwd: repoRoot }
  )
  const ref = JSON.parse(stdout.trim().split("\n").at(-1)!) as { gpu: string; tokens: Array<number> }
  assert.strictEqual(ref.gpu, gpuBackend, `node-llama-cpp ran on its ${gpuBackend} build`)
  assert.isAtLeast(new Set(ref.tokens).size, 6, `a varied reference stream: ${ref.tokens.join(",")}`)
  return ref.tokens
}

/** One stage on a local Vulkan agent (`--gpu-memory` when given): its tokens and its summary. */
const swactorRun = async (model: string, gpuMemory?: number) => {
  const extra = [
    "--stages",
    "1",
    "--backend",
    gpuBackend,
    ...(gpuMemory === undefined ? [] : ["--gpu-memory", String(gpuMemory)])
  ]
  const { stdout } = await exec(process.execPath, [swactorMain(), ...runJsonArgs(model, PROMPT, N, extra)], {
    env: vulkanEnv,
    cwd: repoRoot
  })
  const out = runJsonOutput<{ tokens: Array<{ id: number }>; summary: { stages: Array<StageSummary> } }>(stdout)
  return { tokens: out.tokens.map((t) => t.id), stage: out.summary.stages[0]! }
}

/** `--dry-run`'s line for stage 0's device: its blocks on the device, device and host memory (KiB/MiB, parsed). */
const dryRun = async (model: string, gpuMemory: number) => {
  const { stderr, stdout } = await exec(
    process.execPath,
    [
      swactorMain(),
      "run",
      "--model",
      model,
      "--dry-run",
      "--stages",
      "1",
      "--backend",
      gpuBackend,
      "--gpu-memory",
      String(gpuMemory)
    ],
    { env: vulkanEnv, cwd: repoRoot }
  )
  const text = stdout + stderr
  const line = new RegExp(
    `stage 0 on ${gpuDeviceName}: (\\d+) blocks on the device .*?, device ([\\d.]+) (KiB|MiB) .*host ([\\d.]+) (KiB|MiB)`
  ).exec(text)
  assert.isNotNull(line, `a device line in the dry run:\n${text}`)
  const bytes = (n: string, unit: string) => Number(n) * (unit === "MiB" ? 2 ** 20 : 1024)
  return { blocks: Number(line![1]), deviceBytes: bytes(line![2]!, line![3]!), hostBytes: bytes(line![4]!, line![5]!) }
}

const within5 = (allocated: number, planned: number, what: string) =>
  assert.isAtMost(
    Math.abs(allocated - planned),
    0.05 * planned,
    `${what}: ${allocated} bytes allocated, ${planned} planned (more than 5% apart)`
  )

describe("a GPU stage through ggml's scheduler, on lavapipe", () => {
  it("every block on the device: node-llama-cpp's tokens; planned device memory within 5% of the allocated", async () => {
    const [expected, run] = await Promise.all([reference(llamaPath), swactorRun(llamaPath)])
    assert.deepStrictEqual(run.tokens, expected)
    const device = run.stage.device!
    assert.strictEqual(run.stage.backend, gpuBackend)
    assert.strictEqual(device.blocks, LLAMA.layers)
    assert.strictEqual(device.hostBytes, 0, "nothing in host memory")
    within5(device.allocated.weightBytes, device.weightBytes, "weights")
    within5(device.allocated.cacheBytes, device.cacheBytes, "caches")
    assert.isAbove(device.allocated.computeBytes, 0)
    assert.isAtMost(device.allocated.computeBytes, device.computeBytes, "the compute buffer within the room kept")
    assert.strictEqual(device.allocated.splits, 1, "the whole graph on the device, in one piece")
  }, 120_000)

  it("half the blocks on the device (--gpu-memory), half on the CPU: node-llama-cpp's tokens with -ngl 3", async () => {
    const full = await swactorRun(llamaPath)
    const f = full.stage.device!
    // room for the head, the compute buffer and the last two blocks: the input table and two blocks stay behind
    const budget = f.weightBytes + f.cacheBytes + f.computeBytes - inputBytes - 2 * (blockWeightBytes + blockCacheBytes)
    const [expected, half] = await Promise.all([reference(llamaPath, 3), swactorRun(llamaPath, budget)])
    const device = half.stage.device!
    assert.strictEqual(device.blocks, 2, `2 of 4 blocks on the device within ${budget} bytes`)
    assert.strictEqual(half.stage.backend, gpuBackend)
    assert.deepStrictEqual(half.tokens, expected, "node-llama-cpp with the same split")
    assert.deepStrictEqual(half.tokens, full.tokens, "and the whole stage on the device")
    within5(device.allocated.weightBytes, device.weightBytes, "device weights")
    within5(device.allocated.cacheBytes, device.cacheBytes, "device caches")
    assert.isAtMost(device.allocated.cacheBytes, 2 * blockCacheBytes + 64, "two blocks' caches on the device")
    assert.strictEqual(device.allocated.splits, 2, "host blocks on the CPU, then device blocks")
    within5(device.hostBytes, inputBytes + 2 * (blockWeightBytes + blockCacheBytes), "host memory")
    // --dry-run plans the same split from the catalog's layout and the node's reported device, before anything loads
    const preview = await dryRun(llamaPath, budget)
    assert.strictEqual(preview.blocks, 2, "the dry run's blocks on the device")
    within5(
      preview.deviceBytes,
      device.weightBytes + device.cacheBytes + device.computeBytes,
      "dry run's device memory"
    )
    within5(preview.hostBytes, device.hostBytes, "dry run's host memory")
  }, 180_000)

  it("--gpu-memory 0: every block on the CPU, the same tokens", async () => {
    const [full, none] = await Promise.all([swactorRun(llamaPath), swactorRun(llamaPath, 0)])
    assert.strictEqual(none.stage.backend, "cpu")
    assert.strictEqual(none.stage.device!.blocks, 0)
    assert.strictEqual(none.stage.device!.allocated.weightBytes, 0)
    assert.deepStrictEqual(none.tokens, full.tokens)
  }, 120_000)

  it("TQ1_0 weights the device does not compute stay in host memory, their products on the CPU: node-llama-cpp's tokens", async () => {
    const [expected, run] = await Promise.all([reference(tq1Path), swactorRun(tq1Path)])
    assert.deepStrictEqual(run.tokens, expected)
    const device = run.stage.device!
    assert.strictEqual(run.stage.backend, gpuBackend)
    assert.strictEqual(device.blocks, LLAMA.layers, "every block on the device")
    // only the F32 norms are on the device; every TQ1_0 matrix (token_embd included) is pinned to host memory
    assert.strictEqual(device.allocated.weightBytes, device.weightBytes)
    assert.isBelow(device.weightBytes, 4 * LLAMA.hidden * (2 * LLAMA.layers + 1) + 1024)
    assert.isAbove(device.hostBytes, 100_000, "the TQ1_0 matrices in host memory")
    assert.isAbove(device.allocated.splits!, LLAMA.layers, "the products on the CPU, between device pieces")
  }, 120_000)

  it("an op the device does not compute (flash attention over heads of 36) runs on the CPU: node-llama-cpp's tokens", async () => {
    const [expected, run] = await Promise.all([reference(head36Path), swactorRun(head36Path)])
    assert.deepStrictEqual(run.tokens, expected)
    const device = run.stage.device!
    assert.strictEqual(run.stage.backend, gpuBackend)
    assert.strictEqual(device.blocks, 3, "every block's weights on the device")
    // each block's attention on the CPU: the graph leaves the device and comes back once per block
    assert.strictEqual(device.allocated.splits, 1 + 2 * 3)
  }, 120_000)
})
