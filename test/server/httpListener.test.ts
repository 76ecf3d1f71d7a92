/**
 * Node's HTTP server under the HTTP front (src/layers/server/HttpListener.ts): a connection closed after a refusal
 * lingers, so a client still sending the body it was refused reads the answer instead of a reset. Over a real socket,
 * with the client forced into the race CI lost once (the openai client's 3 MB prompt, refused 413 from its
 * Content-Length, got "fetch failed"): it reads the whole answer, then keeps sending, as a client that writes its body
 * before it reads does.
 */
import { afterEach, assert, describe, it } from "@effect/vitest"
import type { Server } from "node:http"
import { connect } from "node:net"
import type { AddressInfo } from "node:net"
import { defaultHttpLimits } from "../../src/layers/server/HttpGuard.js"
import { type ConnectionStats, lingerMillis, makeNodeServer } from "../../src/layers/server/HttpListener.js"

/** A server whose every answer is an early 413 with `connection: close`, the body never read (as declaredTooLarge). */
const refusingServer = async (): Promise<{ server: Server; port: number; stats: ConnectionStats }> => {
  const stats: ConnectionStats = { open: 0, refused: 0, dropped: 0 }
  const server = makeNodeServer(defaultHttpLimits, stats)
  server.on("request", (_request, response) => {
    response.writeHead(413, { "content-type": "application/json", connection: "close" })
    response.end('{"error":{"message":"too large"}}')
  })
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve))
  return { server, port: (server.address() as AddressInfo).port, stats }
}

interface Seen {
  readonly answer: string
  readonly errors: ReadonlyArray<string>
  readonly ended: boolean
}

/**
 * Sends the head and a first piece, waits for the whole answer, then writes `moreBytes` of body (each write awaited)
 * and waits for the server to close. A reset shows as an error (EPIPE, ECONNRESET) on a write or the socket.
 */
const sendPastAnswer = (port: number, moreBytes: number, declared: number): Promise<Seen> =>
  new Promise((resolve) => {
    // half-open allowed, as a client still writing its body: the server's FIN does not end the client's side
    const socket = connect({ port, host: "127.0.0.1", allowHalfOpen: true })
    const errors: Array<string> = []
    let answer = ""
    let ended = false
    let answered: () => void = () => undefined
    const whole = new Promise<void>((r) => (answered = r))
    socket.setEncoding("utf8")
    socket.on("data", (chunk: string) => {
      answer += chunk
      if (answer.includes('"too large"}}')) answered()
    })
    socket.on("end", () => (ended = true))
    socket.on("error", (error: NodeJS.ErrnoException) => errors.push(error.code ?? error.message))
    socket.on("close", () => resolve({ answer, errors, ended }))
    socket.on("connect", async () => {
      socket.write(
        `POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: ${declared}\r\n\r\n`
      )
      socket.write(Buffer.alloc(16 * 1024, "x"))
      await whole
      // let the server finish its close before more arrives
      await new Promise((r) => setTimeout(r, 50))
      const piece = Buffer.alloc(64 * 1024, "x")
      for (let sent = 0; sent < moreBytes && !socket.destroyed; sent += piece.length) {
        await new Promise<void>((r) => socket.write(piece, () => r()))
      }
      socket.end()
    })
  })

describe("HttpListener: lingering close", () => {
  let server: Server | undefined
  afterEach(() => {
    server?.closeAllConnections()
    server?.close()
    server = undefined
  })

  it("a client still sending a refused body gets the answer and a clean close, no reset", async () => {
    const started = await refusingServer()
    server = started.server
    const seen = await sendPastAnswer(started.port, 2 * 2 ** 20, 3 * 2 ** 20)
    assert.match(seen.answer, /^HTTP\/1\.1 413 /)
    assert.deepStrictEqual(seen.errors, [], "the client's writes after the answer were reset")
    assert.isTrue(seen.ended, "the server ended its side (FIN) rather than reset")
  })

  it("lingering is bounded: the server closes a connection whose client neither sends nor closes after the linger time", async () => {
    const started = await refusingServer()
    server = started.server
    const client = connect({ port: started.port, host: "127.0.0.1", allowHalfOpen: true })
    let answer = ""
    const answered = new Promise<number>((resolve) =>
      client.on("data", (chunk: Buffer) => {
        answer += chunk.toString("utf8")
        if (answer.includes('"too large"}}')) resolve(performance.now())
      })
    )
    client.on("error", () => undefined)
    client.write(
      `POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: ${3 * 2 ** 20}\r\n\r\n${"x".repeat(1024)}`
    )
    const answeredAt = await answered
    assert.match(answer, /^HTTP\/1\.1 413 /)
    assert.strictEqual(started.stats.open, 1, "the connection lingers after its answer")
    while (started.stats.open > 0 && performance.now() - answeredAt < lingerMillis + 5_000)
      await new Promise((r) => setTimeout(r, 50))
    const closedAfter = performance.now() - answeredAt
    client.destroy()
    assert.strictEqual(started.stats.open, 0, "the server never closed the lingering connection")
    assert.isAtLeast(closedAfter, lingerMillis - 100)
    assert.isBelow(closedAfter, lingerMillis + 2_000)
  })
})
