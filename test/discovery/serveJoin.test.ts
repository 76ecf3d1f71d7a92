// Nodes joining a running `serve --discover` (issue 39), on loopback with a private discovery port (other tests'
// nodes stay out), through dist/main.js:
// - a node started while streams run is heard, the pipeline re-planned onto it (the plan over three nodes is faster
//   per token by more than the margin: every node declares 1 MB/s, so the weights dominate the hop), and every stream,
//   those that spanned the switch included, gives the text it gives alone (whose start is node-llama-cpp's);
// - a node killed with SIGKILL leaves the discovered pool, a replay of its own announcement does not bring it back,
//   and restarted on its port with its state folder it comes back with the same id and serves again.
// Needs dist/ (npm run build) like the other command-line tests.
import { assert, describe, it } from "@effect/vitest"
import { type ChildProcess, spawn } from "node:child_process"
import * as Dgram from "node:dgram"
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { Effect } from "effect"
import { DISCOVERY_GROUP } from "../../src/domain/discovery.js"
import { generateToken, swactorCommand, swactorMain } from "../../src/layers/agent/AgentProcesses.js"
import { readSse, type ServeProcess, startServe, stopServe } from "../support/serve.js"
import { repoRoot, requireModel } from "../support/models.js"

const discoveryPort = 21000 + ((process.pid + 4111) % 20000)
/** node-llama-cpp's greedy continuation of the prompt, 32 tokens (as test/discovery/discoverRun.test.ts). */
const llamaText = ", there was a little girl named Lily. She loved to play outside in the park. One day, she saw"
const prompt = "Once upon a time"
const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms))

interface Node {
  readonly child: ChildProcess
  readonly id: string
}

/** A `swactor node` announcing on loopback; resolves with its id once its ready line is out. */
const startNode = (
  env: Record<string, string>,
  listen = "127.0.0.1:0",
  extra: ReadonlyArray<string> = []
): Promise<Node> =>
  new Promise((resolve, reject) => {
    const child = spawn(
      process.execPath,
      [swactorMain(), "node", "--listen", listen, "--threads", "1", "--speed", "1e6", ...extra],
      {
        cwd: repoRoot,
        stdio: ["ignore", "pipe", "pipe"],
        env: { ...process.env, SWACTOR_DISCOVERY_PORT: String(discoveryPort), ...env }
      }
    )
    let stderr = ""
    let ready = false
    const check = () => {
      const id = /announcing node ([0-9a-f]{32})/.exec(stderr)?.[1]
      if (ready && id !== undefined) resolve({ child, id })
    }
    child.stderr.on("data", (chunk) => {
      stderr += chunk
      check()
    })
    child.stdout.on("data", (chunk) => {
      ready ||= String(chunk).includes("swactor-node-ready")
      check()
    })
    child.on("exit", (code) => reject(new Error(`swactor node exited ${code}: ${stderr}`)))
  })

/** One streamed completion: its text, when it started and ended. */
const streamed = async (url: string, maxTokens: number) => {
  const start = Date.now()
  const response = await fetch(`${url}/v1/completions`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ prompt, max_tokens: maxTokens, temperature: 0, stream: true })
  })
  assert.strictEqual(response.status, 200, await response.clone().text())
  const events = await readSse(response)
  const text = events
    .filter((e) => e.data !== "[DONE]")
    .map((e) => (JSON.parse(e.data) as { choices: Array<{ text?: string }> }).choices[0]?.text ?? "")
    .join("")
  return { text, start, end: Date.now() }
}

/** Resolves with when `pattern` first shows in the server's stderr (polled every 20 ms), at most `withinMs`. */
const lineSeen = async (server: ServeProcess, pattern: RegExp, withinMs = 60_000, from = 0) => {
  for (const until = Date.now() + withinMs; Date.now() < until; await sleep(20)) {
    if (pattern.test(server.stderr().slice(from))) return Date.now()
  }
  throw new Error(`never saw ${pattern} in serve's stderr:\n${server.stderr()}`)
}

const nodeStates = async (url: string) =>
  ((await fetch(`${url}/api/status`).then((r) => r.json())) as { nodes: Array<{ address: string; state: string }> })
    .nodes

/** Children, a state folder and the server of one test, ended (SIGKILL, then the server) whatever happens. */
const world = () => {
  const dir = mkdtempSync(join(tmpdir(), "swactor-join-"))
  const children: Array<ChildProcess> = []
  let server: ServeProcess | undefined
  return {
    dir,
    token: generateToken(),
    keep: (node: Node) => (children.push(node.child), node),
    serve: (s: ServeProcess) => (server = s),
    end: Effect.promise(async () => {
      await stopServe(server)
      for (const child of children) child.kill("SIGKILL")
      rmSync(dir, { recursive: true, force: true })
    })
  }
}

describe("nodes joining a running serve --discover", () => {
  it.live(
    "a node started while streams run is added by a re-plan; every stream's text is unchanged",
    () =>
      Effect.gen(function* () {
        const w = world()
        yield* Effect.addFinalizer(() => w.end)
        const env = { SWACTOR_CLUSTER_TOKEN: w.token }
        yield* Effect.promise(async () => {
          for (const name of ["a", "b"]) w.keep(await startNode({ ...env, XDG_STATE_HOME: join(w.dir, name) }))
          const server = w.serve(
            await startServe(["--model", requireModel("stories260K.gguf"), "--discover", "--threads", "1"], {
              ...env,
              SWACTOR_DISCOVERY_PORT: String(discoveryPort)
            })
          )
          const lone = await streamed(server.url, 160)
          assert.isTrue(lone.text.startsWith(llamaText), lone.text)
          // streams on three workers, one after another, until a while after the re-plan
          let stop = false
          const runs: Array<{ text: string; start: number; end: number }> = []
          const workers = Array.from({ length: 3 }, async () => {
            while (!stop) runs.push(await streamed(server.url, 160))
          })
          await sleep(500)
          w.keep(await startNode({ ...env, XDG_STATE_HOME: join(w.dir, "c") }))
          const switchedAt = await lineSeen(server, /re-planned onto 3 nodes/)
          // until three streams that started on the new plan have ended
          for (let i = 0; i < 600 && runs.filter((r) => r.start > switchedAt).length < 3; i++) await sleep(100)
          stop = true
          await Promise.all(workers)
          assert.match(server.stderr(), /joined: re-planning: the slowest stage .* on 2 stages, .* on 3 /)
          for (const run of runs) assert.strictEqual(run.text, lone.text)
          assert.isTrue(
            runs.some((r) => r.start < switchedAt - 50 && r.end > switchedAt),
            "a stream ran across the switch"
          )
          assert.isTrue(
            runs.some((r) => r.start > switchedAt),
            "streams ran on the new plan"
          )
          const nodes = await nodeStates(server.url)
          assert.strictEqual(nodes.filter((n) => n.state === "ready").length, 3, JSON.stringify(nodes))
        })
      }).pipe(Effect.scoped),
    120_000
  )

  it.live(
    "a model that fits on no node alone waits, loading, and serves once a second node joins",
    () =>
      Effect.gen(function* () {
        const w = world()
        yield* Effect.addFinalizer(() => w.end)
        const env = { SWACTOR_CLUSTER_TOKEN: w.token }
        // 34 MiB each: one stage of stories260K needs about 34.3 MiB, each of two about 33.6
        const small = ["--memory-limit", String(34 * 2 ** 20)]
        yield* Effect.promise(async () => {
          w.keep(await startNode({ ...env, XDG_STATE_HOME: join(w.dir, "a") }, "127.0.0.1:0", small))
          const { args, command } = swactorCommand([
            "serve",
            "--port",
            "0",
            "--model",
            requireModel("stories260K.gguf"),
            "--discover",
            "--threads",
            "1"
          ])
          const child = spawn(command, args, {
            cwd: repoRoot,
            stdio: ["ignore", "ignore", "pipe"],
            env: { ...process.env, ...env, SWACTOR_DISCOVERY_PORT: String(discoveryPort) }
          })
          let stderr = ""
          child.stderr.on("data", (chunk) => (stderr += chunk))
          const exited = new Promise<{ code: number | null; signal: string | null }>((resolve) =>
            child.on("exit", (code, signal) => resolve({ code, signal }))
          )
          const server = w.serve({ child, url: "", healthSeen: [], stderr: () => stderr, exited })
          await lineSeen(server, /does not fit on the discovered nodes .*; waiting for more nodes/, 30_000)
          const url = /listening on (http:\/\/[^ \n]+)/.exec(stderr)![1]!
          assert.strictEqual((await fetch(`${url}/health`)).status, 503, "loading while it waits")
          w.keep(await startNode({ ...env, XDG_STATE_HOME: join(w.dir, "b") }, "127.0.0.1:0", small))
          await lineSeen(server, /ready: stories260K\.gguf, 2 stages/, 60_000)
          assert.strictEqual((await streamed(url, 32)).text, llamaText)
        })
      }).pipe(Effect.scoped),
    120_000
  )

  it.live(
    "two nodes with one id that appear while it serves are refused, naming both addresses, and never used",
    () =>
      Effect.gen(function* () {
        const w = world()
        yield* Effect.addFinalizer(() => w.end)
        const env = { SWACTOR_CLUSTER_TOKEN: w.token }
        yield* Effect.promise(async () => {
          w.keep(await startNode({ ...env, XDG_STATE_HOME: join(w.dir, "a") }))
          const server = w.serve(
            await startServe(["--model", requireModel("stories260K.gguf"), "--discover", "--threads", "1"], {
              ...env,
              SWACTOR_DISCOVERY_PORT: String(discoveryPort)
            })
          )
          // one state folder, one port, two loopback addresses: one id (a copied configuration)
          const port = 32000 + (process.pid % 20000)
          const twin = { ...env, XDG_STATE_HOME: join(w.dir, "twin") }
          const [first, second] = (
            await Promise.all([startNode(twin, `127.0.0.1:${port}`), startNode(twin, `127.0.0.2:${port}`)])
          ).map(w.keep)
          assert.isDefined(first)
          assert.isDefined(second)
          assert.strictEqual(first!.id, second!.id)
          await lineSeen(
            server,
            new RegExp(
              `not used: node id ${first!.id} is announced by two live nodes, 127\\.0\\.0\\.1:${port} and 127\\.0\\.0\\.2:${port}`
            ),
            20_000
          )
          await sleep(1500)
          assert.notMatch(server.stderr(), /re-plann/)
          assert.strictEqual((await nodeStates(server.url)).length, 1)
          assert.strictEqual((await streamed(server.url, 32)).text, llamaText)
        })
      }).pipe(Effect.scoped),
    120_000
  )

  it.live(
    "a node killed with SIGKILL leaves the pool, is not brought back by its stale announcement, and comes back restarted",
    () =>
      Effect.gen(function* () {
        const w = world()
        yield* Effect.addFinalizer(() => w.end)
        const env = { SWACTOR_CLUSTER_TOKEN: w.token }
        // every announcement of a's, as the LAN carries it (multicast on loopback)
        const heard = Dgram.createSocket({ type: "udp4", reuseAddr: true })
        yield* Effect.addFinalizer(() => Effect.sync(() => heard.close()))
        yield* Effect.async<void>(
          (resume) =>
            void heard.bind(discoveryPort, () => {
              heard.addMembership(DISCOVERY_GROUP, "127.0.0.1")
              heard.setMulticastInterface("127.0.0.1")
              resume(Effect.void)
            })
        )
        let stale: Buffer | undefined
        let idA = ""
        heard.on("message", (message) => {
          if (idA !== "" && message.toString("utf8").includes(idA)) stale = message
        })
        yield* Effect.promise(async () => {
          const portA = 31000 + (process.pid % 20000)
          const stateA = { ...env, XDG_STATE_HOME: join(w.dir, "a") }
          const a = w.keep(await startNode(stateA, `127.0.0.1:${portA}`))
          idA = a.id
          w.keep(await startNode({ ...env, XDG_STATE_HOME: join(w.dir, "b") }))
          const server = w.serve(
            await startServe(["--model", requireModel("stories260K.gguf"), "--discover", "--threads", "1"], {
              ...env,
              SWACTOR_DISCOVERY_PORT: String(discoveryPort)
            })
          )
          assert.strictEqual((await streamed(server.url, 32)).text, llamaText)
          assert.isDefined(stale, "a's announcements were heard")
          a.child.kill("SIGKILL")
          const left = new RegExp(`node ${idA} at 127\\.0\\.0\\.1:${portA} left the discovered pool`)
          await lineSeen(server, left, 20_000)
          const leftAt = server.stderr().search(left)
          // its own announcement again, as a late or replayed datagram
          for (let i = 0; i < 4; i++) {
            heard.send(stale!, discoveryPort, DISCOVERY_GROUP)
            await sleep(500)
          }
          const joined = new RegExp(`node ${idA} at 127\\.0\\.0\\.1:${portA} joined the discovered pool`)
          assert.notMatch(server.stderr().slice(leftAt), joined, "a stale announcement brought the dead node back")
          assert.strictEqual(
            (await nodeStates(server.url)).find((n) => n.address === `127.0.0.1:${portA}`)?.state,
            "lost"
          )
          assert.strictEqual((await streamed(server.url, 32)).text, llamaText, "the pool serves on the other")
          // restarted on its port with its state folder: the same id, heard again, back in the pipeline
          const again = w.keep(await startNode(stateA, `127.0.0.1:${portA}`))
          assert.strictEqual(again.id, idA)
          await lineSeen(server, joined, 20_000, leftAt)
          for (let tries = 0; tries < 200; tries++) {
            const state = (await nodeStates(server.url)).find((n) => n.address === `127.0.0.1:${portA}`)?.state
            if (state === "ready") break
            await sleep(100)
          }
          assert.strictEqual(
            (await nodeStates(server.url)).find((n) => n.address === `127.0.0.1:${portA}`)?.state,
            "ready"
          )
          assert.strictEqual((await streamed(server.url, 32)).text, llamaText)
        })
      }).pipe(Effect.scoped),
    120_000
  )
})
