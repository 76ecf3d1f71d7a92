import { Context, type Effect, type Scope } from "effect"
import type {
  ForwardError,
  LoadProgress,
  StageInfo,
  StageInput,
  StageLoadSpec,
  StageOutput
} from "../domain/engine.js"
import type { ModelLoadError } from "../domain/gguf.js"

/** Weights of one block range, loaded once and shared by every session on them. */
export interface LoadedStage {
  readonly info: StageInfo
}

/** One sequence's KV cache over a loaded stage. */
export interface StageSession {
  readonly info: StageInfo
  /**
   * Runs `input` (n tokens, positions startPos..startPos+n-1) through the stage in one batch
   * and appends to this session's KV cache. n = 1 is a decode step.
   */
  readonly forward: (startPos: number, input: StageInput) => Effect.Effect<StageOutput, ForwardError>
  /** Forgets the KV cache (positions start again at 0). */
  readonly reset: Effect.Effect<void>
}

export interface SessionOptions {
  readonly contextLength?: number
  readonly threads?: number
}

export interface StageExecutorService {
  /** Loads the block range (scoped: freed when the scope closes). */
  readonly load: (
    spec: StageLoadSpec,
    onProgress?: (progress: LoadProgress) => void
  ) => Effect.Effect<LoadedStage, ModelLoadError, Scope.Scope>
  /** A fresh KV cache over loaded weights (scoped). */
  readonly session: (stage: LoadedStage, options?: SessionOptions) => Effect.Effect<StageSession, ModelLoadError, Scope.Scope>
}

export class StageExecutor extends Context.Tag("swactor/StageExecutor")<StageExecutor, StageExecutorService>() {}
