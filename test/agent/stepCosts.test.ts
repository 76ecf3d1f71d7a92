/** services/StepCosts.ts: the step cost table and the decode micro-batch size chosen from it. */
import { describe, expect, it } from "vitest"
import { makeRng } from "../../src/services/Sampler.js"
import { chooseDecodeGroup, makeStepCosts, partsOf, roundMillis } from "../../src/services/StepCosts.js"

/** Measured on the 16×2048 Q8_0 model's 8-block stage at 1 thread (bench/README.md). */
const MEASURED: Record<number, number> = { 1: 70, 2: 74, 3: 149, 4: 115, 5: 180, 6: 130, 8: 164 }
const table = (costs: Record<number, number>) => {
  const t = makeStepCosts()
  for (const [rows, millis] of Object.entries(costs)) t.observe(Number(rows), millis)
  return t
}

describe("step costs", () => {
  it("estimates: measured sizes as measured, sizes between them interpolated, none beyond", () => {
    const t = table(MEASURED)
    expect(t.estimate(4)).toBe(115)
    expect(t.estimate(7)).toBe((130 + 164) / 2)
    expect(t.estimate(9)).toBeUndefined()
    expect(t.entries().map((e) => e.rows)).toEqual([1, 2, 3, 4, 5, 6, 8])
  })

  it("one slow step does not move an estimate; a lasting change does", () => {
    const t = table({ 2: 74 })
    for (let i = 0; i < 3; i++) t.observe(2, 74)
    t.observe(2, 900)
    expect(t.estimate(2)).toBe(74)
    for (let i = 0; i < 5; i++) t.observe(2, 200)
    expect(t.estimate(2)).toBe(200)
  })

  // StageBatcher keeps its last choice while L, S and this revision hold: it must move exactly when an estimate does.
  it("revision grows when an estimate changes, and only then", () => {
    const t = table({ 2: 74 })
    const first = t.revision()
    for (let i = 0; i < 4; i++) t.observe(2, 74)
    t.observe(2, 900) // one slow step: the lower median stays 74
    expect(t.revision()).toBe(first)
    t.observe(3, 149)
    expect(t.revision()).toBe(first + 1)
    for (let i = 0; i < 5; i++) t.observe(2, 200)
    expect(t.estimate(2)).toBe(200)
    expect(t.revision()).toBe(first + 2)
    t.observe(0, 5) // refused observations change nothing
    expect(t.revision()).toBe(first + 2)
  })

  it("rounds: max(sum of the parts, stages x the dearest part)", () => {
    expect(partsOf(7, 3)).toEqual([3, 3, 1])
    expect(roundMillis([2, 2, 2], 2, (r) => MEASURED[r]!)).toBe(222)
    expect(roundMillis([4], 2, (r) => MEASURED[r]!)).toBe(230)
  })

  // The measured table: 5 and 6 sequences on 2 stages cut into pairs (ceil would be 3 + 2 and 3 + 3: 149 ms steps);
  // 4 and 8 keep ceil (2 + 2, 4 + 4); 1 stage keeps one micro-batch of all (ceil(L / 1)) unless smaller ones are
  // clearly cheaper in sum (6 rows: 130 against 2 + 2 + 2 = 222: kept).
  for (const [decoders, stages, rows] of [
    [5, 2, 2],
    [6, 2, 2],
    [4, 2, 2],
    [8, 2, 4],
    [6, 1, 6],
    [3, 2, 2],
    [1, 4, 1]
  ] as const) {
    it(`measured costs: ${decoders} sequences on ${stages} stage(s) -> ${rows} per micro-batch`, () => {
      expect(chooseDecodeGroup(decoders, stages, table(MEASURED)).rows).toBe(rows)
    })
  }

  // A fixed cost per step plus one per row: where S divides L, ceil(L / S) balances the stages and is kept; where it
  // does not, smaller micro-batches may balance better (3 on 2 stages: 2 + 1 takes 2 x 50 a trip, 1 + 1 + 1 takes 90).
  it("costs linear in rows keep ceil(L / S) where S divides L; no estimate keeps ceil(L / S)", () => {
    const linear = table(Object.fromEntries(Array.from({ length: 16 }, (_, i) => [i + 1, 10 + 20 * (i + 1)])))
    for (const s of [1, 2, 3, 4])
      for (let l = s; l <= 16; l += s) expect(chooseDecodeGroup(l, s, linear).rows).toBe(l / s)
    expect(chooseDecodeGroup(3, 2, linear).rows).toBe(1)
    expect(chooseDecodeGroup(6, 2, table({ 1: 70, 2: 74 })).rows).toBe(3)
  })

  // Fixed seed; the generator must reach both outcomes (a size other than ceil chosen, and ceil kept).
  it("property: the chosen size's round is never slower than ceil(L / S)'s, and beats it by the margin when it differs", () => {
    const rng = makeRng(25)
    let differs = 0
    let kept = 0
    for (let trial = 0; trial < 400; trial++) {
      const costs: Record<number, number> = {}
      for (let r = 1; r <= 12; r++) costs[r] = 10 + Math.floor(rng() * 200)
      const t = table(costs)
      const l = 1 + Math.floor(rng() * 12)
      const s = 1 + Math.floor(rng() * 4)
      const choice = chooseDecodeGroup(l, s, t)
      const cost = (r: number) => t.estimate(r)!
      const chosen = roundMillis(partsOf(l, choice.rows), s, cost)
      const base = roundMillis(partsOf(l, Math.ceil(l / s)), s, cost)
      expect(chosen).toBeLessThanOrEqual(base)
      if (choice.rows !== Math.ceil(l / s)) {
        differs++
        expect(chosen).toBeLessThan(base * 0.95)
      } else kept++
    }
    expect(differs).toBeGreaterThan(20)
    expect(kept).toBeGreaterThan(20)
  })
})
