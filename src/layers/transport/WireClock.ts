/**
 * The clock of `swactor run --timeline` (services/Timeline.ts) and what the data plane stamps with it (a few
 * `performance.now()` reads per frame whether or not a timeline is asked for; the arrivals are kept only once one is):
 * - `monoNow`: ms on the host's monotonic clock (libuv's hrtime, CLOCK_MONOTONIC on Linux), the same in every process
 *   of one machine, so an agent's times and the orchestrator's compare. `clockId` names that clock (the boot id).
 * - When each received data frame's bytes arrived (the socket's data event, or the drain of a shared-memory ring) and
 *   when it was decoded, by frame (`arrivalOf`), once a timeline was asked for in this process (`keepArrivals`).
 * - The time spent encoding data frames (`encodedMillis`, a running total this process's senders add to), and when the
 *   last one's bytes were handed over (`lastWrittenAt`).
 */
import * as Fs from "node:fs"
import * as Os from "node:os"
import type { DataFrame } from "../../domain/frames.js"

/** performance.now() is libuv's hrtime from this process's start: one offset turns it into the host's clock. */
const origin = Number(process.hrtime.bigint()) / 1e6 - performance.now()

/** Now, in ms on the host's monotonic clock. */
export const monoNow = (): number => performance.now() + origin

/** A `performance.now()` time of this process on the host's monotonic clock. */
export const monoOf = (performanceNow: number): number => performanceNow + origin

const readClockId = (): string => {
  try {
    const id = Fs.readFileSync("/proc/sys/kernel/random/boot_id", "utf8").trim()
    if (id !== "") return `${Os.hostname()}/${id}`
  } catch {
    // not Linux: this process's own clock, comparable with no other
  }
  return `${Os.hostname()}/pid ${process.pid}`
}

let clock: string | undefined
/** The monotonic clock's name: equal in two processes when their `monoNow` times compare. */
export const clockId = (): string => (clock ??= readClockId())

/** When a received frame's bytes arrived and when it was decoded (monoNow). */
export interface FrameArrival {
  readonly arrivedAt: number
  readonly decodedAt: number
}

const arrivals = new WeakMap<DataFrame, FrameArrival>()
let burstAt = 0
/** Off until a timeline is asked for in this process: then every frame's arrival is kept (a WeakMap entry). */
let stamping = false

/** From now on this process keeps every received frame's arrival (a run or a stage with a timeline). */
export const keepArrivals = (): void => {
  stamping = true
}

/** A burst of bytes arrived (a socket's data event, a shared-memory drain): the frames decoded from it arrived now. */
export const markBurst = (): void => {
  burstAt = monoNow()
}

/** `frame` was decoded from the last burst (once whole: a chunked message's last chunk). */
export const stampArrival = (frame: DataFrame): void => {
  if (stamping) arrivals.set(frame, { arrivedAt: burstAt, decodedAt: monoNow() })
}

/** When `frame` arrived, if it came through a data-plane edge of this process. */
export const arrivalOf = (frame: DataFrame): FrameArrival | undefined => arrivals.get(frame)

const encoding = { millis: 0, writtenAt: 0 }

/**
 * A data frame was encoded (taking `millis`) and its bytes are being handed to the socket or published in the ring
 * now (`performance.now()`: `at`).
 */
export const noteEncoded = (millis: number, at: number): void => {
  encoding.millis += millis
  encoding.writtenAt = at
}

/** ms spent encoding data frames in this process so far: the difference over a send is its framing. */
export const encodedMillis = (): number => encoding.millis

/**
 * When the last data frame's bytes were handed over (performance.now): the start of a link, which its receiver's
 * arrival cannot precede (the end of the write can: the receiver may run before the writer is scheduled again).
 */
export const lastWrittenAt = (): number => encoding.writtenAt
