// Discovery over real UDP sockets on loopback (issue 39): announcers send by multicast and broadcast on `lo` (asked
// for explicitly: loopback is left out by default) to a listener on a free port. The listener lists the node with the
// same token as verified, a node with another token as refused, a sender of another protocol version with its
// reason, two live nodes with one id as refused naming both; a clean stop's leave removes a node, a dead node's
// replayed announcement does not bring it back, and an announcement nobody repeats expires.
import { assert, describe, it } from "@effect/vitest"
import * as Dgram from "node:dgram"
import { Effect, Redacted, Scope, Exit } from "effect"
import { type Announcement, DISCOVERY_MARKER, type DiscoveryView } from "../../src/domain/discovery.js"
import { makeAnnouncer } from "../../src/layers/discovery/Announcer.js"
import { signedDatagram } from "../../src/layers/discovery/DiscoveryProof.js"
import { makeDiscoveryListener } from "../../src/layers/discovery/DiscoveryListener.js"

const token = Redacted.make("a-cluster-token-9f3b27c1d4e5")
const otherToken = Redacted.make("another-token-7a1c55e0b2d9")
const loopback = { only: ["lo"] }
const resources = () => ({ totalMemoryBytes: 8e9, freeMemoryBytes: 4e9, cores: 4, backend: "cpu" })

/** Waits (up to 5 s) until the listener's view passes `check`; the last view either way. */
const until = (view: Effect.Effect<DiscoveryView>, check: (v: DiscoveryView) => boolean) =>
  Effect.gen(function* () {
    const end = Date.now() + 5000
    let v = yield* view
    while (!check(v) && Date.now() < end) {
      yield* Effect.sleep("50 millis")
      v = yield* view
    }
    return v
  })

/** Sends `message` once, by unicast, to 127.0.0.1:port. */
const sendRaw = (message: Buffer, port: number) =>
  Effect.async<void>((resume) => {
    const socket = Dgram.createSocket("udp4")
    socket.send(message, port, "127.0.0.1", () => {
      socket.close()
      resume(Effect.void)
    })
  })

const announcerIn = (scope: Scope.Scope, port: number, nodeId: string, address: string, key = token) =>
  makeAnnouncer({ token: key, nodeId, address, resources, interfaces: loopback, port, intervalMillis: 100 }).pipe(
    Scope.extend(scope)
  )

describe("discovery over UDP on loopback", () => {
  it.live(
    "verified, refused, other version and duplicate id are each listed; leave removes; a replay stays dead",
    () =>
      Effect.gen(function* () {
        const listener = yield* makeDiscoveryListener({ token, port: 0, interfaces: loopback })
        const a = yield* Scope.make()
        const announcerA = yield* announcerIn(a, listener.port, "node-a", "127.0.0.1:7001")
        yield* announcerIn(yield* Effect.scope, listener.port, "node-b", "127.0.0.1:7002", otherToken)
        yield* announcerIn(yield* Effect.scope, listener.port, "node-c", "127.0.0.1:7003")
        yield* announcerIn(yield* Effect.scope, listener.port, "node-c", "127.0.0.1:7004")
        const skew = { swactor: DISCOVERY_MARKER, protocol: 2, nonce: "00", proof: "00", body: '{"nodeId":"node-z"}' }
        yield* sendRaw(Buffer.from(JSON.stringify(skew)), listener.port)

        const view = yield* until(
          listener.view,
          (v) => v.verified.length === 1 && v.refused.length > 0 && v.conflicts.length === 1
        )
        assert.deepStrictEqual(
          view.verified.map((n) => [n.nodeId, n.address, n.resources.cores]),
          [["node-a", "127.0.0.1:7001", 4]]
        )
        assert.isTrue(view.refused.every((r) => r.nodeId === "node-b" && r.reason.includes("proof does not hold")))
        assert.include(view.otherVersions[0]?.reason ?? "", "node node-z at 127.0.0.1:")
        assert.include(view.conflicts[0]!.reason, "127.0.0.1:7003 and 127.0.0.1:7004")
        assert.deepStrictEqual((yield* announcerA.failures).size, 0)

        // a clean stop: its leave removes node-a at once (well within the 5 s TTL)
        yield* Scope.close(a, Exit.void)
        const left = yield* until(listener.view, (v) => v.verified.length === 0)
        assert.deepStrictEqual(left.verified, [])
        // a replay of an old announcement of node-a (properly proved, an earlier counter) does not bring it back
        const old: Announcement = {
          kind: "announce",
          nodeId: "node-a",
          address: "127.0.0.1:7001",
          startedAt: 0,
          counter: 1,
          ttlMillis: 5000,
          resources: resources()
        }
        yield* sendRaw(signedDatagram(token, old), listener.port)
        yield* Effect.sleep("300 millis")
        assert.deepStrictEqual((yield* listener.view).verified, [])
      }).pipe(Effect.scoped),
    20_000
  )

  it.live(
    "an announcement nobody repeats expires after its TTL, and its replay does not bring the node back",
    () =>
      Effect.gen(function* () {
        const listener = yield* makeDiscoveryListener({ token, port: 0, interfaces: loopback })
        const once: Announcement = {
          kind: "announce",
          nodeId: "node-k",
          address: "127.0.0.1:7009",
          startedAt: Date.now(),
          counter: 3,
          ttlMillis: 300,
          resources: resources()
        }
        const datagram = signedDatagram(token, once)
        yield* sendRaw(datagram, listener.port)
        const seen = yield* until(listener.view, (v) => v.verified.length === 1)
        assert.deepStrictEqual(
          seen.verified.map((n) => n.nodeId),
          ["node-k"]
        )
        yield* Effect.sleep("500 millis")
        assert.deepStrictEqual((yield* listener.view).verified, [], "expired")
        yield* sendRaw(datagram, listener.port)
        yield* Effect.sleep("200 millis")
        assert.deepStrictEqual((yield* listener.view).verified, [], "the replay stays dead")
        yield* sendRaw(signedDatagram(token, { ...once, counter: 4 }), listener.port)
        const back = yield* until(listener.view, (v) => v.verified.length === 1)
        assert.strictEqual(back.verified.length, 1, "a newer announcement brings it back")
      }).pipe(Effect.scoped),
    20_000
  )

  it.live(
    "a destination whose send fails is kept in failures, round after round, and the others still deliver",
    () =>
      Effect.gen(function* () {
        const listener = yield* makeDiscoveryListener({ token, port: 0, interfaces: loopback })
        const announcer = yield* makeAnnouncer({
          token,
          nodeId: "node-f",
          address: "127.0.0.1:7010",
          resources,
          interfaces: loopback,
          port: listener.port,
          targets: ["127.0.0.1:0"],
          intervalMillis: 100
        })
        const view = yield* until(listener.view, (v) => v.verified.length === 1)
        assert.deepStrictEqual(
          view.verified.map((n) => n.nodeId),
          ["node-f"]
        )
        yield* Effect.sleep("400 millis")
        assert.isAtLeast(yield* announcer.rounds, 3)
        const failures = yield* announcer.failures
        assert.deepStrictEqual([...failures.keys()], ["127.0.0.1:0"])
        assert.match(failures.get("127.0.0.1:0") ?? "", /port/i)
      }).pipe(Effect.scoped),
    20_000
  )
})
