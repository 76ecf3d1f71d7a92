/**
 * A split run inside one process: loads each stage of `boundaries` through the StageExecutor and chains their
 * sessions, token ids into the first stage, hidden states between stages, logits out of the last. Used by the
 * engine's equivalence tests and benchmark, where one process plays every stage.
 */
import { Effect, type Scope } from "effect"
import type { ForwardError, StageInput, StageOutput } from "../domain/engine.js"
import type { ModelLoadError } from "../domain/gguf.js"
import { type SessionOptions, StageExecutor, type StageSession } from "./StageExecutor.js"

export interface InProcessPipeline {
  readonly sessions: ReadonlyArray<StageSession>
  /** Runs tokens at positions pos.. through every stage; the logits of the last position. */
  readonly run: (pos: number, tokens: Int32Array | ReadonlyArray<number>) => Effect.Effect<Float32Array, ForwardError>
  /** Forgets every stage's KV cache. */
  readonly reset: Effect.Effect<void>
}

/** `boundaries` = [0, b1, ..., numLayers]: stage i runs blocks [boundaries[i], boundaries[i + 1]). */
export const openInProcessPipeline = (
  path: string,
  boundaries: ReadonlyArray<number>,
  options?: SessionOptions,
  /** Where stage i loads from (a stage's GGUF slice); default `path` for every stage. */
  stagePath?: (stageIndex: number) => string
): Effect.Effect<InProcessPipeline, ModelLoadError, StageExecutor | Scope.Scope> =>
  Effect.gen(function* () {
    const executor = yield* StageExecutor
    const sessions: Array<StageSession> = []
    const nStages = boundaries.length - 1
    for (let i = 0; i < nStages; i++) {
      const stage = yield* executor.load({
        path: stagePath?.(i) ?? path,
        layerStart: boundaries[i]!,
        layerEndExclusive: boundaries[i + 1]!,
        isFirst: i === 0,
        isLast: i === nStages - 1
      })
      sessions.push(yield* executor.session(stage, options))
    }
    const run = (pos: number, tokens: Int32Array | ReadonlyArray<number>) =>
      Effect.gen(function* () {
        let input: StageInput = {
          _tag: "Tokens",
          tokens: tokens instanceof Int32Array ? tokens : Int32Array.from(tokens)
        }
        for (const s of sessions) {
          const out: StageOutput = yield* s.forward(pos, input)
          if (out._tag === "Logits") return out.logits
          input = out
        }
        return yield* Effect.dieMessage("the last stage returned no logits")
      })
    const reset = Effect.forEach(sessions, (s) => s.reset, { discard: true })
    return { sessions, run, reset }
  })
