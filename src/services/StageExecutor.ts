import { Context, type Effect, type Scope } from "effect"
import {
  ContextOverflow,
  type DeviceBytes,
  type ForwardBatchError,
  type ForwardError,
  InvalidStageInput,
  type LoadProgress,
  type StageInfo,
  type StageInput,
  type StageLoadSpec,
  type StageOutput
} from "../domain/engine.js"
import type { ModelLoadError } from "../domain/gguf.js"

/** Weights of one block range, loaded once and shared by every session on them. */
export interface LoadedStage {
  readonly info: StageInfo
  /**
   * Where the engine can trade a one-time cost for faster steps (the live CPU engine: weights used in place from a
   * file mapping moved to huge-page memory), do it in the background, between steps; true once done. Worth it for
   * long-lived stages (a server, long generations), not for a short run. Absent: nothing to do.
   */
  readonly settle?: () => Effect.Effect<boolean>
  /**
   * What the loaded stage holds now, measured (the live engine: its weight buffers and mapped weights, and every
   * cached graph's compute buffer). Absent: not known (test doubles).
   */
  readonly memory?: () => {
    readonly weightBytes: number
    readonly computeBytes: number
    /**
     * A GPU stage: the device memory its backend allocated now, from ggml's buffer sizes: weights, its open sessions'
     * caches, compute buffers. Absent: a CPU stage.
     */
    readonly device?: DeviceBytes
  }
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
/** What a forward spent on copies (ms), filled in by engines that measure it (`swactor run --timeline`). */
export interface ForwardPhases {
  copyMillis: number
}

export interface BatchItem {
  readonly session: StageSession
  readonly startPos: number
  readonly input: StageInput
}

export interface SessionOptions {
  readonly contextLength?: number
  readonly threads?: number
  /**
   * Threads for a forward of several rows this session runs alone (a prompt's prefill; default `threads`). Bits do not
   * depend on the thread count (each output element is one thread's work in ggml's CPU kernels), so a stage may take
   * idle cores for a prefill while the rest of its pipeline waits for it (PipelineOptions.prefillThreads).
   */
  readonly prefillThreads?: number
  /**
   * A scratch session of the agent's own (the batcher's step-cost probe), not a run's: left out of the process's
   * tally of open sessions and their bytes (`heldSessionBytes`, reported in /metrics).
   */
  readonly scratch?: boolean
}

export interface StageExecutorService {
  /** Loads the block range (scoped: freed when the scope closes). */
  readonly load: (
    spec: StageLoadSpec,
    onProgress?: (progress: LoadProgress) => void
  ) => Effect.Effect<LoadedStage, ModelLoadError, Scope.Scope>
  /** A fresh KV cache over loaded weights (scoped). */
  readonly session: (
    stage: LoadedStage,
    options?: SessionOptions
  ) => Effect.Effect<StageSession, ModelLoadError, Scope.Scope>
  /**
   * Runs several sessions of ONE loaded stage in one computation: the weights are read once for all rows, each
   * sequence attends over its own KV cache. Items may mix prefill (many tokens) and decode (one token); each
   * session appears at most once. One output per item, in order: its hidden rows, or on the last stage the logits
   * of its last position. Every item is checked as `forward` would check it before anything runs; a rejected item
   * fails the whole call with its index (BatchItemRejected) and no session changes.
   */
  readonly forwardBatch: (
    items: ReadonlyArray<BatchItem>,
    /** Where an engine that can tell adds the ms it spent copying rows into and out of its graph (the timeline). */
    phases?: ForwardPhases
  ) => Effect.Effect<ReadonlyArray<StageOutput>, ForwardBatchError>
  /**
   * Prompt cache: copies the KV of positions [0, length) of `from` into `to` (sessions of one loaded stage; `to`
   * then holds `length` positions, later ones forgotten). Neither may be in a computation meanwhile. Refused
   * (nothing copied) when `length` is past what `from` holds or `to` can hold. Absent: the executor cannot.
   */
  readonly copyPrefix?: (from: StageSession, to: StageSession, length: number) => Effect.Effect<void, InvalidStageInput>
}

export class StageExecutor extends Context.Tag("swactor/StageExecutor")<StageExecutor, StageExecutorService>() {}

/**
 * Checks a forward call against the stage and the session before any native call (pure; the live executor and the
 * test double both use it, so they refuse the same inputs with the same words).
 */
export const validateForward = (
  info: StageInfo,
  contextLength: number,
  filled: number,
  startPos: number,
  input: StageInput
): ContextOverflow | InvalidStageInput | undefined => {
  const n = input._tag === "Tokens" ? input.tokens.length : input.nTokens
  if (!Number.isSafeInteger(startPos) || startPos < 0 || startPos > filled) {
    return new InvalidStageInput({
      message: `start position ${startPos} must be an integer in [0, ${filled}] (the cache holds ${filled} positions)`
    })
  }
  if (!Number.isSafeInteger(n) || n < 1) return new InvalidStageInput({ message: `a batch needs at least one token` })
  if (startPos + n > contextLength) {
    return new ContextOverflow({ position: startPos, nTokens: n, contextLength })
  }
  if (info.isFirst) {
    if (input._tag !== "Tokens") {
      return new InvalidStageInput({ message: "the first stage takes token ids, not hidden states" })
    }
    for (let i = 0; i < n; i++) {
      const t = input.tokens[i]!
      if (t < 0 || t >= info.vocabSize) {
        return new InvalidStageInput({ message: `token id ${t} at index ${i} is outside [0, ${info.vocabSize})` })
      }
    }
  } else {
    if (input._tag !== "Hidden") {
      return new InvalidStageInput({ message: "a stage after the first takes hidden states, not token ids" })
    }
    if (input.hidden.length !== n * info.hiddenDim) {
      return new InvalidStageInput({
        message: `hidden states have ${input.hidden.length} floats, expected ${n} x ${info.hiddenDim}`
      })
    }
  }
  return undefined
}
