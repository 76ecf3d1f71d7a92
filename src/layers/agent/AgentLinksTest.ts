/**
 * Test layer of the agent links (DataPlane, AgentControl) and AgentPool: an in-memory world for orchestrator
 * tests, a DataPlane over queues and an AgentControl whose agents are StageHosts in this process. Agents can be "killed" (their links fail) to test faults.
 */
import { Deferred, Effect, Either, Layer, Queue, Ref, Scope, Stream } from "effect"
import {
  type DataFrame,
  type EdgeFault,
  EdgeClosed,
  PeerClosed,
  PeerFaulted,
  type TransportAddress
} from "../../domain/frames.js"
import * as NodeAgent from "./NodeAgent.js"
import {
  AgentControl,
  AgentHello,
  AgentUnavailable,
  DataPlane,
  type DataPlaneService,
  type EdgeRef
} from "../../services/AgentLinks.js"
import type { NodeEndpoint } from "../../services/Membership.js"
import { AgentPool, type AgentSet } from "../../services/Orchestrator.js"

type Slot = Queue.Queue<Either.Either<DataFrame, EdgeFault>>

const keyOf = (address: TransportAddress) => (address._tag === "Tcp" ? `${address.host}:${address.port}` : address.path)

/** Sees every frame sent on the memory data plane, with its edge, as it is sent (tests count frames per edge). */
export type SendTap = (edge: EdgeRef, frame: DataFrame) => void

export const makeMemoryDataPlane = (onSend?: SendTap) =>
  Effect.gen(function* () {
    const listeners = new Map<string, Map<string, Slot>>()
    let nextPort = 40000
    const service: DataPlaneService = {
      listen: (address, _token) =>
        Effect.gen(function* () {
          const bound: TransportAddress = address._tag === "Tcp" ? { ...address, port: nextPort++ } : address
          const edges = new Map<string, Slot>()
          listeners.set(keyOf(bound), edges)
          yield* Effect.addFinalizer(() => Effect.sync(() => listeners.delete(keyOf(bound))))
          return {
            address: bound,
            accept: (edge) =>
              Effect.gen(function* () {
                const slot: Slot = yield* Queue.unbounded<Either.Either<DataFrame, EdgeFault>>()
                const key = `${edge.runId}/${edge.edgeId}`
                edges.set(key, slot)
                yield* Effect.addFinalizer(() =>
                  Effect.zipRight(
                    Effect.sync(() => edges.delete(key)),
                    Queue.shutdown(slot)
                  )
                )
                return {
                  receive: Queue.take(slot).pipe(
                    Effect.flatMap((item) =>
                      Either.isRight(item) ? Effect.succeed(item.right) : Effect.fail(item.left)
                    ),
                    Effect.catchAllDefect(() => Effect.fail(new EdgeClosed()))
                  )
                }
              })
          }
        }),
      connect: (address, edge, _token) =>
        Effect.gen(function* () {
          const edges = listeners.get(keyOf(address))
          if (edges === undefined)
            return yield* Effect.fail(new PeerFaulted({ reason: "UnknownRun", detail: "no listener" }))
          const slot = edges.get(`${edge.runId}/${edge.edgeId}`)
          if (slot === undefined)
            return yield* Effect.fail(new PeerFaulted({ reason: "UnknownEdge", detail: "not registered" }))
          yield* Effect.addFinalizer(() =>
            Queue.isShutdown(slot).pipe(
              Effect.flatMap((down) =>
                down ? Effect.void : Queue.offer(slot, Either.left(new PeerClosed({ detail: "sender closed" })))
              ),
              Effect.exit
            )
          )
          return {
            send: (frame) =>
              Queue.isShutdown(slot).pipe(
                Effect.flatMap((down) =>
                  down
                    ? Effect.fail(new PeerClosed({ detail: "receiver closed" }))
                    : Effect.zipRight(
                        Effect.sync(() => onSend?.(edge, frame)),
                        Queue.offer(slot, Either.right(frame))
                      )
                ),
                Effect.asVoid
              )
          }
        })
    }
    return service
  })

export interface MemoryAgent {
  readonly node: NodeEndpoint
  readonly host: NodeAgent.StageHost
  /** Simulates the agent process dying: every link to it fails from now on. */
  readonly kill: Effect.Effect<void>
}

/**
 * `count` agents as StageHosts over the given executor and data plane, with an AgentControl and an
 * AgentPool that serve them.
 */
export const makeMemoryWorld = (count: number, onSend?: SendTap) =>
  Effect.gen(function* () {
    const data = yield* makeMemoryDataPlane(onSend)
    const scope = yield* Effect.scope
    const agents: Array<MemoryAgent> = []
    const listenerAddresses = new Map<string, TransportAddress>()
    const dead = new Map<string, Deferred.Deferred<void>>()
    const exited = yield* Deferred.make<{ node: NodeEndpoint; reason: string }>()
    for (let i = 0; i < count; i++) {
      const node: NodeEndpoint = {
        nodeId: (i + 1) as NodeEndpoint["nodeId"],
        address: `mem-agent-${i}:7000`
      } as NodeEndpoint
      const listener = yield* data
        .listen({ _tag: "Tcp", host: `mem-agent-${i}`, port: 0 }, "token")
        .pipe(Scope.extend(scope))
      const host = yield* NodeAgent.makeStageHost(listener, { token: "token", threads: 1, backend: "cpu" }).pipe(
        Effect.provide(Layer.succeed(DataPlane, data)),
        Scope.extend(scope)
      )
      const gone = yield* Deferred.make<void>()
      dead.set(node.address, gone)
      agents.push({
        node,
        host,
        kill: Effect.zipRight(
          Deferred.succeed(gone, undefined),
          Deferred.succeed(exited, { node, reason: "killed" })
        ).pipe(Effect.asVoid)
      })
      listenerAddresses.set(node.address, listener.address)
    }
    const provisions = yield* Ref.make(0)
    const unavailable = (node: NodeEndpoint) =>
      new AgentUnavailable({ address: node.address, message: "agent process exited" })
    const control = AgentControl.of({
      connect: (node, _token) =>
        Effect.gen(function* () {
          const agent = agents.find((a) => a.node.address === node.address)
          if (agent === undefined) return yield* Effect.fail(unavailable(node))
          const gone = dead.get(node.address)!
          // A killed agent accepts no new connection either.
          if (yield* Deferred.isDone(gone)) return yield* Effect.fail(unavailable(node))
          const guard = <A, E>(effect: Effect.Effect<A, E>) =>
            Effect.raceFirst(effect, Effect.zipRight(Deferred.await(gone), Effect.fail(unavailable(node))))
          return {
            node,
            hello: new AgentHello({ dataAddress: listenerAddresses.get(node.address)!, pid: 0 }),
            capacity: guard(agent.host.capacity),
            provision: (request) =>
              Stream.unwrap(Ref.update(provisions, (n) => n + 1).pipe(Effect.as(agent.host.provision(request)))).pipe(
                Stream.interruptWhen(Effect.zipRight(Deferred.await(gone), Effect.fail(unavailable(node))))
              ),
            stop: (runId, stageIndex) => guard(agent.host.stop(runId, stageIndex)),
            dropCached: (entries, all) => guard(agent.host.dropCached?.(entries, all) ?? Effect.void)
          }
        })
    })
    const set: AgentSet = {
      nodes: agents.map((a) => a.node),
      token: "token",
      listenHost: "mem-orchestrator",
      exited: Deferred.await(exited)
    }
    const pool = AgentPool.of({ acquire: () => Effect.succeed(set) })
    return {
      agents,
      provisions,
      layer: Layer.mergeAll(
        Layer.succeed(DataPlane, data),
        Layer.succeed(AgentControl, control),
        Layer.succeed(AgentPool, pool)
      )
    }
  })
