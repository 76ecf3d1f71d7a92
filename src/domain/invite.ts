/**
 * Invites (issue 39): one string holding the address to join (host:port of an orchestrator's or a pool member's
 * discovery port) and the cluster token, `swactor1:` then base64url of `{"address","token"}`'s JSON. `swactor invite`
 * and `swactor serve --discover` print one; `swactor node --join <invite>` needs nothing else. A string that is not an
 * invite is refused with why, never echoing it (it may hold a token).
 */
import { Either, Encoding, Schema } from "effect"

/** What an invite string starts with (its version: another layout gets another prefix). */
export const INVITE_PREFIX = "swactor1:"

const InviteBody = Schema.Struct({ address: Schema.String, token: Schema.String })
export type Invite = typeof InviteBody.Type

const inviteJson = Schema.parseJson(InviteBody)

/** The invite's string. */
export const encodeInvite = (invite: Invite): string =>
  INVITE_PREFIX + Encoding.encodeBase64Url(Schema.encodeSync(inviteJson)(invite))

/** Whether `text` is meant as an invite (its prefix), rather than host:port. */
export const looksLikeInvite = (text: string): boolean => text.startsWith(INVITE_PREFIX)

/** Whether `address` is host:port with a port in 1..65535. */
const hostPortProblem = (address: string): string | undefined => {
  const at = address.lastIndexOf(":")
  const port = Number(address.slice(at + 1))
  return at > 0 && /^\d+$/.test(address.slice(at + 1)) && port >= 1 && port <= 65535
    ? undefined
    : "its address is not host:port"
}

/** The invite in `text`; Left: why it is not one (never quoting `text`). */
export const decodeInvite = (text: string): Either.Either<Invite, string> => {
  if (!looksLikeInvite(text)) return Either.left(`it does not start with ${INVITE_PREFIX}`)
  const payload = text.slice(INVITE_PREFIX.length).trim()
  if (!/^[A-Za-z0-9_-]+$/.test(payload)) return Either.left("its payload is not base64url")
  const json = Encoding.decodeBase64UrlString(payload)
  const invite = Either.flatMap(json, (text) => Schema.decodeUnknownEither(inviteJson)(text))
  if (Either.isLeft(invite)) return Either.left("its payload is not an invite's (an address and a token)")
  const problem = hostPortProblem(invite.right.address)
  return problem === undefined ? Either.right(invite.right) : Either.left(problem)
}
