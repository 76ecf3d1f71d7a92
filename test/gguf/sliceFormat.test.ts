/**
 * A slice stream states its slice's format and byte order (issue 42): the agent takes `gguf-le` (GGUF is little-endian
 * by its spec) and refuses any other in one line (reason `Io`, not retried) before it opens a partial file. Real
 * sockets, the agent's receiving side (SliceStream.receiveSlice) with a sink that records what it was asked.
 */
import * as Fs from "node:fs"
import * as Net from "node:net"
import * as Os from "node:os"
import * as Path from "node:path"
import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import { receiveSlice, SLICE_STREAM_MAGIC, type SliceSink } from "../../src/layers/gguf/SliceStream.js"

/**
 * A server handing each connection to `receiveSlice`; `opened` lists the hashes the sink was asked to open (its
 * partial files go to a temporary folder, removed at the end).
 */
const agent = Effect.acquireRelease(
  Effect.async<{ port: number; opened: Array<string>; server: Net.Server; dir: string }>((resume) => {
    const opened: Array<string> = []
    const dir = Fs.mkdtempSync(Path.join(Os.tmpdir(), "swactor-slice-format-"))
    const sink: SliceSink = {
      open: (hash) =>
        Effect.sync(() => {
          opened.push(hash)
          return { path: Path.join(dir, "partial"), release: () => {} }
        }),
      verified: () => {}
    }
    const server = Net.createServer((socket) => {
      socket.on("error", () => {})
      Effect.runFork(receiveSlice(socket, sink))
    })
    server.listen(0, "127.0.0.1", () =>
      resume(Effect.succeed({ port: (server.address() as Net.AddressInfo).port, opened, server, dir }))
    )
  }),
  ({ dir, server }) =>
    Effect.async<void>((resume) => void server.close(() => resume(Effect.void))).pipe(
      Effect.ensuring(Effect.sync(() => Fs.rmSync(dir, { recursive: true, force: true })))
    )
)

/** Sends a slice request stating `format`; resolves with the agent's first answer (undefined: it closed first). */
const ask = (port: number, format: string) =>
  Effect.promise(
    () =>
      new Promise<unknown>((resolve) => {
        const socket = Net.createConnection({ host: "127.0.0.1", port })
        const body = Buffer.from(
          JSON.stringify({ v: 1, hash: "ab".repeat(32), offset: 0, total: 16, sha256: "00".repeat(32), format })
        )
        const length = Buffer.alloc(4)
        length.writeUInt32LE(body.length, 0)
        let received = Buffer.alloc(0)
        socket.on("connect", () => socket.write(Buffer.concat([SLICE_STREAM_MAGIC, length, body])))
        socket.on("data", (chunk: Buffer) => {
          received = Buffer.concat([received, chunk])
          if (received.length >= 4 && received.length >= 4 + received.readUInt32LE(0)) {
            resolve(JSON.parse(received.subarray(4, 4 + received.readUInt32LE(0)).toString("utf8")))
            socket.destroy()
          }
        })
        socket.on("error", () => {})
        socket.on("close", () => resolve(undefined))
      })
  )

describe("a slice stream states its slice format", () => {
  it.scopedLive("a big-endian GGUF slice is refused in one line before anything is opened", () =>
    Effect.gen(function* () {
      const { opened, port } = yield* agent
      const answer = yield* ask(port, "gguf-be")
      assert.deepStrictEqual(answer, {
        ok: false,
        reason: "Io",
        message: 'the slice stream sends "gguf-be" slices; this node reads gguf-le only: refused'
      })
      assert.deepStrictEqual(opened, [])
    })
  )

  // The format every orchestrator of this release states: the agent goes on to open the partial slice.
  it.scopedLive("a gguf-le slice goes on to its partial file", () =>
    Effect.gen(function* () {
      const { opened, port } = yield* agent
      yield* ask(port, "gguf-le").pipe(Effect.timeout("5 seconds"), Effect.ignore)
      assert.deepStrictEqual(opened, ["ab".repeat(32)])
    })
  )
})
