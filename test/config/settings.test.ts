/**
 * One configuration (issue 23): every setting is described once (src/layers/config/Settings.ts), a user setting is a
 * flag with its environment variable as fallback, and the two give the same behaviour. The config module's own rules
 * first (defaults, a bad value refused in one line naming flag and variable, secrets never printed), then each command
 * run as a real process (dist/main.js) with its settings given by flags only, then by the environment only.
 */
import { type ChildProcess, execFile, spawn } from "node:child_process"
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { inspect } from "node:util"
import { afterAll, assert, describe, it } from "@effect/vitest"
import { ConfigProvider, Effect, Either, Option, Redacted } from "effect"
import { generateToken, swactorCommand } from "../../src/layers/agent/AgentProcesses.js"
import {
  agentHooks,
  apiKeyFromEnv,
  childEnvironment,
  clusterTokenFrom,
  engineHooks,
  ggmlPackageSetting,
  settingDocs,
  settingFromFlagOrEnv,
  Settings,
  settingsOf,
  threadsSetting,
  tlsSetting,
  withChoices
} from "../../src/layers/config/Settings.js"
import { requireModel, repoRoot } from "../support/models.js"
import { startServe, stopServe } from "../support/serve.js"

const dir = mkdtempSync(join(tmpdir(), "swactor-settings-"))
afterAll(() => rmSync(dir, { recursive: true, force: true }))

/** Env without any swactor setting of the test runner's own. */
const cleanEnv = (): Record<string, string | undefined> =>
  Object.fromEntries(Object.entries(process.env).filter(([name]) => !settingDocs.some((d) => d.variable === name)))

describe("the configuration module", () => {
  it("defaults: TLS auto, the CPU package, threads unset; hooks off their switches", () => {
    assert.strictEqual(Either.getOrThrow(settingFromFlagOrEnv(tlsSetting, Option.none(), {})), "auto")
    assert.strictEqual(Either.getOrThrow(settingFromFlagOrEnv(ggmlPackageSetting, Option.none(), {})), "cpu")
    assert.isTrue(Option.isNone(Either.getOrThrow(settingFromFlagOrEnv(threadsSetting, Option.none(), {}))))
    assert.deepStrictEqual(engineHooks({}), { mmap: true, hugePages: true, zeroCopy: true, smallBatchRows: undefined })
    assert.deepStrictEqual(agentHooks({}), {
      settleWeights: "auto",
      batchMaxRows: undefined,
      prefillChunk: undefined,
      slowdown: 1
    })
  })

  it("the hooks keep their old reading: 0 turns a switch off, a count must be a whole number", () => {
    const env = { SWACTOR_MMAP: "0", SWACTOR_THP: "0", SWACTOR_ZERO_COPY: "0", SWACTOR_GEMV_MAX_ROWS: "7" }
    assert.deepStrictEqual(engineHooks(env), { mmap: false, hugePages: false, zeroCopy: false, smallBatchRows: 7 })
    assert.strictEqual(engineHooks({ SWACTOR_GEMV_MAX_ROWS: "x" }).smallBatchRows, undefined)
    assert.deepStrictEqual(
      agentHooks({ SWACTOR_MMAP_MOVE: "1", SWACTOR_BATCH_MAX_ROWS: "8", SWACTOR_PREFILL_CHUNK: "0" }),
      { settleWeights: "always", batchMaxRows: 8, prefillChunk: undefined, slowdown: 1 }
    )
    assert.strictEqual(agentHooks({ SWACTOR_MMAP_MOVE: "0" }).settleWeights, "never")
  })

  it("a flag wins over its variable", () => {
    assert.strictEqual(
      Either.getOrThrow(settingFromFlagOrEnv(tlsSetting, Option.some("off" as const), { SWACTOR_TLS: "always" })),
      "off"
    )
    assert.strictEqual(
      Either.getOrThrow(settingFromFlagOrEnv(tlsSetting, Option.none(), { SWACTOR_TLS: "always" })),
      "always"
    )
  })

  it("a bad value is refused in one line naming the flag and the variable", () => {
    for (const [setting, env, flag] of [
      [tlsSetting, { SWACTOR_TLS: "sometimes" }, "--tls"],
      [ggmlPackageSetting, { SWACTOR_GGML_PACKAGE: "gpu" }, "--backend"],
      [threadsSetting, { SWACTOR_THREADS: "many" }, "--threads"]
    ] as const) {
      const read = settingFromFlagOrEnv(setting as typeof tlsSetting, Option.none(), env)
      assert.isTrue(Either.isLeft(read), JSON.stringify(env))
      const message = Either.getLeft(read).pipe(Option.getOrThrow)
      assert.notInclude(message, "\n")
      assert.include(message, flag)
      assert.include(message, Object.keys(env)[0]!)
      assert.include(message, `"${Object.values(env)[0]!}" is not valid: expected `)
    }
  })

  it("the cluster token: trimmed, checked as the CLI checks it, and never printed", () => {
    const token = generateToken()
    const read = clusterTokenFrom(undefined, { SWACTOR_CLUSTER_TOKEN: `  ${token}\n` })
    assert.isTrue(Either.isRight(read))
    const secret = Either.getOrThrow(read)
    assert.strictEqual(Redacted.value(secret), token)
    for (const shown of [String(secret), JSON.stringify({ secret }), inspect(secret), `${secret}`]) {
      assert.notInclude(shown, token)
    }
    assert.strictEqual(Redacted.value(Either.getOrThrow(clusterTokenFrom(undefined, {}))), "")
    const short = clusterTokenFrom(undefined, { SWACTOR_CLUSTER_TOKEN: "short" })
    assert.match(Either.getLeft(short).pipe(Option.getOrThrow), /SWACTOR_CLUSTER_TOKEN is too short: 5 characters/)
    const file = join(dir, "token")
    writeFileSync(file, `${token}\n`)
    assert.strictEqual(Redacted.value(Either.getOrThrow(clusterTokenFrom(file, {}))), token)
    assert.match(
      Either.getLeft(clusterTokenFrom(join(dir, "none"), {})).pipe(Option.getOrThrow),
      /--token-file .*cannot read it/
    )
  })

  it("the API key: trimmed, none when blank, never printed", () => {
    const key = apiKeyFromEnv({ SWACTOR_API_KEY: " sk-test-123456 " })
    assert.strictEqual(Redacted.value(key!), "sk-test-123456")
    assert.notInclude(inspect(key) + String(key) + JSON.stringify(key), "sk-test")
    assert.isUndefined(apiKeyFromEnv({ SWACTOR_API_KEY: "  " }))
    assert.isUndefined(apiKeyFromEnv({}))
  })

  it("the Settings service: resolved from an environment leniently, flags on top, a test's layer read back", () => {
    const none = settingsOf({})
    assert.strictEqual(none.tls, "auto")
    assert.strictEqual(none.ggmlPackage, "cpu")
    assert.isUndefined(none.gpuMemory)
    assert.strictEqual(none.hubEndpoint, "https://huggingface.co/")
    const env = settingsOf({
      SWACTOR_TLS: "always",
      SWACTOR_GGML_PACKAGE: "vulkan",
      SWACTOR_GPU_MEMORY: "1000",
      SWACTOR_THREADS: "3",
      XDG_CACHE_HOME: "/tmp/cache-home",
      HF_ENDPOINT: "http://127.0.0.1:9/hub",
      SWACTOR_DEBUG: "1"
    })
    assert.deepInclude(env, { tls: "always", ggmlPackage: "vulkan", gpuMemory: 1000, threads: 3, debugAgents: true })
    assert.strictEqual(env.cacheDir, join("/tmp/cache-home", "swactor"))
    assert.strictEqual(env.hubEndpoint, "http://127.0.0.1:9/hub/")
    // a value not understood is the default (the CLI refuses it first, in one line)
    assert.strictEqual(settingsOf({ SWACTOR_TLS: "sometimes" }).tls, "auto")
    const chosen = withChoices(env, { tls: "off", ggmlPackage: undefined, gpuMemory: 0 })
    assert.deepInclude(chosen, { tls: "off", ggmlPackage: "vulkan", gpuMemory: 0, threads: 3 })
    const provided = Effect.runSync(Effect.provide(Settings, Settings.layer({ tls: "off" })))
    assert.strictEqual(provided.tls, "off")
    const fromEnv = Effect.runSync(Effect.provide(Settings, Settings.fromEnvironment({ SWACTOR_GPU_MEMORY: "5" })))
    assert.strictEqual(fromEnv.gpuMemory, 5)
    const live = Effect.runSync(
      Effect.provide(Settings, Settings.live).pipe(
        Effect.withConfigProvider(ConfigProvider.fromMap(new Map([["SWACTOR_TLS", "off"]])))
      )
    )
    assert.strictEqual(live.tls, "off")
  })

  it("a local agent's environment carries the resolved user settings a flag can choose, then its own variables", () => {
    const settings = withChoices(settingsOf({}), { tls: "always", ggmlPackage: "cuda", gpuMemory: 0 })
    const env = childEnvironment(settings, { SWACTOR_CLUSTER_TOKEN: "t" })
    assert.strictEqual(env["SWACTOR_TLS"], "always")
    assert.strictEqual(env["SWACTOR_GGML_PACKAGE"], "cuda")
    assert.strictEqual(env["SWACTOR_GPU_MEMORY"], "0")
    assert.strictEqual(env["SWACTOR_CLUSTER_TOKEN"], "t")
    assert.strictEqual(childEnvironment(settings, { SWACTOR_TLS: "off" })["SWACTOR_TLS"], "off")
    assert.notProperty(childEnvironment(settingsOf({}), {}), "SWACTOR_GPU_MEMORY")
  })

  it("the README's Settings table names every variable and flag", () => {
    const readme = readFileSync(join(repoRoot, "README.md"), "utf8")
    const section = readme.slice(readme.indexOf("## Settings"))
    const table = section.slice(0, section.indexOf("\n## ", 1) === -1 ? undefined : section.indexOf("\n## ", 1))
    for (const d of settingDocs) {
      assert.include(table, `\`${d.variable}\``, d.variable)
      if (d.flag !== undefined) assert.include(table, `\`${d.flag.split(" ")[0]}`, d.flag)
    }
  })
})

// ---------------------------------------------------------------------------------------------------------------
// The commands: flags only, then environment only.
// ---------------------------------------------------------------------------------------------------------------

const model = () => requireModel("stories260K.gguf")

/** `swactor node` with the test engine until its start line; the line with addresses and pid taken out. */
const nodeStartLine = (args: ReadonlyArray<string>, env: Record<string, string>) =>
  new Promise<string>((resolve, reject) => {
    const { command, args: argv } = swactorCommand(["node", "--listen", "127.0.0.1:0", "--engine", "test", ...args])
    const child: ChildProcess = spawn(command, argv, {
      cwd: repoRoot,
      stdio: ["ignore", "ignore", "pipe"],
      env: { ...cleanEnv(), ...env }
    })
    let stderr = ""
    const timer = setTimeout(() => {
      child.kill("SIGKILL")
      reject(new Error(`no start line:\n${stderr}`))
    }, 60_000)
    child.stderr!.setEncoding("utf8")
    child.stderr!.on("data", (chunk: string) => {
      stderr += chunk
      const line = stderr.split("\n").find((l) => l.startsWith("swactor node: control"))
      if (line === undefined) return
      clearTimeout(timer)
      child.kill("SIGTERM")
      resolve(line.replace(/control \S+, data \S+, /, "").replace(/ \(pid \d+\)/, ""))
    })
    child.on("exit", () => {
      clearTimeout(timer)
      reject(new Error(`swactor node exited:\n${stderr}`))
    })
  })

const runCli = (args: ReadonlyArray<string>, env: Record<string, string>) =>
  new Promise<{ code: number; stdout: string; stderr: string }>((resolve) => {
    const { command, args: argv } = swactorCommand(args)
    execFile(
      command,
      argv,
      { cwd: repoRoot, env: { ...cleanEnv(), ...env }, timeout: 120_000 },
      (error, stdout, stderr) =>
        resolve({ code: error ? (typeof error.code === "number" ? error.code : 1) : 0, stdout, stderr })
    )
  })

describe("every command: settings by flags only, then by environment only, the same behaviour", () => {
  const token = generateToken()
  const tokenFile = join(dir, "cluster-token")
  writeFileSync(tokenFile, `${token}\n`)

  it("node: threads, backend, TLS and the cluster token", async () => {
    const byFlags = await nodeStartLine(
      ["--threads", "3", "--backend", "cpu", "--tls", "always", "--token-file", tokenFile],
      {}
    )
    const byEnv = await nodeStartLine([], {
      SWACTOR_THREADS: "3",
      SWACTOR_GGML_PACKAGE: "cpu",
      SWACTOR_TLS: "always",
      SWACTOR_CLUSTER_TOKEN: token
    })
    assert.strictEqual(byFlags, "swactor node: 3 threads, cpu backend, test engine, TLS always")
    assert.strictEqual(byEnv, byFlags)
  }, 120_000)

  it("node: a bad TLS mode is refused by flag and by variable alike", async () => {
    const byFlag = await runCli(["node", "--tls", "sometimes", "--token-file", tokenFile], {})
    const byEnv = await runCli(["node"], { SWACTOR_TLS: "sometimes", SWACTOR_CLUSTER_TOKEN: token })
    assert.notStrictEqual(byFlag.code, 0)
    assert.notStrictEqual(byEnv.code, 0)
    assert.match(byEnv.stderr, /--tls \(or SWACTOR_TLS\): "sometimes" is not valid: expected auto, always or off\n/)
  }, 120_000)

  it("run: threads by flag or SWACTOR_THREADS give the same greedy text", async () => {
    const args = [
      "run",
      "--model",
      model(),
      "--stages",
      "2",
      "--max-tokens",
      "8",
      "--temperature",
      "0",
      "--prompt",
      "Once upon a time",
      "--quiet"
    ]
    const byFlags = await runCli([...args, "--threads", "1"], {})
    const byEnv = await runCli(args, { SWACTOR_THREADS: "1" })
    assert.strictEqual(byFlags.code, 0, byFlags.stderr)
    assert.strictEqual(byEnv.code, 0, byEnv.stderr)
    assert.isAbove(byFlags.stdout.length, 0)
    assert.strictEqual(byEnv.stdout, byFlags.stdout)
  }, 180_000)

  // run and serve start local agents: their --backend is the agents' own (without it the agents run the CPU stages
  // whatever SWACTOR_GGML_PACKAGE says, as swactor node does). This machine has the CUDA package and no GPU: a run
  // whose agents got --backend cuda fails in the agents, naming the missing device; one without the flag runs.
  it("run and serve: --backend reaches the local agents; beside --agents it (and --gpu-memory) is refused in one line", async () => {
    const args = ["run", "--model", model(), "--stages", "2", "--max-tokens", "4", "--prompt", "Once upon a time"]
    const cuda = await runCli([...args, "--threads", "1", "--backend", "cuda", "--quiet"], {})
    assert.notStrictEqual(cuda.code, 0)
    assert.match(
      cuda.stderr,
      /stage \d \(agent [^)]+\) faulted: loading the model failed: BackendUnavailable: no cuda device in @node-llama-cpp\/linux-x64-cuda: this node has CPU/
    )
    const cpu = await runCli([...args, "--threads", "1", "--backend", "cpu", "--quiet"], {})
    assert.strictEqual(cpu.code, 0, cpu.stderr)
    assert.isAbove(cpu.stdout.length, 0)
    for (const command of ["run", "serve"]) {
      const refused = await runCli(
        [command, "--model", model(), "--backend", "cpu", "--agents", "127.0.0.1:9", "--token-file", tokenFile],
        {}
      )
      assert.notStrictEqual(refused.code, 0, command)
      assert.strictEqual(
        refused.stderr.trim(),
        `swactor ${command}: --backend applies to local agents; a remote agent's backend is its own swactor node --backend`
      )
      const gpuMemory = await runCli(
        [command, "--model", model(), "--gpu-memory", "1000", "--agents", "127.0.0.1:9", "--token-file", tokenFile],
        {}
      )
      assert.notStrictEqual(gpuMemory.code, 0, command)
      assert.strictEqual(
        gpuMemory.stderr.trim(),
        `swactor ${command}: --gpu-memory applies to local agents; a remote agent's is its own swactor node --gpu-memory`
      )
    }
    const negative = await runCli([...args, "--gpu-memory", "-1"], {})
    assert.notStrictEqual(negative.code, 0)
    assert.match(negative.stderr.trim(), /^swactor run: --gpu-memory: -1 is not a whole number of bytes \(0 or more\)$/)
    // the flag and the variable mean the same to the local agents: a CPU stage whatever the budget, the same text
    const byFlag = await runCli([...args, "--threads", "1", "--gpu-memory", "0", "--quiet"], {})
    const byEnv = await runCli([...args, "--threads", "1", "--quiet"], { SWACTOR_GPU_MEMORY: "0" })
    assert.strictEqual(byFlag.code, 0, byFlag.stderr)
    assert.strictEqual(byEnv.stdout, byFlag.stdout)
    assert.strictEqual(byFlag.stdout, cpu.stdout)
  }, 240_000)

  it("serve: threads, TLS and the API key by flags or by environment: the same answers", async () => {
    const key = "sk-settings-test-1"
    const keyFile = join(dir, "api-keys")
    writeFileSync(keyFile, `${key}\n`)
    const ask = async (url: string) => {
      const open = await fetch(`${url}/v1/models`)
      const completion = await fetch(`${url}/v1/completions`, {
        method: "POST",
        headers: { "content-type": "application/json", authorization: `Bearer ${key}` },
        body: JSON.stringify({ prompt: "Once upon a time", max_tokens: 8, temperature: 0 })
      })
      const body = (await completion.json()) as { choices: Array<{ text: string }> }
      return { open: open.status, status: completion.status, text: body.choices?.[0]?.text }
    }
    const base = ["--model", model(), "--stages", "1"]
    const flags = await startServe(
      [...base, "--threads", "1", "--tls", "off", "--api-key-file", keyFile],
      cleanEnv() as Record<string, string>
    )
    let byFlags
    try {
      byFlags = await ask(flags.url)
    } finally {
      await stopServe(flags)
    }
    const envs = await startServe(base, {
      ...cleanEnv(),
      SWACTOR_THREADS: "1",
      SWACTOR_TLS: "off",
      SWACTOR_API_KEY: key
    } as Record<string, string>)
    let byEnv
    try {
      byEnv = await ask(envs.url)
    } finally {
      await stopServe(envs)
    }
    assert.deepStrictEqual(byFlags.open, 401)
    assert.deepStrictEqual(byFlags.status, 200)
    assert.isAbove(byFlags.text?.length ?? 0, 0)
    assert.deepStrictEqual(byEnv, byFlags)
  }, 240_000)
})
