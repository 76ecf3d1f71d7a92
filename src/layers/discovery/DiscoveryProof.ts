/**
 * The proof of an announcement (issue 39): HMAC-SHA256 keyed by the cluster token over a label of the protocol, a
 * fresh 16-byte nonce and the announcement's JSON text (src/domain/discovery.ts `proofInput`). The datagram carries
 * the nonce, the proof and the text, never the token or anything derived from it but the HMAC. Proofs are compared in
 * constant time. A listener's reading of a datagram is a `Heard`: verified, refused (with the reason), or another
 * protocol version (with the reason; never dropped in silence).
 */
import { createHmac, randomBytes, timingSafeEqual } from "node:crypto"
import { Either, Redacted } from "effect"
import {
  type Announcement,
  decodeAnnouncement,
  decodeDatagram,
  DISCOVERY_MARKER,
  DISCOVERY_PROTOCOL,
  encodeAnnouncement,
  encodeDatagram,
  type DiscoveryDatagram,
  type Heard,
  proofInput,
  relayInput
} from "../../domain/discovery.js"

const NONCE_BYTES = 16

const hmac = (token: Redacted.Redacted<string>, input: string): Buffer =>
  createHmac("sha256", Redacted.value(token)).update(input, "utf8").digest()

const proofOf = (token: Redacted.Redacted<string>, nonce: string, body: string): Buffer =>
  hmac(token, proofInput(nonce, body))

/** The datagram announcing `announcement`, proved with `token` over a fresh nonce. */
export const signedDatagram = (
  token: Redacted.Redacted<string>,
  announcement: Announcement,
  nonce: Buffer = randomBytes(NONCE_BYTES)
): Buffer => {
  const body = encodeAnnouncement(announcement)
  const nonceText = nonce.toString("hex")
  const proof = proofOf(token, nonceText, body).toString("hex")
  return Buffer.from(
    encodeDatagram({ swactor: DISCOVERY_MARKER, protocol: DISCOVERY_PROTOCOL, nonce: nonceText, proof, body }),
    "utf8"
  )
}

/**
 * A join announcement heard from `from`, relayed: the same signed datagram with `from` and this node's proof over
 * `from` and the joiner's proof (so the listener uses the joiner's address, not the relaying node's). Undefined for a
 * datagram that is not a join, or is itself relayed (never relayed twice), or cannot be read.
 */
export const relayedDatagram = (
  token: Redacted.Redacted<string>,
  message: Buffer,
  from: string
): Buffer | undefined => {
  const datagram = decodeDatagram(message.toString("utf8"))
  if (Either.isLeft(datagram) || datagram.right.relay !== undefined) return undefined
  const relay = { from, proof: hmac(token, relayInput(from, datagram.right.proof)).toString("hex") }
  return Buffer.from(encodeDatagram({ ...datagram.right, relay }), "utf8")
}

/** The node id a body names, when it can be read at all (for a refusal's line). */
const idOf = (body: string): string | undefined => {
  try {
    const value: unknown = JSON.parse(body)
    return typeof value === "object" && value !== null && "nodeId" in value && typeof value.nodeId === "string"
      ? value.nodeId
      : undefined
  } catch {
    return undefined
  }
}

/** Whether `proof` (hex) is `expected`, in constant time. */
const sameProof = (expected: Buffer, proof: string): boolean => {
  const given = Buffer.from(proof, "hex")
  return given.length === expected.length && timingSafeEqual(given, expected)
}

/** Whether the datagram's proof holds, and its relay's when relayed. */
const proofsHold = (token: Redacted.Redacted<string>, datagram: DiscoveryDatagram): boolean =>
  sameProof(proofOf(token, datagram.nonce, datagram.body), datagram.proof) &&
  (datagram.relay === undefined ||
    sameProof(hmac(token, relayInput(datagram.relay.from, datagram.proof)), datagram.relay.proof))

/**
 * What a listener holding `token` makes of a datagram `message` from `from` (host:port); a relayed join is heard as
 * from the joiner.
 */
export const readDatagram = (token: Redacted.Redacted<string>, message: Buffer, from: string): Heard => {
  const datagram = decodeDatagram(message.toString("utf8"))
  if (Either.isLeft(datagram)) return { _tag: "Refused", from, reason: "not a swactor announcement" }
  const { protocol, body, relay } = datagram.right
  const nodeId = idOf(body)
  if (protocol !== DISCOVERY_PROTOCOL)
    return {
      _tag: "OtherVersion",
      from,
      protocol,
      reason:
        `${nodeId === undefined ? "a node" : `node ${nodeId}`} at ${from} speaks discovery protocol ${protocol}, ` +
        `this node ${DISCOVERY_PROTOCOL}: not used (run the same swactor release on every node)`
    }
  if (!proofsHold(token, datagram.right))
    return { _tag: "Refused", from, nodeId, reason: "its proof does not hold: another cluster token, or altered" }
  const announcement = decodeAnnouncement(body)
  if (Either.isLeft(announcement))
    return { _tag: "Refused", from, nodeId, reason: "its announcement cannot be read by this release" }
  return relay === undefined
    ? { _tag: "Verified", from, announcement: announcement.right }
    : { _tag: "Verified", from: relay.from, announcement: announcement.right, relayed: true }
}
