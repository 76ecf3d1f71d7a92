/**
 * LAN discovery (issue 39), the pure half: what a node announces, the datagram that carries it, and the set of nodes
 * a listener builds from what it hears. The HMAC and the sockets are in src/layers/discovery.
 *
 * A datagram is JSON text: `{ swactor: "discovery", protocol, nonce, proof, body }`. `body` is the announcement's
 * own JSON text, kept as sent, so the proof (HMAC-SHA256 keyed by the cluster token over a label, the nonce and
 * `body`'s bytes) is checked over exactly the bytes that were signed. The token never travels. `protocol` sits outside
 * the body so that a node of another protocol version is named as such (and why it is not used) even where its body
 * or its proof is one this node cannot read.
 *
 * Ghosts: an announcement lives `ttlMillis` from when it was heard; a node that stops cleanly sends a `leave`. A node
 * that left or expired is remembered as dead at its last (startedAt, counter): an announcement not newer than that
 * (a late or replayed datagram) does not bring it back; a restarted node (a newer `startedAt`) does.
 */
import { Schema } from "effect"

/** The discovery protocol this release speaks. */
export const DISCOVERY_PROTOCOL = 1

/** The datagram's marker, so that other traffic on the port is told apart from a bad announcement. */
export const DISCOVERY_MARKER = "swactor-discovery"

/** The UDP port and the IPv4 multicast group (administratively scoped) announcements go to by default. */
export const DISCOVERY_PORT = 41739
export const DISCOVERY_GROUP = "239.255.41.39"

/**
 * A GGUF slice a node holds in its slice cache (weight delivery, or fetched from the hub): the model it is of, its
 * blocks, its size and the head of its content hash. An orchestrator can see which nodes already hold which blocks.
 */
export const CachedSlice = Schema.Struct({
  /** The model's `general.name`, else its architecture. */
  model: Schema.String,
  /** The first 16 hex digits of the slice's tensor hash (its cache file name). */
  hash: Schema.String,
  layerStart: Schema.Number,
  layerEndExclusive: Schema.Number,
  /** The model's block count. */
  numLayers: Schema.Number,
  bytes: Schema.Number
})
export type CachedSlice = typeof CachedSlice.Type

/** At most this many cached slices go in one announcement (the newest), keeping it one datagram. */
export const MAX_ANNOUNCED_SLICES = 32

/** What a node offers: its memory, its cores, its backend and, when it knows them, its GPU's memory, its cached slices. */
export const NodeResources = Schema.Struct({
  totalMemoryBytes: Schema.Number,
  freeMemoryBytes: Schema.Number,
  cores: Schema.Number,
  backend: Schema.String,
  gpuTotalBytes: Schema.optional(Schema.Number),
  gpuFreeBytes: Schema.optional(Schema.Number),
  /** The slices in its slice cache (absent from nodes before this field: read as none). */
  cached: Schema.optional(Schema.Array(CachedSlice))
})
export type NodeResources = typeof NodeResources.Type

/** One announcement: a node is here (`announce`), or has stopped (`leave`). */
export const Announcement = Schema.Struct({
  kind: Schema.Literal("announce", "leave"),
  /** The node's persistent id (its state folder's). */
  nodeId: Schema.String,
  /** The node's control address, host:port. */
  address: Schema.String,
  /** When this run of the node started (its clock, ms): a restart is newer. */
  startedAt: Schema.Number,
  /** Counts this run's announcements, from 0: a later one is newer. */
  counter: Schema.Number,
  /** How long a listener keeps the node without hearing from it again. */
  ttlMillis: Schema.Number,
  resources: NodeResources,
  /**
   * Sent by unicast to a `--join` address (not on the LAN): a node that hears it relays it onto its own LAN, so a
   * node joining through any pool member reaches an orchestrator its multicast does not.
   */
  join: Schema.optional(Schema.Boolean)
})
export type Announcement = typeof Announcement.Type

/** The datagram around an announcement's JSON text. */
export const DiscoveryDatagram = Schema.Struct({
  swactor: Schema.Literal(DISCOVERY_MARKER),
  protocol: Schema.Number,
  nonce: Schema.String,
  proof: Schema.String,
  body: Schema.String,
  /**
   * A join announcement relayed by the node that heard it: the joiner's address as that node saw it (`from`), proved
   * by the relaying node over `from` and the joiner's own proof (`relayInput`). Relayed datagrams are never relayed.
   */
  relay: Schema.optional(Schema.Struct({ from: Schema.String, proof: Schema.String }))
})
export type DiscoveryDatagram = typeof DiscoveryDatagram.Type

const datagramJson = Schema.parseJson(DiscoveryDatagram)
const announcementJson = Schema.parseJson(Announcement)

/** The datagram's text. */
export const encodeDatagram = (datagram: DiscoveryDatagram): string => Schema.encodeSync(datagramJson)(datagram)
/** The datagram of a text (Left: it is not one). */
export const decodeDatagram = Schema.decodeUnknownEither(datagramJson)
/** An announcement's JSON text (the signed body). */
export const encodeAnnouncement = (announcement: Announcement): string =>
  Schema.encodeSync(announcementJson)(announcement)
/** The announcement of a body (Left: a body this protocol cannot read). */
export const decodeAnnouncement = Schema.decodeUnknownEither(announcementJson)

/** The bytes the proof covers: a label of this protocol, the nonce, the body. */
export const proofInput = (nonce: string, body: string): string =>
  `swactor-discovery-v${DISCOVERY_PROTOCOL}\n${nonce}\n${body}`

/** The bytes a relay's proof covers: a label, the joiner's address as heard, and the joiner's own proof. */
export const relayInput = (from: string, proof: string): string =>
  `swactor-discovery-relay-v${DISCOVERY_PROTOCOL}\n${from}\n${proof}`

// ---------------------------------------------------------------------------------------------------------------
// The discovered set: a pure state and what changes it.
// ---------------------------------------------------------------------------------------------------------------

/** What a listener made of one datagram (its layer checks the proof). */
export type Heard =
  | {
      readonly _tag: "Verified"
      readonly announcement: Announcement
      /** The sender (a relayed join: the joiner as the relaying node heard it). */
      readonly from: string
      /** Heard from a relaying node, not from the joiner itself. */
      readonly relayed?: boolean | undefined
    }
  | { readonly _tag: "Refused"; readonly from: string; readonly nodeId?: string | undefined; readonly reason: string }
  | { readonly _tag: "OtherVersion"; readonly from: string; readonly protocol: number; readonly reason: string }

/** A verified live node. */
export interface DiscoveredNode {
  readonly nodeId: string
  readonly address: string
  readonly from: string
  readonly startedAt: number
  readonly counter: number
  readonly resources: NodeResources
  /** When its latest announcement was heard (the listener's clock). */
  readonly heardAtMillis: number
  readonly expiresAtMillis: number
}

/** A sender not used, and why (keyed by the sender's address, with the node id when it could be read). */
export interface NotUsed {
  readonly from: string
  readonly nodeId?: string | undefined
  readonly reason: string
  readonly expiresAtMillis: number
}

/** Two live nodes announcing one id: both refused, named by address. */
export interface IdConflict {
  readonly nodeId: string
  readonly addresses: ReadonlyArray<string>
  readonly reason: string
}

/** The discovered set. */
export interface Discovered {
  /** Live nodes, by id. */
  readonly nodes: ReadonlyMap<string, DiscoveredNode>
  /** Nodes that left or expired: their last (startedAt, counter), by id. */
  readonly dead: ReadonlyMap<string, { readonly startedAt: number; readonly counter: number }>
  /** Senders refused (a bad proof, a datagram not understood), by sender. */
  readonly refused: ReadonlyMap<string, NotUsed>
  /** Senders of another protocol version, by sender. */
  readonly otherVersions: ReadonlyMap<string, NotUsed>
  /** Ids announced by a second live address: the addresses (and their expiry) by id. */
  readonly conflicts: ReadonlyMap<string, ReadonlyMap<string, number>>
}

export const emptyDiscovered: Discovered = {
  nodes: new Map(),
  dead: new Map(),
  refused: new Map(),
  otherVersions: new Map(),
  conflicts: new Map()
}

/** Whether (startedAt, counter) `a` comes after `b`. */
const newer = (a: { startedAt: number; counter: number }, b: { startedAt: number; counter: number }) =>
  a.startedAt > b.startedAt || (a.startedAt === b.startedAt && a.counter > b.counter)

const withEntry = <K, V>(map: ReadonlyMap<K, V>, key: K, value: V): ReadonlyMap<K, V> => new Map(map).set(key, value)
const withoutEntry = <K, V>(map: ReadonlyMap<K, V>, key: K): ReadonlyMap<K, V> => {
  const next = new Map(map)
  next.delete(key)
  return next
}

/** The conflict's one line, naming every address. */
export const conflictReason = (nodeId: string, addresses: ReadonlyArray<string>): string =>
  `node id ${nodeId} is announced by two live nodes, ${[...addresses].sort().join(" and ")}: both refused ` +
  `(a copied state folder? give one of them a new id)`

/** A second live address for an id already known: both are held in the conflict until one of them expires. */
const conflicted = (state: Discovered, a: Announcement, known: DiscoveredNode, nowMillis: number): Discovered => {
  const held = state.conflicts.get(a.nodeId) ?? new Map([[known.address, known.expiresAtMillis]])
  return {
    ...state,
    conflicts: withEntry(state.conflicts, a.nodeId, withEntry(held, a.address, nowMillis + a.ttlMillis))
  }
}

/**
 * An announcement of an id in conflict refreshes its address; a leave takes its address out, and the conflict ends
 * when one address is left (that node is then heard again on its next announcement).
 */
const heldConflict = (
  state: Discovered,
  a: Announcement,
  held: ReadonlyMap<string, number>,
  nowMillis: number
): Discovered => {
  if (a.kind === "announce")
    return {
      ...state,
      conflicts: withEntry(state.conflicts, a.nodeId, withEntry(held, a.address, nowMillis + a.ttlMillis))
    }
  const rest = withoutEntry(held, a.address)
  return rest.size > 1
    ? { ...state, conflicts: withEntry(state.conflicts, a.nodeId, rest) }
    : { ...state, conflicts: withoutEntry(state.conflicts, a.nodeId), nodes: withoutEntry(state.nodes, a.nodeId) }
}

/**
 * The control address to use: the announced one, or, when it names no host (a node listening on 0.0.0.0), the
 * sender's IP with the announced port (the announcer's socket is bound to the interface's address).
 */
export const reachableAddress = (announced: string, from: string): string => {
  const at = announced.lastIndexOf(":")
  const host = announced.slice(0, at).replace(/^\[|\]$/g, "")
  if (host !== "0.0.0.0" && host !== "::" && host !== "") return announced
  const senderHost = from.slice(0, from.lastIndexOf(":"))
  return `${senderHost.includes(":") ? `[${senderHost}]` : senderHost}${announced.slice(at)}`
}

/** A verified announcement or leave (its address made reachable). */
const verified = (state: Discovered, heard: Announcement, from: string, nowMillis: number): Discovered => {
  const a = { ...heard, address: reachableAddress(heard.address, from) }
  const dead = state.dead.get(a.nodeId)
  if (dead !== undefined && !newer(a, dead)) return state
  const held = state.conflicts.get(a.nodeId)
  if (held !== undefined) return heldConflict(state, a, held, nowMillis)
  const known = state.nodes.get(a.nodeId)
  if (known !== undefined && known.address !== a.address && a.kind === "announce")
    return conflicted(state, a, known, nowMillis)
  if (known !== undefined && !newer(a, known)) return state
  if (a.kind === "leave") {
    const mark = { startedAt: a.startedAt, counter: a.counter }
    return { ...state, nodes: withoutEntry(state.nodes, a.nodeId), dead: withEntry(state.dead, a.nodeId, mark) }
  }
  const node: DiscoveredNode = {
    nodeId: a.nodeId,
    address: a.address,
    from,
    startedAt: a.startedAt,
    counter: a.counter,
    resources: a.resources,
    heardAtMillis: nowMillis,
    expiresAtMillis: nowMillis + a.ttlMillis
  }
  return { ...state, nodes: withEntry(state.nodes, a.nodeId, node), dead: withoutEntry(state.dead, a.nodeId) }
}

/** The set after hearing `heard` at `nowMillis`; a refusal or another version is listed for `ttlMillis`. */
export const hear = (state: Discovered, heard: Heard, nowMillis: number, ttlMillis: number): Discovered => {
  switch (heard._tag) {
    case "Verified":
      return verified(state, heard.announcement, heard.from, nowMillis)
    case "Refused": {
      const entry = {
        from: heard.from,
        nodeId: heard.nodeId,
        reason: heard.reason,
        expiresAtMillis: nowMillis + ttlMillis
      }
      return { ...state, refused: withEntry(state.refused, heard.from, entry) }
    }
    case "OtherVersion": {
      const entry = { from: heard.from, reason: heard.reason, expiresAtMillis: nowMillis + ttlMillis }
      return { ...state, otherVersions: withEntry(state.otherVersions, heard.from, entry) }
    }
  }
}

const liveEntries = <K>(map: ReadonlyMap<K, NotUsed>, nowMillis: number): ReadonlyMap<K, NotUsed> =>
  new Map([...map].filter(([, entry]) => entry.expiresAtMillis > nowMillis))

/** A conflict ends when only one of its addresses is still live; that node is then heard again on its next one. */
const liveConflicts = (conflicts: Discovered["conflicts"], nowMillis: number): Discovered["conflicts"] =>
  new Map(
    [...conflicts]
      .map(([id, held]) => [id, new Map([...held].filter(([, expires]) => expires > nowMillis))] as const)
      .filter(([, held]) => held.size > 1)
  )

/** The set at `nowMillis`: expired nodes are dead at their last announcement, expired listings dropped. */
export const expireDiscovered = (state: Discovered, nowMillis: number): Discovered => {
  const nodes = new Map(state.nodes)
  const dead = new Map(state.dead)
  for (const [id, node] of state.nodes) {
    if (node.expiresAtMillis > nowMillis) continue
    nodes.delete(id)
    dead.set(id, { startedAt: node.startedAt, counter: node.counter })
  }
  const conflicts = liveConflicts(state.conflicts, nowMillis)
  for (const id of state.conflicts.keys()) if (!conflicts.has(id)) nodes.delete(id)
  return {
    nodes,
    dead,
    refused: liveEntries(state.refused, nowMillis),
    otherVersions: liveEntries(state.otherVersions, nowMillis),
    conflicts
  }
}

/**
 * The set after the orchestrator found the node at `address` dead (its control connection lost): it is taken out and
 * remembered dead at its run (`startedAt`) whatever its counter, so that no announcement of that run (a late one, or
 * one of a node that hangs yet still announces) brings it back; a restart (a newer `startedAt`) does.
 */
export const buryAddress = (state: Discovered, address: string): Discovered => {
  const node = [...state.nodes.values()].find((n) => n.address === address)
  if (node === undefined) return state
  const mark = { startedAt: node.startedAt, counter: Number.MAX_SAFE_INTEGER }
  return { ...state, nodes: withoutEntry(state.nodes, node.nodeId), dead: withEntry(state.dead, node.nodeId, mark) }
}

/** What a listener shows: the nodes it would use, and every node it would not with the reason. */
export interface DiscoveryView {
  readonly verified: ReadonlyArray<DiscoveredNode>
  readonly refused: ReadonlyArray<NotUsed>
  readonly otherVersions: ReadonlyArray<NotUsed>
  readonly conflicts: ReadonlyArray<IdConflict>
}

/** The view of a set (already expired to now): a conflicted id is never among the verified. */
export const viewOf = (state: Discovered): DiscoveryView => ({
  verified: [...state.nodes.values()]
    .filter((node) => !state.conflicts.has(node.nodeId))
    .sort((a, b) => a.address.localeCompare(b.address)),
  refused: [...state.refused.values()],
  otherVersions: [...state.otherVersions.values()],
  conflicts: [...state.conflicts].map(([nodeId, held]) => ({
    nodeId,
    addresses: [...held.keys()].sort(),
    reason: conflictReason(nodeId, [...held.keys()])
  }))
})
