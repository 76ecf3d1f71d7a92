/**
 * The engine's arm64 kernel routes under qemu-user (issue 42), each forced in turn and each checked to be taken,
 * against node-llama-cpp's own arm64 build on the same emulated CPU (test/support/cpuReference.mjs, the same thread
 * count, flash attention on, a 256-token context). The engine runs in a process of its own on the arm64 Node binary
 * (test/support/engineRoutes.mjs over the built library), one stage over the whole file, each prompt alone and both
 * prompts in one batch per step. Routes (StageExecutorLive's LiveOptions, never the machine's choice):
 * - `repack: true`: quantized matrices go into the CPU device's extra buffer type (CPU_REPACK) wherever
 *   WeightPlacement.ts's rule 1 agrees, repacked into the arm layouts; stacked experts too (ggml_mul_mat_id);
 *   `repack: false`: every weight plain;
 * - `smallBatchRows: 64`: every product of a batch of 2-64 rows over a plain weight takes the few-row route
 *   (Toolkit.mulMatSmall, ggml's one-row kernel); `smallBatchRows: 0`: never.
 *
 * Files: stories260K (F32: nothing to repack), synthetic llama files in Q4_0 and Q4_K (`swactor synth`) and a small
 * qwen3moe whose experts are Q4_0. Emulated CPUs (QEMU_CPU, which every process of a side inherits), each asserted to
 * load its libggml-cpu variant on both sides and to offer what ggml's repack selector reads:
 * - qemu's `max` (armv9.2 backend; i8mm, 64-byte SVE): CPU_REPACK takes every Q4_0 and Q4_K matrix and the Q4_0
 *   experts (Q4_0 as 4x8, Q4_K as 8x8), so node-llama-cpp repacks and is the oracle of the repacked route.
 *   node-llama-cpp cannot turn repacking off (its addon does not pass llama_model_params.use_extra_bufts), so the
 *   forced plain route of a quantized file has no oracle on this CPU: its placement is checked, its tokens are not
 *   (some of the llama files' streams differ from the first or the fifth token: the plain Q4_0/Q4_K kernels sum in
 *   another order than the repacked ones, and the tiny synthetic models' greedy choice flips; the qwen3moe's do not);
 * - `max` with 32-byte SVE (Q4_0 as 8x8, the SVE kernels) and `cortex-a76` (armv8.2 backend, dotprod without i8mm:
 *   Q4_0 as 4x4, Q4_K as 8x4): the repacked route of the files those layouts apply to;
 * - `cortex-a72` (armv8.0, no dotprod: the armv8.0 backend, whose CPU_REPACK agrees to none of these weights):
 *   node-llama-cpp computes every weight plain, the oracle of the plain route on arm64's own plain kernels.
 * Every reference stream is varied (at least 8 distinct of 16 tokens).
 */
import { Effect, Exit } from "effect"
import { execFile } from "node:child_process"
import { join } from "node:path"
import { promisify } from "node:util"
import { assert, beforeAll, describe, it } from "vitest"
import { readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { type Arm64Runtime, arm64Runtime, lastJson } from "../support/arm64.js"
import { repoRoot, requireModel } from "../support/models.js"
import { runSynthCli } from "../support/synthCli.js"
import { modelFolder } from "../support/synthFiles.js"

const execFileP = promisify(execFile)
const PROMPTS = ["Once upon a time", "The little dog ran home"]
const N = 16
const dir = modelFolder("swactor-arm64-routes-")

interface Route {
  readonly repack: boolean
  readonly smallBatchRows: number
}

/** The routes forced, each in turn (LiveOptions). */
const ROUTES: ReadonlyArray<Route> = [
  { repack: true, smallBatchRows: 0 },
  { repack: true, smallBatchRows: 64 },
  { repack: false, smallBatchRows: 0 },
  { repack: false, smallBatchRows: 64 }
]

/** What ggml's repack selector (ggml-cpu/repack.cpp) reads from the CPU backend. */
interface CpuFeatures {
  readonly dotprod: boolean
  readonly i8mm: boolean
  /** SVE vector length in bytes, 0 without SVE. */
  readonly sveBytes: number
}

interface Cpu {
  /** QEMU_CPU. */
  readonly qemuCpu: string
  /** The libggml-cpu variant node-llama-cpp's loader picks there. */
  readonly backend: string
  readonly features: CpuFeatures
  /** node-llama-cpp repacks the quantized matrices there: the oracle of the repacked route, not of the plain one. */
  readonly repacks: boolean
  /** The files run there (default all) and the routes (default all). */
  readonly files?: ReadonlyArray<string>
  readonly routes?: ReadonlyArray<Route>
}

/**
 * The emulated CPUs. ggml's repack selector picks Q4_0's layout 8x8 with i8mm and 32-byte SVE, else 4x8 with i8mm,
 * else 4x4 with dotprod; Q4_K's 8x8 with i8mm, else 8x4 with dotprod; nothing without dotprod. `max` and `cortex-a72`
 * run every file and route; the other two, each repacked kernel `max` does not take, on the repacked route only.
 */
const CPUS: ReadonlyArray<Cpu> = [
  { qemuCpu: "max", backend: "armv9.2", features: { dotprod: true, i8mm: true, sveBytes: 64 }, repacks: true },
  {
    qemuCpu: "max,sve-default-vector-length=32",
    backend: "armv9.2",
    features: { dotprod: true, i8mm: true, sveBytes: 32 },
    repacks: true,
    files: ["llama-q4_0", "qwen3moe-q4_0"],
    routes: [{ repack: true, smallBatchRows: 0 }]
  },
  {
    qemuCpu: "cortex-a76",
    backend: "armv8.2",
    features: { dotprod: true, i8mm: false, sveBytes: 0 },
    repacks: true,
    files: ["llama-q4_0", "llama-q4_k", "qwen3moe-q4_0"],
    routes: [{ repack: true, smallBatchRows: 0 }]
  },
  {
    qemuCpu: "cortex-a72",
    backend: "armv8.0",
    features: { dotprod: false, i8mm: false, sveBytes: 0 },
    repacks: false
  }
]

interface ModelFile {
  readonly name: string
  readonly path: string
  /** Weights products are built over (2-D, or 3-D stacked experts), token_embd aside (only looked up). */
  readonly matrices: ReadonlyArray<string>
  /** Those of a quantized type (not F32/F16). */
  readonly quantized: ReadonlyArray<string>
}

const synthBase = { layers: "3", hidden: "256", ffn: "512", heads: "4", vocab: "400", seed: "7" }
const synthetic: ReadonlyArray<{ name: string; flags: Readonly<Record<string, string>> }> = [
  { name: "llama-q4_0", flags: { ...synthBase, arch: "llama", type: "q4_0" } },
  { name: "llama-q4_k", flags: { ...synthBase, arch: "llama", type: "q4_k" } },
  {
    name: "qwen3moe-q4_0",
    flags: {
      ...synthBase,
      arch: "qwen3moe",
      ffn: "256",
      heads: "2",
      experts: "4",
      "expert-ffn": "128",
      seed: "17",
      type: "q4_0"
    }
  }
]

interface RouteRun {
  readonly repack: boolean
  readonly smallBatchRows: number
  /** Weight name -> buffer type name. */
  readonly placements: Readonly<Record<string, string>>
  readonly fewRowProducts: number
  /** Per prompt: its tokens alone, and in the batch of both. */
  readonly alone: ReadonlyArray<ReadonlyArray<number>>
  readonly batched: ReadonlyArray<ReadonlyArray<number>>
}

interface CpuResult {
  readonly files: ReadonlyArray<ModelFile>
  readonly routes: ReadonlyArray<Route>
  readonly features: CpuFeatures
  /** node-llama-cpp's tokens, per file, per prompt. */
  readonly reference: ReadonlyArray<ReadonlyArray<ReadonlyArray<number>>>
  readonly referenceBackend: ReadonlyArray<string>
  readonly engineBackend: ReadonlyArray<string>
  /** Per file, per route. */
  readonly engine: ReadonlyArray<ReadonlyArray<RouteRun>>
}

let runtime: Arm64Runtime
let allFiles: ReadonlyArray<ModelFile> = []
const results = new Map<string, CpuResult>()

/** `script JOB` on the arm64 Node binary, under qemu emulating `cpu`. */
const onArm64 = async <A>(cpu: Cpu, script: string, job: unknown): Promise<A> => {
  const { stdout } = await execFileP(
    runtime.qemu,
    ["-L", runtime.sysroot, runtime.node, join(repoRoot, "test", "support", script), JSON.stringify(job)],
    {
      cwd: repoRoot,
      maxBuffer: 16 * 1024 * 1024,
      env: { ...process.env, QEMU_CPU: cpu.qemuCpu, SWACTOR_TEST_QEMU: `${runtime.qemu} ${runtime.sysroot}` }
    }
  )
  const out = lastJson<A & { arch: string }>(stdout)
  assert.strictEqual(out.arch, "arm64", `${script} ran on arm64`)
  return out
}

/** The libggml-cpu variants a process loaded, as it reported them: one, `cpu`'s. */
const assertBackend = (cpu: Cpu, mapped: ReadonlyArray<string>, who: string) => {
  assert.strictEqual(mapped.length, 1, `${who} loaded one CPU backend: ${mapped}`)
  assert.include(mapped[0]!, `/@node-llama-cpp/linux-arm64/bins/linux-arm64/libggml-cpu-${cpu.backend}`, who)
}

/** node-llama-cpp's arm64 build on `cpu`'s files and prompts, then our engine on each file, route and prompt. */
const runCpu = async (cpu: Cpu): Promise<CpuResult> => {
  const files = allFiles.filter((f) => cpu.files?.includes(f.name) ?? true)
  const routes = cpu.routes ?? ROUTES
  const ref = await onArm64<{
    cpuBackend: Array<string>
    runs: Array<{ prompt: Array<number>; tokens: Array<number> }>
  }>(cpu, "cpuReference.mjs", {
    runs: files.flatMap((f) => PROMPTS.map((prompt) => ({ model: f.path, prompt }))),
    n: N
  })
  const perFile = <A>(all: ReadonlyArray<A>) =>
    files.map((_, i) => all.slice(i * PROMPTS.length, (i + 1) * PROMPTS.length))
  const prompts = perFile(ref.runs.map((r) => r.prompt))
  const engine = await onArm64<{
    cpuBackend: Array<string>
    cpuFeatures: CpuFeatures
    files: Array<Array<RouteRun>>
  }>(cpu, "engineRoutes.mjs", { files: files.map((f, i) => ({ model: f.path, prompts: prompts[i] })), n: N, routes })
  return {
    files,
    routes,
    features: engine.cpuFeatures,
    reference: perFile(ref.runs.map((r) => r.tokens)),
    referenceBackend: ref.cpuBackend,
    engineBackend: engine.cpuBackend,
    engine: engine.files
  }
}

/** The tensors of `path` that products use, and the quantized ones among them. */
const matricesOf = async (name: string, path: string): Promise<ModelFile> => {
  const file = await Effect.runPromise(readGgufFile(path))
  const used = file.tensors.filter((t) => t.dims.length >= 2 && t.name !== "token_embd.weight")
  const float = new Set([0, 1]) // GGML_TYPE_F32, GGML_TYPE_F16
  return {
    name,
    path,
    matrices: used.map((t) => t.name),
    quantized: used.filter((t) => !float.has(t.type)).map((t) => t.name)
  }
}

beforeAll(async () => {
  runtime = await arm64Runtime()
  const made: Array<ModelFile> = [await matricesOf("stories260K", requireModel("stories260K.gguf"))]
  for (const s of synthetic) {
    const path = join(dir, `${s.name}.gguf`)
    const flags = Object.entries(s.flags).flatMap(([k, v]) => [`--${k}`, v])
    const exit = await Effect.runPromise(runSynthCli([...flags, "--context-length", "512", "-o", path]))
    assert.isTrue(Exit.isSuccess(exit), `swactor synth ${s.name}: ${String(exit)}`)
    made.push(await matricesOf(s.name, path))
  }
  allFiles = made
  const done = await Promise.all(CPUS.map(runCpu))
  CPUS.forEach((cpu, i) => results.set(cpu.qemuCpu, done[i]!))
}, 480_000)

const routeName = (r: Route) =>
  `repack ${r.repack ? "on" : "off"}, few-row ${r.smallBatchRows === 0 ? "never" : "<= 64"}`

/** The forced route was taken: where each weight went, and how many products took the few-row route. */
const assertRouteTaken = (cpu: Cpu, file: ModelFile, route: Route, run: RouteRun) => {
  const where = `${file.name}, ${routeName(route)}, ${cpu.qemuCpu}`
  assert.strictEqual(run.repack, route.repack)
  const extra = Object.keys(run.placements).filter((n) => !/^CPU(_Mapped)?$/.test(run.placements[n]!))
  for (const name of extra) assert.strictEqual(run.placements[name], "CPU_REPACK", `${where}: ${name}`)
  const repacked = route.repack && cpu.repacks ? file.quantized : []
  assert.deepStrictEqual([...extra].sort(), [...repacked].sort(), `${where}: the weights in CPU_REPACK`)
  const plain = file.matrices.filter((n) => !extra.includes(n))
  if (route.smallBatchRows === 0) assert.strictEqual(run.fewRowProducts, 0, `${where}: no few-row product`)
  else if (plain.length > 0) assert.isAbove(run.fewRowProducts, 0, `${where}: few-row products over ${plain}`)
  else assert.strictEqual(run.fewRowProducts, 0, `${where}: every matrix repacked, no few-row product (rule 2)`)
}

describe("the engine's arm64 kernel routes under qemu-user: node-llama-cpp's arm64 tokens", () => {
  for (const cpu of CPUS) {
    it(`${cpu.qemuCpu}: both sides load the ${cpu.backend} backend, and every reference stream is varied`, () => {
      const r = results.get(cpu.qemuCpu)!
      assertBackend(cpu, r.referenceBackend, "node-llama-cpp's process")
      assertBackend(cpu, r.engineBackend, "the engine's process")
      assert.deepStrictEqual(r.features, cpu.features, "what the repack selector reads")
      for (const [i, file] of r.files.entries()) {
        for (const tokens of r.reference[i]!) {
          assert.strictEqual(tokens.length, N)
          assert.isAtLeast(new Set(tokens).size, 8, `${file.name}: a varied stream, not a repeated token: ${tokens}`)
        }
      }
    })
    for (const [ri, route] of (cpu.routes ?? ROUTES).entries()) {
      it(`${cpu.qemuCpu}, ${routeName(route)}: the route is taken, and the tokens are node-llama-cpp's`, () => {
        const r = results.get(cpu.qemuCpu)!
        for (const [i, file] of r.files.entries()) {
          const run = r.engine[i]![ri]!
          assertRouteTaken(cpu, file, route, run)
          // node-llama-cpp repacks where the CPU can: a forced plain route over repackable weights has no oracle there
          if (cpu.repacks && !route.repack && file.quantized.length > 0) continue
          const where = `${file.name}, ${routeName(route)}, ${cpu.qemuCpu}`
          assert.deepStrictEqual(run.alone, r.reference[i], `${where}: each prompt alone`)
          assert.deepStrictEqual(run.batched, r.reference[i], `${where}: both prompts in one batch`)
        }
      })
    }
  }
})
