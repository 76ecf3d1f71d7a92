/** The start-up progress of `swactor run` on stderr: agents, the plan, weight deliveries, stage loading, recoveries. */
import { Effect } from "effect"
import type { RunUpdate } from "../services/Orchestrator.js"
import { bar, ms } from "./Units.js"

export type Transfers = Map<string, { readonly at: number; readonly bytes: number }>

type Delivery = Extract<RunUpdate, { _tag: "WeightsDelivery" }>

/** A transfer's rate (bytes/s, 0 until half a second in) and seconds left, from its first report in `transfers`. */
export const transferRate = (
  update: Delivery,
  transfers: Transfers
): { readonly bytesPerSecond: number; readonly secondsLeft: number | undefined } => {
  const key = `${update.stageIndex}:${update.address}`
  const first = transfers.get(key) ?? { at: Date.now(), bytes: update.sentBytes }
  transfers.set(key, first)
  const seconds = (Date.now() - first.at) / 1000
  const bytesPerSecond = seconds > 0.5 ? (update.sentBytes - first.bytes) / seconds : 0
  return {
    bytesPerSecond,
    secondsLeft:
      bytesPerSecond > 0 && update.sentBytes < update.totalBytes
        ? (update.totalBytes - update.sentBytes) / bytesPerSecond
        : undefined
  }
}

/** One stage's weights on their way: sent by this process, or fetched from the hub by the node; rate and time left. */
const deliveryText = (update: Delivery, transfers: Transfers): string => {
  const { bytesPerSecond, secondsLeft } = transferRate(update, transfers)
  return (
    (update.source === "Hub"
      ? `stage ${update.stageIndex} on ${update.address} fetching from the hub `
      : `weights for stage ${update.stageIndex} to ${update.address} `) +
    `${bar(update.totalBytes > 0 ? update.sentBytes / update.totalBytes : 1)} ` +
    `${(update.sentBytes / 2 ** 20).toFixed(1)}/${(update.totalBytes / 2 ** 20).toFixed(1)} MiB` +
    (bytesPerSecond > 0 ? ` ${(bytesPerSecond / 2 ** 20).toFixed(1)} MiB/s` : "") +
    (secondsLeft !== undefined ? ` ${Math.ceil(secondsLeft)} s left` : "")
  )
}

/** Renders start-up progress on stderr: one line rewritten in place on a terminal, plain lines otherwise. */
export const makeProgress = (quiet: boolean) => {
  const tty = process.stderr.isTTY === true
  const loading = new Map<number, number>()
  const ready = new Set<number>()
  const transfers: Transfers = new Map()
  let stageCount = 0
  let open = false
  const line = (text: string) => {
    if (quiet) return
    if (tty) {
      process.stderr.write(`\r\x1b[2K${text}`)
      open = true
    } else process.stderr.write(`${text}\n`)
  }
  const done = () => {
    if (open) process.stderr.write("\n")
    open = false
  }
  const render = () => {
    const fraction =
      stageCount === 0
        ? 0
        : [...Array(stageCount).keys()].reduce((sum, i) => sum + (ready.has(i) ? 1 : (loading.get(i) ?? 0)), 0) /
          stageCount
    return `loading ${stageCount} stage${stageCount === 1 ? "" : "s"} ${bar(fraction)} ${ready.size}/${stageCount} ready`
  }
  return {
    update: (update: RunUpdate) =>
      Effect.sync(() => {
        switch (update._tag) {
          case "AgentsStarted":
            return line(`agents: ${update.nodes.map((n) => n.address).join(", ")}`) ?? (tty ? undefined : undefined)
          case "Planned":
            stageCount = update.stages.length
            if (!tty && !quiet) {
              for (const s of update.stages)
                line(`stage ${s.stageIndex}: blocks [${s.layers[0]}, ${s.layers[1]}) on ${s.address}`)
            }
            return line(render())
          case "WeightsDelivery": {
            const text = deliveryText(update, transfers)
            if (tty) return line(text)
            return update.sentBytes === update.totalBytes ? line(text) : undefined
          }
          case "StageLoading":
            loading.set(update.stageIndex, update.totalBytes > 0 ? update.loadedBytes / update.totalBytes : 0)
            return tty ? line(render()) : undefined
          case "StageReady":
            ready.add(update.stageIndex)
            line(render())
            if (ready.size === stageCount) done()
            return
          case "Recovering":
            done()
            ready.clear()
            loading.clear()
            process.stderr.write(
              `\nswactor run: recovering (attempt ${update.attempt}) after ${update.resumedAt} tokens: ${update.reason}\n`
            )
            return
          case "Recovered":
            done()
            process.stderr.write(
              `swactor run: recovered in ${ms(update.recovery.millis)} ms on ${update.recovery.stages
                .map((s) => `stage ${s.stageIndex} [${s.layers[0]}, ${s.layers[1]}) ${s.address}`)
                .join(", ")}\n`
            )
            return
          default:
            return
        }
      }),
    done: Effect.sync(done),
    allReady: () => stageCount > 0 && ready.size === stageCount
  }
}
