/**
 * A fake Hugging Face hub and its CDN for tests (issue 38): real `node:http` servers on 127.0.0.1 that answer what
 * `hf:user/repo:QUANT`, `hf:user/repo/path/file.gguf` and plain `https://…/file.gguf` models need, and inject faults.
 * Never the internet.
 *
 * Each door is its own hub server plus its own CDN server (ephemeral ports), all doors sharing one repo state, so a
 * test can give each node its own door and count what each node asked for and downloaded.
 *
 * Hub host:
 * - `GET /v2/{user}/{repo}/manifests/{tag}` (tag case-insensitive): 200 `{"ggufFile":{rfilename, blobId, size,
 *   lfs:{sha256, size}}}` as the hub answers llama.cpp's `User-Agent: llama-cpp`; unknown repo or tag: 404
 *   `{"error":…}`; a gated repo without `Authorization: Bearer <token>`: 401.
 * - `HEAD|GET /{user}/{repo}/resolve/{revision}/{rfilename…}` (any revision; the query is ignored): 302 to
 *   `/blobs/<sha256>` on this door's CDN, with `X-Linked-Etag`, `X-Linked-Size`, `ETag` and `X-Repo-Commit`. A
 *   missing file: 404 `X-Error-Code: EntryNotFound`; an unknown repo: 401 `X-Error-Code: RepositoryNotFound` (as the
 *   real hub, which does not tell a private repo from a missing one); gated without the token: 401.
 *
 * CDN host: `HEAD|GET /blobs/{sha256}` with `Accept-Ranges: bytes` and a strong `ETag`; `Range: bytes=a-b`, `a-` and
 * `-n` give 206 with `Content-Range`; a start at or past the end gives 416 `Content-Range: bytes *\/size`; an
 * `If-Range` other than the blob's ETag gives the whole body (200); a malformed or multi-part Range is ignored (200,
 * RFC 9110). Blobs are content-addressed: after `replace` the old blob is still served under its old sha256; only
 * resolve points at the new one. The CDN never asks for a token, but records whether one came.
 *
 * Bodies are read from the local files with positioned reads (never whole into memory). The request log records a
 * request when it arrives, and its body bytes as they are handed to the socket, so a client that has read N bytes
 * always finds at least N counted.
 */
import { createHash } from "node:crypto"
import * as Fs from "node:fs"
import * as FsP from "node:fs/promises"
import * as Http from "node:http"
import type { AddressInfo, Socket } from "node:net"
import { setTimeout as sleep } from "node:timers/promises"

/** A local file served as a repo file. */
export interface HubFile {
  readonly path: string
}

export interface HubRepo {
  /** rfilename (may contain "/") -> local file path. */
  readonly files: Record<string, string>
  /** tag (case-insensitive, e.g. "Q8_0", "latest") -> rfilename (the first part of a split set). */
  readonly manifests?: Record<string, string>
  /** Needs `Authorization: Bearer <token>` on the hub host. */
  readonly gated?: boolean
}

export interface TestHubOptions {
  /** "user/repo" -> repo. */
  readonly repos: Record<string, HubRepo>
  /** The token a gated repo accepts (none: a gated repo lets nobody in). */
  readonly token?: string
  /** How many doors (hub + CDN server pairs); default 1. */
  readonly doors?: number
}

export interface HubRequest {
  readonly door: number
  readonly host: "hub" | "cdn"
  readonly method: string
  /** The URL's path, without its query. */
  readonly path: string
  readonly status: number
  /** The Range header as received. */
  readonly range?: string
  /** Body bytes actually written (handed to the socket). */
  readonly bytes: number
  /** An Authorization header was present. */
  readonly authorized: boolean
}

export interface TestHub {
  /** "http://127.0.0.1:PORT/" of that door's hub host (door 0 when omitted). */
  readonly endpoint: (door?: number) => string
  readonly requests: () => ReadonlyArray<HubRequest>
  /** Body bytes sent by that door's CDN (all doors when omitted) since the last reset. */
  readonly bytesServed: (door?: number) => number
  /** Clears the request log and counters (faults stay armed). */
  readonly reset: () => void
  /** The next `times` (default 1) CDN body responses are cut (socket destroyed) after `bytes` body bytes. */
  readonly dropAfter: (bytes: number, times?: number) => void
  /** The next `times` (default 1) requests whose path matches `match` (any when omitted), hub or CDN, get `status`. */
  readonly failNext: (status: 401 | 403 | 404 | 416 | 500 | 503, match?: RegExp, times?: number) => void
  /** The repo file now has other content: new sha256 and ETag; resolve redirects to the new blob. */
  readonly replace: (repo: string, rfilename: string, newLocalPath: string) => void
  /** Paces CDN bodies to `bytesPerSecond` (undefined: full speed); applies to bodies in flight too. */
  readonly throttle: (bytesPerSecond: number | undefined) => void
  /** Closes every server and open socket. */
  readonly close: () => Promise<void>
}

// ---------------------------------------------------------------------------------------------------------------
// State
// ---------------------------------------------------------------------------------------------------------------

interface Blob extends HubFile {
  readonly size: number
  readonly sha256: string
}

interface RepoState {
  readonly gated: boolean
  /** lower-cased tag -> rfilename */
  readonly manifests: Map<string, string>
  readonly files: Map<string, Blob>
  commit: string
}

interface Entry {
  door: number
  host: "hub" | "cdn"
  method: string
  path: string
  status: number
  range?: string
  bytes: number
  authorized: boolean
}

interface Fault<A> {
  readonly value: A
  readonly match: RegExp | undefined
  left: number
}

interface Hub {
  readonly repos: Map<string, RepoState>
  readonly blobs: Map<string, Blob>
  readonly token: string | undefined
  readonly failures: Array<Fault<number>>
  readonly drops: Array<Fault<number>>
  readonly log: Array<Entry>
  readonly cdnPorts: Array<number>
  readonly closing: AbortController
  bytesPerSecond: number | undefined
}

const chunkBytes = 64 * 1024

const sha256Stream = (path: string) =>
  new Promise<string>((resolve, reject) => {
    const hash = createHash("sha256")
    Fs.createReadStream(path, { highWaterMark: 1 << 20 })
      .on("data", (chunk) => hash.update(chunk))
      .on("error", reject)
      .on("end", () => resolve(hash.digest("hex")))
  })

/** The same without leaving the caller's turn (for `replace`, whose signature is synchronous): positioned reads. */
const sha256Sync = (path: string) => {
  const hash = createHash("sha256")
  const fd = Fs.openSync(path, "r")
  try {
    const buffer = Buffer.allocUnsafe(1 << 20)
    for (let n = Fs.readSync(fd, buffer); n > 0; n = Fs.readSync(fd, buffer)) hash.update(buffer.subarray(0, n))
  } finally {
    Fs.closeSync(fd)
  }
  return hash.digest("hex")
}

/** The git blob id of the file's LFS pointer (what the hub's `blobId` is). */
const blobIdOf = (blob: Blob) => {
  const pointer = `version https://git-lfs.github.com/spec/v1\noid sha256:${blob.sha256}\nsize ${blob.size}\n`
  return createHash("sha1")
    .update(`blob ${Buffer.byteLength(pointer)}\0${pointer}`)
    .digest("hex")
}

const commitOf = (repo: string, files: Map<string, Blob>) =>
  createHash("sha1")
    .update(repo)
    .update([...files].map(([name, blob]) => `${name}:${blob.sha256}`).join("\n"))
    .digest("hex")

const loadRepos = async (repos: Record<string, HubRepo>) => {
  const hashes = new Map<string, Promise<string>>()
  const hashOf = (path: string) => {
    const known = hashes.get(path) ?? sha256Stream(path)
    hashes.set(path, known)
    return known
  }
  const out = new Map<string, RepoState>()
  for (const [name, repo] of Object.entries(repos)) {
    const files = new Map<string, Blob>()
    for (const [rfilename, path] of Object.entries(repo.files))
      files.set(rfilename, { path, size: (await FsP.stat(path)).size, sha256: await hashOf(path) })
    const manifests = new Map(Object.entries(repo.manifests ?? {}).map(([tag, file]) => [tag.toLowerCase(), file]))
    out.set(name, { gated: repo.gated === true, manifests, files, commit: commitOf(name, files) })
  }
  return out
}

/** Takes one use of the first armed fault that matches `path` (undefined: none). */
const takeFault = <A>(faults: Array<Fault<A>>, path: string): A | undefined => {
  const index = faults.findIndex((f) => f.match === undefined || new RegExp(f.match.source, f.match.flags).test(path))
  const fault = faults[index]
  if (fault === undefined) return undefined
  fault.left -= 1
  if (fault.left <= 0) faults.splice(index, 1)
  return fault.value
}

// ---------------------------------------------------------------------------------------------------------------
// Responses
// ---------------------------------------------------------------------------------------------------------------

const answer = (
  res: Http.ServerResponse,
  entry: Entry,
  status: number,
  headers: Record<string, string | number> = {},
  body = ""
) => {
  entry.status = status
  const bytes = Buffer.from(body)
  res.writeHead(status, { "Content-Length": bytes.length, ...headers })
  if (entry.method !== "HEAD" && bytes.length > 0) {
    entry.bytes += bytes.length
    res.end(bytes)
  } else res.end()
}

const json = (res: Http.ServerResponse, entry: Entry, status: number, value: unknown) =>
  answer(res, entry, status, { "Content-Type": "application/json" }, JSON.stringify(value))

const segments = (path: string) => path.split("/").slice(1).map(decodeURIComponent)

/** Whether the request carries the hub's token. */
const admitted = (hub: Hub, req: Http.IncomingMessage) =>
  hub.token !== undefined && req.headers.authorization === `Bearer ${hub.token}`

const manifest = (hub: Hub, req: Http.IncomingMessage, res: Http.ServerResponse, entry: Entry, parts: string[]) => {
  const [, user, name, , tag] = parts
  const repo = hub.repos.get(`${user}/${name}`)
  if (repo?.gated === true && !admitted(hub, req))
    return json(res, entry, 401, { error: "Access to this repo is gated" })
  const rfilename = repo?.manifests.get((tag ?? "").toLowerCase())
  const blob = rfilename === undefined ? undefined : repo?.files.get(rfilename)
  if (rfilename === undefined || blob === undefined)
    return json(res, entry, 404, { error: `The specified tag is not available in the repository: ${tag}` })
  const ggufFile = { rfilename, blobId: blobIdOf(blob), size: blob.size, lfs: { sha256: blob.sha256, size: blob.size } }
  return json(res, entry, 200, { ggufFile })
}

const resolve = (
  hub: Hub,
  door: number,
  req: Http.IncomingMessage,
  res: Http.ServerResponse,
  entry: Entry,
  parts: string[]
) => {
  const [user, name, , , ...file] = parts
  const repo = hub.repos.get(`${user}/${name}`)
  if (repo === undefined)
    return answer(res, entry, 401, { "X-Error-Code": "RepositoryNotFound", "X-Error-Message": "Repository not found" })
  if (repo.gated && !admitted(hub, req))
    return answer(res, entry, 401, { "X-Error-Code": "GatedRepo", "X-Error-Message": "Access to this repo is gated" })
  const blob = repo.files.get(file.join("/"))
  if (blob === undefined)
    return answer(res, entry, 404, { "X-Error-Code": "EntryNotFound", "X-Error-Message": "Entry not found" })
  return answer(res, entry, 302, {
    Location: `http://127.0.0.1:${hub.cdnPorts[door]}/blobs/${blob.sha256}`,
    "X-Linked-Etag": `"${blob.sha256}"`,
    "X-Linked-Size": blob.size,
    ETag: `"${blob.sha256}"`,
    "X-Repo-Commit": repo.commit
  })
}

const onHub = (hub: Hub, door: number, req: Http.IncomingMessage, res: Http.ServerResponse, entry: Entry) => {
  const parts = segments(entry.path)
  const readable = entry.method === "GET" || entry.method === "HEAD"
  if (parts[0] === "v2" && parts[3] === "manifests" && parts.length === 5 && readable)
    return manifest(hub, req, res, entry, parts)
  if (parts[2] === "resolve" && parts.length >= 5 && readable) return resolve(hub, door, req, res, entry, parts)
  return json(res, entry, readable ? 404 : 405, { error: "Not found" })
}

/** The first and last byte a Range header asks for; undefined: no usable Range (serve all); "unsatisfiable". */
const rangeOf = (header: string | undefined, size: number): [number, number] | "unsatisfiable" | undefined => {
  const m = header === undefined ? null : /^bytes=(\d*)-(\d*)$/.exec(header.trim())
  if (m === null || (m[1] === "" && m[2] === "")) return undefined
  if (m[1] === "") {
    const suffix = Number(m[2])
    return suffix === 0 ? "unsatisfiable" : size === 0 ? "unsatisfiable" : [Math.max(0, size - suffix), size - 1]
  }
  const first = Number(m[1])
  const last = m[2] === "" ? size - 1 : Math.min(Number(m[2]), size - 1)
  if (m[2] !== "" && Number(m[2]) < first) return undefined
  return first >= size ? "unsatisfiable" : [first, last]
}

/** Writes `chunk`; false when the connection is gone. */
const writeChunk = (res: Http.ServerResponse, chunk: Buffer) =>
  new Promise<boolean>((done) => {
    if (res.destroyed) return done(false)
    const onClose = () => done(false)
    res.once("close", onClose)
    res.write(chunk, (error) => {
      res.off("close", onClose)
      done(error === undefined || error === null)
    })
  })

/** Streams bytes [first, last] of the blob, paced by the throttle, cut after `cut` bytes when set. */
const sendBody = async (
  hub: Hub,
  res: Http.ServerResponse,
  entry: Entry,
  blob: Blob,
  span: [number, number],
  cut?: number
) => {
  const [first, last] = span
  const total = last - first + 1
  const limit = cut === undefined ? total : Math.min(cut, total)
  const file = await FsP.open(blob.path, "r")
  const started = Date.now()
  let sent = 0
  try {
    while (sent < limit && !res.destroyed) {
      const pace = hub.bytesPerSecond
      const size = Math.min(
        limit - sent,
        pace === undefined ? chunkBytes : Math.max(1, Math.min(chunkBytes, Math.floor(pace / 20)))
      )
      const { bytesRead, buffer } = await file.read(Buffer.allocUnsafe(size), 0, size, first + sent)
      if (bytesRead === 0) break
      entry.bytes += bytesRead
      sent += bytesRead
      if (!(await writeChunk(res, buffer.subarray(0, bytesRead)))) return
      if (pace !== undefined) {
        const due = started + (sent / pace) * 1000 - Date.now()
        if (due > 0) await sleep(due, undefined, { signal: hub.closing.signal }).catch(() => undefined)
      }
    }
  } finally {
    await file.close()
  }
  if (sent < total) res.destroy()
  else res.end()
}

const onCdn = (hub: Hub, req: Http.IncomingMessage, res: Http.ServerResponse, entry: Entry) => {
  const parts = segments(entry.path)
  const readable = entry.method === "GET" || entry.method === "HEAD"
  const blob = parts[0] === "blobs" && parts.length === 2 ? hub.blobs.get(parts[1] ?? "") : undefined
  if (blob === undefined || !readable) return answer(res, entry, readable ? 404 : 405, {}, "Not found")
  const etag = `"${blob.sha256}"`
  const base = { "Accept-Ranges": "bytes", ETag: etag, "Content-Type": "application/octet-stream" }
  const ifRange = req.headers["if-range"]
  const range = ifRange === undefined || ifRange === etag ? rangeOf(req.headers.range, blob.size) : undefined
  if (range === "unsatisfiable") return answer(res, entry, 416, { ...base, "Content-Range": `bytes */${blob.size}` })
  const span: [number, number] = range ?? [0, blob.size - 1]
  const length = span[1] - span[0] + 1
  entry.status = range === undefined ? 200 : 206
  res.writeHead(entry.status, {
    ...base,
    "Content-Length": length,
    ...(range === undefined ? {} : { "Content-Range": `bytes ${span[0]}-${span[1]}/${blob.size}` })
  })
  if (entry.method === "HEAD" || length === 0) return res.end()
  const cut = takeFault(hub.drops, entry.path)
  sendBody(hub, res, entry, blob, span, cut).catch(() => res.destroy())
}

/** The injected failure's answer; a 416 from the CDN names the blob's size as a real one would. */
const injected = (hub: Hub, res: Http.ServerResponse, entry: Entry, status: number) => {
  const blob = entry.host === "cdn" ? hub.blobs.get(segments(entry.path)[1] ?? "") : undefined
  const headers = status === 416 && blob !== undefined ? { "Content-Range": `bytes */${blob.size}` } : {}
  return answer(
    res,
    entry,
    status,
    { "Content-Type": "application/json", ...headers },
    `{"error":"injected ${status}"}`
  )
}

const handler =
  (hub: Hub, door: number, host: "hub" | "cdn") => (req: Http.IncomingMessage, res: Http.ServerResponse) => {
    const entry: Entry = {
      door,
      host,
      method: req.method ?? "GET",
      path: (req.url ?? "/").split("?")[0] ?? "/",
      status: 0,
      bytes: 0,
      authorized: req.headers.authorization !== undefined
    }
    if (req.headers.range !== undefined) entry.range = req.headers.range
    hub.log.push(entry)
    req.resume()
    try {
      const failure = takeFault(hub.failures, entry.path)
      if (failure !== undefined) return injected(hub, res, entry, failure)
      return host === "hub" ? onHub(hub, door, req, res, entry) : onCdn(hub, req, res, entry)
    } catch (error) {
      return answer(res, entry, 500, {}, String(error))
    }
  }

// ---------------------------------------------------------------------------------------------------------------
// Servers
// ---------------------------------------------------------------------------------------------------------------

const listen = async (serve: Http.RequestListener, sockets: Set<Socket>) => {
  const server = Http.createServer(serve)
  server.on("connection", (socket) => {
    sockets.add(socket)
    socket.once("close", () => sockets.delete(socket))
  })
  await new Promise<void>((done, fail) => {
    server.once("error", fail)
    server.listen(0, "127.0.0.1", () => done())
  })
  return { server, port: (server.address() as AddressInfo).port }
}

const replaceFile = (hub: Hub, repoName: string, rfilename: string, path: string) => {
  const repo = hub.repos.get(repoName)
  if (repo === undefined) throw new Error(`testHub.replace: no repo ${repoName}`)
  const blob: Blob = { path, size: Fs.statSync(path).size, sha256: sha256Sync(path) }
  repo.files.set(rfilename, blob)
  repo.commit = commitOf(repoName, repo.files)
  // the old blob stays served under its own sha256 (the CDN is content-addressed); resolve now points here
  hub.blobs.set(blob.sha256, blob)
}

/** Starts the hub's doors (each a hub server and a CDN server on 127.0.0.1), serving `options.repos`. */
export const startTestHub = async (options: TestHubOptions): Promise<TestHub> => {
  const repos = await loadRepos(options.repos)
  const hub: Hub = {
    repos,
    blobs: new Map([...repos.values()].flatMap((r) => [...r.files.values()].map((b) => [b.sha256, b] as const))),
    token: options.token,
    failures: [],
    drops: [],
    log: [],
    cdnPorts: [],
    closing: new AbortController(),
    bytesPerSecond: undefined
  }
  const sockets = new Set<Socket>()
  const servers: Array<Http.Server> = []
  const hubPorts: Array<number> = []
  try {
    for (let door = 0; door < (options.doors ?? 1); door++) {
      const cdn = await listen(handler(hub, door, "cdn"), sockets)
      servers.push(cdn.server)
      hub.cdnPorts.push(cdn.port)
      const front = await listen(handler(hub, door, "hub"), sockets)
      servers.push(front.server)
      hubPorts.push(front.port)
    }
  } catch (error) {
    for (const s of servers) s.close()
    throw error
  }
  const arm = <A>(faults: Array<Fault<A>>, value: A, match: RegExp | undefined, times = 1) => {
    if (times > 0) faults.push({ value, match, left: times })
  }
  const door = (n: number) => {
    if (!Number.isInteger(n) || n < 0 || n >= hubPorts.length) throw new Error(`testHub: no door ${n}`)
    return n
  }
  return {
    endpoint: (n = 0) => `http://127.0.0.1:${hubPorts[door(n)]}/`,
    requests: () => hub.log.map((e) => ({ ...e })),
    bytesServed: (n) =>
      hub.log
        .filter((e) => e.host === "cdn" && (n === undefined || e.door === door(n)))
        .reduce((sum, e) => sum + e.bytes, 0),
    reset: () => {
      hub.log.length = 0
    },
    dropAfter: (bytes, times) => arm(hub.drops, bytes, undefined, times),
    failNext: (status, match, times) => arm(hub.failures, status, match, times),
    replace: (repo, rfilename, path) => replaceFile(hub, repo, rfilename, path),
    throttle: (bytesPerSecond) => {
      hub.bytesPerSecond = bytesPerSecond !== undefined && bytesPerSecond > 0 ? bytesPerSecond : undefined
    },
    close: async () => {
      hub.closing.abort()
      const closed = servers.map((s) => new Promise<void>((done) => s.close(() => done())))
      for (const socket of sockets) socket.destroy()
      await Promise.all(closed)
    }
  }
}
