import type { HandshakeError } from "./Auth.js"

/**
 * Log lines for refused connections (a failed handshake on the control or the data plane): each names the peer's
 * address, and a flood cannot fill the log. Per peer address, at most one line per window; the next line for that
 * peer after a quiet spell says how many refusals were not logged meanwhile. Across all peers, at most `maxLines`
 * lines per window (a flood from many addresses), then one line saying further refusals go unlogged until the window
 * ends; the first line after it says how many that was.
 */

export interface RefusalLogOptions {
  /** The window, in milliseconds (default 10 s). */
  readonly windowMillis?: number
  /** Lines per window over all peers (default 20). */
  readonly maxLines?: number
  /** Peers remembered at most (the oldest forgotten first; default 1024). */
  readonly maxPeers?: number
  readonly now?: () => number
}

/** `host` of a socket's peer, in words ("unix socket" for a local socket without an address). */
export const peerAddress = (socket: {
  readonly remoteAddress?: string | undefined
  readonly remotePort?: number | undefined
}) => (socket.remoteAddress === undefined ? "unix socket" : socket.remoteAddress)

/**
 * `refused(peer, detail)` is the line to log, `<what> from <peer> refused: <detail>`, when the limits allow; otherwise
 * undefined (the refusal is counted).
 */
export const makeRefusalLog = (what: string, options: RefusalLogOptions = {}) => {
  const windowMillis = options.windowMillis ?? 10_000
  const maxLines = options.maxLines ?? 20
  const maxPeers = options.maxPeers ?? 1024
  const now = options.now ?? (() => performance.now())
  // per peer: when its last line was written, refusals not logged since
  const peers = new Map<string, { at: number; suppressed: number }>()
  let windowStart = -Infinity
  let linesInWindow = 0
  let unloggedInWindow = 0
  let carriedUnlogged = 0
  const windowSeconds = `${Math.round(windowMillis / 100) / 10} s`
  return {
    refused: (peer: string, detail: string): string | undefined => {
      const t = now()
      if (t - windowStart >= windowMillis) {
        windowStart = t
        linesInWindow = 0
        carriedUnlogged += unloggedInWindow
        unloggedInWindow = 0
      }
      const seen = peers.get(peer)
      if (seen !== undefined && t - seen.at < windowMillis) {
        seen.suppressed++
        return undefined
      }
      if (linesInWindow >= maxLines) {
        unloggedInWindow++
        if (seen !== undefined) seen.suppressed++
        return undefined
      }
      linesInWindow++
      const notes: Array<string> = []
      if (seen !== undefined && seen.suppressed > 0) {
        notes.push(`${seen.suppressed} more from this peer not logged`)
      }
      if (carriedUnlogged > 0) notes.push(`${carriedUnlogged} more from any peer not logged in the last flood`)
      carriedUnlogged = 0
      const last = linesInWindow === maxLines ? `; further refusals are not logged for ${windowSeconds}` : ""
      peers.delete(peer)
      peers.set(peer, { at: t, suppressed: 0 })
      if (peers.size > maxPeers) peers.delete(peers.keys().next().value!)
      return `${what} from ${peer} refused: ${detail}${notes.length > 0 ? ` (${notes.join("; ")})` : ""}${last}`
    }
  }
}

/** A line to log about a failed handshake, and its level. */
export interface HandshakeLine {
  readonly level: "Warning" | "Debug"
  readonly line: string
}

/**
 * What a listener logs about a connection that failed its handshake (`AuthFailed.reason`): a close or a timeout before
 * it authenticated (a TCP health probe, a port scan, a peer that gave up) is one DEBUG line each, never a warning; a
 * failed proof is a WARN line `<what> from <peer> refused: authentication failed: …`, and another protocol spoken a
 * WARN line `… refused: not a swactor handshake: …`, and a peer of another wire version or formats (`WireMismatch`,
 * after both proofs) a WARN line `… refused: peer … speaks wire …; this node speaks wire …`, each under its own limits
 * (makeRefusalLog), so no flood of one kind hides the first line of another.
 */
export const makeHandshakeLog = (what: string, options: RefusalLogOptions = {}) => {
  const proofs = makeRefusalLog(what, options)
  const strangers = makeRefusalLog(what, options)
  const otherWires = makeRefusalLog(what, options)
  return (peer: string, failure: HandshakeError): HandshakeLine | undefined => {
    const warning = (line: string | undefined): HandshakeLine | undefined =>
      line === undefined ? undefined : { level: "Warning", line }
    if (failure._tag === "WireMismatch") return warning(otherWires.refused(peer, failure.message))
    switch (failure.reason) {
      case "closed":
        return { level: "Debug", line: `${what} from ${peer} closed before authenticating (${failure.detail})` }
      case "timeout":
        return { level: "Debug", line: `${what} from ${peer} dropped before authenticating (${failure.detail})` }
      case "protocol":
        return warning(strangers.refused(peer, `not a swactor handshake: ${failure.detail}`))
      case "proof":
        return warning(proofs.refused(peer, `authentication failed: ${failure.detail}`))
    }
  }
}
