// Issue 24: one validation of `run`, `serve` and the library (src/services/RequestChecks.ts), each through real
// processes where the defect was seen: bad threads and stage counts refused in one line before any agent starts,
// token ids outside the vocabulary a 400 at once (not a 500 after a "recovery"), one context rule (prompt + max tokens
// = context accepted by run and serve alike), an empty prompt refused by both, weak cluster tokens refused, an agent
// that refuses a provision for a bad argument is not retried, and a refused connection logged once, naming its peer.
import { afterAll, beforeAll, describe, expect, it } from "vitest"
import { execFile } from "node:child_process"
import { mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { Chunk, Context, Duration, Effect, Exit, Layer, Scope, Stream } from "effect"
import { createClient } from "../../src/api/generate.js"
import { serve } from "../../src/api/serve.js"
import type { NodeId, RunId } from "../../src/domain/ids.js"
import * as AgentControlRpc from "../../src/layers/agent/AgentControlRpc.js"
import { generateToken, swactorMain } from "../../src/layers/agent/AgentProcesses.js"
import { isRecoverable } from "../../src/layers/orchestrator/Recovery.js"
import { AgentControl } from "../../src/services/AgentLinks.js"
import {
  Server,
  type ServeError,
  type ServeEvent,
  type ServeRequest,
  type ServerService
} from "../../src/services/Server.js"
import { refusedConnection, startAgents, startTestNode, stories260KProvision } from "../support/e2e.js"
import { repoRoot, requireModel } from "../support/models.js"
import { type ServeProcess, startServe } from "../support/serve.js"
import { untilAsync } from "../support/until.js"

const model = () => requireModel("stories260K.gguf")

interface Ran {
  readonly code: number | null
  readonly stdout: string
  readonly stderr: string
  readonly millis: number
  /** Child processes of the command seen while it ran (agents it started), polled every 10 ms from /proc. */
  readonly children: ReadonlyArray<number>
}

/** Parent pid of each process now, from /proc. */
const childrenOf = (ppid: number): Array<number> => {
  const found: Array<number> = []
  for (const entry of readdirSync("/proc")) {
    if (!/^\d+$/.test(entry)) continue
    try {
      const stat = readFileSync(`/proc/${entry}/stat`, "utf8")
      const fields = stat.slice(stat.lastIndexOf(")") + 2).split(" ")
      if (Number(fields[1]) === ppid) found.push(Number(entry))
    } catch {
      // gone meanwhile
    }
  }
  return found
}

/** `swactor <args>` as the package's bin runs it (`node dist/main.js`), watching for the children it starts. */
const swactor = (args: ReadonlyArray<string>, env: Record<string, string | undefined> = {}) =>
  new Promise<Ran>((resolve) => {
    const started = Date.now()
    const children = new Set<number>()
    const child = execFile(
      process.execPath,
      [swactorMain(), ...args],
      {
        cwd: repoRoot,
        env: { ...process.env, SWACTOR_CLUSTER_TOKEN: undefined, ...env },
        timeout: 120_000
      },
      (error, stdout, stderr) => {
        clearInterval(poll)
        resolve({
          code: error ? (typeof error.code === "number" ? error.code : 1) : 0,
          stdout,
          stderr,
          millis: Date.now() - started,
          children: [...children]
        })
      }
    )
    const poll = setInterval(() => {
      if (child.pid !== undefined) for (const pid of childrenOf(child.pid)) children.add(pid)
    }, 10)
  })

/** Refused up front: exit 1, one line on stderr, fast, and no agent process was ever started. */
const expectRefused = (ran: Ran, command: string, message: string | RegExp) => {
  const lines = ran.stderr.trim().split("\n")
  expect(ran.code, ran.stderr).toBe(1)
  expect(lines, ran.stderr).toHaveLength(1)
  expect(lines[0]).toMatch(new RegExp(`^swactor ${command}: `))
  if (typeof message === "string") expect(lines[0]).toBe(`swactor ${command}: ${message}`)
  else expect(lines[0]).toMatch(message)
  expect(ran.stdout).toBe("")
  expect(ran.millis).toBeLessThan(10_000)
  expect(ran.children, "agent processes started before the refusal").toEqual([])
}

describe("the command line: bounds checked before any agent starts (run, serve, node)", () => {
  it("--threads 1000: one line, exit 1, no agent (run, serve, node)", async () => {
    const message = "--threads must be a whole number from 1 to 512, got 1000"
    expectRefused(await swactor(["run", "--model", model(), "--threads", "1000"]), "run", message)
    expectRefused(await swactor(["serve", "--model", model(), "--port", "0", "--threads", "1000"]), "serve", message)
    expectRefused(
      await swactor(["node", "--threads", "1000"], { SWACTOR_CLUSTER_TOKEN: generateToken() }),
      "node",
      message
    )
  })

  it("--spares 1000: one line, exit 1, no agent (run, serve)", async () => {
    const message = "--spares must be a whole number from 0 to 64, got 1000"
    expectRefused(await swactor(["run", "--model", model(), "--spares", "1000"]), "run", message)
    expectRefused(await swactor(["serve", "--model", model(), "--port", "0", "--spares", "1000"]), "serve", message)
  })

  it("--stages 100 on a 5-block model: refused from the GGUF header, no agent started (run, serve)", async () => {
    const message =
      "--stages 100: the model has 5 blocks, so it splits into at most 5 stages (each stage hosts at least one block)"
    expectRefused(await swactor(["run", "--model", model(), "--stages", "100"]), "run", message)
    expectRefused(await swactor(["serve", "--model", model(), "--port", "0", "--stages", "100"]), "serve", message)
  })

  it("an empty or blank prompt is refused by run", async () => {
    expectRefused(await swactor(["run", "--model", model(), "--prompt", ""]), "run", "--prompt: the prompt is empty")
    expectRefused(
      await swactor(["run", "--model", model(), "--prompt", "  \n "]),
      "run",
      "--prompt: the prompt is empty"
    )
  })

  it("weak cluster tokens are refused with how to make one (node, run, the library)", async () => {
    expectRefused(
      await swactor(["node"], { SWACTOR_CLUSTER_TOKEN: "0".repeat(64) }),
      "node",
      /^swactor node: the cluster token from SWACTOR_CLUSTER_TOKEN is weak: about \d+ bits of entropy .*at least 64; make one with: openssl rand -hex 32$/
    )
    const dir = mkdtempSync(join(tmpdir(), "swactor-validation-"))
    try {
      writeFileSync(join(dir, "token"), `${"ab".repeat(32)}\n`)
      expectRefused(
        await swactor(["run", "--model", model(), "--agents", "127.0.0.1:9", "--token-file", join(dir, "token")]),
        "run",
        /^swactor run: the cluster token from --token-file .*token is weak: .*openssl rand -hex 32$/
      )
    } finally {
      rmSync(dir, { recursive: true, force: true })
    }
    const client = createClient({ agents: ["127.0.0.1:9"], token: "0123456789abcdef".repeat(4) })
    try {
      const error = await client.complete({ model: model(), prompt: "Once", maxTokens: 1 }).then(
        () => undefined,
        (e: unknown) => e as { _tag?: string; message?: string }
      )
      expect(error?._tag).toBe("InvalidRequest")
      expect(error?.message).toMatch(/cluster token .* is weak: .*openssl rand -hex 32/)
    } finally {
      await client.close()
    }
  })

  // The KV holds the prompt and every generated token fed back; the last one never is, so prompt + max tokens =
  // context fits with a position to spare. run and serve accept exactly that (serve: below).
  it("an API key with a character outside printable ASCII is refused at start in one line (file and SWACTOR_API_KEY)", async () => {
    // Such a key loaded but never matched: clients send its characters as other bytes (curl UTF-8, fetch Latin-1).
    const dir = mkdtempSync(join(tmpdir(), "swactor-keys-"))
    try {
      const file = join(dir, "keys")
      writeFileSync(file, `# keys\n${generateToken()}\ncafé-${generateToken()}\n`)
      expectRefused(
        await swactor(["serve", "--model", model(), "--port", "0", "--api-key-file", file]),
        "serve",
        `--api-key-file ${file}: key 2 has a character outside printable ASCII (at character 4), which HTTP clients ` +
          "send as different bytes; use letters, digits and punctuation (make one with: openssl rand -hex 32)"
      )
      expectRefused(
        await swactor(["serve", "--model", model(), "--port", "0"], { SWACTOR_API_KEY: `ключ-${generateToken()}` }),
        "serve",
        /^swactor serve: SWACTOR_API_KEY: key 1 has a character outside printable ASCII \(at character 1\)/
      )
    } finally {
      rmSync(dir, { recursive: true, force: true })
    }
  })

  it("run: prompt + max tokens = the model's context runs to the end; one more is refused with the room left", async () => {
    const dir = mkdtempSync(join(tmpdir(), "swactor-validation-"))
    try {
      const promptFile = join(dir, "prompt")
      writeFileSync(promptFile, Array(200).fill("the cat sat on the mat.").join(" "))
      const over = await swactor(["run", "--model", model(), "--prompt-file", promptFile, "--max-tokens", "4000"])
      expectRefused(
        over,
        "run",
        /^swactor run: context too long: the prompt \(\d+ tokens\) and 4000 new tokens \(--max-tokens 4000\) do not fit the model's context of 2048 tokens; at most --max-tokens \d+$/
      )
      const room = Number(/at most --max-tokens (\d+)/.exec(over.stderr)![1])
      const promptTokens = 2048 - room
      const justOver = await swactor([
        "run",
        "--model",
        model(),
        "--prompt-file",
        promptFile,
        "--max-tokens",
        String(room + 1)
      ])
      expectRefused(
        justOver,
        "run",
        new RegExp(`the prompt \\(${promptTokens} tokens\\) and ${room + 1} new tokens .*at most --max-tokens ${room}$`)
      )
      const fits = await swactor([
        "run",
        "--model",
        model(),
        "--prompt-file",
        promptFile,
        "--max-tokens",
        String(room),
        "--threads",
        "1",
        "--json"
      ])
      expect(fits.code, fits.stderr).toBe(0)
      const report = JSON.parse(fits.stdout) as {
        ok: boolean
        summary: { promptTokens: number; generatedTokens: number }
      }
      expect(report.ok).toBe(true)
      expect(report.summary.promptTokens).toBe(promptTokens)
      expect(report.summary.promptTokens + report.summary.generatedTokens).toBeLessThanOrEqual(2048)
    } finally {
      rmSync(dir, { recursive: true, force: true })
    }
  }, 120_000)
})

/** The refusal of one request, or its events. */
const outcome = (server: ServerService, request: ServeRequest) =>
  Stream.runCollect(server.generate(request)).pipe(
    Effect.map(Chunk.toReadonlyArray),
    Effect.timeout("60 seconds"),
    Effect.either,
    Effect.runPromise
  )

describe("serve (the library's serve(), real local agents): one validation with run's", () => {
  let scope: Scope.CloseableScope
  let server: ServerService
  beforeAll(async () => {
    scope = Effect.runSync(Scope.make())
    const context = await Effect.runPromise(
      Layer.buildWithScope(serve({ model: model(), stages: 2, threads: 1 }), scope)
    )
    server = Context.get(context, Server)
    await Effect.runPromise(server.ready)
    // The first text prompt starts the server's tokenizer worker (~1 s): paid here, not by a timed refusal.
    await Effect.runPromise(Stream.runDrain(server.generate({ prompt: "Once", maxTokens: 1 })))
  }, 180_000)
  afterAll(async () => {
    if (scope !== undefined) await Effect.runPromise(Scope.close(scope, Exit.void))
  })

  const refusedAtOnce = async (request: ServeRequest, message: string | RegExp) => {
    const started = performance.now()
    const result = await outcome(server, request)
    const millis = performance.now() - started
    expect(result._tag).toBe("Left")
    const error = (result as { left: ServeError }).left
    expect(error._tag).toBe("BadServeRequest")
    if (typeof message === "string") expect(error.message).toBe(message)
    else expect(error.message).toMatch(message)
    expect(millis).toBeLessThan(1000)
  }

  const completes = async (request: ServeRequest) => {
    const result = await outcome(server, request)
    expect(result._tag, JSON.stringify(result)).toBe("Right")
    const events = (result as { right: ReadonlyArray<ServeEvent> }).right
    const done = events.find((e) => e._tag === "Done")
    expect(done?._tag).toBe("Done")
    return done as Extract<ServeEvent, { _tag: "Done" }>
  }

  it("token ids outside the vocabulary (negative, ≥ 512, fractional) are BadServeRequest at once; the next request runs", async () => {
    await refusedAtOnce(
      { prompt: [1, -1], maxTokens: 4 },
      "prompt token 1 is -1: token ids are whole numbers from 0 to 511 (the model's vocabulary)"
    )
    await refusedAtOnce({ prompt: [1, 512], maxTokens: 4 }, /^prompt token 1 is 512: /)
    await refusedAtOnce({ prompt: [1, 1.5], maxTokens: 4 }, /^prompt token 1 is 1.5: /)
    await refusedAtOnce({ prompt: [1, 2 ** 40], maxTokens: 4 }, /^prompt token 1 is 1099511627776: /)
    const done = await completes({ prompt: "Once upon a time", maxTokens: 4 })
    expect(done.completionTokens).toBeGreaterThan(0)
    expect((await Effect.runPromise(server.metrics)).recoveries).toBe(0)
  }, 60_000)

  it("an empty or blank prompt is BadServeRequest with run's words", async () => {
    await refusedAtOnce({ prompt: "", maxTokens: 4 }, "the prompt is empty")
    await refusedAtOnce({ prompt: " \n", maxTokens: 4 }, "the prompt is empty")
    await refusedAtOnce({ prompt: [], maxTokens: 4 }, "the prompt is empty")
  })

  it("prompt + max tokens = the model's context is served; one more is refused with run's words", async () => {
    const prompt = [1, ...Array.from({ length: 2048 - 8 - 1 }, (_, i) => 300 + (i % 7))]
    const done = await completes({ prompt, maxTokens: 8 })
    expect(done.promptTokens).toBe(2040)
    expect(done.promptTokens + done.completionTokens).toBeLessThanOrEqual(2048)
    await refusedAtOnce(
      { prompt, maxTokens: 9 },
      "context too long: the prompt (2040 tokens) and 9 new tokens (max_tokens 9) do not fit the model's context of 2048 tokens; at most max_tokens 8"
    )
  }, 60_000)
})

describe("swactor serve over HTTP: an id beyond the vocabulary is a 400 at once, not a 500 after a recovery", () => {
  let server: ServeProcess
  beforeAll(async () => {
    server = await startServe(["--model", model(), "--stages", "2", "--threads", "1"])
  }, 180_000)
  afterAll(async () => {
    if (server?.child.exitCode === null) server.child.kill("SIGTERM")
    await server?.exited
  })

  it("prompt [1, 100000]: 400 in well under a second; a normal request after it is 200", async () => {
    const post = (body: unknown) =>
      fetch(`${server.url}/v1/completions`, {
        method: "POST",
        headers: { "content-type": "application/json" },
        body: JSON.stringify(body)
      })
    const started = performance.now()
    const bad = await post({ model: "stories260K.gguf", prompt: [1, 100000], max_tokens: 4 })
    expect(bad.status).toBe(400)
    expect(performance.now() - started).toBeLessThan(1000)
    expect(JSON.stringify(await bad.json())).toMatch(/prompt token 1 is 100000/)
    const empty = await post({ model: "stories260K.gguf", prompt: "", max_tokens: 4 })
    expect(empty.status).toBe(400)
    expect(JSON.stringify(await empty.json())).toMatch(/the prompt is empty/)
    const good = await post({ model: "stories260K.gguf", prompt: "Once upon a time", max_tokens: 4 })
    expect(good.status).toBe(200)
  }, 60_000)
})

describe("the agent: a provision it cannot honour is refused, not crashed and retried", () => {
  it("threads 1000 in a provision: ProvisionFailed at once (not recoverable); the agent hosts nothing and stays up", async () => {
    const request = stories260KProvision(91 as RunId, model(), 1000)
    await Effect.gen(function* () {
      const { agents, token } = yield* startAgents(1)
      const control = yield* AgentControl
      const link = yield* control.connect({ nodeId: 1 as NodeId, address: agents[0]!.address }, token)
      const reports = Chunk.toReadonlyArray(
        yield* Stream.runCollect(link.provision(request)).pipe(
          Effect.timeoutFail({
            duration: Duration.seconds(5),
            onTimeout: () => new Error("the provision was not refused")
          })
        )
      )
      const fault = reports.find((r) => r._tag === "StageFault")
      expect(fault?._tag === "StageFault" ? fault.reason : undefined).toEqual({
        _tag: "ProvisionFailed",
        message: "stage 0 refused: threads must be a whole number from 1 to 512, got 1000"
      })
      if (fault?._tag === "StageFault") {
        expect(isRecoverable({ _tag: "StageFault", stageIndex: 0, reason: fault.reason })).toBe(false)
      }
      expect((yield* link.capacity).activeStages).toBe(0)
    }).pipe(Effect.scoped, Effect.provide(AgentControlRpc.layer), Effect.runPromise)
  }, 60_000)
})

describe("a node's refused connections: one WARN line per peer, naming it", () => {
  it("20 connections that speak no handshake from 127.0.0.1: one line, with the address", async () => {
    const node = await startTestNode()
    try {
      for (let i = 0; i < 20; i++) await refusedConnection(node.port)
      await untilAsync("the refusal line", node.stderr, (text) => text.includes("connection from"))
    } finally {
      await node.stop()
    }
    const stderr = node.stderr()
    const lines = stderr.split("\n").filter((line) => line.includes("connection from"))
    expect(lines, stderr).toHaveLength(1)
    expect(lines[0]).toMatch(/WARN/)
    expect(lines[0]).toMatch(/control-plane connection from 127\.0\.0\.1 refused: /)
  }, 60_000)
})
