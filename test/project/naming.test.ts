/**
 * Naming rules of the architecture issue (23) and its glossary (specs/GLOSSARY.md):
 * - no two exported things in src/ share a name (a Schema and its type of the same name are one thing; the
 *   per-module `make` and `layer`, `layerTest`, `layerWith`... of Effect's own packages are meant to repeat, always
 *   used through their module). A second `generate`, `alignUp` or `StagePlan` fails here;
 * - a glossary word is not used for another meaning where a syntax scan can tell: a step number is `step`, never
 *   `sequence` (the word for one stream inside a batch); a thing is exported under its own name, never re-exported
 *   under another (`NodeCapacity as AgentCapacity`); an exported layer is `layer` or `layer<Variant>`; the CLI flag
 *   `--nodes` takes node ids (`plan`), agents' host:port lists are `--agents`.
 */
import { readdirSync, readFileSync } from "node:fs"
import { join, relative } from "node:path"
import ts from "typescript"
import { describe, expect, it } from "vitest"

const root = join(import.meta.dirname, "..", "..", "src")
const files = (dir: string): Array<string> =>
  readdirSync(dir, { withFileTypes: true }).flatMap((e) =>
    e.isDirectory() ? files(join(dir, e.name)) : e.name.endsWith(".ts") ? [join(dir, e.name)] : []
  )
/** Names every module may export: its constructor and its layers (`layer`, `layerTest`, `layerWith`, ...). */
const idiom = (name: string) => name === "make" || /^layer([A-Z][A-Za-z0-9]*)?$/.test(name)

/** name -> modules declaring it (export const/let/function/class, export interface/type). */
const declared = (): Map<string, Set<string>> => {
  const byName = new Map<string, Set<string>>()
  for (const file of files(root)) {
    const text = readFileSync(file, "utf8")
    for (const m of text.matchAll(
      /^export (?:declare )?(?:const|let|function|class|interface|type|enum) ([A-Za-z0-9_$]+)/gm
    )) {
      const name = m[1]!
      if (idiom(name)) continue
      const set = byName.get(name) ?? new Set<string>()
      set.add(relative(root, file))
      byName.set(name, set)
    }
  }
  return byName
}

describe("exported names", () => {
  it("the scan sees the project's exports (a Schema with its type counts once)", () => {
    const names = declared()
    expect(names.size).toBeGreaterThan(200)
    expect([...(names.get("RunPlan") ?? [])]).toEqual(["domain/plan.ts"])
    expect(names.get("alignUp")?.size).toBe(1)
  })

  it("no two modules export the same name", () => {
    const twice = [...declared()]
      .filter(([, mods]) => mods.size > 1)
      .map(([n, mods]) => `${n}: ${[...mods].join(", ")}`)
    expect(twice).toEqual([])
  })
})

// ---------------------------------------------------------------------------------------------------------------
// Glossary words (syntax only: each src file parsed once, no type checking)
// ---------------------------------------------------------------------------------------------------------------

const parsed = files(root).map((file) => ({
  path: relative(root, file),
  sf: ts.createSourceFile(file, readFileSync(file, "utf8"), ts.ScriptTarget.Latest, true)
}))
const where = (path: string, sf: ts.SourceFile, node: ts.Node) =>
  `${path}:${sf.getLineAndCharacterOfPosition(node.getStart(sf)).line + 1}`
const nodesOf = <T extends ts.Node>(
  guard: (n: ts.Node) => n is T
): Array<{ path: string; sf: ts.SourceFile; node: T }> => {
  const out: Array<{ path: string; sf: ts.SourceFile; node: T }> = []
  for (const { path, sf } of parsed) {
    const visit = (n: ts.Node) => {
      if (guard(n)) out.push({ path, sf, node: n })
      ts.forEachChild(n, visit)
    }
    visit(sf)
  }
  return out
}
const isExported = (n: ts.Node) =>
  (ts.canHaveModifiers(n) ? (ts.getModifiers(n) ?? []) : []).some((m) => m.kind === ts.SyntaxKind.ExportKeyword)

/** A property `sequence`, `sequences`, `...Sequence` (a record's field, a Schema struct's, an object literal's). */
const sequenceField = /^(sequences?|[a-z][A-Za-z0-9]*Sequence)$/
const propertyNamed = (
  n: ts.Node
): n is ts.PropertySignature | ts.PropertyDeclaration | ts.PropertyAssignment | ts.ShorthandPropertyAssignment =>
  (ts.isPropertySignature(n) ||
    ts.isPropertyDeclaration(n) ||
    ts.isPropertyAssignment(n) ||
    ts.isShorthandPropertyAssignment(n)) &&
  ts.isIdentifier(n.name) &&
  sequenceField.test(n.name.text)

/** An exported const whose type says it is a layer (`: Layer.Layer<..>`, `(..): Layer.Layer<..> =>`, `= Layer.x(..)`). */
const layerConst = (d: ts.VariableDeclaration) => {
  const init = d.initializer
  const declaredType =
    d.type?.getText() ?? (init !== undefined && ts.isArrowFunction(init) ? (init.type?.getText() ?? "") : "")
  return (
    declaredType.startsWith("Layer.Layer<") ||
    (init !== undefined && ts.isCallExpression(init) && init.expression.getText().startsWith("Layer."))
  )
}

describe("glossary words keep one meaning (specs/GLOSSARY.md)", () => {
  it("a step number is `step`: no field named sequence/sequences/...Sequence, no `Sequence` type", () => {
    const fields = nodesOf(propertyNamed).map(
      ({ node, path, sf }) => `${(node.name as ts.Identifier).text} at ${where(path, sf, node)}`
    )
    const types = nodesOf(
      (n): n is ts.VariableDeclaration | ts.TypeAliasDeclaration | ts.InterfaceDeclaration =>
        (ts.isVariableDeclaration(n) || ts.isTypeAliasDeclaration(n) || ts.isInterfaceDeclaration(n)) &&
        ts.isIdentifier(n.name) &&
        /^Sequences?$/.test(n.name.text)
    ).map(({ node, path, sf }) => `${(node.name as ts.Identifier).text} at ${where(path, sf, node)}`)
    expect([...fields, ...types]).toEqual([])
  })

  it("one name per thing: nothing is re-exported under another name (`export { A as B }`)", () => {
    const aliases = nodesOf(ts.isExportSpecifier)
      .filter(({ node }) => node.propertyName !== undefined && node.propertyName.getText() !== node.name.getText())
      .map(
        ({ node, path, sf }) => `${node.propertyName!.getText()} as ${node.name.getText()} at ${where(path, sf, node)}`
      )
    expect(aliases).toEqual([])
  })

  it("an exported layer is named `layer` or `layer<Variant>`, used through its module", () => {
    const misnamed = nodesOf(ts.isVariableDeclaration)
      .filter(
        ({ node, path }) =>
          path.startsWith("layers/") &&
          isExported(node.parent.parent) &&
          ts.isIdentifier(node.name) &&
          layerConst(node) &&
          !/^layer([A-Z][A-Za-z0-9]*)?$/.test(node.name.text)
      )
      .map(({ node, path, sf }) => `${node.name.getText()} at ${where(path, sf, node)}`)
    expect(misnamed).toEqual([])
  })

  it("`--nodes` takes node ids (plan); a host:port list of agents is `--agents`", () => {
    const hostPortNodes = nodesOf(ts.isCallExpression)
      .filter(({ node }) => node.getText().startsWith(`Options.text("nodes")`) && node.getText().includes("host:port"))
      .map(({ node, path, sf }) => where(path, sf, node))
    expect(hostPortNodes).toEqual([])
  })

  it("the scans see what they look for (each rule is red on a sample)", () => {
    const sample = ts.createSourceFile(
      "sample.ts",
      [
        `export const F = Schema.Struct({ sequence: U32 })`,
        `export { NodeCapacity as AgentCapacity } from "../x.js"`,
        `export const StageExecutorLive: Layer.Layer<StageExecutor> = layerWith({})`,
        `const nodes = Options.text("nodes").pipe(Options.withDescription("agents host:port,..."))`
      ].join("\n"),
      ts.ScriptTarget.Latest,
      true
    )
    const found: Array<string> = []
    const visit = (n: ts.Node) => {
      if (propertyNamed(n)) found.push("sequence field")
      if (ts.isExportSpecifier(n) && n.propertyName !== undefined) found.push("alias")
      if (ts.isVariableDeclaration(n) && layerConst(n) && !/^layer/.test(n.name.getText())) found.push("layer name")
      if (
        ts.isCallExpression(n) &&
        n.getText().startsWith(`Options.text("nodes")`) &&
        n.getText().includes("host:port")
      ) {
        found.push("--nodes host:port")
      }
      ts.forEachChild(n, visit)
    }
    visit(sample)
    expect(found).toEqual(["sequence field", "alias", "layer name", "--nodes host:port"])
  })
})
