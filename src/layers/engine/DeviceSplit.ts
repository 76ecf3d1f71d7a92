/**
 * A GPU stage's split between its device and host memory, from its layout (StageLayout.ts) and the device's budget:
 * services/DeviceFit.ts's rule over the bytes this stage really loads.
 */
import { computeEstimate, type DeviceShare, deviceShare, type StageBytes } from "../../services/DeviceFit.js"
import { kvCacheSize, swaCacheSize } from "../../services/KvSize.js"
import type { Ggml, Ptr } from "../ggml/Bindings.js"
import { blockMemory, kvBytesPerTokenOfMemory, stateBytesOfMemory } from "./BlockMemory.js"
import type { HParams } from "./HParams.js"
import type { PlannedTensor, StageLayout } from "./StageLayout.js"
import { deviceComputesWeight } from "./WeightPlacement.js"

/** Bytes one session of `contextLength` keeps for block `il` (KV rows over its cache, or its recurrent state). */
const cacheBytesOfBlock = (hp: HParams, il: number, contextLength: number): number => {
  const m = blockMemory(hp, il)
  if (m.kind === "state") return stateBytesOfMemory(m)
  const cells =
    m.kind === "kv" && m.window !== undefined ? swaCacheSize(contextLength, m.window) : kvCacheSize(contextLength)
  return kvBytesPerTokenOfMemory(m) * cells
}

/**
 * The stage's memory, part by part, at `contextLength`; the weights `devicePlaced` refuses (a type the device does not
 * compute) are pinned to host memory.
 */
export const stageBytesOf = (
  layout: StageLayout,
  contextLength: number,
  devicePlaced: (t: PlannedTensor) => boolean = () => true
): StageBytes => {
  const { hp, spec } = layout
  const blocks: Array<{ weightBytes: number; cacheBytes: number }> = []
  for (let il = spec.layerStart; il < spec.layerEndExclusive; il++) {
    blocks.push({ weightBytes: 0, cacheBytes: cacheBytesOfBlock(hp, il, contextLength) })
  }
  let inputBytes = 0
  let headBytes = 0
  let pinnedHostBytes = 0
  for (const t of layout.tensors) {
    if (!devicePlaced(t)) {
      pinnedHostBytes += t.info.byteSize
      continue
    }
    const block = /^blk\.(\d+)\./.exec(t.name)
    if (block !== null) blocks[Number(block[1]) - spec.layerStart]!.weightBytes += t.info.byteSize
    else if (t.part === "input") inputBytes += t.info.byteSize
    else headBytes += t.info.byteSize
  }
  const computeBytes = computeEstimate(hp.nEmbd, kvCacheSize(contextLength))
  return { blocks, inputBytes, headBytes, computeBytes, pinnedHostBytes }
}

/** The device's free memory now (ggml_backend_dev_memory). */
const freeBytesOf = (ggml: Ggml, dev: Ptr): number => {
  const free = [0]
  const total = [0]
  ggml.raw.ggml_backend_dev_memory(dev, free, total)
  return free[0]!
}

/** How much of the stage `dev` holds: within `budgetBytes` (the node's cap) and the device's free memory. */
export const splitForDevice = (
  layout: StageLayout,
  ggml: Ggml,
  dev: Ptr,
  contextLength: number,
  budgetBytes: number | undefined
): DeviceShare =>
  deviceShare(
    stageBytesOf(layout, contextLength, (t) => deviceComputesWeight(ggml, dev, t.use, t.info.type, t.info.dims)),
    Math.min(budgetBytes ?? Infinity, freeBytesOf(ggml, dev))
  )
