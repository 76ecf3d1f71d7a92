/**
 * A stand-in for a slower node on one machine (bench:cluster's throttled agent): every batched forward takes `factor`
 * times as long. After the real computation the executor sleeps (factor − 1) × its wall time, so the node is slow
 * without burning the CPU the other agents need (a thread-starved agent on a small machine slows every agent).
 * `swactor node` wraps its engine in it when SWACTOR_BENCH_SLOWDOWN is set (config/Settings.ts `agentHooks`: a finite
 * number above 1; anything else is 1, not slowed), and divides its measured speed by the
 * same factor, so placement sees the node as it behaves.
 */
import { Effect, Layer } from "effect"
import { StageExecutor } from "../../services/StageExecutor.js"

/** The StageExecutor below it, each `forwardBatch` stretched to `factor` times its wall time. */
export const layerSlowed = (factor: number): Layer.Layer<StageExecutor, never, StageExecutor> =>
  Layer.effect(
    StageExecutor,
    Effect.map(StageExecutor, (executor) =>
      StageExecutor.of({
        load: (spec, onProgress) => executor.load(spec, onProgress),
        session: (stage, options) => executor.session(stage, options),
        ...(executor.copyPrefix === undefined ? {} : { copyPrefix: executor.copyPrefix }),
        forwardBatch: (items, phases) =>
          Effect.gen(function* () {
            const started = performance.now()
            const outputs = yield* executor.forwardBatch(items, phases)
            yield* Effect.sleep((factor - 1) * (performance.now() - started))
            return outputs
          })
      })
    )
  )
