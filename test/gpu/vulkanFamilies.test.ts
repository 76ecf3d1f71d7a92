/**
 * Vulkan stages on lavapipe (issue 42) across the families and weight types: tiny synthetic models (`swactor synth`,
 * 3-4 blocks, hidden 128-256, vocabulary 400) of llama (Q8_0, Q4_K, F16), qwen3moe, gemma3, qwen35 (DeltaNet) and
 * deepseek2 (MLA), each run greedy by `swactor run --backend vulkan` at 1-3 stages: every stage reports the Vulkan
 * device (a silent CPU fallback fails) and the tokens equal node-llama-cpp's Vulkan build on the same device
 * (test/support/vulkanReference.mjs, a process of its own). Then a Vulkan stage's agent killed with SIGKILL
 * mid-generation: the run resumes, every stage on Vulkan, with the uninterrupted run's text. VK_ICD_FILENAMES and
 * GGML_VK_VISIBLE_DEVICES are forced in every process, as in vulkan.test.ts.
 *
 * The prompt is short (14 tokens) and every reference stream varied (at least 8 distinct tokens). A 50-token prompt
 * on the expert families (qwen3moe, deepseek2) crashes node-llama-cpp's own Vulkan build with SIGSEGV in a thread of
 * lavapipe's (Debian 12's Mesa 22.3.6) in most runs, with flash attention on (as both sides run), and our agent the
 * same way; the dense families at 50 tokens, and the expert ones without flash attention, do not.
 * SWACTOR_GPU_TEST_BACKEND=cuda runs the same tests on the machine's CUDA device (test/support/gpuTarget.ts).
 */
import { Effect, Either, Exit, Stream } from "effect"
import { execFile } from "node:child_process"
import { join } from "node:path"
import { promisify } from "node:util"
import { assert, beforeAll, describe, it } from "vitest"
import { layerLocal, run as generate } from "../../src/api/generate.js"
import { type LocalAgent, swactorMain } from "../../src/layers/agent/AgentProcesses.js"
import type { RunUpdate } from "../../src/services/Orchestrator.js"
import { gpuBackend, gpuDeviceEnv, requireGpuDevice } from "../support/gpuTarget.js"
import { repoRoot } from "../support/models.js"
import { runSynthCli } from "../support/synthCli.js"
import { modelFolder } from "../support/synthFiles.js"
import { runJsonArgs, runJsonOutput } from "../support/runJson.js"

const exec = promisify(execFile)
const PROMPT = "Once upon a time"
const N = 16
/** lavapipe, device 0 (or the CUDA device), in every process this file starts. */
const vulkanEnv = gpuDeviceEnv
const dir = modelFolder("swactor-vulkan-families-")

interface Case {
  readonly name: string
  readonly stages: number
  /** `swactor synth` flags over `base`'s. */
  readonly synth: Readonly<Record<string, string>>
}

const base = { layers: "3", hidden: "128", ffn: "256", heads: "2", type: "f16", vocab: "400", seed: "7" }

/** Each family and type, at the stage count it runs with (1-3 over the file). */
const cases: ReadonlyArray<Case> = [
  { name: "llama-q8_0", stages: 3, synth: { arch: "llama", type: "q8_0" } },
  { name: "llama-q4_k", stages: 2, synth: { arch: "llama", type: "q4_k", hidden: "256", ffn: "512", heads: "4" } },
  { name: "llama-f16", stages: 1, synth: { arch: "llama" } },
  { name: "qwen3moe-f16", stages: 2, synth: { arch: "qwen3moe", experts: "4", "expert-ffn": "128", seed: "2" } },
  { name: "gemma3-f16", stages: 3, synth: { arch: "gemma3", "sliding-window": "8", "swa-pattern": "3" } },
  { name: "qwen35-f16", stages: 2, synth: { arch: "qwen35", layers: "4", "kv-heads": "1", "head-dim": "64" } },
  {
    name: "deepseek2-f16",
    stages: 2,
    synth: { arch: "deepseek2", hidden: "256", heads: "4", "kv-heads": "1", experts: "4", "expert-ffn": "128" }
  }
]

const pathOf = (name: string) => join(dir, `${name}.gguf`)

beforeAll(async () => {
  requireGpuDevice()
  for (const c of cases) {
    const flags = Object.entries({ ...base, ...c.synth }).flatMap(([k, v]) => [`--${k}`, v])
    const exit = await Effect.runPromise(runSynthCli([...flags, "--context-length", "512", "-o", pathOf(c.name)]))
    assert.isTrue(Exit.isSuccess(exit), `swactor synth ${c.name}: ${String(exit)}`)
  }
}, 60_000)

/** node-llama-cpp's Vulkan build, greedy, on `model`. */
const reference = async (model: string): Promise<ReadonlyArray<number>> => {
  const { stdout } = await exec(
    process.execPath,
    [join(repoRoot, "test", "support", "vulkanReference.mjs"), model, PROMPT, String(N)],
    { env: { ...process.env, ...vulkanEnv }, cwd: repoRoot }
  )
  const ref = JSON.parse(stdout.trim().split("\n").at(-1)!) as { gpu: string; tokens: Array<number> }
  assert.strictEqual(ref.gpu, gpuBackend, `node-llama-cpp ran on its ${gpuBackend} build`)
  assert.strictEqual(ref.tokens.length, N)
  assert.isAtLeast(new Set(ref.tokens).size, 8, `a varied stream, not a repeated token: ${ref.tokens}`)
  return ref.tokens
}

/** `swactor run --json --backend vulkan`: the generated ids and each stage's reported backend. */
const swactorRun = async (model: string, stages: number) => {
  const { stdout } = await exec(
    process.execPath,
    [swactorMain(), ...runJsonArgs(model, PROMPT, N, ["--stages", String(stages), "--backend", gpuBackend])],
    { env: { ...process.env, ...vulkanEnv }, cwd: repoRoot }
  )
  const out = runJsonOutput<{
    tokens: Array<{ id: number }>
    summary: { stages: Array<{ backend?: string }>; recoveries: Array<unknown> }
  }>(stdout)
  assert.strictEqual(out.summary.recoveries.length, 0, "no stage failed")
  return { tokens: out.tokens.map((t) => t.id), backends: out.summary.stages.map((s) => s.backend) }
}

describe("Vulkan stages on lavapipe per family and type: node-llama-cpp's Vulkan tokens", () => {
  for (const c of cases) {
    it(`${c.name}, ${c.stages} ${gpuBackend} stage(s)`, async () => {
      const expected = await reference(pathOf(c.name))
      const { backends, tokens } = await swactorRun(pathOf(c.name), c.stages)
      assert.deepStrictEqual(backends, Array(c.stages).fill(gpuBackend), "every stage computed on the GPU device")
      assert.deepStrictEqual(tokens, expected)
    }, 90_000)
  }
})

/** One generation on local Vulkan agents; with `kill`, agent `kill.agent` gets SIGKILL when token `kill.atToken` comes. */
const generateOnVulkan = (
  stages: number,
  spares: number,
  kill?: { readonly atToken: number; readonly agent: number }
) =>
  Effect.gen(function* () {
    let agents: ReadonlyArray<LocalAgent> = []
    let killed = false
    const updates: Array<RunUpdate> = []
    const local = layerLocal({
      threads: 1,
      env: vulkanEnv,
      extraArgs: () => ["--backend", gpuBackend],
      onStarted: (a) => (agents = a)
    })
    const result = yield* generate({ model: pathOf("llama-f16"), prompt: PROMPT, stages, spares, maxTokens: N }).pipe(
      Stream.provideLayer(local),
      Stream.runForEach((u) =>
        Effect.sync(() => {
          updates.push(u)
          if (kill !== undefined && !killed && u._tag === "Token" && u.token.step === kill.atToken) {
            killed = true
            process.kill(agents[kill.agent]!.pid, "SIGKILL")
          }
        })
      ),
      Effect.either
    )
    assert.isTrue(Either.isRight(result), JSON.stringify(result))
    const finished = updates.find((u) => u._tag === "Finished")
    assert.isDefined(finished)
    const summary = finished!._tag === "Finished" ? finished!.summary : undefined
    const tokens = updates.flatMap((u) => (u._tag === "Token" && u.token.tokenId >= 0 ? [u.token.tokenId] : []))
    return { tokens, summary: summary!, killed }
  })

describe("kill -9 of a Vulkan stage", () => {
  it("llama-f16 on 2 Vulkan stages, the second's agent killed at token 6: resumes, every stage on Vulkan, same text", async () => {
    const reference = await Effect.runPromise(generateOnVulkan(2, 0))
    assert.strictEqual(reference.tokens.length, N)
    assert.isAtLeast(new Set(reference.tokens).size, 8, "a varied stream")
    assert.deepStrictEqual(
      reference.summary.stages.map((s) => s.backend),
      [gpuBackend, gpuBackend]
    )
    const outcome = await Effect.runPromise(generateOnVulkan(2, 1, { atToken: 6, agent: 1 }))
    assert.isTrue(outcome.killed, "token 6 came back and the agent was killed")
    assert.strictEqual(outcome.summary.recoveries.length, 1)
    // the recovery may re-plan onto fewer stages: whichever agents host them, each computes on the Vulkan device
    const resumed = outcome.summary.stages.map((s) => s.backend)
    assert.isAtLeast(resumed.length, 1)
    assert.deepStrictEqual(resumed, Array(resumed.length).fill(gpuBackend), "the resumed stages on the GPU device")
    assert.deepStrictEqual(outcome.tokens, reference.tokens)
    assert.strictEqual(outcome.summary.text, reference.summary.text)
  }, 120_000)
})
