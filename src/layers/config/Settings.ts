/**
 * Every setting of swactor, described once: its flag (where it has one), its environment variable, its default and
 * its meaning, each read through Effect's `Config` (the cluster token and API keys as `Config.redacted`). This is the
 * one module of src that reads the environment (src/main.ts reads NO_COLOR for its own console). They are resolved
 * once into the `Settings` service: its default is this process's environment, read once; the command line's edge
 * (src/cli) provides it with its flags' choices on top (`withChoices`), a test provides its own (`Settings.layer`).
 * Layers read the service where they are built or where an effect runs (the TLS mode of a connection), never the
 * environment.
 *
 * Three kinds of setting:
 * - user settings: a flag of `run`, `serve` and `node` with the environment as fallback (`--tls` / SWACTOR_TLS); a bad
 *   value is a one-line refusal naming both (`settingFromFlagOrEnv`);
 * - places and switches of the host (XDG_CACHE_HOME, SWACTOR_GGML_DIR, SWACTOR_DEBUG...), environment only;
 * - tuning and test hooks (SWACTOR_MMAP, SWACTOR_ZERO_COPY...): taken from the service where a layer is built (its
 *   `engineHooks`, `agentHooks`) and passed to it as options; tests pass the options themselves. They keep their old
 *   lenient reading: a value they do not understand is their default.
 */
import * as Os from "node:os"
import * as Path from "node:path"
import { readFileSync } from "node:fs"
import { Config, type ConfigError, ConfigProvider, Context, Effect, Either, Layer, Option, Redacted } from "effect"
import { DISCOVERY_PORT } from "../../domain/discovery.js"
import { type Backend, backends } from "../../domain/engine.js"
import { clusterTokenProblem } from "../../services/RequestChecks.js"

/** Environment variables by name (the process's, or a test's map). */
export type Environment = Readonly<Record<string, string | undefined>>

const providerOf = (env: Environment) =>
  ConfigProvider.fromMap(
    new Map(Object.entries(env).filter((entry): entry is [string, string] => entry[1] !== undefined))
  )

/** A config read from `env` (default: this process's environment), failing with Effect's ConfigError. */
export const readConfig = <A>(config: Config.Config<A>, env: Environment = process.env) =>
  Effect.runSync(Effect.either(Effect.withConfigProvider(config, providerOf(env))))

/** A config that never fails: read from `env`, or from this process's environment (lenient configs only). */
const readLenient = <A>(config: Config.Config<A>, env: Environment = process.env): A =>
  Either.getOrThrowWith(readConfig(config, env), (error) => new Error(String(error)))

// ---------------------------------------------------------------------------------------------------------------
// The table: every setting, described once (README `## Settings` shows it).
// ---------------------------------------------------------------------------------------------------------------

export interface SettingDoc {
  readonly variable: string
  /** The flag of `run`, `serve` and `node` (or of the commands named) that sets it, when there is one. */
  readonly flag?: string
  readonly commands?: string
  readonly default: string
  readonly meaning: string
}

const doc = (d: SettingDoc) => d

const docs = {
  tls: doc({
    variable: "SWACTOR_TLS",
    flag: "--tls auto|always|off",
    default: "auto",
    meaning: "encrypt agent links in TLS 1.3: auto (when the peer is not loopback), always, off"
  }),
  ggmlPackage: doc({
    variable: "SWACTOR_GGML_PACKAGE",
    flag: "--backend cpu|cuda|vulkan|auto",
    commands: "node; run and serve for their local agents",
    default: "cpu",
    meaning:
      "which node-llama-cpp ggml package an agent loads and where its stages run: cpu, cuda, vulkan, or auto (cuda " +
      "when an NVIDIA driver is seen, else vulkan when a Vulkan loader and the package are there, on its GPU if any)"
  }),
  gpuMemory: doc({
    variable: "SWACTOR_GPU_MEMORY",
    flag: "--gpu-memory BYTES",
    commands: "node; run and serve for their local agents",
    default: "the device's free memory",
    meaning:
      "the most device memory a GPU stage uses: a stage larger keeps its last blocks on the device and the rest in " +
      "host memory, run by the CPU (like llama.cpp's -ngl); 0 keeps every block on the CPU"
  }),
  threads: doc({
    variable: "SWACTOR_THREADS",
    flag: "--threads N",
    default: "every core",
    meaning: "engine threads per stage"
  }),
  clusterToken: doc({
    variable: "SWACTOR_CLUSTER_TOKEN",
    flag: "--token-file FILE",
    default: "none",
    meaning: "the cluster token agents and orchestrators prove (at least 16 characters; the file's text, trimmed)"
  }),
  apiKey: doc({
    variable: "SWACTOR_API_KEY",
    flag: "--api-key-file FILE",
    commands: "serve",
    default: "none (the API is open)",
    meaning: "the API key callers of `swactor serve` present (the file: one key per line)"
  }),
  cacheHome: doc({
    variable: "XDG_CACHE_HOME",
    flag: "--cache-dir DIR",
    commands: "node",
    default: "~/.cache",
    meaning: "where swactor keeps its cache (`swactor/`: delivered slices, model facts)"
  }),
  stateHome: doc({
    variable: "XDG_STATE_HOME",
    default: "~/.local/state",
    meaning: "where swactor keeps its state (`swactor/`: the node's persistent id, announced on the LAN)"
  }),
  discoveryPort: doc({
    variable: "SWACTOR_DISCOVERY_PORT",
    default: "41739",
    meaning: "the UDP port nodes announce themselves on and `--discover` listens on (every node of a cluster alike)"
  }),
  hubEndpoint: doc({
    variable: "HF_ENDPOINT",
    default: "https://huggingface.co/",
    meaning: "the hub `--model hf:…` names resolve against (MODEL_ENDPOINT, when set, is read first, as llama.cpp does)"
  }),
  hubToken: doc({
    variable: "HF_TOKEN",
    default: "none",
    meaning: "the token sent to the hub (never to its CDN, never logged) for gated or private repositories"
  }),
  ggmlDir: doc({
    variable: "SWACTOR_GGML_DIR",
    default: "none",
    meaning: "a folder of ggml libraries tried before node-llama-cpp's packages"
  }),
  ggmlLog: doc({
    variable: "SWACTOR_GGML_LOG",
    default: "warnings",
    meaning: "debug: let ggml print its debug and info lines too"
  }),
  debug: doc({
    variable: "SWACTOR_DEBUG",
    default: "0",
    meaning: "1: copy local agents' stderr to the command's"
  }),
  parentWatch: doc({
    variable: "SWACTOR_PARENT_WATCH",
    default: "none",
    meaning: "stdin: the agent exits when its stdin closes (set by the command that starts local agents)"
  }),
  mmap: doc({
    variable: "SWACTOR_MMAP",
    default: "1",
    meaning: "tuning: 0 reads CPU weights into memory instead of using them from a mapping of the file"
  }),
  mmapMove: doc({
    variable: "SWACTOR_MMAP_MOVE",
    default: "auto",
    meaning: "tuning: 1 always moves mapped weights to huge-page memory after load, 0 never (auto: warm or long runs)"
  }),
  hugePages: doc({
    variable: "SWACTOR_THP",
    default: "1",
    meaning: "tuning: 0 stops advising transparent huge pages for weight memory"
  }),
  zeroCopy: doc({
    variable: "SWACTOR_ZERO_COPY",
    default: "1",
    meaning: "tuning: 0 copies a hop's hidden rows into the graph instead of pointing the graph at them"
  }),
  gemvMaxRows: doc({
    variable: "SWACTOR_GEMV_MAX_ROWS",
    default: "measured",
    meaning: "tuning: the most rows of a CPU product that take the one-row kernel, for every weight type"
  }),
  batchMaxRows: doc({
    variable: "SWACTOR_BATCH_MAX_ROWS",
    default: "256",
    meaning: "tuning: rows per micro-batch of an agent's stage batcher"
  }),
  prefillChunk: doc({
    variable: "SWACTOR_PREFILL_CHUNK",
    default: "128",
    meaning: "tuning: prompt tokens per prefill chunk of an agent's stage batcher"
  }),
  benchSlowdown: doc({
    variable: "SWACTOR_BENCH_SLOWDOWN",
    default: "1",
    meaning: "bench hook: an agent's engine runs this many times slower and reports its speed divided by it"
  })
} as const

/** Every setting, in the README's order. */
export const settingDocs: ReadonlyArray<SettingDoc> = Object.values(docs)

const described = <A>(d: SettingDoc, config: Config.Config<A>) => config.pipe(Config.withDescription(d.meaning))

/** A variable read as text; unset or empty is `fallback`, else `parse(text)` (which may say undefined: `fallback`). */
const lenient = <A>(d: SettingDoc, parse: (text: string) => A | undefined, fallback: A): Config.Config<A> =>
  described(
    d,
    Config.string(d.variable).pipe(
      Config.map((text) => parse(text) ?? fallback),
      Config.withDefault(fallback)
    )
  )

const positiveInteger = (text: string): number | undefined => {
  const n = Number(text)
  return Number.isSafeInteger(n) && n > 0 ? n : undefined
}

// ---------------------------------------------------------------------------------------------------------------
// User settings: flag, then variable, then default; a bad value refused.
// ---------------------------------------------------------------------------------------------------------------

export type TlsMode = "auto" | "always" | "off"
export type GgmlPackage = Backend

/** A user setting: its description and its strict config (a bad value fails). */
export interface UserSetting<A> {
  readonly doc: SettingDoc
  readonly config: Config.Config<A>
  /** What a good value is, for the refusal of a bad one. */
  readonly expected: string
}

export const tlsSetting: UserSetting<TlsMode> = {
  doc: docs.tls,
  expected: "auto, always or off",
  config: described(
    docs.tls,
    Config.literal("auto", "always", "off")(docs.tls.variable).pipe(Config.withDefault("auto"))
  )
}

export const ggmlPackageSetting: UserSetting<GgmlPackage> = {
  doc: docs.ggmlPackage,
  expected: "cpu, cuda, vulkan or auto",
  config: described(
    docs.ggmlPackage,
    Config.literal(...backends)(docs.ggmlPackage.variable).pipe(Config.withDefault("cpu"))
  )
}

export const threadsSetting: UserSetting<Option.Option<number>> = {
  doc: docs.threads,
  expected: "a whole number",
  config: described(docs.threads, Config.option(Config.integer(docs.threads.variable)))
}

const flagName = (d: SettingDoc) => d.flag?.split(" ")[0] ?? d.variable

/** The one-line refusal of a bad value: it names the flag and the variable. */
const refusal = (d: SettingDoc, detail: string) =>
  `${flagName(d)} (or ${d.variable}): ${detail.replace(/\s+/g, " ").trim()}`

/**
 * A user setting: the flag when given, else its variable in `env`, else its default. Left: the one-line refusal of
 * a bad variable (a flag's own value is checked by the flag parser). The CLI then provides the value chosen as the
 * `Settings` service (`withChoices`): the engine and the agents it starts see it.
 */
export const settingFromFlagOrEnv = <A>(
  setting: UserSetting<A>,
  flag: Option.Option<A>,
  env: Environment = process.env
): Either.Either<A, string> => {
  if (Option.isSome(flag)) return Either.right(flag.value)
  return Either.mapLeft(readConfig(setting.config, env), () =>
    refusal(setting.doc, `${JSON.stringify(env[setting.doc.variable])} is not valid: expected ${setting.expected}`)
  )
}

/** The TLS mode (unset or unknown: auto). */
const tlsModeConfig = lenient(
  docs.tls,
  (text) => (text === "always" || text === "off" ? text : undefined),
  "auto" as TlsMode
)

/** The ggml package to load (unset or unknown: cpu). */
const ggmlPackageConfig = lenient(
  docs.ggmlPackage,
  (text) => (text === "cuda" || text === "vulkan" || text === "auto" ? text : undefined),
  "cpu" as GgmlPackage
)

/** SWACTOR_GPU_MEMORY when a whole number of bytes (a GPU stage's device budget), else undefined. */
const gpuMemoryConfig = lenient(
  docs.gpuMemory,
  (text) => {
    const v = Number(text)
    return text.trim() !== "" && Number.isSafeInteger(v) && v >= 0 ? v : undefined
  },
  undefined as number | undefined
)

/** SWACTOR_THREADS when a positive whole number (the live engine's default threads), else undefined. */
const threadsConfig = lenient(docs.threads, positiveInteger, undefined as number | undefined)

/**
 * The cluster token: the file named by `tokenFile` (trimmed), else SWACTOR_CLUSTER_TOKEN (trimmed), else "" (none).
 * Left: one line naming where it came from, for a file that cannot be read or is empty, or a token shorter than 16
 * characters or with under 64 bits of estimated entropy (services/RequestChecks.ts). The one reader of the token:
 * the CLI (cli/PipelineFlags.ts) and the library (api/generate.ts) both use it.
 */
export const clusterTokenFrom = (
  tokenFile: string | undefined,
  env: Environment = process.env
): Either.Either<Redacted.Redacted<string>, string> => {
  let token: string
  let source: string
  if (tokenFile !== undefined) {
    source = `--token-file ${tokenFile}`
    try {
      token = readFileSync(tokenFile, "utf8").trim()
    } catch (cause) {
      return Either.left(`${source}: cannot read it (${(cause as NodeJS.ErrnoException).code ?? String(cause)})`)
    }
    if (token === "") return Either.left(`${source}: the file is empty`)
  } else {
    source = docs.clusterToken.variable
    token = Redacted.value(clusterTokenFromEnv(env))
    if (token === "") return Either.right(Redacted.make(""))
  }
  const problem = clusterTokenProblem(token, source)
  return problem === undefined ? Either.right(Redacted.make(token)) : Either.left(problem)
}

/**
 * SWACTOR_CLUSTER_TOKEN, trimmed ("" when unset), not yet checked: `clusterTokenFrom` checks it for the CLI, the
 * remote agent pool (AgentPools.ts) with the same rule for the library.
 */
export const clusterTokenFromEnv = (env: Environment = process.env): Redacted.Redacted<string> =>
  Option.match(
    readLenient(described(docs.clusterToken, Config.option(Config.redacted(docs.clusterToken.variable))), env),
    {
      onNone: () => Redacted.make(""),
      onSome: (value) => Redacted.make(Redacted.value(value).trim())
    }
  )

/** SWACTOR_API_KEY, trimmed (none: undefined); `swactor serve` reads it when no --api-key-file is given. */
export const apiKeyFromEnv = (env: Environment = process.env): Redacted.Redacted<string> | undefined =>
  Option.getOrUndefined(
    Option.flatMap(
      readLenient(described(docs.apiKey, Config.option(Config.redacted(docs.apiKey.variable))), env),
      (key) =>
        Redacted.value(key).trim() === "" ? Option.none() : Option.some(Redacted.make(Redacted.value(key).trim()))
    )
  )

/** The environment variable names the CLI's messages mention. */
export const clusterTokenVariable = docs.clusterToken.variable
export const apiKeyVariable = docs.apiKey.variable
export const parentWatchVariable = docs.parentWatch.variable

// ---------------------------------------------------------------------------------------------------------------
// The host: places and switches, environment only.
// ---------------------------------------------------------------------------------------------------------------

/** `$XDG_CACHE_HOME/swactor` (unset or empty: `~/.cache/swactor`). */
const cacheDirConfig = lenient(docs.cacheHome, (text) => text, "").pipe(
  Config.map((home) => Path.join(home || Path.join(Os.homedir(), ".cache"), "swactor"))
)

/** `$XDG_STATE_HOME/swactor` (unset or empty: `~/.local/state/swactor`). */
const stateDirConfig = lenient(docs.stateHome, (text) => text, "").pipe(
  Config.map((home) => Path.join(home || Path.join(Os.homedir(), ".local", "state"), "swactor"))
)

const urlText = (text: string): string | undefined => {
  try {
    const url = new URL(text)
    return url.protocol === "http:" || url.protocol === "https:"
      ? url.href.endsWith("/")
        ? url.href
        : `${url.href}/`
      : undefined
  } catch {
    return undefined
  }
}

/** The hub's base URL, ending in "/": MODEL_ENDPOINT, else HF_ENDPOINT, else https://huggingface.co/. */
const hubEndpointConfig = Config.all([
  lenient({ ...docs.hubEndpoint, variable: "MODEL_ENDPOINT" }, urlText, undefined as string | undefined),
  lenient(docs.hubEndpoint, urlText, "https://huggingface.co/")
]).pipe(Config.map(([model, hf]) => model ?? hf))

/** HF_TOKEN, when set and not empty: sent to the hub only. */
const hubTokenConfig = lenient(docs.hubToken, (t) => t.trim(), "").pipe(
  Config.map((text) => (text === "" ? undefined : Redacted.make(text)))
)

/** SWACTOR_GGML_DIR when set and not empty. */
const ggmlDirConfig = lenient(docs.ggmlDir, (text) => text, undefined as string | undefined).pipe(
  Config.map((dir) => dir || undefined)
)

/** Windows' folder (SystemRoot; default C:\Windows), where the NVIDIA driver's DLL would be. */
const windowsRootConfig = described(
  doc({ variable: "SystemRoot", default: "C:\\Windows", meaning: "Windows' folder" }),
  Config.string("SystemRoot").pipe(Config.withDefault("C:\\Windows"))
)

// ---------------------------------------------------------------------------------------------------------------
// Tuning and test hooks: taken from the service where a layer is built, passed to it as options.
// ---------------------------------------------------------------------------------------------------------------

/** The live stage engine's hooks (StageExecutorLive's options). */
export interface EngineHooks {
  /** Use plain CPU weights from a mapping of the file (SWACTOR_MMAP, default true). */
  readonly mmap: boolean
  /** Advise transparent huge pages for CPU weight memory (SWACTOR_THP, default true). */
  readonly hugePages: boolean
  /** Point a lone call's hidden input at the caller's rows (SWACTOR_ZERO_COPY, default true). */
  readonly zeroCopy: boolean
  /** A fixed few-row route limit for every weight type (SWACTOR_GEMV_MAX_ROWS; default measured: undefined). */
  readonly smallBatchRows: number | undefined
}

export const engineHooksConfig: Config.Config<EngineHooks> = Config.all({
  mmap: lenient(docs.mmap, (text) => text !== "0", true),
  hugePages: lenient(docs.hugePages, (text) => text !== "0", true),
  zeroCopy: lenient(docs.zeroCopy, (text) => text !== "0", true),
  smallBatchRows: lenient(
    docs.gemvMaxRows,
    (text) => {
      if (text.trim() === "") return undefined
      const v = Number(text)
      return Number.isSafeInteger(v) && v >= 0 ? v : undefined
    },
    undefined as number | undefined
  )
})

/** The engine hooks of `env` (this process's are its Settings' `engineHooks`). */
export const engineHooks = (env: Environment): EngineHooks => readLenient(engineHooksConfig, env)

/** A node agent's hooks (the stage host's options). */
export interface AgentHooks {
  /** When a stage moves mapped weights to allocated memory (SWACTOR_MMAP_MOVE: 1 always, 0 never, else auto). */
  readonly settleWeights: "always" | "never" | "auto"
  /** Stage batcher rows per micro-batch (SWACTOR_BATCH_MAX_ROWS; undefined: the batcher's default). */
  readonly batchMaxRows: number | undefined
  /** Stage batcher tokens per prefill chunk (SWACTOR_PREFILL_CHUNK; undefined: the batcher's default). */
  readonly prefillChunk: number | undefined
  /** The bench throttle factor (SWACTOR_BENCH_SLOWDOWN: a finite number above 1, else 1). */
  readonly slowdown: number
}

export const agentHooksConfig: Config.Config<AgentHooks> = Config.all({
  settleWeights: lenient(
    docs.mmapMove,
    (text) => (text === "1" ? ("always" as const) : text === "0" ? ("never" as const) : undefined),
    "auto" as const
  ),
  batchMaxRows: lenient(docs.batchMaxRows, positiveInteger, undefined as number | undefined),
  prefillChunk: lenient(docs.prefillChunk, positiveInteger, undefined as number | undefined),
  slowdown: lenient(
    docs.benchSlowdown,
    (text) => {
      const factor = Number(text)
      return Number.isFinite(factor) && factor > 1 ? factor : undefined
    },
    1
  )
})

/** The agent hooks of `env` (this process's are its Settings' `agentHooks`). */
export const agentHooks = (env: Environment): AgentHooks => readLenient(agentHooksConfig, env)

// ---------------------------------------------------------------------------------------------------------------
// The service: every setting resolved once.
// ---------------------------------------------------------------------------------------------------------------

/** Every setting a layer reads, resolved: the environment's (or a test's), with the CLI's flag choices on top. */
export interface SettingsValues {
  /** --tls / SWACTOR_TLS (unset or unknown: auto): the mode of every link this process makes or accepts. */
  readonly tls: TlsMode
  /** --backend / SWACTOR_GGML_PACKAGE (unset or unknown: cpu): the ggml package this process loads. */
  readonly ggmlPackage: GgmlPackage
  /** --gpu-memory / SWACTOR_GPU_MEMORY: a GPU stage's device budget in bytes (undefined: the device's free memory). */
  readonly gpuMemory: number | undefined
  /** SWACTOR_THREADS when a positive whole number: the live engine's default threads. */
  readonly threads: number | undefined
  /** `$XDG_CACHE_HOME/swactor` (unset or empty: `~/.cache/swactor`). */
  readonly cacheDir: string
  /** `$XDG_STATE_HOME/swactor` (unset or empty: `~/.local/state/swactor`): the node's persistent id. */
  readonly stateDir: string
  /** SWACTOR_DISCOVERY_PORT (unset or not a port: 41739): the UDP port of LAN discovery. */
  readonly discoveryPort: number
  /** The hub's base URL, ending in "/": MODEL_ENDPOINT, else HF_ENDPOINT, else https://huggingface.co/. */
  readonly hubEndpoint: string
  /** HF_TOKEN, when set and not empty: sent to the hub only. */
  readonly hubToken: Redacted.Redacted<string> | undefined
  /** SWACTOR_GGML_DIR when set and not empty. */
  readonly ggmlDir: string | undefined
  /** SWACTOR_GGML_LOG=debug: ggml's debug and info lines are kept. */
  readonly ggmlDebugLog: boolean
  /** SWACTOR_DEBUG=1: local agents' stderr is copied to ours. */
  readonly debugAgents: boolean
  /** SWACTOR_PARENT_WATCH=stdin: this agent exits when its parent's pipe on stdin closes. */
  readonly watchesParent: boolean
  /** Windows' folder (SystemRoot; default C:\Windows), where the Vulkan loader's and NVIDIA driver's DLLs would be. */
  readonly windowsRoot: string
  /** The live stage engine's tuning hooks. */
  readonly engineHooks: EngineHooks
  /** A node agent's tuning hooks. */
  readonly agentHooks: AgentHooks
}

/** Every setting, read leniently (a value not understood is its default; the CLI refuses bad user settings first). */
export const settingsConfig: Config.Config<SettingsValues> = Config.all({
  tls: tlsModeConfig,
  ggmlPackage: ggmlPackageConfig,
  gpuMemory: gpuMemoryConfig,
  threads: threadsConfig,
  cacheDir: cacheDirConfig,
  stateDir: stateDirConfig,
  discoveryPort: lenient(
    docs.discoveryPort,
    (text) => {
      const port = positiveInteger(text)
      return port !== undefined && port <= 65535 ? port : undefined
    },
    DISCOVERY_PORT
  ),
  hubEndpoint: hubEndpointConfig,
  hubToken: hubTokenConfig,
  ggmlDir: ggmlDirConfig,
  ggmlDebugLog: lenient(docs.ggmlLog, (text) => text === "debug", false),
  debugAgents: lenient(docs.debug, (text) => text === "1", false),
  watchesParent: lenient(docs.parentWatch, (text) => text === "stdin", false),
  windowsRoot: windowsRootConfig,
  engineHooks: engineHooksConfig,
  agentHooks: agentHooksConfig
})

/** The settings of `env` (a test's map, or this process's environment). */
export const settingsOf = (env: Environment): SettingsValues => readLenient(settingsConfig, env)

/**
 * The settings service. Its default, without a layer, is this process's environment, read once (through Effect's
 * `Config`): a library user gets the environment's settings. The CLI provides its flags' choices on top
 * (`withChoices`); a test provides `Settings.layer({ tls: "always" })` instead of writing `process.env`.
 */
export class Settings extends Context.Reference<Settings>()("swactor/Settings", {
  defaultValue: (): SettingsValues => settingsOf(process.env)
}) {
  /** The settings read through the Config provider in force (Effect's default: the environment). */
  static readonly live: Layer.Layer<Settings, ConfigError.ConfigError> = Layer.effect(Settings, settingsConfig)

  /** This process's settings with `values` on top: what a test provides. */
  static readonly layer = (values: Partial<SettingsValues>): Layer.Layer<Settings> =>
    Layer.succeed(Settings, { ...liveSettings(), ...values })

  /** The settings of the environment `env` (read as this process's is): a test's variables, without writing them. */
  static readonly fromEnvironment = (env: Environment): Layer.Layer<Settings> =>
    Layer.succeed(Settings, settingsOf(env))
}

/** This process's settings from its environment, read once (the service's default), for code outside an effect. */
export const liveSettings = (): SettingsValues => Context.get(Context.empty(), Settings)

/** What the CLI's flags chose: each, when given, replaces the setting resolved from the environment. */
export interface SettingChoices {
  readonly tls?: TlsMode | undefined
  readonly ggmlPackage?: GgmlPackage | undefined
  readonly gpuMemory?: number | undefined
}

/** `settings` with the flags' choices on top. */
export const withChoices = (settings: SettingsValues, choices: SettingChoices): SettingsValues => ({
  ...settings,
  ...(choices.tls === undefined ? {} : { tls: choices.tls }),
  ...(choices.ggmlPackage === undefined ? {} : { ggmlPackage: choices.ggmlPackage }),
  ...(choices.gpuMemory === undefined ? {} : { gpuMemory: choices.gpuMemory })
})

/**
 * The environment of a child process this one starts (a local agent): ours, the user settings a flag can choose as
 * resolved here (so a flag and its variable mean the same to the agents: --tls, --backend, --gpu-memory), then
 * `extra` (its cluster token, its parent watch, a test's variables).
 */
export const childEnvironment = (settings: SettingsValues, extra: Environment = {}): NodeJS.ProcessEnv => ({
  ...process.env,
  [docs.tls.variable]: settings.tls,
  [docs.ggmlPackage.variable]: settings.ggmlPackage,
  ...(settings.gpuMemory === undefined ? {} : { [docs.gpuMemory.variable]: String(settings.gpuMemory) }),
  ...extra
})
