/**
 * What a node logs about connections that never authenticate (issue 41), through a real `swactor node` process and
 * real sockets: a connection that opens the data port (or the control port) and closes before the handshake (a TCP
 * health probe, a port scan, a peer that gives up) is a DEBUG line, never the authentication warning; a failed proof
 * is exactly one WARN line, however many closes come around it from the same address.
 */
import * as Net from "node:net"
import { randomBytes } from "node:crypto"
import { describe, expect, it } from "vitest"
import { Effect, Either, Redacted } from "effect"
import type { TransportAddress } from "../../src/domain/frames.js"
import { generateToken } from "../../src/layers/agent/AgentProcesses.js"
import * as Auth from "../../src/layers/transport/Auth.js"

// The test's own e2e helpers start the node (test/support/e2e.ts).
import { startTestNode } from "../support/e2e.js"

const tcpPort = (address: TransportAddress) => {
  if (address._tag !== "Tcp") throw new Error(`expected a TCP data address, got ${JSON.stringify(address)}`)
  return address.port
}

/** Opens a connection and closes it as soon as it is connected; resolves once it is closed. */
const openAndClose = (port: number) =>
  new Promise<void>((resolve) => {
    const socket = Net.createConnection({ host: "127.0.0.1", port }, () => socket.destroy())
    socket.on("error", () => {})
    socket.on("close", () => resolve())
  })

/** `count` of those, `batch` at a time. */
const openAndCloseMany = async (port: number, count: number, batch = 25) => {
  for (let done = 0; done < count; done += batch) {
    await Promise.all(Array.from({ length: Math.min(batch, count - done) }, () => openAndClose(port)))
  }
}

/**
 * A forged handshake: a proper Hello, then a Proof of random bytes (no token behind it) after the node's Challenge.
 * Resolves with the node's verdict byte (0: refused).
 */
const forgedHandshake = (port: number) =>
  new Promise<number>((resolve, reject) => {
    const socket = Net.createConnection({ host: "127.0.0.1", port })
    let received = Buffer.alloc(0)
    let proofSent = false
    socket.on("connect", () => {
      const hello = Buffer.alloc(Auth.HELLO_BYTES)
      hello.write("SWH1", 0, "ascii")
      hello[4] = 1
      randomBytes(Auth.NONCE_BYTES).copy(hello, 8)
      socket.write(hello)
    })
    socket.on("data", (chunk: Buffer) => {
      received = Buffer.concat([received, chunk])
      if (!proofSent && received.length >= Auth.CHALLENGE_BYTES) {
        proofSent = true
        received = received.subarray(Auth.CHALLENGE_BYTES)
        const proof = Buffer.alloc(Auth.PROOF_BYTES)
        proof.write("SWH3", 0, "ascii")
        randomBytes(32).copy(proof, 8)
        socket.write(proof)
      }
      if (proofSent && received.length >= Auth.VERDICT_BYTES) {
        resolve(received[4]!)
        socket.destroy()
      }
    })
    socket.on("error", () => {})
    socket.on("close", () => reject(new Error("the node closed the connection before its verdict")))
  })

/** The node's lines at `level` about connections from this test (`what` as the listener names them). */
const lines = (stderr: string, level: "WARN" | "DEBUG", what: string) =>
  stderr.split("\n").filter((line) => line.includes(`level=${level}`) && line.includes(`${what} from 127.0.0.1`))

/** Its DEBUG lines about connections closed before they authenticated. */
const closeLines = (stderr: string, what: string) =>
  lines(stderr, "DEBUG", what).filter((line) => line.includes("closed before authenticating"))

/** Waits until `check` holds (polling the node's output), at most `timeoutMs`. */
const until = async (check: () => boolean, timeoutMs: number) => {
  const end = Date.now() + timeoutMs
  while (!check() && Date.now() < end) await new Promise((resolve) => setTimeout(resolve, 25))
}

describe("a node's log: closes before the handshake are not attacks (issue 41)", () => {
  it("200 connections that open the data port and close at once: no authentication warning; one forged handshake among them: exactly one", async () => {
    const node = await startTestNode({ logLevel: "debug" })
    try {
      const port = tcpPort(node.data)
      await openAndCloseMany(port, 100)
      expect(await forgedHandshake(port)).toBe(0)
      await openAndCloseMany(port, 100)
      // The control port: the same rule.
      await openAndCloseMany(node.port, 50)
      const closes = () => closeLines(node.stderr(), "data-plane connection")
      const controlCloses = () => closeLines(node.stderr(), "control-plane connection")
      const warnings = () => lines(node.stderr(), "WARN", "data-plane connection")
      await until(() => closes().length >= 200 && controlCloses().length >= 50 && warnings().length >= 1, 30_000)
      const stderr = node.stderr()
      expect(warnings(), stderr).toHaveLength(1)
      expect(warnings()[0]).toMatch(
        /data-plane connection from 127\.0\.0\.1 refused: authentication failed: client proof does not match the cluster token/
      )
      expect(closes(), stderr).toHaveLength(200)
      expect(closes()[0]).toMatch(/data-plane connection from 127\.0\.0\.1 closed before authenticating/)
      expect(lines(stderr, "WARN", "control-plane connection"), stderr).toHaveLength(0)
      expect(controlCloses(), stderr).toHaveLength(50)
    } finally {
      await node.stop()
    }
  }, 90_000)

  it("a peer with another cluster token (it leaves after the node's challenge) is one warning among closes", async () => {
    const node = await startTestNode({ logLevel: "debug" })
    try {
      const port = tcpPort(node.data)
      await openAndCloseMany(port, 50)
      const wrong = await Effect.runPromise(
        Effect.either(
          Effect.async<Net.Socket>((resume) => {
            const socket = Net.createConnection({ host: "127.0.0.1", port }, () => resume(Effect.succeed(socket)))
            socket.on("error", () => {})
          }).pipe(Effect.flatMap((socket) => Auth.clientHandshake(socket, { token: Redacted.make(generateToken()) })))
        )
      )
      expect(Either.isLeft(wrong)).toBe(true)
      await openAndCloseMany(port, 50)
      const warnings = () => lines(node.stderr(), "WARN", "data-plane connection")
      const closes = () => closeLines(node.stderr(), "data-plane connection")
      await until(() => closes().length >= 100 && warnings().length >= 1, 30_000)
      expect(warnings(), node.stderr()).toHaveLength(1)
      expect(warnings()[0]).toMatch(/refused: authentication failed: .*another cluster token/)
      expect(closes(), node.stderr()).toHaveLength(100)
    } finally {
      await node.stop()
    }
  }, 90_000)

  it("over TLS (--tls always): closes before the TLS handshake are closes; a wrong token is one warning", async () => {
    const node = await startTestNode({ logLevel: "debug", args: ["--tls", "always"] })
    try {
      const port = tcpPort(node.data)
      await openAndCloseMany(port, 50)
      const wrong = await Effect.runPromise(
        Effect.either(
          Effect.async<Net.Socket>((resume) => {
            const socket = Net.createConnection({ host: "127.0.0.1", port }, () => resume(Effect.succeed(socket)))
            socket.on("error", () => {})
          }).pipe(
            Effect.flatMap((socket) =>
              Auth.clientHandshake(socket, { token: Redacted.make(generateToken()), tls: "always" })
            )
          )
        )
      )
      expect(Either.isLeft(wrong)).toBe(true)
      await openAndCloseMany(port, 50)
      const warnings = () => lines(node.stderr(), "WARN", "data-plane connection")
      const closes = () => closeLines(node.stderr(), "data-plane connection")
      await until(() => closes().length >= 100 && warnings().length >= 1, 30_000)
      expect(warnings(), node.stderr()).toHaveLength(1)
      expect(warnings()[0]).toMatch(/refused: authentication failed: TLS handshake failed/)
      expect(closes(), node.stderr()).toHaveLength(100)
    } finally {
      await node.stop()
    }
  }, 90_000)
})
