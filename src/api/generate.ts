/**
 * swactor's pipeline API.
 *
 * Effect: `generate(request)` is a `Stream` of generated tokens whose failure channel is the typed
 * union `GenerateError` (plan rejections, model load errors, pool/agent errors, run faults);
 * `run(request)` also streams start-up progress and ends with a summary. Both need an
 * `Orchestrator`: `layerLocal()` starts one agent process per stage on this machine,
 * `layerRemote({ agents, token })` uses agents already running elsewhere (`swactor node`).
 *
 * Promise / AsyncIterable: `createClient(options)` wraps the same thing for non-Effect callers.
 */
import { Cause, Effect, Layer, ManagedRuntime, Option, Redacted, Runtime, Stream } from "effect"
import * as AgentLinksLive from "../layers/agent/AgentLinksLive.js"
import * as AgentControlRpc from "../layers/agent/AgentControlRpc.js"
import { type LocalPoolOptions, type RemotePoolOptions } from "../layers/agent/AgentPools.js"
import * as AgentPools from "../layers/agent/AgentPools.js"
import * as MembershipLive from "../layers/agent/MembershipLive.js"
import { clusterTokenFromEnv } from "../layers/config/Settings.js"
import * as OrchestratorLive from "../layers/orchestrator/OrchestratorLive.js"
import * as ModelCatalogLive from "../layers/gguf/ModelCatalogLive.js"
import * as TokenizerLive from "../layers/gguf/TokenizerLive.js"
import {
  type GeneratedToken,
  type GenerateError,
  type GenerateRequest,
  Orchestrator,
  type RunSummary,
  type RunUpdate
} from "../services/Orchestrator.js"

export type { GeneratedToken, GenerateError, GenerateRequest, RunSummary, RunUpdate }

/** Every update of one run: progress, tokens, then the summary. Interrupting it stops the run. */
export const run = (request: GenerateRequest): Stream.Stream<RunUpdate, GenerateError, Orchestrator> =>
  Stream.unwrap(Effect.map(Orchestrator, (orchestrator) => orchestrator.run(request)))

/** The generated tokens of one run, as they come back from the last stage. */
export const generate = (request: GenerateRequest): Stream.Stream<GeneratedToken, GenerateError, Orchestrator> =>
  run(request).pipe(Stream.filterMap((update) => (update._tag === "Token" ? Option.some(update.token) : Option.none())))

/** The whole text and the summary of one run. */
export const complete = (
  request: GenerateRequest
): Effect.Effect<{ readonly text: string; readonly summary: RunSummary }, GenerateError, Orchestrator> =>
  run(request).pipe(
    Stream.runFold({ text: "", summary: undefined as RunSummary | undefined }, (acc, update) =>
      update._tag === "Token"
        ? { ...acc, text: acc.text + update.token.text }
        : update._tag === "Finished"
          ? { ...acc, summary: update.summary }
          : acc
    ),
    Effect.map(({ summary, text }) => ({ text, summary: summary! }))
  )

const services = Layer.mergeAll(
  TokenizerLive.layer,
  MembershipLive.layer,
  AgentControlRpc.layer,
  AgentLinksLive.layerDataPlane,
  ModelCatalogLive.layer
)

/** Orchestrator whose runs each start their own agents on this machine (one child process per stage). */
export const layerLocal = (options: LocalPoolOptions = {}): Layer.Layer<Orchestrator> =>
  OrchestratorLive.layer.pipe(Layer.provide(Layer.merge(services, AgentPools.layerLocal(options))))

/** Orchestrator over agents already running (`swactor node`) at `agents`, which share `token`. */
export const layerRemote = (options: RemotePoolOptions): Layer.Layer<Orchestrator> =>
  OrchestratorLive.layer.pipe(Layer.provide(Layer.merge(services, AgentPools.layerRemote(options))))

// ---------------------------------------------------------------------------------------------
// Promise / AsyncIterable facade
// ---------------------------------------------------------------------------------------------

export interface ClientOptions {
  /** Remote agents (host:port); omit to start local agents per run. */
  readonly agents?: ReadonlyArray<string>
  /**
   * Cluster token of the remote agents (default: SWACTOR_CLUSTER_TOKEN, trimmed as the CLI reads it:
   * config/Settings.ts; the remote pool checks it with the CLI's rule, a weak one fails the run as InvalidRequest).
   */
  readonly token?: string
  /** Default engine threads of local agents. */
  readonly threads?: number
}

export interface Client {
  /** Tokens as they are generated; `break` out of the loop to stop the run (it is torn down). */
  readonly stream: (request: GenerateRequest) => AsyncIterable<GeneratedToken>
  /** Progress, tokens and the summary. */
  readonly updates: (request: GenerateRequest) => AsyncIterable<RunUpdate>
  /** The whole text and the run's summary; rejects with the typed error (`error._tag`, `error.message`). */
  readonly complete: (request: GenerateRequest) => Promise<{ readonly text: string; readonly summary: RunSummary }>
  readonly close: () => Promise<void>
}

/**
 * Promise callers get the typed error itself (`error._tag`, `error.message`, `instanceof Error`), not the runtime's
 * FiberFailure wrapper.
 */
const rethrowTyped = (error: unknown): never => {
  throw Runtime.isFiberFailure(error) ? Cause.squash(error[Runtime.FiberFailureCauseId]) : error
}

export const createClient = (options: ClientOptions = {}): Client => {
  const layer =
    options.agents !== undefined && options.agents.length > 0
      ? layerRemote({ agents: options.agents, token: options.token ?? Redacted.value(clusterTokenFromEnv()) })
      : layerLocal(options.threads === undefined ? {} : { threads: options.threads })
  const runtime = ManagedRuntime.make(layer)
  const iterate = <A>(stream: Stream.Stream<A, GenerateError, Orchestrator>): AsyncIterable<A> => ({
    [Symbol.asyncIterator]: () => {
      let inner: AsyncIterator<A> | undefined
      const start = async () =>
        (inner ??= Stream.toAsyncIterableRuntime(stream, await runtime.runtime())[Symbol.asyncIterator]())
      return {
        next: async () => (await start()).next().catch(rethrowTyped),
        return: async (value?: unknown) => (await start()).return?.(value) ?? { done: true, value: undefined }
      }
    }
  })
  return {
    stream: (request) => iterate(generate(request)),
    updates: (request) => iterate(run(request)),
    complete: (request) => runtime.runPromise(complete(request)).catch(rethrowTyped),
    close: () => runtime.dispose()
  }
}
