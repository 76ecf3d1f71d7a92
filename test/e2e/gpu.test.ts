/**
 * A mixed CUDA + CPU pipeline (issue 10): one `swactor node --backend cuda` (node-llama-cpp's CUDA package,
 * SWACTOR_GGML_PACKAGE=cuda: its graphs are checked op by op with ggml's supports_op before they run) and one
 * `swactor node --backend cpu`, `swactor run --agents` over both, greedy on stories260K, against node-llama-cpp's
 * single-process CPU run. Runs only where an NVIDIA GPU is visible (`nvidia-smi -L`); CI machines have none, and the
 * describe line then says why it did not run.
 */
import { describe, expect, it } from "vitest"
import { type ChildProcess, execFile, spawn, spawnSync } from "node:child_process"
import { randomBytes } from "node:crypto"
import { clusterTokenEnv, parentWatchEnv, readyLinePrefix } from "../../src/layers/agent/ReadyLine.js"
import { swactorCommand, swactorMain } from "../../src/layers/agent/AgentProcesses.js"
import { referenceRun } from "../support/engine.js"
import { repoRoot, requireModel } from "../support/models.js"

const gpu = (() => {
  const probe = spawnSync("nvidia-smi", ["-L"], { encoding: "utf8" })
  return probe.status === 0 && /GPU \d/.test(probe.stdout) ? probe.stdout.split("\n")[0]! : undefined
})()

/** `swactor node` on a free port; resolves with its control address once it printed its ready line. */
const startNode = (backend: "cuda" | "cpu", token: string) =>
  new Promise<{ child: ChildProcess; address: string }>((resolve, reject) => {
    const { args, command } = swactorCommand([
      "node",
      "--listen",
      "127.0.0.1:0",
      "--threads",
      "1",
      "--backend",
      backend
    ])
    const child = spawn(command, args, {
      stdio: ["pipe", "pipe", "pipe"],
      env: {
        ...process.env,
        [clusterTokenEnv]: token,
        [parentWatchEnv]: "stdin",
        ...(backend === "cuda" ? { SWACTOR_GGML_PACKAGE: "cuda" } : {})
      }
    })
    let out = ""
    let err = ""
    child.stderr!.on("data", (c: Buffer) => (err += c.toString()))
    child.stdout!.on("data", (c: Buffer) => {
      out += c.toString()
      const line = out.split("\n").find((l) => l.startsWith(readyLinePrefix))
      if (line === undefined) return
      const ready = JSON.parse(line.slice(readyLinePrefix.length)) as { host: string; port: number }
      resolve({ child, address: `${ready.host}:${ready.port}` })
    })
    child.on("exit", (code) => reject(new Error(`swactor node --backend ${backend} exited with ${code}: ${err}`)))
  })

describe.skipIf(gpu === undefined)(
  `mixed CUDA + CPU pipeline (${gpu ?? "not run: no NVIDIA GPU visible to nvidia-smi -L"})`,
  () => {
    it("a CUDA stage then a CPU stage give node-llama-cpp's greedy tokens", async () => {
      const model = requireModel("stories260K.gguf")
      const token = randomBytes(32).toString("hex")
      const nodes = [await startNode("cuda", token), await startNode("cpu", token)]
      try {
        const result = await new Promise<{ code: number; stdout: string; stderr: string }>((resolve) =>
          execFile(
            process.execPath,
            [
              swactorMain(),
              "run",
              "--model",
              model,
              "--agents",
              nodes.map((n) => n.address).join(","),
              "--stages",
              "2",
              "--threads",
              "1",
              "--prompt",
              "Once upon a time",
              "--max-tokens",
              "16",
              "--json"
            ],
            { cwd: repoRoot, timeout: 120_000, env: { ...process.env, [clusterTokenEnv]: token } },
            (error, stdout, stderr) => resolve({ code: error ? 1 : 0, stdout, stderr })
          )
        )
        expect(result.code, result.stderr).toBe(0)
        const report = JSON.parse(result.stdout) as { tokens: Array<{ id: number }> }
        const reference = await referenceRun(model, "Once upon a time", 16, { contextLength: 256, threads: 1 })
        expect(report.tokens.map((t) => t.id)).toEqual(reference.tokens)
      } finally {
        for (const n of nodes) n.child.kill("SIGKILL")
      }
    }, 180_000)
  }
)
