/**
 * Serving from code: `serve(options)` is a layer holding one warm pipeline (local agents, or remote nodes with
 * `nodes` + `token`); `Server.generate(request)` is a Stream of events per request (Admitted, Text…, Done),
 * many at once, admitted by the KV budget. `completion(request)` collects one into text and counts.
 * The HTTP front (`swactor serve`) is src/layers/server/HttpServe.ts over the same service; the Server itself is
 * src/layers/server/ServerLive.ts.
 */
import { Effect, Layer, Stream } from "effect"
import * as ServerLive from "../layers/server/ServerLive.js"
import * as PromptTokenizer from "../layers/server/PromptTokenizer.js"
import type { LocalPoolOptions } from "../layers/agent/AgentPools.js"
import { type FinishReason, Server, type ServeError, type ServeOptions, type ServeRequest } from "../services/Server.js"
import { layerLocal, layerRemote } from "./generate.js"
import { poolAddresses } from "../services/DiscoveredPool.js"

export type { ServeOptions }
export { Server }

export interface ServeLayerOptions extends ServeOptions {
  /** Remote agents (host:port); omit to start `stages` local agent processes. */
  readonly agents?: ReadonlyArray<string>
  /** Cluster token of the remote agents. */
  readonly token?: string
  /** Local agents: how they are started (threads, extra arguments, a callback with their pids). */
  readonly local?: LocalPoolOptions
}

/** A Server with its own warm pipeline, set up in the background when the layer is built. */
export const serve = (options: ServeLayerOptions): Layer.Layer<Server> => {
  const { local, agents: nodes, token, ...serveOptions } = options
  const orchestrator =
    nodes !== undefined && nodes.length > 0
      ? layerRemote({
          agents: nodes,
          token: token ?? "",
          // serve --discover: each pipeline (a re-plan's too) is set up on the nodes heard then
          ...(options.discovered === undefined ? {} : { current: Effect.map(options.discovered.view, poolAddresses) })
        })
      : layerLocal({ ...(options.threads === undefined ? {} : { threads: options.threads }), ...local })
  // Prompts tokenized and chats rendered on a worker thread: a long prompt never holds up other requests' tokens.
  return ServerLive.layer(serveOptions).pipe(
    Layer.provide(orchestrator),
    Layer.provide(PromptTokenizer.layerWorker(options.model))
  )
}

/** One request to the end: its text, why it ended, and the token counts. */
export const completion = (
  request: ServeRequest
): Effect.Effect<
  {
    readonly text: string
    readonly finishReason: FinishReason
    readonly promptTokens: number
    readonly completionTokens: number
  },
  ServeError,
  Server
> =>
  Effect.flatMap(Server, (server) =>
    server.generate(request).pipe(
      Stream.runFold(
        { text: "", finishReason: "length" as FinishReason, promptTokens: 0, completionTokens: 0 },
        (acc, event) =>
          event._tag === "Text"
            ? { ...acc, text: acc.text + event.text }
            : event._tag === "Done"
              ? {
                  ...acc,
                  finishReason: event.finishReason,
                  promptTokens: event.promptTokens,
                  completionTokens: event.completionTokens
                }
              : acc
      )
    )
  )
