// A sender that connects before the receiver has registered its edge (the stages of a new run set up side by side) is
// held and attached the moment the edge registers, instead of being refused and polling; an edge that never registers
// is refused once the wait is over, and a wait of 0 refuses at once.
import { assert, describe, it } from "@effect/vitest"
import { Effect, Either, Fiber, Redacted } from "effect"
import { ActivationFrame, tcpAddress } from "../../src/domain/frames.js"
import type { EdgeId, RunId } from "../../src/domain/ids.js"
import type { RingSpec } from "../../src/domain/plan.js"
import * as EdgeTransport from "../../src/layers/transport/EdgeTransport.js"

const token = Redacted.make("correct-horse-battery-staple-0123456789")
const runId = 7 as RunId
const edgeId = 3 as EdgeId
const ring: RingSpec = {
  dataCapacity: 64 * 1024,
  alignment: 64,
  direction: "Egress",
  hostPinning: "Pageable",
  wakeCoalescing: "PendingBit"
}

describe("an attach waits for its edge's registration (attachWait)", () => {
  it.scopedLive("a sender that connected first is attached when the edge registers, and its frames arrive", () =>
    Effect.gen(function* () {
      const listener = yield* EdgeTransport.listen({ address: tcpAddress(0), token, attachWait: "5 seconds" })
      const connecting = yield* Effect.fork(
        EdgeTransport.connect({ address: listener.address, token, runId, edgeId, ring })
      )
      // long enough for the attach to have reached the listener (and for a refusal to have come back, were it refused)
      yield* Effect.sleep("300 millis")
      assert.isNull(connecting.unsafePoll(), "the connect ended before the edge was registered")
      const registeredAt = performance.now()
      const receiver = yield* listener.register({ runId, edgeId, ring })
      const sender = yield* Fiber.join(connecting)
      const attachedAfter = performance.now() - registeredAt
      // attached at the registration: no polling interval (the sender's retry schedule starts at 10 ms and doubles)
      assert.isBelow(attachedAfter, 250, `attached ${attachedAfter.toFixed(1)} ms after the registration`)
      const payload = Float32Array.from([1, 2, 3, 4])
      yield* sender.send(ActivationFrame({ runId, edgeId, step: 0, startPos: 0, nTokens: 1, hiddenDim: 4, payload }))
      const frame = yield* receiver.take
      assert.strictEqual(frame._tag, "ActivationFrame")
      if (frame._tag === "ActivationFrame") assert.deepStrictEqual(Array.from(frame.payload), [1, 2, 3, 4])
    })
  )

  it.scopedLive("an edge that never registers is refused once the wait is over (UnknownRun, then UnknownEdge)", () =>
    Effect.gen(function* () {
      const listener = yield* EdgeTransport.listen({ address: tcpAddress(0), token, attachWait: "300 millis" })
      const started = performance.now()
      const unknownRun = yield* Effect.either(
        EdgeTransport.connect({ address: listener.address, token, runId, edgeId, ring })
      )
      const waited = performance.now() - started
      assert.isTrue(
        Either.isLeft(unknownRun) && unknownRun.left._tag === "PeerFaulted" && unknownRun.left.reason === "UnknownRun"
      )
      assert.isAtLeast(waited, 280, "refused before the wait was over")
      yield* listener.register({ runId, edgeId, ring })
      const unknownEdge = yield* Effect.either(
        EdgeTransport.connect({ address: listener.address, token, runId, edgeId: 9 as EdgeId, ring })
      )
      assert.isTrue(
        Either.isLeft(unknownEdge) &&
          unknownEdge.left._tag === "PeerFaulted" &&
          unknownEdge.left.reason === "UnknownEdge"
      )
    })
  )

  it.scopedLive("a wait of 0 refuses an unregistered edge at once", () =>
    Effect.gen(function* () {
      const listener = yield* EdgeTransport.listen({ address: tcpAddress(0), token, attachWait: 0 })
      const started = performance.now()
      const result = yield* Effect.either(
        EdgeTransport.connect({ address: listener.address, token, runId, edgeId, ring })
      )
      assert.isTrue(Either.isLeft(result) && result.left._tag === "PeerFaulted" && result.left.reason === "UnknownRun")
      assert.isBelow(performance.now() - started, 1000)
    })
  )
})
