import { assert, describe, it } from "@effect/vitest"
import { GgmlType, ggmlTypeInfo } from "../../src/domain/ggmlTypes.js"
import { expectedBuild, getGgml, gpuDeviceIndex, TensorLayout } from "../../src/layers/ggml/Bindings.js"
import { locateGgmlLibraries, platformPackageNames } from "../../src/layers/ggml/Platform.js"

describe("ggml bindings over node-llama-cpp's libraries", () => {
  // node-llama-cpp's platform package names, CUDA first when wanted; Vulkan's package alone (x64 Linux and Windows).
  it("maps platforms to node-llama-cpp's package names", () => {
    assert.deepStrictEqual(platformPackageNames("linux", "x64", false), ["linux-x64"])
    assert.deepStrictEqual(platformPackageNames("linux", "x64", "cuda"), [
      "linux-x64-cuda",
      "linux-x64-cuda-ext",
      "linux-x64"
    ])
    assert.deepStrictEqual(platformPackageNames("darwin", "arm64", false), ["mac-arm64-metal"])
    assert.deepStrictEqual(platformPackageNames("darwin", "x64", false), ["mac-x64"])
    assert.deepStrictEqual(platformPackageNames("win32", "x64", "cuda"), [
      "win-x64-cuda",
      "win-x64-cuda-ext",
      "win-x64"
    ])
    assert.deepStrictEqual(platformPackageNames("linux", "x64", "vulkan"), ["linux-x64-vulkan"])
    assert.deepStrictEqual(platformPackageNames("win32", "x64", "vulkan"), ["win-x64-vulkan"])
    assert.deepStrictEqual(platformPackageNames("darwin", "arm64", "vulkan"), [])
    assert.deepStrictEqual(platformPackageNames("aix", "ppc64", false), [])
  })

  it("finds node-llama-cpp's Vulkan package by the backend's name (x64 Linux)", () => {
    const found = locateGgmlLibraries({ backend: "vulkan" })
    assert.isFalse("tried" in found, JSON.stringify(found))
    if ("tried" in found) return
    assert.strictEqual(found.packageName, "@node-llama-cpp/linux-x64-vulkan")
    assert.strictEqual(found.gpu, "vulkan")
    assert.strictEqual(found.release, expectedBuild.release)
  })

  it("finds the installed CPU package and its llama.cpp release", () => {
    const found = locateGgmlLibraries({ backend: "cpu" })
    assert.isFalse("tried" in found, JSON.stringify(found))
    if ("tried" in found) return
    assert.strictEqual(
      found.packageName,
      `@node-llama-cpp/${platformPackageNames(process.platform, process.arch, false)[0]}`
    )
    assert.strictEqual(found.release, expectedBuild.release)
  })

  // The start-up check read back ne/nb/flags/name at the offsets the bindings assume.
  it("loads, passes the version and ggml_tensor layout checks, and agrees with the type table", () => {
    const g = getGgml()
    assert.strictEqual(g.version, expectedBuild.ggmlVersion)
    assert.strictEqual(g.raw.ggml_tensor_overhead(), TensorLayout.overhead)
    for (const t of [
      GgmlType.F32,
      GgmlType.F16,
      GgmlType.BF16,
      GgmlType.Q8_0,
      GgmlType.Q4_0,
      GgmlType.Q4_K,
      GgmlType.Q6_K
    ]) {
      const info = ggmlTypeInfo(t)!
      assert.strictEqual(g.ggml_type_size(t), info.typeSize)
      assert.strictEqual(g.ggml_blck_size(t), info.blockSize)
      assert.strictEqual(g.ggml_row_size(t, 512), (512 / info.blockSize) * info.typeSize)
    }
  })

  it("quantizeChunk produces rows of ggml_row_size bytes and refuses bad shapes", () => {
    const g = getGgml()
    const src = Float32Array.from({ length: 256 * 3 }, (_, i) => Math.sin(i))
    assert.strictEqual(g.quantizeChunk(GgmlType.Q4_K, src, 3, 256).length, 3 * 144)
    assert.strictEqual(g.quantizeChunk(GgmlType.Q8_0, src, 3, 256).length, 3 * 8 * 34)
    const f32 = g.quantizeChunk(GgmlType.F32, src, 3, 256)
    assert.deepStrictEqual(new Float32Array(f32.buffer), src)
    assert.throws(() => g.quantizeChunk(GgmlType.Q4_K, src, 6, 128), /block size/)
    assert.throws(() => g.quantizeChunk(GgmlType.Q8_0, src, 4, 256), /src has/)
  })

  it("a GPU stage's device: the first discrete GPU, else the first integrated one, never the CPU or an accelerator", () => {
    assert.strictEqual(gpuDeviceIndex(["cpu"]), -1)
    assert.strictEqual(gpuDeviceIndex(["accel", "cpu"]), -1)
    // a laptop's Intel GPU through Vulkan, a DGX Spark through CUDA: integrated
    assert.strictEqual(gpuDeviceIndex(["igpu", "cpu"]), 0)
    assert.strictEqual(gpuDeviceIndex(["cpu", "igpu", "gpu"]), 2)
    assert.strictEqual(gpuDeviceIndex(["gpu", "gpu", "cpu"]), 0)
  })

  it("the CPU package's devices: one CPU device with the machine's memory", () => {
    const devices = getGgml().devices()
    assert.deepStrictEqual(
      devices.map((d) => d.kind),
      ["cpu"]
    )
    assert.isAbove(devices[0]!.totalBytes, 0)
    assert.isAtMost(devices[0]!.freeBytes, devices[0]!.totalBytes)
    assert.isNull(getGgml().gpuDevice())
  })
})
