#!/usr/bin/env node
/**
 * Issue 23's vocabulary renames (specs/GLOSSARY.md), applied with the TypeScript language service: every symbol is
 * found by its name and a rule on its declaration (file pattern, kind, type text), never by line number, and renamed
 * with `findRenameLocations` over src/, test/, bench/ (tsconfig.json's program) and examples/, so references through
 * Schema structs, unions and imports follow. A rule that finds nothing is printed and skipped, so the script runs on a
 * tree that changed since it was written (files split or moved). Strings (CLI flags, messages, the index's re-exports)
 * are explicit text edits with a file pattern; a pattern that matches nothing is printed too.
 *
 *   node scripts/rename.mjs            apply, print what was renamed and what was not found
 *   node scripts/rename.mjs --dry-run  print only
 *
 * Re-running on a renamed tree finds nothing to do (every rule reports "not found"). It needs `typescript` (a dev
 * dependency) and takes about a minute (one language-service program over src, test, bench and examples).
 */
import { existsSync, readdirSync, readFileSync, writeFileSync } from "node:fs"
import { basename, join, relative } from "node:path"
import ts from "typescript"

const root = process.cwd()
const dryRun = process.argv.includes("--dry-run")
const started = performance.now()
const rel = (f) => relative(root, f).split("\\").join("/")

// ---------------------------------------------------------------------------------------------------------------
// The renames
// ---------------------------------------------------------------------------------------------------------------

const typeText = (decl) => decl.type?.getText() ?? ""
const initText = (decl) => decl.initializer?.getText() ?? ""
const propertyKinds = new Set([
  ts.SyntaxKind.PropertySignature,
  ts.SyntaxKind.PropertyDeclaration,
  ts.SyntaxKind.PropertyAssignment
])
const valueKinds = new Set([
  ts.SyntaxKind.VariableDeclaration,
  ts.SyntaxKind.FunctionDeclaration,
  ts.SyntaxKind.ClassDeclaration,
  ts.SyntaxKind.InterfaceDeclaration,
  ts.SyntaxKind.TypeAliasDeclaration
])
const exported = (decl) => {
  const statement = ts.isVariableDeclaration(decl) ? decl.parent.parent : decl
  return (ts.getModifiers?.(statement) ?? []).some((m) => m.kind === ts.SyntaxKind.ExportKeyword)
}

/**
 * Each rule: `name` -> `to` for the declarations named `name` of `kind` ("property" or "value") in files matching
 * `files`, kept by `where(decl)` when given. `layer`: an exported layer renamed inside its module; importers that
 * named it get a namespace import (`import * as StageExecutorLive` ... `StageExecutorLive.layer`).
 */
const stepFiles = /^src\/(domain|services|layers|api)\//
const rules = [
  // "sequence" was both a frame's step number and a stream inside a batch: the step number is now `step`.
  { why: "frame/step number", kind: "property", files: stepFiles, name: "sequence", to: "step" },
  { why: "frame/step number", kind: "property", files: stepFiles, name: "sequences", to: "steps" },
  { why: "frame/step number", kind: "property", files: stepFiles, name: "expectedSequence", to: "expectedStep" },
  { why: "frame/step number", kind: "property", files: stepFiles, name: "sourceSequence", to: "sourceStep" },
  { why: "frame/step number", kind: "property", files: stepFiles, name: "worstSequence", to: "worstStep" },
  { why: "frame/step number", kind: "property", files: stepFiles, name: "initialSequence", to: "initialStep" },
  { why: "frame/step number", kind: "property", files: stepFiles, name: "nextSequence", to: "nextStep" },
  // a third "sequence": the stop string that ended a generation (OpenAI's and Anthropic's "stop sequence") is stop text
  { why: "stop text", kind: "property", files: stepFiles, name: "stopSequence", to: "stopText" },
  // tests and benches: untyped literals that reach a renamed type later (`fc.record({ sequence: u32 })`, `{ sequence, ... }`)
  { why: "frame/step number", kind: "property", files: /^(test|bench|examples)\//, name: "sequence", to: "step" },
  { why: "frame/step number", kind: "value", files: /^src\/domain\/frames\.ts$/, name: "Sequence", to: "StepNumber" },
  // `--nodes` meant node ids in `plan` and agents' host:port in `run`/`serve`: host:port lists are `agents`.
  {
    why: "host:port list",
    kind: "property",
    files: /^src\/(api|cli|layers\/agent)\//,
    name: "nodes",
    to: "agents",
    // `plan --nodes 10,11,12` (node ids: `readonly nodes: string`, described as "node hosting each stage") stays
    where: (d) =>
      ["ReadonlyArray<string>", "Option.Option<string>"].includes(typeText(d)) ||
      (initText(d).startsWith(`Options.text("nodes")`) && initText(d).includes("host:port"))
  },
  { why: "host:port list", kind: "value", files: /^src\/cli\//, name: "nodeList", to: "agentList" },
  // Layers: `layer`, `layer<Variant>`, `make` inside their module, used through it (Effect's packages' shape).
  {
    why: "layer style",
    kind: "value",
    files: /\/StageExecutorLive\.ts$/,
    name: "StageExecutorLive",
    to: "layer",
    layer: true
  },
  {
    why: "layer style",
    kind: "value",
    files: /\/StageExecutorTest\.ts$/,
    name: "layerTest",
    to: "layerWith",
    layer: true
  },
  {
    why: "layer style",
    kind: "value",
    files: /\/StageExecutorTest\.ts$/,
    name: "StageExecutorTest",
    to: "layer",
    layer: true
  },
  {
    why: "layer style",
    kind: "value",
    files: /\/AgentPools\.ts$/,
    name: "localAgentPool",
    to: "layerLocal",
    layer: true
  },
  {
    why: "layer style",
    kind: "value",
    files: /\/AgentPools\.ts$/,
    name: "remoteAgentPool",
    to: "layerRemote",
    layer: true
  },
  {
    why: "layer style",
    kind: "value",
    files: /\/AgentLinksLive\.ts$/,
    name: "dataPlaneLayer",
    to: "layerDataPlane",
    layer: true
  }
]

/**
 * Text edits, applied after the semantic renames: [file pattern, from (string or RegExp, all matches), to]. The old
 * `--nodes` of `run` and `serve` stays as an alias of `--agents` (Options.withAlias), so no command line breaks;
 * `plan --nodes` keeps its name (node ids).
 */
const hostPortCli = /^src\/cli\/(?!Plan)/
const textEdits = [
  // frame/step number
  [/^(src|test|bench)\//, `"SequenceNotInFlight"`, `"StepNotInFlight"`],
  [/^src\//, "`no token came back for sequence ${reason.step}", "`no token came back for step ${reason.step}"],
  [/^src\//, `"sequence must fit in u32"`, `"step must fit in u32"`],
  // --agents (alias --nodes) in run and serve
  [hostPortCli, `Options.text("nodes").pipe(`, `Options.text("agents").pipe(\n      Options.withAlias("nodes"),`],
  [hostPortCli, /`--nodes "\$\{text\}" names no node: /g, '`--agents "${text}" names no agent: '],
  // no colon after the flag: the CLI tests read "agents:" on stderr as the run's start-up line
  [hostPortCli, /`--nodes: "\$\{node\}" is not host:port`/g, '`--agents "${node}" is not host:port`'],
  [hostPortCli, "`--nodes needs the cluster token", "`--agents needs the cluster token"],
  [hostPortCli, "/** `--nodes host:port,host:port`", "/** `--agents host:port,host:port` (alias `--nodes`)"],
  [hostPortCli, /with --nodes\b/g, "with --agents"],
  [hostPortCli, "remote --nodes", "remote --agents"],
  [hostPortCli, "Without --nodes it", "Without --agents it"],
  [
    hostPortCli,
    "Options.withDescription(`remote agents host:port,... (token from",
    "Options.withDescription(`agents host:port,... (alias --nodes; token from"
  ],
  [/^src\/api\//, "`layerRemote({ nodes, token })`", "`layerRemote({ agents, token })`"],
  [/^src\/api\//, "at `nodes`, which share", "at `agents`, which share"],
  // tests and benches of run/serve (by content, wherever the test files have moved): `"--nodes", <host:port or an
  // expression>` becomes `"--agents", ...`; node-id lists (plan) and the two refusals of cli.defects that give no
  // host:port (`","`, `"hostwithoutport"`) keep `--nodes`, which proves the alias
  [/^(test|bench)\//, /\/--nodes "," names no node\//g, `/--agents "," names no agent/`],
  [
    /^(test|bench)\//,
    /\/--nodes: "hostwithoutport" is not host:port\//g,
    `/--agents "hostwithoutport" is not host:port/`
  ],
  [/^(test|bench)\//, /"--nodes",(\s*)(?=[^"\s]|"[^"]*:)/g, `"--agents",$1`],
  [/^(test|bench)\//, /\b(run|serve) --nodes\b/g, "$1 --agents"],
  [/^README\.md$/, /(run|serve) --nodes\b/g, "$1 --agents"],
  [/^README\.md$/, "[--stages N | --nodes host:port,...]", "[--stages N | --agents host:port,...]"],
  [/^README\.md$/, "auto = with `--nodes`", "auto = with `--agents`"],
  [/^README\.md$/, "with `--nodes`, one per node", "with `--agents`, one per agent"],
  [/^README\.md$/, "With `--nodes`, a node keeps", "With `--agents`, a node keeps"],
  [/^specs\/BEHAVIOR_GUARANTEES\.md$/, "`localAgentPool({ prestart: n })`", "`AgentPools.layerLocal({ prestart: n })`"]
]

/** Text edits to the library entry, applied before the semantic renames (so these lines are not renamed again). */
const entryEdits = [
  // The library entry: one name per thing (no `NodeCapacity as AgentCapacity`), implementation modules as namespaces.
  [/^src\/index\.ts$/, /\n  NodeCapacity as AgentCapacity,/g, ""],
  [
    /^src\/index\.ts$/,
    `export { localAgentPool, remoteAgentPool } from "./layers/agent/AgentPools.js"`,
    `export * as AgentPools from "./layers/agent/AgentPools.js"`
  ],
  [
    /^src\/index\.ts$/,
    /export \{ layerWith as stageExecutorLayerWith, LiveLoadedStage, StageExecutorLive \} from "\.\/layers\/engine\/StageExecutorLive\.js"\nexport type \{ LiveOptions as StageExecutorLiveOptions \} from "\.\/layers\/engine\/StageExecutorLive\.js"/,
    `export * as StageExecutorLive from "./layers/engine/StageExecutorLive.js"`
  ],
  [
    /^src\/index\.ts$/,
    /export \{\n  defaultTestModel,\n  layerTest as stageExecutorLayerTest,\n  StageExecutorTest,\n  testModelGreedy,\n  testModelNextToken\n\} from "\.\/layers\/engine\/StageExecutorTest\.js"\nexport type \{ TestModel \} from "\.\/layers\/engine\/StageExecutorTest\.js"/,
    `export * as StageExecutorTest from "./layers/engine/StageExecutorTest.js"`
  ]
]

// ---------------------------------------------------------------------------------------------------------------
// The language service over the project (tsconfig.json: src, test, bench) and examples/
// ---------------------------------------------------------------------------------------------------------------

const config = ts.getParsedCommandLineOfConfigFile(
  join(root, "tsconfig.json"),
  {},
  {
    ...ts.sys,
    onUnRecoverableConfigFileDiagnostic: (d) => {
      throw new Error(ts.flattenDiagnosticMessageText(d.messageText, "\n"))
    }
  }
)
const walk = (dir) =>
  existsSync(dir)
    ? readdirSync(dir, { withFileTypes: true }).flatMap((e) =>
        e.name === "node_modules"
          ? []
          : e.isDirectory()
            ? walk(join(dir, e.name))
            : e.name.endsWith(".ts")
              ? [join(dir, e.name)]
              : []
      )
    : []
const sources = new Map()
for (const f of [...config.fileNames, ...walk(join(root, "examples"))])
  sources.set(f, { version: 0, text: readFileSync(f, "utf8") })

/** Applies text edits [pattern, from, to] to the files of `files` (repo-relative -> absolute); unmatched ones listed. */
const untouched = []
const applyText = (list, files) => {
  let count = 0
  for (const [pattern, from, to] of list) {
    let hits = 0
    for (const [r, f] of files) {
      if (!pattern.test(r)) continue
      const entry = sources.get(f)
      let text
      if (typeof from === "string") {
        hits += entry.text.split(from).length - 1
        text = entry.text.split(from).join(to)
      } else {
        const re = from.global ? from : new RegExp(from.source, from.flags + "g")
        hits += [...entry.text.matchAll(re)].length
        text = entry.text.replace(re, to)
      }
      if (text !== entry.text) sources.set(f, { version: entry.version + 1, text })
    }
    if (hits === 0) untouched.push(`${String(from).slice(0, 90)} (in ${pattern})`)
    count += hits
  }
  return count
}
const textFiles = new Map([...sources.keys()].map((f) => [rel(f), f]))
let textCount = applyText(entryEdits, textFiles)

const makeService = () =>
  ts.createLanguageService({
    getScriptFileNames: () => [...sources.keys()],
    getScriptVersion: (f) => String(sources.get(f)?.version ?? 0),
    getScriptSnapshot: (f) => {
      const text = sources.get(f)?.text ?? ts.sys.readFile(f)
      return text === undefined ? undefined : ts.ScriptSnapshot.fromString(text)
    },
    getCurrentDirectory: () => root,
    getCompilationSettings: () => config.options,
    getDefaultLibFileName: ts.getDefaultLibFilePath,
    fileExists: ts.sys.fileExists,
    readFile: ts.sys.readFile,
    readDirectory: ts.sys.readDirectory,
    directoryExists: ts.sys.directoryExists,
    getDirectories: ts.sys.getDirectories
  })

/** Applies `edits` ({ file, start, end, text }) to `sources`, last first; overlapping edits: the first kept, printed. */
const applyEdits = (edits) => {
  const byFile = new Map()
  for (const e of edits) byFile.set(e.file, [...(byFile.get(e.file) ?? []), e])
  let count = 0
  for (const [file, list] of byFile) {
    list.sort((a, b) => b.start - a.start || a.end - b.end)
    let text = sources.get(file).text
    let floor = Infinity
    const seen = new Set()
    for (const e of list) {
      const key = `${e.start}:${e.end}`
      if (seen.has(key)) continue
      seen.add(key)
      if (e.end > floor) {
        console.log(`  conflict at ${rel(file)}:${e.start} (${e.text}), kept the other edit`)
        continue
      }
      text = text.slice(0, e.start) + e.text + text.slice(e.end)
      floor = e.start
      count++
    }
    sources.set(file, { version: sources.get(file).version + 1, text })
  }
  return count
}

// ---------------------------------------------------------------------------------------------------------------
// Pass 0 (syntax only): files that import a layer about to be renamed (`import { StageExecutorLive } from
// ".../StageExecutorLive.js"`) take its module as a namespace first (`StageExecutorLive.StageExecutorLive`), so that
// the rename gives `StageExecutorLive.layer` and never a second `layer` (or `layerLocal`) in the importing file.
// ---------------------------------------------------------------------------------------------------------------

const layerModules = [] // { module (absolute, no extension), from }
for (const rule of rules.filter((r) => r.layer)) {
  for (const [file, entry] of sources) {
    if (rule.files.test(rel(file)) && new RegExp(`^export const ${rule.name}\\b`, "m").test(entry.text)) {
      layerModules.push({ module: file.replace(/\.ts$/, ""), from: rule.name })
    }
  }
}
let namespaced = 0
for (const [file, entry] of sources) {
  const sf = ts.createSourceFile(file, entry.text, ts.ScriptTarget.Latest, true)
  const fileEdits = []
  const rewrites = new Map() // local name -> `Ns.exportedName`
  for (const statement of sf.statements) {
    if (!ts.isImportDeclaration(statement) || statement.importClause?.isTypeOnly) continue
    const spec = statement.moduleSpecifier.text
    if (!spec.startsWith(".")) continue
    const target = join(file, "..", spec).replace(/\.js$/, "")
    const names = layerModules.filter((m) => m.module === target).map((m) => m.from)
    const bindings = statement.importClause?.namedBindings
    if (names.length === 0 || bindings === undefined || !ts.isNamedImports(bindings)) continue
    const ns = basename(target)
    const moved = bindings.elements.filter((e) => !e.isTypeOnly && names.includes((e.propertyName ?? e.name).text))
    if (moved.length === 0) continue
    for (const e of moved) rewrites.set(e.name.text, `${ns}.${(e.propertyName ?? e.name).text}`)
    const kept = bindings.elements.filter((e) => !moved.includes(e)).map((e) => e.getText(sf))
    const hasNamespace = sf.statements.some(
      (s) =>
        ts.isImportDeclaration(s) &&
        s.moduleSpecifier.text === spec &&
        s.importClause?.namedBindings !== undefined &&
        ts.isNamespaceImport(s.importClause.namedBindings) &&
        s.importClause.namedBindings.name.text === ns
    )
    const lines = [
      ...(kept.length > 0 ? [`import { ${kept.join(", ")} } from "${spec}"`] : []),
      ...(hasNamespace ? [] : [`import * as ${ns} from "${spec}"`])
    ]
    fileEdits.push({ file, start: statement.getStart(sf), end: statement.getEnd(), text: lines.join("\n") })
  }
  if (rewrites.size === 0) continue
  const visit = (node) => {
    if (ts.isImportDeclaration(node)) return
    if (ts.isIdentifier(node) && rewrites.has(node.text)) {
      const p = node.parent
      const isName =
        (ts.isPropertyAccessExpression(p) && p.name === node) ||
        (ts.isPropertyAssignment(p) && p.name === node) ||
        (ts.isQualifiedName(p) && p.right === node) ||
        (ts.isPropertySignature(p) && p.name === node)
      if (!isName) {
        const text = ts.isShorthandPropertyAssignment(p)
          ? `${node.text}: ${rewrites.get(node.text)}`
          : rewrites.get(node.text)
        fileEdits.push({ file, start: node.getStart(sf), end: node.getEnd(), text })
      }
    }
    ts.forEachChild(node, visit)
  }
  visit(sf)
  if (applyEdits(fileEdits) > 0) namespaced++
}

// ---------------------------------------------------------------------------------------------------------------
// Pass 1: semantic renames
// ---------------------------------------------------------------------------------------------------------------

const service = makeService()
const program = service.getProgram()
const edits = []
const notFound = []
const report = []
const claimed = new Map() // file:start -> rule name (two rules on one location: the first wins)
const shorthands = [] // `{ sequence, ... }` in a literal no renamed type reaches: `{ step: sequence, ... }`
const skipped = []

for (const rule of rules) {
  const decls = []
  for (const sf of program.getSourceFiles()) {
    if (!sources.has(sf.fileName) || !rule.files.test(rel(sf.fileName))) continue
    const visit = (node) => {
      if (ts.isIdentifier(node) && node.text === rule.name && node.parent?.name === node) {
        const d = node.parent
        const kinds = rule.kind === "property" ? propertyKinds : valueKinds
        if (kinds.has(d.kind) && (rule.where === undefined || rule.where(d)) && (!rule.layer || exported(d))) {
          decls.push({ sf, node })
        } else if (rule.kind === "property" && rule.where === undefined && ts.isShorthandPropertyAssignment(d)) {
          shorthands.push({ sf, node, rule })
        }
      }
      ts.forEachChild(node, visit)
    }
    visit(sf)
  }
  if (decls.length === 0) {
    notFound.push(`${rule.name} -> ${rule.to} (${rule.kind} in ${rule.files})`)
    continue
  }
  const where = new Set()
  let n = 0
  for (const { sf, node } of decls) {
    const locations =
      service.findRenameLocations(sf.fileName, node.getStart(sf), false, false, {
        providePrefixAndSuffixTextForRename: true
      }) ?? []
    const outside = locations.find((l) => !sources.has(l.fileName))
    if (outside !== undefined) {
      // a key of another package's type (node-llama-cpp's `sequences`...): not ours to rename
      skipped.push(
        `${rule.name} at ${rel(sf.fileName)}:${sf.getLineAndCharacterOfPosition(node.getStart(sf)).line + 1} (declared in ${outside.fileName})`
      )
      continue
    }
    for (const l of locations) {
      const key = `${l.fileName}:${l.textSpan.start}`
      if (claimed.has(key)) continue
      claimed.set(key, rule.name)
      edits.push({
        file: l.fileName,
        start: l.textSpan.start,
        end: l.textSpan.start + l.textSpan.length,
        text: `${l.prefixText ?? ""}${rule.to}${l.suffixText ?? ""}`
      })
      where.add(rel(l.fileName))
      n++
    }
  }
  report.push(
    `${rule.name} -> ${rule.to} [${rule.why}]: ${decls.length} declaration(s) (${[...new Set(decls.map((d) => rel(d.sf.fileName)))].join(", ")}), ` +
      `${n} location(s) in ${where.size} file(s)`
  )
}
for (const { sf, node, rule } of shorthands) {
  const start = node.getStart(sf)
  if (claimed.has(`${sf.fileName}:${start}`)) continue
  claimed.set(`${sf.fileName}:${start}`, rule.name)
  edits.push({ file: sf.fileName, start, end: node.getEnd(), text: `${rule.to}: ${rule.name}` })
  report.push(`${rule.name} -> ${rule.to} [${rule.why}]: shorthand in an untyped literal at ${rel(sf.fileName)}`)
}
const renamed = applyEdits(edits)

// ---------------------------------------------------------------------------------------------------------------
// Pass 3: text edits (flags, messages, the library entry), on every file a pattern names
// ---------------------------------------------------------------------------------------------------------------

for (const extra of ["README.md", "specs/BEHAVIOR_GUARANTEES.md"]) {
  const f = join(root, extra)
  if (existsSync(f)) {
    sources.set(f, { version: 0, text: readFileSync(f, "utf8") })
    textFiles.set(extra, f)
  }
}
textCount += applyText(textEdits, textFiles)

// ---------------------------------------------------------------------------------------------------------------
// Write and report
// ---------------------------------------------------------------------------------------------------------------

let written = 0
for (const [file, entry] of sources) {
  if (entry.version === 0) continue
  if (!dryRun) writeFileSync(file, entry.text)
  written++
}
console.log(`renamed (semantic, ${renamed} locations):`)
for (const line of report) console.log(`  ${line}`)
console.log(`importers turned to namespace imports: ${namespaced} file(s)`)
console.log(`text edits: ${textCount}`)
if (skipped.length > 0) console.log(`left alone (another package's property):\n  ${skipped.join("\n  ")}`)
if (notFound.length > 0) console.log(`not found (skipped):\n  ${notFound.join("\n  ")}`)
if (untouched.length > 0) console.log(`text patterns that matched nothing:\n  ${untouched.join("\n  ")}`)
console.log(
  `${dryRun ? "would write" : "wrote"} ${written} file(s) in ${((performance.now() - started) / 1000).toFixed(1)} s`
)
