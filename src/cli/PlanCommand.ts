/**
 * `swactor plan`: forms a run plan from the command line and prints it as a table, or prints the typed rejection in
 * words and exits non-zero.
 */
import * as Command from "@effect/cli/Command"
import { Console, Data, Effect, Option } from "effect"
import type { ModelLoadError } from "../domain/gguf.js"
import { type NodeId, RunId } from "../domain/ids.js"
import type { DTypeFamily, Edge, EdgeEndpoint, ModelFacts, PlannerInput, RingSpec, RunPlan } from "../domain/plan.js"
import type { PlanRejection } from "../domain/planErrors.js"
import * as ModelCatalogLive from "../layers/gguf/ModelCatalogLive.js"
import { ModelCatalog } from "../services/ModelCatalog.js"
import { planRun } from "../services/Planner.js"
import * as Flag from "./FlagSpec.js"
import { commandDoc, optionsOf } from "./FlagSpec.js"

/** Bad command-line input (before planning). */
export class PlanUsageError extends Data.TaggedError("PlanUsageError")<{ readonly message: string }> {}

export interface PlanArgs {
  readonly layers: Option.Option<number>
  readonly model: Option.Option<string>
  readonly stages: number
  readonly nodes: string
  readonly pool: Option.Option<string>
  readonly orchestrator: number
  readonly runId: number
  readonly maxTokens: number
  readonly hiddenDim: number
  readonly maxSeqLen: number
  readonly dtype: "f32" | "f16" | "bf16"
  readonly activationRingBytes: number
  readonly tokenRingBytes: number
  readonly alignment: number
}

const DTYPES: Record<PlanArgs["dtype"], readonly [DTypeFamily, number]> = {
  f32: ["Float", 4],
  f16: ["Half", 2],
  bf16: ["BFloat", 2]
}

/** Parses "10,11,12" into node ids. */
export const parseNodeList = (text: string, flag: string): Effect.Effect<ReadonlyArray<NodeId>, PlanUsageError> => {
  const parts = text
    .split(",")
    .map((p) => p.trim())
    .filter((p) => p.length > 0)
  const bad = parts.find((p) => !/^\d+$/.test(p) || !Number.isSafeInteger(Number(p)))
  if (bad !== undefined) {
    return Effect.fail(new PlanUsageError({ message: `--${flag}: "${bad}" is not a node id (a whole number >= 0)` }))
  }
  if (parts.length === 0) return Effect.fail(new PlanUsageError({ message: `--${flag} lists no nodes` }))
  return Effect.succeed(parts.map((p) => Number(p) as NodeId))
}

const modelFactsFromGguf = (
  path: string,
  dtype: PlanArgs["dtype"]
): Effect.Effect<ModelFacts, ModelLoadError, ModelCatalog> =>
  Effect.gen(function* () {
    const facts = yield* (yield* ModelCatalog).facts(path)
    const [dtypeFamily, dtypeWidthBytes] = DTYPES[dtype]
    return { ...facts, dtypeFamily, dtypeWidthBytes }
  })

/** Builds the planner input the command line describes. */
export const plannerInputFromArgs = (
  args: PlanArgs
): Effect.Effect<PlannerInput, PlanUsageError | ModelLoadError, ModelCatalog> =>
  Effect.gen(function* () {
    const nodes = yield* parseNodeList(args.nodes, "nodes")
    const pool = Option.isSome(args.pool) ? yield* parseNodeList(args.pool.value, "pool") : [...new Set(nodes)]
    const [dtypeFamily, dtypeWidthBytes] = DTYPES[args.dtype]
    let model: ModelFacts
    if (Option.isSome(args.model)) {
      model = yield* modelFactsFromGguf(args.model.value, args.dtype)
      if (Option.isSome(args.layers) && args.layers.value !== model.numLayers) {
        return yield* new PlanUsageError({
          message: `--layers ${args.layers.value} disagrees with ${model.modelId}, which has ${model.numLayers} layers`
        })
      }
    } else if (Option.isSome(args.layers)) {
      model = {
        modelId: "unnamed",
        ggufSource: { _tag: "LocalPath", path: "<none>" },
        numLayers: args.layers.value,
        hiddenDim: args.hiddenDim,
        dtypeFamily,
        dtypeWidthBytes,
        maxSeqLen: args.maxSeqLen,
        eosTokenId: 2,
        tokenizer: { _tag: "EmbeddedInGguf" }
      }
    } else {
      return yield* new PlanUsageError({
        message: "give the layer count with --layers N or a GGUF file with --model PATH"
      })
    }
    const ring = (dataCapacity: number): RingSpec => ({
      dataCapacity,
      alignment: args.alignment,
      direction: "Egress",
      hostPinning: "Pageable",
      wakeCoalescing: "PendingBit"
    })
    return {
      runId: RunId.make(args.runId),
      orchestratorNodeId: args.orchestrator as NodeId,
      model,
      runtime: { maxTokens: args.maxTokens, sampling: { temperatureMillis: 0, topK: 1 } },
      candidatePool: pool,
      stageCount: args.stages,
      placement: {
        _tag: "FixedLinear",
        stages: nodes.map((nodeId, stageIndex) => ({ stageIndex, nodeId }))
      },
      activationRing: ring(args.activationRingBytes),
      tokenRing: ring(args.tokenRingBytes)
    }
  })

const endpointText = (endpoint: EdgeEndpoint) =>
  endpoint._tag === "Orchestrator"
    ? `orchestrator (node ${endpoint.nodeId})`
    : `stage ${endpoint.stageIndex} (node ${endpoint.nodeId})`

const ringText = (ring: RingSpec) => `${ring.dataCapacity} B, align ${ring.alignment}`

const table = (header: ReadonlyArray<string>, rows: ReadonlyArray<ReadonlyArray<string>>): string => {
  const widths = header.map((h, i) => Math.max(h.length, ...rows.map((r) => (r[i] ?? "").length)))
  const line = (cells: ReadonlyArray<string>) =>
    cells
      .map((c, i) => (i === cells.length - 1 ? c : c.padEnd(widths[i]!)))
      .join("  ")
      .trimEnd()
  return [line(header), line(widths.map((w) => "-".repeat(w))), ...rows.map(line)].join("\n")
}

/** The plan as text: a summary line, a stage table and an edge table. */
export const renderPlan = (plan: RunPlan): string => {
  const edgeById = new Map<number, Edge>(plan.edges.map((e) => [e.edgeId, e]))
  const edgeText = (id: number) => `#${id} ${edgeById.get(id)?.kind ?? "?"}`
  const stages = table(
    ["stage", "node", "blocks", "layers", "inbound", "outbound"],
    plan.stages.map((s) => [
      String(s.stageIndex),
      String(s.nodeId),
      `[${s.layerStart}, ${s.layerEndExclusive})`,
      String(s.layerEndExclusive - s.layerStart),
      edgeText(s.inboundEdge),
      edgeText(s.outboundEdge)
    ])
  )
  const edges = table(
    ["edge", "kind", "from", "to", "ring"],
    plan.edges.map((e) => [
      `#${e.edgeId}`,
      e.kind,
      endpointText(e.producer),
      endpointText(e.consumer),
      ringText(e.ring)
    ])
  )
  const m = plan.model
  return [
    `run ${plan.runId}: ${m.modelId}, ${m.numLayers} layers over ${plan.stages.length} stages, ` +
      `hidden ${m.hiddenDim} x ${m.dtypeWidthBytes} B (${m.dtypeFamily}), max tokens ${plan.maxTokens}, ` +
      `orchestrator node ${plan.orchestratorNodeId}`,
    "",
    stages,
    "",
    edges
  ].join("\n")
}

/** A rejection in words: its kind and its message (which names the offending value). */
export const renderRejection = (rejection: PlanRejection): string =>
  `plan rejected (${rejection._tag}): ${rejection.message}`

/** Plans from parsed arguments and prints the result; fails (non-zero exit) after printing why. */
export const runPlanCommand = (args: PlanArgs) =>
  plannerInputFromArgs(args).pipe(
    Effect.flatMap(planRun),
    Effect.matchEffect({
      onSuccess: (plan) => Console.log(renderPlan(plan)),
      onFailure: (error) =>
        Effect.zipRight(
          Console.error(
            error._tag === "PlanUsageError"
              ? `swactor plan: ${error.message}`
              : error._tag === "ModelLoadError"
                ? `swactor plan: cannot read the model: ${error.message}`
                : renderRejection(error)
          ),
          Effect.fail(error)
        )
    }),
    Effect.provide(ModelCatalogLive.layer)
  )

const model = "Model"
const pipeline = "Pipeline"
const rings = "Rings"

/** The flags of `swactor plan`: what they parse into and what `--help` says of them. */
const planFlags = {
  layers: Flag.integer("layers", { group: model, text: "transformer blocks in the model" }).optional("from --model"),
  model: Flag.text("model", {
    group: model,
    value: "PATH",
    text: "GGUF file to read the layer count, hidden size and context length from"
  }).optional(),
  stages: Flag.integer("stages", { group: pipeline, text: "pipeline stages" }),
  nodes: Flag.text("nodes", {
    group: pipeline,
    value: "IDS",
    text: "node hosting each stage, in stage order: 10,11,12"
  }),
  pool: Flag.text("pool", { group: pipeline, value: "IDS", text: "candidate node pool" }).optional(
    "the nodes of --nodes"
  ),
  orchestrator: Flag.integer("orchestrator", {
    group: pipeline,
    value: "ID",
    text: "orchestrator node id"
  }).withDefault(0),
  runId: Flag.integer("run-id", { group: pipeline, value: "ID", text: "run id" }).withDefault(1),
  maxTokens: Flag.integer("max-tokens", { group: pipeline, text: "tokens to generate at most" }).withDefault(16),
  hiddenDim: Flag.integer("hidden-dim", { group: model, text: "hidden size (without --model)" }).withDefault(4096),
  maxSeqLen: Flag.integer("max-seq-len", { group: model, text: "context length (without --model)" }).withDefault(2048),
  dtype: Flag.choice("dtype", ["f32", "f16", "bf16"], { group: rings, text: "activation frame dtype" }).withDefault(
    "f32"
  ),
  activationRingBytes: Flag.integer("activation-ring-bytes", {
    group: rings,
    value: "BYTES",
    text: "activation ring capacity"
  }).withDefault(1 << 20),
  tokenRingBytes: Flag.integer("token-ring-bytes", {
    group: rings,
    value: "BYTES",
    text: "token ring capacity"
  }).withDefault(4096),
  alignment: Flag.integer("ring-alignment", {
    group: rings,
    value: "BYTES",
    text: "frame alignment of every ring"
  }).withDefault(64)
}

/** What `swactor plan --help` says. */
export const planDoc = commandDoc(
  "plan",
  "Form a run plan and print it: stages, nodes, block ranges, edges",
  [model, pipeline, rings],
  planFlags,
  [
    { what: "36 blocks over three nodes", command: "swactor plan --layers 36 --stages 3 --nodes 10,11,12" },
    { what: "a model's own shape", command: "swactor plan --model model.gguf --stages 2 --nodes 1,2" }
  ]
)

export const planCommand = Command.make("plan", optionsOf(planFlags), runPlanCommand).pipe(
  Command.withDescription(planDoc.summary)
)
