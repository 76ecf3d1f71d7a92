/**
 * What the checked flags of `swactor run` ask the library for: the generation request, and the agent pool it runs on
 * (remote agents given by --nodes, else local agent processes started for it).
 */
import { Option } from "effect"
import { layerLocal, layerRemote } from "../api/generate.js"
import type { GenerateRequest } from "../services/Orchestrator.js"
import type { CheckedRunFlags, RunArgs } from "./RunFlags.js"

/**
 * The stages the model is checked against: the agents a local run starts, one per stage (a fixed placement: one per
 * range). Remote nodes: --stages if given.
 */
export const plannedStages = (flags: CheckedRunFlags): number | undefined =>
  Option.isSome(flags.stages) ? flags.stages.value : flags.nodes.length > 0 ? undefined : flags.localStages

/** The generation request of the flags. */
export const requestFromFlags = (args: RunArgs, flags: CheckedRunFlags, model: string): GenerateRequest => {
  const { maxTokens, nodes, prompt, threads } = flags
  return {
    model,
    prompt,
    maxTokens,
    sampling: {
      temperature: flags.temperature,
      topK: flags.topK,
      ...(Option.isSome(flags.seed) ? { seed: flags.seed.value } : {}),
      ...flags.chain
    },
    ...(Option.isSome(flags.stages)
      ? { stages: flags.stages.value }
      : nodes.length > 0
        ? {}
        : { stages: flags.localStages }),
    ...(flags.placement === undefined ? {} : { placement: flags.placement }),
    // Nodes that lack the model file receive their stages' slices (remote nodes by default; never for a dry run).
    ...(!args.dryRun && (args.deliverWeights === "always" || (args.deliverWeights !== "never" && nodes.length > 0))
      ? { deliverWeights: true }
      : {}),
    ...(Option.isSome(threads) ? { threads: threads.value } : {}),
    ...(args.dryRun ? { dryRun: true } : {}),
    ...(args.tokenLoop === "off" ? { tokenLoop: false } : {}),
    ...(flags.prefillThreads === undefined ? {} : { prefillThreads: flags.prefillThreads }),
    ...((args.spares ?? 0) !== 0 ? { spares: args.spares! } : {})
  }
}

/** The agent pool the request runs on: the remote agents of --nodes, or local agent processes, one per stage. */
export const agentPoolFromFlags = (args: RunArgs, flags: CheckedRunFlags, request: GenerateRequest) => {
  const { agentArgs, nodes, threads, token } = flags
  // Local agents are alike (one machine, same threads): their speed probe runs after they are ready, off the
  // start-up path. A dry run explains placement with measured speeds, so there they measure first.
  const probeArgs = args.dryRun ? [] : ["--speed-probe", "after-ready"]
  const extraArgs = [...probeArgs, ...agentArgs]
  return nodes.length > 0
    ? layerRemote({ agents: nodes, token })
    : layerLocal({
        // The agents boot while the orchestrator reads the model's facts and vocabulary.
        prestart: (request.stages ?? 2) + (request.spares ?? 0),
        ...(extraArgs.length === 0 ? {} : { extraArgs: () => extraArgs }),
        ...(Option.isSome(threads) ? { threads: threads.value } : {})
      })
}
