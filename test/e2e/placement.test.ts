// Placement end to end (issue 10): agents declare memory limits and speeds, the orchestrator places blocks from
// their heartbeat answers, and the run follows that placement. stories260K over real agent processes on loopback.
import { assert, describe, it } from "@effect/vitest"
import { spawn } from "node:child_process"
import { Chunk, Effect, Stream } from "effect"
import { run } from "../../src/api/generate.js"
import { swactorCommand } from "../../src/layers/agent/AgentProcesses.js"
import { readModelLayout } from "../../src/layers/gguf/ModelCatalogLive.js"
import type { RunUpdate } from "../../src/services/Orchestrator.js"
import { computeReserveBytes } from "../../src/services/Placement.js"
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { startAgents } from "../support/e2e.js"
import { repoRoot, requireModel } from "../support/models.js"
import { writeMoeFile } from "../support/moeFile.js"

const prompt = "Once upon a time"
// prompt + 8 tokens + 1, aligned to 256: the KV cells placement reserves per block.
const CONTEXT = 256

const layersOf = (updates: ReadonlyArray<RunUpdate>) => {
  const planned = updates.find((u) => u._tag === "Planned")
  return planned?._tag === "Planned" ? planned.stages.map((s) => s.layers) : []
}

describe("end to end: placement from the agents' declared memory (stories260K)", () => {
  // Agent 1 may use plenty of memory, agent 2 only enough for the last block and the output head: capacity puts
  // blocks [0, 4) on agent 1 and [4, 5) on agent 2, the balanced split (3 + 2) is refused naming agent 2, and the
  // capacity run completes with the same greedy text as an unconstrained split.
  it.live(
    "two local agents with different memory limits get the expected split",
    () =>
      Effect.gen(function* () {
        const model = requireModel("stories260K.gguf")
        const layout = yield* readModelLayout(model)
        const lastStage =
          layout.blockBytes[4]! +
          layout.kvBytesPerToken[4]! * CONTEXT +
          layout.outputBytes +
          computeReserveBytes(layout, CONTEXT)
        // Less than one more block: [3, 5) does not fit.
        const smallLimit = lastStage + Math.floor(layout.blockBytes[3]! / 2)
        const { layer } = yield* startAgents(2, {
          // Equal declared speeds keep the split about memory (measured speeds vary with the machine's load).
          extraArgs: (i) => ["--memory-limit", String(i === 0 ? 2 ** 30 : smallLimit), "--speed", "1e9"]
        })
        const request = { model, prompt, stages: 2, maxTokens: 8, threads: 1 }
        const capacity = yield* Stream.runCollect(run({ ...request, placement: { _tag: "Capacity" } })).pipe(
          Effect.map(Chunk.toReadonlyArray),
          Effect.provide(layer)
        )
        assert.deepStrictEqual(layersOf(capacity), [
          [0, 4],
          [4, 5]
        ])
        const pool = capacity.find((u) => u._tag === "PoolReady")
        assert.deepStrictEqual(
          pool?._tag === "PoolReady"
            ? pool.capacity.map((c) => [c.capacity.memoryLimitBytes, c.capacity.speedSource])
            : [],
          [
            [2 ** 30, "declared"],
            [smallLimit, "declared"]
          ]
        )
        const finished = capacity.find((u) => u._tag === "Finished")
        assert.isTrue(finished?._tag === "Finished")

        const balanced = yield* Effect.flip(Stream.runCollect(run(request)).pipe(Effect.provide(layer)))
        assert.strictEqual(balanced._tag, "StageOverMemory")
        assert.match(balanced.message, /stage\(s\) 1 on node 2 need about/)

        // The same split given by hand produces the same text.
        const fixed = yield* Stream.runCollect(
          run({
            ...request,
            placement: {
              _tag: "Fixed",
              ranges: [
                [0, 4],
                [4, 5]
              ]
            }
          })
        ).pipe(Effect.map(Chunk.toReadonlyArray), Effect.provide(layer))
        const finishedFixed = fixed.find((u) => u._tag === "Finished")
        assert.isTrue(
          finished?._tag === "Finished" &&
            finishedFixed?._tag === "Finished" &&
            finished.summary.text === finishedFixed.summary.text &&
            finished.summary.text.length > 0
        )
      }).pipe(Effect.scoped),
    180_000
  )

  // `swactor run --placement capacity --dry-run` explains the choice per node: memory, speed, blocks, bytes stored and
  // read per token, ms.
  it.live(
    "swactor run --dry-run explains a placement per node; --layers sets a fixed one",
    () =>
      Effect.gen(function* () {
        const cli = (extra: ReadonlyArray<string>, model = requireModel("stories260K.gguf")) =>
          Effect.async<{ code: number | null; stdout: string; stderr: string }>((resume) => {
            const { args, command } = swactorCommand(["run", "--model", model, "--threads", "1", "--dry-run", ...extra])
            const child = spawn(command, args, { cwd: repoRoot, stdio: ["ignore", "pipe", "pipe"] })
            let stdout = ""
            let stderr = ""
            child.stdout.on("data", (chunk) => (stdout += chunk))
            child.stderr.on("data", (chunk) => (stderr += chunk))
            child.on("exit", (code) => resume(Effect.succeed({ code, stdout, stderr })))
          })
        const fixed = yield* cli(["--layers", "0-0,1-4"])
        assert.strictEqual(fixed.code, 0, fixed.stderr)
        assert.match(fixed.stdout, /stage 0: blocks \[0, 1\) on 127\.0\.0\.1:\d+/)
        assert.match(fixed.stdout, /stage 1: blocks \[1, 5\) on 127\.0\.0\.1:\d+/)
        assert.include(fixed.stdout, "fixed placement, in the planner's cost model:")
        // The agents measured their speed at start (a timed ggml matrix product).
        assert.match(fixed.stdout, /node 2 127\.0\.0\.1:\d+: .* stages hosted, \d+\.\d\d GB\/s measured/)
        assert.match(
          fixed.stdout,
          /stage 1 on node 2 \(\d+\.\d MiB free, \d+\.\d\d GB\/s\): 4 blocks \[1, 5\), \d+\.\d MiB weights, \d+\.\d MiB read per token, \d+\.\d MiB with KV and buffers, \d+\.\d\d ms\/token/
        )
        assert.match(fixed.stdout, /expected: \d+\.\d\d ms per token for one sequence/)
        const bad = yield* cli(["--layers", "0-2,4-4"])
        assert.notStrictEqual(bad.code, 0)
        assert.include(bad.stderr, "blocks 3..3 are in no range")

        // A mixture of experts (blocks 2 and 3: 32 stacked experts, 2 routed per token), split between its dense and
        // MoE blocks: each stage shows the weight bytes it stores and the fewer it reads per token.
        const dir = mkdtempSync(join(tmpdir(), "swactor-moe-dry-"))
        try {
          const path = join(dir, "moe.gguf")
          yield* writeMoeFile({ path, layers: 4, moeBlocks: [2, 3], experts: 32, expertsUsed: 2 })
          const layout = yield* readModelLayout(path)
          const active = layout.activeBlockBytes!
          const moe = yield* cli(["--layers", "0-1,2-3"], path)
          assert.strictEqual(moe.code, 0, moe.stderr)
          const mib = (bytes: number) => `${(bytes / 2 ** 20).toFixed(1)} MiB`
          // Stage 0 stores the embedding too (a lookup reads one row of it per token: counted as nothing).
          assert.include(
            moe.stdout,
            `2 blocks [0, 2), ${mib(layout.blockBytes[0]! + layout.blockBytes[1]! + layout.inputBytes)} weights, ` +
              `${mib(active[0]! + active[1]!)} read per token`
          )
          // Stage 1: 3 MiB of experts per block stored, 2/32 of them read, plus the output head.
          const stored1 = layout.blockBytes[2]! + layout.blockBytes[3]! + layout.outputBytes
          const read1 = active[2]! + active[3]! + layout.outputBytes
          assert.isBelow(read1, stored1 / 4)
          assert.include(moe.stdout, `2 blocks [2, 4), ${mib(stored1)} weights, ${mib(read1)} read per token`)
        } finally {
          rmSync(dir, { recursive: true, force: true })
        }
      }),
    120_000
  )
})
