// The agent's measured speed (issue 10): a short timed ggml Q8_0 matrix-vector product.
import { assert, describe, it } from "@effect/vitest"
import { measureSpeed } from "../../src/layers/engine/SpeedProbe.js"

describe("speed probe", () => {
  it("measures a plausible weight-bytes-per-second figure in well under a second", async () => {
    const start = performance.now()
    const speed = await measureSpeed({ threads: 1, cols: 1024, rows: 1024, budgetMillis: 20 })
    assert.isTrue(Number.isFinite(speed))
    // Between 10 MB/s and 1 TB/s: a real product was timed, not a constant.
    assert.isAbove(speed, 1e7)
    assert.isBelow(speed, 1e12)
    assert.isBelow(performance.now() - start, 5000)
  })

  it("refuses a matrix shape that Q8_0 cannot hold with an exception, not a crash", async () => {
    let failed: unknown
    try {
      await measureSpeed({ threads: 1, cols: 100, rows: 4 })
    } catch (e) {
      failed = e
    }
    assert.instanceOf(failed, RangeError)
    assert.include(String(failed), "32-value blocks")
  })
})
