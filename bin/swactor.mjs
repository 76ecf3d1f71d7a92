#!/usr/bin/env node
// Launches the TypeScript CLI through tsx's loader (Node 20 cannot run .ts directly).
import { spawnSync } from "node:child_process"
import { createRequire } from "node:module"
import { dirname, join } from "node:path"
import { fileURLToPath } from "node:url"

const here = dirname(fileURLToPath(import.meta.url))
const require = createRequire(import.meta.url)
const tsxCli = require.resolve("tsx/cli")
const result = spawnSync(process.execPath, [tsxCli, join(here, "..", "src", "main.ts"), ...process.argv.slice(2)], {
  stdio: "inherit"
})
process.exit(result.status ?? 1)
