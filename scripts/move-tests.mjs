#!/usr/bin/env node
// Moves the flat test files (test/*.test.ts and their helpers, such as test/gguf.fields.ts) into folders that mirror
// src/ (issue 23), named after the module or behaviour they prove, and updates every reference to them:
// - relative specifiers in moved and unmoved files (imports, `new URL(..., import.meta.url)`, `import.meta.dirname`
//   and `__dirname` path segments), so that `../src/x.js` becomes `../../src/x.js` and a moved helper is found;
// - paths cited in text anywhere in the repository (specs/BEHAVIOR_GUARANTEES.md, README, bench/, scripts/, .ci/,
//   vitest.config.ts, comments in src/ and test/): `test/engine.peak.test.ts`, `test/engine.peak` (a citation without
//   the extension), a bare `engine.peak.test.ts` (written `test/engine/peak.test.ts` after the move) and the globs
//   `test/<prefix>.*.test.ts`;
// - the engine-checked run (vitest.config.ts): it keeps exactly the files it ran before; and the one code comparison
//   with a test file's name (test/support/mallocChecks.setup.ts).
// Placement: PLACES (exact names, checked first), then PREFIXES (the name's first dotted part chooses the folder and
// is dropped), then a prefix that names an existing folder of test/ (e.g. `config.x.test.ts` -> test/config/x.test.ts).
// A file none of these places fails the script (exit 1, listing the files) before anything moves. Files already in a
// subfolder of test/ stay where they are.
//   node scripts/move-tests.mjs            move (git mv) and rewrite
//   node scripts/move-tests.mjs --dry-run  print the mapping and the files that would change, change nothing
import { execFileSync } from "node:child_process"
import { existsSync, mkdirSync, readdirSync, readFileSync, statSync, writeFileSync } from "node:fs"
import { dirname, join, posix, relative, resolve } from "node:path"
import { fileURLToPath } from "node:url"

const root = resolve(dirname(fileURLToPath(import.meta.url)), "..")
const dryRun = process.argv.includes("--dry-run")
const self = "scripts/move-tests.mjs"

/** Exceptions, by the file's name in test/ (without `.test.ts`; helpers keep `.ts`): its new path under test/. */
const PLACES = {
  // the module or behaviour they prove, which their old prefix did not say
  "e2e.recovery.units": "orchestrator/recovery",
  "agent.stopEarly": "agent/stopEarly",
  anthropicMessages: "server/anthropicMessages",
  auth: "transport/auth",
  build: "project/build",
  controlplane: "agent/controlPlane",
  dataplane: "transport/dataPlane",
  framing: "transport/framing",
  gbnf: "server/gbnf",
  harmony: "server/harmony",
  httpGuard: "server/httpGuard",
  jsonGrammar: "server/jsonGrammar",
  library_entry: "api/libraryEntry",
  "localAgents.prestart": "agent/localAgents.prestart",
  membership: "agent/membership",
  model_catalog: "gguf/modelCatalog",
  naming: "project/naming",
  orchestrator: "orchestrator/orchestrator",
  package: "project/package",
  "placement.properties": "planner/placement.properties",
  plan_command: "cli/plan",
  promptCacheIndex: "server/promptCacheIndex",
  readme: "project/readme",
  "recovery.replayDeadline": "orchestrator/recovery.replayDeadline",
  request_checks: "server/requestChecks",
  run_fsm: "fsm/runFsm",
  run_plan: "planner/runPlan",
  sampler: "sampling/sampler",
  slice_cache: "gguf/sliceCache",
  slice_stream: "gguf/sliceStream",
  speed_probe: "engine/speedProbe",
  "speed_probe.later": "e2e/speedProbe.later",
  "stageExecutor.double": "engine/stageExecutorTest",
  "stageExecutor.slowed": "engine/stageExecutorSlowed",
  stepCosts: "agent/stepCosts",
  "stragglers.stage": "orchestrator/stragglers",
  "synth.moeRecipe": "gguf/synthetic.moeRecipe",
  "synthetic.cli": "cli/synth",
  "synthetic.load": "gguf/synthetic.load",
  textLogprobs: "server/textLogprobs",
  tls: "transport/tls",
  stageBatcher: "agent/stageBatcher",
  tokenizer: "gguf/tokenizer",
  "tokenizer.spm": "gguf/spmTokenizer",
  "tokenizer.worker": "server/tokenizeWorker",
  toolCalls: "server/toolCalls",
  validation: "api/validation",
  // helpers (no `.test`): beside the tests that use them
  "gguf.fields.ts": "gguf/fields.ts"
}

/** A name's first dotted part -> what replaces it: a folder (`engine/`: `engine.peak` -> engine/peak) or a folder and a
 * name the rest keeps (`agent/stageBatcher.`: `stageBatcher.replay` -> agent/stageBatcher.replay). */
const PREFIXES = {
  agent: "agent/",
  cli: "cli/",
  e2e: "e2e/",
  engine: "engine/",
  ggml: "ggml/",
  gguf: "gguf/",
  orchestrator: "orchestrator/",
  planner: "planner/",
  run_fsm: "fsm/",
  run_plan: "planner/",
  sampler: "sampling/",
  serve: "server/",
  stageBatcher: "agent/stageBatcher.",
  tokenizer: "gguf/tokenizer.",
  transport: "transport/"
}

/** The engine-checked run (vitest.config.ts) ran `test/engine.*.test.ts`: files placed in test/engine/ from other names
 * are kept out of it, so that it runs the same files as before. */
const CHECKED_PREFIX = "engine"

const git = (...args) => execFileSync("git", args, { cwd: root, encoding: "utf8" })

// ---- the plan ---------------------------------------------------------------------------------------------------
const flat = readdirSync(join(root, "test")).filter(
  (f) => f.endsWith(".ts") && statSync(join(root, "test", f)).isFile()
)
const stem = (file) => (file.endsWith(".test.ts") ? file.slice(0, -".test.ts".length) : file)
const folders = new Set(readdirSync(join(root, "test")).filter((f) => statSync(join(root, "test", f)).isDirectory()))

const place = (file) => {
  const name = stem(file)
  const isTest = file.endsWith(".test.ts")
  const suffix = isTest ? ".test.ts" : ""
  if (PLACES[name] !== undefined) return PLACES[name] + suffix
  const dot = name.indexOf(".")
  if (dot <= 0) return undefined
  const prefix = name.slice(0, dot)
  const rest = name.slice(dot + 1)
  const into = PREFIXES[prefix] ?? (folders.has(prefix) && prefix !== "support" ? `${prefix}/` : undefined)
  if (into === undefined) return undefined
  return `${into}${rest}${suffix}`
}

const moves = new Map() // "test/old.test.ts" -> "test/folder/new.test.ts"
const unplaced = []
for (const file of flat) {
  const to = place(file)
  if (to === undefined) unplaced.push(`test/${file}`)
  else moves.set(`test/${file}`, `test/${to}`)
}
if (unplaced.length > 0) {
  console.error(`move-tests: no place for ${unplaced.length} file(s); add them to PLACES or PREFIXES in ${self}:`)
  for (const f of unplaced) console.error(`  ${f}`)
  process.exit(1)
}
const targets = new Map()
const clashes = []
for (const [from, to] of moves) {
  if (targets.has(to)) clashes.push(`${targets.get(to)} and ${from} -> ${to}`)
  else if (existsSync(join(root, to))) clashes.push(`${from} -> ${to}, which exists`)
  targets.set(to, from)
}
if (clashes.length > 0) {
  console.error(`move-tests: ${clashes.length} clash(es):`)
  for (const c of clashes) console.error(`  ${c}`)
  process.exit(1)
}
const fromStem = new Map() // "engine.peak" / "gguf.fields" -> move (both .test.ts and helper .ts)
for (const [from, to] of moves) {
  const name = from.slice("test/".length)
  fromStem.set(name.endsWith(".test.ts") ? stem(name) : name.slice(0, -".ts".length), { from, to })
}
const newStem = (to) => to.replace(/\.test\.ts$/, "").replace(/\.ts$/, "")

// ---- rewriting --------------------------------------------------------------------------------------------------
const newLocation = (path) => moves.get(path) ?? path

/** A relative specifier written in `file` (repo path, old location) -> the one to write at its new location. */
const respecify = (file, spec) => {
  if (!spec.startsWith("./") && !spec.startsWith("../") && spec !== "." && spec !== "..") return spec
  const oldDir = posix.dirname(file)
  const newDir = posix.dirname(newLocation(file))
  const target = posix.normalize(posix.join(oldDir, spec))
  // a moved file is imported as .js (NodeNext) or named as .ts
  let moved = target
  for (const ext of ["", ".ts"]) {
    const candidate = ext === "" ? target : target.replace(/\.js$/, ext)
    if (moves.has(candidate)) moved = moves.get(candidate).replace(/\.ts$/, target.endsWith(".js") ? ".js" : ".ts")
  }
  if (oldDir === newDir && moved === target) return spec
  let rel = posix.relative(newDir, moved)
  if (rel === "") rel = "."
  if (!rel.startsWith(".")) rel = `./${rel}`
  if (spec.endsWith("/") && !rel.endsWith("/")) rel += "/"
  return rel
}

const codeFile = (f) => /\.(ts|mts|cts|mjs|cjs|js)$/.test(f)

const rewriteSpecifiers = (file, text) => {
  const q = () => (m, pre, quote, spec, close, post) => `${pre}${quote}${respecify(file, spec)}${close}${post}`
  text = text
    // import/export ... from "x", import "x"
    .replace(
      /(\bfrom\s*|\bimport\s*)(["'])(\.{1,2}(?:\/[^"'\n]*)?)(["'])()/g,
      (m, pre, quote, spec) => `${pre}${quote}${respecify(file, spec)}${quote}`
    )
    // import("x"), require("x"), vi.mock("x"), require.resolve("x")
    .replace(
      /(\b(?:import|require|require\.resolve|vi\.mock|vi\.doMock|vi\.importActual)\(\s*)(["'`])(\.{1,2}(?:\/[^"'`\n]*)?)(["'`])()/g,
      q()
    )
    // new URL("x", import.meta.url)
    .replace(/(\bnew URL\(\s*)(["'`])(\.{1,2}(?:\/[^"'`\n]*)?)(["'`])(\s*,\s*import\.meta\.url)/g, q())
  // join/resolve(import.meta.dirname | __dirname | dirname(fileURLToPath(import.meta.url)), "seg", "seg", ...)
  text = text.replace(
    /(import\.meta\.dirname|__dirname|dirname\(fileURLToPath\(import\.meta\.url\)\))((?:\s*,\s*"[^"\n]*")+)/g,
    (m, base, args) => {
      const segments = [...args.matchAll(/"([^"\n]*)"/g)].map((s) => s[1])
      const spec = posix.join(".", ...segments)
      const rel = respecify(file, spec.startsWith(".") ? spec : `./${spec}`)
      const parts = posix
        .normalize(rel)
        .split("/")
        .filter((p) => p !== ".")
      if (
        parts.join("/") ===
        posix
          .normalize(spec)
          .split("/")
          .filter((p) => p !== ".")
          .join("/")
      )
        return m
      return `${base}, ${parts.map((p) => `"${p}"`).join(", ")}`
    }
  )
  return text
}

/** Test paths cited as text: `test/old.test.ts`, `test/old` (citation), bare `old.test.ts`, globs `test/prefix.*.test.ts`. */
const rewriteCitations = (text) => {
  text = text.replace(/(?<![\w.-])test\/([A-Za-z0-9_][A-Za-z0-9_.*]*)/g, (m, token) => {
    const glob = /^([A-Za-z0-9_]+)\.\*\.test\.ts$/.exec(token)
    if (glob) {
      const into = PREFIXES[glob[1]]
      return into === undefined ? m : `test/${into}*.test.ts`
    }
    // the longest name that is a moved file's: test/engine.peak.test.ts, test/engine.peak. (end of a sentence)
    for (const [tail, form] of [
      [".test.ts", "test"],
      [".ts", "ts"],
      [".js", "js"],
      ["", "none"]
    ]) {
      if (!token.endsWith(tail)) continue
      let name = token.slice(0, token.length - tail.length)
      let trailing = ""
      while (form === "none" && name.endsWith(".")) {
        name = name.slice(0, -1)
        trailing += "."
      }
      const move = fromStem.get(name)
      if (move === undefined) continue
      const isTest = move.from.endsWith(".test.ts")
      if (form === "test" && !isTest) continue
      if (form === "ts" && isTest) continue
      const next = newStem(move.to).slice("test/".length)
      return `test/${next}${form === "test" ? ".test.ts" : form === "ts" ? ".ts" : form === "js" ? ".js" : ""}${trailing}`
    }
    return m
  })
  // bare file names (comments): serve.revive.test.ts -> test/server/revive.test.ts
  text = text.replace(/(?<![\w./-])([A-Za-z0-9_][A-Za-z0-9_.]*)\.test\.ts\b/g, (m, name) => {
    const move = fromStem.get(name)
    return move === undefined || !move.from.endsWith(".test.ts") ? m : move.to
  })
  return text
}

/** Code that compares a test file's name, rewritten with it (a missing anchor with the old name still there fails). */
const PATCHES = [
  {
    file: "test/support/mallocChecks.setup.ts",
    when: (text) => text.includes("residentMemoryTests.includes(basename(testPath))"),
    apply: (text) => {
      text = text.replace(
        "residentMemoryTests.includes(basename(testPath))",
        "residentMemoryTests.some((file) => testPath.endsWith(`/${file}`))"
      )
      if (!/\bbasename\(/.test(text)) text = text.replace(/^import \{ basename \} from "node:path"\n/m, "")
      return text
    }
  }
]

const checkedExtras = [...moves]
  .filter(
    ([from, to]) =>
      to.startsWith(`test/${CHECKED_PREFIX}/`) && to.endsWith(".test.ts") && !from.startsWith(`test/${CHECKED_PREFIX}.`)
  )
  .map(([, to]) => to)
  .sort()

const patchVitestConfig = (text) => {
  if (checkedExtras.length === 0) return text
  const anchor = /^const engineTests = \[[^\]\n]*\]\n/m
  if (!anchor.test(text) || !text.includes("include: engineTests,")) {
    throw new Error(
      "vitest.config.ts: no `const engineTests = [...]` and `include: engineTests,` to add the exclusions to"
    )
  }
  const list = checkedExtras.map((f) => `  "${f}"`).join(",\n")
  return text
    .replace(
      anchor,
      (line) =>
        `${line}\n/** Files in test/engine/ that the checked run leaves out: it runs the engine files it ran before they moved. */\n` +
        `const engineTestsUnchecked = [\n${list}\n]\n`
    )
    .replace(/^(\s*)include: engineTests,\n/m, (m, indent) => `${m}${indent}exclude: engineTestsUnchecked,\n`)
}

// ---- run --------------------------------------------------------------------------------------------------------
const tracked = git("ls-files", "-z")
  .split("\0")
  .filter((f) => f !== "" && existsSync(join(root, f)))
const textual = tracked.filter(
  (f) =>
    f !== self &&
    f !== "package-lock.json" &&
    !f.startsWith("shared/") &&
    (/\.(ts|mts|cts|mjs|cjs|js|json|md|yml|yaml|sh)$/.test(f) || f.startsWith(".ci/"))
)
// untracked, unignored files under test/ (a new test not yet committed) are rewritten too
const untracked = git("ls-files", "-z", "--others", "--exclude-standard", "--", "test")
  .split("\0")
  .filter((f) => f !== "")
const changed = new Map() // new path -> new text
const problems = []
for (const file of [...new Set([...textual, ...untracked])]) {
  const before = readFileSync(join(root, file), "utf8")
  let after = codeFile(file) ? rewriteSpecifiers(file, before) : before
  for (const patch of PATCHES) if (patch.file === file && patch.when(after)) after = patch.apply(after)
  after = rewriteCitations(after)
  if (file === "vitest.config.ts") after = patchVitestConfig(after)
  if (codeFile(file)) {
    // a string that still names an old test file (a spawned script, a compared name) is not something to guess
    for (const [name] of fromStem) {
      const old = new RegExp(`["'\`/]${name.replace(/[.]/g, "\\.")}\\.(test\\.)?(ts|js)["'\`]`)
      if (old.test(after)) problems.push(`${file}: still names ${name} in a string`)
    }
  }
  if (after !== before || moves.has(file)) changed.set(newLocation(file), after)
}

console.log(`move-tests: ${moves.size} file(s) to move`)
for (const [from, to] of [...moves].sort((a, b) => a[1].localeCompare(b[1]))) console.log(`  ${from} -> ${to}`)
if (checkedExtras.length > 0)
  console.log(`engine-checked run leaves out (not in it before): ${checkedExtras.join(", ")}`)
const edited = [...changed.keys()].filter((f) => !targets.has(f))
console.log(`references rewritten in ${edited.length} other file(s): ${edited.sort().join(", ")}`)
if (problems.length > 0) {
  console.error(`move-tests: ${problems.length} reference(s) it cannot rewrite:`)
  for (const p of problems) console.error(`  ${p}`)
  process.exit(1)
}
if (dryRun) process.exit(0)

for (const [from, to] of moves) {
  mkdirSync(dirname(join(root, to)), { recursive: true })
  git("mv", from, to)
}
for (const [file, text] of changed) writeFileSync(join(root, file), text)
console.log("moved; run `npx tsc --noEmit -p .` and the moved tests")
