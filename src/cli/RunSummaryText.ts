/**
 * The summary `swactor run` prints on stderr after a completed run: tokens, timings, stages, recoveries, stragglers, and
 * with --timeline the per-token timeline (services/Timeline.ts).
 */
import { formatAddress } from "../layers/agent/AgentControlRpc.js"
import type { RunSummary } from "../services/Orchestrator.js"
import { renderTimeline } from "../services/Timeline.js"
import { mib, ms, size } from "./Units.js"

/** A GPU stage's split: its blocks on the device, and device memory planned and allocated, host memory planned. */
const deviceText = (device: RunSummary["stages"][number]["device"], layers: readonly [number, number]): string =>
  device === undefined
    ? ""
    : `, ${device.blocks} of ${layers[1] - layers[0]} blocks on the device: weights ${size(device.allocated.weightBytes)} ` +
      `of ${size(device.weightBytes)} planned, caches ${size(device.allocated.cacheBytes)} of ${size(device.cacheBytes)}, ` +
      `compute ${size(device.allocated.computeBytes)} of ${size(device.computeBytes)}; host ${size(device.hostBytes)}`

export const renderSummary = (summary: RunSummary): string => {
  const lines = [
    `${summary.generatedTokens} tokens (${summary.outcome === "Eos" ? "end of sequence" : "max tokens"}), ` +
      `prompt ${summary.promptTokens} tokens`,
    `time to first token ${ms(summary.timeToFirstTokenMillis)} ms (prefill through the pipeline ${ms(summary.prefillMillis)} ms)`,
    `decode ${summary.decodeTokensPerSecond.toFixed(1)} tok/s (${ms(summary.decodeMillisPerToken)} ms per token: ` +
      `compute ${ms(summary.decodeMillisPerToken - summary.transferMillisPerToken)} ms, transfer ${ms(summary.transferMillisPerToken)} ms)`
  ]
  const spec = summary.speculative
  if (spec !== undefined) {
    const rate = spec.drafted === 0 ? "-" : `${((100 * spec.accepted) / spec.drafted).toFixed(0)}%`
    lines.push(
      `speculative: ${spec.steps} steps drafted ${spec.drafted} tokens, ${spec.accepted} kept (acceptance ${rate})`
    )
  }
  for (const s of summary.stages) {
    lines.push(
      `  stage ${s.stageIndex} blocks [${s.layers[0]}, ${s.layers[1]}) on ${s.address} (data ${formatAddress(s.dataAddress)}` +
        `${s.backend === undefined ? "" : `, ${s.backend}`}${deviceText(s.device, s.layers)}): ` +
        `compute ${ms(s.computeMillisPerToken)} ms/token, load ${ms(s.loadMillis)} ms${s.cachedWeights ? " (cached weights)" : ""}` +
        (s.peakResidentBytes > 0
          ? `; agent memory ${mib(s.residentBytes)}, peak ${mib(s.peakResidentBytes)} (KV ${size(s.kvBytes)}, compute ${size(
              s.computeBytes
            )})`
          : "")
    )
  }
  if (summary.recoveries.length > 0) {
    lines.push(`recoveries: ${summary.recoveries.length}`)
    for (const r of summary.recoveries) {
      lines.push(`  attempt ${r.attempt} after ${r.resumedAt} tokens, ${ms(r.millis)} ms: ${r.reason}`)
    }
  }
  if (summary.stragglers.length > 0) {
    lines.push(
      `stragglers: ${summary.stragglers.length} slow tokens (${summary.stragglers
        .slice(0, 5)
        .map((s) => `#${s.step} ${ms(s.latencyMillis)} ms vs median ${ms(s.medianMillis)} ms`)
        .join(", ")}${summary.stragglers.length > 5 ? ", ..." : ""})`
    )
  }
  for (const s of summary.stageStragglers) {
    lines.push(
      `straggling stage ${s.stageIndex} on ${s.address}: ${s.tokens} slow token${s.tokens === 1 ? "" : "s"} ` +
        `(median ${ms(s.medianMillis)} ms, worst ${ms(s.worstMillis)} ms at #${s.worstStep})`
    )
  }
  if (summary.timeline !== undefined) lines.push(...renderTimeline(summary.timeline))
  return lines.join("\n")
}
