/**
 * HTTP access to a model hub (issue 38 part 3): Hugging Face or anything that answers as it does (its manifest API,
 * `resolve` URLs that redirect to a CDN, Range requests). Used to read GGUF headers (RemoteGguf.ts) and a stage's
 * tensor bytes (RemoteSlice.ts); never to download a whole model.
 * - A name resolves as node-llama-cpp's `resolveModelFile` does: `hf:user/repo:TAG` asks
 *   `<endpoint>v2/<user>/<repo>/manifests/<tag>` (with `User-Agent: llama-cpp`, which makes the hub name the GGUF
 *   file), then reads `<endpoint><user>/<repo>/resolve/<revision>/<file>`.
 * - Redirects are followed by hand, so that the token (HF_TOKEN) goes only to the hub's own origin, never to the CDN
 *   it redirects to, and never into a message.
 * - A byte range is pinned to the ETag the header was read with (`If-Range`): a file that changed since answers
 *   200 with the whole body, which is refused (`Changed`) instead of mixing two versions.
 * - A connection dropped mid-range is resumed from the last byte received.
 */
import { Data, Duration, Effect, Redacted, Schedule } from "effect"
import type { SettingsValues } from "../config/Settings.js"
import { type ModelName } from "../../domain/modelName.js"

export class HubError extends Data.TaggedError("HubError")<{
  readonly reason: "NotFound" | "Unauthorized" | "Changed" | "BadRange" | "Network" | "Http" | "Protocol"
  /** The URL, without query string (never a token). */
  readonly url: string
  readonly message: string
}> {}

/** Where the hub is and what to present to it. */
export interface HubAccess {
  /** The hub's base URL, ending in "/". */
  readonly endpoint: string
  readonly token?: Redacted.Redacted<string>
  /** Attempts per range when the connection drops (default 6). */
  readonly attempts?: number
}

/** The hub of the resolved settings: MODEL_ENDPOINT / HF_ENDPOINT and HF_TOKEN (config/Settings.ts). */
export const hubAccessOf = (settings: Pick<SettingsValues, "hubEndpoint" | "hubToken">): HubAccess => {
  const token = settings.hubToken
  return { endpoint: settings.hubEndpoint, ...(token === undefined ? {} : { token }) }
}

/** A URL fit for a message: no query string, no fragment. */
export const shownUrl = (url: string): string => {
  try {
    const u = new URL(url)
    return `${u.origin}${u.pathname}`
  } catch {
    return url
  }
}

/** The file a name points at on the hub, before its header is read. */
export interface ResolvedName {
  /** The `resolve` URL of the file (the first part of a split set). */
  readonly url: string
  /** The file's SHA-256 when the hub's manifest gave it (its LFS object id). */
  readonly sha256?: string
  readonly size?: number
}

const USER_AGENT = "llama-cpp swactor/0.1"

const encodePath = (path: string) => path.split("/").map(encodeURIComponent).join("/")

const sameOrigin = (a: string, b: string) => {
  try {
    return new URL(a).origin === new URL(b).origin
  } catch {
    return false
  }
}

interface Request {
  readonly method: "GET" | "HEAD"
  /** [start, endExclusive) */
  readonly range?: readonly [number, number]
  readonly ifRange?: string
  readonly accept?: string
}

/** The final response of a request, after redirects, with the headers the redirects carried (X-Linked-*). */
interface Answer {
  readonly response: Response
  readonly url: string
  readonly linked: { readonly etag?: string; readonly size?: number }
}

const statusError = (url: string, status: number, what: string): HubError => {
  const shown = shownUrl(url)
  if (status === 401 || status === 403) {
    return new HubError({
      reason: "Unauthorized",
      url: shown,
      message: `${what}: the hub refused access (HTTP ${status}); for a gated or private repository set HF_TOKEN`
    })
  }
  if (status === 404) return new HubError({ reason: "NotFound", url: shown, message: `${what}: not found (HTTP 404)` })
  if (status === 416) {
    return new HubError({ reason: "BadRange", url: shown, message: `${what}: the range is past the file's end (416)` })
  }
  return new HubError({ reason: "Http", url: shown, message: `${what}: HTTP ${status}` })
}

/** One request, redirects followed by hand (at most 5), the token only on the hub's origin. */
const request = (access: HubAccess, url: string, req: Request, what: string): Effect.Effect<Answer, HubError> =>
  Effect.gen(function* () {
    let current = url
    const linked: { etag?: string; size?: number } = {}
    for (let hop = 0; hop < 6; hop++) {
      const headers: Record<string, string> = { "User-Agent": USER_AGENT }
      if (req.accept !== undefined) headers["Accept"] = req.accept
      if (req.range !== undefined) headers["Range"] = `bytes=${req.range[0]}-${req.range[1] - 1}`
      if (req.ifRange !== undefined) headers["If-Range"] = req.ifRange
      if (access.token !== undefined && sameOrigin(current, access.endpoint)) {
        headers["Authorization"] = `Bearer ${Redacted.value(access.token)}`
      }
      const target = current
      const response = yield* Effect.tryPromise({
        try: (signal) => fetch(target, { method: req.method, headers, redirect: "manual", signal }),
        catch: (e) =>
          new HubError({
            reason: "Network",
            url: shownUrl(target),
            message: `${what}: ${e instanceof Error ? ((e.cause as Error | undefined)?.message ?? e.message) : String(e)}`
          })
      })
      const linkedEtag = response.headers.get("x-linked-etag")
      const linkedSize = response.headers.get("x-linked-size")
      if (linkedEtag !== null) linked.etag = linkedEtag
      if (linkedSize !== null && /^\d+$/.test(linkedSize)) linked.size = Number(linkedSize)
      if (response.status >= 300 && response.status < 400 && response.headers.get("location") !== null) {
        yield* Effect.promise(() => response.body?.cancel() ?? Promise.resolve())
        current = new URL(response.headers.get("location")!, current).href
        continue
      }
      if (response.status >= 400) {
        yield* Effect.promise(() => response.body?.cancel() ?? Promise.resolve())
        return yield* statusError(current, response.status, what)
      }
      return { response, url: current, linked }
    }
    return yield* new HubError({ reason: "Protocol", url: shownUrl(url), message: `${what}: too many redirects` })
  })

/** The manifest's answer for a tag: the file's name, and its SHA-256 and size where given. */
const manifestFile = (json: unknown): { rfilename: string; sha256?: string; size?: number } | undefined => {
  if (typeof json !== "object" || json === null) return undefined
  const gguf = (json as { ggufFile?: unknown }).ggufFile
  if (typeof gguf !== "object" || gguf === null) return undefined
  const { rfilename, lfs, size } = gguf as { rfilename?: unknown; lfs?: unknown; size?: unknown }
  if (typeof rfilename !== "string" || rfilename === "" || rfilename.split("/").some((p) => p === "..")) {
    return undefined
  }
  const sha = typeof lfs === "object" && lfs !== null ? (lfs as { sha256?: unknown }).sha256 : undefined
  return {
    rfilename,
    ...(typeof sha === "string" && /^[0-9a-f]{64}$/.test(sha) ? { sha256: sha } : {}),
    ...(typeof size === "number" && Number.isSafeInteger(size) ? { size } : {})
  }
}

/** Where a hub name or URL points: the manifest asked for a tag; a file or a URL is taken as it is. */
export const resolveName = (
  access: HubAccess,
  name: Exclude<ModelName, { readonly _tag: "Local" }>
): Effect.Effect<ResolvedName, HubError> =>
  Effect.gen(function* () {
    if (name._tag === "Url") return { url: name.url }
    const repoUrl = `${access.endpoint}${encodeURIComponent(name.user)}/${encodeURIComponent(name.repo)}`
    if (name.file !== undefined) {
      return { url: `${repoUrl}/resolve/${encodeURIComponent(name.revision)}/${encodePath(name.file)}` }
    }
    const tag = name.tag ?? "latest"
    const manifestUrl =
      `${access.endpoint}v2/${encodeURIComponent(name.user)}/${encodeURIComponent(name.repo)}` +
      `/manifests/${encodeURIComponent(tag)}`
    const what = `hf:${name.user}/${name.repo}:${tag}`
    const answer = yield* request(access, manifestUrl, { method: "GET", accept: "application/json" }, what).pipe(
      Effect.mapError((e) =>
        e.reason === "NotFound"
          ? new HubError({
              ...e,
              message: `${what}: the hub has no such repository, or no GGUF file for the tag "${tag}"`
            })
          : e
      )
    )
    const json = yield* Effect.tryPromise({
      try: () => answer.response.json() as Promise<unknown>,
      catch: () =>
        new HubError({ reason: "Protocol", url: shownUrl(manifestUrl), message: `${what}: the manifest is not JSON` })
    })
    const file = manifestFile(json)
    if (file === undefined) {
      return yield* new HubError({
        reason: "Protocol",
        url: shownUrl(manifestUrl),
        message: `${what}: the manifest names no GGUF file`
      })
    }
    return {
      url: `${repoUrl}/resolve/${encodeURIComponent(name.revision)}/${encodePath(file.rfilename)}`,
      ...(file.sha256 === undefined ? {} : { sha256: file.sha256 }),
      ...(file.size === undefined ? {} : { size: file.size })
    }
  })

/** A file's size and version, from a HEAD (following the redirect to the CDN). */
export const headFile = (
  access: HubAccess,
  url: string
): Effect.Effect<{ readonly size: number; readonly etag: string; readonly sha256?: string }, HubError> =>
  Effect.gen(function* () {
    const answer = yield* request(access, url, { method: "HEAD" }, shownUrl(url))
    const etag = answer.response.headers.get("etag") ?? answer.linked.etag
    const length = answer.response.headers.get("content-length")
    const size = length !== null && /^\d+$/.test(length) ? Number(length) : answer.linked.size
    if (etag === undefined || etag === null || size === undefined) {
      return yield* new HubError({
        reason: "Protocol",
        url: shownUrl(url),
        message: `${shownUrl(url)}: the server gives no ETag or size, so a range cannot be pinned to one version`
      })
    }
    return { size, etag, ...sha256Of(answer.linked.etag ?? etag) }
  })

/** The SHA-256 an LFS ETag carries (`"<64 hex>"`), if it is one. */
const sha256Of = (etag: string | undefined): { sha256?: string } => {
  const m = etag === undefined ? null : /^(?:W\/)?"?([0-9a-f]{64})"?$/.exec(etag)
  return m === null ? {} : { sha256: m[1]! }
}

/** What a range read learned about the file: its size and version. */
export interface RangeInfo {
  readonly size: number
  readonly etag: string
  readonly sha256?: string
}

const contentRange = (header: string | null): { start: number; end: number; size: number } | undefined => {
  const m = header === null ? null : /^bytes (\d+)-(\d+)\/(\d+)$/.exec(header.trim())
  return m === null ? undefined : { start: Number(m[1]), end: Number(m[2]) + 1, size: Number(m[3]) }
}

/**
 * What a range answer must be: 206 for exactly the bytes from `at`, of the pinned version. A 200 to `If-Range` (or
 * another ETag) means the file changed (`Changed`); anything else is a protocol error. The body is dropped on failure.
 */
const checkRangeAnswer = (answer: Answer, shown: string, at: number, end: number, pinned: string | undefined) =>
  Effect.gen(function* () {
    const { response } = answer
    const got = response.headers.get("etag") ?? answer.linked.etag ?? undefined
    const range = contentRange(response.headers.get("content-range"))
    const refuse = (reason: HubError["reason"], message: string) =>
      Effect.promise(() => response.body?.cancel() ?? Promise.resolve()).pipe(
        Effect.zipRight(Effect.fail(new HubError({ reason, url: shown, message })))
      )
    const changed = `${shown} changed on the server since its header was read (ETag ${pinned} → ${got ?? "none"})`
    if (response.status !== 206 || range === undefined) {
      return yield* response.status === 200 && pinned !== undefined
        ? refuse("Changed", changed)
        : refuse("Protocol", `${shown}: the server does not answer range requests (HTTP ${response.status})`)
    }
    if (pinned !== undefined && got !== undefined && got !== pinned) return yield* refuse("Changed", changed)
    if (range.start !== at || range.end > end || got === undefined) {
      return yield* refuse(
        "Protocol",
        `${shown}: asked for bytes ${at}-${end - 1}, got ${response.headers.get("content-range")}` +
          (got === undefined ? " without an ETag" : "")
      )
    }
    return { got, range }
  })

/**
 * Reads bytes [start, end) of `url` into `sink` (called in order, each chunk once), pinned to `etag` when given.
 * A connection dropped part way is resumed from the last byte received (`attempts` in all, backing off); a file that
 * changed (another ETag, or a 200 to `If-Range`) fails `Changed` at once. Returns what the server said of the file.
 */
export const readRange = (
  access: HubAccess,
  url: string,
  start: number,
  end: number,
  etag: string | undefined,
  sink: (chunk: Uint8Array) => void
): Effect.Effect<RangeInfo, HubError> =>
  Effect.gen(function* () {
    let at = start
    let info: RangeInfo | undefined
    const shown = shownUrl(url)
    const attempt = Effect.gen(function* () {
      const pinned = etag ?? info?.etag
      const answer = yield* request(
        access,
        url,
        { method: "GET", range: [at, end], ...(pinned === undefined ? {} : { ifRange: pinned }) },
        shown
      )
      const { response } = answer
      const { got, range } = yield* checkRangeAnswer(answer, shown, at, end, pinned)
      info = { size: range.size, etag: got, ...sha256Of(answer.linked.etag ?? got) }
      const body = response.body
      if (body === null) return
      yield* Effect.tryPromise({
        try: async () => {
          for await (const chunk of body as unknown as AsyncIterable<Uint8Array>) {
            const room = Math.min(chunk.length, end - at)
            if (room <= 0) break
            sink(room === chunk.length ? chunk : chunk.subarray(0, room))
            at += room
          }
        },
        catch: (e) =>
          new HubError({
            reason: "Network",
            url: shown,
            message: `${shown}: the connection dropped at byte ${at}: ${e instanceof Error ? e.message : String(e)}`
          })
      })
      if (at < range.end) {
        return yield* new HubError({
          reason: "Network",
          url: shown,
          message: `${shown}: the body ended at byte ${at} of ${range.end}`
        })
      }
    })
    // Resume after a dropped connection (only: a refusal or a changed file is final).
    yield* Effect.suspend(() => (at < end ? attempt : Effect.void)).pipe(
      Effect.retry({
        schedule: Schedule.exponential(Duration.millis(100), 2).pipe(Schedule.upTo(Duration.seconds(10))),
        times: (access.attempts ?? 6) - 1,
        while: (e) => e.reason === "Network"
      })
    )
    if (info === undefined) {
      return yield* new HubError({ reason: "Protocol", url: shown, message: `${shown}: an empty range was asked` })
    }
    return info
  })
