/**
 * Live `DataPlane` over the transport layer's authenticated TCP/Unix data plane
 * (src/layers/transport/EdgeTransport.ts): one listener per process, one connection per edge.
 *
 * An edge to a Unix-socket listener is on this machine, so its frames go through a shared-memory
 * ring (ShmRing.ts) when /dev/shm can hold it; the socket then carries only the attach, doorbells
 * and faults. TCP edges stay plain sockets.
 */
import { statfsSync } from "node:fs"
import { Effect, ExecutionStrategy, Exit, Layer, Redacted, Scope } from "effect"
import { ConnectFailed, type TransportAddress } from "../../domain/frames.js"
import { DataPlane, type DataPlaneService } from "../../services/AgentLinks.js"
import * as Transport from "../transport/EdgeTransport.js"
import * as ShmRing from "../transport/ShmRing.js"

let shmSupported: boolean | undefined

/**
 * Shared memory for a same-host edge: Linux with /dev/shm, and room there for the ring several times
 * over (a tmpfs that fills up turns a write into the ring into SIGBUS, so a small /dev/shm means sockets).
 */
const useSharedMemory = (address: TransportAddress, ringBytes: number): boolean => {
  if (address._tag !== "Unix") return false
  shmSupported ??= ShmRing.isSupported()
  if (!shmSupported) return false
  try {
    const fs = statfsSync("/dev/shm")
    return fs.bavail * fs.bsize >= 8 * (ringBytes + ShmRing.CONTROL_BYTES)
  } catch {
    return false
  }
}

export const dataPlane: DataPlaneService = {
  listen: (address, token) =>
    Transport.listen({ address, token: Redacted.make(token) }).pipe(
      Effect.mapError((failed) => new ConnectFailed({ detail: `cannot listen: ${failed.detail}` })),
      Effect.map((listener) => ({
        address: listener.address,
        accept: (edge) =>
          listener
            .register({
              runId: edge.runId,
              edgeId: edge.edgeId,
              ring: edge.ring,
              reassemble: edge.reassemble,
              initialStep: edge.initialStep
            })
            .pipe(Effect.map((receiver) => ({ receive: receiver.take })))
      }))
    ),
  // Each attempt gets a scope of its own, closed when it fails: callers retry while the consumer has not
  // registered the edge yet, and a refused attempt must not keep its socket or ring until the edge ends.
  connect: (address, edge, token) =>
    Effect.gen(function* () {
      const attempt = yield* Scope.fork(yield* Effect.scope, ExecutionStrategy.sequential)
      return yield* Transport.connect({
        address,
        token: Redacted.make(token),
        runId: edge.runId,
        edgeId: edge.edgeId,
        ring: edge.ring,
        sharedMemory: useSharedMemory(address, edge.ring.dataCapacity)
      }).pipe(
        Effect.map((sender) => ({ send: sender.send })),
        Scope.extend(attempt),
        Effect.onExit((exit) => (Exit.isSuccess(exit) ? Effect.void : Scope.close(attempt, exit)))
      )
    })
}

export const layerDataPlane: Layer.Layer<DataPlane> = Layer.succeed(DataPlane, dataPlane)
