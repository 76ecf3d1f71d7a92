/** swactor's public library API. Each module appends its exports here. */

// Domain vocabulary
export * from "./domain/ids.js"
export * from "./domain/plan.js"
export * from "./domain/planErrors.js"
export * from "./domain/runEvents.js"

// Planning and the run state machine
export * from "./services/Planner.js"
export * from "./services/RunFsm.js"
export * from "./services/OrchestratorHarness.js"

// GGUF format layer: ggml types, validating reader, writer, synthetic models
export * from "./domain/gguf.js"
export * from "./domain/ggmlTypes.js"
export * from "./layers/gguf/GgufReader.js"
export * from "./layers/gguf/GgufWriter.js"
export * from "./layers/gguf/Synthetic.js"
export * from "./layers/gguf/Float16.js"

// Transport: frames, control RPC, framing, auth, data plane, control plane
export * from "./domain/frames.js"
export * from "./domain/controlRpc.js"
export * as Framing from "./layers/transport/Framing.js"
export * as Auth from "./layers/transport/Auth.js"
export * as EdgeTransport from "./layers/transport/EdgeTransport.js"
export * as ControlPlane from "./layers/transport/ControlPlane.js"
export * as ShmRing from "./layers/transport/ShmRing.js"

// Pipeline API: generate / run / complete, local or remote agents, Promise facade
export * from "./api/generate.js"
export { readModelFacts } from "./api/modelFacts.js"
export * from "./services/Orchestrator.js"
export * from "./services/Tokenizer.js"
// Serving: a warm pipeline with admission from code (serve, completion, Server), and its OpenAI-compatible HTTP front
export { completion, serve, type ServeLayerOptions } from "./api/serve.js"
export * from "./services/Server.js"
export * from "./services/StopText.js"
export * as HttpServe from "./layers/server/HttpServe.js"
export {
  type HeartbeatOptions,
  Membership,
  NodeEndpoint,
  NodeLost,
  type NodeProbeService,
  NodeUnreachable,
  type Pool,
  PoolNotReady
} from "./services/Membership.js"
export * from "./services/AgentLinks.js"
export * as AgentPools from "./layers/agent/AgentPools.js"
export { spawnLocalAgents, generateToken } from "./layers/agent/AgentProcesses.js"
export type { LocalAgent } from "./layers/agent/AgentProcesses.js"
export type { LocalPoolOptions, RemotePoolOptions } from "./layers/agent/AgentPools.js"
export { makeStageHost, startNodeAgent } from "./layers/agent/NodeAgent.js"
export * from "./domain/engine.js"
export * from "./services/StageExecutor.js"
export * from "./services/InProcessPipeline.js"
export * from "./services/Sampler.js"
export * as StageExecutorLive from "./layers/engine/StageExecutorLive.js"
export * as StageExecutorTest from "./layers/engine/StageExecutorTest.js"
