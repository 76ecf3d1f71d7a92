// The command line's rough edges (P2–P5 in specs/BEHAVIOR_GUARANTEES.md), each through the real program
// (`node dist/main.js`, as the package's bin runs it): every bad flag is refused before anything starts with one line
// naming the flag; a peer that is not a swactor node is named as such; a node's warnings go to stderr; no colour
// codes reach a pipe; `--help` shows the defaults; the Promise facade rejects with the typed error.
import { describe, expect, it } from "vitest"
import { execFile } from "node:child_process"
import { mkdtempSync, rmSync, writeFileSync } from "node:fs"
import * as Net from "node:net"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { createClient } from "../../src/api/generate.js"
import { generateToken, swactorMain } from "../../src/layers/agent/AgentProcesses.js"
import { refusedConnection, startTestNode } from "../support/e2e.js"
import { repoRoot, requireModel } from "../support/models.js"
import { untilAsync } from "../support/until.js"

interface Ran {
  readonly code: number | null
  readonly stdout: string
  readonly stderr: string
  readonly millis: number
}

const swactor = (args: ReadonlyArray<string>, env: Record<string, string | undefined> = {}, input?: string) =>
  new Promise<Ran>((resolve) => {
    const started = Date.now()
    const child = execFile(
      process.execPath,
      [swactorMain(), ...args],
      {
        cwd: repoRoot,
        env: { ...process.env, SWACTOR_CLUSTER_TOKEN: undefined, ...env },
        timeout: 60_000
      },
      (error, stdout, stderr) =>
        resolve({
          code: error ? (typeof error.code === "number" ? error.code : 1) : 0,
          stdout,
          stderr,
          millis: Date.now() - started
        })
    )
    if (input !== undefined) child.stdin?.end(input)
  })

const model = () => requireModel("stories260K.gguf")

/** Refused up front: exit 1, one line on stderr naming the flag, nothing on stdout, no agent started. */
const expectRefused = (ran: Ran, command: string, pattern: RegExp) => {
  const lines = ran.stderr.trim().split("\n")
  expect(ran.code, ran.stderr).toBe(1)
  expect(lines, ran.stderr).toHaveLength(1)
  expect(lines[0]).toMatch(new RegExp(`^swactor ${command}: `))
  expect(lines[0]).toMatch(pattern)
  expect(ran.stdout).toBe("")
  expect(ran.stderr).not.toMatch(/agents:|loading|at .*\.js:\d+/)
}

describe("swactor run / node: every flag checked before anything starts", () => {
  it('swactor serve: --threads 0, --nodes ",", --token-file /missing, --port 70000 are refused in one line', async () => {
    expectRefused(
      await swactor(["serve", "--model", model(), "--threads", "0"]),
      "serve",
      /--threads must be a whole number from 1 to 512, got 0/
    )
    expectRefused(await swactor(["serve", "--model", model(), "--nodes", ","]), "serve", /--agents "," names no agent/)
    expectRefused(
      await swactor(["serve", "--model", model(), "--token-file", "/missing"]),
      "serve",
      /--token-file \/missing: cannot read it/
    )
    expectRefused(
      await swactor(["serve", "--model", model(), "--port", "70000"]),
      "serve",
      /--port must be at most 65535/
    )
  })

  it("--token-file that cannot be read: one line naming the flag (run and node)", async () => {
    expectRefused(
      await swactor(["run", "--model", model(), "--agents", "127.0.0.1:9", "--token-file", "/missing"]),
      "run",
      /--token-file \/missing: cannot read it \(ENOENT\)/
    )
    expectRefused(
      await swactor(["node", "--token-file", "/missing"]),
      "node",
      /--token-file \/missing: cannot read it \(ENOENT\)/
    )
  })

  it("--threads 0 is refused (run and node), not passed on to crash an agent", async () => {
    expectRefused(
      await swactor(["run", "--model", model(), "--threads", "0"]),
      "run",
      /--threads must be a whole number from 1 to 512, got 0/
    )
    expectRefused(
      await swactor(["node", "--threads", "0"], { SWACTOR_CLUSTER_TOKEN: generateToken() }),
      "node",
      /--threads .* got 0/
    )
  })

  it("--temperature -1, --top-k -1, --max-tokens 0, --stages 0 are refused", async () => {
    expectRefused(
      await swactor(["run", "--model", model(), "--temperature", "-1"]),
      "run",
      /--temperature must be at least 0, got -1/
    )
    expectRefused(await swactor(["run", "--model", model(), "--top-k", "-1"]), "run", /--top-k/)
    expectRefused(await swactor(["run", "--model", model(), "--max-tokens", "0"]), "run", /--max-tokens/)
    expectRefused(await swactor(["run", "--model", model(), "--stages", "0"]), "run", /--stages/)
  })

  it("--speculative draft and --draft-model go together (run and serve)", async () => {
    for (const command of ["run", "serve"]) {
      expectRefused(
        await swactor([command, "--model", model(), "--speculative", "draft"]),
        command,
        /--speculative draft needs --draft-model FILE/
      )
      expectRefused(
        await swactor([command, "--model", model(), "--draft-model", model()]),
        command,
        /--draft-model is only used with --speculative draft/
      )
    }
  })

  it('--nodes "," names no node: refused instead of silently running locally', async () => {
    expectRefused(await swactor(["run", "--model", model(), "--nodes", ","]), "run", /--agents "," names no agent/)
    expectRefused(
      await swactor(["run", "--model", model(), "--nodes", "hostwithoutport"], {
        SWACTOR_CLUSTER_TOKEN: generateToken()
      }),
      "run",
      /--agents "hostwithoutport" is not host:port/
    )
  })

  it("prompt + max tokens must fit the context: refused up front, not a ContextOverflow at the end", async () => {
    const ran = await swactor(["run", "--model", model(), "--max-tokens", "2048", "--prompt", "Once upon a time"])
    expectRefused(
      ran,
      "run",
      /context too long: the prompt \(5 tokens\) and 2048 new tokens \(--max-tokens 2048\) do not fit the model's context of 2048 tokens; at most --max-tokens 2043/
    )
    expect(ran.millis).toBeLessThan(10_000)
  })

  it("a short cluster token is called short, naming where it came from", async () => {
    expectRefused(
      await swactor(["node"], { SWACTOR_CLUSTER_TOKEN: "short" }),
      "node",
      /cluster token from SWACTOR_CLUSTER_TOKEN is too short: 5 characters, at least 16/
    )
    const dir = mkdtempSync(join(tmpdir(), "swactor-cli-test-"))
    try {
      writeFileSync(join(dir, "token"), "tiny\n")
      expectRefused(
        await swactor(["run", "--model", model(), "--agents", "127.0.0.1:9", "--token-file", join(dir, "token")]),
        "run",
        /--token-file .*token is too short: 4 characters/
      )
    } finally {
      rmSync(dir, { recursive: true, force: true })
    }
  })
})

describe("swactor run / node: messages and streams", () => {
  it("connecting to a server that is not a swactor node says so", async () => {
    const server = Net.createServer((socket) => {
      socket.on("error", () => {})
      socket.write(Buffer.from("HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n".padEnd(100, " ")))
    })
    await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve))
    const port = (server.address() as Net.AddressInfo).port
    try {
      const ran = await swactor(["run", "--model", model(), "--agents", `127.0.0.1:${port}`, "--quiet"], {
        SWACTOR_CLUSTER_TOKEN: generateToken()
      })
      expect(ran.code, ran.stderr).toBe(1)
      expect(ran.stderr).toContain(`cannot connect to 127.0.0.1:${port}: not a swactor node`)
      expect(ran.stderr).not.toContain("expected Challenge\n")
    } finally {
      server.close()
    }
  })

  it("a node's warnings go to stderr; stdout carries only its ready line", async () => {
    const node = await startTestNode()
    // A client that speaks no handshake: the node refuses it and logs a warning.
    await refusedConnection(node.port)
    await untilAsync("the refusal warning", node.stderr, (text) =>
      /control-plane connection from .* refused/.test(text)
    )
    await node.stop()
    expect(node.stderr()).toMatch(/control-plane connection from 127\.0\.0\.1 refused/)
    expect(
      node
        .stdout()
        .trim()
        .split("\n")
        .every((line) => line.startsWith("swactor-node-ready "))
    ).toBe(true)
  })

  it("no colour or terminal codes when stdout is not a terminal; --help shows the defaults", async () => {
    const help = await swactor(["run", "--help"])
    expect(help.code).toBe(0)
    expect(help.stdout).not.toContain("\x1b[")
    expect(help.stdout).toContain("[default: 128]")
    expect(help.stdout).toContain("[default: 40]")
    const nodeHelp = await swactor(["node", "--help"])
    expect(nodeHelp.stdout).toContain("[default: 127.0.0.1:7070]")
    const bad = await swactor(["run", "--no-such-flag"])
    expect(bad.code).not.toBe(0)
    expect(bad.stdout + bad.stderr).not.toContain("\x1b[")
  })

  it("swactor synth needs no --heads / --kv-heads: defaults from the shape", async () => {
    const dir = mkdtempSync(join(tmpdir(), "swactor-cli-test-"))
    try {
      const ran = await swactor([
        "synth",
        "--arch",
        "llama",
        "--layers",
        "2",
        "--hidden",
        "256",
        "--ffn",
        "512",
        "--vocab",
        "300",
        "--type",
        "q8_0",
        "-o",
        join(dir, "m.gguf")
      ])
      expect(ran.code, ran.stderr).toBe(0)
      expect(ran.stdout).toContain("heads 4/4")
    } finally {
      rmSync(dir, { recursive: true, force: true })
    }
  })
})

describe("library: the Promise facade keeps the typed error", () => {
  it("createClient().complete rejects with the tagged error itself, not a FiberFailure", async () => {
    const client = createClient({ threads: 1 })
    try {
      const error = await client.complete({ model: "/no/such/model.gguf", prompt: "x", maxTokens: 1 }).then(
        () => undefined,
        (e: unknown) => e as { _tag?: string; message?: string; name?: string }
      )
      expect(error?._tag).toBe("ModelLoadError")
      expect(error?.name).not.toBe("(FiberFailure) Error")
      expect(error).toBeInstanceOf(Error)
      // and through the AsyncIterable
      const streamed = await (async () => {
        for await (const _ of client.stream({ model: "/no/such/model.gguf", prompt: "x", maxTokens: 1 })) void _
      })().then(
        () => undefined,
        (e: unknown) => e as { _tag?: string }
      )
      expect(streamed?._tag).toBe("ModelLoadError")
    } finally {
      await client.close()
    }
  })
})
