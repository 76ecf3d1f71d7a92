import { Clock, Deferred, Duration, Effect, Layer, Option, Ref, type Scope, Stream, SubscriptionRef } from "effect"
import type { NodeId } from "../../domain/ids.js"
import {
  Membership,
  type MembershipService,
  type NodeCapacity,
  type NodeEndpoint,
  NodeLost,
  type NodeProbeService,
  NodeUnreachable,
  PoolNotReady,
  type NodeStatus
} from "../../services/Membership.js"

type StatusMap = ReadonlyMap<NodeId, NodeStatus>

const setStatus = (map: StatusMap, nodeId: NodeId, status: NodeStatus): StatusMap => {
  const next = new Map(map)
  next.set(nodeId, status)
  return next
}

const errorText = (status: NodeStatus | undefined) =>
  status === undefined
    ? "never probed"
    : status._tag === "Unknown"
      ? status.lastError
      : status._tag === "Lost"
        ? status.lost.reason
        : "up"

/** One watched pool: its nodes, their prober, the heartbeat timings, the nodes' status and the first loss. */
interface Watch {
  readonly nodes: ReadonlyArray<NodeEndpoint>
  readonly prober: Parameters<MembershipService["watch"]>[1]
  readonly interval: Duration.Duration
  readonly deadline: Duration.Duration
  readonly deadlineMillis: number
  readonly state: SubscriptionRef.SubscriptionRef<StatusMap>
  readonly firstLost: Deferred.Deferred<NodeLost>
}

const markLost = (w: Watch, node: NodeEndpoint, reason: string) =>
  SubscriptionRef.modify(w.state, (map) => {
    const current = map.get(node.nodeId)
    if (current?._tag === "Lost") return [Option.none<NodeLost>(), map] as const
    const lost = new NodeLost({
      node,
      lastSeenMillis: current?._tag === "Up" ? current.lastSeenMillis : null,
      reason
    })
    return [Option.some(lost), setStatus(map, node.nodeId, { _tag: "Lost", lost })] as const
  }).pipe(
    Effect.flatMap(
      Option.match({
        onNone: () => Effect.void,
        onSome: (lost) => Deferred.succeed(w.firstLost, lost).pipe(Effect.asVoid)
      })
    )
  )

/** Probes `node` every interval until it is lost (no answer for the deadline, or marked lost). */
const heartbeat = (w: Watch, node: NodeEndpoint) =>
  Effect.gen(function* () {
    const { state, interval, deadline, deadlineMillis } = w
    const lastSeen = yield* Ref.make<number | null>(null)
    while (true) {
      const current = (yield* SubscriptionRef.get(state)).get(node.nodeId)
      if (current?._tag === "Lost") return
      const answer = yield* w.prober.probe(node).pipe(
        Effect.timeoutFail({
          duration: Duration.min(interval, deadline),
          onTimeout: () =>
            new NodeUnreachable({ nodeId: node.nodeId, address: node.address, message: "heartbeat timed out" })
        }),
        Effect.either
      )
      const now = yield* Clock.currentTimeMillis
      if (answer._tag === "Right") {
        yield* Ref.set(lastSeen, now)
        yield* SubscriptionRef.update(state, (map) =>
          map.get(node.nodeId)?._tag === "Lost"
            ? map
            : setStatus(map, node.nodeId, { _tag: "Up", capacity: answer.right, lastSeenMillis: now })
        )
      } else {
        const seen = yield* Ref.get(lastSeen)
        if (seen === null) {
          yield* SubscriptionRef.update(state, (map) =>
            map.get(node.nodeId)?._tag === "Lost"
              ? map
              : setStatus(map, node.nodeId, { _tag: "Unknown", lastError: answer.left.message })
          )
        } else if (now - seen >= deadlineMillis) {
          yield* markLost(
            w,
            node,
            `no heartbeat answer for ${now - seen} ms (deadline ${deadlineMillis} ms): ${answer.left.message}`
          )
          return
        }
      }
      yield* Effect.sleep(interval)
    }
  })

/** The pool was not ready in time: which needed nodes are missing, and why. */
const notReady = (w: Watch, needed: ReadonlyArray<NodeId>, timeout: Duration.DurationInput) =>
  SubscriptionRef.get(w.state).pipe(
    Effect.flatMap((map) => {
      const { nodes } = w
      const missing = nodes.filter((node) => needed.includes(node.nodeId) && map.get(node.nodeId)?._tag !== "Up")
      const unknown = needed.filter((nodeId) => !nodes.some((node) => node.nodeId === nodeId))
      return Effect.fail(
        new PoolNotReady({
          missing,
          waitedMillis: Duration.toMillis(Duration.decode(timeout)),
          lastError:
            unknown.length > 0
              ? `nodes ${unknown.join(", ")} are not in the pool`
              : missing.map((node) => `${node.address}: ${errorText(map.get(node.nodeId))}`).join("; ")
        })
      )
    })
  )

const awaitReady = (w: Watch, needed: ReadonlyArray<NodeId>, timeout: Duration.DurationInput) =>
  w.state.changes.pipe(
    Stream.filterMap((map) => {
      const up = new Map<NodeId, NodeCapacity>()
      for (const nodeId of needed) {
        const status = map.get(nodeId)
        if (status?._tag !== "Up") return Option.none()
        up.set(nodeId, status.capacity)
      }
      return Option.some(up as ReadonlyMap<NodeId, NodeCapacity>)
    }),
    Stream.runHead,
    Effect.flatten,
    Effect.timeoutFail({
      duration: timeout,
      onTimeout: () => undefined
    }),
    Effect.catchAll(() => notReady(w, needed, timeout))
  )

/** A lost node back: Unknown again, and heartbeats resume (in the watch's scope). */
const rejoin = (w: Watch, watchScope: Scope.Scope, nodeId: NodeId) => {
  const node = w.nodes.find((candidate) => candidate.nodeId === nodeId)
  if (node === undefined) return Effect.void
  return SubscriptionRef.modify(w.state, (map) =>
    map.get(nodeId)?._tag === "Lost"
      ? ([true, setStatus(map, nodeId, { _tag: "Unknown", lastError: "rejoined, no answer yet" })] as const)
      : ([false, map] as const)
  ).pipe(
    Effect.flatMap((revived) => (revived ? Effect.forkIn(heartbeat(w, node), watchScope) : Effect.void)),
    Effect.asVoid
  )
}

const watch: MembershipService["watch"] = (nodes, prober, options) =>
  Effect.gen(function* () {
    const interval = Duration.decode(options.interval)
    const deadline = Duration.decode(options.deadline)
    const w: Watch = {
      nodes,
      prober,
      interval,
      deadline,
      deadlineMillis: Duration.toMillis(deadline),
      state: yield* SubscriptionRef.make<StatusMap>(
        new Map(nodes.map((node) => [node.nodeId, { _tag: "Unknown", lastError: "no answer yet" } as NodeStatus]))
      ),
      firstLost: yield* Deferred.make<NodeLost>()
    }
    yield* Effect.forkScoped(
      Effect.forEach(nodes, (node) => heartbeat(w, node), { concurrency: "unbounded", discard: true })
    )
    const watchScope = yield* Effect.scope
    return {
      nodes,
      status: SubscriptionRef.get(w.state),
      awaitReady: (needed: ReadonlyArray<NodeId>, timeout: Duration.DurationInput) => awaitReady(w, needed, timeout),
      firstLost: Deferred.await(w.firstLost),
      markLost: (nodeId: NodeId, reason: string) => {
        const node = nodes.find((candidate) => candidate.nodeId === nodeId)
        return node === undefined ? Effect.void : markLost(w, node, reason)
      },
      rejoin: (nodeId: NodeId) => rejoin(w, watchScope, nodeId)
    }
  })

/** Heartbeats every node of a pool through `NodeProbe`, on Effect's Clock (so TestClock drives it in tests). */
export const make = (): MembershipService => Membership.of({ watch })

/** Membership over the probe each `watch` is given (control-plane heartbeats live, in-memory in tests). */
export const layer: Layer.Layer<Membership> = Layer.sync(Membership, make)

/** An in-memory world of nodes for tests: each node answers, hangs, or refuses. */
export interface TestNodes {
  readonly set: (nodeId: NodeId, behaviour: TestNodeBehaviour) => Effect.Effect<void>
  readonly probe: NodeProbeService
}
export type TestNodeBehaviour =
  | { readonly _tag: "Answers"; readonly capacity: NodeCapacity }
  | { readonly _tag: "Hangs" }
  | { readonly _tag: "Refuses"; readonly message: string }

export const makeTestNodes = (initial: ReadonlyMap<NodeId, TestNodeBehaviour>) =>
  Effect.gen(function* () {
    const behaviours = yield* Ref.make(initial)
    const probe: NodeProbeService = {
      probe: (node) =>
        Ref.get(behaviours).pipe(
          Effect.flatMap((map) => {
            const behaviour = map.get(node.nodeId)
            if (behaviour === undefined || behaviour._tag === "Refuses") {
              return Effect.fail(
                new NodeUnreachable({
                  nodeId: node.nodeId,
                  address: node.address,
                  message: behaviour?._tag === "Refuses" ? behaviour.message : "connection refused"
                })
              )
            }
            return behaviour._tag === "Hangs" ? Effect.never : Effect.succeed(behaviour.capacity)
          })
        )
    }
    return {
      set: (nodeId, behaviour) => Ref.update(behaviours, (map) => new Map(map).set(nodeId, behaviour)),
      probe
    } satisfies TestNodes
  })
