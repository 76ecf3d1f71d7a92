import { assert, describe, it } from "@effect/vitest"
import { Either, FastCheck as fc } from "effect"
import {
  ActivationFrame,
  AttachedFrame,
  AttachFrame,
  CreditFrame,
  dataFrame,
  type DataFrame,
  DoorbellFrame,
  FaultFrame,
  TokenFrame,
  type WireFrame
} from "../../src/domain/frames.js"
import type { EdgeId, RunId } from "../../src/domain/ids.js"
import * as Framing from "../../src/layers/transport/Framing.js"
import { Sequencer } from "../../src/layers/transport/Sequencer.js"

const runId = 7 as RunId
const edgeId = 3 as EdgeId
const limits = (alignment: number): Framing.Limits => ({ alignment, maxFrameBytes: 1 << 20 })

const activation = (step: number, nTokens: number, hiddenDim: number, startPos = 0) =>
  ActivationFrame({
    runId,
    edgeId,
    step,
    startPos,
    nTokens,
    hiddenDim,
    payload: Float32Array.from({ length: nTokens * hiddenDim }, (_, i) => i * 0.5 - 3)
  })

const roundTrip = (frame: WireFrame, alignment: number) => {
  const bytes = Either.getOrThrow(Framing.encode(frame, alignment))
  return { bytes, decoded: Framing.decodeUnguarded(bytes, limits(alignment)) }
}

// Arbitraries for every frame kind.
const u32 = fc.integer({ min: 0, max: 0xffff_ffff })
const alignmentArb = fc.constantFrom(1, 2, 4, 8, 16, 64, 256)
const ids = { runId: u32.map((n) => n as RunId), edgeId: u32.map((n) => n as EdgeId) }
const tokenFrameArb = fc
  .record({
    ...ids,
    step: u32,
    payload: fc.oneof(
      fc.array(u32, { minLength: 1, maxLength: 40 }).map((tokens) => ({ _tag: "Prompt" as const, tokens })),
      u32.map((tokenId) => ({ _tag: "Decode" as const, tokenId })),
      fc.record({ tokenId: u32, eos: fc.boolean() }).map((p) => ({ _tag: "Sampled" as const, ...p })),
      // a Sampled token with its sampler's draws and/or its log-probs (alternatives most likely first)
      fc
        .record({
          tokenId: u32,
          eos: fc.boolean(),
          draws: fc.option(u32, { nil: undefined }),
          logprob: fc.option(
            fc.record({
              logprob: fc.double({ min: -1e6, max: 0, noNaN: true }),
              top: fc
                .array(fc.record({ tokenId: u32, logprob: fc.double({ min: -1e6, max: 0, noNaN: true }) }), {
                  maxLength: Framing.MAX_SAMPLED_TOP
                })
                .map((top) => [...top].sort((a, b) => b.logprob - a.logprob))
            }),
            { nil: undefined }
          )
        })
        .map((p) => ({
          _tag: "Sampled" as const,
          tokenId: p.tokenId,
          eos: p.eos,
          ...(p.draws === undefined ? {} : { draws: p.draws }),
          ...(p.logprob === undefined ? {} : { logprob: p.logprob })
        }))
    )
  })
  .map((f) => TokenFrame(f))
const activationArb = fc
  .record({
    ...ids,
    step: u32,
    chunk: fc
      .integer({ min: 1, max: 5 })
      .chain((count) => fc.record({ count: fc.constant(count), index: fc.integer({ min: 0, max: count - 1 }) })),
    startPos: u32,
    nTokens: fc.integer({ min: 1, max: 4 }),
    hiddenDim: fc.integer({ min: 1, max: 24 }),
    draftSeed: fc.integer({ min: 0, max: 4 })
  })
  .chain((f) =>
    fc.float32Array({ minLength: f.nTokens * f.hiddenDim, maxLength: f.nTokens * f.hiddenDim }).map((payload) =>
      ActivationFrame({
        // a speculative step's frame: up to nTokens - 1 drafted tokens (0: a plain frame, no drafts field)
        ...(f.draftSeed % f.nTokens === 0
          ? {}
          : { drafts: Array.from({ length: f.draftSeed % f.nTokens }, (_, i) => (f.startPos + 977 * i) >>> 0) }),
        runId: f.runId,
        edgeId: f.edgeId,
        step: f.step,
        chunkIndex: f.chunk.index,
        chunkCount: f.chunk.count,
        startPos: f.startPos,
        nTokens: f.nTokens,
        hiddenDim: f.hiddenDim,
        payload
      })
    )
  )
const controlArb = fc.oneof(
  fc.record({ ...ids, step: u32, bytes: u32 }).map((f) => CreditFrame(f)),
  fc
    .record({
      ...ids,
      dataCapacity: u32,
      alignment: u32,
      wakeCoalescing: fc.constantFrom("PendingBit" as const, "EveryFrame" as const),
      sharedMemory: fc.constantFrom("", "/dev/shm/swactor-1-abc.ring")
    })
    .map((f) => AttachFrame(f)),
  fc.record(ids).map((f) => DoorbellFrame(f)),
  fc.record(ids).map((f) => AttachedFrame(f)),
  fc
    .record({ ...ids, reason: fc.string({ maxLength: 20 }), detail: fc.string({ maxLength: 200 }) })
    .map((f) => FaultFrame(f))
)
const frameArb: fc.Arbitrary<WireFrame> = fc.oneof(tokenFrameArb, activationArb, controlArb)

const sameFrame = (a: WireFrame, b: WireFrame) => {
  if (a._tag === "ActivationFrame" && b._tag === "ActivationFrame") {
    const { payload: pa, ...ra } = a
    const { payload: pb, ...rb } = b
    assert.deepStrictEqual({ ...ra }, { ...rb })
    // Compare bit patterns so NaN payloads round-trip too.
    assert.deepStrictEqual(
      new Uint32Array(pa.buffer, pa.byteOffset, pa.length),
      new Uint32Array(pb.buffer, pb.byteOffset, pb.length)
    )
  } else {
    assert.deepStrictEqual({ ...a }, { ...b })
  }
}

describe("Framing", () => {
  // Every frame kind encodes and decodes back to an equal frame, at every alignment.
  it("round-trips arbitrary frames at arbitrary alignments", () => {
    fc.assert(
      fc.property(frameArb, alignmentArb, (frame, alignment) => {
        const { bytes, decoded } = roundTrip(frame, alignment)
        assert.strictEqual(bytes.length % Framing.effectiveAlignment(alignment), 0)
        assert.isTrue(Either.isRight(decoded))
        sameFrame(frame, Either.getOrThrow(decoded))
      }),
      { numRuns: 400, seed: 0x5eed32 }
    )
  })

  // A frame is padded to the ring alignment, and an activation payload starts aligned inside it.
  it("honours the alignment for frame length and payload offset", () => {
    const frame = activation(0, 3, 5)
    for (const alignment of [8, 64, 256]) {
      const bytes = Either.getOrThrow(Framing.encode(frame, alignment))
      assert.strictEqual(bytes.length % alignment, 0)
      const payloadOffset = new DataView(bytes.buffer).getUint32(Framing.HEADER_BYTES + 16, true)
      assert.strictEqual(payloadOffset % alignment, 0)
    }
  })

  // Decoding is total: random bytes give a typed fault (or, vanishingly rarely, a valid frame), never a throw.
  it("decodes random bytes to a typed fault, never a throw", () => {
    fc.assert(
      fc.property(fc.uint8Array({ maxLength: 300 }), alignmentArb, (bytes, alignment) => {
        const result = Framing.decodeUnguarded(bytes, limits(alignment))
        if (Either.isLeft(result)) assert.include(["Malformed", "Truncated", "Oversized"], result.left._tag)
      }),
      { numRuns: 2000, seed: 0x5eed33 }
    )
  })

  // Random bytes behind a valid header still never throw.
  it("decodes a valid header followed by garbage to a typed fault", () => {
    fc.assert(
      fc.property(frameArb, fc.uint8Array({ minLength: 1, maxLength: 200 }), (frame, garbage) => {
        const bytes = Either.getOrThrow(Framing.encode(frame, 8))
        const mixed = new Uint8Array(bytes.length)
        mixed.set(bytes.subarray(0, Framing.HEADER_BYTES))
        mixed.set(garbage.subarray(0, bytes.length - Framing.HEADER_BYTES), Framing.HEADER_BYTES)
        const result = Framing.decodeUnguarded(mixed, limits(8))
        if (Either.isLeft(result)) assert.include(["Malformed", "Truncated", "Oversized"], result.left._tag)
      }),
      { numRuns: 500, seed: 0x5eed34 }
    )
  })

  // Every strict prefix of a valid frame is Truncated.
  it("reports every truncation of a valid frame as Truncated", () => {
    fc.assert(
      fc.property(frameArb, alignmentArb, (frame, alignment) => {
        const bytes = Either.getOrThrow(Framing.encode(frame, alignment))
        for (let cut = 0; cut < bytes.length; cut += Math.max(1, Math.floor(bytes.length / 17))) {
          const result = Framing.decodeUnguarded(bytes.subarray(0, cut), limits(alignment))
          assert.isTrue(Either.isLeft(result))
          if (Either.isLeft(result)) assert.include(["Truncated", "Malformed"], result.left._tag)
          if (cut >= 4 && Either.isLeft(result)) assert.strictEqual(result.left._tag, "Truncated")
        }
      }),
      { numRuns: 200, seed: 0x5eed35 }
    )
  })

  // A single flipped byte is a typed fault or a different, still valid frame — never a throw.
  it("turns single-byte mutations into typed faults, never throws", () => {
    fc.assert(
      fc.property(frameArb, fc.nat(), fc.integer({ min: 1, max: 255 }), (frame, at, xor) => {
        const bytes = Either.getOrThrow(Framing.encode(frame, 8)).slice()
        const i = at % bytes.length
        bytes[i] = bytes[i]! ^ xor
        const result = Framing.decodeUnguarded(bytes, limits(8))
        if (Either.isLeft(result)) assert.include(["Malformed", "Truncated", "Oversized"], result.left._tag)
        // Magic, version, flags and lengths must never slip through. A changed type byte may name
        // another frame kind whose body is the same (Attached ↔ Doorbell, both empty): never the same kind.
        if (i < 16 && i !== 5 && Either.isRight(result)) assert.fail(`mutation of header byte ${i} decoded`)
        if (i === 5 && Either.isRight(result)) assert.notStrictEqual(result.right._tag, frame._tag)
      }),
      { numRuns: 2000, seed: 0x5eed36 }
    )
  })

  it("refuses a frame whose announced length exceeds the limit before its body arrives", () => {
    const bytes = Either.getOrThrow(Framing.encode(activation(0, 64, 64), 8))
    const result = Framing.decode(bytes.subarray(0, Framing.HEADER_BYTES), { alignment: 8, maxFrameBytes: 4096 })
    assert.isTrue(Either.isLeft(result) && result.left._tag === "Oversized")
  })

  // The fuzz tests above run the decoder without its exception guard, so a throw fails them. This shows they would:
  // the guarded decoder turns a throw into Malformed, the unguarded one lets it through.
  it("the fuzz tests see a decoder throw instead of a Malformed fault", () => {
    const bytes = Either.getOrThrow(Framing.encode(AttachedFrame({ runId, edgeId }), 8))
    const throwing = {
      alignment: 8,
      get maxFrameBytes(): number {
        throw new Error("boom")
      }
    }
    const guarded = Framing.decode(bytes, throwing)
    assert.isTrue(Either.isLeft(guarded) && guarded.left._tag === "Malformed")
    assert.throws(() => Framing.decodeUnguarded(bytes, throwing), "boom")
  })

  // G: frameLength must be exactly the header plus the body rounded up to the alignment. A frame announcing one
  // more aligned block of (zero) padding than its body needs, or a body that does not fit its frame, is Malformed
  // at the header, before its body is read.
  it("refuses a frame length that does not match the body length", () => {
    const bytes = Either.getOrThrow(Framing.encode(AttachedFrame({ runId, edgeId }), 8))
    const setU32 = (b: Uint8Array, at: number, v: number) => new DataView(b.buffer, b.byteOffset).setUint32(at, v, true)
    // One spare 8-byte block of zero padding: everything else about the frame is valid.
    const padded = new Uint8Array(bytes.length + 8)
    padded.set(bytes)
    setU32(padded, 8, padded.length)
    const tooLong = Framing.decodeUnguarded(padded, limits(8))
    assert.isTrue(Either.isLeft(tooLong) && tooLong.left._tag === "Malformed")
    if (Either.isLeft(tooLong) && tooLong.left._tag === "Malformed") {
      assert.include(tooLong.left.detail, "does not match body length")
    }
    // A body length the frame cannot hold, found from the first 16 bytes alone.
    const longBody = bytes.slice()
    setU32(longBody, 12, 8)
    const step = Framing.decodeAt(longBody.subarray(0, 16), 0, limits(8))
    assert.isTrue(step._tag === "Fault" && step.fault._tag === "Malformed")
    // A body length that still rounds up to the same frame length is caught by the body's own lengths.
    const credit = Either.getOrThrow(Framing.encode(CreditFrame({ runId, edgeId, step: 1, bytes: 64 }), 64))
    const shorter = credit.slice()
    setU32(shorter, 12, 7)
    const short = Framing.decodeUnguarded(shorter, limits(64))
    assert.isTrue(Either.isLeft(short) && short.left._tag === "Malformed")
  })

  it("refuses a frame not padded to the edge's alignment", () => {
    const bytes = Either.getOrThrow(Framing.encode(activation(0, 1, 3), 8))
    const result = Framing.decode(bytes, limits(64))
    assert.isTrue(Either.isLeft(result) && result.left._tag === "Malformed")
  })

  it("refuses trailing bytes after a whole frame", () => {
    const bytes = Either.getOrThrow(Framing.encode(AttachedFrame({ runId, edgeId }), 8))
    const result = Framing.decode(new Uint8Array([...bytes, 0]), limits(8))
    assert.isTrue(Either.isLeft(result) && result.left._tag === "Malformed")
  })

  // A Sampled body's extension is strict: flags only on Sampled, nTop only with a log-prob and at most 20, log-probs
  // ≤ 0 and not NaN, the alternatives most likely first, the body length exactly what the flags announce.
  it("decodes a Sampled token's draws and log-probs strictly", () => {
    const sampled = TokenFrame({
      runId,
      edgeId,
      step: 4,
      payload: {
        _tag: "Sampled",
        tokenId: 9,
        eos: false,
        draws: 12,
        logprob: {
          logprob: -0.5,
          top: [
            { tokenId: 9, logprob: -0.5 },
            { tokenId: 3, logprob: -1.25 }
          ]
        }
      }
    })
    const bytes = Either.getOrThrow(Framing.encode(sampled, 8))
    sameFrame(sampled, Either.getOrThrow(Framing.decodeUnguarded(bytes, limits(8))))
    const o = Framing.HEADER_BYTES
    const mutated = (edit: (view: DataView) => void) => {
      const copy = bytes.slice()
      edit(new DataView(copy.buffer))
      const result = Framing.decodeUnguarded(copy, limits(8))
      return Either.isLeft(result) ? result.left._tag : "decoded"
    }
    assert.strictEqual(
      mutated((v) => v.setUint8(o + 1, 8)),
      "Malformed"
    ) // unknown flag
    assert.strictEqual(
      mutated((v) => v.setUint8(o + 1, 2)),
      "Malformed"
    ) // no log-prob flag, body still has it
    assert.strictEqual(
      mutated((v) => v.setUint16(o + 2, 3, true)),
      "Malformed"
    ) // nTop beyond the body
    assert.strictEqual(
      mutated((v) => v.setFloat64(o + 16, 0.5, true)),
      "Malformed"
    ) // a log-prob above 0
    assert.strictEqual(
      mutated((v) => v.setFloat64(o + 16, NaN, true)),
      "Malformed"
    )
    assert.strictEqual(
      mutated((v) => v.setFloat64(o + 24 + 4, -2, true)),
      "Malformed"
    ) // not most likely first
    assert.strictEqual(
      mutated((v) => v.setUint8(o, 1)),
      "Malformed"
    ) // flags on a Decode
    const tooMany = {
      ...sampled,
      payload: {
        ...sampled.payload,
        logprob: { logprob: -1, top: Array.from({ length: 21 }, (_, i) => ({ tokenId: i, logprob: -1 })) }
      }
    }
    assert.isTrue(Either.isLeft(Framing.encode(tooMany as TokenFrame, 8)))
  })

  it("decodes a speculative step's drafted tokens strictly", () => {
    const frame = ActivationFrame({ ...activation(5, 3, 4, 20), drafts: [7, 0xffff_fffe] })
    const bytes = Either.getOrThrow(Framing.encode(frame, 64))
    const back = Either.getOrThrow(Framing.decodeUnguarded(bytes, limits(64)))
    sameFrame(frame, back)
    assert.deepStrictEqual(back._tag === "ActivationFrame" ? back.drafts : undefined, [7, 0xffff_fffe])
    const mutated = (edit: (view: DataView) => void) => {
      const copy = bytes.slice()
      edit(new DataView(copy.buffer))
      const result = Framing.decodeUnguarded(copy, limits(64))
      return Either.isLeft(result) ? result.left._tag : "decoded"
    }
    const o = Framing.HEADER_BYTES
    // one draft more or fewer than the body holds; as many drafts as rows (no row left for the step's token)
    assert.strictEqual(
      mutated((v) => v.setUint8(o + 1, 3)),
      "Malformed"
    )
    assert.strictEqual(
      mutated((v) => v.setUint8(o + 1, 1)),
      "Malformed"
    )
    const full = Either.getOrThrow(Framing.encode(ActivationFrame({ ...activation(5, 2, 4), drafts: [1] }), 64))
    new DataView(full.buffer).setUint8(o + 1, 2)
    assert.isTrue(Either.isLeft(Framing.decodeUnguarded(full, limits(64))))
    // never chunked, never more than 255
    assert.isTrue(Either.isLeft(Framing.chunk(frame, 64, 64)))
    const many = ActivationFrame({ ...activation(5, 300, 1), drafts: Array.from({ length: 256 }, (_, i) => i) })
    assert.isTrue(Either.isLeft(Framing.encode(many, 64)))
  })

  it("refuses to encode fields that do not fit the wire format", () => {
    const tooBig = TokenFrame({ runId, edgeId, step: 0, payload: { _tag: "Decode", tokenId: 1 } })
    const result = Framing.encode({ ...tooBig, runId: (2 ** 33) as RunId } as TokenFrame, 8)
    assert.isTrue(Either.isLeft(result) && result.left._tag === "Malformed")
  })

  // The stream decoder yields the same frames whatever the chunk boundaries of the byte stream.
  it("decodes a stream split at arbitrary points", () => {
    fc.assert(
      fc.property(
        fc.array(frameArb, { minLength: 1, maxLength: 8 }),
        fc.array(fc.nat(), { maxLength: 10 }),
        (frames, cuts) => {
          const encoded = frames.map((f) => Either.getOrThrow(Framing.encode(f, 64)))
          const all = new Uint8Array(encoded.reduce((n, b) => n + b.length, 0))
          let at = 0
          for (const b of encoded) {
            all.set(b, at)
            at += b.length
          }
          const points = [...new Set(cuts.map((c) => c % (all.length + 1)))].sort((a, b) => a - b)
          const decoder = new Framing.StreamDecoder()
          const out: Array<WireFrame> = []
          let prev = 0
          for (const p of [...points, all.length]) {
            decoder.push(all.slice(prev, p))
            prev = p
            for (;;) {
              const step = decoder.next(limits(64))
              if (step._tag === "Fault") assert.fail(step.fault._tag)
              if (step._tag === "NeedMore") break
              out.push(step.frame)
            }
          }
          assert.strictEqual(out.length, frames.length)
          frames.forEach((f, i) => sameFrame(f, out[i]!))
          assert.isUndefined(decoder.finish())
        }
      ),
      { numRuns: 200, seed: 0x5eed37 }
    )
  })

  // A message larger than the window is split into chunks that fit, and the sequencer joins them back.
  it("chunks a large activation to fit the window and reassembles it", () => {
    const frame = activation(0, 37, 100, 5)
    const chunks = Either.getOrThrow(Framing.chunk(frame, 4096, 64))
    assert.isAbove(chunks.length, 1)
    for (const c of chunks) assert.isAtMost(Framing.encodedLength(c, 64), 4096)
    const sequencer = new Sequencer()
    let whole: DataFrame | undefined
    for (const c of chunks) {
      const step = sequencer.accept(
        Either.getOrThrow(Framing.decode(Framing.unsafeEncode(c, 64), limits(64))) as DataFrame
      )
      if (step._tag === "Fault") assert.fail(step.fault._tag)
      if (step._tag === "Complete") whole = step.frame
    }
    assert.isDefined(whole)
    sameFrame(whole!, frame)
  })

  it("chunks a long prompt and reassembles it", () => {
    const tokens = Array.from({ length: 5000 }, (_, i) => i)
    const frame = TokenFrame({ runId, edgeId, step: 0, payload: { _tag: "Prompt", tokens } })
    const chunks = Either.getOrThrow(Framing.chunk(frame, 1024, 8))
    assert.isAbove(chunks.length, 1)
    const sequencer = new Sequencer()
    const steps = chunks.map((c) => sequencer.accept(c))
    const last = steps[steps.length - 1]!
    assert.strictEqual(last._tag, "Complete")
    if (last._tag === "Complete") sameFrame(last.frame, frame)
  })

  it("refuses to chunk a single token row wider than the window", () => {
    const result = Framing.chunk(activation(0, 2, 2048), 4096, 8)
    assert.isTrue(Either.isLeft(result) && result.left._tag === "Oversized")
  })

  it("faults a skipped step number or chunk as OutOfOrder", () => {
    const sequencer = new Sequencer()
    assert.strictEqual(sequencer.accept(activation(0, 1, 2))._tag, "Complete")
    const skipped = sequencer.accept(activation(2, 1, 2))
    assert.isTrue(skipped._tag === "Fault" && skipped.fault._tag === "OutOfOrder")
    const chunked = new Sequencer()
    const c1 = ActivationFrame({ ...activation(0, 1, 2), chunkIndex: 1, chunkCount: 2 })
    const step = chunked.accept(c1)
    assert.isTrue(step._tag === "Fault" && step.fault._tag === "OutOfOrder")
  })
})

describe("dataFrame", () => {
  // Frames are built only through the domain's builders: `dataFrame` picks the builder by `_tag` and fills defaults.
  it("builds either kind through its builder, with the chunk fields and dtype defaulted", () => {
    const payload = Float32Array.of(1, 2, 3, 4)
    assert.deepStrictEqual(
      dataFrame({ _tag: "ActivationFrame", runId, edgeId, step: 4, startPos: 2, nTokens: 2, hiddenDim: 2, payload }),
      ActivationFrame({ runId, edgeId, step: 4, startPos: 2, nTokens: 2, hiddenDim: 2, payload })
    )
    const token = dataFrame({ _tag: "TokenFrame", runId, edgeId, step: 1, payload: { _tag: "Decode", tokenId: 9 } })
    assert.deepStrictEqual(token, {
      _tag: "TokenFrame",
      runId,
      edgeId,
      step: 1,
      chunkIndex: 0,
      chunkCount: 1,
      payload: { _tag: "Decode", tokenId: 9 }
    })
    // Only the frame's own fields: nothing extra a caller passed rides along onto the wire value.
    const extra = {
      _tag: "TokenFrame" as const,
      runId,
      edgeId,
      step: 1,
      payload: { _tag: "Decode" as const, tokenId: 9 },
      note: "x"
    }
    assert.notProperty(dataFrame(extra), "note")
  })
})

describe("Framing without extra copies", () => {
  // A frame encoded into a dirty slot (a ring's memory) is byte for byte the frame encoded into fresh zeros.
  it("encodeInto a dirty buffer gives exactly the bytes of unsafeEncode", () => {
    fc.assert(
      fc.property(frameArb, alignmentArb, fc.integer({ min: 1, max: 255 }), (frame, alignment, dirt) => {
        const expected = Framing.unsafeEncode(frame, alignment)
        const slot = new Uint8Array(expected.length).fill(dirt)
        Framing.encodeInto(frame, alignment, slot)
        assert.deepStrictEqual(slot, expected)
      }),
      { numRuns: 300, seed: 0x5eed41 }
    )
  })

  // The stream decoder used on sockets and drained rings hands over activation payloads as views of the pushed
  // bytes (no copy), falling back to a copy when the payload would not be 4-byte aligned in memory.
  it("an aliasing stream decoder returns payload views, and copies when misaligned", () => {
    const frame = activation(0, 2, 6)
    const bytes = Either.getOrThrow(Framing.encode(frame, 64))
    const decoder = new Framing.StreamDecoder(true)
    decoder.push(bytes)
    const step = decoder.next(limits(64))
    assert.isTrue(step._tag === "Frame" && step.frame._tag === "ActivationFrame")
    if (step._tag !== "Frame" || step.frame._tag !== "ActivationFrame") return
    assert.strictEqual(step.frame.payload.buffer, bytes.buffer)
    sameFrame(step.frame, frame)
    // The same bytes one byte into a buffer: the payload is copied, and still equal.
    const shifted = new Uint8Array(bytes.length + 1).subarray(1)
    shifted.set(bytes)
    const copying = new Framing.StreamDecoder(true)
    copying.push(shifted)
    const copied = copying.next(limits(64))
    assert.isTrue(copied._tag === "Frame" && copied.frame._tag === "ActivationFrame")
    if (copied._tag !== "Frame" || copied.frame._tag !== "ActivationFrame") return
    assert.notStrictEqual(copied.frame.payload.buffer, shifted.buffer)
    sameFrame(copied.frame, frame)
    // The default decoder always copies.
    const plain = Either.getOrThrow(Framing.decode(bytes, limits(64)))
    assert.isTrue(plain._tag === "ActivationFrame" && plain.payload.buffer !== bytes.buffer)
  })
})
