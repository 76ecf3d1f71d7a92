/**
 * glibc's own heap checks for the checked engine run (`vitest run --mode engine-checked`, what `npm test` runs after
 * the main run: see vitest.config.ts). MALLOC_CHECK_=3 makes malloc keep a check byte after every block and abort on
 * free/realloc of a block whose check byte was overwritten, or of a pointer that is not a live block (a double free);
 * MALLOC_PERTURB_ fills every new block with ~0xA5 (0x5A) and every freed one with 0xA5, so code that reads
 * memory it never wrote, or after freeing it, computes on garbage instead of on yesterday's values. Since glibc 2.34
 * MALLOC_CHECK_ is honoured only with libc_malloc_debug.so.0 preloaded; all three must be in the environment when
 * the process starts (vitest's `env` option reaches its forked workers at spawn).
 */
import { execFileSync } from "node:child_process"
import { existsSync } from "node:fs"

/** The perturb byte: new blocks read as its complement (0x5A), freed ones as itself. */
export const perturbByte = 0xa5

const glibcVersion = (): string | undefined =>
  (process.report?.getReport() as { header?: { glibcVersionRuntime?: string } } | undefined)?.header
    ?.glibcVersionRuntime

/** Where libc_malloc_debug.so.0 is: ldconfig's cache, else the usual library folders. */
const findMallocDebug = (): string | undefined => {
  for (const ldconfig of ["ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig"]) {
    try {
      const cache = execFileSync(ldconfig, ["-p"], { encoding: "utf8", stdio: ["ignore", "pipe", "ignore"] })
      const line =
        cache.split("\n").find((l) => /libc_malloc_debug\.so\.0 \(.*x86-64.*\) => /.test(l)) ??
        cache.split("\n").find((l) => l.includes("libc_malloc_debug.so.0 "))
      const path = line?.split(" => ")[1]?.trim()
      if (path !== undefined && existsSync(path)) return path
    } catch {
      // no ldconfig under that name
    }
  }
  return ["/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64", "/usr/lib"]
    .map((dir) => `${dir}/libc_malloc_debug.so.0`)
    .find((path) => existsSync(path))
}

/**
 * The environment that turns the checks on, for a process started with it. Throws (the checked run must never pass
 * unchecked) when this is not glibc, or glibc >= 2.34 without libc_malloc_debug.so.0.
 */
export const mallocCheckEnv = (): Record<string, string> => {
  const version = glibcVersion()
  if (version === undefined) throw new Error("the checked engine run needs glibc (its MALLOC_CHECK_ / MALLOC_PERTURB_)")
  const [major = 0, minor = 0] = version.split(".").map(Number)
  const env: Record<string, string> = { MALLOC_CHECK_: "3", MALLOC_PERTURB_: String(perturbByte) }
  if (major > 2 || (major === 2 && minor >= 34)) {
    const lib = findMallocDebug()
    if (lib === undefined) {
      throw new Error(
        `glibc ${version} honours MALLOC_CHECK_ only with libc_malloc_debug.so.0 preloaded, and it was found neither ` +
          "in `ldconfig -p` nor in /lib/x86_64-linux-gnu, /usr/lib/x86_64-linux-gnu, /lib64, /usr/lib64, /usr/lib"
      )
    }
    const before = process.env["LD_PRELOAD"]
    env["LD_PRELOAD"] = before !== undefined && before !== "" ? `${lib}:${before}` : lib
  }
  return env
}
