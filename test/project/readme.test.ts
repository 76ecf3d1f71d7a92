// The README stays true (P7 in specs/BEHAVIOR_GUARANTEES.md): every command line in its ```sh blocks and every
// `swactor ...` example in its command table is extracted and run on the test model — `npm run swactor --` and
// `swactor` as the compiled bin (`node dist/main.js`), `../shared/models` as SWACTOR_MODELS_DIR, the placeholder
// hosts (`0.0.0.0:7070`, `10.0.0.x:7070`, `HOST:PORT`) as real local agents, `/models/llama.gguf` as stories260K.
// Leading NAME=value words are the command's environment (the Vulkan example's, lavapipe).
// The library example is run too, importing "swactor" by its package name. A command the test does not know how to
// run fails it: a new README example needs a line here.
import { describe, expect, it } from "vitest"
import { execFile, spawn } from "node:child_process"
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs"
import { createRequire } from "node:module"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { pathToFileURL } from "node:url"
import { generateToken, swactorMain } from "../../src/layers/agent/AgentProcesses.js"
import { modelsDir, repoRoot, requireModel } from "../support/models.js"

const readme = readFileSync(join(repoRoot, "README.md"), "utf8")

/** Lines of the ```sh blocks (comments dropped) and the `swactor ...` cells of the command table. */
const readmeCommands = (): Array<string> => {
  const lines: Array<string> = []
  for (const block of readme.matchAll(/```sh\n([\s\S]*?)```/g)) {
    // a line ending in a backslash continues on the next
    for (const line of block[1]!.replace(/\\\n\s*/g, "").split("\n")) {
      const command = line.replace(/\s+#.*$/, "").trim()
      if (command !== "") lines.push(command)
    }
  }
  for (const row of readme.matchAll(/^\| `(swactor [^`]*)` \|/gm)) lines.push(row[1]!)
  return lines
}

/** Shell words: double-quoted strings kept whole. */
const words = (line: string): Array<string> => [...line.matchAll(/"([^"]*)"|(\S+)/g)].map((m) => m[1] ?? m[2]!)

// 180 s a command: a README run on lavapipe (--backend vulkan) took over 90 s on a CI runner loaded 4× its cores, and a
// command cut by its timeout exits 143 (SIGTERM) rather than failing on what it printed.
const swactor = (args: ReadonlyArray<string>, env: Record<string, string> = {}, cwd = repoRoot) =>
  new Promise<{ code: number; stdout: string; stderr: string }>((resolve) =>
    execFile(
      process.execPath,
      [swactorMain(), ...args],
      { cwd, env: { ...process.env, ...env }, timeout: 180_000 },
      (error, stdout, stderr) =>
        resolve({ code: error ? (typeof error.code === "number" ? error.code : 1) : 0, stdout, stderr })
    )
  )

/** A `swactor node` on an ephemeral port; resolves with its control address once it is ready, and a stop function. */
const startNode = (token: string) =>
  new Promise<{ address: string; stop: () => Promise<void> }>((resolve, reject) => {
    const child = spawn(process.execPath, [swactorMain(), "node", "--listen", "127.0.0.1:0", "--threads", "1"], {
      cwd: repoRoot,
      stdio: ["ignore", "pipe", "pipe"],
      env: { ...process.env, SWACTOR_CLUSTER_TOKEN: token }
    })
    let out = ""
    child.on("error", reject)
    child.stdout.on("data", (chunk) => {
      out += chunk
      const ready = /swactor-node-ready (\{.*\})/.exec(out)
      if (ready !== null) {
        const { host, port } = JSON.parse(ready[1]!) as { host: string; port: number }
        resolve({
          address: `${host}:${port}`,
          stop: () =>
            new Promise<void>((done) => {
              child.on("exit", () => done())
              child.kill("SIGTERM")
            })
        })
      }
    })
  })

describe("README", () => {
  it("every command line in the README runs as written on the test model", async () => {
    const model = requireModel("stories260K.gguf")
    const commands = readmeCommands()
    expect(commands.length).toBeGreaterThanOrEqual(9)
    const token = generateToken()
    const nodes = [await startNode(token), await startNode(token)]
    const dir = mkdtempSync(join(tmpdir(), "swactor-readme-test-"))
    const covered: Array<string> = []
    try {
      for (const line of commands) {
        const all = words(line.replace(/^npm ci && /, ""))
        // leading NAME=value words are the command's environment
        const assigned = all.findIndex((w) => !/^[A-Z_][A-Z0-9_]*=/.test(w))
        const lineEnv = Object.fromEntries(
          all.slice(0, assigned).map((w) => [w.slice(0, w.indexOf("=")), w.slice(w.indexOf("=") + 1)])
        )
        const argv = all.slice(assigned)
        if (argv.join(" ") === "npm test") {
          // The README's test command: what this suite is; check it exists and builds first.
          expect(JSON.parse(readFileSync(join(repoRoot, "package.json"), "utf8")).scripts.test).toBe("vitest run")
          covered.push(line)
          continue
        }
        if (argv[0] === "export" && argv[1]?.startsWith("SWACTOR_CLUSTER_TOKEN=")) {
          covered.push(line)
          continue
        }
        const args =
          argv[0] === "npm" && argv[1] === "run" && argv[2] === "swactor" && argv[3] === "--"
            ? argv.slice(4)
            : argv[0] === "swactor"
              ? argv.slice(1)
              : undefined
        expect(args, `README command the test does not know how to run: ${line}`).toBeDefined()
        const real = args!.map((word) =>
          word
            .replace("../shared/models", modelsDir())
            .replace("/models/llama.gguf", model)
            .replace("10.0.0.2:7070,10.0.0.3:7070", nodes.map((n) => n.address).join(","))
            .replace(/^(0\.0\.0\.0:7070|HOST:PORT)$/, "127.0.0.1:0")
        )
        if (real[0] === "node") {
          // A node runs until stopped: it must come up and announce itself.
          const child = spawn(process.execPath, [swactorMain(), ...real], {
            cwd: repoRoot,
            stdio: ["ignore", "pipe", "pipe"],
            env: { ...process.env, SWACTOR_CLUSTER_TOKEN: token }
          })
          const ready = await new Promise<boolean>((resolve) => {
            child.stdout.on("data", (chunk) => String(chunk).includes("swactor-node-ready") && resolve(true))
            child.on("exit", () => resolve(false))
          })
          child.kill("SIGTERM")
          expect(ready, line).toBe(true)
          covered.push(line)
          continue
        }
        if (real[0] === "serve") {
          // A server runs until stopped: it must become ready, answer a completion, and stop on SIGTERM (exit 143).
          // Its port is made ephemeral so the test never collides with a real server on 8080.
          const port = real.indexOf("--port")
          if (port >= 0) real[port + 1] = "0"
          const child = spawn(process.execPath, [swactorMain(), ...real], {
            cwd: repoRoot,
            stdio: ["ignore", "ignore", "pipe"]
          })
          let stderr = ""
          const url = await new Promise<string | undefined>((resolve) => {
            child.stderr.on("data", (chunk) => {
              stderr += chunk
              const at = /listening on (http:\/\/\S+)/.exec(stderr)
              if (at !== null && stderr.includes("ready:")) resolve(at[1])
            })
            child.on("exit", () => resolve(undefined))
          })
          expect(url, `${line}\n${stderr}`).toBeDefined()
          const completion = await fetch(`${url}/v1/completions`, {
            method: "POST",
            headers: { "content-type": "application/json" },
            body: JSON.stringify({ prompt: "Once upon a time", max_tokens: 8 })
          }).then((r) => r.json() as Promise<{ usage?: { completion_tokens: number } }>)
          expect(completion.usage?.completion_tokens, line).toBe(8)
          const exited = new Promise<number | null>((resolve) => child.on("exit", (code) => resolve(code)))
          child.kill("SIGTERM")
          expect(await exited, `${line}\n${stderr}`).toBe(143)
          covered.push(line)
          continue
        }
        const ran = await swactor(real, { SWACTOR_CLUSTER_TOKEN: token, XDG_CACHE_HOME: dir, ...lineEnv }, dir)
        expect(ran.code, `${line}\n${ran.stderr}`).toBe(0)
        if (real[0] === "run" && !real.includes("--dry-run")) expect(ran.stdout, line).toMatch(/\S/)
        if (real.includes("--dry-run")) expect(ran.stdout, line).toContain("dry run: nothing was provisioned")
        if (real[0] === "plan") expect(ran.stdout, line).toContain("36 layers over 3 stages")
        if (real[0] === "synth") expect(ran.stdout, line).toMatch(/^wrote /)
        covered.push(line)
      }
      expect(covered).toEqual(commands)
    } finally {
      await Promise.all(nodes.map((n) => n.stop()))
      rmSync(dir, { recursive: true, force: true })
    }
  }, 600_000)

  it("the README's library example runs, importing the package by its name", async () => {
    const example = /```ts\n([\s\S]*?)```/.exec(readme)?.[1]
    expect(example).toBeDefined()
    // In the repository root so that "swactor" resolves to this package (its `exports`, the compiled dist/).
    const file = join(repoRoot, `.readme-example-${process.pid}.mts`)
    writeFileSync(file, example!.replace("../shared/models/stories260K.gguf", requireModel("stories260K.gguf")))
    try {
      const tsx = pathToFileURL(createRequire(import.meta.url).resolve("tsx")).href
      const ran = await new Promise<{ code: number; stdout: string; stderr: string }>((resolve) =>
        execFile(
          process.execPath,
          ["--import", tsx, file],
          { cwd: repoRoot, timeout: 90_000 },
          (error, stdout, stderr) =>
            resolve({ code: error ? (typeof error.code === "number" ? error.code : 1) : 0, stdout, stderr })
        )
      )
      expect(ran.code, ran.stderr).toBe(0)
      expect(ran.stdout.length).toBeGreaterThan(20)
    } finally {
      rmSync(file, { force: true })
    }
  }, 120_000)
})
