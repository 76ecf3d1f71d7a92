/**
 * Live `DataPlane` over the transport layer's authenticated TCP/Unix data plane
 * (src/layers/transport/DataPlane.ts): one listener per process, one connection per edge.
 */
import { Effect, Layer, Redacted } from "effect"
import { ConnectFailed } from "../domain/frames.js"
import { DataPlane, type DataPlaneService } from "../services/AgentLinks.js"
import * as Transport from "../layers/transport/DataPlane.js"

export const dataPlane: DataPlaneService = {
  listen: (address, token) =>
    Transport.listen({ address, token: Redacted.make(token) }).pipe(
      Effect.mapError((failed) => new ConnectFailed({ detail: `cannot listen: ${failed.detail}` })),
      Effect.map((listener) => ({
        address: listener.address,
        accept: (edge) =>
          listener.register({ runId: edge.runId, edgeId: edge.edgeId, ring: edge.ring }).pipe(
            Effect.map((receiver) => ({ receive: receiver.take }))
          )
      }))
    ),
  connect: (address, edge, token) =>
    Transport.connect({ address, token: Redacted.make(token), runId: edge.runId, edgeId: edge.edgeId, ring: edge.ring }).pipe(
      Effect.map((sender) => ({ send: sender.send }))
    )
}

export const dataPlaneLayer: Layer.Layer<DataPlane> = Layer.succeed(DataPlane, dataPlane)
