/**
 * The run's state machine, the library's `RunFsm` namespace: its events, commands and lifecycle events
 * (domain/runEvents.ts: `RunEvents.PoolReady(...)`, ...), the pure `transition` and the `RunActor` fiber around it.
 * Its test harness (`OrchestratorHarness`) is in the `swactor/testing` entry.
 */
export * from "../domain/runEvents.js"
export * from "../services/RunFsm.js"
