/**
 * What the checked flags of `swactor run` ask the library for: the generation request, and the agent pool it runs on
 * (remote agents given by --agents, else local agent processes started for it).
 */
import { Option } from "effect"
import { layerLocal, layerRemote } from "../api/generate.js"
import type { GenerateRequest, PlacementRequest } from "../services/Orchestrator.js"
import { defaultLocalStages, pipelineOptionsOf, speculativeOf } from "./PipelineFlags.js"
import type { CheckedRunFlags, RunArgs } from "./RunFlags.js"

/**
 * The placement of run and serve without --placement or --layers: over remote agents (--agents), each node's share of
 * the blocks by the speed it measured (services/Placement.ts `Speed`: a node 10 times slower gets fewer blocks); local
 * agents are alike processes of one machine: the equal split.
 */
export const defaultPlacement = (agents: ReadonlyArray<string>): { readonly placement?: PlacementRequest } =>
  agents.length > 0 ? { placement: { _tag: "Speed" } } : {}

/** The generation request of the flags. */
export const requestFromFlags = (args: RunArgs, flags: CheckedRunFlags, model: string): GenerateRequest => ({
  model,
  prompt: flags.prompt,
  maxTokens: flags.maxTokens,
  sampling: {
    temperature: flags.temperature,
    topK: flags.topK,
    ...(Option.isSome(flags.seed) ? { seed: flags.seed.value } : {}),
    ...flags.chain
  },
  // Nodes that lack the model file receive their stages' slices (remote nodes by default; never for a dry run).
  ...pipelineOptionsOf(flags.pipeline, { localStages: flags.localStages, dryRun: args.dryRun }),
  ...(flags.placement === undefined ? defaultPlacement(flags.pipeline.agents) : { placement: flags.placement }),
  ...(args.dryRun ? { dryRun: true } : {}),
  ...(args.timeline ? { timeline: true } : {}),
  ...speculativeOf(args)
})

/** The agent pool the request runs on: the remote agents of --agents, or local agent processes, one per stage. */
export const agentPoolFromFlags = (args: RunArgs, flags: CheckedRunFlags, request: GenerateRequest) => {
  const { agentArgs, agents, threads, token } = flags.pipeline
  // Local agents are alike (one machine, same threads): their speed probe runs after they are ready, off the
  // start-up path. A dry run explains placement with measured speeds, so there they measure first.
  const probeArgs = args.dryRun ? [] : ["--speed-probe", "after-ready"]
  const extraArgs = [...probeArgs, ...agentArgs]
  return agents.length > 0
    ? layerRemote({ agents, token })
    : layerLocal({
        // The agents boot while the orchestrator reads the model's facts and vocabulary.
        prestart: (request.stages ?? defaultLocalStages) + (request.spares ?? 0),
        ...(extraArgs.length === 0 ? {} : { extraArgs: () => extraArgs }),
        ...(threads === undefined ? {} : { threads })
      })
}
