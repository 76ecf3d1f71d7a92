/**
 * The rule of a GPU stage's split between device and host memory (services/DeviceFit.ts), as llama.cpp's `-ngl`: the
 * last blocks on the device with the head, the input tables only when every block is; nothing past the budget.
 */
import { assert, describe, it } from "@effect/vitest"
import { FastCheck as fc } from "effect"
import { computeEstimate, deviceShare, type StageBytes } from "../../src/services/DeviceFit.js"

const stage = (blocks: ReadonlyArray<readonly [number, number]>, extra: Partial<StageBytes> = {}): StageBytes => ({
  blocks: blocks.map(([weightBytes, cacheBytes]) => ({ weightBytes, cacheBytes })),
  inputBytes: 100,
  headBytes: 50,
  computeBytes: 20,
  ...extra
})

describe("deviceShare", () => {
  const four = stage([
    [10, 1],
    [20, 2],
    [30, 3],
    [40, 4]
  ])

  it("everything fits: every block, the input table and the head on the device, nothing on the host", () => {
    assert.deepStrictEqual(deviceShare(four, 280), {
      blocks: 4,
      weightBytes: 250,
      cacheBytes: 10,
      computeBytes: 20,
      hostBytes: 0
    })
  })

  it("a smaller budget keeps the last blocks that fit with the head and the compute room; the input stays behind", () => {
    // head 50 + compute 20 + block 3 (44) + block 2 (33) = 147; block 1 (22) would make 169
    assert.deepStrictEqual(deviceShare(four, 150), {
      blocks: 2,
      weightBytes: 50 + 40 + 30,
      cacheBytes: 7,
      computeBytes: 20,
      hostBytes: 100 + 11 + 22
    })
  })

  it("no block fits: the stage is all host memory, nothing kept on the device", () => {
    assert.deepStrictEqual(deviceShare(four, 100), {
      blocks: 0,
      weightBytes: 0,
      cacheBytes: 0,
      computeBytes: 0,
      hostBytes: 260
    })
    assert.strictEqual(deviceShare(four, 0).blocks, 0)
  })

  it("weights the device does not compute are host memory wherever their block is", () => {
    const share = deviceShare({ ...four, pinnedHostBytes: 500 }, 1000)
    assert.strictEqual(share.blocks, 4)
    assert.strictEqual(share.hostBytes, 500)
  })

  const arbitraryStage = fc.record({
    blocks: fc.array(fc.tuple(fc.nat(1000), fc.nat(300)), { minLength: 1, maxLength: 12 }),
    input: fc.nat(500),
    head: fc.nat(500),
    compute: fc.nat(200),
    budget: fc.nat(10_000)
  })
  const seeded = { numRuns: 400, seed: 0x9e1 }

  it("never more on the device than the budget, bytes conserved, more budget never fewer blocks", () => {
    let partial = 0
    let none = 0
    let all = 0
    fc.assert(
      fc.property(arbitraryStage, ({ blocks, budget, compute, head, input }) => {
        const s = stage(blocks, { inputBytes: input, headBytes: head, computeBytes: compute })
        const share = deviceShare(s, budget)
        const total = blocks.reduce((sum, [w, c]) => sum + w + c, 0) + input + head
        if (share.blocks > 0) assert.isAtMost(share.weightBytes + share.cacheBytes + share.computeBytes, budget)
        assert.strictEqual(share.weightBytes + share.cacheBytes + share.hostBytes, total)
        assert.isAtLeast(deviceShare(s, budget + 1 + (budget >> 1)).blocks, share.blocks)
        if (share.blocks === 0) none++
        else if (share.blocks === blocks.length) all++
        else partial++
      }),
      seeded
    )
    // the generator reaches each kind of split the property is about
    assert.isAbove(partial, 20, "partial splits")
    assert.isAbove(none, 20, "stages left on the CPU")
    assert.isAbove(all, 20, "whole stages on the device")
  })
})

describe("computeEstimate", () => {
  it("grows with the hidden width and the context, from a prompt chunk of 512 rows", () => {
    assert.strictEqual(computeEstimate(64, 1024), 512 * (32 * 64 + 2 * 1024))
    assert.isAbove(computeEstimate(128, 1024), computeEstimate(64, 1024))
    assert.isAbove(computeEstimate(64, 2048), computeEstimate(64, 1024))
  })
})
