/**
 * The HTTP edge's rules as pure functions (src/layers/server/HttpGuard.ts): who may call (Host, Origin), how deep JSON
 * may nest, what an error message may carry. serve.edge proves them through a real server.
 */
import { assert, describe, it } from "@effect/vitest"
import { Effect, Exit } from "effect"
import { hostname } from "node:os"
import {
  checkCaller,
  checkJsonContentType,
  clip,
  hostAllowed,
  hostOf,
  jsonDepth,
  maxJsonDepth,
  originAllowed,
  parseJson,
  withoutAddresses
} from "../../src/layers/server/HttpGuard.js"

describe("HttpGuard", () => {
  it("Host: a loopback listener answers loopback names only; a wildcard one IP literals and this machine; --allowed-hosts adds names", () => {
    assert.strictEqual(hostOf("LocalHost:8080"), "localhost")
    assert.strictEqual(hostOf("[::1]:8080"), "::1")
    assert.strictEqual(hostOf("10.0.0.2"), "10.0.0.2")
    for (const host of ["localhost", "127.0.0.1", "127.1.2.3", "::1", "app.localhost"])
      assert.isTrue(hostAllowed(host, "127.0.0.1", []), host)
    // DNS rebinding: the attacker's own name, now resolving to 127.0.0.1.
    assert.isFalse(hostAllowed("attacker.example", "127.0.0.1", []))
    assert.isFalse(hostAllowed("127.attacker.example", "127.0.0.1", []))
    assert.isFalse(hostAllowed("10.0.0.2", "127.0.0.1", []))
    assert.isTrue(hostAllowed("llm.lan", "127.0.0.1", ["llm.lan"]))
    assert.isTrue(hostAllowed("anything", "127.0.0.1", ["*"]))
    assert.isTrue(hostAllowed("10.0.0.2", "0.0.0.0", []))
    assert.isTrue(hostAllowed(hostname().toLowerCase(), "0.0.0.0", []))
    assert.isFalse(hostAllowed("attacker.example", "0.0.0.0", []))
    assert.isTrue(hostAllowed("10.0.0.2", "10.0.0.2", []))
    assert.isFalse(hostAllowed("10.0.0.3", "10.0.0.2", []))
  })

  it("Origin: none (not a browser), the server's own, or an allowed one", () => {
    assert.isTrue(originAllowed(undefined, "127.0.0.1:8080", []))
    assert.isTrue(originAllowed("http://127.0.0.1:8080", "127.0.0.1:8080", []))
    assert.isFalse(originAllowed("http://127.0.0.1:9090", "127.0.0.1:8080", []))
    assert.isFalse(originAllowed("http://evil.example", "127.0.0.1:8080", []))
    assert.isFalse(originAllowed("null", "127.0.0.1:8080", []))
    assert.isTrue(originAllowed("http://app.example:3000", "127.0.0.1:8080", ["http://app.example:3000"]))
    assert.isTrue(originAllowed("http://evil.example", "127.0.0.1:8080", ["*"]))
    assert.strictEqual(
      checkCaller({ host: "127.0.0.1:8080" }, "127.0.0.1", { allowedHosts: [], allowedOrigins: [] }),
      undefined
    )
    assert.strictEqual(checkCaller({}, "127.0.0.1", { allowedHosts: [], allowedOrigins: [] })?.code, "host_missing")
    assert.strictEqual(
      checkCaller({ host: "127.0.0.1:8080", origin: "http://evil.example" }, "127.0.0.1", {
        allowedHosts: [],
        allowedOrigins: []
      })?.status,
      403
    )
  })

  it("content type: application/json with any parameters, nothing else", () => {
    assert.strictEqual(checkJsonContentType("application/json"), undefined)
    assert.strictEqual(checkJsonContentType("Application/JSON; charset=utf-8"), undefined)
    for (const type of [
      undefined,
      "text/plain",
      "application/x-www-form-urlencoded",
      "multipart/form-data; boundary=x",
      "application/jsonx"
    ]) {
      assert.strictEqual(checkJsonContentType(type)?.status, 415, String(type))
    }
  })

  it("JSON depth: brackets inside strings (and escaped quotes) do not count; past the limit refused before parsing", () => {
    assert.strictEqual(jsonDepth('{"a":[1,{"b":2}]}'), 3)
    assert.strictEqual(jsonDepth('{"a":"[[[[{{{{\\"[[["}'), 1)
    assert.strictEqual(jsonDepth("42"), 0)
    // Escaped backslashes before a quote: an even run closes the string, an odd one does not.
    assert.strictEqual(jsonDepth('["a\\\\",[[1]]]'), 3)
    assert.strictEqual(jsonDepth('["a\\\\\\"[[[",[1]]'), 2)
    assert.strictEqual(jsonDepth(`{"s":"${"x".repeat(1_000_000)}","a":[[[]]]}`), 4)
    const deep = `${"[".repeat(maxJsonDepth + 1)}${"]".repeat(maxJsonDepth + 1)}`
    const refused = Effect.runSyncExit(parseJson(deep))
    assert.isTrue(Exit.isFailure(refused))
    const atLimit = `${"[".repeat(maxJsonDepth)}${"]".repeat(maxJsonDepth)}`
    assert.isTrue(Exit.isSuccess(Effect.runSyncExit(parseJson(atLimit))))
    assert.isTrue(Exit.isFailure(Effect.runSyncExit(parseJson('{"a":'))))
  })

  it("messages: clipped with the count left out; agents' addresses and socket paths taken out", () => {
    const long = "x".repeat(5000)
    const clipped = clip(long, 100)
    assert.strictEqual(clipped, `${"x".repeat(100)}… (4900 more characters)`)
    assert.strictEqual(clip("short"), "short")
    const scrubbed = withoutAddresses(
      "lost agent 10.1.2.3:7070; agent [fd00::2]:7071 and node-b.lan:7070 refused; socket /tmp/swactor-123/agent-0.sock gone; 12 tokens: 3 stages"
    )
    for (const inside of ["10.1.2.3", "fd00::2", "node-b.lan", "/tmp/swactor-123"]) assert.notInclude(scrubbed, inside)
    assert.include(scrubbed, "12 tokens: 3 stages")
  })
})
