#!/usr/bin/env node
/**
 * The build. `tsc -p tsconfig.build.json` emits the library (dist/**\/*.js, .d.ts and source maps: what `exports`
 * points at). esbuild bundles the command (src/main.ts and everything it imports) into one CommonJS file,
 * dist/swactor.cjs; dist/main.js, the `swactor` bin and what every local agent runs, is a small loader that compiles
 * the bundle with V8's code cache for it (dist/swactor.cjs.<hash>.<node>.v8cache, written here by starting one agent
 * to its ready line), so a process neither resolves ~900 module files nor compiles ~1.4 MB of JavaScript at start.
 * CPU of `node dist/main.js node` to its ready line: ~700 ms as tsc's separate files, ~240 ms bundled, ~130 ms with
 * the code cache. A cache V8 rejects (another Node version) costs nothing but the compile it would have saved.
 *
 *   node scripts/build.mjs            incremental tsc, then the bundle and its code cache
 *   node scripts/build.mjs --clean    dist/ removed first
 *   node scripts/build.mjs --bundle   the bundle only (src/ is type-checked by `npx tsc --noEmit -p .`)
 *
 * The bundle inlines the dependencies (effect, @effect/*, ws, msgpackr, ...) except native ones, which load at run
 * time from node_modules: koffi (the ggml bindings) and node-llama-cpp (chat templates; its files locate the ggml
 * libraries). Subcommands are initialised only when asked for (main.ts imports the one asked), so an agent never
 * runs the HTTP server's or `run`'s module code.
 */
import { execFileSync, spawn } from "node:child_process"
import { createHash } from "node:crypto"
import { chmodSync, existsSync, readdirSync, readFileSync, rmSync, writeFileSync } from "node:fs"
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

const bundle = join(dist, "swactor.cjs")
await esbuild.build({
  absWorkingDir: root,
  entryPoints: ["src/main.ts"],
  outfile: bundle,
  bundle: true,
  platform: "node",
  format: "cjs",
  target: "node20",
  minify: true,
  // Class and function names survive minification (error messages and stack traces name them).
  keepNames: true,
  sourcemap: "linked",
  sourcesContent: false,
  external: ["koffi", "node-llama-cpp", "msgpackr-extract"],
  // The sources are ES modules: `import.meta.url` is the bundle's own URL here.
  define: { "import.meta.url": "__swactorBundleUrl" },
  banner: { js: `var __swactorBundleUrl = require("node:url").pathToFileURL(__filename).href;` },
  logLevel: "warning"
})

// The code cache belongs to one bundle: its name carries a hash of the bundle (V8 itself checks only the length).
// main.ts's hashbang becomes a comment (the loader wraps the bundle in a function; lines stay where the map says).
// What is left of `import("...")` (external ES modules: node-llama-cpp) calls the loader's own import(): on Node 20 a
// vm.Script compiled from a code cache loses its dynamic-import callback (ERR_VM_DYNAMIC_IMPORT_CALLBACK_MISSING).
const source = readFileSync(bundle, "utf8")
  .replace(/^#!.*/, "//")
  .replace(/\bimport\((?=["'`])/g, "__swactorImport(")
if (/\bimport\(/.test(source.replace(/"(?:[^"\\\n]|\\.)*"/g, '""')))
  console.warn("build: an import() the loader does not serve is left in the bundle")
writeFileSync(bundle, source)
const hash = createHash("sha256").update(source).digest("hex").slice(0, 16)
for (const old of readdirSync(dist)) if (old.endsWith(".v8cache")) rmSync(join(dist, old))

const loader = `#!/usr/bin/env node
// The \`swactor\` command, written by scripts/build.mjs: runs the bundle (swactor.cjs) compiled with V8's code cache
// for it when one for this Node version is there. SWACTOR_CODE_CACHE=write: write that cache when the process exits;
// SWACTOR_CODE_CACHE=check: say on stderr whether V8 took it.
import { readFileSync, renameSync, writeFileSync } from "node:fs"
import { createRequire } from "node:module"
import { dirname, join } from "node:path"
import { fileURLToPath } from "node:url"
import { Script } from "node:vm"

const entry = fileURLToPath(import.meta.url)
const bundle = join(dirname(entry), "swactor.cjs")
const cachePath = \`\${bundle}.${hash}.\${process.versions.v8}-\${process.arch}.v8cache\`
let cachedData
try {
  cachedData = readFileSync(cachePath)
} catch {
  // no cache for this Node: compile
}
const script = new Script(
  "(function (exports, require, module, __filename, __dirname, __swactorImport) {" + readFileSync(bundle, "utf8") + "\\n})",
  { filename: bundle, ...(cachedData === undefined ? {} : { cachedData }) }
)
if (process.env.SWACTOR_CODE_CACHE === "check") {
  process.stderr.write(\`swactor: code cache \${cachedData === undefined ? "none" : script.cachedDataRejected ? "rejected" : "used"}\\n\`)
}
if (process.env.SWACTOR_CODE_CACHE === "write") {
  process.on("exit", () => {
    try {
      writeFileSync(\`\${cachePath}.\${process.pid}\`, script.createCachedData())
      renameSync(\`\${cachePath}.\${process.pid}\`, cachePath)
    } catch (error) {
      process.stderr.write(\`swactor: could not write the code cache: \${error.message}\\n\`)
    }
  })
}
// Local agents run this file too (src/layers/agent/CliEntry.ts).
globalThis[Symbol.for("swactor.cliEntry")] = entry
const module = { exports: {} }
script.runInThisContext()(module.exports, createRequire(bundle), module, bundle, dirname(bundle), (specifier) => import(specifier))
`
const main = join(dist, "main.js")
writeFileSync(main, loader)
chmodSync(main, 0o755)
rmSync(join(dist, "main.js.map"), { force: true })
rmSync(join(dist, "chunks"), { recursive: true, force: true })

// The code cache: one agent started to its ready line, then stopped; what it compiled is the cache.
const writeCache = () =>
  new Promise((resolve, reject) => {
    const child = spawn(
      process.execPath,
      [main, "node", "--listen", "127.0.0.1:0", "--threads", "1", "--speed-probe", "after-ready"],
      {
        cwd: root,
        stdio: ["ignore", "pipe", "pipe"],
        env: { ...process.env, SWACTOR_CODE_CACHE: "write", SWACTOR_CLUSTER_TOKEN: "swactor-build-code-cache-token" }
      }
    )
    let stderr = ""
    const timer = setTimeout(() => child.kill("SIGKILL"), 30_000)
    child.stdout.on("data", (chunk) => {
      if (String(chunk).includes("swactor-node-ready")) child.kill("SIGTERM")
    })
    child.stderr.on("data", (chunk) => (stderr += chunk))
    child.on("error", reject)
    child.on("exit", () => {
      clearTimeout(timer)
      const written = readdirSync(dist).some((f) => f.endsWith(".v8cache"))
      written
        ? resolve()
        : reject(new Error(`no code cache written: ${stderr.trim().split("\n").slice(-3).join(" | ")}`))
    })
  })
await writeCache().catch((error) => {
  // Not fatal: without the cache every process compiles the bundle (slower start, same behaviour).
  console.warn(`build: ${error.message}`)
})
