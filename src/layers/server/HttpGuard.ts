/**
 * What `swactor serve` checks of a request before any work: who may ask (the Host and Origin a browser sends, so a web
 * page the user visits cannot drive a local server, by a simple POST or by DNS rebinding), how much it may send (body
 * bytes counted as they arrive, never buffered past the limit; a body that stalls), and what it sends (JSON routes
 * take `application/json` only; JSON nested past a fixed depth is refused before it is parsed). Error messages are
 * clipped, so a bad value is never echoed back whole, and agents' addresses are kept out of them.
 *
 * The connection limits (how many at once, how long a connection may take to send its headers) are set on Node's
 * HTTP server in HttpListener.ts from the same `HttpLimits`.
 */
import { createHash, timingSafeEqual } from "node:crypto"
import type { IncomingMessage } from "node:http"
import { hostname } from "node:os"
import { isIP } from "node:net"
import { Effect, Redacted } from "effect"
import { isLoopback } from "../transport/Tls.js"

/** The limits of the HTTP front, each a `swactor serve` flag. */
export interface HttpLimits {
  /** Request body bytes at most (413 beyond; counted while the body arrives). */
  readonly maxBodyBytes: number
  /** Open connections at most; more are refused at the socket. */
  readonly maxConnections: number
  /** A connection must have sent a request's headers within this. */
  readonly headerTimeoutMillis: number
  /** A request's body must have arrived whole within this (408 beyond). */
  readonly bodyTimeoutMillis: number
  /** Origins (scheme://host[:port]) whose pages may call the API, with CORS; `*` any. Default none. */
  readonly allowedOrigins: ReadonlyArray<string>
  /** Host names requests may be addressed to besides the listen address and loopback names; `*` any. */
  readonly allowedHosts: ReadonlyArray<string>
}

export const defaultHttpLimits: HttpLimits = {
  maxBodyBytes: 8 * 2 ** 20,
  maxConnections: 512,
  headerTimeoutMillis: 10_000,
  bodyTimeoutMillis: 30_000,
  allowedOrigins: [],
  allowedHosts: []
}

/** JSON bodies nested deeper than this (objects and arrays) are refused before parsing. */
export const maxJsonDepth = 64

/** Error messages are clipped to this many characters. */
export const maxMessageChars = 400

/** A refusal at the edge: an HTTP status and OpenAI's error fields. */
export class EdgeRefusal {
  constructor(
    readonly status: number,
    readonly type: string,
    readonly message: string,
    readonly code: string | null
  ) {}
}

/** At most `max` characters: a longer text keeps its start and says how much was left out. */
export const clip = (text: string, max = maxMessageChars): string =>
  text.length <= max ? text : `${text.slice(0, max)}… (${text.length - max} more characters)`

/**
 * A message with agents' addresses taken out (`host:port`, `[v6]:port`, Unix socket paths): they name the cluster's
 * inside, which a client has no business seeing. The server's log keeps the whole message.
 */
export const withoutAddresses = (text: string): string =>
  text
    .replace(/\[[0-9a-fA-F:.]+\](?::\d{1,5})?/g, "<agent>")
    .replace(/\b(?:\d{1,3}\.){3}\d{1,3}(?::\d{1,5})?\b/g, "<agent>")
    .replace(/\b[a-zA-Z][\w.-]*:\d{2,5}\b/g, "<agent>")
    .replace(/(?:unix:)?(?:\/[\w.@+-]+){2,}/g, "<path>")

/**
 * A loopback name or address as `hostOf` gives it: `localhost`, `*.localhost`, or an IP literal Tls.ts counts as
 * loopback (127.0.0.0/8, ::1, IPv4-mapped). Only literals: a name such as `127.attacker.example` is not loopback.
 */
export const isLoopbackHost = (host: string) =>
  host === "localhost" || host.endsWith(".localhost") || (isIP(host) !== 0 && isLoopback(host))

/** The host name of a Host header (`name`, `name:port`, `[v6]:port`), lower case, without the port. */
export const hostOf = (header: string): string => {
  const value = header.trim().toLowerCase()
  if (value.startsWith("[")) {
    const end = value.indexOf("]")
    return end < 0 ? value : value.slice(1, end)
  }
  const colon = value.lastIndexOf(":")
  return colon >= 0 && value.indexOf(":") === colon ? value.slice(0, colon) : value
}

/**
 * Whether a request addressed to `host` (from its Host header) may be served by a server listening on `listenHost`:
 * a loopback listener answers loopback names only (a page that rebinds its own name to 127.0.0.1 sends its name);
 * any listener answers its own address, IP literals when it listens on every address, this machine's name, and the
 * names of `--allowed-hosts` (`*`: any).
 */
export const hostAllowed = (host: string, listenHost: string, allowedHosts: ReadonlyArray<string>): boolean => {
  if (allowedHosts.includes("*")) return true
  const listen = hostOf(listenHost)
  if (host === listen || isLoopbackHost(host) || allowedHosts.some((h) => h.toLowerCase() === host)) return true
  if (isLoopbackHost(listen)) return false
  const wildcard = listen === "0.0.0.0" || listen === "::" || listen === ""
  return (wildcard && isIP(host) !== 0) || host === hostname().toLowerCase()
}

/**
 * Whether a page of `origin` may call the API: no Origin (not a browser), the server's own origin (same Host), or one
 * of `--allowed-origins` (`*`: any).
 */
export const originAllowed = (
  origin: string | undefined,
  hostHeader: string,
  allowedOrigins: ReadonlyArray<string>
): boolean => {
  if (origin === undefined) return true
  if (allowedOrigins.includes("*") || allowedOrigins.includes(origin)) return true
  try {
    const url = new URL(origin)
    return (url.protocol === "http:" || url.protocol === "https:") && url.host === hostHeader.trim().toLowerCase()
  } catch {
    return false
  }
}

/** Who may ask: the Host and Origin checks, as a refusal or undefined. */
export const checkCaller = (
  headers: Readonly<Record<string, string | undefined>>,
  listenHost: string,
  limits: Pick<HttpLimits, "allowedHosts" | "allowedOrigins">
): EdgeRefusal | undefined => {
  const hostHeader = headers["host"]
  if (hostHeader === undefined || hostHeader.trim() === "") {
    return new EdgeRefusal(400, "invalid_request_error", "the request has no Host header", "host_missing")
  }
  const host = hostOf(hostHeader)
  if (!hostAllowed(host, listenHost, limits.allowedHosts)) {
    return new EdgeRefusal(
      403,
      "invalid_request_error",
      clip(
        `requests addressed to host "${host}" are not served here (listening on ${listenHost}); allow it with --allowed-hosts`
      ),
      "host_not_allowed"
    )
  }
  if (!originAllowed(headers["origin"], hostHeader, limits.allowedOrigins)) {
    return new EdgeRefusal(
      403,
      "invalid_request_error",
      clip(`pages of origin ${headers["origin"]} may not call this server; allow it with --allowed-origins`),
      "origin_not_allowed"
    )
  }
  return undefined
}

/** JSON routes take `application/json` (any parameters, e.g. charset=utf-8) only: a browser cannot send that without a preflight. */
export const checkJsonContentType = (contentType: string | undefined): EdgeRefusal | undefined => {
  const media = contentType?.split(";")[0]?.trim().toLowerCase()
  return media === "application/json"
    ? undefined
    : new EdgeRefusal(
        415,
        "invalid_request_error",
        `the body must be JSON with content-type: application/json${
          contentType === undefined ? " (none given)" : `, got ${clip(JSON.stringify(contentType), 80)}`
        }`,
        "unsupported_media_type"
      )
}

/**
 * The deepest nesting of objects and arrays in a JSON text, stopping once past `limit`. Strings are skipped whole with
 * native `indexOf` (a quote counts as closing when an even number of backslashes precedes it), so a body that is
 * mostly one long string costs a few milliseconds per megabyte of event loop, not a walk over every character.
 */
export const jsonDepth = (text: string, limit = maxJsonDepth): number => {
  let depth = 0
  let deepest = 0
  for (let i = 0; i < text.length; i++) {
    const c = text.charCodeAt(i)
    if (c === 34 /* " */) {
      let end = i
      for (;;) {
        end = text.indexOf('"', end + 1)
        if (end < 0) return deepest // unterminated: JSON.parse refuses it
        let slashes = 0
        while (text.charCodeAt(end - 1 - slashes) === 92 /* \ */) slashes++
        if (slashes % 2 === 0) break
      }
      i = end
    } else if (c === 123 /* { */ || c === 91 /* [ */) {
      depth++
      if (depth > deepest) {
        deepest = depth
        if (deepest > limit) return deepest
      }
    } else if (c === 125 /* } */ || c === 93 /* ] */) depth--
  }
  return deepest
}

/** The body's text as JSON, refused when nested past `maxJsonDepth` or not JSON. */
export const parseJson = (text: string): Effect.Effect<unknown, EdgeRefusal> =>
  Effect.suspend(() => {
    if (jsonDepth(text) > maxJsonDepth) {
      return Effect.fail(
        new EdgeRefusal(
          400,
          "invalid_request_error",
          `bad request body: JSON nested deeper than ${maxJsonDepth} levels`,
          "json_too_deep"
        )
      )
    }
    try {
      return Effect.succeed(JSON.parse(text) as unknown)
    } catch (error) {
      return Effect.fail(
        new EdgeRefusal(
          400,
          "invalid_request_error",
          clip(`bad request body: not JSON: ${(error as Error).message}`),
          "invalid_json"
        )
      )
    }
  })

const tooLarge = (maxBodyBytes: number, seen: string) =>
  new EdgeRefusal(
    413,
    "invalid_request_error",
    `the request body is over the limit of ${maxBodyBytes} bytes (${seen}); raise it with --max-body-mib`,
    "body_too_large"
  )

/** A Content-Length header over the limit: refused before a byte of the body is read (also for `Expect: 100-continue`). */
export const declaredTooLarge = (contentLength: string | undefined, maxBodyBytes: number): EdgeRefusal | undefined => {
  if (contentLength === undefined) return undefined
  const declared = Number(contentLength)
  return Number.isFinite(declared) && declared > maxBodyBytes
    ? tooLarge(maxBodyBytes, `${declared} declared`)
    : undefined
}

/**
 * The body of a Node request as UTF-8 text, counted while it arrives: refused (413) as soon as it passes
 * `maxBodyBytes` (what arrived is dropped, the rest is never read), and (408) when it has not arrived whole within
 * `bodyTimeoutMillis`. Interrupting it (the client went away) removes its listeners.
 */
export const readBody = (
  incoming: IncomingMessage,
  limits: Pick<HttpLimits, "maxBodyBytes" | "bodyTimeoutMillis">
): Effect.Effect<string, EdgeRefusal> =>
  Effect.async<string, EdgeRefusal>((resume) => {
    const declared = declaredTooLarge(incoming.headers["content-length"], limits.maxBodyBytes)
    if (declared !== undefined) return resume(Effect.fail(declared))
    if (incoming.readableEnded) return resume(Effect.succeed(""))
    const chunks: Array<Buffer> = []
    let size = 0
    let settled = false
    const settle = (result: Effect.Effect<string, EdgeRefusal>) => {
      if (settled) return
      settled = true
      cleanup()
      resume(result)
    }
    const onData = (chunk: Buffer) => {
      size += chunk.length
      if (size > limits.maxBodyBytes) {
        chunks.length = 0
        incoming.pause()
        settle(Effect.fail(tooLarge(limits.maxBodyBytes, `more than that arrived`)))
      } else chunks.push(chunk)
    }
    const onEnd = () => settle(Effect.sync(() => Buffer.concat(chunks, size).toString("utf8")))
    const onError = (error: Error) =>
      settle(
        Effect.fail(
          new EdgeRefusal(
            400,
            "invalid_request_error",
            clip(`the request body broke off: ${error.message}`),
            "body_aborted"
          )
        )
      )
    const timer = setTimeout(
      () =>
        settle(
          Effect.fail(
            new EdgeRefusal(
              408,
              "invalid_request_error",
              `the request body did not arrive within ${limits.bodyTimeoutMillis} ms (${size} bytes came)`,
              "body_timeout"
            )
          )
        ),
      limits.bodyTimeoutMillis
    )
    const cleanup = () => {
      clearTimeout(timer)
      incoming.off("data", onData)
      incoming.off("end", onEnd)
      incoming.off("error", onError)
      incoming.off("aborted", onAborted)
    }
    const onAborted = () => onError(new Error("the client closed the connection"))
    incoming.on("data", onData)
    incoming.on("end", onEnd)
    incoming.on("error", onError)
    incoming.on("aborted", onAborted)
    return Effect.sync(cleanup)
  })

/**
 * The API keys a server accepts, kept as SHA-256 digests: a presented key is hashed and compared with each in constant
 * time (the digests have one length, so neither a key's content nor its length shows in the timing).
 */
export interface ApiKeys {
  readonly count: number
  readonly accepts: (presented: string) => boolean
}

export const apiKeys = (keys: ReadonlyArray<Redacted.Redacted<string>>): ApiKeys => {
  const digest = (key: string) => createHash("sha256").update(key, "utf8").digest()
  const digests = keys.map((key) => digest(Redacted.value(key)))
  return {
    count: digests.length,
    accepts: (presented) => {
      const candidate = digest(presented)
      let match = false
      for (const known of digests) match = timingSafeEqual(candidate, known) || match
      return match
    }
  }
}

/** Routes open without a key: a load balancer's health check, and the console's page (it asks for the key). */
const openPaths = new Set(["/health", "/"])

/**
 * The caller's key, from `Authorization: Bearer KEY` (what OpenAI's clients send) or `x-api-key: KEY` (Anthropic's),
 * checked when the server has keys: 401 in OpenAI's shape without one or with a wrong one. `/health` and the console's
 * page `/` stay open (the page holds nothing of the server's; what it shows comes from `/api/*`, which need the key).
 */
export const checkApiKey = (
  headers: Readonly<Record<string, string | undefined>>,
  path: string,
  keys: ApiKeys
): EdgeRefusal | undefined => {
  if (keys.count === 0 || openPaths.has(path)) return undefined
  const bearer = /^Bearer\s+(\S+)\s*$/i.exec(headers["authorization"] ?? "")?.[1]
  const presented = bearer ?? headers["x-api-key"]?.trim()
  if (presented === undefined || presented === "") {
    return new EdgeRefusal(
      401,
      "invalid_request_error",
      "this server needs an API key: send Authorization: Bearer KEY (or x-api-key: KEY)",
      "missing_api_key"
    )
  }
  return keys.accepts(presented)
    ? undefined
    : new EdgeRefusal(401, "invalid_request_error", "incorrect API key provided", "invalid_api_key")
}
