// The library entry (src/index.ts) exports each name once: the DataPlane service tag is reachable as `DataPlane`
// (it was shadowed by the transport module's namespace of the same name), the transport module as `EdgeTransport`.
import { assert, describe, it } from "@effect/vitest"
import * as Swactor from "../../src/index.js"
import { DataPlane } from "../../src/services/AgentLinks.js"

describe("library entry", () => {
  it("exports the DataPlane service tag as DataPlane and the edge transport as EdgeTransport", () => {
    assert.strictEqual(Swactor.DataPlane, DataPlane)
    assert.strictEqual(Swactor.DataPlane.key, "swactor/DataPlane")
    assert.isFunction(Swactor.EdgeTransport.listen)
    assert.isFunction(Swactor.EdgeTransport.connect)
  })
})
