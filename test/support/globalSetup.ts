/**
 * Builds dist/ once before any test file runs (scripts/build.mjs: incremental tsc for the library, then the CLI
 * bundle dist/main.js): tests that start `swactor` processes (the CLI, agents spawned by LocalAgents) run the built
 * `node dist/main.js`, so a stale or missing build can never be what they test.
 */
import { execFileSync } from "node:child_process"
import { existsSync } from "node:fs"
import { join } from "node:path"
import { fileURLToPath } from "node:url"

export default function setup() {
  const root = fileURLToPath(new URL("../..", import.meta.url))
  // Two test runs on one machine (or one while a benchmark builds) take turns at dist/ under one lock file.
  const build = [process.execPath, join(root, "scripts", "build.mjs")]
  if (existsSync("/usr/bin/flock"))
    execFileSync("/usr/bin/flock", [join(root, ".cache-build.lock"), ...build], { cwd: root, stdio: "inherit" })
  else execFileSync(build[0]!, build.slice(1), { cwd: root, stdio: "inherit" })
  if (!existsSync(join(root, "dist", "main.js"))) throw new Error("the build left no dist/main.js")
}
