/**
 * A child process for test/engine/peak.test.ts: loads one whole-model stage with the given options, runs a prompt and a
 * few decode steps, settles (moves mapped weights to huge-page memory), and prints one JSON line with its resident
 * memory (from /proc/self/status, MiB granularity is too coarse: KiB) at each phase and the stage's byte counts.
 * Arguments: model path, then JSON LiveOptions.
 */
import { Effect } from "effect"
import { readFileSync } from "node:fs"
import { getGgml } from "../../src/layers/ggml/Bindings.js"
import { layerWith, type LiveLoadedStage, type LiveOptions } from "../../src/layers/engine/StageExecutorLive.js"
import { StageExecutor } from "../../src/services/StageExecutor.js"

const status = () => {
  const fields = Object.fromEntries(
    readFileSync("/proc/self/status", "utf8")
      .split("\n")
      .map((l) => l.split(":"))
      .filter((p) => p.length === 2)
      .map(([k, v]) => [k!.trim(), Number(v!.trim().split(/\s+/)[0]) * 1024])
  )
  return { hwm: fields["VmHWM"]!, rss: fields["VmRSS"]! }
}

const [path, optionsJson] = process.argv.slice(2)
const options = JSON.parse(optionsJson ?? "{}") as LiveOptions
const CONTEXT = 512

getGgml()
const baseline = status()
const program = Effect.gen(function* () {
  const executor = yield* StageExecutor
  const stage = (yield* executor.load({
    path: path!,
    layerStart: 0,
    layerEndExclusive: 4,
    isFirst: true,
    isLast: true
  })) as LiveLoadedStage
  const loaded = status()
  const session = yield* executor.session(stage, { threads: 1, contextLength: CONTEXT })
  let out = yield* session.forward(0, { _tag: "Tokens", tokens: Int32Array.from({ length: 16 }, (_, i) => 3 + i) })
  for (let p = 16; p < 24; p++) out = yield* session.forward(p, { _tag: "Tokens", tokens: Int32Array.of(5) })
  const served = status()
  const settled = yield* stage.settle()
  for (let p = 24; p < 28; p++) out = yield* session.forward(p, { _tag: "Tokens", tokens: Int32Array.of(5) })
  const end = status()
  return {
    baseline,
    loaded,
    served,
    end,
    settled,
    logits: out._tag,
    weightBytes: stage.info.weightBytes,
    kvBytes: stage.info.kvBytesPerToken * CONTEXT,
    computeBytes: stage.computeBytes,
    placements: [...new Set(stage.placements.map((p) => p.bufferType))]
  }
}).pipe(Effect.scoped, Effect.provide(layerWith(options)))

Effect.runPromise(program).then(
  (r) => console.log(JSON.stringify(r)),
  (e) => {
    console.error(e)
    process.exit(1)
  }
)
