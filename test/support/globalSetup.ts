/**
 * Builds dist/ (tsc, incremental) once before any test file runs: tests that start `swactor` processes (the CLI,
 * agents spawned by LocalAgents) run the compiled `node dist/main.js`, so a stale or missing build can never be
 * what they test.
 */
import { execFileSync } from "node:child_process"
import { existsSync, rmSync } from "node:fs"
import { createRequire } from "node:module"
import { join } from "node:path"
import { fileURLToPath } from "node:url"

export default function setup() {
  const root = fileURLToPath(new URL("../..", import.meta.url))
  const tsc = createRequire(import.meta.url).resolve("typescript/bin/tsc")
  // tsc's incremental state lives in dist/: a build whose outputs were partly deleted must start over.
  if (!existsSync(join(root, "dist", "main.js"))) rmSync(join(root, "dist"), { recursive: true, force: true })
  execFileSync(process.execPath, [tsc, "-p", join(root, "tsconfig.build.json")], { cwd: root, stdio: "inherit" })
  if (!existsSync(join(root, "dist", "main.js"))) throw new Error("the build left no dist/main.js")
}
