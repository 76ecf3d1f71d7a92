/**
 * Capped sliding-window caches end to end (specs GM7): `swactor run --dry-run` shows each stage's memory with its
 * sliding-window blocks' KV capped (placement's cost model), and `swactor serve`'s `swactor_stage_kv_bytes` gauge gives
 * what each stage's agent sized for a request: the per-block formula, less than full-size caches. A prompt-cache entry
 * whose window the ring has since overwritten (its request generated past the ring) is not adopted: the next prompt
 * sharing its prefix is prefilled whole, with the text of a server that has the cache off (specs GM6).
 */
import { assert, describe, it } from "@effect/vitest"
import { spawn } from "node:child_process"
import { Effect } from "effect"
import { join } from "node:path"
import { swactorCommand } from "../../src/layers/agent/AgentProcesses.js"
import { readModelLayout } from "../../src/layers/gguf/ModelCatalogLive.js"
import { type SyntheticModelOptions, writeSyntheticModel } from "../../src/layers/gguf/Synthetic.js"
import { kvBytesOfBlocks, kvBytesPerTokenOfBlock } from "../../src/services/KvSize.js"
import { computeReserveBytes, stageMemoryBytes } from "../../src/services/Placement.js"
import * as StageExecutorLive from "../../src/layers/engine/StageExecutorLive.js"
import { StageExecutor } from "../../src/services/StageExecutor.js"
import { metricOf, type ServeProcess, startServe, stopServe } from "../support/serve.js"
import { repoRoot } from "../support/models.js"
import { modelFolder } from "../support/synthFiles.js"

const dir = modelFolder("swactor-swa-memory-")

// 4 blocks, pattern 2: blocks 0 and 2 slide over 16 positions (rings of 256 cells), 1 and 3 are global
const model = (name: string, window: number): SyntheticModelOptions => ({
  path: join(dir, `${name}.gguf`),
  arch: "gemma3",
  layers: 4,
  hidden: 256,
  ffn: 512,
  heads: 4,
  kvHeads: 4,
  vocab: 400,
  contextLength: 4096,
  type: "f32",
  seed: 81,
  slidingWindow: window,
  swaPattern: 2
})
const ROW = kvBytesPerTokenOfBlock(64 * 4, 64 * 4)
const mib = (bytes: number) => `${(bytes / 2 ** 20).toFixed(1)} MiB`

const cli = (args: ReadonlyArray<string>) =>
  Effect.async<{ code: number | null; stdout: string; stderr: string }>((resume) => {
    const { args: argv, command } = swactorCommand(args)
    const child = spawn(command, argv, { cwd: repoRoot, stdio: ["ignore", "pipe", "pipe"] })
    let stdout = ""
    let stderr = ""
    child.stdout.on("data", (chunk) => (stdout += chunk))
    child.stderr.on("data", (chunk) => (stderr += chunk))
    child.on("exit", (code) => resume(Effect.succeed({ code, stdout, stderr })))
  })

describe("capped sliding-window caches: --dry-run and /metrics", () => {
  it.live(
    "swactor run --dry-run: each stage's memory counts its sliding blocks' rings, not the context",
    () =>
      Effect.gen(function* () {
        const capped = model("capped", 16)
        const wide = model("wide", 8192)
        yield* writeSyntheticModel(capped)
        yield* writeSyntheticModel(wide)
        // prompt + 4000 tokens + 1 -> a context of 4096 cells
        const args = (path: string) => [
          "run",
          "--model",
          path,
          "--threads",
          "1",
          "--dry-run",
          "--layers",
          "0-1,2-3",
          "--max-tokens",
          "4000"
        ]
        const out = yield* cli(args(capped.path))
        assert.strictEqual(out.code, 0, out.stderr)
        const outWide = yield* cli(args(wide.path))
        assert.strictEqual(outWide.code, 0, outWide.stderr)
        const layout = yield* readModelLayout(capped.path)
        const options = { contextTokens: 4096, computeBytes: computeReserveBytes(layout, 4096) }
        for (const [start, end] of [
          [0, 2],
          [2, 4]
        ] as const) {
          const memory = stageMemoryBytes(layout, start, end, options)
          // one full block of 4096 cells and one ring of 256 on each stage
          const { slidingWindow: _, ...uncapped } = layout
          assert.strictEqual(stageMemoryBytes(uncapped, start, end, options) - memory, (4096 - 256) * ROW)
          const line = new RegExp(`blocks \\[${start}, ${end}\\), .*, (\\d+\\.\\d MiB) with KV and buffers`)
          assert.strictEqual(line.exec(out.stdout)?.[1], mib(memory), out.stdout)
          // the same weights with the window past the context: every block holds the context
          assert.strictEqual(
            line.exec(outWide.stdout)?.[1],
            mib(stageMemoryBytes(uncapped, start, end, options)),
            outWide.stdout
          )
        }
      }),
    180_000
  )

  // gpt-oss's own keys (`gpt-oss.attention.sliding_window`, pattern default 2 as llama.cpp's openai-moe.cpp sets it):
  // the catalog's layout must count the rings the engine allocates (each loaded stage's kvWindow), not full caches
  it.live(
    "gpt-oss: --dry-run and the catalog's layout count each stage's sliding blocks as the engine loads them",
    () =>
      Effect.gen(function* () {
        const gptOss = (name: string, swaPattern: number): SyntheticModelOptions => ({
          path: join(dir, `${name}.gguf`),
          arch: "gpt-oss",
          layers: 6,
          hidden: 128,
          ffn: 64,
          heads: 4,
          kvHeads: 2,
          vocab: 400,
          contextLength: 4096,
          type: "f32",
          seed: 82,
          experts: 4,
          expertsUsed: 2,
          slidingWindow: 16,
          swaPattern
        })
        const split = [
          [0, 3],
          [3, 6]
        ] as const
        for (const [pattern, sliding] of [
          [2, [true, false, true, false, true, false]],
          [3, [true, true, false, true, true, false]]
        ] as const) {
          const m = gptOss(`gpt-oss-p${pattern}`, pattern)
          yield* writeSyntheticModel(m)
          const layout = yield* readModelLayout(m.path)
          assert.deepStrictEqual(layout.slidingWindow, { window: 16, blocks: sliding })
          const row = kvBytesPerTokenOfBlock((128 / 4) * 2, (128 / 4) * 2)
          for (const [start, end] of split) {
            const info = yield* Effect.scoped(
              Effect.gen(function* () {
                const stage = yield* (yield* StageExecutor).load({
                  path: m.path,
                  layerStart: start,
                  layerEndExclusive: end,
                  isFirst: start === 0,
                  isLast: end === 6
                })
                return stage.info
              })
            ).pipe(Effect.provide(StageExecutorLive.layer))
            const slidingHere = sliding.slice(start, end).filter((b) => b).length
            assert.deepStrictEqual(info.kvWindow, { window: 16, bytesPerToken: slidingHere * row })
            assert.strictEqual(info.kvBytesPerToken, (end - start) * row)
          }
          const out = yield* cli([
            "run",
            "--model",
            m.path,
            "--threads",
            "1",
            "--dry-run",
            "--layers",
            "0-2,3-5",
            "--max-tokens",
            "4000"
          ])
          assert.strictEqual(out.code, 0, out.stderr)
          const options = { contextTokens: 4096, computeBytes: computeReserveBytes(layout, 4096) }
          const { slidingWindow: _, ...uncapped } = layout
          for (const [start, end] of split) {
            const memory = stageMemoryBytes(layout, start, end, options)
            const slidingHere = sliding.slice(start, end).filter((b) => b).length
            assert.strictEqual(
              stageMemoryBytes(uncapped, start, end, options) - memory,
              slidingHere * (4096 - 256) * row
            )
            const line = new RegExp(`blocks \\[${start}, ${end}\\), .*, (\\d+\\.\\d MiB) with KV and buffers`)
            assert.strictEqual(line.exec(out.stdout)?.[1], mib(memory), out.stdout)
          }
        }
      }),
    180_000
  )

  it.live(
    "swactor serve: swactor_stage_kv_bytes gives each stage's per-block KV, sliding blocks capped",
    () =>
      Effect.gen(function* () {
        const capped = model("served", 16)
        yield* writeSyntheticModel(capped)
        const server = yield* Effect.promise(() =>
          startServe(["--model", capped.path, "--stages", "2", "--threads", "1", "--prompt-cache", "off"])
        )
        try {
          const response = yield* Effect.promise(() =>
            fetch(`${server.url}/v1/completions`, {
              method: "POST",
              headers: { "content-type": "application/json" },
              body: JSON.stringify({ prompt: "Once upon a time", max_tokens: 600, temperature: 0 })
            }).then((r) => r.json() as Promise<{ usage: { prompt_tokens: number } }>)
          )
          // the run's context: prompt + max_tokens + 1, aligned to 256
          const context = Math.ceil((response.usage.prompt_tokens + 600 + 1) / 256) * 256
          assert.isAbove(context, 256)
          // 2 stages, blocks [0, 2) and [2, 4): a ring and a full block each
          const perStage = kvBytesOfBlocks([{ bytesPerToken: ROW, window: 16 }, { bytesPerToken: ROW }], context)
          assert.strictEqual(perStage, (256 + context) * ROW)
          for (const stage of [0, 1]) {
            assert.strictEqual(
              yield* Effect.promise(() => metricOf(server.url, `swactor_stage_kv_bytes{stage="${stage}"}`)),
              perStage
            )
          }
        } finally {
          yield* Effect.promise(() => stopServe(server))
        }
      }),
    180_000
  )

  it.live(
    "swactor serve: an entry whose window the ring overwrote is prefilled again, with the cache-off text",
    () =>
      Effect.gen(function* () {
        const m = model("cached", 16)
        yield* writeSyntheticModel(m)
        const env = { SWACTOR_PREFILL_CHUNK: "8" }
        const args = ["--model", m.path, "--stages", "2", "--threads", "1"]
        const complete = (server: ServeProcess, prompt: string, maxTokens: number) =>
          Effect.promise(async () => {
            const r = await fetch(`${server.url}/v1/completions`, {
              method: "POST",
              headers: { "content-type": "application/json" },
              body: JSON.stringify({ prompt, max_tokens: maxTokens, temperature: 0 })
            })
            const json = (await r.json()) as {
              choices: Array<{ text: string }>
              usage: {
                prompt_tokens: number
                completion_tokens: number
                prompt_tokens_details: { cached_tokens: number }
              }
            }
            assert.strictEqual(r.status, 200, JSON.stringify(json))
            return { text: json.choices[0]!.text, usage: json.usage }
          })
        const on = yield* Effect.promise(() => startServe(args, env))
        const off = yield* Effect.promise(() => startServe([...args, "--prompt-cache", "off"], env))
        try {
          const P = "Once upon a time there was a little girl who lived in a village near the forest with her mother"
          const Q = "The old dog sat by the door every morning and waited for the boy to come home from school"
          // within the ring: the entry of P is adopted (its positions and their window are held)
          yield* complete(on, P, 20)
          const p2 = yield* complete(on, `${P} and her dog`, 20)
          assert.isAbove(p2.usage.prompt_tokens_details.cached_tokens, 8, "P's entry adopted")
          assert.strictEqual(p2.text, (yield* complete(off, `${P} and her dog`, 20)).text)
          // Q generates 400 tokens: its stages' rings (256 cells) then hold positions past Q's prompt only
          const q1 = yield* complete(on, Q, 400)
          assert.strictEqual(q1.usage.completion_tokens, 400)
          assert.isAtLeast(q1.usage.prompt_tokens, 9, "Q's entry would be adoptable in whole chunks of 8")
          const q2 = yield* complete(on, `${Q} and the cat`, 20)
          assert.strictEqual(q2.usage.prompt_tokens_details.cached_tokens, 0, "Q's entry is not adopted")
          assert.strictEqual(q2.text, (yield* complete(off, `${Q} and the cat`, 20)).text)
        } finally {
          yield* Effect.promise(() => Promise.all([stopServe(on), stopServe(off)]))
        }
      }),
    240_000
  )
})
