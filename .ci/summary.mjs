// Prints `tests: N passed, M failed` from vitest's JSON report (.vitest-results.json).
// A failed type-check counts as one failure; a run that left no report counts as one failure.
import { existsSync, readFileSync } from "node:fs"

const typecheckFailed = process.argv[2] === "1"
const testRc = Number(process.argv[3] ?? "1")
let passed = 0
let failed = 0
let skipped = 0
if (existsSync(".vitest-results.json")) {
  const report = JSON.parse(readFileSync(".vitest-results.json", "utf8"))
  passed = report.numPassedTests ?? 0
  failed = report.numFailedTests ?? 0
  skipped = (report.numPendingTests ?? 0) + (report.numTodoTests ?? 0)
  // Suites that failed to load (syntax errors, missing modules) hold no test results.
  const brokenSuites = (report.testResults ?? []).filter(
    (suite) => suite.status === "failed" && (suite.assertionResults ?? []).length === 0
  ).length
  failed += brokenSuites
} else {
  failed = 1
  console.log("vitest left no JSON report")
}
if (typecheckFailed) {
  console.log("type-check failed (counted as one failure)")
  failed += 1
}
if (testRc !== 0 && failed === 0) failed = 1
// skipped tests (the GPU-only test on a machine without one) on their own line: the last line keeps its fixed shape
if (skipped > 0) console.log(`skipped: ${skipped} (not run here: see their describe lines for why)`)
console.log(`tests: ${passed} passed, ${failed} failed`)
process.exit(failed > 0 ? 1 : 0)
