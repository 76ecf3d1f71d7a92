/**
 * Setup file of the checked engine run (vitest.config.ts, mode "engine-checked"): before a test file runs, proves
 * that its worker process really runs with glibc's checks, so the run cannot pass unchecked. In this process:
 * libc_malloc_debug is mapped (where glibc needs it) and a fresh malloc block is filled with the perturb pattern.
 * In a child started with this process's environment: a one-byte overflow past a 16-byte block, which plain glibc
 * never notices (the block's usable size is 24), aborts at its free. The overflow flips the byte it overwrites: that
 * byte is glibc's check byte, computed from the block's address, so writing a fixed value left it intact about once in
 * 256 runs (a fresh-clone CI run's probe "survived").
 *
 * A file that measures its child processes' resident memory (engine.peak: VmHWM of a stage process) gets its
 * children without MALLOC_PERTURB_ (they keep MALLOC_CHECK_): perturbing writes every byte of every new block, so
 * memory a stage never touches would count as resident and the peak would be glibc's, not the stage's.
 */
import { spawnSync } from "node:child_process"
import { readFileSync } from "node:fs"
import { createRequire } from "node:module"
import { expect } from "vitest"
import { perturbByte } from "./mallocChecks.js"

const require = createRequire(import.meta.url)
const koffiPath = require.resolve("koffi")
const koffi = require(koffiPath) as typeof import("koffi")

if (process.env["MALLOC_CHECK_"] !== "3" || process.env["MALLOC_PERTURB_"] !== String(perturbByte)) {
  throw new Error("the checked engine run's worker started without MALLOC_CHECK_=3 and MALLOC_PERTURB_")
}
const preload = process.env["LD_PRELOAD"] ?? ""
if (preload.includes("libc_malloc_debug") && !readFileSync("/proc/self/maps", "utf8").includes("libc_malloc_debug")) {
  throw new Error(`LD_PRELOAD=${preload}, but libc_malloc_debug is not mapped in this worker`)
}

// malloc/free as every native library resolves them (the global scope, where the preloaded library comes first),
// not libc's own, which a handle of libc.so.6 would give
const self = koffi.load(null as unknown as string)
const malloc = self.func("void *malloc(size_t)")
const free = self.func("void free(void *)")
const block = malloc(64)
const fresh = new Uint8Array(koffi.view(block, 64)).slice()
free(block)
if (!fresh.every((b) => b === (~perturbByte & 0xff))) {
  throw new Error(`a fresh malloc block is not perturbed (0x5A): ${Buffer.from(fresh).toString("hex")}`)
}

const overflow = `
  const koffi = require(${JSON.stringify(koffiPath)})
  const self = koffi.load(null)
  const p = self.func("void *malloc(size_t)")(16)
  // byte 16 holds glibc's check byte, derived from the address: flipped, never rewritten with the value it may hold
  const bytes = new Uint8Array(koffi.view(p, 17))
  bytes[16] = bytes[16] ^ 0xff
  self.func("void free(void *)")(p)
  console.log("survived")
`
const probe = spawnSync(process.execPath, ["-e", overflow], { env: process.env, encoding: "utf8" })
if (probe.signal !== "SIGABRT") {
  throw new Error(
    `a one-byte heap overflow did not abort a process with this worker's environment (MALLOC_CHECK_ is not on): ` +
      `signal ${probe.signal}, status ${probe.status}, ${probe.stdout}${probe.stderr}`
  )
}

const residentMemoryTests = ["test/engine/peak.test.ts"]
const testPath = expect.getState().testPath
if (testPath !== undefined && residentMemoryTests.some((file) => testPath.endsWith(`/${file}`)))
  delete process.env["MALLOC_PERTURB_"]
