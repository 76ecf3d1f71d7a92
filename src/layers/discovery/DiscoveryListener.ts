/**
 * The listener of announcements (issue 39): a UDP socket on the discovery port (shared, `reuseAddr`), joined to the
 * multicast group on each chosen interface, that reads each datagram with the cluster token (DiscoveryProof.ts) into
 * the discovered set (src/domain/discovery.ts): the verified nodes, the refused senders and why, the senders of another
 * protocol version and why, and the ids two live nodes announce (refused, both named, logged as a warning). A join
 * (a node's unicast announcement, `--join`) heard here is verified, then handed to `relay` when given.
 */
import * as Dgram from "node:dgram"
import { Effect, Queue, Redacted, type Scope } from "effect"
import {
  DISCOVERY_GROUP,
  DISCOVERY_PORT,
  buryAddress,
  type Discovered,
  type DiscoveryView,
  emptyDiscovered,
  expireDiscovered,
  hear,
  viewOf
} from "../../domain/discovery.js"
import { readDatagram, relayedDatagram } from "./DiscoveryProof.js"
import { discoveryInterfaces, type InterfaceChoice } from "./NetInterfaces.js"

export interface ListenerOptions {
  readonly token: Redacted.Redacted<string>
  /** The UDP port to bind (default DISCOVERY_PORT; 0: any, see `port`). */
  readonly port?: number | undefined
  readonly group?: string | undefined
  readonly interfaces?: InterfaceChoice | undefined
  /** How long a refused sender or one of another version stays listed without being heard again (default 10 s). */
  readonly listingMillis?: number | undefined
  /** The clock (default Date.now). */
  readonly now?: (() => number) | undefined
  /**
   * Where a verified join (an announcement a node sent here by unicast, `--join`) goes on, relayed (a node's
   * announcer: onto its LAN). None: joins are only heard.
   */
  readonly relay?: ((message: Buffer) => Effect.Effect<void>) | undefined
}

export interface DiscoveryListener {
  /** The port bound. */
  readonly port: number
  /** The discovered set now (expired to now). */
  readonly view: Effect.Effect<DiscoveryView>
  /** The node at this control address was found dead: not listed again until it restarts (`buryAddress`). */
  readonly bury: (address: string) => Effect.Effect<void>
}

const bindListener = (options: ListenerOptions) =>
  Effect.acquireRelease(
    Effect.async<Dgram.Socket, Error>((resume) => {
      const socket = Dgram.createSocket({ type: "udp4", reuseAddr: true })
      socket.once("error", (cause) => {
        socket.close()
        resume(Effect.fail(cause))
      })
      socket.bind(options.port ?? DISCOVERY_PORT, () => {
        socket.removeAllListeners("error")
        socket.on("error", () => {})
        resume(Effect.succeed(socket))
      })
    }),
    (socket) => Effect.sync(() => socket.close()).pipe(Effect.ignore)
  )

/** Joins the group on each interface; one that refuses is skipped (broadcast and unicast still arrive). */
const joinGroup = (socket: Dgram.Socket, options: ListenerOptions) =>
  Effect.sync(() => {
    for (const iface of discoveryInterfaces(options.interfaces)) {
      try {
        socket.addMembership(options.group ?? DISCOVERY_GROUP, iface.address)
      } catch {
        // not a multicast interface: broadcast and unicast reach the socket anyway
      }
    }
  })

/** Listens until the scope closes. Fails when the port cannot be bound. */
export const makeDiscoveryListener = (options: ListenerOptions): Effect.Effect<DiscoveryListener, Error, Scope.Scope> =>
  Effect.gen(function* () {
    const now = options.now ?? Date.now
    const listing = options.listingMillis ?? 10_000
    const socket = yield* bindListener(options)
    yield* joinGroup(socket, options)
    const heard = yield* Queue.sliding<{ message: Buffer; from: string }>(4096)
    socket.on("message", (message, info) => {
      Queue.unsafeOffer(heard, { message, from: `${info.address}:${info.port}` })
    })
    let state: Discovered = emptyDiscovered
    const take = Queue.take(heard).pipe(
      Effect.flatMap(({ message, from }) => {
        const before = state.conflicts
        const read = readDatagram(options.token, message, from)
        state = hear(expireDiscovered(state, now()), read, now(), listing)
        const fresh = viewOf(state).conflicts.filter((c) => !before.has(c.nodeId))
        const relayed =
          read._tag === "Verified" && read.relayed !== true && read.announcement.join === true
            ? relayedDatagram(options.token, message, from)
            : undefined
        return Effect.zipRight(
          Effect.forEach(fresh, (conflict) => Effect.logWarning(conflict.reason), { discard: true }),
          relayed === undefined || options.relay === undefined ? Effect.void : options.relay(relayed)
        )
      })
    )
    yield* Effect.forkScoped(Effect.forever(take))
    return {
      port: socket.address().port,
      view: Effect.sync(() => {
        state = expireDiscovered(state, now())
        return viewOf(state)
      }),
      bury: (address) =>
        Effect.sync(() => {
          state = buryAddress(state, address)
        })
    }
  })
