/**
 * bench:wan's link simulator, run as its own process (bench/wan.ts starts it) so its timers do not share an event
 * loop with the orchestrator: TCP relays on loopback, each forwarding to one target with a fixed one-way delay and a
 * bandwidth cap, in both directions independently (full duplex).
 *
 * Per direction, a chunk read at time t leaves the link's "wire" at `sent = max(t, wire free) + bytes × 8 / rate`
 * (the bytes queued before it are serialised first: a token bucket of zero depth) and is written to the other side at
 * `sent + delay`. Timing: a setTimeout for all but the last ~1.5 ms, then setImmediate turns until the due time (timers
 * alone fire up to a millisecond late). A direction holding more than `queueLimit` bytes stops reading its source
 * until the queue drains; a congested destination (write() false) holds the queue until 'drain'.
 *
 * Protocol: one JSON line per request on stdin, `{"id", "target": {"host","port"}, "listenPort"?, "delayMs",
 * "bitsPerSecond"}`; the answer is one line on stdout, `{"id", "port"}` (the relay's listening port on 127.0.0.1).
 * Exits when stdin closes; WAN_RELAY_DEBUG=1 logs each relayed connection on stderr. Bench-only code.
 */
import * as Net from "node:net"
import * as Readline from "node:readline"

interface LinkRequest {
  readonly id: number
  readonly target: { readonly host: string; readonly port: number }
  readonly listenPort?: number
  readonly delayMs: number
  readonly bitsPerSecond: number
}

const queueLimit = 8 << 20
/** WAN_RELAY_DEBUG=1: one stderr line per relayed connection. */
const debug = process.env["WAN_RELAY_DEBUG"] === "1"
/** Below this much time to go, turn the loop (setImmediate) instead of sleeping on a timer. */
const spinMs = 1.5

/** One direction of one connection: `from`'s bytes written to `to` after the link's serialisation and delay. */
const pipeDelayed = (from: Net.Socket, to: Net.Socket, delayMs: number, bitsPerSecond: number) => {
  const queue: Array<{ readonly due: number; readonly chunk: Buffer | null }> = []
  let queued = 0
  let wireFree = 0
  let scheduled = false
  let blocked = false
  const pump = () => {
    scheduled = false
    if (blocked) return
    let now = performance.now()
    while (queue.length > 0 && queue[0]!.due <= now) {
      const { chunk } = queue.shift()!
      if (chunk === null) {
        to.end()
        return
      }
      queued -= chunk.length
      if (from.isPaused() && queued < queueLimit / 2) from.resume()
      if (!to.write(chunk)) {
        blocked = true
        to.once("drain", () => {
          blocked = false
          schedule()
        })
        return
      }
      now = performance.now()
    }
    schedule()
  }
  const schedule = () => {
    if (scheduled || blocked || queue.length === 0) return
    scheduled = true
    const wait = queue[0]!.due - performance.now()
    if (wait > spinMs) setTimeout(pump, wait - spinMs)
    else setImmediate(pump)
  }
  const enqueue = (chunk: Buffer | null) => {
    const now = performance.now()
    const bytes = chunk === null ? 0 : chunk.length
    wireFree = Math.max(now, wireFree) + (bytes * 8 * 1000) / bitsPerSecond
    queue.push({ due: wireFree + delayMs, chunk })
    queued += bytes
    if (queued > queueLimit) from.pause()
    schedule()
  }
  from.on("data", (chunk: Buffer) => enqueue(chunk))
  from.on("end", () => enqueue(null))
}

const openLink = (request: LinkRequest): Promise<number> =>
  new Promise((resolve, reject) => {
    const server = Net.createServer({ allowHalfOpen: true, noDelay: true }, (client) => {
      if (debug)
        process.stderr.write(
          `relay ${(server.address() as Net.AddressInfo).port} -> ${request.target.port}: connection\n`
        )
      const upstream = Net.createConnection({
        host: request.target.host,
        port: request.target.port,
        allowHalfOpen: true,
        noDelay: true
      })
      const teardown = () => {
        client.destroy()
        upstream.destroy()
      }
      client.on("error", teardown)
      upstream.on("error", teardown)
      // A clean close: the end travels as a queued marker (after the bytes before it); a reset tears both down.
      client.on("close", (hadError) => hadError && upstream.destroy())
      upstream.on("close", (hadError) => hadError && client.destroy())
      pipeDelayed(client, upstream, request.delayMs, request.bitsPerSecond)
      pipeDelayed(upstream, client, request.delayMs, request.bitsPerSecond)
    })
    server.once("error", reject)
    server.listen(request.listenPort ?? 0, "127.0.0.1", () => resolve((server.address() as Net.AddressInfo).port))
  })

const lines = Readline.createInterface({ input: process.stdin })
lines.on("line", (line) => {
  if (line.trim() === "") return
  const request = JSON.parse(line) as LinkRequest
  openLink(request).then(
    (port) => process.stdout.write(`${JSON.stringify({ id: request.id, port })}\n`),
    (error: unknown) => process.stdout.write(`${JSON.stringify({ id: request.id, error: String(error) })}\n`)
  )
})
lines.on("close", () => process.exit(0))
