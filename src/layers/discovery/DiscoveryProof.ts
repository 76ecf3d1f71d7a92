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
  type Heard,
  proofInput
} from "../../domain/discovery.js"

const NONCE_BYTES = 16

const proofOf = (token: Redacted.Redacted<string>, nonce: string, body: string): Buffer =>
  createHmac("sha256", Redacted.value(token)).update(proofInput(nonce, body), "utf8").digest()

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

/** Whether `proof` (hex) is the HMAC of `nonce` and `body` under `token`, in constant time. */
const proofHolds = (token: Redacted.Redacted<string>, nonce: string, body: string, proof: string): boolean => {
  const expected = proofOf(token, nonce, body)
  const given = Buffer.from(proof, "hex")
  return given.length === expected.length && timingSafeEqual(given, expected)
}

/** What a listener holding `token` makes of a datagram `message` from `from` (host:port). */
export const readDatagram = (token: Redacted.Redacted<string>, message: Buffer, from: string): Heard => {
  const datagram = decodeDatagram(message.toString("utf8"))
  if (Either.isLeft(datagram)) return { _tag: "Refused", from, reason: "not a swactor announcement" }
  const { protocol, nonce, proof, body } = datagram.right
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
  if (!proofHolds(token, nonce, body, proof))
    return { _tag: "Refused", from, nodeId, reason: "its proof does not hold: another cluster token, or altered" }
  const announcement = decodeAnnouncement(body)
  if (Either.isLeft(announcement))
    return { _tag: "Refused", from, nodeId, reason: "its announcement cannot be read by this release" }
  return { _tag: "Verified", from, announcement: announcement.right }
}
