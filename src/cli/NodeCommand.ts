/**
 * `swactor node`: a node agent. Hosts stages for any orchestrator that proves the cluster token
 * (SWACTOR_CLUSTER_TOKEN or --token-file), binds 127.0.0.1 unless told otherwise, and prints
 * `swactor-node-ready {...}` on stdout once it listens.
 */
import * as Command from "@effect/cli/Command"
import * as Os from "node:os"
import { Console, Data, Effect, Either, Layer, Option, Redacted } from "effect"
import type { CachedSlice, NodeResources } from "../domain/discovery.js"
import { decodeInvite, INVITE_PREFIX, looksLikeInvite } from "../domain/invite.js"
import type { TransportAddress } from "../domain/frames.js"
import * as AgentLinksLive from "../layers/agent/AgentLinksLive.js"
import { formatAddress, parseAddress } from "../layers/agent/AgentControlRpc.js"
import { announceReady, watchParentPipe } from "../layers/agent/ReadyLine.js"
import { makeAnnouncer } from "../layers/discovery/Announcer.js"
import { makeDiscoveryListener } from "../layers/discovery/DiscoveryListener.js"
import { ephemeralNodeId, persistentNodeId } from "../layers/discovery/NodeIdentity.js"
import { heldSlices } from "../layers/gguf/SliceCache.js"
import { defaultSliceCacheDir } from "../layers/gguf/SliceStore.js"
import { measureSpeed } from "../layers/engine/SpeedProbe.js"
import { getGgml } from "../layers/ggml/Bindings.js"
import { type NodeAgentOptions, startNodeAgent } from "../layers/agent/NodeAgent.js"
import * as StageExecutorLive from "../layers/engine/StageExecutorLive.js"
import { layerSlowed } from "../layers/engine/StageExecutorSlowed.js"
import { type AgentHooks, Settings, type SettingsValues } from "../layers/config/Settings.js"
import * as StageExecutorTest from "../layers/engine/StageExecutorTest.js"
import type { StageExecutor } from "../services/StageExecutor.js"
import { clusterTokenProblem, maxThreads } from "../services/RequestChecks.js"
import * as Flag from "./FlagSpec.js"
import { commandDoc, optionsOf } from "./FlagSpec.js"
import { backendFlag, checkAgentFlags, gpuMemoryFlag, securityFlags, threadsFlag } from "./PipelineFlags.js"
import { untilOperatorStop } from "./Signals.js"

export class NodeUsageError extends Data.TaggedError("NodeUsageError")<{ readonly message: string }> {}

/** How long after its ready line an agent started with `--speed-probe after-ready` measures its speed. */
const laterProbeDelay = "2 seconds"

/** The stage executor an agent runs stages with, per `--engine`. */
export type StageExecutorFor = (engine: NodeArgs["engine"]) => Layer.Layer<StageExecutor>

/** ggml (`live`), or the deterministic double (`test`). */
export const stageExecutorFor: StageExecutorFor = (engine) =>
  engine === "test" ? StageExecutorTest.layer : StageExecutorLive.layer

const address = (text: string, flag: string): Effect.Effect<TransportAddress, NodeUsageError> => {
  const parsed = parseAddress(text)
  return parsed === undefined
    ? Effect.fail(new NodeUsageError({ message: `--${flag}: "${text}" is not host:port or a socket path` }))
    : Effect.succeed(parsed)
}

/** What the flags of `swactor node` parse into. */
export type NodeArgs = Flag.ArgsOf<typeof nodeFlags>

/** `swactor node` until an operator stops it (SIGINT/SIGTERM/SIGHUP: every hosted stage stopped, then exit 128+n). */
export const runNodeCommand = (args: NodeArgs, executorFor: StageExecutorFor = stageExecutorFor) =>
  untilOperatorStop(runNode(args, executorFor), {
    stdoutClosedStops: false,
    onStop: (stop) => (stop._tag === "Signal" ? Console.error(`swactor node: stopped by ${stop.signal}`) : Effect.void)
  })

/**
 * `--join`: host:port, or an invite (src/domain/invite.ts) whose token is then the node's. A malformed invite, or one
 * with a weak token, is refused in one line that never quotes it.
 */
const checkJoin = (args: NodeArgs): Effect.Effect<{ target?: string; token?: string }, NodeUsageError> => {
  if (Option.isNone(args.join)) return Effect.succeed({})
  const refuse = (message: string) => Effect.fail(new NodeUsageError({ message: `--join: ${message}` }))
  if (args.announce === "off") return refuse("a node that joins announces itself: drop --announce off")
  const text = args.join.value.trim()
  if (!looksLikeInvite(text)) {
    const parsed = parseAddress(text)
    return parsed?._tag === "Tcp" && parsed.port !== 0
      ? Effect.succeed({ target: formatAddress(parsed) })
      : refuse(`not host:port nor an invite (${INVITE_PREFIX}...)`)
  }
  return Either.match(decodeInvite(text), {
    onLeft: (why) => refuse(`not a valid invite: ${why}`),
    onRight: (invite) => {
      const weak = clusterTokenProblem(invite.token, "the invite")
      return weak === undefined ? Effect.succeed({ target: invite.address, token: invite.token }) : refuse(weak)
    }
  })
}

/** The flags of `node`, checked: the shared ones (cli/PipelineFlags.ts), then its addresses, memory limit and speed. */
const checkNodeFlags = (args: NodeArgs) =>
  Effect.gen(function* () {
    const join = yield* checkJoin(args)
    const shared = yield* checkAgentFlags(args, join.token)
    const listen = yield* address(args.listen, "listen")
    const dataListen = Option.isSome(args.dataListen) ? yield* address(args.dataListen.value, "data-listen") : undefined
    const dataAdvertise = Option.isSome(args.dataAdvertise)
      ? yield* address(args.dataAdvertise.value, "data-advertise")
      : undefined
    const memoryLimitBytes = Option.getOrUndefined(args.memoryLimit)
    const speedBytesPerSecond = Option.getOrUndefined(args.speed)
    if (memoryLimitBytes !== undefined && !(memoryLimitBytes > 0)) {
      return yield* new NodeUsageError({
        message: `--memory-limit: ${memoryLimitBytes} is not a positive number of bytes`
      })
    }
    if (speedBytesPerSecond !== undefined && !(speedBytesPerSecond > 0 && Number.isFinite(speedBytesPerSecond))) {
      return yield* new NodeUsageError({
        message: `--speed: ${speedBytesPerSecond} is not a positive bytes-per-second figure`
      })
    }
    const threads = shared.threads ?? Math.min(maxThreads, Math.max(1, Os.availableParallelism()))
    const joinTarget = join.target
    return { ...shared, threads, listen, dataListen, dataAdvertise, memoryLimitBytes, speedBytesPerSecond, joinTarget }
  })

type CheckedNodeFlags = Effect.Effect.Success<ReturnType<typeof checkNodeFlags>>

type Speed = Pick<NodeAgentOptions, "speedBytesPerSecond" | "speedSource">

/** The engine's speed now (a short timed ggml matrix product), slowed by the bench hook; none when it fails. */
const measuredSpeed = (threads: number, settings: SettingsValues): Effect.Effect<number | undefined> =>
  Effect.tryPromise(() =>
    measureSpeed({ threads, ggml: settings }).then((measured) => measured / settings.agentHooks.slowdown)
  ).pipe(
    Effect.catchAll((error) =>
      Console.error(
        `swactor node: could not measure the engine's speed (${String(error)}); placement assumes 1 GB/s`
      ).pipe(Effect.as(undefined))
    )
  )

/** Placement's speed at start: declared, or measured with the live engine (none with the test one, or measured later). */
const speedAtStart = (
  args: NodeArgs,
  flags: CheckedNodeFlags,
  probeLater: boolean
): Effect.Effect<Speed | undefined> =>
  flags.speedBytesPerSecond !== undefined
    ? Effect.succeed({ speedBytesPerSecond: flags.speedBytesPerSecond, speedSource: "declared" })
    : args.engine === "live" && !probeLater
      ? measuredSpeed(flags.threads, flags.settings).pipe(
          Effect.map((measured) =>
            measured === undefined ? undefined : { speedBytesPerSecond: measured, speedSource: "measured" as const }
          )
        )
      : Effect.succeed(undefined)

/**
 * The live engine's ggml devices now, each GPU with the node's `--gpu-memory` when set; none when its libraries
 * cannot be loaded (a stage load then says why).
 */
const liveDevices = (settings: SettingsValues) => () => {
  try {
    const limit = settings.gpuMemory
    return getGgml(settings)
      .devices()
      .map((d) => (limit !== undefined && (d.kind === "gpu" || d.kind === "igpu") ? { ...d, limitBytes: limit } : d))
  } catch {
    return []
  }
}

/** What the agent is started with: the checked flags, the tuning hooks, its speed. */
const agentOptions = (
  args: NodeArgs,
  flags: CheckedNodeFlags,
  hooks: AgentHooks,
  speed: Speed | undefined,
  laterSpeed: NodeAgentOptions["laterSpeed"]
): NodeAgentOptions => ({
  listen: flags.listen,
  ...(flags.dataListen === undefined ? {} : { dataListen: flags.dataListen }),
  ...(flags.dataAdvertise === undefined ? {} : { dataAdvertise: flags.dataAdvertise }),
  token: flags.token,
  threads: flags.threads,
  backend: flags.backend,
  ...(hooks.batchMaxRows === undefined && hooks.prefillChunk === undefined
    ? {}
    : {
        batch: {
          ...(hooks.batchMaxRows === undefined ? {} : { maxRows: hooks.batchMaxRows }),
          ...(hooks.prefillChunk === undefined ? {} : { prefillChunk: hooks.prefillChunk })
        }
      }),
  ...(hooks.settleWeights === "auto" ? {} : { settleWeights: hooks.settleWeights }),
  ...(Option.isSome(args.cacheDir) ? { cacheDir: args.cacheDir.value } : {}),
  ...(args.slicesOnly ? { slicesOnly: true } : {}),
  log: (line: string) => void process.stderr.write(`swactor node: ${line}\n`),
  ...(flags.memoryLimitBytes === undefined ? {} : { memoryLimitBytes: flags.memoryLimitBytes }),
  ...(speed === undefined ? {} : speed),
  ...(laterSpeed === undefined ? {} : { laterSpeed }),
  // the real engine's step costs by rows decide the decode micro-batch size (StepCosts.ts); its devices are reported
  ...(args.engine === "live" ? { stepProbeRows: 8, devices: liveDevices(flags.settings) } : {})
})

/**
 * What the node offers, for its announcements: memory (within --memory-limit), cores, backend, its GPU's memory, and
 * the slices its cache holds (`cached()`: the latest listing).
 */
const resourcesOf =
  (flags: CheckedNodeFlags, options: NodeAgentOptions, cached: () => ReadonlyArray<CachedSlice>) =>
  (): NodeResources => {
    const gpu = options.devices?.().find((d) => d.kind === "gpu" || d.kind === "igpu")
    const slices = cached()
    return {
      totalMemoryBytes: Os.totalmem(),
      freeMemoryBytes: Math.min(Os.freemem(), flags.memoryLimitBytes ?? Number.POSITIVE_INFINITY),
      cores: Os.availableParallelism(),
      backend: flags.backend,
      ...(gpu === undefined ? {} : { gpuTotalBytes: gpu.totalBytes, gpuFreeBytes: gpu.limitBytes ?? gpu.freeBytes }),
      ...(slices.length === 0 ? {} : { cached: slices })
    }
  }

/** How often a node lists its slice cache again for its announcements. */
const CACHE_LISTING_MILLIS = 10_000

/** The node's slice cache listed now and every CACHE_LISTING_MILLIS until the scope closes; the latest listing. */
const watchCachedSlices = (flags: CheckedNodeFlags, options: NodeAgentOptions) =>
  Effect.gen(function* () {
    const dir = options.cacheDir ?? defaultSliceCacheDir(flags.settings.cacheDir)
    let latest: ReadonlyArray<CachedSlice> = yield* heldSlices(dir)
    yield* heldSlices(dir).pipe(
      Effect.tap((slices) => Effect.sync(() => (latest = slices))),
      Effect.delay(CACHE_LISTING_MILLIS),
      Effect.forever,
      Effect.forkScoped
    )
    return () => latest
  })

/**
 * `--announce on`: the node announces itself (src/layers/discovery/Announcer.ts) with its id (persistent per control
 * port; fresh on an ephemeral port: src/layers/discovery/NodeIdentity.ts), its control
 * address and its resources, until it stops (then its leave): on the LAN's interfaces, or on loopback only when it
 * listens on a loopback address (only this host reaches it). A control address that is a Unix socket is not announced.
 */
const announceNode = (flags: CheckedNodeFlags, options: NodeAgentOptions, control: TransportAddress) =>
  Effect.gen(function* () {
    if (control._tag !== "Tcp") return
    const requested = flags.listen._tag === "Tcp" ? flags.listen.port : 0
    const nodeId =
      requested === 0
        ? ephemeralNodeId()
        : yield* persistentNodeId(flags.settings.stateDir, `node-${requested}.id`).pipe(
            Effect.mapError((error) => new NodeUsageError({ message: `its node id: ${error.message}` }))
          )
    const loopback = control.host === "localhost" || control.host === "::1" || control.host.startsWith("127.")
    const interfaces = loopback ? { loopbackOnly: true } : undefined
    const token = Redacted.make(flags.token)
    const announcer = yield* makeAnnouncer({
      token,
      nodeId,
      address: formatAddress(control),
      resources: resourcesOf(flags, options, yield* watchCachedSlices(flags, options)),
      interfaces,
      port: flags.settings.discoveryPort,
      targets: flags.joinTarget === undefined ? undefined : [flags.joinTarget]
    })
    yield* Console.error(
      `swactor node: announcing node ${nodeId} on UDP port ${flags.settings.discoveryPort}` +
        (loopback ? " (loopback only: it listens on a loopback address)" : "") +
        (flags.joinTarget === undefined ? "" : `, and to ${flags.joinTarget} (--join)`)
    )
    yield* relayJoins(flags, interfaces, token, announcer.relay)
  })

/**
 * Every announcing node listens on the discovery port too, so that a node can `--join` through it: a join it hears
 * (proved with the token) is relayed onto its LAN, where orchestrators hear it as from the joiner. A port that cannot
 * be bound only means no relaying (one line says so).
 */
const relayJoins = (
  flags: CheckedNodeFlags,
  interfaces: { loopbackOnly: boolean } | undefined,
  token: Redacted.Redacted<string>,
  relay: (message: Buffer) => Effect.Effect<void>
) =>
  makeDiscoveryListener({ token, port: flags.settings.discoveryPort, interfaces, relay }).pipe(
    Effect.catchAll((error) =>
      Console.error(
        `swactor node: not relaying joins: cannot listen on UDP port ${flags.settings.discoveryPort}: ${error.message}`
      )
    )
  )

/**
 * The agent, from its ready line until stopped: its speed measured after the ready line when asked (`laterSpeed`),
 * one start line on stderr.
 */
const hostStages = (args: NodeArgs, flags: CheckedNodeFlags, options: NodeAgentOptions) =>
  Effect.gen(function* () {
    const agent = yield* startNodeAgent(options)
    watchParentPipe(flags.settings.watchesParent, () => process.exit(0))
    if (agent.control._tag === "Tcp") announceReady(agent.control.host, agent.control.port, agent.data)
    const laterSpeed = options.laterSpeed
    if (laterSpeed !== undefined) {
      // Not at once: right after the ready line come the stage's load and the prompt's prefill, and on a machine
      // with few cores a probe then (~0.1 s of every core it is given) would delay the run's first token.
      yield* Effect.forkScoped(
        measuredSpeed(flags.threads, flags.settings).pipe(
          Effect.delay(laterProbeDelay),
          Effect.tap((measured) => Effect.sync(() => (laterSpeed.current = measured)))
        )
      )
    }
    if (args.announce === "on") yield* announceNode(flags, options, agent.control)
    const speed = options.speedBytesPerSecond
    yield* Console.error(
      `swactor node: control ${formatAddress(agent.control)}, data ${formatAddress(agent.data)}, ` +
        `${flags.threads} threads, ${flags.backend} backend, ${args.engine} engine` +
        (speed === undefined ? "" : `, ${(speed / 1e9).toFixed(2)} GB/s ${options.speedSource}`) +
        `, TLS ${flags.tls}` +
        ` (pid ${process.pid})`
    )
    return yield* Effect.never
  }).pipe(Effect.scoped)

const runNode = (args: NodeArgs, executorFor: StageExecutorFor) =>
  Effect.gen(function* () {
    const flags = yield* checkNodeFlags(args)
    // Tuning and bench hooks, resolved once (config/Settings.ts): SWACTOR_BENCH_SLOWDOWN=k makes this agent's engine
    // k times slower and divides its measured speed by k (StageExecutorSlowed.ts; bench:cluster's throttled node).
    const hooks = flags.settings.agentHooks
    // after-ready (local agents of `swactor run`): the agent announces itself first and reports no speed (placement's
    // default) until the probe has run, so the probe is not on the run's start-up path.
    const probeLater =
      flags.speedBytesPerSecond === undefined && args.engine === "live" && args.speedProbe === "after-ready"
    const speed = yield* speedAtStart(args, flags, probeLater)
    const options = agentOptions(args, flags, hooks, speed, probeLater ? { current: undefined } : undefined)
    const engine = executorFor(args.engine)
    const executor = hooks.slowdown > 1 ? layerSlowed(hooks.slowdown).pipe(Layer.provide(engine)) : engine
    yield* hostStages(args, flags, options).pipe(
      Effect.provide(Layer.mergeAll(executor, AgentLinksLive.layerDataPlane)),
      Effect.provideService(Settings, flags.settings)
    )
  }).pipe(
    Effect.tapError((error) =>
      Console.error(`swactor node: ${"message" in error && error.message !== "" ? error.message : String(error)}`)
    )
  )

const network = "Network and security"
const engineGroup = "Engine"

/** The flags of `swactor node`: what they parse into and what `--help` says of them. */
const nodeFlags = {
  listen: Flag.text("listen", {
    group: network,
    value: "HOST:PORT",
    text: "control address (0.0.0.0:PORT serves other machines)"
  }).withDefault("127.0.0.1:7070"),
  dataListen: Flag.text("data-listen", {
    group: network,
    value: "ADDRESS",
    text: "data-plane address, host:port or a Unix socket path"
  }).optional("the control host, any port"),
  dataAdvertise: Flag.text("data-advertise", {
    group: network,
    value: "ADDRESS",
    text: "data address to tell orchestrators, when it differs from the bound one (NAT, proxies)"
  }).optional(),
  ...securityFlags,
  threads: threadsFlag(engineGroup),
  backend: backendFlag(engineGroup, ""),
  gpuMemory: gpuMemoryFlag(engineGroup, ""),
  memoryLimit: Flag.integer("memory-limit", {
    group: engineGroup,
    value: "BYTES",
    text: "report at most this much free memory (placement keeps within it)"
  }).optional(),
  speed: Flag.float("speed", {
    group: engineGroup,
    value: "BYTES/S",
    text: "declared engine speed in weight bytes per second, for placement"
  }).optional("measured at start"),
  speedProbe: Flag.choice("speed-probe", ["start", "after-ready"], {
    group: engineGroup,
    text: `measure the engine's speed before announcing ready (start) or ${laterProbeDelay} after (after-ready)`
  }).withDefault("start"),
  engine: Flag.choice("engine", ["live", "test"], {
    group: engineGroup,
    text: "stage engine: live (ggml) or test (a deterministic double, for tests)"
  }).withDefault("live"),
  cacheDir: Flag.text("cache-dir", {
    group: "Weights",
    value: "DIR",
    text: "where weight slices delivered by orchestrators are kept"
  }).optional("$XDG_CACHE_HOME/swactor/slices"),
  announce: Flag.choice("announce", ["on", "off"], {
    group: network,
    text: "announce this node (id, control address, resources, proved with the cluster token) for --discover"
  }).withDefault("on"),
  join: Flag.text("join", {
    group: network,
    value: "HOST:PORT|INVITE",
    text: "also announce by unicast to an orchestrator's or a pool node's discovery port (networks that drop multicast); an invite (swactor invite) holds the token too"
  }).optional(),
  slicesOnly: Flag.boolean("slices-only", {
    group: "Weights",
    text: "never read the orchestrator's model paths here: load only the slices it delivers"
  })
}

/** What `swactor node --help` says. */
export const nodeDoc = commandDoc(
  "node",
  "Run a node agent that hosts pipeline stages for orchestrators with the cluster token",
  [network, engineGroup, "Weights"],
  nodeFlags,
  [
    {
      what: "an agent other machines reach, the cluster token in a file (openssl rand -hex 32 > token)",
      command: "swactor node --listen 0.0.0.0:7070 --token-file token"
    },
    {
      what: "a node joining through an invite (swactor invite, or the line swactor serve --discover prints)",
      command: "swactor node --listen 0.0.0.0:7070 --join swactor1:..."
    }
  ]
)

/** `swactor node` over the given stage executors (tests start agents with doubles: test/support/agentEntry.ts). */
export const makeNodeCommand = (executorFor: StageExecutorFor = stageExecutorFor) =>
  Command.make("node", optionsOf(nodeFlags), (args) => runNodeCommand(args, executorFor)).pipe(
    Command.withDescription(nodeDoc.summary)
  )

export const nodeCommand = makeNodeCommand()
