// `swactor run --discover` (issue 39): two `swactor node`s on loopback announce themselves (on by default, loopback
// only as they listen on 127.0.0.1), each with its own persistent id from its state folder; a third node has another
// cluster token. `run --discover` with the token finds the two, says the third is not used and why, and runs the
// pipeline on the two through the `--agents` path: node-llama-cpp's greedy text. One node's slice cache holds a
// slice, which its discovered line names. A private discovery port keeps other
// tests' nodes out. Needs dist/ (npm run build) like the other command-line tests.
import { assert, describe, it } from "@effect/vitest"
import { type ChildProcess, spawn } from "node:child_process"
import { mkdirSync, mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { Effect } from "effect"
import { generateToken, swactorMain } from "../../src/layers/agent/AgentProcesses.js"
import { readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { sliceHash, writeGgufSlice } from "../../src/layers/gguf/GgufSlice.js"
import { repoRoot, requireModel } from "../support/models.js"

const discoveryPort = String(20000 + (process.pid % 20000))

/** A `swactor node` on loopback; resolves once its ready line is out. */
const startNode = (env: Record<string, string>, children: Array<ChildProcess>) =>
  Effect.async<void, Error>((resume) => {
    const child = spawn(process.execPath, [swactorMain(), "node", "--listen", "127.0.0.1:0", "--threads", "1"], {
      cwd: repoRoot,
      stdio: ["ignore", "pipe", "pipe"],
      env: { ...process.env, SWACTOR_DISCOVERY_PORT: discoveryPort, ...env }
    })
    children.push(child)
    let stderr = ""
    child.stderr.on("data", (chunk) => (stderr += chunk))
    child.stdout.on("data", (chunk) => String(chunk).includes("swactor-node-ready") && resume(Effect.void))
    child.on("exit", (code) => resume(Effect.fail(new Error(`swactor node exited ${code}: ${stderr}`))))
  })

describe("swactor run --discover", () => {
  it.live(
    "finds the nodes proving the token, says why another is not used, and gives node-llama-cpp's text",
    () =>
      Effect.gen(function* () {
        const dir = mkdtempSync(join(tmpdir(), "swactor-discover-"))
        const children: Array<ChildProcess> = []
        yield* Effect.addFinalizer(() =>
          Effect.sync(() => {
            for (const child of children) child.kill("SIGKILL")
            rmSync(dir, { recursive: true, force: true })
          })
        )
        const token = generateToken()
        // node a's slice cache holds stories260K's blocks [0, 2): its announcements say so
        const file = yield* readGgufFile(requireModel("stories260K.gguf"))
        const range = { layerStart: 0, layerEndExclusive: 2, numLayers: 5 }
        const slices = join(dir, "a-cache", "swactor", "slices")
        mkdirSync(slices, { recursive: true })
        yield* writeGgufSlice(file, range, join(slices, `${yield* sliceHash(file, range)}.gguf`))
        yield* Effect.all(
          [
            startNode(
              { SWACTOR_CLUSTER_TOKEN: token, XDG_STATE_HOME: join(dir, "a"), XDG_CACHE_HOME: join(dir, "a-cache") },
              children
            ),
            startNode({ SWACTOR_CLUSTER_TOKEN: token, XDG_STATE_HOME: join(dir, "b") }, children),
            startNode({ SWACTOR_CLUSTER_TOKEN: generateToken(), XDG_STATE_HOME: join(dir, "c") }, children)
          ],
          { concurrency: "unbounded" }
        )
        const run = spawn(
          process.execPath,
          [
            swactorMain(),
            "run",
            "--model",
            requireModel("stories260K.gguf"),
            "--prompt",
            "Once upon a time",
            "--max-tokens",
            "32",
            "--threads",
            "1",
            "--quiet",
            "--discover"
          ],
          {
            cwd: repoRoot,
            stdio: ["ignore", "pipe", "pipe"],
            env: { ...process.env, SWACTOR_CLUSTER_TOKEN: token, SWACTOR_DISCOVERY_PORT: discoveryPort }
          }
        )
        children.push(run)
        const result = yield* Effect.async<{ code: number | null; stdout: string; stderr: string }>((resume) => {
          let stdout = ""
          let stderr = ""
          run.stdout.on("data", (chunk) => (stdout += chunk))
          run.stderr.on("data", (chunk) => (stderr += chunk))
          run.on("exit", (code) => resume(Effect.succeed({ code, stdout, stderr })))
        })
        assert.strictEqual(result.code, 0, result.stderr)
        assert.strictEqual(result.stderr.match(/swactor: discovered node [0-9a-f]{32} at 127\.0\.0\.1:\d+/g)?.length, 2)
        assert.match(result.stderr, /not used: node [0-9a-f]{32} at 127\.0\.0\.1:\d+: its proof does not hold/)
        assert.strictEqual(result.stderr.match(/; holds llama blocks \[0, 2\) of 5\n/g)?.length, 1, result.stderr)
        assert.strictEqual(
          result.stdout.trim(),
          "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, she saw"
        )
      }).pipe(Effect.scoped),
    120_000
  )

  it.live(
    "a node on a fixed port keeps its id across restarts; a second port of the same host has its own",
    () =>
      Effect.gen(function* () {
        const dir = mkdtempSync(join(tmpdir(), "swactor-nodeid-"))
        yield* Effect.addFinalizer(() => Effect.sync(() => rmSync(dir, { recursive: true, force: true })))
        const port = 30000 + (process.pid % 20000)
        /** Starts a node on `listenPort`, reads its "announcing node <id>" line, stops it (SIGTERM). */
        const idOf = (listenPort: number) =>
          Effect.async<string, Error>((resume) => {
            const child = spawn(
              process.execPath,
              [swactorMain(), "node", "--listen", `127.0.0.1:${listenPort}`, "--engine", "test"],
              {
                cwd: repoRoot,
                stdio: ["ignore", "pipe", "pipe"],
                env: {
                  ...process.env,
                  SWACTOR_CLUSTER_TOKEN: generateToken(),
                  SWACTOR_DISCOVERY_PORT: discoveryPort,
                  XDG_STATE_HOME: dir
                }
              }
            )
            let stderr = ""
            let id: string | undefined
            child.stderr.on("data", (chunk) => {
              stderr += chunk
              const found = /announcing node ([0-9a-f]{32})/.exec(stderr)
              if (found !== null && id === undefined) {
                id = found[1]!
                child.kill("SIGTERM")
              }
            })
            child.on("exit", () => resume(id === undefined ? Effect.fail(new Error(stderr)) : Effect.succeed(id)))
          })
        const first = yield* idOf(port)
        assert.strictEqual(yield* idOf(port), first)
        assert.notStrictEqual(yield* idOf(port + 1), first)
      }).pipe(Effect.scoped),
    60_000
  )
})
