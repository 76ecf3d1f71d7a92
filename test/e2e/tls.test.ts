// Encrypted links end to end (issue 10): a two-stage run over real agent processes whose stage 0 → stage 1
// activations pass a recording proxy. With TLS the capture holds no frame, auth message or activation in the clear;
// without it the same capture does (so the check can see plaintext). Loopback is forced into TLS with
// SWACTOR_TLS=always in the agents' environment and the Settings service of this process (the orchestrator), exactly
// as a link between hosts is encrypted by default.
import * as Net from "node:net"
import { assert, describe, it } from "@effect/vitest"
import { Chunk, Effect, Stream } from "effect"
import { generate } from "../../src/api/generate.js"
import { Settings } from "../../src/layers/config/Settings.js"
import { TLS_ENV, type TlsMode } from "../../src/layers/transport/Tls.js"
import { startAgents } from "../support/e2e.js"
import { requireModel } from "../support/models.js"

const freePort = Effect.async<number>((resume) => {
  const server = Net.createServer()
  server.listen(0, "127.0.0.1", () => {
    const port = (server.address() as Net.AddressInfo).port
    server.close(() => resume(Effect.succeed(port)))
  })
})

/** A proxy on an ephemeral port forwarding to `target`, recording every byte both ways. */
const recordingProxy = (target: number) =>
  Effect.acquireRelease(
    Effect.async<{ readonly port: number; readonly captured: () => Buffer; readonly server: Net.Server }>((resume) => {
      const chunks: Array<Buffer> = []
      const server = Net.createServer((client) => {
        const upstream = Net.createConnection({ host: "127.0.0.1", port: target })
        const pipe = (from: Net.Socket, to: Net.Socket) => {
          from.on("data", (chunk: Buffer) => {
            chunks.push(chunk)
            to.write(chunk)
          })
          from.on("error", () => to.destroy())
          from.on("close", () => to.destroy())
        }
        pipe(client, upstream)
        pipe(upstream, client)
      })
      server.listen(0, "127.0.0.1", () =>
        resume(
          Effect.succeed({
            port: (server.address() as Net.AddressInfo).port,
            captured: () => Buffer.concat(chunks),
            server
          })
        )
      )
    }),
    ({ server }) => Effect.sync(() => server.close())
  )

const splitRun = (mode: TlsMode) =>
  Effect.gen(function* () {
    const stage1Port = yield* freePort
    const proxy = yield* recordingProxy(stage1Port)
    const { layer } = yield* startAgents(2, {
      env: { [TLS_ENV]: mode },
      // Stage 1's agent listens on stage1Port and tells the orchestrator (hence stage 0) the proxy's port.
      extraArgs: (i) =>
        i === 1 ? ["--data-listen", `127.0.0.1:${stage1Port}`, "--data-advertise", `127.0.0.1:${proxy.port}`] : []
    })
    const tokens = yield* Stream.runCollect(
      generate({
        model: requireModel("stories260K.gguf"),
        prompt: "Once upon a time",
        stages: 2,
        maxTokens: 8,
        threads: 1
      })
    ).pipe(Effect.provide(layer))
    const text = Chunk.toReadonlyArray(tokens)
      .map((t) => t.text)
      .join("")
    return { text, captured: proxy.captured() }
  }).pipe(Effect.scoped, Effect.provide(Settings.layer({ tls: mode })))

describe("end to end: encrypted links between stages (stories260K)", () => {
  it.live(
    "a capture between two stages holds nothing in the clear under TLS, and the text is unchanged",
    () =>
      Effect.gen(function* () {
        const magic = Buffer.from("SWAF", "ascii")
        const hello = Buffer.from("SWH1", "ascii")
        const plain = yield* splitRun("off")
        assert.isTrue(plain.captured.includes(magic), "the plain capture shows frames")
        assert.isTrue(plain.captured.includes(hello), "the plain capture shows the auth handshake")

        const encrypted = yield* splitRun("always")
        assert.strictEqual(encrypted.text, plain.text)
        assert.strictEqual(encrypted.text, ", there was a little girl")
        assert.isAbove(encrypted.captured.length, 5 * 64 * 4, "activations passed the proxy")
        assert.strictEqual(encrypted.captured[0], 0x16, "a TLS handshake record opens the link")
        assert.isFalse(encrypted.captured.includes(magic), "frame magic in the clear")
        assert.isFalse(encrypted.captured.includes(hello), "auth handshake in the clear")
        // No 16-byte window of the plain run's activation stream appears in the encrypted capture.
        const plainBody = plain.captured.subarray(plain.captured.indexOf(magic))
        for (let at = 0; at + 16 <= Math.min(plainBody.length, 4096); at += 61) {
          assert.isFalse(encrypted.captured.includes(plainBody.subarray(at, at + 16)), `plain bytes at ${at}`)
        }
      }),
    180_000
  )
})
