import { existsSync, readdirSync, readFileSync } from "node:fs"
import { createRequire } from "node:module"
import { dirname, join } from "node:path"
import { ggmlDirNow, windowsRoot } from "../config/Settings.js"

/**
 * Where node-llama-cpp's prebuilt ggml libraries live. node-llama-cpp ships them in one
 * package per platform (`@node-llama-cpp/<name>/bins/<name>/`), named as below.
 */
export interface GgmlLibraryDir {
  readonly packageName: string
  readonly dir: string
  readonly gpu: "cuda" | "metal" | false
  /** `libggml-base.so` / `libggml-base.dylib` / `ggml-base.dll` */
  readonly baseLib: string
  /** `libggml.v0.4.0.so` etc.: the backend registry */
  readonly mainLib: string
  /** llama.cpp release tag from `_nlcBuildMetadata.json` */
  readonly release: string | undefined
}

/** Platform package names as node-llama-cpp uses them, best first. */
export const platformPackageNames = (
  platform: NodeJS.Platform,
  arch: string,
  wantCuda: boolean
): ReadonlyArray<string> => {
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

/** True when an NVIDIA driver is visible (cheap check, no library load). */
export const cudaDriverPresent = (): boolean => {
  if (process.platform === "linux") {
    return existsSync("/proc/driver/nvidia/version") || existsSync("/dev/nvidiactl")
  }
  if (process.platform === "win32") {
    return existsSync(join(windowsRoot(), "System32", "nvcuda.dll"))
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
  options: { readonly backend?: "cpu" | "cuda" | "auto" } = {}
): GgmlLibraryDir | { readonly tried: ReadonlyArray<string> } => {
  const backend = options.backend ?? "cpu"
  const envDir = ggmlDirNow()
  const tried: Array<string> = []
  const wantCuda = backend === "cuda" || (backend === "auto" && cudaDriverPresent())
  const candidates: Array<{ packageName: string; dir: string }> = []
  if (envDir !== undefined && envDir !== "") candidates.push({ packageName: "SWACTOR_GGML_DIR", dir: envDir })
  for (const name of platformPackageNames(process.platform, process.arch, wantCuda)) {
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
      : c.packageName.includes("metal")
        ? ("metal" as const)
        : false
    return { packageName: c.packageName, dir: c.dir, gpu, baseLib, mainLib, release }
  }
  return { tried }
}
