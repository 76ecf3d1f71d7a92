import { afterAll, beforeAll } from "vitest"
import { assert, describe, it } from "@effect/vitest"
import { Effect } from "effect"
import OpenAI from "openai"
import { existsSync, mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { writeSyntheticModel } from "../../src/layers/gguf/Synthetic.js"
import * as TokenizerLive from "../../src/layers/gguf/TokenizerLive.js"
import type { LocalAgent } from "../../src/layers/agent/AgentProcesses.js"
import { Tokenizer } from "../../src/services/Tokenizer.js"
import { isAlive } from "../support/e2e.js"
import { repoRoot, requireModel } from "../support/models.js"
import { spawn } from "node:child_process"
import { swactorCommand } from "../../src/layers/agent/AgentProcesses.js"
import {
  agentsOf,
  metricOf,
  readSse,
  type ServeProcess,
  shmFilesOf,
  socketDirOf,
  startServe,
  startServeOverNodes,
  waitForIdle
} from "../support/serve.js"
import { untilAsync } from "../support/until.js"

const model = requireModel("stories260K.gguf")
/** The greedy 24-token completion of "Once upon a time" from the local server (the remote one must match it). */
let localGreedy: string | undefined
const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms))

const promptTokenCount = (text: string) =>
  Effect.runPromise(
    Tokenizer.pipe(
      Effect.flatMap((t) => t.open(model)),
      Effect.map((v) => v.tokenize(text).length),
      Effect.scoped,
      Effect.provide(TokenizerLive.layer)
    )
  )

describe("swactor serve over HTTP (openai client, stories260K, 2 local stages)", () => {
  let server: ServeProcess
  let client: OpenAI
  beforeAll(async () => {
    server = await startServe(["--model", model, "--stages", "2", "--threads", "1", "--parallel", "8"])
    client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: "none", maxRetries: 0, timeout: 60_000 })
  }, 180_000)
  afterAll(async () => {
    if (server?.child.exitCode === null) server.child.kill("SIGTERM")
    await server?.exited
  })

  const greedy = async (prompt: string, maxTokens: number, extra: Record<string, unknown> = {}) =>
    client.completions.create({ model: "stories260K.gguf", prompt, max_tokens: maxTokens, temperature: 0, ...extra })

  // /health answers 503 while the pipeline loads and 200 once it is ready; /v1/models names the model.
  it("health: 503 while loading, then 200; models lists the model", async () => {
    assert.deepStrictEqual(server.healthSeen, [503, 200])
    const models = await client.models.list()
    assert.deepStrictEqual(
      models.data.map((m) => m.id),
      ["stories260K.gguf"]
    )
  })

  // A non-streamed completion carries usage: prompt tokens as tokenized (BOS included), completion tokens generated.
  it("completions: text, finish reason and usage", async () => {
    const prompt = "Once upon a time"
    const result = await greedy(prompt, 24)
    localGreedy = result.choices[0]!.text
    assert.strictEqual(result.object, "text_completion")
    assert.strictEqual(result.choices[0]!.finish_reason, "length")
    assert.isAbove(result.choices[0]!.text.length, 20)
    assert.deepStrictEqual(result.usage, {
      prompt_tokens: await promptTokenCount(prompt),
      completion_tokens: 24,
      total_tokens: (await promptTokenCount(prompt)) + 24,
      // the first request of this prompt: nothing of it held by the prompt cache
      prompt_tokens_details: { cached_tokens: 0 }
    })
  })

  // Streamed text is the non-streamed text; with include_usage the last chunk has no choices and the usage.
  it("completions streamed: same text, usage chunk, then [DONE]", async () => {
    const whole = (await greedy("Lily went", 20)).choices[0]!.text
    const stream = await client.completions.create({
      model: "m",
      prompt: "Lily went",
      max_tokens: 20,
      temperature: 0,
      stream: true,
      stream_options: { include_usage: true }
    })
    let text = ""
    const chunks = []
    for await (const chunk of stream) {
      chunks.push(chunk)
      text += chunk.choices[0]?.text ?? ""
    }
    assert.strictEqual(text, whole)
    const last = chunks.at(-1)!
    assert.deepStrictEqual(last.choices, [])
    assert.strictEqual(last.usage?.completion_tokens, 20)
    assert.strictEqual(chunks.at(-2)!.choices[0]!.finish_reason, "length")
    const raw = await readSse(
      await fetch(`${server.url}/v1/completions`, {
        method: "POST",
        headers: { "content-type": "application/json" },
        body: JSON.stringify({ prompt: "Lily went", max_tokens: 3, temperature: 0, stream: true })
      })
    )
    assert.strictEqual(raw.at(-1)!.data, "[DONE]")
  })

  // Chat goes through the model's chat template (node-llama-cpp's wrapper); streamed deltas add up to the message.
  it("chat completions: streamed and not, role first, usage", async () => {
    const messages = [
      { role: "system" as const, content: "You tell stories." },
      { role: "user" as const, content: "Tell me about a cat." }
    ]
    const result = await client.chat.completions.create({ model: "m", messages, max_tokens: 16, temperature: 0 })
    assert.strictEqual(result.object, "chat.completion")
    assert.strictEqual(result.choices[0]!.message.role, "assistant")
    const content = result.choices[0]!.message.content ?? ""
    assert.isAbove(content.length, 0)
    assert.strictEqual(result.usage?.completion_tokens, 16)
    // The template wraps the messages: more prompt tokens than the texts alone.
    assert.isAbove(result.usage!.prompt_tokens, await promptTokenCount("You tell stories. Tell me about a cat."))
    const stream = await client.chat.completions.create({
      model: "m",
      messages,
      max_tokens: 16,
      temperature: 0,
      stream: true,
      stream_options: { include_usage: true }
    })
    let text = ""
    const chunks = []
    for await (const chunk of stream) {
      chunks.push(chunk)
      text += chunk.choices[0]?.delta.content ?? ""
    }
    assert.strictEqual(chunks[0]!.choices[0]!.delta.role, "assistant")
    assert.strictEqual(chunks[0]!.object, "chat.completion.chunk")
    assert.strictEqual(text, content)
    // the same chat a second time: the prompt cache held its whole 128-token prompt chunks before its last token
    const held = result.usage!.prompt_tokens - 1
    assert.deepStrictEqual(chunks.at(-1)!.usage, {
      ...result.usage!,
      prompt_tokens_details: { cached_tokens: held - (held % 128) }
    })
  })

  // A stop string that spans two streamed pieces ends the text just before it, streamed or not.
  it("stop strings end the text, also across token boundaries", async () => {
    const stream = await greedy("Once upon a time", 40, { stream: true })
    const pieces: Array<string> = []
    for await (const chunk of stream as unknown as AsyncIterable<OpenAI.Completion>)
      pieces.push(chunk.choices[0]?.text ?? "")
    const whole = pieces.join("")
    // The end of one piece and the start of the next, somewhere in the middle.
    const k = pieces.findIndex((p, i) => i > 3 && p.length >= 2 && (pieces[i + 1]?.length ?? 0) >= 2)
    assert.isAtLeast(k, 0)
    const stop = pieces[k]!.slice(-2) + pieces[k + 1]!.slice(0, 2)
    const expected = whole.slice(0, whole.indexOf(stop))
    const stopped = await greedy("Once upon a time", 40, { stop: [stop, "zzzz-never"] })
    assert.strictEqual(stopped.choices[0]!.text, expected)
    assert.strictEqual(stopped.choices[0]!.finish_reason, "stop")
    const streamed = await greedy("Once upon a time", 40, { stop, stream: true })
    let text = ""
    let finish: string | null = null
    for await (const chunk of streamed as unknown as AsyncIterable<OpenAI.Completion>) {
      text += chunk.choices[0]?.text ?? ""
      finish = chunk.choices[0]?.finish_reason ?? finish
    }
    assert.strictEqual(text, expected)
    assert.strictEqual(finish, "stop")
  })

  // Same seed, same sampled text (streamed or not); another seed, another text. top_k/top_p/min_p are accepted.
  it("seeded sampling is reproducible", async () => {
    const sample = (seed: number, extra: Record<string, unknown> = {}) =>
      client.completions
        .create({
          model: "m",
          prompt: "The dog",
          max_tokens: 30,
          temperature: 1,
          seed,
          top_p: 0.95,
          ...{ top_k: 50, min_p: 0.01 },
          ...extra
        } as OpenAI.CompletionCreateParamsNonStreaming)
        .then((r) => r.choices[0]!.text)
    const a = await sample(42)
    assert.strictEqual(await sample(42), a)
    assert.notStrictEqual(await sample(43), a)
  })

  // Bad values and a context the model cannot hold are 400s in OpenAI's error shape.
  it("bad requests are 400 with OpenAI's error body", async () => {
    const tooLong = await greedy("Once", 100_000).then(
      () => undefined,
      (e: unknown) => e
    )
    assert.instanceOf(tooLong, OpenAI.BadRequestError)
    assert.match((tooLong as InstanceType<typeof OpenAI.BadRequestError>).message, /context too long/)
    const badTopP = await greedy("Once", 4, { top_p: 2 }).then(
      () => undefined,
      (e: unknown) => e
    )
    assert.instanceOf(badTopP, OpenAI.BadRequestError)
    assert.match((badTopP as InstanceType<typeof OpenAI.BadRequestError>).message, /top_p/)
    const response = await fetch(`${server.url}/v1/completions`, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ prompt: 3 })
    })
    assert.strictEqual(response.status, 400)
    const body = (await response.json()) as { error: { type: string; message: string } }
    assert.strictEqual(body.error.type, "invalid_request_error")
    assert.match(body.error.message, /prompt/)
  })

  // Batched = unbatched: each of 8 requests in flight at once gets the greedy text it gets alone.
  it("8 concurrent greedy requests each equal the same request served alone", async () => {
    const prompts = [
      "Once upon a time",
      "Lily saw",
      "The sun",
      "Tom had a",
      "A big dog",
      "One day",
      "Sara and Ben",
      "The bird"
    ]
    const alone: Array<string> = []
    for (const prompt of prompts) alone.push((await greedy(prompt, 24)).choices[0]!.text)
    const together = await Promise.all(prompts.map((prompt) => greedy(prompt, 24).then((r) => r.choices[0]!.text)))
    assert.deepStrictEqual(together, alone)
    // They ran batched: the agents' stage batchers put several sequences into one micro-batch on each stage.
    for (const stage of [0, 1]) {
      assert.isAbove(
        await metricOf(server.url, `swactor_stage_max_batch_sequences{stage="${stage}"}`),
        1,
        `stage ${stage}`
      )
      assert.isAbove(
        await metricOf(server.url, `swactor_stage_batch_rows_total{stage="${stage}"}`),
        await metricOf(server.url, `swactor_stage_micro_batches_total{stage="${stage}"}`),
        `stage ${stage}: rows per micro-batch above 1`
      )
      // each stage's memory, as its agent measured it: a resident set (a Node process holding its weights), its peak
      // at least that, and the compute buffers its graphs allocated
      const resident = await metricOf(server.url, `swactor_stage_resident_bytes{stage="${stage}"}`)
      assert.isAbove(resident, 20 * 2 ** 20, `stage ${stage} resident`)
      assert.isAtLeast(await metricOf(server.url, `swactor_stage_peak_resident_bytes{stage="${stage}"}`), resident)
      assert.isAbove(await metricOf(server.url, `swactor_stage_compute_buffer_bytes{stage="${stage}"}`), 0)
    }
  })

  // A client that goes away cancels its run at once: every stage stops hosting it, its KV reservation is returned.
  it("a disconnect cancels the run and frees every stage", async () => {
    const cancelledBefore = await metricOf(server.url, 'swactor_requests_total{outcome="cancelled"}')
    const abort = new AbortController()
    const response = await fetch(`${server.url}/v1/completions`, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ prompt: "Once upon a time", max_tokens: 1800, temperature: 0, stream: true }),
      signal: abort.signal
    })
    const reader = response.body!.getReader()
    await reader.read()
    await reader.read()
    const during = await agentsOf(server.url)
    assert.deepStrictEqual(
      during.map((a) => a.activeStages),
      [1, 1]
    )
    assert.strictEqual(await metricOf(server.url, "swactor_requests_in_flight"), 1)
    abort.abort()
    const started = Date.now()
    await waitForIdle(server.url)
    assert.deepStrictEqual(
      (await agentsOf(server.url)).map((a) => a.activeStages),
      [0, 0]
    )
    assert.isBelow(Date.now() - started, 2000)
    assert.strictEqual(await metricOf(server.url, "swactor_requests_in_flight"), 0)
    assert.strictEqual(await metricOf(server.url, "swactor_kv_reserved_bytes"), 0)
    assert.strictEqual(await metricOf(server.url, 'swactor_requests_total{outcome="cancelled"}'), cancelledBefore + 1)
  })

  // SIGTERM with a stream open: the stream ends, every stage and agent is torn down, exit 143 (128 + SIGTERM) within
  // 2 s as for `swactor run`, and no socket folder or shared-memory ring file is left.
  it("SIGTERM with a stream open tears everything down and exits 143", async () => {
    const agents = await agentsOf(server.url)
    const socketDirs = agents.map((a) => socketDirOf(a.pid))
    const response = await fetch(`${server.url}/v1/completions`, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ prompt: "Once upon a time", max_tokens: 1800, temperature: 0, stream: true })
    })
    const seen: Array<string> = []
    const ended = readSse(response, (data) => seen.push(data)).catch(() => "cut")
    while (seen.length < 2) await sleep(10)
    const stoppedAt = Date.now()
    server.child.kill("SIGTERM")
    const exit = await server.exited
    await ended
    assert.strictEqual(exit.code, 143, server.stderr())
    assert.isBelow(Date.now() - stoppedAt, 2000)
    for (const agent of agents) assert.isFalse(isAlive(agent.pid))
    assert.match(server.stderr(), /stopped by SIGTERM/)
    assert.isAbove(socketDirs.filter((d) => d !== undefined).length, 0, "agents listen in a private socket folder")
    for (const dir of socketDirs) if (dir !== undefined) assert.isFalse(existsSync(dir), dir)
    assert.deepStrictEqual(shmFilesOf([server.child.pid!, ...agents.map((a) => a.pid)]), [])
  })
})

describe("swactor serve --agents (remote agents)", () => {
  let server: ServeProcess
  let agents: ReadonlyArray<LocalAgent>
  let close: (() => Promise<void>) | undefined
  beforeAll(async () => {
    ;({ server, nodes: agents, close } = await startServeOverNodes(["--model", model]))
  }, 180_000)
  afterAll(() => close?.())

  // The same server over agents started elsewhere: one stage per node, the same greedy text as local agents.
  it("serves through remote agents, one stage per node", async () => {
    const client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: "none", maxRetries: 0 })
    const result = await client.completions.create({
      model: "m",
      prompt: "Once upon a time",
      max_tokens: 24,
      temperature: 0
    })
    if (localGreedy !== undefined) assert.strictEqual(result.choices[0]!.text, localGreedy)
    assert.strictEqual(result.usage?.completion_tokens, 24)
    const listed = await agentsOf(server.url)
    assert.deepStrictEqual(
      listed.map((a) => a.address),
      agents.map((a) => a.address)
    )
    assert.deepStrictEqual(
      listed.map((a) => a.pid),
      agents.map((a) => a.pid)
    )
    assert.deepStrictEqual(
      listed.map((a) => a.activeStages),
      [0, 0]
    )
  })
})

describe("swactor serve start-up failures", () => {
  // A file that is no model: refused from its header before any agent starts, one line naming it, exit 1.
  it("a file that is no GGUF model ends the command with exit code 1 and the reason", async () => {
    const notAModel = join(repoRoot, "package.json")
    const { args, command } = swactorCommand(["serve", "--model", notAModel, "--port", "0"])
    const child = spawn(command, args, { cwd: repoRoot, stdio: ["ignore", "ignore", "pipe"] })
    let stderr = ""
    child.stderr!.setEncoding("utf8")
    child.stderr!.on("data", (chunk: string) => (stderr += chunk))
    const code = await new Promise<number | null>((resolve) => child.on("exit", (c) => resolve(c)))
    assert.strictEqual(code, 1)
    assert.match(stderr, /^swactor serve: .*package\.json: bad magic .*expected "GGUF"/m)
  })
})

describe("swactor serve on a synthetic model (random weights, 4 x 256, Q8_0)", () => {
  let server: ServeProcess
  let dir: string
  beforeAll(async () => {
    dir = mkdtempSync(join(tmpdir(), "swactor-serve-test-"))
    const path = join(dir, "synthetic.gguf")
    await Effect.runPromise(
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
        type: "q8_0",
        seed: 7
      })
    )
    server = await startServe(["--model", path, "--stages", "2", "--threads", "1", "--parallel", "8"])
  }, 180_000)
  afterAll(async () => {
    server?.child.kill("SIGTERM")
    await server?.exited
    rmSync(dir, { recursive: true, force: true })
  })

  // Batched = unbatched on another shape (grouped-query attention, quantized weights).
  it("8 concurrent greedy requests each equal the same request served alone", async () => {
    const client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: "none", maxRetries: 0 })
    const greedy = (prompt: string) =>
      client.completions.create({ model: "m", prompt, max_tokens: 24, temperature: 0 }).then((r) => r.choices[0]!.text)
    const prompts = ["a", "bb", "ccc", "dd d", "e", "ff", "g g", "hh"]
    const alone: Array<string> = []
    for (const prompt of prompts) alone.push(await greedy(prompt))
    assert.deepStrictEqual(await Promise.all(prompts.map(greedy)), alone)
    assert.isAbove(new Set(alone).size, 1)
  })
})

describe("swactor serve: admission and faults (parallel 1, queue 1)", () => {
  let server: ServeProcess
  beforeAll(async () => {
    server = await startServe([
      "--model",
      model,
      "--stages",
      "2",
      "--threads",
      "1",
      "--parallel",
      "1",
      "--queue",
      "1",
      "--keep-alive-ms",
      "200"
    ])
  }, 180_000)
  afterAll(async () => {
    // A failed test leaves it running: SIGTERM, so it still removes its agents and socket directory.
    if (server?.child.exitCode === null) server.child.kill("SIGTERM")
    await server?.exited
  })

  const streamRequest = (maxTokens: number) =>
    fetch(`${server.url}/v1/completions`, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ prompt: "Once upon a time", max_tokens: maxTokens, temperature: 0, stream: true })
    })

  // One runs, one waits in the queue; the next is refused with 429 and Retry-After (the openai client sees RateLimitError).
  // Then kill -9 of a stage agent mid-stream: both streams are recovered on the other agent; killing that one too ends
  // the next stream with an error and [DONE] within 2 s, /health says 503 `reviving`, then fresh local agents serve
  // again, and SIGHUP leaves no process behind, old or new (exit 129).
  it("queue full is 429 + Retry-After; a killed agent's streams recover; with every agent killed they end with an error", async () => {
    const running = await streamRequest(1800)
    const runningEvents: Array<string> = []
    const runningDone = readSse(running, (data) => runningEvents.push(data))
    while (runningEvents.length < 2) await sleep(10)
    const queued = await streamRequest(8)
    assert.strictEqual(queued.status, 200)
    const comments: Array<string> = []
    const queuedDone = readSse(queued, undefined, (line) => comments.push(line))
    assert.strictEqual(await metricOf(server.url, "swactor_requests_queued"), 1)
    // While it waits in the queue, the open stream gets keep-alive comments.
    await untilAsync(
      "two keep-alive comments on the queued stream",
      () => comments.length,
      (n) => n >= 2
    )
    assert.strictEqual(comments[0], ": keep-alive")

    const client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: "none", maxRetries: 0 })
    const refused = await client.completions.create({ model: "m", prompt: "Hi", max_tokens: 2 }).then(
      () => undefined,
      (e: unknown) => e
    )
    assert.instanceOf(refused, OpenAI.RateLimitError)
    assert.strictEqual((refused as InstanceType<typeof OpenAI.RateLimitError>).status, 429)
    assert.isAtLeast(Number((refused as InstanceType<typeof OpenAI.RateLimitError>).headers?.get("retry-after")), 1)

    const agents = await agentsOf(server.url)
    assert.strictEqual(agents.length, 2)
    // kill -9 of a stage agent mid-stream: both requests are recovered on the surviving agent (replay, then the
    // rest of the stream): no error event, [DONE] at the end, /health stays ok, /metrics counts the recoveries.
    process.kill(agents[1]!.pid, "SIGKILL")
    const [runningAll, queuedAll] = await Promise.all([runningDone, queuedDone])
    for (const events of [runningAll, queuedAll]) {
      assert.strictEqual(events.at(-1)!.data, "[DONE]")
      assert.notInclude(events.at(-2)!.data, '"error"')
    }
    assert.isAtLeast(await metricOf(server.url, "swactor_recoveries_total"), 1)
    const degraded = await fetch(`${server.url}/health`)
    assert.strictEqual(degraded.status, 200)
    assert.deepStrictEqual(await degraded.json(), { status: "ok", lostAgents: [agents[1]!.address] })
    assert.deepStrictEqual(
      (await agentsOf(server.url)).map((a) => a.pid),
      [agents[0]!.pid]
    )

    // The last agent killed mid-stream: nothing can host the model; the stream ends with an error event and
    // [DONE] within 2 s, /health says 503 `reviving` (every agent lost), then the server serves again on fresh local
    // agents (their processes exited: nothing to wait for) without a restart (test/server/revive.test.ts: a stall).
    const last = await streamRequest(1800)
    const lastEvents: Array<string> = []
    const lastDone = readSse(last, (data) => lastEvents.push(data))
    while (lastEvents.length < 2) await sleep(10)
    const killedAt = Date.now()
    process.kill(agents[0]!.pid, "SIGKILL")
    const lastAll = await lastDone
    assert.strictEqual(lastAll.at(-1)!.data, "[DONE]")
    const error = JSON.parse(lastAll.at(-2)!.data) as { error?: { message: string } }
    assert.match(error.error?.message ?? "", /no node left to host the model/)
    assert.isBelow(lastAll.at(-1)!.at - killedAt, 2000)
    let health = await untilAsync(
      "/health to say 503",
      () => fetch(`${server.url}/health`),
      (h) => h.status === 503
    )
    assert.strictEqual(health.status, 503)
    const reviving = (await health.json()) as { status: string; error: string }
    assert.strictEqual(reviving.status, "reviving")
    assert.match(reviving.error, /every agent of the pipeline was lost/)
    health = await untilAsync(
      "/health to say 200 again",
      () => fetch(`${server.url}/health`),
      (h) => h.status === 200
    )
    assert.strictEqual(health.status, 200, server.stderr())
    const after = await client.completions.create({ model: "m", prompt: "Hi", max_tokens: 2 })
    assert.strictEqual(after.usage?.completion_tokens, 2)
    assert.strictEqual(await metricOf(server.url, "swactor_pipeline_revivals_total"), 1)
    const fresh = await agentsOf(server.url)
    assert.strictEqual(fresh.length, 2)
    for (const agent of fresh)
      assert.notInclude(
        agents.map((a) => a.pid),
        agent.pid
      )
    assert.match(server.stderr(), /reviving the pipeline: attempt 1: a run succeeded on 2 fresh local agents/)

    server.child.kill("SIGHUP")
    const exit = await server.exited
    assert.strictEqual(exit.code, 129, server.stderr())
    for (const agent of [...agents, ...fresh]) assert.isFalse(isAlive(agent.pid))
  })
})
