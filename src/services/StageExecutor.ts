import { Context, type Effect, type Scope } from "effect"
import type {
  ForwardBatchError,
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

/** One sequence's part of a batched forward: `input` at positions startPos.. of `session`. */
export interface BatchItem {
  readonly session: StageSession
  readonly startPos: number
  readonly input: StageInput
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
  /**
   * Runs several sessions of ONE loaded stage in one computation: the weights are read once for all rows, each
   * sequence attends over its own KV cache. Items may mix prefill (many tokens) and decode (one token); each
   * session appears at most once. One output per item, in order: its hidden rows, or on the last stage the logits
   * of its last position. Every item is checked as `forward` would check it before anything runs; a rejected item
   * fails the whole call with its index (BatchItemRejected) and no session changes.
   */
  readonly forwardBatch: (items: ReadonlyArray<BatchItem>) => Effect.Effect<ReadonlyArray<StageOutput>, ForwardBatchError>
}

export class StageExecutor extends Context.Tag("swactor/StageExecutor")<StageExecutor, StageExecutorService>() {}
