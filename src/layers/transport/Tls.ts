/**
 * Encrypted links: TLS 1.3 with a pre-shared key derived from the cluster token, on every TCP connection that leaves
 * the host (control and data plane alike). Loopback TCP, Unix sockets and shared memory stay plain.
 *
 * Key: HKDF-SHA256(token, salt "swactor-tls-psk-v1", info "psk", 32 bytes); identity "swactor-v1"; cipher
 * TLS_AES_128_GCM_SHA256 (the PSK's hash). No certificates: a peer without the token cannot finish the handshake
 * (the PSK binder does not verify), and an observer sees only ciphertext. The HMAC challenge of Auth.ts still runs
 * inside the tunnel.
 *
 * When (`--tls` / `SWACTOR_TLS`, config/Settings.ts) = `auto` (default: encrypt when the connection's peer address is not loopback, decided the same
 * way on both ends from the connected socket), `always` (every TCP connection, loopback too: tests and benches) or
 * `off` (never). Both ends must agree; a mismatch fails the handshake, never falls back to plain.
 */
import { hkdfSync } from "node:crypto"
import type * as Net from "node:net"
import * as Tls from "node:tls"
import { type Duration, Effect, Redacted } from "effect"
import { AuthFailed } from "../../domain/frames.js"
import { Settings, type TlsMode } from "../config/Settings.js"

/** The cluster token (Auth.ts's `ClusterToken`; not imported from there, which imports this module). */
type ClusterToken = Redacted.Redacted<string>

export type { TlsMode }

/** The variable that gives a child agent its mode (a test sets it in the agents' environment). */
export const TLS_ENV = "SWACTOR_TLS"
const IDENTITY = "swactor-v1"
const CIPHER = "TLS_AES_128_GCM_SHA256"

/** 127.0.0.0/8, ::1 and their IPv4-mapped forms. */
export const isLoopback = (ip: string): boolean => {
  const v4 = ip.startsWith("::ffff:") ? ip.slice(7) : ip
  return v4.startsWith("127.") || ip === "::1"
}

/** Whether a connected socket should be wrapped: TCP (it has a peer address), not already TLS, per the mode. */
export const wantsTls = (socket: Net.Socket, mode: TlsMode): boolean => {
  const peer = socket.remoteAddress
  if (peer === undefined || socket instanceof Tls.TLSSocket || mode === "off") return false
  return mode === "always" || !isLoopback(peer)
}

/** The 32-byte PSK of a cluster token. */
export const pskOf = (token: ClusterToken): Buffer =>
  Buffer.from(hkdfSync("sha256", Redacted.value(token), "swactor-tls-psk-v1", "psk", 32))

const versions = { minVersion: "TLSv1.3", maxVersion: "TLSv1.3", ciphers: CIPHER } as const

const handshake = (
  socket: Net.Socket,
  side: "server" | "client",
  token: ClusterToken,
  timeout: Duration.DurationInput
): Effect.Effect<Net.Socket, AuthFailed> =>
  Effect.async<Net.Socket, AuthFailed>((resume) => {
    const psk = pskOf(token)
    const secured =
      side === "server"
        ? new Tls.TLSSocket(socket, {
            isServer: true,
            ...versions,
            secureContext: Tls.createSecureContext(versions),
            // Honoured by Node 20's TLSSocket (as by tls.createServer) but missing from @types/node's TLSSocketOptions.
            pskCallback: (_socket: Tls.TLSSocket, identity: string) => (identity === IDENTITY ? psk : null)
          } as Tls.TLSSocketOptions)
        : Tls.connect({
            socket,
            ...versions,
            checkServerIdentity: () => undefined,
            pskCallback: () => ({ psk, identity: IDENTITY })
          })
    const fail = (failure: AuthFailed) => {
      secured.off("close", onClose)
      secured.destroy()
      socket.destroy()
      resume(Effect.fail(failure))
    }
    const onError = (err: NodeJS.ErrnoException) => fail(tlsFailure(side, err))
    // A peer that closes before the handshake (a health probe, a port scan) ends the socket without an error.
    const onClose = () =>
      fail(new AuthFailed({ detail: "peer closed the connection during the TLS handshake", reason: "closed" }))
    secured.once("error", onError)
    secured.once("close", onClose)
    secured.once(side === "server" ? "secure" : "secureConnect", () => {
      secured.off("error", onError)
      secured.off("close", onClose)
      // Owners watch `close`, as for plain sockets.
      secured.on("error", () => {})
      resume(Effect.succeed(secured))
    })
    return Effect.sync(() => {
      secured.destroy()
      socket.destroy()
    })
  }).pipe(
    Effect.timeoutFail({
      duration: timeout,
      onTimeout: () => new AuthFailed({ detail: "TLS handshake timed out", reason: "timeout" })
    })
  )

/**
 * A failed TLS handshake, by what failed: the connection reset (`closed`); on the server, a PSK binder that does not
 * verify (the peer holds another token: `proof`) or any other TLS error (the peer speaks something else, an HTTP
 * request, a TLS client without the PSK: `protocol`); on the client, any TLS error (`proof`: the node holds another
 * token, or is not a swactor node).
 */
const tlsFailure = (side: "server" | "client", err: NodeJS.ErrnoException): AuthFailed => {
  if (err.code === "ECONNRESET" || err.code === "EPIPE") {
    return new AuthFailed({ detail: `connection reset during the TLS handshake: ${err.message}`, reason: "closed" })
  }
  if (side === "server" && err.code !== "ERR_SSL_BINDER_DOES_NOT_VERIFY") {
    return new AuthFailed({ detail: `TLS handshake failed: ${err.message.trim()}`, reason: "protocol" })
  }
  return new AuthFailed({
    detail: `TLS handshake failed (wrong cluster token?): ${err.message.trim()}`,
    reason: "proof"
  })
}

/**
 * The socket to speak on: `socket` itself when it stays plain, else a TLS socket over it once the handshake with the
 * token's PSK succeeded. A failed handshake destroys the socket.
 */
export const secure = (
  socket: Net.Socket,
  side: "server" | "client",
  options: {
    readonly token: ClusterToken
    readonly mode?: TlsMode | undefined
    readonly timeout: Duration.DurationInput
  }
): Effect.Effect<Net.Socket, AuthFailed> =>
  Effect.flatMap(Settings, (settings) =>
    wantsTls(socket, options.mode ?? settings.tls)
      ? handshake(socket, side, options.token, options.timeout)
      : Effect.succeed(socket)
  )
