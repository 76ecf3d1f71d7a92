/**
 * `swactor run`: generates text across a pipeline of node agents. Without --agents it starts one
 * agent process per stage on this machine and runs the same distributed path over loopback.
 * Streams the text to stdout; progress and the summary go to stderr.
 *
 * The steps, each in its own module: the flags and their checks (RunFlags, over PipelineFlags shared with serve and
 * node), the model (DefaultModel, ModelFit), the request and its agent pool (RunRequestFromFlags), what is printed
 * (RunOutput, DryRunPreview), operator stops (Signals).
 */
import * as Command from "@effect/cli/Command"
import { Console, Effect, Option, Stream } from "effect"
import { run } from "../api/generate.js"
import { Settings } from "../layers/config/Settings.js"
import { defaultSyntheticModel } from "./DefaultModel.js"
import { renderPreview } from "./DryRunPreview.js"
import { checkModelFit } from "./ModelFit.js"
import { commandDoc, optionsOf } from "./FlagSpec.js"
import { type CheckedRunFlags, type RunArgs, runFlags, runGroups, validateRunFlags } from "./RunFlags.js"
import { type JsonReport, makeRunPrinter, printJsonReport, reportFailure, reportOperatorStop } from "./RunOutput.js"
import { plannedStages } from "./PipelineFlags.js"
import { agentPoolFromFlags, requestFromFlags } from "./RunRequestFromFlags.js"
import { untilOperatorStop } from "./Signals.js"
import { makePhaseClock } from "./StartupPhases.js"

/** The run once its flags are checked, with the settings they chose (the Settings service) provided. */
const runRun = (args: RunArgs, json: JsonReport) =>
  Effect.gen(function* () {
    const clock = makePhaseClock()
    clock.mark("start")
    const flags = yield* validateRunFlags(args)
    return yield* runChecked(args, json, clock, flags).pipe(Effect.provideService(Settings, flags.pipeline.settings))
  })

const runChecked = (
  args: RunArgs,
  json: JsonReport,
  clock: ReturnType<typeof makePhaseClock>,
  flags: CheckedRunFlags
) =>
  Effect.gen(function* () {
    const model = Option.isSome(args.model) ? args.model.value : yield* defaultSyntheticModel
    yield* checkModelFit(model, flags.prompt, flags.maxTokens, plannedStages(flags.pipeline, flags.localStages))
    clock.mark("checked")
    const request = requestFromFlags(args, flags, model)
    const layer = agentPoolFromFlags(args, flags, request)
    if (args.dryRun) {
      return yield* run(request).pipe(
        Stream.map(renderPreview),
        Stream.filter((text) => text !== ""),
        Stream.runForEach((text) => Console.log(text)),
        Effect.provide(layer)
      )
    }
    const printer = makeRunPrinter(args, flags.prompt, json, clock)
    yield* run(request).pipe(
      Stream.runForEach(printer.update),
      Effect.provide(layer),
      Effect.tapError(() => printer.endLine)
    )
  })

/** `swactor run` with its operator stops (signals, closed stdout): see cli/Signals.ts. */
export const runRunCommand = (args: RunArgs) => {
  const json: JsonReport = { ok: false, text: "", tokens: [] }
  const printJson = printJsonReport(args.json, json)
  return untilOperatorStop(runRun(args, json), {
    onStop: (stop) =>
      stop._tag === "OutputClosed"
        ? Effect.void
        : reportOperatorStop(json, stop.signal).pipe(Effect.zipRight(printJson))
  }).pipe(
    Effect.tap((result) => (Option.isSome(result) ? printJson : Effect.void)),
    Effect.tapError((error) => reportFailure(json, error).pipe(Effect.zipRight(printJson)))
  )
}

/** What `swactor run --help` says. */
export const runDoc = commandDoc(
  "run",
  "Generate text across a pipeline of node agents (local child processes by default)",
  runGroups,
  runFlags,
  [
    {
      what: "two local agents, greedy; the text on stdout, progress and a summary on stderr",
      command: 'swactor run --model model.gguf --prompt "Once upon a time" --max-tokens 64'
    },
    {
      what: "three nodes started with swactor node, the cluster token in a file",
      command: "swactor run --model model.gguf --agents n1:7070,n2:7070,n3:7070 --token-file token"
    },
    {
      what: "sampled, one JSON document at the end",
      command: "swactor run --model model.gguf --temperature 0.8 --top-p 0.95 --seed 7 --json"
    }
  ]
)

export const runCommand = Command.make("run", optionsOf(runFlags), runRunCommand).pipe(
  Command.withDescription(runDoc.summary)
)
