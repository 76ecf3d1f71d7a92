/**
 * No function longer than 80 lines without a reason written beside it (issue 37): a function is counted with what it
 * nests, and only the outermost long one of a nest is listed. A long function passes when the comment just above it
 * says why it stays whole (a line starting `// long:`), or when it is one of the known long functions in
 * `longFunctions.json` (each still to be cut into named steps) and has not grown by more than a few lines. So the list
 * only shrinks: a new long function, or a known one grown, fails here. `SWACTOR_WRITE_LONG_FUNCTIONS=1` rewrites the
 * list from the code (after a function was cut, to drop it).
 */
import { assert, describe, it } from "@effect/vitest"
import { execFileSync } from "node:child_process"
import { readFileSync, writeFileSync } from "node:fs"
import { join } from "node:path"
import ts from "typescript"
import { repoRoot } from "../support/models.js"

const LIMIT = 80
/** A known long function may grow this much (a fix inside it) before it must be cut first. */
const SLACK = 10
const baselinePath = join(repoRoot, "test", "project", "longFunctions.json")

interface LongFunction {
  readonly id: string
  readonly lines: number
  readonly reason: boolean
}

/** A function-like node's name: its own, its variable's, its property's or its class member's; else `<anonymous>`. */
const nameOf = (node: ts.Node): string => {
  if ((ts.isFunctionDeclaration(node) || ts.isMethodDeclaration(node) || ts.isGetAccessor(node)) && node.name)
    return node.name.getText()
  if (ts.isConstructorDeclaration(node)) return "constructor"
  const parent = node.parent
  if (ts.isVariableDeclaration(parent) || ts.isPropertyAssignment(parent) || ts.isPropertyDeclaration(parent))
    return parent.name.getText()
  if (ts.isCallExpression(parent)) return `${nameOf(parent)}(…)`
  return "<anonymous>"
}

const isFunction = (n: ts.Node): n is ts.FunctionLikeDeclaration =>
  ts.isFunctionDeclaration(n) ||
  ts.isArrowFunction(n) ||
  ts.isFunctionExpression(n) ||
  ts.isMethodDeclaration(n) ||
  ts.isConstructorDeclaration(n) ||
  ts.isGetAccessor(n)

/** The names of the named functions enclosing `node`, outermost first. */
const pathOf = (node: ts.Node): string => {
  const names: Array<string> = []
  for (let n: ts.Node | undefined = node; n !== undefined; n = n.parent) if (isFunction(n)) names.unshift(nameOf(n))
  return names.join(" > ")
}

/** Whether the lines just above `line` (0-based) hold a `// long:` reason. */
const hasReason = (lines: ReadonlyArray<string>, line: number) =>
  lines.slice(Math.max(0, line - 3), line).some((l) => l.trim().startsWith("// long:"))

const longFunctions = (): ReadonlyArray<LongFunction> => {
  const files = execFileSync("git", ["ls-files", "src/*.ts", "src/**/*.ts"], { cwd: repoRoot })
    .toString()
    .trim()
    .split("\n")
  const out: Array<LongFunction> = []
  for (const file of files) {
    const text = readFileSync(join(repoRoot, file), "utf8")
    const lines = text.split("\n")
    const source = ts.createSourceFile(file, text, ts.ScriptTarget.Latest, true)
    const visit = (node: ts.Node): void => {
      if (isFunction(node) && node.body !== undefined) {
        const start = source.getLineAndCharacterOfPosition(node.getStart()).line
        const end = source.getLineAndCharacterOfPosition(node.end).line
        if (end - start + 1 > LIMIT) {
          // the statement the function belongs to carries its reason (a `const f = (...) =>` starts a line above)
          const statementLine = source.getLineAndCharacterOfPosition(
            (ts.findAncestor(node, (n) => ts.isVariableStatement(n) || ts.isClassElement(n)) ?? node).getStart()
          ).line
          out.push({
            id: `${file} ${pathOf(node)}`,
            lines: end - start + 1,
            reason: hasReason(lines, Math.min(start, statementLine))
          })
          return // what it nests is counted with it
        }
      }
      ts.forEachChild(node, visit)
    }
    visit(source)
  }
  return out
}

describe("function length", () => {
  it("no function over 80 lines without a reason beside it, beyond the known ones (which may only shrink)", () => {
    const found = longFunctions()
    const unexplained = found.filter((f) => !f.reason)
    if (process.env["SWACTOR_WRITE_LONG_FUNCTIONS"] === "1") {
      const list = Object.fromEntries(unexplained.map((f) => [f.id, f.lines]))
      writeFileSync(baselinePath, `${JSON.stringify(list, null, 2)}\n`)
    }
    const known = JSON.parse(readFileSync(baselinePath, "utf8")) as Record<string, number>
    const problems: Array<string> = []
    for (const f of unexplained) {
      const allowed = known[f.id]
      if (allowed === undefined)
        problems.push(`${f.id}: ${f.lines} lines, new (cut it into named steps, or say why above it: // long: ...)`)
      else if (f.lines > allowed + SLACK) problems.push(`${f.id}: ${f.lines} lines, grown from ${allowed}`)
    }
    assert.deepStrictEqual(problems, [])
    // the list names only functions that still exist and are still long (a cut one leaves it)
    const stale = Object.keys(known).filter((id) => !unexplained.some((f) => f.id === id))
    assert.deepStrictEqual(stale, [], "known long functions no longer long: rewrite the list")
    console.log(
      `long functions: ${unexplained.length} known, still to be cut; ${found.length - unexplained.length} with a reason`
    )
  })
})
