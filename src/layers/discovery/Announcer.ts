/**
 * A node's announcements on the LAN (issue 39): every `intervalMillis`, a proved datagram (DiscoveryProof.ts) by UDP
 * multicast and broadcast on each chosen interface (NetInterfaces.ts, listed again each time, so an interface that
 * comes up later is used), and by unicast to the `targets` given (`--join`: marked as joins, so that a node hearing one
 * relays it onto its own LAN, `relay`). Each interface has its own socket bound to its
 * address; a send that fails is transient: the interface's socket is dropped, the failure kept for `failures`, and
 * the next round opens it again. On a clean stop (the scope closing) a `leave` goes out the same ways.
 */
import * as Dgram from "node:dgram"
import { Duration, Effect, Redacted, Schedule, type Scope } from "effect"
import { type Announcement, DISCOVERY_GROUP, DISCOVERY_PORT, type NodeResources } from "../../domain/discovery.js"
import { signedDatagram } from "./DiscoveryProof.js"
import { type DiscoveryInterface, discoveryInterfaces, type InterfaceChoice } from "./NetInterfaces.js"

export interface AnnouncerOptions {
  readonly token: Redacted.Redacted<string>
  readonly nodeId: string
  /** The node's control address, host:port. */
  readonly address: string
  /** The node's resources now (read for each announcement). */
  readonly resources: () => NodeResources
  readonly interfaces?: InterfaceChoice | undefined
  /** The UDP port listeners bind (default DISCOVERY_PORT). */
  readonly port?: number | undefined
  readonly group?: string | undefined
  /** Unicast destinations besides the LAN's (host:port). */
  readonly targets?: ReadonlyArray<string> | undefined
  /** Multicast and broadcast on the interfaces (default true; false: the targets only). */
  readonly lan?: boolean | undefined
  readonly intervalMillis?: number | undefined
  readonly ttlMillis?: number | undefined
  /** This run's start (default now). */
  readonly startedAt?: number | undefined
}

/** A running announcer. */
export interface Announcer {
  /** Announcements sent so far (rounds). */
  readonly rounds: Effect.Effect<number>
  /** The interfaces (or targets) whose last send failed, with why. */
  readonly failures: Effect.Effect<ReadonlyMap<string, string>>
  /** Sends a datagram (a relayed join) on this announcer's interfaces, by multicast and broadcast. */
  readonly relay: (message: Buffer) => Effect.Effect<void>
}

interface AnnouncerState {
  readonly options: AnnouncerOptions
  readonly sockets: Map<string, Dgram.Socket>
  readonly failures: Map<string, string>
  counter: number
}

/**
 * Sends this socket's multicast out of `iface`. Where the system refuses the option (qemu-user answers ENOPROTOOPT
 * for IP_MULTICAST_IF), multicast follows the routing table and broadcast, bound to the interface's address, still
 * goes out on it: the node announces and keeps running.
 */
const pinMulticast = (socket: Dgram.Socket, iface: DiscoveryInterface | undefined) => {
  if (iface === undefined) return
  try {
    socket.setMulticastInterface(iface.address)
  } catch {
    // the routing table chooses the multicast interface
  }
}

const openSocket = (bindAddress: string | undefined, iface: DiscoveryInterface | undefined) =>
  Effect.async<Dgram.Socket, Error>((resume) => {
    const socket = Dgram.createSocket("udp4")
    socket.once("error", (cause) => {
      socket.close()
      resume(Effect.fail(cause))
    })
    socket.bind({ port: 0, ...(bindAddress === undefined ? {} : { address: bindAddress }) }, () => {
      socket.removeAllListeners("error")
      socket.on("error", () => {})
      try {
        socket.setBroadcast(true)
      } catch (cause) {
        socket.close()
        resume(Effect.fail(cause instanceof Error ? cause : new Error(String(cause))))
        return
      }
      pinMulticast(socket, iface)
      resume(Effect.succeed(socket))
    })
  })

const sendTo = (socket: Dgram.Socket, message: Buffer, port: number, host: string) =>
  Effect.async<void, Error>((resume) => {
    try {
      socket.send(message, port, host, (cause) => resume(cause ? Effect.fail(cause) : Effect.void))
    } catch (cause) {
      resume(Effect.fail(cause instanceof Error ? cause : new Error(String(cause))))
    }
  })

const closeSocket = (socket: Dgram.Socket) => Effect.sync(() => socket.close()).pipe(Effect.ignore)

/** One destination's sends on its socket (opened when missing); a failure drops the socket and is kept. */
const sendOn = (
  state: AnnouncerState,
  key: string,
  open: Effect.Effect<Dgram.Socket, Error>,
  sends: (socket: Dgram.Socket) => Effect.Effect<void, Error>
) =>
  Effect.gen(function* () {
    const known = state.sockets.get(key)
    const socket = known ?? (yield* open)
    state.sockets.set(key, socket)
    yield* sends(socket)
    state.failures.delete(key)
  }).pipe(
    Effect.catchAll((cause) =>
      Effect.gen(function* () {
        state.failures.set(key, cause.message)
        const socket = state.sockets.get(key)
        state.sockets.delete(key)
        if (socket !== undefined) yield* closeSocket(socket)
      })
    )
  )

const hostPort = (target: string): [string, number] => {
  const at = target.lastIndexOf(":")
  return [target.slice(0, at), Number(target.slice(at + 1))]
}

const interfaceKey = (iface: DiscoveryInterface) => `${iface.name} ${iface.address}`

/** An interface no longer listed (down, or its address gone): its socket closed, its failure forgotten. */
const forgetGone = (state: AnnouncerState, current: ReadonlySet<string>) =>
  Effect.forEach(
    [...new Set([...state.sockets.keys(), ...state.failures.keys()])].filter((key) => !current.has(key)),
    (key) => {
      const socket = state.sockets.get(key)
      state.sockets.delete(key)
      state.failures.delete(key)
      return socket === undefined ? Effect.void : closeSocket(socket)
    },
    { discard: true }
  )

/** `message` by multicast and broadcast on each chosen interface (none with `lan: false`). */
const onLan = (state: AnnouncerState, lan: ReadonlyArray<DiscoveryInterface>, message: Buffer) => {
  const port = state.options.port ?? DISCOVERY_PORT
  const group = state.options.group ?? DISCOVERY_GROUP
  return lan.map((iface) =>
    sendOn(state, interfaceKey(iface), openSocket(iface.address, iface), (socket) =>
      Effect.zipRight(sendTo(socket, message, port, group), sendTo(socket, message, port, iface.broadcast))
    )
  )
}

const lanInterfaces = (options: AnnouncerOptions) =>
  options.lan === false ? [] : discoveryInterfaces(options.interfaces)

/**
 * One round: the announcement (or leave) to every interface, and to every target marked as a join (a node hearing it
 * relays it onto its LAN).
 */
const sendRound = (state: AnnouncerState, kind: Announcement["kind"]) =>
  Effect.suspend(() => {
    const { options } = state
    const announcement: Announcement = {
      kind,
      nodeId: options.nodeId,
      address: options.address,
      startedAt: options.startedAt ?? 0,
      counter: state.counter++,
      ttlMillis: options.ttlMillis ?? 5000,
      resources: options.resources()
    }
    const message = signedDatagram(options.token, announcement)
    const joinMessage = signedDatagram(options.token, { ...announcement, join: true })
    const lan = lanInterfaces(options)
    const gone = forgetGone(state, new Set([...lan.map(interfaceKey), ...(options.targets ?? [])]))
    const onTargets = (options.targets ?? []).map((target) =>
      sendOn(state, target, openSocket(undefined, undefined), (socket) => {
        const [host, targetPort] = hostPort(target)
        return sendTo(socket, joinMessage, targetPort, host)
      })
    )
    return Effect.zipRight(
      gone,
      Effect.all([...onLan(state, lan, message), ...onTargets], { concurrency: "unbounded", discard: true })
    )
  })

/** Announces the node until the scope closes, then sends its leave. */
export const makeAnnouncer = (options: AnnouncerOptions): Effect.Effect<Announcer, never, Scope.Scope> =>
  Effect.gen(function* () {
    const state: AnnouncerState = {
      options: { ...options, startedAt: options.startedAt ?? Date.now() },
      sockets: new Map(),
      failures: new Map(),
      counter: 0
    }
    let rounds = 0
    yield* Effect.addFinalizer(() =>
      sendRound(state, "leave").pipe(
        Effect.timeout(Duration.seconds(1)),
        Effect.ignore,
        Effect.zipRight(Effect.forEach([...state.sockets.values()], closeSocket, { discard: true }))
      )
    )
    // The second round follows the first after a quarter interval: a running server uses a node from its second
    // announcement on (src/layers/server/Replan.ts), so a node starting is used sooner; then every interval.
    const interval = options.intervalMillis ?? 1000
    const announce = sendRound(state, "announce").pipe(Effect.tap(() => Effect.sync(() => rounds++)))
    yield* announce.pipe(
      Effect.zipRight(Effect.sleep(Duration.millis(Math.round(interval / 4)))),
      Effect.zipRight(announce.pipe(Effect.repeat(Schedule.spaced(Duration.millis(interval))))),
      Effect.forkScoped
    )
    return {
      rounds: Effect.sync(() => rounds),
      failures: Effect.sync(() => new Map(state.failures)),
      relay: (message) =>
        Effect.suspend(() =>
          Effect.all(onLan(state, lanInterfaces(state.options), message), { concurrency: "unbounded", discard: true })
        )
    }
  })
