/**
 * swactor's public library API (the package's "." entry). What a program that runs or serves a model uses is exported
 * by name: generate / run / complete and the Promise client, serve / completion, agents, requests, summaries and the
 * errors their error channels carry. The contracts under them are namespaces: `Plan`, `RunFsm`, `Gguf`, `Engine`,
 * `Transport`, `AgentPools`, `HttpServe`. Test doubles and harnesses are in the
 * `swactor/testing` entry (src/testing.ts); frame encoding, the shared-memory ring and the layers' internals are not
 * exported.
 */

// Running a model: generate / run / complete over local or remote agents, and the Promise facade; the requests,
// updates and summaries, the run's typed errors (GenerateError) and the Orchestrator service they need
export * from "./api/generate.js"
export * from "./services/Orchestrator.js"
export { readModelFacts } from "./api/modelFacts.js"

// The errors in GenerateError and the other error channels users handle: plan and placement rejections, model load,
// tokenizer, agents and pools
export * from "./domain/planErrors.js"
export { ModelLoadError, ModelLoadReason } from "./domain/gguf.js"
export { ChatRenderError, TokenizerError } from "./services/Tokenizer.js"
export { AgentSpawnError, AgentUnavailable } from "./services/AgentLinks.js"
export { NodeEndpoint, NodeLost, NodeUnreachable, PoolNotReady } from "./services/Membership.js"

// Serving: a warm pipeline with admission from code (serve, completion, the Server service and its events, metrics
// and errors), and its OpenAI-compatible HTTP front
export { completion, serve, type ServeLayerOptions } from "./api/serve.js"
export * from "./services/Server.js"
export * as HttpServe from "./layers/server/HttpServe.js"

// Agents: local agent processes, a node agent in this process, and the pools a pipeline runs on
export { generateToken, spawnLocalAgents } from "./layers/agent/AgentProcesses.js"
export type { AgentExit, LocalAgent, LocalAgentsOptions } from "./layers/agent/AgentProcesses.js"
export { startNodeAgent, type NodeAgentOptions, type RunningAgent } from "./layers/agent/NodeAgent.js"
export type { LocalPoolOptions, RemotePoolOptions } from "./layers/agent/AgentPools.js"
export * as AgentPools from "./layers/agent/AgentPools.js"

// Settings: the service every setting is resolved into once (default: this process's environment); a program provides
// its own values with Settings.layer instead of setting variables
export { type GgmlPackage, Settings, type SettingsValues, type TlsMode } from "./layers/config/Settings.js"

// The contracts, by namespace: the plan (ids, plan, planner, rejections) and the run's state machine (events,
// commands, transition, actor)
export * as Plan from "./api/plan.js"
export * as RunFsm from "./api/runFsm.js"

// GGUF files (reader, writer, ggml types), the engine (StageExecutor and its live layer, tokenizer, sampling) and the
// agents' links (frames, control RPC, data and control planes, membership, auth)
export * as Gguf from "./api/gguf.js"
export * as Engine from "./api/engine.js"
export * as Transport from "./api/transport.js"
