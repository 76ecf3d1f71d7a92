/**
 * The fake Hugging Face hub (test/support/testHub.ts, issue 38 part 3), driven with plain `fetch`: manifests, resolve
 * redirects, the CDN's byte ranges, doors counted apart, and each fault (a cut body, an injected status, a replaced
 * file, a throttle, a prompt close).
 */
import { createHash, randomBytes } from "node:crypto"
import { mkdtempSync, rmSync, writeFileSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { afterAll, describe, expect, it } from "vitest"
import { type HubFile, type HubRepo, type HubRequest, type TestHub, startTestHub } from "../support/testHub.js"

const dir = mkdtempSync(join(tmpdir(), "swactor-test-hub-"))
afterAll(() => rmSync(dir, { recursive: true, force: true }))

/** A local file of `size` random bytes, its bytes and sha256. */
const localFile = (name: string, size: number): HubFile & { readonly bytes: Buffer; readonly sha256: string } => {
  const bytes = randomBytes(size)
  const path = join(dir, name)
  writeFileSync(path, bytes)
  return { path, bytes, sha256: createHash("sha256").update(bytes).digest("hex") }
}

const q8 = localFile("q8.gguf", 200_000)
const q4 = localFile("q4.gguf", 90_000)
const part2 = localFile("part2.gguf", 1_000)
const secret = localFile("secret.gguf", 5_000)
const other = localFile("other.gguf", 150_000)

const tiny: HubRepo = {
  files: {
    "tiny-Q8_0.gguf": q8.path,
    "Q4_K_M/tiny-Q4_K_M-00001-of-00002.gguf": q4.path,
    "Q4_K_M/tiny-Q4_K_M-00002-of-00002.gguf": part2.path
  },
  manifests: { Q8_0: "tiny-Q8_0.gguf", latest: "tiny-Q8_0.gguf", q4_k_m: "Q4_K_M/tiny-Q4_K_M-00001-of-00002.gguf" }
}
const repos = { "alice/tiny-GGUF": tiny, "corp/locked-GGUF": { files: { "m.gguf": secret.path }, gated: true } }
const token = "hf_test_token"

/** Runs `body` against a fresh hub, closed afterwards. */
const withHub = async (body: (hub: TestHub) => Promise<void>, doors = 1) => {
  const hub = await startTestHub({ repos, token, doors })
  try {
    await body(hub)
  } finally {
    await hub.close()
  }
}

const manual = { redirect: "manual" } as const
const resolveUrl = (hub: TestHub, file: string, door = 0, repo = "alice/tiny-GGUF") =>
  `${hub.endpoint(door)}${repo}/resolve/main/${file}`

/** The CDN address that resolve sends `file` to. */
const blobUrl = async (hub: TestHub, file: string, door = 0) => {
  const res = await fetch(resolveUrl(hub, file, door), manual)
  expect(res.status).toBe(302)
  return res.headers.get("location")!
}

/** Reads a body until it ends or breaks: the bytes that came and whether it broke. */
const readAll = async (res: Response) => {
  const chunks: Array<Uint8Array> = []
  let broke = false
  const reader = res.body!.getReader()
  try {
    for (let next = await reader.read(); !next.done; next = await reader.read()) chunks.push(next.value)
  } catch {
    broke = true
  }
  return { bytes: Buffer.concat(chunks), broke }
}

const cdnRequests = (hub: TestHub): ReadonlyArray<HubRequest> => hub.requests().filter((r) => r.host === "cdn")

describe("test hub: manifests", () => {
  it("a tag (any case) names its file with size and sha256; an unknown repo or tag is a 404 with an error", () =>
    withHub(async (hub) => {
      expect(hub.endpoint()).toMatch(/^http:\/\/127\.0\.0\.1:\d+\/$/)
      const res = await fetch(`${hub.endpoint()}v2/alice/tiny-GGUF/manifests/q8_0`, {
        headers: { "User-Agent": "llama-cpp", Accept: "application/json" }
      })
      expect(res.status).toBe(200)
      const body = (await res.json()) as { ggufFile: Record<string, unknown> }
      expect(body.ggufFile).toEqual({
        rfilename: "tiny-Q8_0.gguf",
        blobId: expect.stringMatching(/^[0-9a-f]{40}$/),
        size: q8.bytes.length,
        lfs: { sha256: q8.sha256, size: q8.bytes.length }
      })
      const split = await fetch(`${hub.endpoint()}v2/alice/tiny-GGUF/manifests/Q4_K_M`)
      expect(((await split.json()) as { ggufFile: { rfilename: string } }).ggufFile.rfilename).toBe(
        "Q4_K_M/tiny-Q4_K_M-00001-of-00002.gguf"
      )
      expect((await fetch(`${hub.endpoint()}v2/alice/tiny-GGUF/manifests/LATEST`)).status).toBe(200)
      for (const path of ["v2/alice/tiny-GGUF/manifests/Q2_K", "v2/bob/none-GGUF/manifests/Q8_0"]) {
        const missing = await fetch(`${hub.endpoint()}${path}`)
        expect(missing.status).toBe(404)
        expect(((await missing.json()) as { error: string }).error).toEqual(expect.any(String))
      }
    }))

  it("a gated repo's manifest needs the bearer token", () =>
    withHub(async (hub) => {
      const url = `${hub.endpoint()}v2/corp/locked-GGUF/manifests/latest`
      expect((await fetch(url)).status).toBe(401)
      expect((await fetch(url, { headers: { Authorization: "Bearer wrong" } })).status).toBe(401)
      // the repo has no manifest: past the gate, a 404
      expect((await fetch(url, { headers: { Authorization: `Bearer ${token}` } })).status).toBe(404)
    }))
})

describe("test hub: resolve", () => {
  it("redirects to the blob on the CDN with the hub's linked headers; the query is ignored; HEAD too", () =>
    withHub(async (hub) => {
      for (const method of ["GET", "HEAD"]) {
        const res = await fetch(`${resolveUrl(hub, "tiny-Q8_0.gguf")}?download=true`, { ...manual, method })
        expect(res.status).toBe(302)
        expect(res.headers.get("location")).toMatch(new RegExp(`^http://127\\.0\\.0\\.1:\\d+/blobs/${q8.sha256}$`))
        expect(res.headers.get("x-linked-etag")).toBe(`"${q8.sha256}"`)
        expect(res.headers.get("etag")).toBe(`"${q8.sha256}"`)
        expect(res.headers.get("x-linked-size")).toBe(String(q8.bytes.length))
        expect(res.headers.get("x-repo-commit")).toMatch(/^[0-9a-f]{40}$/)
      }
      expect(new URL(await blobUrl(hub, "tiny-Q8_0.gguf")).port).not.toBe(new URL(hub.endpoint()).port)
      const nested = await fetch(resolveUrl(hub, "Q4_K_M/tiny-Q4_K_M-00002-of-00002.gguf"), manual)
      expect(nested.headers.get("location")).toMatch(new RegExp(`/blobs/${part2.sha256}$`))
    }))

  it("a missing file is a 404 EntryNotFound; a missing repo a 401 RepositoryNotFound", () =>
    withHub(async (hub) => {
      const missing = await fetch(resolveUrl(hub, "nope.gguf"), manual)
      expect(missing.status).toBe(404)
      expect(missing.headers.get("x-error-code")).toBe("EntryNotFound")
      const noRepo = await fetch(resolveUrl(hub, "m.gguf", 0, "bob/none-GGUF"), manual)
      expect(noRepo.status).toBe(401)
      expect(noRepo.headers.get("x-error-code")).toBe("RepositoryNotFound")
    }))

  it("a gated file needs the token on the hub; following the redirect, the token does not reach the CDN", () =>
    withHub(async (hub) => {
      const url = resolveUrl(hub, "m.gguf", 0, "corp/locked-GGUF")
      expect((await fetch(url, manual)).status).toBe(401)
      expect((await fetch(url, { ...manual, headers: { Authorization: "Bearer wrong" } })).status).toBe(401)
      hub.reset()
      const res = await fetch(url, { headers: { Authorization: `Bearer ${token}` } })
      expect(res.status).toBe(200)
      expect(Buffer.from(await res.arrayBuffer()).equals(secret.bytes)).toBe(true)
      expect(hub.requests().map((r) => [r.host, r.status, r.authorized])).toEqual([
        ["hub", 302, true],
        ["cdn", 200, false]
      ])
      const sent = await fetch(`http://127.0.0.1:${new URL(await blobUrl(hub, "tiny-Q8_0.gguf")).port}/blobs/x`, {
        headers: { Authorization: "Bearer x" }
      })
      expect(sent.status).toBe(404)
      expect(hub.requests().at(-1)).toMatchObject({ host: "cdn", authorized: true, status: 404 })
    }))
})

describe("test hub: CDN", () => {
  it("serves byte ranges with Content-Range, whole bodies without, 416 past the end, 404 for an unknown blob", () =>
    withHub(async (hub) => {
      const blob = await blobUrl(hub, "tiny-Q8_0.gguf")
      const size = q8.bytes.length
      const head = await fetch(blob, { method: "HEAD" })
      expect(head.status).toBe(200)
      expect(head.headers.get("accept-ranges")).toBe("bytes")
      expect(head.headers.get("etag")).toBe(`"${q8.sha256}"`)
      expect(head.headers.get("content-length")).toBe(String(size))
      const cases: Array<[string, number, number]> = [
        ["bytes=100-199", 100, 199],
        ["bytes=150000-", 150_000, size - 1],
        ["bytes=199990-300000", 199_990, size - 1],
        ["bytes=-10", size - 10, size - 1]
      ]
      for (const [range, first, last] of cases) {
        const res = await fetch(blob, { headers: { Range: range } })
        expect(res.status).toBe(206)
        expect(res.headers.get("content-range")).toBe(`bytes ${first}-${last}/${size}`)
        expect(res.headers.get("content-length")).toBe(String(last - first + 1))
        expect(Buffer.from(await res.arrayBuffer()).equals(q8.bytes.subarray(first, last + 1))).toBe(true)
      }
      const whole = await fetch(blob)
      expect(whole.status).toBe(200)
      expect(Buffer.from(await whole.arrayBuffer()).equals(q8.bytes)).toBe(true)
      const past = await fetch(blob, { headers: { Range: `bytes=${size}-` } })
      expect(past.status).toBe(416)
      expect(past.headers.get("content-range")).toBe(`bytes */${size}`)
      expect((await fetch(blob.replace(q8.sha256, "0".repeat(64)))).status).toBe(404)
      expect(cdnRequests(hub).map((r) => r.range)).toContain("bytes=100-199")
    }))

  it("If-Range: the blob's ETag keeps the range; any other gives the whole body", () =>
    withHub(async (hub) => {
      const blob = await blobUrl(hub, "tiny-Q8_0.gguf")
      const same = await fetch(blob, { headers: { Range: "bytes=0-9", "If-Range": `"${q8.sha256}"` } })
      expect(same.status).toBe(206)
      expect((await same.arrayBuffer()).byteLength).toBe(10)
      for (const stale of [`"${"a".repeat(64)}"`, `W/"${q8.sha256}"`]) {
        const res = await fetch(blob, { headers: { Range: "bytes=0-9", "If-Range": stale } })
        expect(res.status).toBe(200)
        expect(res.headers.get("content-range")).toBeNull()
        expect(Buffer.from(await res.arrayBuffer()).equals(q8.bytes)).toBe(true)
      }
    }))

  it("counts each door's requests and CDN bytes apart; reset clears them", () =>
    withHub(async (hub) => {
      expect(hub.endpoint(0)).not.toBe(hub.endpoint(1))
      const blob0 = await blobUrl(hub, "tiny-Q8_0.gguf", 0)
      const blob1 = await blobUrl(hub, "tiny-Q8_0.gguf", 1)
      expect(new URL(blob0).port).not.toBe(new URL(blob1).port)
      await (await fetch(blob0, { headers: { Range: "bytes=0-999" } })).arrayBuffer()
      await (await fetch(blob1, { headers: { Range: "bytes=0-4999" } })).arrayBuffer()
      await (await fetch(blob1, { headers: { Range: "bytes=5000-5099" } })).arrayBuffer()
      await fetch(blob1, { method: "HEAD" })
      expect(hub.bytesServed(0)).toBe(1000)
      expect(hub.bytesServed(1)).toBe(5100)
      expect(hub.bytesServed()).toBe(6100)
      expect(hub.requests().filter((r) => r.door === 1 && r.host === "hub")).toHaveLength(1)
      expect(cdnRequests(hub).map((r) => [r.door, r.method, r.status, r.bytes])).toEqual([
        [0, "GET", 206, 1000],
        [1, "GET", 206, 5000],
        [1, "GET", 206, 100],
        [1, "HEAD", 200, 0]
      ])
      expect(() => hub.endpoint(2)).toThrow()
      hub.reset()
      expect(hub.requests()).toEqual([])
      expect(hub.bytesServed()).toBe(0)
    }, 2))
})

describe("test hub: faults", () => {
  it("dropAfter cuts the next CDN body after that many bytes, then clears itself", () =>
    withHub(async (hub) => {
      const blob = await blobUrl(hub, "tiny-Q8_0.gguf")
      hub.reset()
      hub.dropAfter(70_000)
      const cut = await readAll(await fetch(blob))
      expect(cut.broke).toBe(true)
      expect(cut.bytes.equals(q8.bytes.subarray(0, 70_000))).toBe(true)
      expect(hub.bytesServed()).toBe(70_000)
      // the resumption: a range from where it stopped, in full
      const rest = await readAll(await fetch(blob, { headers: { Range: "bytes=70000-" } }))
      expect(rest.broke).toBe(false)
      expect(Buffer.concat([cut.bytes, rest.bytes]).equals(q8.bytes)).toBe(true)
      hub.dropAfter(10, 2)
      expect((await readAll(await fetch(blob, { headers: { Range: "bytes=0-99" } }))).bytes.length).toBe(10)
      expect((await readAll(await fetch(blob, { headers: { Range: "bytes=0-99" } }))).bytes.length).toBe(10)
      expect((await readAll(await fetch(blob, { headers: { Range: "bytes=0-99" } }))).broke).toBe(false)
    }))

  it("failNext answers a status on the next matching request (hub or CDN), `times` times", () =>
    withHub(async (hub) => {
      const blob = await blobUrl(hub, "tiny-Q8_0.gguf")
      hub.failNext(503, /\/blobs\//, 2)
      hub.failNext(403, /manifests/)
      // a hub request does not match the CDN's fault
      expect((await fetch(resolveUrl(hub, "tiny-Q8_0.gguf"), manual)).status).toBe(302)
      expect((await fetch(blob)).status).toBe(503)
      expect((await fetch(blob)).status).toBe(503)
      expect((await fetch(blob, { headers: { Range: "bytes=0-0" } })).status).toBe(206)
      expect((await fetch(`${hub.endpoint()}v2/alice/tiny-GGUF/manifests/latest`)).status).toBe(403)
      expect((await fetch(`${hub.endpoint()}v2/alice/tiny-GGUF/manifests/latest`)).status).toBe(200)
      hub.failNext(416)
      const refused = await fetch(blob, { headers: { Range: "bytes=0-0" } })
      expect(refused.status).toBe(416)
      expect(refused.headers.get("content-range")).toBe(`bytes */${q8.bytes.length}`)
      hub.failNext(500)
      expect((await fetch(resolveUrl(hub, "tiny-Q8_0.gguf"), manual)).status).toBe(500)
      expect((await fetch(resolveUrl(hub, "tiny-Q8_0.gguf"), manual)).status).toBe(302)
    }))

  it("replace gives the file a new sha256 and ETag; resolve sends to the new blob, a stale If-Range gets it whole", () =>
    withHub(async (hub) => {
      const before = await fetch(resolveUrl(hub, "tiny-Q8_0.gguf"), manual)
      const oldBlob = before.headers.get("location")!
      hub.replace("alice/tiny-GGUF", "tiny-Q8_0.gguf", other.path)
      const after = await fetch(resolveUrl(hub, "tiny-Q8_0.gguf"), manual)
      const newBlob = after.headers.get("location")!
      expect(newBlob).toMatch(new RegExp(`/blobs/${other.sha256}$`))
      expect(after.headers.get("etag")).toBe(`"${other.sha256}"`)
      expect(after.headers.get("x-linked-size")).toBe(String(other.bytes.length))
      expect(after.headers.get("x-repo-commit")).not.toBe(before.headers.get("x-repo-commit"))
      const manifest = await fetch(`${hub.endpoint()}v2/alice/tiny-GGUF/manifests/Q8_0`)
      expect(((await manifest.json()) as { ggufFile: { lfs: { sha256: string } } }).ggufFile.lfs.sha256).toBe(
        other.sha256
      )
      // a download begun on the old file resumes with If-Range: the new blob answers whole
      const resumed = await fetch(newBlob, { headers: { Range: "bytes=1000-", "If-Range": `"${q8.sha256}"` } })
      expect(resumed.status).toBe(200)
      expect(resumed.headers.get("etag")).toBe(`"${other.sha256}"`)
      expect(Buffer.from(await resumed.arrayBuffer()).equals(other.bytes)).toBe(true)
      // the CDN is content-addressed: the old blob is still there under its own sha256
      expect(Buffer.from(await (await fetch(oldBlob)).arrayBuffer()).equals(q8.bytes)).toBe(true)
    }))

  it("throttle paces CDN bodies; undefined lifts it", () =>
    withHub(async (hub) => {
      const blob = await blobUrl(hub, "tiny-Q8_0.gguf")
      hub.throttle(100_000)
      const started = Date.now()
      const slow = await readAll(await fetch(blob, { headers: { Range: "bytes=0-29999" } }))
      const slowMillis = Date.now() - started
      expect(slow.bytes.equals(q8.bytes.subarray(0, 30_000))).toBe(true)
      expect(slowMillis).toBeGreaterThanOrEqual(250)
      hub.throttle(undefined)
      const fast = Date.now()
      await (await fetch(blob)).arrayBuffer()
      expect(Date.now() - fast).toBeLessThan(slowMillis)
    }))

  it("close ends promptly with a throttled body in flight and keep-alive connections open", async () => {
    const hub = await startTestHub({ repos, token })
    const blob = await blobUrl(hub, "tiny-Q8_0.gguf")
    hub.throttle(1_000)
    const res = await fetch(blob)
    const reading = readAll(res)
    await new Promise((done) => setTimeout(done, 100))
    const started = Date.now()
    await hub.close()
    expect(Date.now() - started).toBeLessThan(1_000)
    const got = await reading
    expect(got.broke).toBe(true)
    expect(got.bytes.length).toBeLessThan(q8.bytes.length)
    await expect(fetch(hub.endpoint())).rejects.toThrow()
  })
})
