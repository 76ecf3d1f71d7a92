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
  execFileSync(process.execPath, [join(root, "scripts", "build.mjs")], { cwd: root, stdio: "inherit" })
  if (!existsSync(join(root, "dist", "main.js"))) throw new Error("the build left no dist/main.js")
}
