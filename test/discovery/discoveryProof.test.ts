// Discovery's proof and the discovered set (issue 39), without sockets: a proof holds with the same token only, an
// altered announcement fails, another protocol version is listed with its reason, leave and expiry remove a node, a
// stale announcement after them does not bring it back (a restart does), and two live nodes with one id are refused
// naming both addresses.
import { assert, describe, it } from "@effect/vitest"
import { mkdtempSync, rmSync, writeFileSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { Effect, Redacted } from "effect"
import {
  type Announcement,
  buryAddress,
  DISCOVERY_MARKER,
  emptyDiscovered,
  expireDiscovered,
  hear,
  reachableAddress,
  viewOf
} from "../../src/domain/discovery.js"
import { readDatagram, signedDatagram } from "../../src/layers/discovery/DiscoveryProof.js"
import { broadcastOf, discoveryInterfaces } from "../../src/layers/discovery/NetInterfaces.js"
import { persistentNodeId } from "../../src/layers/discovery/NodeIdentity.js"

const token = Redacted.make("a-cluster-token-9f3b27c1d4e5")
const otherToken = Redacted.make("another-token-7a1c55e0b2d9")
/** A fixed nonce: the proofs below are the same on every run. */
const nonce = Buffer.alloc(16, 7)

const announcement = (over: Partial<Announcement> = {}): Announcement => ({
  kind: "announce",
  nodeId: "node-a",
  address: "10.0.0.1:7000",
  startedAt: 1000,
  counter: 0,
  ttlMillis: 500,
  resources: { totalMemoryBytes: 8e9, freeMemoryBytes: 4e9, cores: 8, backend: "cpu" },
  ...over
})

const verified = (a: Announcement, from = "10.0.0.1:50000") => ({ _tag: "Verified" as const, announcement: a, from })

describe("the proof of an announcement", () => {
  it("holds with the same token, fails with another; the token is not in the datagram", () => {
    const datagram = signedDatagram(token, announcement(), nonce)
    const same = readDatagram(token, datagram, "10.0.0.1:50000")
    assert.strictEqual(same._tag, "Verified")
    assert.deepStrictEqual(same._tag === "Verified" ? same.announcement : undefined, announcement())
    const other = readDatagram(otherToken, datagram, "10.0.0.1:50000")
    assert.strictEqual(other._tag, "Refused")
    assert.include(other._tag === "Refused" ? other.reason : "", "proof does not hold")
    assert.notInclude(datagram.toString("utf8"), Redacted.value(token))
    // a fresh nonce each time: two datagrams of one announcement differ
    assert.notDeepEqual(signedDatagram(token, announcement()), signedDatagram(token, announcement()))
  })

  it("an altered announcement (address, resources or nonce) is refused", () => {
    const text = signedDatagram(token, announcement(), nonce).toString("utf8")
    const altered = [
      text.replace("10.0.0.1:7000", "10.6.6.6:7000"),
      text.replace('"cores\\":8', '"cores\\":64'),
      text.replace(nonce.toString("hex"), Buffer.alloc(16, 8).toString("hex"))
    ]
    for (const t of altered) {
      assert.notStrictEqual(t, text)
      const heard = readDatagram(token, Buffer.from(t), "10.0.0.1:50000")
      assert.strictEqual(heard._tag, "Refused", t)
      assert.strictEqual(heard._tag === "Refused" ? heard.nodeId : undefined, "node-a")
    }
    assert.strictEqual(readDatagram(token, Buffer.from("hello"), "10.0.0.9:1")._tag, "Refused")
  })

  it("another protocol version is listed with the reason, never dropped", () => {
    const datagram = JSON.stringify({ swactor: DISCOVERY_MARKER, protocol: 2, nonce: "00", proof: "00", body: "{}" })
    const heard = readDatagram(token, Buffer.from(datagram), "10.0.0.5:50000")
    assert.strictEqual(heard._tag, "OtherVersion")
    const view = viewOf(hear(emptyDiscovered, heard, 0, 1000))
    assert.strictEqual(view.otherVersions.length, 1)
    assert.include(view.otherVersions[0]!.reason, "discovery protocol 2, this node 1")
    assert.include(view.otherVersions[0]!.reason, "10.0.0.5:50000")
  })
})

describe("the discovered set", () => {
  it("a leave removes the node; a stale announcement after it does not re-add it; a restart does", () => {
    let state = hear(emptyDiscovered, verified(announcement({ counter: 3 })), 0, 1000)
    assert.deepStrictEqual(
      viewOf(state).verified.map((n) => n.nodeId),
      ["node-a"]
    )
    state = hear(state, verified(announcement({ kind: "leave", counter: 4 })), 10, 1000)
    assert.deepStrictEqual(viewOf(state).verified, [])
    for (const counter of [2, 3, 4]) state = hear(state, verified(announcement({ counter })), 20, 1000)
    assert.deepStrictEqual(viewOf(state).verified, [], "a late or replayed announcement stays dead")
    state = hear(state, verified(announcement({ startedAt: 2000, counter: 0 })), 30, 1000)
    assert.deepStrictEqual(
      viewOf(state).verified.map((n) => n.startedAt),
      [2000]
    )
  })

  it("an announcement expires after its TTL; a stale one after that does not re-add; a newer one does", () => {
    let state = hear(emptyDiscovered, verified(announcement({ counter: 5 })), 0, 1000)
    assert.strictEqual(viewOf(expireDiscovered(state, 499)).verified.length, 1)
    state = expireDiscovered(state, 501)
    assert.deepStrictEqual(viewOf(state).verified, [])
    state = hear(state, verified(announcement({ counter: 5 })), 600, 1000)
    assert.deepStrictEqual(viewOf(state).verified, [])
    state = hear(state, verified(announcement({ counter: 6 })), 700, 1000)
    assert.strictEqual(viewOf(state).verified.length, 1)
  })

  it("a node found dead (buried by its address) is not re-added by any announcement of its run; a restart is", () => {
    let state = hear(emptyDiscovered, verified(announcement({ counter: 5 })), 0, 1000)
    assert.strictEqual(buryAddress(state, "10.9.9.9:7000"), state, "another address buries nothing")
    state = buryAddress(state, "10.0.0.1:7000")
    assert.deepStrictEqual(viewOf(state).verified, [])
    // the same run still announcing (a node that hangs), a late datagram: neither brings it back
    for (const counter of [4, 6, 500]) state = hear(state, verified(announcement({ counter })), 10, 1000)
    assert.deepStrictEqual(viewOf(state).verified, [])
    state = hear(state, verified(announcement({ startedAt: 3000, counter: 0 })), 20, 1000)
    assert.deepStrictEqual(
      viewOf(state).verified.map((n) => [n.nodeId, n.startedAt]),
      [["node-a", 3000]]
    )
  })

  it("two live nodes with one id: both refused, naming both addresses; when one expires the other is used", () => {
    let state = hear(emptyDiscovered, verified(announcement()), 0, 1000)
    state = hear(state, verified(announcement({ address: "10.0.0.2:7000", startedAt: 5 }), "10.0.0.2:50000"), 10, 1000)
    const view = viewOf(state)
    assert.deepStrictEqual(view.verified, [])
    assert.strictEqual(view.conflicts.length, 1)
    assert.include(view.conflicts[0]!.reason, "10.0.0.1:7000 and 10.0.0.2:7000")
    // only the first keeps announcing: the second expires, the conflict ends, the first is heard again
    state = hear(state, verified(announcement({ counter: 1 })), 400, 1000)
    state = expireDiscovered(state, 600)
    assert.deepStrictEqual(viewOf(state).conflicts, [])
    state = hear(state, verified(announcement({ counter: 2 })), 700, 1000)
    assert.deepStrictEqual(
      viewOf(state).verified.map((n) => n.address),
      ["10.0.0.1:7000"]
    )
  })
})

describe("the address a node is reached at", () => {
  it("a wildcard host is the sender's IP with the announced port; a named host is kept", () => {
    assert.strictEqual(reachableAddress("0.0.0.0:7070", "10.0.0.7:50123"), "10.0.0.7:7070")
    assert.strictEqual(reachableAddress("[::]:7070", "10.0.0.7:50123"), "10.0.0.7:7070")
    assert.strictEqual(reachableAddress("10.0.0.9:7070", "10.0.0.7:50123"), "10.0.0.9:7070")
    const state = hear(emptyDiscovered, verified(announcement({ address: "0.0.0.0:7070" }), "10.0.0.7:5"), 0, 1000)
    assert.deepStrictEqual(
      viewOf(state).verified.map((n) => n.address),
      ["10.0.0.7:7070"]
    )
  })
})

describe("interfaces and the node id", () => {
  it("virtual interfaces and loopback are left out unless asked; broadcast from the netmask", () => {
    const info = (address: string, internal = false) => ({
      address,
      netmask: "255.255.255.0",
      family: "IPv4" as const,
      mac: "00:00:00:00:00:00",
      internal,
      cidr: null
    })
    const table = {
      lo: [info("127.0.0.1", true)],
      eth0: [info("192.168.1.7")],
      docker0: [info("172.17.0.1")],
      veth12: [info("172.17.0.2")],
      "br-3f": [info("172.18.0.1")],
      virbr0: [info("192.168.122.1")]
    }
    assert.deepStrictEqual(
      discoveryInterfaces({}, table).map((i) => i.name),
      ["eth0"]
    )
    assert.deepStrictEqual(
      discoveryInterfaces({ loopback: true }, table).map((i) => i.name),
      ["lo", "eth0"]
    )
    assert.deepStrictEqual(
      discoveryInterfaces({ only: ["docker0"] }, table).map((i) => i.name),
      ["docker0"]
    )
    assert.strictEqual(discoveryInterfaces({}, table)[0]!.broadcast, "192.168.1.255")
    assert.strictEqual(broadcastOf("10.1.2.3", "255.255.0.0"), "10.1.255.255")
  })

  it.effect("the node id is made once and kept; a damaged file is refused", () =>
    Effect.gen(function* () {
      const dir = mkdtempSync(join(tmpdir(), "swactor-nodeid-"))
      try {
        const first = yield* persistentNodeId(join(dir, "state"))
        assert.match(first, /^[0-9a-f]{32}$/)
        assert.strictEqual(yield* persistentNodeId(join(dir, "state")), first)
        writeFileSync(join(dir, "state", "node-id"), "copied?\n")
        const damaged = yield* Effect.flip(persistentNodeId(join(dir, "state")))
        assert.include(damaged.message, "does not hold a node id")
      } finally {
        rmSync(dir, { recursive: true, force: true })
      }
    })
  )
})
