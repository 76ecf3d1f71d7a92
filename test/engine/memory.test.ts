import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import type { LoadProgress, StageLoadSpec } from "../../src/domain/engine.js"
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { afterAll } from "vitest"
import { readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { writeSyntheticModel } from "../../src/layers/gguf/Synthetic.js"
import { MAPPED_BUFFER_TYPE } from "../../src/layers/engine/Weights.js"
import { layerWith, LiveLoadedStage } from "../../src/layers/engine/StageExecutorLive.js"
import { StageExecutor } from "../../src/services/StageExecutor.js"
import { requireModel } from "../support/models.js"

const blockNames = (il: number) =>
  ["attn_q", "attn_k", "attn_v", "attn_output", "attn_norm", "ffn_gate", "ffn_down", "ffn_up", "ffn_norm"].map(
    (n) => `blk.${il}.${n}.weight`
  )

/** What a stage of stories260K must hold, from the llama layout (independent of the engine's planner). */
const expectedNames = (spec: StageLoadSpec) => {
  const names: Array<string> = []
  if (spec.isFirst) names.push("token_embd.weight")
  for (let il = spec.layerStart; il < spec.layerEndExclusive; il++) names.push(...blockNames(il))
  if (spec.isLast) names.push("output_norm.weight", "output.weight")
  return names.sort()
}

describe("a stage's memory holds only its tensors", () => {
  const path = requireModel("stories260K.gguf")
  const stages: ReadonlyArray<readonly [string, StageLoadSpec]> = [
    ["first", { path, layerStart: 0, layerEndExclusive: 2, isFirst: true, isLast: false }],
    ["middle", { path, layerStart: 2, layerEndExclusive: 3, isFirst: false, isLast: false }],
    ["last", { path, layerStart: 3, layerEndExclusive: 5, isFirst: false, isLast: true }]
  ]
  for (const [role, spec] of stages)
    for (const mmap of [true, false]) {
      // weightBytes is the GGUF table's size of exactly the stage's tensors, and that is what was mapped or
      // allocated and read.
      it.live(
        `${role} stage [${spec.layerStart}, ${spec.layerEndExclusive}) ${mmap ? "mapped" : "copied"}: bytes = sum of its tensors' sizes`,
        () =>
          Effect.scoped(
            Effect.gen(function* () {
              const file = yield* readGgufFile(path)
              const names = expectedNames(spec)
              const tableBytes = names.reduce((s, n) => s + file.tensorsByName.get(n)!.byteSize, 0)
              const progress: Array<LoadProgress> = []
              const executor = yield* StageExecutor
              const stage = yield* executor.load(spec, (p) => progress.push(p))
              assert.strictEqual(stage.info.weightBytes, tableBytes)
              assert.instanceOf(stage, LiveLoadedStage)
              const live = stage as LiveLoadedStage
              assert.deepStrictEqual(live.placements.map((p) => p.name).sort(), names)
              assert.strictEqual(
                live.placements.reduce((s, p) => s + p.bytes, 0),
                tableBytes
              )
              // F32 weights: mapped, every one is used in place and nothing is allocated; copied, nothing is mapped
              const inPlace = live.placements.filter((p) => p.bufferType === MAPPED_BUFFER_TYPE)
              assert.strictEqual(inPlace.length, mmap ? names.length : 0)
              assert.strictEqual(live.mappedBytes, mmap ? tableBytes : 0)
              // allocated backend buffers: the copied tensors plus alignment padding only
              const copied = tableBytes - live.mappedBytes
              assert.isAtLeast(live.bufferBytes, copied)
              assert.isAtMost(live.bufferBytes, copied === 0 ? 0 : copied + 64 * names.length + 4096)
              const last = progress[progress.length - 1]!
              assert.deepStrictEqual(last, { loadedBytes: tableBytes, totalBytes: tableBytes })
              assert.isTrue(progress.every((p, i) => i === 0 || p.loadedBytes >= progress[i - 1]!.loadedBytes))
              assert.isBelow(tableBytes, file.fileSize / 2)
            }).pipe(Effect.provide(layerWith({ mmap })))
          )
      )
    }
})

describe("quantized stages: repacked weights still hold exactly the stage's tensors", () => {
  const dir = mkdtempSync(join(tmpdir(), "swactor-engine-mem-"))
  afterAll(() => rmSync(dir, { recursive: true, force: true }))
  const path = join(dir, "qwen3-q4_k.gguf")
  const layers = 4
  const qwen3Block = (il: number) =>
    [
      "attn_norm",
      "attn_q",
      "attn_k",
      "attn_v",
      "attn_q_norm",
      "attn_k_norm",
      "attn_output",
      "ffn_norm",
      "ffn_gate",
      "ffn_up",
      "ffn_down"
    ].map((n) => `blk.${il}.${n}.weight`)
  const stages: ReadonlyArray<readonly [string, StageLoadSpec]> = [
    ["first", { path, layerStart: 0, layerEndExclusive: 1, isFirst: true, isLast: false }],
    ["middle", { path, layerStart: 1, layerEndExclusive: 3, isFirst: false, isLast: false }],
    ["last", { path, layerStart: 3, layerEndExclusive: 4, isFirst: false, isLast: true }]
  ]
  for (const [role, spec] of stages) {
    // Q4_K matrices go to llama.cpp's CPU_REPACK buffers; the embedding (gathered by row) and norms stay plain.
    it.live(`${role} stage of a Q4_K model: bytes = table sizes, matrices repacked`, () =>
      Effect.scoped(
        Effect.gen(function* () {
          if (role === "first") {
            yield* writeSyntheticModel({
              path,
              arch: "qwen3",
              layers,
              hidden: 256,
              ffn: 512,
              heads: 4,
              kvHeads: 2,
              vocab: 400,
              contextLength: 256,
              type: "q4_k",
              seed: 5
            })
          }
          const file = yield* readGgufFile(path)
          const names: Array<string> = []
          if (spec.isFirst) names.push("token_embd.weight")
          for (let il = spec.layerStart; il < spec.layerEndExclusive; il++) names.push(...qwen3Block(il))
          if (spec.isLast) names.push("output_norm.weight", "output.weight")
          const tableBytes = names.reduce((s, n) => s + file.tensorsByName.get(n)!.byteSize, 0)
          const executor = yield* StageExecutor
          const stage = (yield* executor.load(spec)) as LiveLoadedStage
          assert.strictEqual(stage.info.weightBytes, tableBytes)
          assert.deepStrictEqual(stage.placements.map((p) => p.name).sort(), names.sort())
          // mapped in place: exactly the placements marked so; allocated: the rest plus alignment padding
          const inPlaceBytes = stage.placements
            .filter((p) => p.bufferType === MAPPED_BUFFER_TYPE)
            .reduce((s, p) => s + p.bytes, 0)
          assert.strictEqual(stage.mappedBytes, inPlaceBytes)
          assert.isAtLeast(stage.bufferBytes, tableBytes - inPlaceBytes)
          assert.isAtMost(stage.bufferBytes, tableBytes - inPlaceBytes + 64 * names.length + 8192)
          // (CPU_REPACK needs AVX2 or NEON; on a CPU without them every tensor stays in plain CPU memory)
          const isMatrix = (n: string) =>
            /attn_(q|k|v|output)\.weight|ffn_(gate|up|down)\.weight|^output\.weight/.test(n)
          const matrixBufts = new Set(stage.placements.filter((p) => isMatrix(p.name)).map((p) => p.bufferType))
          assert.strictEqual(matrixBufts.size, 1)
          assert.include(["CPU_REPACK", MAPPED_BUFFER_TYPE], [...matrixBufts][0])
          // the rest is plain: used in place from the mapping (GGUF data is 32-byte aligned, as ggml needs)
          for (const p of stage.placements.filter((p) => !isMatrix(p.name))) {
            assert.strictEqual(p.bufferType, MAPPED_BUFFER_TYPE, p.name)
          }
        }).pipe(Effect.provide(layerWith({})))
      )
    )
  }
})
