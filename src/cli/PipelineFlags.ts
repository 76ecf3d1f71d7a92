/**
 * The flags `run`, `serve` and `node` share (issue 37): each declared once with its one help text, checked once, and
 * turned into the pipeline's options once. `run` and `serve` take the pipeline's (`pipelineFlags`: --stages, --agents,
 * --threads, --prefill-threads, --backend, --spares, --deliver-weights, --token-loop), the model's (`modelFlag`) and
 * the links' (`securityFlags`: --tls, --token-file); `node` takes --threads, its own --backend and the links' flags.
 * A new pipeline flag is added here: its declaration, its check and what it asks of PipelineOptions.
 */
import { Effect, Either, Option, Redacted, type Scope } from "effect"
import { parseAddress } from "../layers/agent/AgentControlRpc.js"
import { clusterTokenEnv } from "../layers/agent/ReadyLine.js"
import {
  clusterTokenFrom,
  ggmlPackageSetting,
  Settings,
  settingFromFlagOrEnv,
  threadsSetting,
  type TlsMode,
  tlsSetting,
  type UserSetting,
  withChoices
} from "../layers/config/Settings.js"
import type { PipelineOptions } from "../services/Orchestrator.js"
import { DEFAULT_MAX_DRAFT, type SpeculativeOptions } from "../services/Speculation.js"
import {
  makeTokenHint,
  maxSpares,
  minTokenLength,
  sparesProblem,
  stagesProblem,
  threadsProblem
} from "../services/RequestChecks.js"
import { discoveredAgents } from "./DiscoverAgents.js"
import type { DiscoveredPoolService } from "../services/DiscoveredPool.js"
import { optionalWholeNumber, UsageError } from "./Flags.js"
import * as Flag from "./FlagSpec.js"
import { type Backend, backends } from "../domain/engine.js"

const fail = (message: string) => Effect.fail(new UsageError({ message }))

const pipeline = "Pipeline"
const security = "Network and security"

/** Local agents `run` and `serve` start without --stages or --agents. */
export const defaultLocalStages = 2

// ---- The declarations: what each flag parses into and what `--help` says of it.

/** `--model PATH` of run and serve (run: optional, with its own default; serve: required). */
export const modelFlag = (group: string) =>
  Flag.modelPath("model", {
    group,
    text: "GGUF model (with --agents, nodes without it receive their stages' slices: --deliver-weights)"
  })

const stagesFlag = Flag.integer("stages", { group: pipeline, text: "pipeline stages" }).optional(
  `${defaultLocalStages} local agents; with --agents, one per agent`
)

/** `--threads N` of run, serve (group Pipeline) and node (group Engine); checked by `optionalThreads`. */
export const threadsFlag = (group: string) =>
  Flag.integer("threads", { group, text: "engine threads per stage" }).optional(
    `${threadsSetting.doc.variable}, else ${threadsSetting.doc.default} of the node`
  )

const prefillThreadsFlag = Flag.integer("prefill-threads", {
  group: pipeline,
  text: "threads a stage takes for the prompt (under 128 tokens) of a run alone on the pipeline, the other stages waiting"
}).optional("local agents with --threads: stages × threads, at most this machine's cores; else --threads")

const agentsFlag = Flag.text("agents", {
  group: pipeline,
  value: "HOST:PORT,...",
  text: "remote agents (swactor node) to run the stages on, each proving the cluster token"
})
  .withAlias("nodes")
  .optional("local agents, started by this command")

const discoverFlag = Flag.boolean("discover", {
  group: pipeline,
  text: "run the stages on the nodes that announce themselves with the cluster token (swactor node), found on the LAN"
})

/** `--backend` of node (the agent's own), and of run and serve for the local agents they start. */
export const backendFlag = (group: string, whose: "" | " of the local agents") =>
  Flag.choice("backend", backends, {
    group,
    text:
      `ggml backend and package${whose}: cpu, cuda or vulkan (node-llama-cpp's package of that name, its GPU) or auto` +
      (whose === "" ? "" : "; remote agents choose their own")
  }).optional(`cpu stages; the package from ${ggmlPackageSetting.doc.variable}, else ${ggmlPackageSetting.doc.default}`)

/** `--gpu-memory` of node (the agent's own), and of run and serve for the local agents they start. */
export const gpuMemoryFlag = (group: string, whose: "" | " of the local agents") =>
  Flag.integer("gpu-memory", {
    group,
    value: "BYTES",
    text:
      `the most device memory a GPU stage${whose} uses: a larger stage keeps its last blocks on the device and the ` +
      "rest in host memory, run by the CPU (like llama.cpp's -ngl); 0: every block on the CPU"
  }).optional("the device's free memory")

const sparesFlag = Flag.integer("spares", {
  group: pipeline,
  text: `local agents: extra agents that host nothing until a recovery needs them (at most ${maxSpares})`
}).withDefault(0)

const deliverWeightsFlag = Flag.choice("deliver-weights", ["auto", "always", "never"], {
  group: pipeline,
  text: "send each stage's weights (a GGUF slice) to nodes that lack them: auto (to remote --agents), always, never"
}).withDefault("auto")

const tokenLoopFlag = (receiver: "orchestrator" | "server") =>
  Flag.choice("token-loop", ["on", "off"], {
    group: pipeline,
    text: `the last stage sends each token straight to stage 0 as well as back (on), or only back to the ${receiver} (off)`
  }).withDefault("on")

/** The pipeline's flags of run and serve, in the order their help lists them; `receiver`: who gets the tokens. */
export const pipelineFlags = (receiver: "orchestrator" | "server") => ({
  stages: stagesFlag,
  agents: agentsFlag,
  discover: discoverFlag,
  threads: threadsFlag(pipeline),
  prefillThreads: prefillThreadsFlag,
  backend: backendFlag(pipeline, " of the local agents"),
  gpuMemory: gpuMemoryFlag(pipeline, " of the local agents"),
  spares: sparesFlag,
  deliverWeights: deliverWeightsFlag,
  tokenLoop: tokenLoopFlag(receiver)
})

/** `--tls` and `--token-file` of run, serve and node: the links between agents and orchestrators. */
export const securityFlags = {
  tls: Flag.choice("tls", ["auto", "always", "off"], {
    group: security,
    text: "encrypt links between agents in TLS 1.3: auto (when the peer is not loopback), always, off; every end must agree"
  }).optional(`${tlsSetting.doc.variable}, else ${tlsSetting.doc.default}`),
  tokenFile: Flag.text("token-file", {
    group: security,
    value: "PATH",
    text: "file holding the cluster token"
  }).optional(`the ${clusterTokenEnv} environment variable`)
}

/** What the pipeline's and the links' flags of run and serve parse into. */
export type PipelineArgs = Flag.ArgsOf<ReturnType<typeof pipelineFlags>> & Flag.ArgsOf<typeof securityFlags>

// ---- The checks: each bad value a one-line UsageError naming the flag, before anything starts.

/** A user setting (config/Settings.ts): the flag, else its environment variable, else its default; bad: refused. */
const userSetting = <A>(setting: UserSetting<A>, flag: Option.Option<A>): Effect.Effect<A, UsageError> =>
  Either.match(settingFromFlagOrEnv(setting, flag), {
    onLeft: (message): Effect.Effect<A, UsageError> => fail(message),
    onRight: (value) => Effect.succeed(value)
  })

/** `--threads`, else SWACTOR_THREADS: a whole number the stage engine accepts, 1 to 512 (services/RequestChecks.ts). */
const optionalThreads = (value: Option.Option<number>): Effect.Effect<Option.Option<number>, UsageError> =>
  Effect.gen(function* () {
    const threads = yield* userSetting(threadsSetting, value.pipe(Option.map(Option.some)))
    if (Option.isNone(threads)) return threads
    const problem = threadsProblem(threads.value, Option.isSome(value) ? "--threads" : threadsSetting.doc.variable)
    return problem === undefined ? threads : yield* fail(problem)
  })

/** `--prefill-threads`: absent, or threads the engine takes. */
const optionalPrefillThreads = (value: Option.Option<number>): Effect.Effect<number | undefined, UsageError> => {
  if (Option.isNone(value)) return Effect.succeed(undefined)
  const problem = threadsProblem(value.value, "--prefill-threads")
  return problem === undefined ? Effect.succeed(value.value) : fail(problem)
}

/** `--spares`: local spare agents, 0 to 64 (services/RequestChecks.ts). */
const checkSpares = (value: number): Effect.Effect<number, UsageError> => {
  const problem = sparesProblem(value, "--spares")
  return problem === undefined ? Effect.succeed(value) : fail(problem)
}

/**
 * The TLS mode of this command and the agents it starts: `--tls`, else SWACTOR_TLS, else auto. A flag becomes this
 * process's setting (`chosenSettings`: its links and its local agents use it).
 */
const tlsMode = (flag: Option.Option<TlsMode>): Effect.Effect<TlsMode, UsageError> => userSetting(tlsSetting, flag)

/**
 * `--backend cpu|cuda|vulkan|auto` picks the ggml package an agent loads (cuda, vulkan: node-llama-cpp's package of
 * that name); without it,
 * SWACTOR_GGML_PACKAGE, else cpu. Returns the stage backend (the flag, else cpu); a flag becomes this process's
 * setting (`chosenSettings`).
 */
const checkBackend = (flag: Option.Option<Backend>): Effect.Effect<Backend, UsageError> =>
  userSetting(ggmlPackageSetting, flag).pipe(Effect.as(Option.getOrElse(flag, () => "cpu" as const)))

/**
 * `--backend` of run and serve: the extra arguments their local agents start with (none without the flag). Refused
 * beside `--agents`: a remote agent's backend is its own `swactor node --backend`.
 */
const localBackendArgs = (
  flag: Option.Option<Backend>,
  remote: boolean
): Effect.Effect<ReadonlyArray<string>, UsageError> =>
  Effect.gen(function* () {
    if (remote && Option.isSome(flag)) {
      return yield* fail(
        "--backend applies to local agents; a remote agent's backend is its own swactor node --backend"
      )
    }
    const chosen = yield* checkBackend(flag)
    return Option.isSome(flag) ? ["--backend", chosen] : []
  })

/**
 * `--gpu-memory BYTES`: a whole number of bytes, 0 or more, becoming this process's setting (SWACTOR_GPU_MEMORY: its
 * engine and the local agents it starts read it; `chosenSettings`). Refused beside `--agents`: a remote agent's is its own.
 */
const checkGpuMemory = (flag: Option.Option<number>, remote: boolean): Effect.Effect<void, UsageError> => {
  if (Option.isNone(flag)) return Effect.void
  if (remote) return fail("--gpu-memory applies to local agents; a remote agent's is its own swactor node --gpu-memory")
  if (!Number.isSafeInteger(flag.value) || flag.value < 0) {
    return fail(`--gpu-memory: ${flag.value} is not a whole number of bytes (0 or more)`)
  }
  return Effect.void
}

/**
 * The settings this command and the agents it starts run with (the `Settings` service it provides): the resolved
 * ones (this process's environment, read once), with the flags given on top: --tls, --backend, --gpu-memory.
 */
const chosenSettings = (args: {
  readonly tls: Option.Option<TlsMode>
  readonly backend: Option.Option<Backend>
  readonly gpuMemory: Option.Option<number>
}) =>
  Effect.map(Settings, (settings) =>
    withChoices(settings, {
      tls: Option.getOrUndefined(args.tls),
      ggmlPackage: Option.getOrUndefined(args.backend),
      gpuMemory: Option.getOrUndefined(args.gpuMemory)
    })
  )

/**
 * The cluster token: the file named by `--token-file` (trimmed), else SWACTOR_CLUSTER_TOKEN, else "" (none). A file
 * that cannot be read, a token shorter than 16 characters or one with under 64 bits of estimated entropy is a
 * UsageError naming where it came from and how to make one (config/Settings.ts `clusterTokenFrom`, the library's too).
 */
export const clusterToken = (tokenFile: Option.Option<string>): Effect.Effect<string, UsageError> =>
  Either.match(clusterTokenFrom(Option.getOrUndefined(tokenFile)), {
    onLeft: (message): Effect.Effect<string, UsageError> => fail(message),
    onRight: (token) => Effect.succeed(Redacted.value(token))
  })

/** How to give the cluster token, said wherever one is needed and missing. */
const giveToken = `set ${clusterTokenEnv} or pass --token-file (at least ${minTokenLength} characters; ${makeTokenHint})`

/** `--agents host:port,host:port` (alias `--nodes`): at least one, each host:port. */
const agentList = (text: string): Effect.Effect<ReadonlyArray<string>, UsageError> =>
  Effect.gen(function* () {
    const agents = text
      .split(",")
      .map((n) => n.trim())
      .filter((n) => n.length > 0)
    if (agents.length === 0) return yield* fail(`--agents "${text}" names no agent: give host:port,host:port,...`)
    const bad = agents.find((agent) => parseAddress(agent)?._tag !== "Tcp")
    return bad === undefined ? agents : yield* fail(`--agents "${bad}" is not host:port`)
  })

/**
 * The remote agents: --agents, or with --discover the nodes heard proving the token (cli/DiscoverAgents.ts; `invite`:
 * its invite line printed while it listens).
 */
const remoteAgents = (
  args: PipelineArgs,
  token: string,
  invite: boolean,
  keep: Scope.Scope | undefined
): Effect.Effect<
  { readonly agents: ReadonlyArray<string>; readonly discovered?: DiscoveredPoolService | undefined },
  UsageError
> =>
  Effect.gen(function* () {
    if (!args.discover) return { agents: Option.isSome(args.agents) ? yield* agentList(args.agents.value) : [] }
    if (Option.isSome(args.agents)) return yield* fail("--discover and --agents: give one of them")
    if (token === "") return yield* fail(`--discover needs the cluster token: ${giveToken}`)
    const found = yield* discoveredAgents(token, yield* chosenSettings(args), invite, keep).pipe(
      Effect.mapError((message) => new UsageError({ message }))
    )
    return { agents: found.addresses, discovered: keep === undefined ? undefined : found.pool }
  })

/**
 * The pipeline's and the links' flags of run and serve, checked: the remote agents and their cluster token (needed
 * with --agents), the TLS mode, backend and GPU memory (`settings`: the Settings service the command provides), the
 * local agents' extra arguments, stages, threads, prefill threads, spares. `invite` (serve): --discover prints the
 * invite line (cli/DiscoverAgents.ts); `keep` (serve): the discovered pool stays open in it (`discovered`), so that
 * nodes appearing later are seen.
 */
export const checkPipelineFlags = (args: PipelineArgs, invite = false, keep?: Scope.Scope) =>
  Effect.gen(function* () {
    const token = yield* clusterToken(args.tokenFile)
    const { agents, discovered } = yield* remoteAgents(args, token, invite, keep)
    yield* tlsMode(args.tls)
    const agentArgs = yield* localBackendArgs(args.backend, agents.length > 0)
    yield* checkGpuMemory(args.gpuMemory, agents.length > 0)
    if (agents.length > 0 && token === "") return yield* fail(`--agents needs the cluster token: ${giveToken}`)
    return {
      agents,
      discovered,
      token,
      agentArgs,
      settings: yield* chosenSettings(args),
      stages: Option.getOrUndefined(yield* optionalWholeNumber("stages", args.stages, 1)),
      threads: Option.getOrUndefined(yield* optionalThreads(args.threads)),
      prefillThreads: yield* optionalPrefillThreads(args.prefillThreads),
      spares: yield* checkSpares(args.spares),
      deliverWeights: args.deliverWeights,
      tokenLoop: args.tokenLoop
    }
  })

/** The pipeline's flags of run and serve once checked. */
export type CheckedPipelineFlags = Effect.Effect.Success<ReturnType<typeof checkPipelineFlags>>

/** What `node` takes of the shared flags: its threads and backend, and the links'. */
interface AgentArgs extends Flag.ArgsOf<typeof securityFlags> {
  readonly threads: Option.Option<number>
  readonly backend: Option.Option<Backend>
  readonly gpuMemory: Option.Option<number>
}

/**
 * The shared flags of `node`, checked: an agent needs the cluster token (`invited`: the one an invite holds, else
 * --token-file or the environment); its threads (none: the command decides), its backend, GPU memory and TLS mode
 * (`settings`: the Settings service the command provides).
 */
export const checkAgentFlags = (args: AgentArgs, invited?: string) =>
  Effect.gen(function* () {
    const token = invited ?? (yield* clusterToken(args.tokenFile))
    if (token === "") return yield* fail(`no cluster token: ${giveToken}`)
    const threads = Option.getOrUndefined(yield* optionalThreads(args.threads))
    const backend = yield* checkBackend(args.backend)
    yield* checkGpuMemory(args.gpuMemory, false)
    const tls = yield* tlsMode(args.tls)
    return { token, threads, backend, tls, settings: yield* chosenSettings(args) }
  })

// ---- What the checked flags ask of the pipeline.

/**
 * The stages the model is checked against and the pipeline asked for: --stages, else with remote agents none (one per
 * agent), else the local agents started (`localStages`: a fixed placement of `run` starts one per range).
 */
export const plannedStages = (flags: CheckedPipelineFlags, localStages = defaultLocalStages): number | undefined =>
  flags.stages ?? (flags.agents.length > 0 ? undefined : localStages)

/** The planned stages against the model's blocks, from its GGUF header (services/RequestChecks.ts), before any agent. */
export const checkStagesFit = (
  stages: number | undefined,
  facts: { readonly numLayers: number }
): Effect.Effect<void, UsageError> => {
  const problem = stages === undefined ? undefined : stagesProblem(stages, facts.numLayers, "--stages")
  return problem === undefined ? Effect.void : fail(problem)
}

/**
 * What the checked flags ask of the pipeline (PipelineOptions), only what differs from its defaults: the planned
 * stages, threads, prefill threads, spares, the token loop, and weight delivery (to remote agents by default; `always`
 * to local ones too; never for a dry run, which provisions nothing).
 */
export const pipelineOptionsOf = (
  flags: CheckedPipelineFlags,
  options: { readonly localStages?: number; readonly dryRun?: boolean } = {}
) => {
  const stages = plannedStages(flags, options.localStages)
  const deliver = flags.deliverWeights === "always" || (flags.deliverWeights === "auto" && flags.agents.length > 0)
  return {
    ...(stages === undefined ? {} : { stages }),
    ...(flags.threads === undefined ? {} : { threads: flags.threads }),
    ...(flags.prefillThreads === undefined ? {} : { prefillThreads: flags.prefillThreads }),
    ...(flags.spares > 0 ? { spares: flags.spares } : {}),
    ...(flags.tokenLoop === "off" ? { tokenLoop: false } : {}),
    ...(deliver && options.dryRun !== true ? { deliverWeights: true } : {})
  } satisfies Partial<PipelineOptions>
}

/** Speculative decoding's flags (run and serve; RunRequest.speculative). */
export const speculativeFlags = {
  speculative: Flag.choice("speculative", ["off", "auto", "ngram", "draft"], {
    group: "Pipeline",
    text:
      "draft tokens and verify them through the pipeline as one step (the same text), while a request is alone on " +
      "it: by prompt lookup (auto where the model's stages can roll back, ngram or refuse), or by a small model of " +
      "the same vocabulary on stage 0's node (draft, with --draft-model)"
  }).withDefault("off"),
  draftMax: Flag.integer("draft-max", {
    group: "Pipeline",
    text: "the most tokens drafted per step with --speculative (fewer while they are not kept)"
  }).withDefault(DEFAULT_MAX_DRAFT),
  draftModel: Flag.modelPath("draft-model", {
    group: "Pipeline",
    text: "--speculative draft's draft model: a small GGUF of the model's vocabulary, run whole on stage 0's node"
  }).optional()
}

/** The speculative flags as given. */
interface SpeculativeArgs {
  readonly speculative: "off" | "auto" | "ngram" | "draft"
  readonly draftMax: number
  readonly draftModel: Option.Option<string>
}

/** `--speculative draft` and `--draft-model` go together: either without the other is a usage error (one line). */
export const checkSpeculativeFlags = (args: SpeculativeArgs): Effect.Effect<void, UsageError> => {
  if (args.speculative === "draft" && Option.isNone(args.draftModel)) {
    return fail("--speculative draft needs --draft-model FILE")
  }
  if (args.speculative !== "draft" && Option.isSome(args.draftModel)) {
    return fail("--draft-model is only used with --speculative draft")
  }
  return Effect.void
}

/** What the speculative flags ask for (undefined: off). */
export const speculativeOf = (args: SpeculativeArgs): { readonly speculative?: SpeculativeOptions } =>
  args.speculative === "off"
    ? {}
    : {
        speculative: {
          mode: args.speculative,
          maxDraft: args.draftMax,
          ...(Option.isSome(args.draftModel) ? { draftModel: args.draftModel.value } : {})
        }
      }
