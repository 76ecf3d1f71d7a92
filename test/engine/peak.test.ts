/**
 * Peak memory of a stage near its weights: a stage process's resident set, through load, a prompt, decode steps and
 * the move of its mapped weights to huge-page memory ("settle"), never exceeds its baseline (Node and the ggml
 * libraries loaded, nothing else) by more than 1.15 x (weights + KV cache). Before the mapped pages were released as
 * they were copied, settle held the mapping and the copy at once (~2x the weights), and a repacked load held the whole
 * prefaulted mapping beside the repacked copies (~1.8x).
 *
 * Each case runs in its own child process (test/support/peakChild.ts), so VmHWM is the stage's own peak.
 */
import { Effect } from "effect"
import { execFile } from "node:child_process"
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { promisify } from "node:util"
import { afterAll, assert, describe, it } from "vitest"
import { type SyntheticType, writeSyntheticModel } from "../../src/layers/gguf/Synthetic.js"
import { getGgml } from "../../src/layers/ggml/Bindings.js"
import { repoRoot } from "../support/models.js"

const dir = mkdtempSync(join(tmpdir(), "swactor-peak-"))
afterAll(() => rmSync(dir, { recursive: true, force: true }))

interface Phase {
  readonly hwm: number
  readonly rss: number
}
interface PeakReport {
  readonly baseline: Phase
  readonly loaded: Phase
  readonly served: Phase
  readonly end: Phase
  readonly settled: boolean
  readonly logits: string
  readonly weightBytes: number
  readonly kvBytes: number
  readonly computeBytes: number
  readonly placements: ReadonlyArray<string>
}

const model = async (type: SyntheticType) => {
  const path = join(dir, `peak-${type}.gguf`)
  // ~115 MB at Q8_0: large enough that Node's own allocations are noise beside it
  await Effect.runPromise(
    writeSyntheticModel({
      path,
      arch: "llama",
      layers: 4,
      hidden: 1024,
      ffn: 4096,
      heads: 8,
      kvHeads: 4,
      vocab: 16384,
      contextLength: 512,
      type,
      seed: 3
    })
  )
  return path
}

const measure = async (path: string, options: object): Promise<PeakReport> => {
  const { stdout } = await promisify(execFile)(
    process.execPath,
    ["--import", "tsx", join(repoRoot, "test", "support", "peakChild.ts"), path, JSON.stringify(options)],
    { cwd: repoRoot, env: { ...process.env, SWACTOR_MMAP_MOVE: "0" }, maxBuffer: 1 << 20 }
  ).catch((e: { message: string; code?: number; signal?: string; stderr?: string }) => {
    throw new Error(`the stage process failed (exit ${e.code}, signal ${e.signal}): ${e.stderr?.slice(-2000)}`)
  })
  return JSON.parse(stdout.trim().split("\n").at(-1)!) as PeakReport
}

const MB = 2 ** 20
const MiB = (n: number) => `${(n / 2 ** 20).toFixed(1)} MiB`

const hasRepack = () => getGgml().cpuExtraBufferTypes().length > 0

describe("a stage's peak resident memory stays near its weights + KV cache + compute buffers", () => {
  const cases = [
    ["q8_0", { mmap: true, repack: true }, "mapped in place, then settled", "CPU_Mapped"],
    ["q4_k", { mmap: true, repack: true }, "repacked from the mapping, the rest in place, then settled", "CPU_REPACK"],
    ["q8_0", { mmap: false, repack: false }, "copied into buffers", "CPU"]
  ] as const
  for (const [type, options, what, expectBuffer] of cases) {
    it(`${type}, ${what}: load, serving and settle peaks within fixed allowances of weights + KV + compute`, async () => {
      const r = await measure(await model(type), { ...options, smallBatchRows: 0 })
      const budget = r.weightBytes + r.kvBytes + r.computeBytes
      const above = (p: Phase) => p.hwm - r.baseline.rss
      console.log(
        `${type} ${what}: weights ${MiB(r.weightBytes)}, KV ${MiB(r.kvBytes)}, compute ${MiB(r.computeBytes)}, ` +
          `baseline ${MiB(r.baseline.rss)}; peak above baseline: loaded ${MiB(above(r.loaded))}, served ` +
          `${MiB(above(r.served))}, after settle ${MiB(above(r.end))} = ${(above(r.end) / budget).toFixed(3)}x ` +
          `(weights + KV + compute); steady ${MiB(r.end.rss - r.baseline.rss)}; placements ${r.placements}`
      )
      assert.strictEqual(r.logits, "Logits")
      if (expectBuffer === "CPU_REPACK" && !hasRepack()) {
        console.log("this CPU offers no repacked buffer type: the Q4_K case is placed in plain buffers")
      } else {
        assert.include(r.placements, expectBuffer)
      }
      if (options.mmap) assert.isTrue(r.settled, "the mapped weights were moved")
      // Fixed allowances, not ratios: on a small model Node's own allocations (V8 heap, thread stacks) would decide a
      // ratio. The load holds the weights once (plus a read chunk or one repacked tensor's pages); serving adds the
      // KV cache and compute buffers; settle adds at most a few copy chunks (it held a second copy of every mapped
      // weight before).
      // The Q4_K load measured 15.6-16.0 MB above its weights across runs of the same code (a fresh-clone CI run went
      // 4 KiB over a 16 MB allowance): 20 MB leaves room for that spread and still catches the regression this guards
      // (a prefaulted mapping held beside the repacked copies is ~40 MB more here).
      assert.isAtMost(above(r.loaded), r.weightBytes + 20 * MB, `load peak ${MiB(above(r.loaded))}`)
      assert.isAtMost(above(r.served), budget + 32 * MB, `serving peak ${MiB(above(r.served))}`)
      assert.isAtMost(r.end.hwm - r.served.hwm, 24 * MB, `settle raised the peak by ${MiB(r.end.hwm - r.served.hwm)}`)
    }, 120_000)
  }
})
