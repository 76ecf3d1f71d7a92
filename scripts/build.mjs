#!/usr/bin/env node
/**
 * The build: `tsc -p tsconfig.build.json` (the library: dist/**\/*.js, .d.ts and source maps, what `exports` points at),
 * then esbuild bundles the program (src/main.ts) into dist/main.js plus its lazily loaded chunks in dist/chunks/: the
 * `swactor` bin and every local agent run that bundle. A Node process spends most of its start-up resolving, reading
 * and compiling modules: as ~900 separate files `node dist/main.js node` took ~700 ms of CPU to its ready line, bundled
 * ~220 ms (one stage of `swactor run` is one such process, plus the orchestrator).
 *
 *   node scripts/build.mjs            incremental tsc, then the bundle
 *   node scripts/build.mjs --clean    dist/ removed first
 *   node scripts/build.mjs --bundle   the bundle only (src/ is type-checked by `npx tsc --noEmit -p .`)
 *
 * The bundle inlines the dependencies (effect, @effect/*, ws, msgpackr, ...) except native ones, which load at run
 * time from node_modules as before: koffi (the ggml bindings) and node-llama-cpp (whose files only locate the ggml
 * libraries). Subcommands stay separate chunks (main.ts imports only the one asked for), so an agent never loads the
 * HTTP server, the tokenizer or the CLI of `run`.
 */
import { execFileSync } from "node:child_process"
import { existsSync, rmSync } from "node:fs"
import { createRequire } from "node:module"
import { dirname, join } from "node:path"
import { fileURLToPath } from "node:url"
import * as esbuild from "esbuild"

const root = join(dirname(fileURLToPath(import.meta.url)), "..")
const dist = join(root, "dist")
const args = new Set(process.argv.slice(2))

if (args.has("--clean") || !existsSync(join(dist, "index.js"))) {
  // tsc's incremental state lives in dist/: a build whose outputs were partly deleted must start over.
  rmSync(dist, { recursive: true, force: true })
}

if (!args.has("--bundle")) {
  const tsc = createRequire(import.meta.url).resolve("typescript/bin/tsc")
  execFileSync(process.execPath, [tsc, "-p", join(root, "tsconfig.build.json")], { cwd: root, stdio: "inherit" })
}

rmSync(join(dist, "chunks"), { recursive: true, force: true })
await esbuild.build({
  absWorkingDir: root,
  entryPoints: { main: "src/main.ts" },
  outdir: dist,
  chunkNames: "chunks/[name]-[hash]",
  bundle: true,
  splitting: true,
  platform: "node",
  format: "esm",
  target: "node20",
  minify: true,
  // Class and function names survive minification (error messages and stack traces name them).
  keepNames: true,
  sourcemap: "linked",
  sourcesContent: false,
  external: ["koffi", "node-llama-cpp", "msgpackr-extract"],
  // CommonJS dependencies bundled into ESM (ws, msgpackr) call require() for Node built-ins.
  banner: {
    js: `import { createRequire as __swactorRequire } from "node:module"; const require = __swactorRequire(import.meta.url);`
  },
  logLevel: "warning"
})
