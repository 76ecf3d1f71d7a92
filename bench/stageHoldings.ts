/**
 * What a model's stages hold, from its GGUF header alone (no tensor data read): each stage's weights (StageLayout's
 * weightBytes) and KV bytes per cached position, for an even split into `stageCount` stages (Planner.partitionLayers,
 * the split `swactor serve` makes without a placement). Shared by bench:memory and bench:moe.
 */
import { Effect } from "effect"
import { readHParams } from "../src/layers/engine/HParams.js"
import { archOf, layoutStage } from "../src/layers/engine/StageLayout.js"
import { readHeader, readModelLayout } from "../src/layers/gguf/ModelCatalogLive.js"
import { partitionLayers } from "../src/services/Planner.js"

export interface Holdings {
  readonly label: string
  readonly weights: number
  /** KV cache bytes of one cached position (F16 K and V of the blocks held). */
  readonly kvPerToken: number
}

export const modelHoldings = (path: string, stageCount: number) =>
  Effect.runPromise(
    Effect.gen(function* () {
      const file = yield* readHeader(path)
      const hp = yield* readHParams(file, (yield* archOf(file)).ropeMode)
      const layoutOf = (start: number, end: number) =>
        layoutStage(file, {
          path,
          layerStart: start,
          layerEndExclusive: end,
          isFirst: start === 0,
          isLast: end === hp.nLayer
        })
      // as StageInfo.kvBytesPerToken (StageExecutorLive): blocks x (K + V head size) x KV heads x 2 bytes (F16)
      const kvPerToken = (blocks: number) => blocks * (hp.headDimK + hp.headDimV) * hp.nHeadKv * 2
      const perStage: Array<Holdings> = []
      for (const [start, end] of partitionLayers(hp.nLayer, stageCount)) {
        const layout = yield* layoutOf(start, end)
        perStage.push({ label: `[${start}, ${end})`, weights: layout.weightBytes, kvPerToken: kvPerToken(end - start) })
      }
      const whole = yield* layoutOf(0, hp.nLayer)
      return {
        hp,
        perStage,
        whole: {
          label: "whole model",
          weights: whole.weightBytes,
          kvPerToken: kvPerToken(hp.nLayer)
        } satisfies Holdings,
        fileTensorBytes: file.tensors.reduce((s, t) => s + t.byteSize, 0),
        layout: yield* readModelLayout(path)
      }
    })
  )
