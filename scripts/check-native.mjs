#!/usr/bin/env node
/**
 * `npm run check:native`: the smallest engine equivalence check (scripts/check-native-entry.mjs: stories260K, three
 * sequences greedy alone vs batched through the live stage executor) under valgrind memcheck. Fails (non-zero) when
 * the tokens differ or when valgrind reports any error that scripts/valgrind/node.supp does not suppress (Node, V8 and
 * koffi noise only; nothing inside libggml* is suppressed). Too slow for CI (~1 min on 2 cores); run it by hand
 * after touching the native boundary (src/layers/ggml, src/layers/engine).
 *
 *   npm run check:native                          builds dist/ (incremental), then runs the check under valgrind
 *   npm run check:native -- --track-origins=yes   extra arguments go to valgrind (here: where an undefined value came from)
 *
 * The model: $SWACTOR_MODELS_DIR/stories260K.gguf, default ../shared/models relative to the repository root.
 * valgrind's full output is on stderr and in .cache/check-native/valgrind.log.
 */
import { spawn, spawnSync } from "node:child_process"
import { existsSync, mkdirSync, writeFileSync } from "node:fs"
import { dirname, join, resolve } from "node:path"
import { fileURLToPath } from "node:url"

const root = resolve(dirname(fileURLToPath(import.meta.url)), "..")
const modelsDir = resolve(root, process.env["SWACTOR_MODELS_DIR"] ?? join("..", "shared", "models"))
const model = join(modelsDir, "stories260K.gguf")
const fail = (message) => {
  console.error(`check:native: ${message}`)
  process.exit(2)
}

if (!existsSync(model)) {
  fail(
    `test model stories260K.gguf not found at ${model} (set SWACTOR_MODELS_DIR to the folder that holds it; ` +
      `default is ../shared/models relative to ${root})`
  )
}
const version = spawnSync("valgrind", ["--version"], { encoding: "utf8" })
if (version.status !== 0) fail("valgrind is not installed (Debian/Ubuntu: apt-get install -y valgrind)")

// The check runs the built library: build it (incremental; a fresh clone builds it all).
const build = spawnSync(process.execPath, [join(root, "scripts", "build.mjs")], { cwd: root, stdio: "inherit" })
if (build.status !== 0) fail("the build failed")

const valgrindArgs = [
  "--tool=memcheck",
  // any error valgrind reports (after the suppressions) fails the check
  "--error-exitcode=99",
  // V8 writes code at run time even with --jitless (the regexp interpreter's tables, trampolines): re-check it
  "--smc-check=all-non-file",
  `--suppressions=${join(root, "scripts", "valgrind", "node.supp")}`,
  "--trace-children=no",
  // a block nothing points to any more at exit is an error (Node's own such blocks, N-API external records never
  // finalized, are suppressed in node.supp; "possibly lost" is Node's threads' TLS; what Node keeps but never frees
  // at exit is still reachable)
  "--leak-check=full",
  "--show-leak-kinds=definite",
  "--errors-for-leak-kinds=definite",
  "--num-callers=40",
  ...process.argv.slice(2)
]
const nodeArgs = [
  // no JIT: nothing for valgrind to retranslate, and ~3x faster under it than V8's tiers
  "--jitless",
  join(root, "scripts", "check-native-entry.mjs"),
  model
]
const command = ["valgrind", ...valgrindArgs, process.execPath, ...nodeArgs]
console.error(`check:native: ${version.stdout.trim()}, node ${process.version}\ncheck:native: ${command.join(" ")}`)

const started = Date.now()
const child = spawn(command[0], command.slice(1), { cwd: root, stdio: ["ignore", "inherit", "pipe"] })
let log = ""
child.stderr.on("data", (chunk) => {
  log += chunk
  process.stderr.write(chunk)
})
child.on("close", (code, signal) => {
  const seconds = ((Date.now() - started) / 1000).toFixed(0)
  mkdirSync(join(root, ".cache", "check-native"), { recursive: true })
  writeFileSync(join(root, ".cache", "check-native", "valgrind.log"), log)
  const summary = /ERROR SUMMARY: .*/.exec(log)?.[0] ?? "no ERROR SUMMARY (valgrind did not finish)"
  // error reports with a ggml frame: what this check is for
  const inGgml = log
    .split(/\n==\d+== \n/)
    .filter(
      (block) =>
        /==\d+== (Invalid|Conditional|Use of|Syscall|Source and|Mismatched|Argument)/.test(block) &&
        /libggml|ggml_/.test(block)
    ).length
  console.error(`check:native: ${seconds} s under valgrind; ${summary}`)
  if (inGgml > 0) console.error(`check:native: ${inGgml} of the reports have a ggml frame (see above)`)
  if (code === 0) {
    console.error("check:native: passed")
    process.exit(0)
  }
  console.error(
    code === 99
      ? "check:native: FAILED: valgrind reported errors"
      : `check:native: FAILED: ${signal !== null ? `killed by ${signal}` : `exit code ${code}`}`
  )
  process.exit(1)
})
