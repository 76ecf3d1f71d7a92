import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import type { LoadProgress, StageLoadSpec } from "../src/domain/engine.js"
import { readGgufFile } from "../src/layers/gguf/GgufReader.js"
import { LiveLoadedStage, StageExecutorLive } from "../src/layers/StageExecutorLive.js"
import { StageExecutor } from "../src/services/StageExecutor.js"
import { requireModel } from "./support/models.js"

const blockNames = (il: number) =>
  ["attn_q", "attn_k", "attn_v", "attn_output", "attn_norm", "ffn_gate", "ffn_down", "ffn_up", "ffn_norm"].map((n) =>
    `blk.${il}.${n}.weight`
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
  for (const [role, spec] of stages) {
    // weightBytes is the GGUF table's size of exactly the stage's tensors, and that is what was allocated and read.
    it.live(`${role} stage [${spec.layerStart}, ${spec.layerEndExclusive}): reported bytes = sum of its tensors' sizes`, () =>
      Effect.scoped(Effect.gen(function*() {
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
        assert.strictEqual(live.placements.reduce((s, p) => s + p.bytes, 0), tableBytes)
        // backend buffers: the tensors plus alignment padding only
        assert.isAtLeast(live.bufferBytes, tableBytes)
        assert.isAtMost(live.bufferBytes, tableBytes + 64 * names.length + 4096)
        const last = progress[progress.length - 1]!
        assert.deepStrictEqual(last, { loadedBytes: tableBytes, totalBytes: tableBytes })
        assert.isTrue(progress.every((p, i) => i === 0 || p.loadedBytes >= progress[i - 1]!.loadedBytes))
        assert.isBelow(tableBytes, file.fileSize / 2)
      }).pipe(Effect.provide(StageExecutorLive))))
  }
})
