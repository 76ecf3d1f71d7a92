/**
 * API keys on `swactor serve` (issue 22's key item): through a real server and the official openai client, a key from
 * --api-key-file or SWACTOR_API_KEY is required on every route but /health, presented as `Authorization: Bearer` or
 * `x-api-key`; a missing or wrong key is 401 in OpenAI's shape, and the keys never show in the server's output.
 */
import { afterAll, beforeAll } from "vitest"
import { assert, describe, it } from "@effect/vitest"
import OpenAI from "openai"
import { mkdtempSync, rmSync, writeFileSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { randomBytes } from "node:crypto"
import { requireModel } from "../support/models.js"
import { type ServeProcess, startServe, stopServe } from "../support/serve.js"
import { untilAsync } from "../support/until.js"

const model = requireModel("stories260K.gguf")
const first = randomBytes(24).toString("hex")
const second = `sk-${randomBytes(24).toString("base64url")}`

describe("swactor serve --api-key-file (two keys)", () => {
  let server: ServeProcess
  let dir: string
  beforeAll(async () => {
    dir = mkdtempSync(join(tmpdir(), "swactor-keys-"))
    writeFileSync(join(dir, "keys"), `# serving keys\n${first}\n\n  ${second}  \n`)
    server = await startServe([
      "--model",
      model,
      "--stages",
      "2",
      "--threads",
      "1",
      "--api-key-file",
      join(dir, "keys")
    ])
  }, 180_000)
  afterAll(async () => {
    await stopServe(server)
    rmSync(dir, { recursive: true, force: true })
  })

  it("each key works (Bearer through the openai client, x-api-key by hand); the same greedy text", async () => {
    const texts: Array<string> = []
    for (const key of [first, second]) {
      const client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: key, maxRetries: 0 })
      const answer = await client.completions.create({
        model: "m",
        prompt: "Once upon a time",
        max_tokens: 12,
        temperature: 0
      })
      texts.push(answer.choices[0]!.text)
    }
    const byHeader = await fetch(`${server.url}/v1/completions`, {
      method: "POST",
      headers: { "content-type": "application/json", "x-api-key": second },
      body: JSON.stringify({ prompt: "Once upon a time", max_tokens: 12, temperature: 0 })
    })
    assert.strictEqual(byHeader.status, 200)
    texts.push(((await byHeader.json()) as { choices: Array<{ text: string }> }).choices[0]!.text)
    assert.strictEqual(new Set(texts).size, 1)
    assert.isAbove(texts[0]!.length, 0)
  })

  it("no key or a wrong one is 401 in OpenAI's shape on every route but /health", async () => {
    const wrong = new OpenAI({
      baseURL: `${server.url}/v1`,
      apiKey: `${first.slice(0, -1)}${first.endsWith("0") ? "1" : "0"}`,
      maxRetries: 0
    })
    const refused = await wrong.chat.completions
      .create({ model: "m", messages: [{ role: "user", content: "hi" }] })
      .then(
        () => undefined,
        (e: unknown) => e
      )
    assert.instanceOf(refused, OpenAI.AuthenticationError)
    assert.strictEqual((refused as InstanceType<typeof OpenAI.AuthenticationError>).status, 401)
    assert.strictEqual((refused as InstanceType<typeof OpenAI.AuthenticationError>).code, "invalid_api_key")
    for (const path of ["/v1/models", "/metrics"]) {
      const none = await fetch(`${server.url}${path}`)
      assert.strictEqual(none.status, 401, path)
      const body = (await none.json()) as { error: { code: string; type: string; param: null; message: string } }
      assert.strictEqual(body.error.code, "missing_api_key")
      assert.match(body.error.message, /Authorization: Bearer/)
    }
    // A key is a whole header value: a prefix of a key, another scheme, or the key with a suffix is refused.
    for (const authorization of [`Bearer ${first.slice(0, 20)}`, `Basic ${first}`, `Bearer ${first}x`]) {
      const answer = await fetch(`${server.url}/v1/models`, { headers: { authorization } })
      assert.strictEqual(answer.status, 401, authorization)
    }
    const health = await fetch(`${server.url}/health`)
    assert.strictEqual(health.status, 200)
    const models = await fetch(`${server.url}/v1/models`, { headers: { authorization: `Bearer ${first}` } })
    assert.strictEqual(models.status, 200)
    assert.notInclude(server.stderr(), first)
    assert.notInclude(server.stderr(), second)
    assert.match(server.stderr(), /2 API keys from --api-key-file/)
  })

  it("/health tells a caller without a key only the status: no agent address after an agent is lost", async () => {
    const metrics = await fetch(`${server.url}/metrics`, { headers: { authorization: `Bearer ${first}` } }).then((r) =>
      r.text()
    )
    const agents = [...metrics.matchAll(/^swactor_agent_active_stages\{address="([^"]+)",pid="(\d+)"\}/gm)].map(
      (m) => ({
        address: m[1]!,
        pid: Number(m[2])
      })
    )
    assert.strictEqual(agents.length, 2)
    process.kill(agents[1]!.pid, "SIGKILL")
    const withKey = await untilAsync(
      "the killed agent to be reported lost",
      () =>
        fetch(`${server.url}/health`, { headers: { "x-api-key": first } }).then(
          (r) => r.json() as Promise<{ status: string; lostAgents?: ReadonlyArray<string> }>
        ),
      (health) => health.lostAgents !== undefined
    )
    assert.deepStrictEqual(withKey, { status: "ok", lostAgents: [agents[1]!.address] })
    const open = await fetch(`${server.url}/health`)
    assert.strictEqual(open.status, 200)
    const body = await open.text()
    assert.deepStrictEqual(JSON.parse(body), { status: "ok" })
    assert.notInclude(body, agents[1]!.address)
  })
})

describe("swactor serve with SWACTOR_API_KEY", () => {
  let server: ServeProcess | undefined
  afterAll(() => stopServe(server))

  it("the environment's key is required; an empty key file is refused in one line", async () => {
    server = await startServe(["--model", model, "--stages", "1", "--threads", "1"], { SWACTOR_API_KEY: first })
    const open = await fetch(`${server.url}/v1/models`)
    assert.strictEqual(open.status, 401)
    const client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: first, maxRetries: 0 })
    const answer = await client.completions.create({
      model: "m",
      prompt: "Once upon a time",
      max_tokens: 4,
      temperature: 0
    })
    assert.strictEqual(answer.choices.length, 1)
    assert.match(server.stderr(), /1 API key from SWACTOR_API_KEY/)
    await stopServe(server)

    const dir = mkdtempSync(join(tmpdir(), "swactor-keys-"))
    writeFileSync(join(dir, "keys"), "# nothing here\n\n")
    const failed = await startServe(["--model", model, "--api-key-file", join(dir, "keys")]).then(
      () => undefined,
      (e: unknown) => String(e)
    )
    rmSync(dir, { recursive: true, force: true })
    assert.match(failed ?? "", /--api-key-file .*: the file holds no key/)
  })
})
