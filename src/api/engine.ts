/**
 * The engine, the library's `Engine` namespace: the `StageExecutor` service (load a stage's blocks, run batched
 * forwards) with its load specs, inputs, outputs and errors, its live ggml layer (`StageExecutorLive`), a pipeline of
 * stages in this process, the `Tokenizer` service, sampling and stop-text matching. The executor's test layer is in
 * the `swactor/testing` entry.
 */
export * from "../domain/engine.js"
export * from "../services/StageExecutor.js"
export * from "../services/InProcessPipeline.js"
export * from "../services/Tokenizer.js"
export * from "../services/Sampler.js"
export * from "../services/StopText.js"
export * as StageExecutorLive from "../layers/engine/StageExecutorLive.js"
