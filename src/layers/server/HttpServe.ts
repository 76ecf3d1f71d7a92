/**
 * The OpenAI-compatible HTTP front of a Server: its routes (HttpRoutes.ts) behind the caller guard, on Node's HTTP
 * server with the connection limits (HttpListener.ts). Bodies and the requests they ask for are OpenAiBodies.ts,
 * errors OpenAiErrors.ts (OpenAI's `{"error":{...}}` with the status and Retry-After), whole answers
 * OpenAiWholeAnswers.ts, streams OpenAiSse.ts, /metrics MetricsText.ts. A client that goes away interrupts its handler,
 * which cancels the run (its stages stop, its KV is freed).
 */
import type { Server as NodeServer } from "node:http"
import * as HttpServer from "@effect/platform/HttpServer"
import * as NodeHttpServer from "@effect/platform-node/NodeHttpServer"
import { Effect, Layer } from "effect"
import type { Server } from "../../services/Server.js"
import { apiKeys } from "./HttpGuard.js"
import { guarded, router } from "./HttpRoutes.js"
import { type ConnectionStats, type ListenError, listenError, makeNodeServer } from "./HttpListener.js"
import { type HttpServeOptions, limitsOf } from "./HttpServeOptions.js"

export { ChatBody, CompletionBody } from "./OpenAiBodies.js"
export { type ConnectionStats, ListenError } from "./HttpListener.js"
export { type HttpServeOptions, limitsOf } from "./HttpServeOptions.js"
export { renderMetrics } from "./MetricsText.js"
export { router } from "./HttpRoutes.js"

/**
 * Serves the routes on Node's HTTP server until the scope closes; open connections are cut on close (their
 * runs are cancelled), so shutting down never waits on a client. Fails with a ListenError when it cannot listen.
 */
export const layer = (options: HttpServeOptions, modelPath: string): Layer.Layer<never, ListenError, Server> => {
  const limits = limitsOf(options)
  const host = options.host ?? "127.0.0.1"
  const port = options.port ?? 8080
  let nodeServer: NodeServer | undefined
  const connections: ConnectionStats = { open: 0, refused: 0, dropped: 0 }
  const evaluate = () => (nodeServer = makeNodeServer(limits, connections))
  const app = Layer.unwrapEffect(
    Effect.map(router(options, modelPath, connections), (routes) =>
      HttpServer.serve(guarded(routes, host, limits, apiKeys(options.apiKeys ?? [])))
    )
  )
  const announce = Layer.scopedDiscard(
    Effect.gen(function* () {
      const server = yield* HttpServer.HttpServer
      yield* Effect.addFinalizer(() => Effect.sync(() => nodeServer?.closeAllConnections()))
      if (server.address._tag === "TcpAddress")
        options.onListening?.({ host: server.address.hostname, port: server.address.port })
    })
  )
  return Layer.mergeAll(app, announce).pipe(
    Layer.provide(
      NodeHttpServer.layer(evaluate, { port, host }).pipe(
        Layer.mapError((error) => listenError(host, port, error.cause))
      )
    )
  )
}
