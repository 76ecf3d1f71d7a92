// Placement intents over random pools (memory, speed) and models (per-block bytes, stored and read): P1–P6, P-MOE in
// specs/BEHAVIOR_GUARANTEES.md.
import { assert, describe, it } from "@effect/vitest"
import { Either, FastCheck as fc } from "effect"
import { type NodeId, RunId } from "../../src/domain/ids.js"
import type {
  LayerRange,
  ModelLayout,
  PlacementChoice,
  PlannerInput,
  PoolNode,
  RingSpec
} from "../../src/domain/plan.js"
import { choosePlacement, computeReserveBytes, parseLayerSpec, plannerPlacement } from "../../src/services/Placement.js"
import { partitionLayers, planRunEither } from "../../src/services/Planner.js"

const MiB = 2 ** 20
const CONTEXT = 512

const layoutArb = fc
  .integer({ min: 1, max: 12 })
  .chain((numLayers) =>
    fc.record({
      blockBytes: fc.array(
        fc.integer({ min: 1, max: 64 }).map((m) => m * MiB),
        {
          minLength: numLayers,
          maxLength: numLayers
        }
      ),
      // Per block: dense (reads what it stores), or a mixture of experts that reads 1/16 to all of it per token.
      activeShare: fc.array(
        fc.oneof(
          fc.constant(1),
          fc.integer({ min: 1, max: 16 }).map((k) => k / 16)
        ),
        {
          minLength: numLayers,
          maxLength: numLayers
        }
      ),
      kvBytesPerToken: fc.array(fc.constantFrom(1024, 4096, 16384), { minLength: numLayers, maxLength: numLayers }),
      inputBytes: fc.integer({ min: 0, max: 64 }).map((m) => m * MiB),
      outputBytes: fc.integer({ min: 0, max: 64 }).map((m) => m * MiB),
      hiddenDim: fc.constantFrom(64, 256, 2048)
    })
  )
  .map(({ activeShare, ...layout }): ModelLayout => ({
    ...layout,
    activeBlockBytes: layout.blockBytes.map((bytes, i) => bytes * activeShare[i]!)
  }))

// Free memory from "holds nothing" to "holds a whole model"; speeds over two orders of magnitude.
const poolArb = fc
  .array(
    fc.record({
      freeMemoryBytes: fc.integer({ min: 0, max: 1200 }).map((m) => m * MiB),
      speedBytesPerSecond: fc.integer({ min: 1, max: 100 }).map((g) => g * 1e8)
    }),
    { minLength: 1, maxLength: 5 }
  )
  .map((nodes) => nodes.map((n, i): PoolNode => ({ ...n, nodeId: (i + 1) as NodeId })))

const options = { contextTokens: CONTEXT }

const memoryOf = (layout: ModelLayout, start: number, end: number) => {
  let bytes = computeReserveBytes(layout, CONTEXT)
  for (let i = start; i < end; i++) bytes += layout.blockBytes[i]! + layout.kvBytesPerToken[i]! * CONTEXT
  if (start === 0) bytes += layout.inputBytes
  if (end === layout.blockBytes.length) bytes += layout.outputBytes
  return bytes
}

const assertWithinMemory = (layout: ModelLayout, pool: ReadonlyArray<PoolNode>, choice: PlacementChoice) => {
  for (const node of pool) {
    const used = choice.stages
      .filter((s) => s.nodeId === node.nodeId)
      .reduce((sum, s) => sum + memoryOf(layout, s.layerStart, s.layerEndExclusive), 0)
    assert.isAtMost(used, node.freeMemoryBytes, `node ${node.nodeId}`)
  }
}

const assertContiguousComplete = (numLayers: number, choice: PlacementChoice) => {
  let next = 0
  choice.stages.forEach((s, i) => {
    assert.strictEqual(s.stageIndex, i)
    assert.strictEqual(s.layerStart, next)
    assert.isAbove(s.layerEndExclusive, s.layerStart)
    next = s.layerEndExclusive
  })
  assert.strictEqual(next, numLayers)
}

const ring = (dataCapacity: number, alignment: number): RingSpec => ({
  dataCapacity,
  alignment,
  direction: "Egress",
  hostPinning: "Pageable",
  wakeCoalescing: "PendingBit"
})

const plannerInput = (numLayers: number, pool: ReadonlyArray<PoolNode>, choice: PlacementChoice): PlannerInput => ({
  runId: RunId.make(1),
  orchestratorNodeId: 0 as NodeId,
  model: {
    modelId: "m",
    ggufSource: { _tag: "LocalPath", path: "/m.gguf" },
    numLayers,
    hiddenDim: 64,
    dtypeFamily: "Float",
    dtypeWidthBytes: 4,
    maxSeqLen: 2048,
    eosTokenId: 2,
    tokenizer: { _tag: "EmbeddedInGguf" }
  },
  runtime: { maxTokens: 8, sampling: { temperatureMillis: 0, topK: 1 } },
  candidatePool: pool.map((n) => n.nodeId),
  ...plannerPlacement(choice),
  activationRing: ring(1 << 16, 64),
  tokenRing: ring(4096, 8)
})

// Every contiguous split of every subset of the pool (in pool order), by brute force: the reference for small cases.
// Time is what a token reads (active bytes: a MoE block's routed experts), memory what is stored.
const bruteForceBest = (layout: ModelLayout, pool: ReadonlyArray<PoolNode>): number | undefined => {
  const n = layout.blockBytes.length
  const millis = (node: PoolNode, start: number, end: number) => {
    let read = 0
    for (let i = start; i < end; i++) read += (layout.activeBlockBytes ?? layout.blockBytes)[i]!
    if (end === n) read += layout.outputBytes
    return (read / node.speedBytesPerSecond) * 1000 + 0.1
  }
  let best: number | undefined
  const go = (nodes: ReadonlyArray<PoolNode>, start: number, worst: number) => {
    if (start === n) {
      best = best === undefined ? worst : Math.min(best, worst)
      return
    }
    if (nodes.length === 0) return
    const [node, ...rest] = nodes
    // Either node is left out, or it takes [start, end).
    go(rest, start, worst)
    for (let end = start + 1; end <= n; end++) {
      if (memoryOf(layout, start, end) > node!.freeMemoryBytes) continue
      go(rest, end, Math.max(worst, millis(node!, start, end)))
    }
  }
  go(pool, 0, 0)
  return best
}

const seeded = { numRuns: 400, seed: 0xc1a5 }

describe("capacity placement over random pools (P1–P4)", () => {
  it("P1 never over a node's memory; P2 contiguous, complete and accepted by the planner", () => {
    let placed = 0
    let fewerStagesThanNodes = 0
    fc.assert(
      fc.property(layoutArb, poolArb, (layout, pool) => {
        const result = choosePlacement({ _tag: "Capacity" }, layout, pool, options)
        if (Either.isLeft(result)) return
        placed++
        const choice = result.right
        if (choice.stages.length < Math.min(pool.length, layout.blockBytes.length)) fewerStagesThanNodes++
        assertWithinMemory(layout, pool, choice)
        assertContiguousComplete(layout.blockBytes.length, choice)
        const plan = planRunEither(plannerInput(layout.blockBytes.length, pool, choice))
        assert.isTrue(Either.isRight(plan))
        if (Either.isRight(plan)) {
          assert.deepStrictEqual(
            plan.right.stages.map((s): LayerRange => [s.layerStart, s.layerEndExclusive]),
            choice.stages.map((s): LayerRange => [s.layerStart, s.layerEndExclusive])
          )
        }
      }),
      seeded
    )
    // The generator reaches the interesting states: placements that fit, and ones that leave nodes out.
    assert.isAbove(placed, 100)
    assert.isAbove(fewerStagesThanNodes, 20)
  })

  it("P3 deterministic: the same pool and model give the same choice", () =>
    fc.assert(
      fc.property(layoutArb, poolArb, (layout, pool) => {
        const a = choosePlacement({ _tag: "Capacity" }, layout, pool, options)
        const b = choosePlacement({ _tag: "Capacity" }, structuredClone(layout), structuredClone(pool), options)
        assert.deepStrictEqual(a, b)
      }),
      { ...seeded, numRuns: 100 }
    ))

  it("P4 capacity is never slower than balanced in the cost model, and is the best split of any subset", () => {
    let balancedFits = 0
    let capacityStrictlyFaster = 0
    fc.assert(
      fc.property(layoutArb, poolArb, (layout, pool) => {
        const capacity = choosePlacement({ _tag: "Capacity" }, layout, pool, options)
        const stageCount = Math.min(pool.length, layout.blockBytes.length)
        const balanced = choosePlacement({ _tag: "Balanced", stageCount }, layout, pool, options)
        if (Either.isRight(balanced)) {
          balancedFits++
          assert.isTrue(Either.isRight(capacity), "balanced fits, so capacity must find a placement")
          if (Either.isRight(capacity)) {
            assert.isAtMost(capacity.right.bottleneckMillis, balanced.right.bottleneckMillis)
            if (capacity.right.bottleneckMillis < balanced.right.bottleneckMillis) capacityStrictlyFaster++
          }
        }
        const reference = bruteForceBest(layout, pool)
        if (reference === undefined) assert.isTrue(Either.isLeft(capacity))
        else if (Either.isRight(capacity)) assert.closeTo(capacity.right.bottleneckMillis, reference, 1e-9)
        else assert.fail("a split fits but capacity refused")
      }),
      seeded
    )
    assert.isAbove(balancedFits, 50)
    assert.isAbove(capacityStrictlyFaster, 20)
  })
})

describe("typed rejections (P5)", () => {
  const layout: ModelLayout = {
    blockBytes: [100 * MiB, 100 * MiB, 100 * MiB, 100 * MiB],
    kvBytesPerToken: [4096, 4096, 4096, 4096],
    inputBytes: 10 * MiB,
    outputBytes: 10 * MiB,
    hiddenDim: 256
  }
  const node = (id: number, freeMiB: number, speed = 1e9): PoolNode => ({
    nodeId: id as NodeId,
    freeMemoryBytes: freeMiB * MiB,
    speedBytesPerSecond: speed
  })

  it("a pool that cannot hold the model is refused with the numbers", () => {
    const result = choosePlacement({ _tag: "Capacity" }, layout, [node(1, 150), node(2, 150)], options)
    assert.isTrue(Either.isLeft(result))
    if (Either.isLeft(result)) {
      assert.strictEqual(result.left._tag, "PoolMemoryTooSmall")
      assert.match(result.left.message, /does not fit in the pool's memory: it needs about 4\d\d\.\d MiB/)
      assert.match(result.left.message, /2 node\(s\) have 300\.0 MiB free \(largest 150\.0 MiB\)/)
    }
  })

  it("a balanced or fixed split over a node's memory is refused naming the node", () => {
    const pool = [node(1, 1000), node(2, 200)]
    const balanced = choosePlacement({ _tag: "Balanced", stageCount: 2 }, layout, pool, options)
    assert.deepStrictEqual(Either.isLeft(balanced) && balanced.left._tag, "StageOverMemory")
    if (Either.isLeft(balanced) && balanced.left._tag === "StageOverMemory") {
      assert.strictEqual(balanced.left.nodeId, 2)
      assert.deepStrictEqual(balanced.left.stageIndices, [1])
    }
    // The same pool with capacity: the small node takes one block.
    const capacity = choosePlacement({ _tag: "Capacity" }, layout, pool, options)
    assert.deepStrictEqual(
      Either.map(capacity, (c) => c.stages.map((s) => [s.nodeId, s.layerStart, s.layerEndExclusive])),
      Either.right([
        [1, 0, 3],
        [2, 3, 4]
      ])
    )
  })

  it("fixed ranges that are not contiguous and complete are refused", () => {
    const pool = [node(1, 1000), node(2, 1000)]
    for (const [ranges, reason] of [
      [
        [
          [0, 2],
          [3, 4]
        ],
        "blocks 2..2 are in no range"
      ],
      [
        [
          [0, 3],
          [2, 4]
        ],
        "block 2 is in two ranges"
      ],
      [
        [
          [0, 2],
          [2, 3]
        ],
        "blocks 3..3 are in no range"
      ],
      [
        [
          [0, 2],
          [2, 6]
        ],
        "the ranges end at block 5 but the model has 4 blocks"
      ]
    ] as const) {
      const result = choosePlacement({ _tag: "Fixed", ranges }, layout, pool, options)
      assert.deepStrictEqual(Either.isLeft(result) && result.left._tag, "InvalidLayerRanges")
      if (Either.isLeft(result)) assert.include(result.left.message, reason)
    }
    const fixed = choosePlacement(
      {
        _tag: "Fixed",
        ranges: [
          [0, 1],
          [1, 4]
        ]
      },
      layout,
      pool,
      options
    )
    assert.deepStrictEqual(
      Either.map(fixed, (c) => c.stages.map((s) => [s.nodeId, s.layerStart, s.layerEndExclusive])),
      Either.right([
        [1, 0, 1],
        [2, 1, 4]
      ])
    )
  })

  it("--layers text parses inclusive ranges and refuses anything else", () => {
    assert.deepStrictEqual(
      parseLayerSpec("0-9,10-15"),
      Either.right([
        [0, 10],
        [10, 16]
      ])
    )
    assert.deepStrictEqual(
      parseLayerSpec("0-2, 3 ,4-4"),
      Either.right([
        [0, 3],
        [3, 4],
        [4, 5]
      ])
    )
    for (const text of ["", "0-", "a-3", "5-2", "0-3;4-5", "-1-2"]) {
      const parsed = parseLayerSpec(text)
      assert.isTrue(Either.isLeft(parsed), text)
      if (Either.isLeft(parsed)) assert.include(parsed.left.message, "expected ranges like 0-9,10-15")
    }
  })
})

describe("capacity follows speed (P6)", () => {
  it("blocks go in proportion to speed, and a node too slow for even one block is left out", () => {
    const layout: ModelLayout = {
      blockBytes: Array(12).fill(10 * MiB),
      kvBytesPerToken: Array(12).fill(1024),
      inputBytes: 0,
      outputBytes: 0,
      hiddenDim: 64
    }
    const node = (id: number, speed: number): PoolNode => ({
      nodeId: id as NodeId,
      freeMemoryBytes: 10_000 * MiB,
      speedBytesPerSecond: speed
    })
    const split = (pool: ReadonlyArray<PoolNode>) =>
      Either.map(choosePlacement({ _tag: "Capacity" }, layout, pool, options), (c) =>
        c.stages.map((s) => [s.nodeId, s.layerEndExclusive - s.layerStart])
      )
    assert.deepStrictEqual(
      split([node(1, 2e9), node(2, 1e9)]),
      Either.right([
        [1, 8],
        [2, 4]
      ])
    )
    assert.deepStrictEqual(
      split([node(1, 1e9), node(2, 1e9), node(3, 1e9)]),
      Either.right([
        [1, 4],
        [2, 4],
        [3, 4]
      ])
    )
    // Node 3 would take 10 MiB at 1 MB/s = 10 s per token: it is left out.
    assert.deepStrictEqual(
      split([node(1, 1e9), node(2, 1e9), node(3, 1e6)]),
      Either.right([
        [1, 6],
        [2, 6]
      ])
    )
    assert.deepStrictEqual(partitionLayers(12, 3), [
      [0, 4],
      [4, 8],
      [8, 12]
    ])
  })
})

describe("mixtures of experts: memory by stored bytes, speed by active bytes (P-MOE)", () => {
  // Blocks 0-1 dense (10 MiB, all read per token); blocks 2-3 a mixture of experts: 100 MiB stored, 10 MiB read
  // per token (the routed experts).
  const moe: ModelLayout = {
    blockBytes: [10 * MiB, 10 * MiB, 100 * MiB, 100 * MiB],
    activeBlockBytes: [10 * MiB, 10 * MiB, 10 * MiB, 10 * MiB],
    kvBytesPerToken: [4096, 4096, 4096, 4096],
    inputBytes: 0,
    outputBytes: 0,
    hiddenDim: 64
  }
  const node = (id: number, freeMiB: number, speed = 1e9): PoolNode => ({
    nodeId: id as NodeId,
    freeMemoryBytes: freeMiB * MiB,
    speedBytesPerSecond: speed
  })
  const ranges = (choice: Either.Either<PlacementChoice, unknown>) =>
    Either.map(choice, (c) => c.stages.map((s) => [s.nodeId, s.layerStart, s.layerEndExclusive]))

  it("equal nodes with room for everything split by active bytes: 2 + 2 blocks, the boundary between dense and MoE", () => {
    const choice = choosePlacement({ _tag: "Capacity" }, moe, [node(1, 10_000), node(2, 10_000)], options)
    // Stored bytes as the speed cost would put blocks 0-2 (120 MiB) against block 3 (100 MiB).
    assert.deepStrictEqual(
      ranges(choice),
      Either.right([
        [1, 0, 2],
        [2, 2, 4]
      ])
    )
    if (Either.isRight(choice)) {
      const [first, second] = choice.right.stages
      assert.strictEqual(first!.weightBytes, 20 * MiB)
      assert.strictEqual(first!.activeBytes, 20 * MiB)
      assert.strictEqual(second!.weightBytes, 200 * MiB)
      assert.strictEqual(second!.activeBytes, 20 * MiB)
      // 20 MiB read at 1 GB/s + one hop, on both stages.
      const ms = ((20 * MiB) / 1e9) * 1000 + 0.1
      assert.closeTo(first!.expectedMillis, ms, 1e-9)
      assert.closeTo(second!.expectedMillis, ms, 1e-9)
      // Memory counts every stored expert byte.
      assert.strictEqual(second!.memoryBytes, 200 * MiB + 2 * 4096 * CONTEXT + computeReserveBytes(moe, CONTEXT))
    }
  })

  it("a fast node that cannot hold a MoE block's stored bytes gets the dense blocks only: memory decides", () => {
    // Node 1 is 3x faster (by active bytes it would take blocks [0, 3): 30 MiB at 3 GB/s against 10 MiB at 1 GB/s)
    // but holds 50 MiB of weights: both dense blocks, not one MoE block (100 MiB stored).
    const small = 50 + (computeReserveBytes(moe, CONTEXT) + 3 * 4096 * CONTEXT) / MiB
    const roomy = choosePlacement({ _tag: "Capacity" }, moe, [node(1, 10_000, 3e9), node(2, 10_000)], options)
    assert.deepStrictEqual(
      ranges(roomy),
      Either.right([
        [1, 0, 3],
        [2, 3, 4]
      ])
    )
    const choice = choosePlacement({ _tag: "Capacity" }, moe, [node(1, small, 3e9), node(2, 10_000)], options)
    assert.deepStrictEqual(
      ranges(choice),
      Either.right([
        [1, 0, 2],
        [2, 2, 4]
      ])
    )
    // A balanced split that gives the small node the MoE half is refused naming it.
    const balanced = choosePlacement(
      { _tag: "Balanced", stageCount: 2 },
      moe,
      [node(2, 10_000), node(1, small)],
      options
    )
    assert.deepStrictEqual(Either.isLeft(balanced) && balanced.left._tag, "StageOverMemory")
  })

  it("speed follows active bytes: a fast node takes more MoE blocks than their stored bytes would allow", () => {
    const layout: ModelLayout = {
      blockBytes: Array(8).fill(80 * MiB),
      activeBlockBytes: Array(8).fill(10 * MiB),
      kvBytesPerToken: Array(8).fill(1024),
      inputBytes: 0,
      outputBytes: 0,
      hiddenDim: 64
    }
    const split = (pool: ReadonlyArray<PoolNode>) =>
      Either.map(choosePlacement({ _tag: "Capacity" }, layout, pool, options), (c) => ({
        blocks: c.stages.map((s) => s.layerEndExclusive - s.layerStart),
        bottleneck: c.bottleneckMillis
      }))
    // Speeds 3:1 give 6 + 2 blocks; the bottleneck is 60 MiB read at 3 GB/s (not 480 MiB stored).
    const result = split([node(1, 10_000, 3e9), node(2, 10_000, 1e9)])
    assert.deepStrictEqual(
      Either.map(result, (r) => r.blocks),
      Either.right([6, 2])
    )
    assert.closeTo(Either.getOrThrow(result).bottleneck, ((60 * MiB) / 3e9) * 1000 + 0.1, 1e-9)
    // Layouts whose active and stored lengths differ are refused.
    const bad = choosePlacement({ _tag: "Capacity" }, { ...layout, activeBlockBytes: [1] }, [node(1, 10_000)], options)
    assert.deepStrictEqual(Either.isLeft(bad) && bad.left._tag, "InvalidPlacement")
  })
})
