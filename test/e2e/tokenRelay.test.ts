// RemotePoolOptions dataListen/dataAdvertise (bench:wan's relayed token link): the orchestrator's data listener binds
// the given address and the last stage is told to send its tokens to the advertised one, here a byte-counting TCP
// forwarder in front of the listener. The run's tokens are node-llama-cpp's greedy tokens, and every token crossed
// the forwarder. stories260K, two real agent processes on loopback.
import * as Net from "node:net"
import { assert, describe, it } from "@effect/vitest"
import { Chunk, Effect, Stream } from "effect"
import { layerRemote, run } from "../../src/api/generate.js"
import { tcpAddress } from "../../src/domain/frames.js"
import { generateToken, spawnLocalAgents } from "../../src/layers/agent/AgentProcesses.js"
import { referenceRun } from "../support/engine.js"
import { requireModel } from "../support/models.js"

const prompt = "Once upon a time"
const maxTokens = 12

const listenOn = (server: Net.Server) =>
  Effect.async<number>((resume) => {
    server.listen(0, "127.0.0.1", () => resume(Effect.succeed((server.address() as Net.AddressInfo).port)))
  })

/** A TCP forwarder to `port` that counts the connections and the bytes going toward the target. */
const forwarder = (port: number) =>
  Effect.acquireRelease(
    Effect.gen(function* () {
      const seen = { connections: 0, bytes: 0 }
      const sockets = new Set<Net.Socket>()
      const server = Net.createServer((client) => {
        seen.connections++
        const upstream = Net.createConnection({ host: "127.0.0.1", port })
        for (const s of [client, upstream]) {
          sockets.add(s)
          s.on("error", () => {
            client.destroy()
            upstream.destroy()
          })
        }
        client.on("data", (c: Buffer) => (seen.bytes += c.length))
        client.pipe(upstream)
        upstream.pipe(client)
      })
      return { server, sockets, seen, port: yield* listenOn(server) }
    }),
    ({ server, sockets }) =>
      Effect.sync(() => {
        for (const s of sockets) s.destroy()
        server.close()
      })
  )

const freePort = Effect.gen(function* () {
  const server = Net.createServer()
  const port = yield* listenOn(server)
  yield* Effect.async<void>((resume) => void server.close(() => resume(Effect.void)))
  return port
})

describe("remote pool: the orchestrator's token listener behind an advertised address", () => {
  it.live(
    "the last stage sends its tokens to dataAdvertise; the text is node-llama-cpp's",
    () =>
      Effect.gen(function* () {
        const model = requireModel("stories260K.gguf")
        const expected = (yield* Effect.promise(() =>
          referenceRun(model, prompt, maxTokens, { threads: 1, contextLength: 256 })
        )).tokens
        const token = generateToken()
        const agents = yield* spawnLocalAgents({ count: 2, token, threads: 1 })
        const listenPort = yield* freePort
        const front = yield* forwarder(listenPort)
        const layer = layerRemote({
          agents: agents.map((a) => a.address),
          token,
          listenHost: "127.0.0.1",
          dataListen: tcpAddress(listenPort),
          dataAdvertise: tcpAddress(front.port)
        })
        const updates = Chunk.toReadonlyArray(
          yield* Stream.runCollect(run({ model, prompt, stages: 2, maxTokens, threads: 1 })).pipe(Effect.provide(layer))
        )
        const tokens = updates.flatMap((u) => (u._tag === "Token" ? [u.token.tokenId] : []))
        assert.deepStrictEqual(tokens, [...expected])
        assert.isAtLeast(front.seen.connections, 1)
        // Each token's frame crossed the forwarder (a frame is more than 4 bytes).
        assert.isAtLeast(front.seen.bytes, 4 * maxTokens)
      }).pipe(Effect.scoped),
    120_000
  )
})
