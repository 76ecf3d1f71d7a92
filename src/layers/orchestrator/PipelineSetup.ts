/**
 * Setting a pipeline up, once for any number of runs: validate → model facts → tokenizer → agents →
 * control links → membership pool → the orchestrator's data listener. What it returns (`WarmPipeline`)
 * lives as long as the scope it was opened in; the runs on it (RunWorld) come and go.
 */
import { isRemoteModel } from "../../domain/modelName.js"
import { Effect, ExecutionStrategy, Exit, Option, Schedule, Scope } from "effect"
import type { TransportAddress } from "../../domain/frames.js"
import { NodeId, RunId } from "../../domain/ids.js"
import type { LayerRange, ModelFacts, ModelLayout, RingSpec, SamplingPolicy } from "../../domain/plan.js"
import { ModelCatalog } from "../../services/ModelCatalog.js"
import { type AgentLink, AgentControl, DataPlane, type DataListener } from "../../services/AgentLinks.js"
import {
  Membership,
  type NodeCapacity,
  type NodeEndpoint,
  NodeUnreachable,
  type Pool
} from "../../services/Membership.js"
import {
  AgentPool,
  type AgentSet,
  InvalidRequest,
  type PipelineOptions,
  type PlacementExplanation,
  type RunUpdate,
  type SamplingOptions
} from "../../services/Orchestrator.js"
import { alignUp } from "../../domain/plan.js"
import { activationFrameBytes, planRun } from "../../services/Planner.js"
import { type ModelTokenizer, Tokenizer } from "../../services/Tokenizer.js"
import { sparesProblem, threadsProblem } from "../../services/RequestChecks.js"
import { nodesToAwait, placementFor, requestedStageCount } from "./RunPlacement.js"
import { deliverWeights } from "./WeightDelivery.js"
import { faultWords } from "./RunReport.js"

export const ORCHESTRATOR_NODE = NodeId.make(0)

const ring = (dataCapacity: number, direction: RingSpec["direction"]): RingSpec => ({
  dataCapacity,
  alignment: 64,
  direction,
  hostPinning: "Pageable",
  wakeCoalescing: "PendingBit"
})

/** The run-time settings the planner checks, from a request's numbers. */
export const samplingPolicy = (
  sampling: SamplingOptions | undefined,
  startPosition = 0,
  resume?: SamplerResume
): SamplingPolicy => {
  const s = sampling ?? {}
  const temperature = s.temperature ?? 0
  const bias = s.logitBias ?? []
  const finiteBias = bias.filter((b) => b.bias !== -Infinity)
  const banned = bias.filter((b) => b.bias === -Infinity).map((b) => b.tokenId)
  return {
    temperatureMillis: Math.round(temperature * 1000),
    topK: s.topK ?? (temperature > 0 ? 40 : 1),
    ...(s.topP === undefined ? {} : { topP: s.topP }),
    ...(s.minP === undefined ? {} : { minP: s.minP }),
    ...(s.seed === undefined ? {} : { seed: s.seed }),
    ...(startPosition === 0 ? {} : { startPosition }),
    ...(s.typicalP === undefined ? {} : { typicalP: s.typicalP }),
    ...(s.repeatPenalty === undefined ? {} : { repeatPenalty: s.repeatPenalty }),
    ...(s.presencePenalty === undefined ? {} : { presencePenalty: s.presencePenalty }),
    ...(s.frequencyPenalty === undefined ? {} : { frequencyPenalty: s.frequencyPenalty }),
    ...(s.penaltyLastN === undefined ? {} : { penaltyLastN: s.penaltyLastN }),
    ...(s.dry === undefined
      ? {}
      : {
          dry: {
            multiplier: s.dry.multiplier,
            base: s.dry.base ?? 1.75,
            allowedLength: s.dry.allowedLength ?? 2,
            penaltyLastN: s.dry.penaltyLastN ?? -1,
            sequenceBreakers: s.dry.sequenceBreakers ?? ["\n", ":", '"', "*"]
          }
        }),
    ...(s.xtc === undefined ? {} : { xtc: { probability: s.xtc.probability, threshold: s.xtc.threshold } }),
    ...(finiteBias.length === 0 ? {} : { logitBias: finiteBias.map((b) => ({ tokenId: b.tokenId, bias: b.bias })) }),
    ...(banned.length === 0 ? {} : { bannedTokens: banned }),
    ...(s.grammar === undefined ? {} : { grammar: { text: s.grammar.text, root: s.grammar.root ?? "root" } }),
    ...(s.logprobs === undefined ? {} : { logprobs: s.logprobs }),
    ...(resume === undefined || (resume.tokens.length === 0 && resume.draws === 0) ? {} : { resume })
  }
}

/** What a resumed generation's sampler needs: the tokens produced so far and the random draws made for them. */
export interface SamplerResume {
  readonly tokens: ReadonlyArray<number>
  readonly draws: number
}

/** The planner's input for one run over `placement`. */
export const plannerInput = (
  facts: ModelFacts,
  runId: RunId,
  candidatePool: ReadonlyArray<NodeId>,
  placement: ReadonlyArray<{ readonly stageIndex: number; readonly nodeId: NodeId }>,
  runtime: {
    readonly maxTokens: number
    readonly sampling: SamplingOptions | undefined
    /** Tokens a resumed generation already produced: the sampler's first draw position. */
    readonly startPosition?: number
    readonly resume?: SamplerResume
  },
  layerRanges?: ReadonlyArray<LayerRange>
) => {
  const activationBytes = activationFrameBytes(facts, 64)
  return {
    runId,
    orchestratorNodeId: ORCHESTRATOR_NODE,
    model: facts,
    runtime: {
      maxTokens: runtime.maxTokens,
      sampling: samplingPolicy(runtime.sampling, runtime.startPosition ?? 0, runtime.resume),
      // the replayed tokens run one per forward on every stage, as they were decoded (RuntimeConfig.replayTail)
      ...(runtime.resume === undefined || runtime.resume.tokens.length === 0
        ? {}
        : { replayTail: runtime.resume.tokens.length })
    },
    candidatePool,
    stageCount: placement.length,
    placement: { _tag: "FixedLinear" as const, stages: placement },
    ...(layerRanges === undefined ? {} : { layerRanges }),
    activationRing: ring(Math.max(4 << 20, alignUp(activationBytes * 64, 64)), "Egress"),
    tokenRing: ring(64 << 10, "Egress")
  }
}

/** A pipeline ready for runs (see `openPipeline`). */
/**
 * Whether agents are sent (or fetch) their stages' weights, and how: when asked, and always for a hub model (`hf:`, a
 * URL), which is never read at a path.
 */
export const deliverySettings = (
  options: PipelineOptions
): { readonly outgoingDir?: string; readonly chunkBytes?: number } | undefined => {
  const asked = options.deliverWeights
  if (asked !== undefined && asked !== false) return asked === true ? {} : asked
  return isRemoteModel(options.model) ? {} : undefined
}

export interface WarmPipeline {
  readonly options: PipelineOptions
  readonly facts: ModelFacts
  readonly vocabulary: ModelTokenizer
  readonly agents: AgentSet
  readonly stageCount: number
  readonly placement: ReadonlyArray<{ readonly stageIndex: number; readonly nodeId: NodeId }>
  /** Each stage's block range, chosen once (the agents' cached weights are these ranges). */
  readonly layerRanges: ReadonlyArray<LayerRange>
  /** The model's per-block bytes (placement's costs; recovery checks survivors' memory with them). */
  readonly layout: ModelLayout
  /** KV cells per block placement budgeted for. */
  readonly contextTokens: number
  /** Why this placement (for `--dry-run` and the Planned update). */
  readonly placementExplanation: PlacementExplanation
  readonly linkOf: (nodeId: number) => AgentLink
  readonly addressOf: (nodeId: number) => string
  readonly dataAddressOf: (nodeId: number) => TransportAddress
  readonly pool: Pool
  /** What each needed node reported when the pool became ready. */
  readonly capacity: ReadonlyArray<{ readonly node: NodeEndpoint; readonly capacity: NodeCapacity }>
  /** Where the last stage of every run sends its sampled tokens. */
  readonly listener: DataListener
  /** Runs on this pipeline now (each attempt of each request, from its plan to its end). */
  readonly activeRuns: { count: number }
}

/** The options' own numbers checked (max tokens, stages, threads); the max tokens to plan with. */
const checkPipelineOptions = (options: PipelineOptions) =>
  Effect.gen(function* () {
    const maxTokens = options.maxTokens ?? 1
    if (!Number.isSafeInteger(maxTokens) || maxTokens < 1) {
      return yield* new InvalidRequest({ message: `max tokens must be a positive whole number, got ${maxTokens}` })
    }
    if (options.stages !== undefined && (!Number.isSafeInteger(options.stages) || options.stages < 1)) {
      return yield* new InvalidRequest({ message: `stages must be a positive whole number, got ${options.stages}` })
    }
    if (options.threads !== undefined) {
      const problem = threadsProblem(options.threads)
      if (problem !== undefined) return yield* new InvalidRequest({ message: problem })
    }
    return maxTokens
  })

/** Rejects what no placement can fix (too many stages, bad max tokens, ...) before starting any agent. */
const precheckStages = (facts: ModelFacts, stages: number | undefined, maxTokens: number) =>
  Effect.gen(function* () {
    if (stages === undefined) return
    const ids = Array.from({ length: stages }, (_, i) => NodeId.make(i + 1))
    yield* planRun(
      plannerInput(
        facts,
        RunId.make(1),
        ids,
        ids.map((nodeId, stageIndex) => ({ stageIndex, nodeId })),
        {
          maxTokens,
          sampling: undefined
        }
      )
    )
  })

/** A control link to every agent, by node id. */
const connectAgents = (agents: AgentSet) =>
  Effect.gen(function* () {
    const control = yield* AgentControl
    const links = new Map<number, AgentLink>()
    yield* Effect.forEach(
      agents.nodes,
      (node) =>
        control.connect(node, agents.token).pipe(Effect.tap((link) => Effect.sync(() => links.set(node.nodeId, link)))),
      {
        concurrency: "unbounded",
        discard: true
      }
    )
    return links
  })

/**
 * A lost node that answers again at its address (restarted there) rejoins: a new control link, heartbeats
 * resume, and the next run may plan on it. One look at the pool.
 */
const rejoinLost = (pool: Pool, agents: AgentSet, links: Map<number, AgentLink>, pipelineScope: Scope.Scope) =>
  Effect.gen(function* () {
    const control = yield* AgentControl
    const status = yield* pool.status
    for (const node of agents.nodes) {
      if (status.get(node.nodeId)?._tag !== "Lost") continue
      const attempt = yield* Scope.fork(pipelineScope, ExecutionStrategy.sequential)
      const link = yield* control
        .connect(node, agents.token)
        .pipe(Scope.extend(attempt), Effect.timeout("2 seconds"), Effect.option)
      if (Option.isNone(link)) {
        yield* Scope.close(attempt, Exit.void)
        continue
      }
      links.set(node.nodeId, link.value)
      yield* pool.rejoin(node.nodeId)
    }
  })

/** The membership pool of the agents: heartbeats over their links, lost nodes rejoining, exited agents lost. */
const watchAgents = (options: PipelineOptions, agents: AgentSet, links: Map<number, AgentLink>) =>
  Effect.gen(function* () {
    const membership = yield* Membership
    // A dropped control connection is noticed at once; the deadline covers a node that hangs (or a long load that blocks it).
    const heartbeat = options.heartbeat ?? { interval: "1 second", deadline: "10 seconds" }
    const pool = yield* membership.watch(
      agents.nodes,
      {
        probe: (node) =>
          links
            .get(node.nodeId)!
            .capacity.pipe(
              Effect.mapError(
                (e) => new NodeUnreachable({ nodeId: node.nodeId, address: node.address, message: e.message })
              )
            )
      },
      heartbeat
    )
    // A lost node that answers again at its address (restarted there) rejoins: a new control link, heartbeats
    // resume, and the next run may plan on it.
    const pipelineScope = yield* Effect.scope
    yield* rejoinLost(pool, agents, links, pipelineScope).pipe(
      Effect.repeat(Schedule.spaced(heartbeat.interval)),
      Effect.forkScoped
    )
    // An agent process seen to exit is lost at once (local agents), whatever run is going on.
    yield* agents.exited.pipe(
      Effect.flatMap(({ node, reason }) => pool.markLost(node.nodeId, reason)),
      Effect.forkScoped
    )
    return pool
  })

/** Waits for the nodes the placement needs to report ready; what every node reported. */
const awaitNodes = (
  options: PipelineOptions,
  agents: AgentSet,
  pool: Pool,
  stageCount: number,
  progress: (update: RunUpdate) => Effect.Effect<void>
) =>
  Effect.gen(function* () {
    const neededNodes = nodesToAwait(options.placement, agents.nodes, stageCount)
    const reported = yield* pool.awaitReady(neededNodes, options.readinessTimeout ?? "120 seconds")
    const capacity = agents.nodes.flatMap((node) => {
      const c = reported.get(node.nodeId)
      return c === undefined ? [] : [{ node, capacity: c }]
    })
    yield* progress({ _tag: "PoolReady", nodes: agents.nodes, capacity })
    return { reported, capacity }
  })

/** Local data endpoint: the last stage of every run sends sampled tokens here. */
const openTokenListener = (agents: AgentSet) =>
  Effect.gen(function* () {
    const dataPlane = yield* DataPlane
    return yield* dataPlane
      .listen(agents.dataListen ?? { _tag: "Tcp", host: agents.listenHost, port: 0 }, agents.token)
      .pipe(
        Effect.mapError(
          (fault) =>
            new InvalidRequest({ message: `cannot open the orchestrator's data listener: ${faultWords(fault)}` })
        )
      )
  })

/** Sets the pipeline up; its agents, links, heartbeats and listener live until the scope closes. */
export const openPipeline = (
  options: PipelineOptions,
  progress: (update: RunUpdate) => Effect.Effect<void>,
  /** The caller's own checks against the model (a run's prompt and max tokens), before any agent starts. */
  precheck: (facts: ModelFacts, vocabulary: ModelTokenizer) => Effect.Effect<void, InvalidRequest> = () => Effect.void
) =>
  Effect.gen(function* () {
    const tokenizer = yield* Tokenizer
    const agentPool = yield* AgentPool
    const catalog = yield* ModelCatalog

    const maxTokens = yield* checkPipelineOptions(options)
    const facts = yield* catalog.facts(options.model)
    const vocabulary = yield* tokenizer.open(options.model)
    yield* precheck(facts, vocabulary)
    // Reject what no placement can fix (too many stages, bad max tokens, ...) before starting any agent.
    yield* precheckStages(facts, options.stages, maxTokens)

    const spares = options.spares ?? 0
    const badSpares = sparesProblem(spares)
    if (badSpares !== undefined) return yield* new InvalidRequest({ message: badSpares })
    const agents = yield* agentPool.acquire(options.stages, spares)
    const stageCount = requestedStageCount(
      options.placement,
      options.stages ?? Math.max(1, agents.nodes.length - spares)
    )
    yield* progress({ _tag: "AgentsStarted", nodes: agents.nodes })
    const links = yield* connectAgents(agents)
    const linkOf = (nodeId: number) => links.get(nodeId)!
    const addressOf = (nodeId: number) =>
      nodeId === ORCHESTRATOR_NODE
        ? "orchestrator"
        : (agents.nodes.find((n) => n.nodeId === nodeId)?.address ?? `node ${nodeId}`)
    const pool = yield* watchAgents(options, agents, links)
    const { reported, capacity } = yield* awaitNodes(options, agents, pool, stageCount, progress)
    // Which node hosts which blocks, by the request's intent within each node's reported memory.
    const contextTokens = Math.min(facts.maxSeqLen, options.contextTokens ?? alignUp((options.maxTokens ?? 1) + 1, 256))
    const placed = yield* placementFor({
      request: options.placement,
      layout: yield* catalog.layout(options.model),
      nodes: agents.nodes,
      capacity: reported,
      stageCount,
      contextTokens,
      modelContext: facts.maxSeqLen
    })

    // Agents that lack their stages' tensors receive them as GGUF slices (when asked: local agents share the file).
    const delivery = deliverySettings(options)
    if (delivery !== undefined) {
      yield* deliverWeights(
        { ...delivery, modelPath: options.model, placement: placed.stages, layerRanges: placed.layerRanges, linkOf },
        progress
      )
    }
    const listener = yield* openTokenListener(agents)
    return {
      options,
      facts,
      vocabulary,
      agents,
      stageCount: placed.stages.length,
      placement: placed.stages,
      layerRanges: placed.layerRanges,
      layout: placed.layout,
      contextTokens,
      placementExplanation: placed.explanation,
      linkOf,
      addressOf,
      dataAddressOf: (nodeId: number) => linkOf(nodeId).hello.dataAddress,
      pool,
      capacity,
      listener,
      activeRuns: { count: 0 }
    } satisfies WarmPipeline
  })
