// The one validation of run, serve and the library (src/services/RequestChecks.ts) and the refused-connection log
// (src/layers/transport/RefusalLog.ts), as pure functions. The same rules through real processes:
// test/validation.test.ts.
import { randomBytes } from "node:crypto"
import { describe, expect, it } from "vitest"
import { AuthFailed } from "../../src/domain/frames.js"
import { makeHandshakeLog, makeRefusalLog } from "../../src/layers/transport/RefusalLog.js"
import {
  clusterTokenProblem,
  contextProblem,
  emptyPromptMessage,
  estimateTokenBits,
  fitsContext,
  generationProblem,
  apiKeyProblem,
  samplingPolicyProblem,
  sparesProblem,
  stagesProblem,
  threadsProblem,
  tokenIdsProblem
} from "../../src/services/RequestChecks.js"

describe("RequestChecks: one rule for run, serve and the library", () => {
  it("grammar: what llama.cpp's parser would choke on is refused before it (the run and library path, not only HTTP)", () => {
    const greedy = { temperatureMillis: 0, topK: 1 }
    const check = (text: string, root = "root") => samplingPolicyProblem({ ...greedy, grammar: { text, root } }, 260)
    expect(check(`root ::= "yes" | "no"`)).toBeUndefined()
    // {3,1}: llama.cpp's parser allocates without end on it (a stage killed for memory).
    expect(check(`root ::= "a"{3,1}`)).toMatch(/^grammar: .*3.*1/)
    expect(check(`root ::= missing`)).toMatch(/^grammar: .*missing/)
    expect(check(`root ::= root "a"`)).toMatch(/^grammar: .*left.recurs/i)
    expect(check(`start ::= "a"`)).toMatch(/^grammar: .*root/)
    expect(check(`start ::= "a"`, "start")).toBeUndefined()
  })

  it("context: prompt + max tokens may equal the context, not exceed it", () => {
    expect(fitsContext(5, 2043, 2048)).toBe(true)
    expect(fitsContext(5, 2044, 2048)).toBe(false)
    expect(contextProblem(5, 2043, 2048, "--max-tokens")).toBeUndefined()
    expect(contextProblem(5, 2048, 2048, "--max-tokens")).toBe(
      "context too long: the prompt (5 tokens) and 2048 new tokens (--max-tokens 2048) do not fit the model's " +
        "context of 2048 tokens; at most --max-tokens 2043"
    )
    expect(contextProblem(2048, 1, 2048, "max_tokens")).toMatch(/the prompt alone fills it$/)
  })

  it("token ids: whole numbers below the vocabulary size; the first bad one is named", () => {
    expect(tokenIdsProblem([1, 0, 511], 512)).toBeUndefined()
    expect(tokenIdsProblem([1, -1], 512)).toBe(
      "prompt token 1 is -1: token ids are whole numbers from 0 to 511 (the model's vocabulary)"
    )
    expect(tokenIdsProblem([1, 512], 512)).toMatch(/prompt token 1 is 512/)
    expect(tokenIdsProblem([1.5], 512)).toMatch(/prompt token 0 is 1.5/)
    expect(tokenIdsProblem([1, Number.NaN], 512)).toMatch(/prompt token 1 is NaN/)
  })

  it("an empty prompt (no ids, empty or white-space text) has one message, before any other check", () => {
    const base = { maxTokens: 4, contextLength: 2048, vocabSize: 512 }
    expect(generationProblem({ ...base, text: "", tokens: [1] })).toBe(emptyPromptMessage)
    expect(generationProblem({ ...base, text: " \n\t", tokens: [1, 3] })).toBe(emptyPromptMessage)
    expect(generationProblem({ ...base, text: [], tokens: [] })).toBe(emptyPromptMessage)
    expect(generationProblem({ ...base, text: "Once", tokens: [1, 4] })).toBeUndefined()
    expect(generationProblem({ ...base, maxTokens: 0, text: "Once", tokens: [1] })).toMatch(
      /max tokens must be a whole number/
    )
  })

  it("threads 1..512, spares 0..64 and stages up to the model's blocks", () => {
    expect(threadsProblem(1)).toBeUndefined()
    expect(threadsProblem(512)).toBeUndefined()
    expect(threadsProblem(513, "--threads")).toBe("--threads must be a whole number from 1 to 512, got 513")
    expect(threadsProblem(0)).toMatch(/got 0/)
    expect(threadsProblem(2.5)).toMatch(/got 2.5/)
    expect(sparesProblem(0)).toBeUndefined()
    expect(sparesProblem(64)).toBeUndefined()
    expect(sparesProblem(65, "--spares")).toBe("--spares must be a whole number from 0 to 64, got 65")
    expect(sparesProblem(-1)).toMatch(/got -1/)
    expect(sparesProblem(1.5)).toMatch(/got 1.5/)
    expect(stagesProblem(5, 5)).toBeUndefined()
    expect(stagesProblem(100, 5, "--stages")).toBe(
      "--stages 100: the model has 5 blocks, so it splits into at most 5 stages (each stage hosts at least one block)"
    )
  })
})

describe("the cluster token's strength", () => {
  const weak = [
    "0".repeat(64), // the token from the report
    "ab".repeat(32),
    "0123456789abcdef".repeat(4),
    "abcdefghijklmnopqrstuvwxyz0123456789",
    "passwordpassword",
    "aaaaaaaaaaaaaaab"
  ]
  it.each(weak)("refuses %s with how to make a good one", (token) => {
    const problem = clusterTokenProblem(token, "SWACTOR_CLUSTER_TOKEN")
    expect(problem).toMatch(/^the cluster token from SWACTOR_CLUSTER_TOKEN is weak: about \d+ bits of entropy/)
    expect(problem).toMatch(/at least 64; make one with: openssl rand -hex 32$/)
  })

  it("refuses a short token, saying how long and how to make one", () => {
    expect(clusterTokenProblem("short", "SWACTOR_CLUSTER_TOKEN")).toBe(
      "the cluster token from SWACTOR_CLUSTER_TOKEN is too short: 5 characters, at least 16; make one with: openssl rand -hex 32"
    )
  })

  it("accepts random tokens (hex and base64 of 16 and 32 bytes) every time, and passphrase-like ones", () => {
    for (let i = 0; i < 2000; i++) {
      for (const token of [
        randomBytes(32).toString("hex"),
        randomBytes(16).toString("hex"),
        randomBytes(32).toString("base64")
      ]) {
        expect(clusterTokenProblem(token, "x"), token).toBeUndefined()
      }
    }
    expect(clusterTokenProblem("control-plane-test-token", "x")).toBeUndefined()
    expect(estimateTokenBits(randomBytes(32).toString("hex"))).toBeGreaterThan(128)
  })
})

describe("refused connections: one line per peer per window, naming it", () => {
  it("names the peer; a flood from one peer is one line, the next says how many were not logged", () => {
    let now = 0
    const log = makeRefusalLog("control-plane connection", { windowMillis: 10_000, now: () => now })
    expect(log.refused("10.0.0.5", "bad proof")).toBe("control-plane connection from 10.0.0.5 refused: bad proof")
    for (let i = 0; i < 1000; i++) {
      now += 1
      expect(log.refused("10.0.0.5", "bad proof")).toBeUndefined()
    }
    expect(log.refused("10.0.0.6", "bad proof")).toBe("control-plane connection from 10.0.0.6 refused: bad proof")
    now = 20_000
    expect(log.refused("10.0.0.5", "bad proof")).toBe(
      "control-plane connection from 10.0.0.5 refused: bad proof (1000 more from this peer not logged)"
    )
  })

  it("a flood from many peers is capped per window, and the count comes later", () => {
    let now = 0
    const log = makeRefusalLog("data-plane connection", { windowMillis: 10_000, maxLines: 3, now: () => now })
    const lines = Array.from({ length: 500 }, (_, i) =>
      log.refused(`10.0.${i >> 8}.${i & 255}`, "authentication failed")
    ).filter((line) => line !== undefined)
    expect(lines).toHaveLength(3)
    expect(lines[2]).toMatch(/further refusals are not logged for 10 s$/)
    now = 20_000 // a new window after the flood's
    expect(log.refused("192.168.1.1", "authentication failed")).toMatch(
      /497 more from any peer not logged in the last flood/
    )
  })
})

describe("failed handshakes: closes are DEBUG lines, and no flood hides a failed proof (issue 41)", () => {
  it("closes and timeouts are one DEBUG line each; a flood of them and of foreign protocols leaves a failed proof its WARN line", () => {
    let now = 0
    const log = makeHandshakeLog("data-plane connection", { windowMillis: 10_000, maxLines: 3, now: () => now })
    const closed = new AuthFailed({ detail: "peer closed the connection during the handshake", reason: "closed" })
    const timedOut = new AuthFailed({ detail: "handshake timed out", reason: "timeout" })
    const foreign = new AuthFailed({ detail: "expected Hello", reason: "protocol" })
    const forged = new AuthFailed({ detail: "client proof does not match the cluster token", reason: "proof" })
    expect(log("10.0.0.5", closed)).toEqual({
      level: "Debug",
      line: "data-plane connection from 10.0.0.5 closed before authenticating (peer closed the connection during the handshake)"
    })
    expect(log("10.0.0.5", timedOut)).toEqual({
      level: "Debug",
      line: "data-plane connection from 10.0.0.5 dropped before authenticating (handshake timed out)"
    })
    // A flood of closes from the forger's own address and from many others, and of another protocol from many peers.
    for (let i = 0; i < 1000; i++) {
      now += 1
      expect(log("10.0.0.5", closed)?.level).toBe("Debug")
      expect(log(`10.1.${i >> 8}.${i & 255}`, closed)?.level).toBe("Debug")
    }
    const foreignLines = Array.from({ length: 500 }, (_, i) => log(`10.2.${i >> 8}.${i & 255}`, foreign)).filter(
      (said) => said !== undefined
    )
    expect(foreignLines).toHaveLength(3)
    expect(foreignLines[0]).toEqual({
      level: "Warning",
      line: "data-plane connection from 10.2.0.0 refused: not a swactor handshake: expected Hello"
    })
    expect(log("10.0.0.5", forged)).toEqual({
      level: "Warning",
      line: "data-plane connection from 10.0.0.5 refused: authentication failed: client proof does not match the cluster token"
    })
    // The next forged proof from that peer within the window is counted, not logged.
    expect(log("10.0.0.5", forged)).toBeUndefined()
  })
})

describe("API keys: printable ASCII without spaces (issue 41)", () => {
  it("API keys: printable ASCII without spaces", () => {
    const printable = Array.from({ length: 0x7e - 0x21 + 1 }, (_, i) => String.fromCharCode(0x21 + i)).join("")
    expect(apiKeyProblem(printable, 1, "--api-key-file k")).toBeUndefined()
    expect(apiKeyProblem("sk-abc def", 2, "--api-key-file k")).toBe(
      "--api-key-file k: key 2 has a space inside; one key per line"
    )
    expect(apiKeyProblem("sk-\u00a0x", 1, "k")).toMatch(/has a space inside/)
    for (const [key, at] of [
      ["café", 4],
      ["🔑-key", 1],
      ["sk-\u007f", 4],
      ["sk-\u0000", 4]
    ] as const) {
      expect(apiKeyProblem(key, 3, "SWACTOR_API_KEY"), key).toBe(
        `SWACTOR_API_KEY: key 3 has a character outside printable ASCII (at character ${at}), which HTTP clients send ` +
          "as different bytes; use letters, digits and punctuation (make one with: openssl rand -hex 32)"
      )
    }
  })
})
