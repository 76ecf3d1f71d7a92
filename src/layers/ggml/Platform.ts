import { existsSync, readdirSync, readFileSync } from "node:fs"
import { createRequire } from "node:module"
import { dirname, join } from "node:path"
import type { Backend } from "../../domain/engine.js"
import { liveSettings } from "../config/Settings.js"

/**
 * Where node-llama-cpp's prebuilt ggml libraries live. node-llama-cpp ships them in one
 * package per platform (`@node-llama-cpp/<name>/bins/<name>/`), named as below.
 */
export interface GgmlLibraryDir {
  readonly packageName: string
  readonly dir: string
  readonly gpu: "cuda" | "vulkan" | "metal" | false
  /** `libggml-base.so` / `libggml-base.dylib` / `ggml-base.dll` */
  readonly baseLib: string
  /** `libggml.v0.4.0.so` etc.: the backend registry */
  readonly mainLib: string
  /** llama.cpp release tag from `_nlcBuildMetadata.json` */
  readonly release: string | undefined
}

/**
 * Platform package names as node-llama-cpp uses them, best first, for a GPU package kind (`gpu`: cuda or vulkan; none:
 * the CPU package). A GPU kind with no package for the platform lists none.
 */
export const platformPackageNames = (
  platform: NodeJS.Platform,
  arch: string,
  gpu: "cuda" | "vulkan" | false
): ReadonlyArray<string> => {
  const wantCuda = gpu === "cuda"
  if (gpu === "vulkan") {
    if (platform === "linux" && arch === "x64") return ["linux-x64-vulkan"]
    if (platform === "win32" && arch === "x64") return ["win-x64-vulkan"]
    return []
  }
  if (platform === "linux") {
    if (arch === "x64") return wantCuda ? ["linux-x64-cuda", "linux-x64-cuda-ext", "linux-x64"] : ["linux-x64"]
    if (arch === "arm64") return ["linux-arm64"]
    if (arch === "arm") return ["linux-armv7l"]
    if (arch === "riscv64") return ["linux-riscv64"]
  }
  if (platform === "darwin") {
    if (arch === "arm64") return ["mac-arm64-metal"]
    if (arch === "x64") return ["mac-x64"]
  }
  if (platform === "win32") {
    if (arch === "x64") return wantCuda ? ["win-x64-cuda", "win-x64-cuda-ext", "win-x64"] : ["win-x64"]
    if (arch === "arm64") return ["win-arm64"]
  }
  return []
}

const libExt = (platform: NodeJS.Platform) => (platform === "win32" ? ".dll" : platform === "darwin" ? ".dylib" : ".so")

/** True when a Vulkan loader is installed (cheap check, no library load; its devices are known only once loaded). */
export const vulkanLoaderPresent = (): boolean =>
  process.platform === "linux"
    ? ["/usr/lib/x86_64-linux-gnu/libvulkan.so.1", "/usr/lib64/libvulkan.so.1", "/usr/lib/libvulkan.so.1"].some(
        existsSync
      )
    : process.platform === "win32"
      ? existsSync(join(liveSettings().windowsRoot, "System32", "vulkan-1.dll"))
      : false

/** The GPU package kind a backend asks for: auto takes cuda with an NVIDIA driver, else vulkan with a Vulkan loader. */
export const gpuPackageOf = (backend: Backend): "cuda" | "vulkan" | false => {
  if (backend === "cuda" || backend === "vulkan") return backend
  if (backend !== "auto") return false
  return cudaDriverPresent() ? "cuda" : vulkanLoaderPresent() ? "vulkan" : false
}

/** True when an NVIDIA driver is visible (cheap check, no library load). */
export const cudaDriverPresent = (): boolean => {
  if (process.platform === "linux") {
    return existsSync("/proc/driver/nvidia/version") || existsSync("/dev/nvidiactl")
  }
  if (process.platform === "win32") {
    return existsSync(join(liveSettings().windowsRoot, "System32", "nvcuda.dll"))
  }
  return false
}

const packageRoot = (name: string): string | undefined => {
  const full = `@node-llama-cpp/${name}`
  const requireHere = createRequire(import.meta.url)
  const bases: Array<string> = [import.meta.url]
  try {
    bases.push(requireHere.resolve("node-llama-cpp"))
  } catch {
    // node-llama-cpp not resolvable from here: only our own resolution applies
  }
  for (const base of bases) {
    try {
      let dir = dirname(createRequire(base).resolve(full))
      for (let i = 0; i < 6; i++) {
        if (existsSync(join(dir, "package.json")) && existsSync(join(dir, "bins"))) return dir
        dir = dirname(dir)
      }
    } catch {
      // not installed beside this base
    }
  }
  return undefined
}

const findLibs = (dir: string, platform: NodeJS.Platform) => {
  const ext = libExt(platform)
  const files = readdirSync(dir)
  const prefix = platform === "win32" ? "" : "lib"
  const baseLib = files.find((f) => f === `${prefix}ggml-base${ext}`)
  const mainLib = files.find((f) => (f.startsWith(`${prefix}ggml.`) && f.endsWith(ext)) || f === `${prefix}ggml${ext}`)
  return { baseLib, mainLib }
}

/**
 * Finds the ggml libraries of the installed node-llama-cpp platform package.
 * Returns a list of what was tried when nothing fits, so the caller can say where it looked.
 */
export const locateGgmlLibraries = (
  options: { readonly backend?: Backend; readonly ggmlDir?: string | undefined } = {}
): GgmlLibraryDir | { readonly tried: ReadonlyArray<string> } => {
  const backend = options.backend ?? "cpu"
  const envDir = options.ggmlDir ?? liveSettings().ggmlDir
  const tried: Array<string> = []
  const gpuPackage = gpuPackageOf(backend)
  const candidates: Array<{ packageName: string; dir: string }> = []
  if (envDir !== undefined && envDir !== "") candidates.push({ packageName: "SWACTOR_GGML_DIR", dir: envDir })
  const names = platformPackageNames(process.platform, process.arch, gpuPackage)
  // auto falls back to the CPU package when the GPU one is not installed; cuda and vulkan do not
  const fallback =
    backend === "auto" && gpuPackage !== false ? platformPackageNames(process.platform, process.arch, false) : []
  if (names.length === 0 && gpuPackage !== false)
    tried.push(`no ${gpuPackage} package for ${process.platform}-${process.arch}`)
  for (const name of [...names, ...fallback.filter((n) => !names.includes(n))]) {
    const root = packageRoot(name)
    if (root === undefined) {
      tried.push(`@node-llama-cpp/${name} (not installed)`)
      continue
    }
    candidates.push({ packageName: `@node-llama-cpp/${name}`, dir: join(root, "bins", name) })
  }
  for (const c of candidates) {
    if (!existsSync(c.dir)) {
      tried.push(`${c.dir} (missing)`)
      continue
    }
    const { baseLib, mainLib } = findLibs(c.dir, process.platform)
    if (baseLib === undefined || mainLib === undefined) {
      tried.push(`${c.dir} (no ggml-base / ggml library)`)
      continue
    }
    let release: string | undefined
    try {
      const meta = JSON.parse(readFileSync(join(c.dir, "_nlcBuildMetadata.json"), "utf8")) as {
        buildOptions?: { llamaCpp?: { release?: string } }
      }
      release = meta.buildOptions?.llamaCpp?.release
    } catch {
      release = undefined
    }
    const gpu = c.packageName.includes("cuda")
      ? ("cuda" as const)
      : c.packageName.includes("vulkan")
        ? ("vulkan" as const)
        : c.packageName.includes("metal")
          ? ("metal" as const)
          : false
    return { packageName: c.packageName, dir: c.dir, gpu, baseLib, mainLib, release }
  }
  return { tried }
}
