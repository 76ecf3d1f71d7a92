/**
 * Flag checks shared by the commands: each bad value is a `UsageError` whose message is one line naming the flag,
 * found before anything starts (no agent spawned, no model read).
 */
import { Data, Effect, Either, Option, Redacted } from "effect"
import { readModelFacts } from "../api/modelFacts.js"
import { ModelLoadError } from "../domain/gguf.js"
import { parseAddress } from "../layers/agent/AgentControlRpc.js"
import { clusterTokenEnv } from "../layers/agent/ReadyLine.js"
import {
  chooseSetting,
  clusterTokenFrom,
  ggmlPackageSetting,
  settingFromFlagOrEnv,
  threadsSetting,
  type TlsMode,
  tlsSetting,
  type UserSetting
} from "../layers/config/Settings.js"
import { maxSpares, minTokenLength, sparesProblem, threadsProblem } from "../services/RequestChecks.js"
import * as Flag from "./FlagSpec.js"

/** A flag with a value the command cannot use; `message` names the flag. */
export class UsageError extends Data.TaggedError("UsageError")<{ readonly message: string }> {}

const fail = (message: string) => Effect.fail(new UsageError({ message }))

/** A whole number of at least `min` (`--threads 0` is refused, not passed on to crash an agent). */
export const wholeNumber = (flag: string, value: number, min: number): Effect.Effect<number, UsageError> =>
  Number.isSafeInteger(value) && value >= min
    ? Effect.succeed(value)
    : fail(`--${flag} must be a whole number of at least ${min}, got ${value}`)

/** A finite number of at least `min`. */
export const atLeast = (flag: string, value: number, min: number): Effect.Effect<number, UsageError> =>
  Number.isFinite(value) && value >= min
    ? Effect.succeed(value)
    : fail(`--${flag} must be at least ${min}, got ${value}`)

/** The same, for an optional flag. */
export const optionalWholeNumber = (flag: string, value: Option.Option<number>, min: number) =>
  Option.isSome(value) ? Effect.asSome(wholeNumber(flag, value.value, min)) : Effect.succeedNone

/** The shortest cluster token a node accepts. */
export { minTokenLength }

/**
 * `--threads`, else SWACTOR_THREADS: a whole number the stage engine accepts, 1 to 512 (services/RequestChecks.ts),
 * when either is given.
 */
export const optionalThreads = (value: Option.Option<number>): Effect.Effect<Option.Option<number>, UsageError> =>
  Effect.gen(function* () {
    const threads = yield* userSetting(threadsSetting, value.pipe(Option.map(Option.some)))
    if (Option.isNone(threads)) return threads
    const problem = threadsProblem(threads.value, Option.isSome(value) ? "--threads" : threadsSetting.doc.variable)
    return problem === undefined ? threads : yield* fail(problem)
  })

/** `--prefill-threads N` of run and serve (PipelineOptions.prefillThreads); checked by `optionalPrefillThreads`. */
export const prefillThreadsFlag = Flag.integer("prefill-threads", {
  group: "Pipeline",
  text: "threads a stage takes for the prompt (under 128 tokens) of a run alone on the pipeline, the other stages waiting"
}).optional("local agents with --threads: stages × threads, at most this machine's cores; else --threads")

/** `--threads N` of run, serve and node; checked by `optionalThreads`. */
export const threadsFlag = (group: string) =>
  Flag.integer("threads", { group, text: "engine threads per stage" }).optional(
    `${threadsSetting.doc.variable}, else ${threadsSetting.doc.default} of the node`
  )

/** --prefill-threads: absent, or threads the engine takes. */
export const optionalPrefillThreads = (
  value: Option.Option<number> | undefined
): Effect.Effect<number | undefined, UsageError> =>
  Effect.gen(function* () {
    if (value === undefined || Option.isNone(value)) return undefined
    const problem = threadsProblem(value.value, "--prefill-threads")
    return problem === undefined ? value.value : yield* fail(problem)
  })

/** A user setting (config/Settings.ts): the flag, else its environment variable, else its default; bad: refused. */
const userSetting = <A>(setting: UserSetting<A>, flag: Option.Option<A>): Effect.Effect<A, UsageError> =>
  Either.match(settingFromFlagOrEnv(setting, flag), {
    onLeft: (message): Effect.Effect<A, UsageError> => fail(message),
    onRight: (value) => Effect.succeed(value)
  })

/** `--tls auto|always|off` of run, serve and node; its default is SWACTOR_TLS (config/Settings.ts). */
export const tlsFlag = Flag.choice("tls", ["auto", "always", "off"], {
  group: "Network and security",
  text: "encrypt links between agents in TLS 1.3: auto (when the peer is not loopback), always, off; every end must agree"
}).optional(`${tlsSetting.doc.variable}, else ${tlsSetting.doc.default}`)

/** `--token-file PATH` of run, serve and node; read by `clusterToken`. */
export const tokenFileFlag = Flag.text("token-file", {
  group: "Network and security",
  value: "PATH",
  text: "file holding the cluster token"
}).optional(`the ${clusterTokenEnv} environment variable`)

/** `--agents host:port,...` (alias `--nodes`) of run and serve; read by `agentList`. */
export const agentsFlag = Flag.text("agents", {
  group: "Pipeline",
  value: "HOST:PORT,...",
  text: "remote agents (swactor node) to run the stages on, each proving the cluster token"
})
  .withAlias("nodes")
  .optional("local agents, started by this command")

/** `--spares N` of run and serve; checked by `spares`. */
export const sparesFlag = Flag.integer("spares", {
  group: "Pipeline",
  text: `local agents: extra agents that host nothing until a recovery needs them (at most ${maxSpares})`
}).withDefault(0)

/** `--deliver-weights` of run and serve. */
export const deliverWeightsFlag = Flag.choice("deliver-weights", ["auto", "always", "never"], {
  group: "Pipeline",
  text: "send each stage's weights (a GGUF slice) to nodes that lack them: auto (to remote --agents), always, never"
}).withDefault("auto")

/** `--token-loop on|off` of run and serve (PipelineOptions.tokenLoop). */
export const tokenLoopFlag = (receiver: string) =>
  Flag.choice("token-loop", ["on", "off"], {
    group: "Pipeline",
    text: `the last stage sends each token straight to stage 0 as well as back (on), or only back to the ${receiver} (off)`
  }).withDefault("on")

/**
 * The TLS mode of this command and the agents it starts: `--tls`, else SWACTOR_TLS, else auto. A flag becomes this
 * process's setting (its links and its local agents use it).
 */
export const tlsMode = (flag: Option.Option<TlsMode>): Effect.Effect<TlsMode, UsageError> =>
  userSetting(tlsSetting, flag).pipe(
    Effect.tap((mode) => (Option.isSome(flag) ? Effect.sync(() => chooseSetting(tlsSetting, mode)) : Effect.void))
  )

/**
 * `--backend cpu|cuda|auto` picks the ggml package an agent loads (cuda: node-llama-cpp's CUDA package); without it,
 * SWACTOR_GGML_PACKAGE, else cpu. Returns the stage backend (the flag, else cpu, as before).
 */
export const backend = (
  flag: Option.Option<"cpu" | "cuda" | "auto">
): Effect.Effect<"cpu" | "cuda" | "auto", UsageError> =>
  userSetting(ggmlPackageSetting, flag).pipe(
    Effect.tap((ggmlPackage) => Effect.sync(() => chooseSetting(ggmlPackageSetting, ggmlPackage))),
    Effect.as(Option.getOrElse(flag, () => "cpu" as const))
  )

/** `--backend` of node, and of run and serve for the local agents they start (as `swactor node --backend`). */
export const backendFlag = (group: string, whose: "" | " of the local agents") =>
  Flag.choice("backend", ["cpu", "cuda", "auto"], {
    group,
    text:
      `ggml backend and package${whose}: cpu, cuda (node-llama-cpp's CUDA package) or auto` +
      (whose === "" ? "" : "; remote agents choose their own")
  }).optional(`cpu stages; the package from ${ggmlPackageSetting.doc.variable}, else ${ggmlPackageSetting.doc.default}`)

/**
 * `--backend` of run and serve, checked: the extra arguments their local agents start with (none without the flag).
 * Refused beside `--agents`: a remote agent's backend is its own `swactor node --backend`.
 */
export const localBackendArgs = (
  flag: Option.Option<"cpu" | "cuda" | "auto">,
  remote: boolean
): Effect.Effect<ReadonlyArray<string>, UsageError> =>
  Effect.gen(function* () {
    if (remote && Option.isSome(flag)) {
      return yield* fail(
        "--backend applies to local agents; a remote agent's backend is its own swactor node --backend"
      )
    }
    const chosen = yield* backend(flag)
    return Option.isSome(flag) ? ["--backend", chosen] : []
  })

/** `--spares`: local spare agents, 0 to 64 (services/RequestChecks.ts), checked before any agent starts. */
export const spares = (value: number): Effect.Effect<number, UsageError> => {
  const problem = sparesProblem(value, "--spares")
  return problem === undefined ? Effect.succeed(value) : fail(problem)
}

/**
 * The cluster token: the file named by `--token-file` (trimmed), else SWACTOR_CLUSTER_TOKEN, else "" (none). A file
 * that cannot be read, a token shorter than 16 characters or one with under 64 bits of estimated entropy (repeated or
 * sequential characters: services/RequestChecks.ts) is a UsageError naming where it came from and how to make one.
 * The reading is config/Settings.ts's `clusterTokenFrom`, the library's too (api/generate.ts).
 */
export const clusterToken = (tokenFile: Option.Option<string>): Effect.Effect<string, UsageError> =>
  Either.match(clusterTokenFrom(Option.getOrUndefined(tokenFile)), {
    onLeft: (message): Effect.Effect<string, UsageError> => fail(message),
    onRight: (token) => Effect.succeed(Redacted.value(token))
  })

/** `--agents host:port,host:port` (alias `--nodes`): at least one, each host:port. */
export const agentList = (text: string): Effect.Effect<ReadonlyArray<string>, UsageError> =>
  Effect.gen(function* () {
    const nodes = text
      .split(",")
      .map((n) => n.trim())
      .filter((n) => n.length > 0)
    if (nodes.length === 0) return yield* fail(`--agents "${text}" names no agent: give host:port,host:port,...`)
    for (const node of nodes) {
      const address = parseAddress(node)
      if (address === undefined || address._tag !== "Tcp") {
        return yield* fail(`--agents "${node}" is not host:port`)
      }
    }
    return nodes
  })

/** A comma-separated list flag: each item checked by `bad` (a reason, or undefined when good); none given is []. */
export const listFlag = (
  flag: string,
  value: Option.Option<string>,
  bad: (item: string) => string | undefined
): Effect.Effect<ReadonlyArray<string>, UsageError> =>
  Effect.gen(function* () {
    if (Option.isNone(value)) return []
    const items = value.value
      .split(",")
      .map((item) => item.trim())
      .filter((item) => item !== "")
    for (const item of items) {
      const reason = bad(item)
      if (reason !== undefined) return yield* fail(`--${flag}: "${item}" is not valid: ${reason}`)
    }
    return items
  })

/**
 * The model's facts from its GGUF header, for checks before anything starts. A file that is no model stays a
 * ModelLoadError (its tag is what `run --json` reports), its message naming the file.
 */
export const modelFactsOf = (model: string) =>
  readModelFacts(model).pipe(
    Effect.mapError((error) =>
      error.message.includes(model) ? error : new ModelLoadError({ ...error, message: `${model}: ${error.message}` })
    )
  )
