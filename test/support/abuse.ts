/**
 * Hostile and careless requests against a running `swactor serve`, over raw sockets where an HTTP client would not
 * send them (stalled bodies, silent connections, floods), and a watch on a concurrent stream: its largest gap
 * between tokens while a case runs. Used by test/server/edge.test.ts and `npm run bench:abuse` (bench/abuse.ts).
 */
import { spawn } from "node:child_process"
import { connect, type Socket } from "node:net"
import { readFileSync } from "node:fs"
import { fileURLToPath } from "node:url"

export const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms))

/** A raw HTTP exchange: the status line's code (0 when the connection closed first), headers and body as text. */
export interface RawAnswer {
  readonly status: number
  readonly headers: string
  readonly body: string
  readonly millis: number
  /** How the exchange ended: the server answered, closed the connection, or the client gave up. */
  readonly ended: "answered" | "closed" | "timeout"
}

/**
 * Sends `head` (request line and headers, without the blank line) then `body` parts, `gapMs` apart, and reads what
 * comes back until the server closes, the answer is complete, or `timeoutMs`.
 */
export const rawRequest = (
  url: string,
  head: string,
  body: ReadonlyArray<string | Buffer> = [],
  options: { readonly gapMs?: number; readonly timeoutMs?: number } = {}
): Promise<RawAnswer> =>
  new Promise((resolve) => {
    const { hostname, port } = new URL(url)
    const started = Date.now()
    const socket = connect(Number(port), hostname)
    let received = Buffer.alloc(0)
    let done = false
    const finish = (ended: RawAnswer["ended"]) => {
      if (done) return
      done = true
      clearTimeout(timer)
      socket.destroy()
      const text = received.toString("utf8")
      const split = text.indexOf("\r\n\r\n")
      const headers = split < 0 ? text : text.slice(0, split)
      const status = Number(
        /^HTTP\/1\.[01] (\d{3})/.exec(text.replace(/^HTTP\/1\.1 100 Continue\r\n\r\n/, ""))?.[1] ?? 0
      )
      resolve({ status, headers, body: split < 0 ? "" : text.slice(split + 4), millis: Date.now() - started, ended })
    }
    const timer = setTimeout(() => finish("timeout"), options.timeoutMs ?? 20_000)
    socket.on("data", (chunk: Buffer) => {
      received = Buffer.concat([received, chunk])
      const text = received.toString("utf8").replace(/^HTTP\/1\.1 100 Continue\r\n\r\n/, "")
      const split = text.indexOf("\r\n\r\n")
      const length = /\r\ncontent-length: (\d+)/i.exec(text.slice(0, split))?.[1]
      if (split >= 0 && length !== undefined && Buffer.byteLength(text.slice(split + 4)) >= Number(length))
        finish("answered")
    })
    socket.on("close", () => finish(received.length > 0 ? "answered" : "closed"))
    socket.on("error", () => finish("closed"))
    socket.on("connect", async () => {
      socket.write(`${head}\r\n\r\n`)
      for (const part of body) {
        if (done) return
        if (options.gapMs !== undefined) await sleep(options.gapMs)
        if (!socket.destroyed) socket.write(part)
      }
    })
  })

/** Opens `count` TCP connections that never send a byte; `close` ends those still open. */
export const silentConnections = async (url: string, count: number) => {
  const { hostname, port } = new URL(url)
  const sockets: Array<Socket> = []
  let closedByServer = 0
  await Promise.all(
    Array.from(
      { length: count },
      () =>
        new Promise<void>((resolve) => {
          const socket = connect(Number(port), hostname, () => resolve())
          socket.on("error", () => resolve())
          socket.on("close", () => {
            closedByServer++
            resolve()
          })
          sockets.push(socket)
        })
    )
  )
  return {
    closedByServer: () => closedByServer,
    close: () => {
      for (const socket of sockets) socket.destroy()
    }
  }
}

/** The resident set of a process, in bytes (0 when it is gone). */
export const residentBytes = (pid: number): number => {
  try {
    const kib = /VmRSS:\s+(\d+) kB/.exec(readFileSync(`/proc/${pid}/status`, "utf8"))?.[1]
    return kib === undefined ? 0 : Number(kib) * 1024
  } catch {
    return 0
  }
}

/**
 * Greedy streams one after another until stopped, recording the gaps between their tokens (not between streams):
 * what a concurrent user sees while a case runs. They run in a process of their own (watchStreams.mjs), so the work
 * of sending a case (building a big body, opening many sockets) never shows as a gap. `started` resolves once three
 * tokens came; `stop` gives the largest gap, the median, the number of tokens, the streams' texts (each must equal the
 * lone greedy text), errors, and connections refused before an answer (retried, as clients do).
 */
export const watchStreams = (url: string, prompt = "Once upon a time", maxTokens = 48) => {
  const child = spawn(
    process.execPath,
    [fileURLToPath(new URL("./watchStreams.mjs", import.meta.url)), url, prompt, String(maxTokens)],
    {
      stdio: ["pipe", "pipe", "inherit"]
    }
  )
  let output = ""
  let onLine: (() => void) | undefined
  child.stdout!.setEncoding("utf8")
  child.stdout!.on("data", (chunk: string) => {
    output += chunk
    onLine?.()
  })
  const started = new Promise<void>((resolve, reject) => {
    onLine = () => {
      if (output.includes("started\n")) resolve()
    }
    child.once("exit", () => reject(new Error(`the stream watcher exited before it started: ${output}`)))
  })
  const exited = new Promise<void>((resolve) => child.once("exit", () => resolve()))
  let stopped: Promise<StreamWatch> | undefined
  return {
    started,
    /** Ends the streams (once: later calls give the same result). */
    stop: (): Promise<StreamWatch> =>
      (stopped ??= (async () => {
        child.stdin!.end()
        await exited
        const last = output.trim().split("\n").at(-1) ?? "{}"
        return JSON.parse(last) as StreamWatch
      })())
  }
}

export interface StreamWatch {
  readonly maxGapMillis: number
  readonly medianGapMillis: number
  readonly tokens: number
  readonly texts: ReadonlyArray<string>
  readonly errors: ReadonlyArray<string>
  readonly refusedConnections: number
}
