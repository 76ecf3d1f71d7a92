/**
 * A model by name (issue 38 part 3), against the test hub (test/support/testHub.ts: a real HTTP hub and CDN on
 * loopback, never the internet): names parsed as node-llama-cpp's resolveModelFile takes them, headers read with Range
 * requests only (and recalled from disk on a warm start, which asks for the manifest alone), each stage's slice fetched
 * as byte ranges and byte-identical to the slice cut from the local file, and every fault the issue lists.
 */
import { afterAll, assert, beforeAll, describe, it } from "@effect/vitest"
import { Effect, Either, Redacted } from "effect"
import { existsSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { type GgufFile } from "../../src/domain/gguf.js"
import { parseModelName } from "../../src/domain/modelName.js"
import { readGgufFile } from "../../src/layers/gguf/GgufReader.js"
import { type SliceRange, sliceTensors, writeGgufSlice } from "../../src/layers/gguf/GgufSlice.js"
import { writeSyntheticModel } from "../../src/layers/gguf/Synthetic.js"
import type { HubAccess } from "../../src/layers/gguf/HubClient.js"
import { openRemoteModel } from "../../src/layers/gguf/RemoteGguf.js"
import { fetchRemoteSlice, sliceFetchBytes } from "../../src/layers/gguf/RemoteSlice.js"
import { writeConverted } from "../support/convertedModels.js"
import { startTestHub, type TestHub } from "../support/testHub.js"

const dir = mkdtempSync(join(tmpdir(), "swactor-remote-model-"))
const TOKEN = "hf_test_token_0123456789"
let hub: TestHub
let single: string
let changed: string
let parts: ReadonlyArray<string>

const access = (door = 0, token?: string): HubAccess => ({
  endpoint: hub.endpoint(door),
  ...(token === undefined ? {} : { token: Redacted.make(token) })
})

const synth = (path: string, seed: number) =>
  writeSyntheticModel({
    path,
    arch: "llama",
    layers: 4,
    hidden: 256,
    ffn: 768,
    heads: 4,
    kvHeads: 2,
    vocab: 512,
    contextLength: 1024,
    type: "f32",
    seed
  })

beforeAll(async () => {
  single = join(dir, "tiny.Q8_0.gguf")
  changed = join(dir, "tiny-changed.gguf")
  await Effect.runPromise(synth(single, 1))
  await Effect.runPromise(synth(changed, 2))
  // a 3-part set written by gguf-py: blk.0 (with token_embd), blk.1 alone, then blk.2.. with the head
  parts = writeConverted("llama", join(dir, "set.gguf"), 3, {
    cuts: ["blk.1.attn_norm.weight", "blk.2.attn_norm.weight"]
  })
  hub = await startTestHub({
    token: TOKEN,
    doors: 2,
    repos: {
      "test/tiny-GGUF": { files: { "tiny.Q8_0.gguf": single }, manifests: { Q8_0: "tiny.Q8_0.gguf" } },
      "test/set-GGUF": {
        files: Object.fromEntries(parts.map((p) => [`q8/${p.split("/").at(-1)!}`, p])),
        manifests: { Q8_0: `q8/${parts[0]!.split("/").at(-1)!}` }
      },
      "test/gated-GGUF": { files: { "tiny.Q8_0.gguf": single }, manifests: { Q8_0: "tiny.Q8_0.gguf" }, gated: true }
    }
  })
}, 120_000)
afterAll(async () => {
  await hub?.close()
  rmSync(dir, { recursive: true, force: true })
})

const freshDir = (name: string) => mkdtempSync(join(dir, `${name}-`))

/** The same header: metadata, and every tensor's name, type, shape and size (offsets are the parts'). */
const sameHeader = (remote: GgufFile, local: GgufFile) => {
  assert.deepStrictEqual([...remote.metadata.keys()], [...local.metadata.keys()])
  for (const [k, v] of local.metadata) assert.deepStrictEqual(remote.metadata.get(k), v, k)
  assert.deepStrictEqual(
    remote.tensors.map((t) => [t.name, t.type, t.dims.join(), t.offset, t.byteSize, t.part ?? 0]),
    local.tensors.map((t) => [t.name, t.type, t.dims.join(), t.offset, t.byteSize, t.part ?? 0])
  )
}

const fileSize = (path: string) => readFileSync(path).length

describe("model names", () => {
  it("parses hub names, files in a repository and URLs; refuses what is neither", () => {
    assert.deepStrictEqual(parseModelName("hf:user/repo:Q4_K_M"), {
      _tag: "Hub",
      user: "user",
      repo: "repo",
      tag: "Q4_K_M",
      revision: "main"
    })
    assert.deepStrictEqual(parseModelName("hf:user/repo"), {
      _tag: "Hub",
      user: "user",
      repo: "repo",
      revision: "main"
    })
    assert.deepStrictEqual(parseModelName("hf:user/repo/sub/model-Q8_0.gguf#v2"), {
      _tag: "Hub",
      user: "user",
      repo: "repo",
      file: "sub/model-Q8_0.gguf",
      revision: "v2"
    })
    assert.deepStrictEqual(parseModelName("https://example.com/m/a.gguf"), {
      _tag: "Url",
      url: "https://example.com/m/a.gguf"
    })
    assert.deepStrictEqual(parseModelName("./models/a.gguf"), { _tag: "Local", path: "./models/a.gguf" })
    for (const bad of [
      "hf:user",
      "hf:/repo",
      "hf:user/repo/../x.gguf",
      "hf:user/repo/file.bin",
      "hf:user/repo:bad tag",
      "https://example.com/readme.md",
      "https://me:secret@example.com/a.gguf"
    ]) {
      const parsed = parseModelName(bad)
      assert.isTrue("message" in parsed, bad)
      if ("message" in parsed) assert.notInclude(parsed.message, "secret")
    }
  })
})

describe("a remote model's header", () => {
  it.live("hf:user/repo:TAG reads the header with range requests only, a small share of the file", () =>
    Effect.gen(function* () {
      hub.reset()
      const model = yield* openRemoteModel("hf:test/tiny-GGUF:Q8_0", {
        access: access(),
        cacheDir: freshDir("h"),
        remember: false
      })
      sameHeader(model.file, yield* readGgufFile(single))
      const cdn = hub.requests().filter((r) => r.host === "cdn")
      assert.isAbove(cdn.length, 0)
      for (const r of cdn) {
        assert.strictEqual(r.status, 206)
        assert.isDefined(r.range)
      }
      assert.isAtMost(hub.bytesServed(), fileSize(single) / 100, "the header is read, not the file")
      const manifests = hub.requests().filter((r) => r.path.includes("/manifests/"))
      assert.strictEqual(manifests.length, 1)
      assert.match(model.parts[0]!.sha256 ?? "", /^[0-9a-f]{64}$/)
    })
  )

  it.live("a warm start asks the hub for the manifest and nothing else", () =>
    Effect.gen(function* () {
      const cacheDir = freshDir("w")
      yield* openRemoteModel("hf:test/tiny-GGUF:Q8_0", { access: access(), cacheDir, remember: false })
      hub.reset()
      const again = yield* openRemoteModel("hf:test/tiny-GGUF:Q8_0", { access: access(), cacheDir, remember: false })
      sameHeader(again.file, yield* readGgufFile(single))
      assert.deepStrictEqual(
        hub.requests().map((r) => `${r.host} ${r.path}`),
        ["hub /v2/test/tiny-GGUF/manifests/Q8_0"]
      )
    })
  )

  it.live("a split set named by tag, or by its first part's path, is every part's header merged", () =>
    Effect.gen(function* () {
      const local = yield* readGgufFile(parts[0]!)
      assert.strictEqual(local.parts?.length, 3)
      for (const named of ["hf:test/set-GGUF:q8_0", `hf:test/set-GGUF/q8/${parts[0]!.split("/").at(-1)!}`]) {
        const model = yield* openRemoteModel(named, { access: access(), cacheDir: freshDir("s"), remember: false })
        sameHeader(model.file, local)
        assert.strictEqual(model.parts.length, 3)
      }
      // a later part named: refused, naming the first
      const later = yield* Effect.either(
        openRemoteModel(`hf:test/set-GGUF/q8/${parts[1]!.split("/").at(-1)!}`, {
          access: access(),
          cacheDir: freshDir("l"),
          remember: false
        })
      )
      assert.isTrue(Either.isLeft(later))
      if (Either.isLeft(later)) assert.match(later.left.message, /part 2 of a 3-part split set/)
    })
  )

  it.live("a missing repository, a missing tag and a gated repository without the token are one-line errors", () =>
    Effect.gen(function* () {
      const open = (named: string, token?: string) =>
        Effect.either(openRemoteModel(named, { access: access(0, token), cacheDir: freshDir("e"), remember: false }))
      const cases: ReadonlyArray<readonly [string, RegExp, string?]> = [
        ["hf:test/none-GGUF:Q8_0", /no such repository, or no GGUF file for the tag "Q8_0"/],
        ["hf:test/tiny-GGUF:Q2_K", /no such repository, or no GGUF file for the tag "Q2_K"/],
        ["hf:test/tiny-GGUF/other.gguf", /not found \(HTTP 404\)/],
        ["hf:test/gated-GGUF:Q8_0", /refused access \(HTTP 401\).*HF_TOKEN/],
        ["hf:test/gated-GGUF:Q8_0", /refused access \(HTTP 401\).*HF_TOKEN/, "hf_wrong_token_000000"]
      ]
      for (const [named, expected, token] of cases) {
        const result = yield* open(named, token)
        assert.isTrue(Either.isLeft(result), named)
        if (Either.isLeft(result)) {
          assert.match(result.left.message, expected)
          assert.notInclude(result.left.message, "\n")
          assert.notInclude(result.left.message, TOKEN)
        }
      }
      hub.reset()
      const gated = yield* open("hf:test/gated-GGUF:Q8_0", TOKEN)
      assert.isTrue(Either.isRight(gated))
      // the token went to the hub, never to the CDN it redirects to
      assert.isTrue(hub.requests().some((r) => r.host === "hub" && r.authorized))
      assert.isFalse(hub.requests().some((r) => r.host === "cdn" && r.authorized))
    })
  )
})

const stageRanges = (numLayers: number): ReadonlyArray<SliceRange> =>
  [
    [0, 2],
    [2, 4],
    [0, 1],
    [1, 3],
    [3, 4],
    [0, 4]
  ].map(([layerStart, layerEndExclusive]) => ({
    layerStart: layerStart!,
    layerEndExclusive: layerEndExclusive!,
    numLayers
  }))

/** The slice the orchestrator would cut from the local file. */
const localSlice = (file: GgufFile, range: SliceRange, name: string) =>
  Effect.gen(function* () {
    const path = join(dir, `${name}.local.gguf`)
    yield* writeGgufSlice(file, range, path)
    return readFileSync(path)
  })

describe("a stage's slice fetched from the hub", () => {
  it.live("is byte-identical to the slice cut from the local file, at ≤ 1.05× its tensor bytes", () =>
    Effect.gen(function* () {
      for (const [named, localPath] of [
        ["hf:test/tiny-GGUF:Q8_0", single],
        ["hf:test/set-GGUF:Q8_0", parts[0]!]
      ] as const) {
        const model = yield* openRemoteModel(named, { access: access(), cacheDir: freshDir("m"), remember: false })
        const local = yield* readGgufFile(localPath)
        for (const range of stageRanges(4)) {
          const cache = freshDir("slices")
          hub.reset()
          const fetched = yield* fetchRemoteSlice(model, range, cache, { access: access() })
          const tensorBytes = sliceTensors(local, range).reduce((n, t) => n + t.byteSize, 0)
          assert.deepStrictEqual(
            readFileSync(fetched.path),
            yield* localSlice(local, range, "cut"),
            `${named} [${range.layerStart}, ${range.layerEndExclusive})`
          )
          assert.strictEqual(fetched.fetchedBytes, sliceFetchBytes(model.file, range))
          assert.isAtMost(hub.bytesServed(), tensorBytes * 1.05)
          assert.isAtLeast(hub.bytesServed(), tensorBytes)
          // only the slice and its tensor hash are left
          assert.deepStrictEqual(readdirSync(cache).sort(), [
            fetched.path.split("/").at(-1)!,
            `${fetched.path.split("/").at(-1)!}.tensors`
          ])
          // again: held, nothing fetched
          hub.reset()
          const again = yield* fetchRemoteSlice(model, range, cache, { access: access() })
          assert.strictEqual(again.fetchedBytes, 0)
          assert.strictEqual(hub.requests().length, 0)
        }
      }
    })
  )

  it.live("a connection dropped mid-range resumes; a fetch cut off resumes where its file ends", () =>
    Effect.gen(function* () {
      const model = yield* openRemoteModel("hf:test/tiny-GGUF:Q8_0", {
        access: access(),
        cacheDir: freshDir("d"),
        remember: false
      })
      const local = yield* readGgufFile(single)
      const range = stageRanges(4)[0]!
      const total = sliceFetchBytes(model.file, range)
      // dropped twice mid-body: the fetch resumes in the same call
      const cache = freshDir("drop")
      hub.reset()
      hub.dropAfter(300_000, 2)
      const fetched = yield* fetchRemoteSlice(model, range, cache, { access: access() })
      assert.deepStrictEqual(readFileSync(fetched.path), yield* localSlice(local, range, "drop"))
      const ranged = hub.requests().filter((r) => r.host === "cdn")
      assert.isAtLeast(ranged.length, 3, "two drops, each followed by a resumed range")
      assert.isAtMost(hub.bytesServed(), total * 1.05)

      // one attempt only: the fetch fails and keeps its bytes; the next one asks only for the rest
      const cut = freshDir("cut")
      hub.reset()
      hub.dropAfter(500_000)
      const failed = yield* Effect.either(fetchRemoteSlice(model, range, cut, { access: { ...access(), attempts: 1 } }))
      assert.isTrue(Either.isLeft(failed))
      if (Either.isLeft(failed)) assert.match(failed.left.message, /dropped|ended/)
      const kept = readdirSync(cut).filter((n) => n.endsWith(".fetch"))
      assert.strictEqual(kept.length, 1)
      const keptBytes = fileSize(join(cut, kept[0]!))
      const first = hub.bytesServed()
      assert.isAbove(first, 0)
      hub.reset()
      const resumed = yield* fetchRemoteSlice(model, range, cut, { access: access() })
      assert.deepStrictEqual(readFileSync(resumed.path), yield* localSlice(local, range, "cut2"))
      assert.isAtMost(hub.bytesServed(), total - first + 4096 + 1)
      assert.strictEqual(resumed.fetchedBytes, total - keptBytes)
    })
  )

  it.live("a file changed on the hub after its header was read is refused, and nothing of it is kept", () =>
    Effect.gen(function* () {
      const model = yield* openRemoteModel("hf:test/tiny-GGUF:Q8_0", {
        access: access(),
        cacheDir: freshDir("c"),
        remember: false
      })
      hub.replace("test/tiny-GGUF", "tiny.Q8_0.gguf", changed)
      try {
        const cache = freshDir("changed")
        const result = yield* Effect.either(fetchRemoteSlice(model, stageRanges(4)[1]!, cache, { access: access() }))
        assert.isTrue(Either.isLeft(result))
        if (Either.isLeft(result)) assert.match(result.left.message, /changed on the server since its header was read/)
        assert.deepStrictEqual(readdirSync(cache), [])
        // the model opened again is the new version, and its slice is the new file's
        const fresh = yield* openRemoteModel("hf:test/tiny-GGUF:Q8_0", {
          access: access(),
          cacheDir: freshDir("c2"),
          remember: false
        })
        assert.notStrictEqual(fresh.id, model.id)
        const fetched = yield* fetchRemoteSlice(fresh, stageRanges(4)[1]!, cache, { access: access() })
        assert.deepStrictEqual(
          readFileSync(fetched.path),
          yield* localSlice(yield* readGgufFile(changed), stageRanges(4)[1]!, "changed")
        )
      } finally {
        hub.replace("test/tiny-GGUF", "tiny.Q8_0.gguf", single)
      }
    })
  )

  it.live("404, 401 and 416 from the CDN end the fetch with one line; a slow link still completes", () =>
    Effect.gen(function* () {
      const model = yield* openRemoteModel("hf:test/tiny-GGUF:Q8_0", {
        access: access(),
        cacheDir: freshDir("f"),
        remember: false
      })
      const range = stageRanges(4)[4]!
      for (const [status, expected] of [
        [404, /not found \(HTTP 404\)/],
        [401, /refused access \(HTTP 401\)/],
        [416, /past the file's end \(416\)/]
      ] as const) {
        const cache = freshDir(`s${status}`)
        hub.failNext(status, /\/blobs\//)
        const result = yield* Effect.either(fetchRemoteSlice(model, range, cache, { access: access() }))
        assert.isTrue(Either.isLeft(result), String(status))
        if (Either.isLeft(result)) {
          assert.match(result.left.message, expected)
          assert.notInclude(result.left.message, "\n")
        }
        assert.isFalse(
          readdirSync(cache).some((n) => n.endsWith(".gguf")),
          "no slice from a refused fetch"
        )
      }
      const cache = freshDir("slow")
      hub.throttle(4 * 2 ** 20)
      try {
        const started = Date.now()
        const fetched = yield* fetchRemoteSlice(model, range, cache, { access: access() })
        const seconds = (Date.now() - started) / 1000
        assert.isAtLeast(seconds, (fetched.fetchedBytes / (4 * 2 ** 20)) * 0.5, "the link was slow")
        assert.deepStrictEqual(
          readFileSync(fetched.path),
          yield* localSlice(yield* readGgufFile(single), range, "slow")
        )
      } finally {
        hub.throttle(undefined)
      }
    })
  )

  it.live("a slice whose bytes changed in the cache is not reused: it is fetched again", () =>
    Effect.gen(function* () {
      const model = yield* openRemoteModel("hf:test/tiny-GGUF:Q8_0", {
        access: access(),
        cacheDir: freshDir("r"),
        remember: false
      })
      const range = stageRanges(4)[1]!
      const cache = freshDir("reuse")
      const fetched = yield* fetchRemoteSlice(model, range, cache, { access: access() })
      const bytes = readFileSync(fetched.path)
      bytes[bytes.length - 10] = bytes[bytes.length - 10]! ^ 0xff
      writeFileSync(fetched.path, bytes)
      hub.reset()
      const again = yield* fetchRemoteSlice(model, range, cache, { access: access() })
      assert.isAbove(again.fetchedBytes, 0)
      assert.isAbove(hub.bytesServed(), 0)
      assert.isTrue(existsSync(again.path))
      assert.deepStrictEqual(readFileSync(again.path), yield* localSlice(yield* readGgufFile(single), range, "reuse"))
    })
  )
})
