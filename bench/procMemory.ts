/**
 * Resident memory of processes from /proc, for bench:memory: one reading of /proc/PID/status, the kernel's peak reset
 * through /proc/PID/clear_refs, and a sampler on a worker thread that reads every tracked process every few ms (so a
 * busy event loop in this process does not stretch the interval) and keeps each one's highest VmRSS per phase.
 */
import { readFileSync, writeFileSync } from "node:fs"
import { Worker } from "node:worker_threads"

/** One reading of /proc/PID/status, in bytes. */
export interface MemStatus {
  /** VmRSS: resident now (anonymous + file-backed + shared memory). */
  readonly rss: number
  /** VmHWM: the kernel's peak of VmRSS (since the process started, or since its last reset). */
  readonly hwm: number
  /** RssAnon: heap, malloc'd and anonymously mapped memory (copied weights, KV cache, compute buffers, V8 heap). */
  readonly anon: number
  /** RssFile: pages of mapped files (a model file used in place, shared libraries, code). */
  readonly file: number
  /** RssShmem: shared memory (the stages' shared-memory rings, /dev/shm). */
  readonly shmem: number
}

const kib = (text: string, key: string): number => {
  const m = new RegExp(`^${key}:\\s+(\\d+) kB`, "m").exec(text)
  return m === null ? Number.NaN : Number(m[1]) * 1024
}

const parseStatus = (text: string): MemStatus => ({
  rss: kib(text, "VmRSS"),
  hwm: kib(text, "VmHWM"),
  anon: kib(text, "RssAnon"),
  file: kib(text, "RssFile"),
  shmem: kib(text, "RssShmem")
})

/** The process's memory now; undefined when it is gone. */
export const readStatus = (pid: number): MemStatus | undefined => {
  try {
    return parseStatus(readFileSync(`/proc/${pid}/status`, "utf8"))
  } catch {
    return undefined
  }
}

/** Resets the process's VmHWM to its VmRSS now (`echo 5 > /proc/PID/clear_refs`); false when not allowed. */
export const resetPeak = (pid: number): boolean => {
  try {
    writeFileSync(`/proc/${pid}/clear_refs`, "5")
    return true
  } catch {
    return false
  }
}

/** Whether the process maps `path` now (its /proc/PID/maps names it). */
export const mapsFile = (pid: number, path: string): boolean => {
  try {
    return readFileSync(`/proc/${pid}/maps`, "utf8").includes(path)
  } catch {
    return false
  }
}

/** The highest VmRSS a sampler saw of one process in a phase, with that reading and when (ms since the phase began). */
export interface SampledPeak extends MemStatus {
  readonly atMs: number
}

export interface Sampler {
  /** Starts sampling these processes too. */
  readonly track: (pids: ReadonlyArray<number>) => void
  /** Each tracked process's highest reading since the last cut (and the count of sampling passes); starts anew. */
  readonly cut: () => Promise<{ readonly peaks: ReadonlyMap<number, SampledPeak>; readonly passes: number }>
  readonly close: () => Promise<void>
}

// Plain CommonJS (an eval'd worker is not compiled by tsx): the same parsing as parseStatus.
const samplerSource = `
const { parentPort, workerData } = require("node:worker_threads")
const { readFileSync } = require("node:fs")
const kib = (text, key) => { const m = new RegExp("^" + key + ":\\\\s+(\\\\d+) kB", "m").exec(text); return m === null ? NaN : Number(m[1]) * 1024 }
const pids = new Set()
let peaks = new Map()
let passes = 0
let since = performance.now()
const sample = () => {
  passes++
  for (const pid of pids) {
    let text
    try { text = readFileSync("/proc/" + pid + "/status", "utf8") } catch { continue }
    const rss = kib(text, "VmRSS")
    const best = peaks.get(pid)
    if (best !== undefined && best.rss >= rss) continue
    peaks.set(pid, { rss, hwm: kib(text, "VmHWM"), anon: kib(text, "RssAnon"), file: kib(text, "RssFile"), shmem: kib(text, "RssShmem"), atMs: performance.now() - since })
  }
}
setInterval(sample, workerData.intervalMs)
parentPort.on("message", (m) => {
  if (m.type === "track") for (const pid of m.pids) pids.add(pid)
  if (m.type === "cut") {
    sample()
    parentPort.postMessage({ id: m.id, peaks: [...peaks], passes })
    peaks = new Map()
    passes = 0
    since = performance.now()
  }
})
`

export const startSampler = (intervalMs: number): Sampler => {
  const worker = new Worker(samplerSource, { eval: true, workerData: { intervalMs } })
  let nextId = 0
  const waiting = new Map<number, (reply: { peaks: Array<[number, SampledPeak]>; passes: number }) => void>()
  worker.on("message", (m: { id: number; peaks: Array<[number, SampledPeak]>; passes: number }) => {
    waiting.get(m.id)?.(m)
    waiting.delete(m.id)
  })
  return {
    track: (pids) => worker.postMessage({ type: "track", pids: [...pids] }),
    cut: () =>
      new Promise((resolve) => {
        const id = nextId++
        waiting.set(id, (m) => resolve({ peaks: new Map(m.peaks), passes: m.passes }))
        worker.postMessage({ type: "cut", id })
      }),
    close: async () => {
      await worker.terminate()
    }
  }
}

/** What one process did in one phase. */
export interface PhaseFigures {
  readonly phase: string
  readonly seconds: number
  /** The kernel's peak over the phase (VmHWM read at its end, reset at its start where allowed). */
  readonly hwm: number
  /** The sampler's highest VmRSS in the phase. */
  readonly sampled: SampledPeak | undefined
  /** The reading at the phase's end. */
  readonly end: MemStatus | undefined
  readonly passes: number
}

/**
 * Phases of a set of processes: `cut(name)` closes the phase that began at the previous cut (or at `start`), reading
 * each process's VmHWM then resetting it, so each phase's peak is its own; the peak over all phases is their largest.
 */
export const phaseTracker = (sampler: Sampler) => {
  const pids: Array<number> = []
  const byPid = new Map<number, Array<PhaseFigures>>()
  let began = performance.now()
  /** false once a reset was refused: VmHWM is then the peak since the process started, for every phase. */
  let resets = true
  return {
    track: (more: ReadonlyArray<number>) => {
      for (const pid of more) {
        if (!pids.includes(pid)) {
          pids.push(pid)
          byPid.set(pid, [])
        }
      }
      sampler.track(more)
    },
    cut: async (phase: string) => {
      const { passes, peaks } = await sampler.cut()
      const seconds = (performance.now() - began) / 1000
      for (const pid of pids) {
        const end = readStatus(pid)
        if (end !== undefined && !resetPeak(pid)) resets = false
        byPid.get(pid)!.push({ phase, seconds, hwm: end?.hwm ?? Number.NaN, sampled: peaks.get(pid), end, passes })
      }
      began = performance.now()
    },
    phases: (pid: number): ReadonlyArray<PhaseFigures> => byPid.get(pid) ?? [],
    get resetsWorked() {
      return resets
    }
  }
}

export type PhaseTracker = ReturnType<typeof phaseTracker>
