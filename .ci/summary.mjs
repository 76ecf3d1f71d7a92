// Prints `tests: N passed, M failed` from vitest's JSON reports of `npm test`: the main run (.vitest-results.json) and
// the checked engine run after it (.cache/vitest-results.engine-checked.json: the engine's tests again under glibc's heap
// checks, `vitest run --mode engine-checked`, npm test's posttest), summed.
// A failed type-check, layering, unused-code or format check (.ci/run), or a failed build, counts as one failure; a run
// that left no report counts as one failure (the checked run leaves none when the main run failed, since npm then stops
// before its posttest: that failure is already counted).
import { existsSync, readFileSync } from "node:fs"

const typecheckFailed = process.argv[2] === "1"
const testRc = Number(process.argv[3] ?? "1")
let passed = 0
let failed = 0
let skipped = 0
const read = (file) => {
  const report = JSON.parse(readFileSync(file, "utf8"))
  // Suites that failed to load (syntax errors, missing modules) hold no test results.
  const brokenSuites = (report.testResults ?? []).filter(
    (suite) => suite.status === "failed" && (suite.assertionResults ?? []).length === 0
  ).length
  return {
    passed: report.numPassedTests ?? 0,
    failed: (report.numFailedTests ?? 0) + brokenSuites,
    skipped: (report.numPendingTests ?? 0) + (report.numTodoTests ?? 0)
  }
}
const runs = [
  { file: ".vitest-results.json", name: "vitest" },
  { file: ".cache/vitest-results.engine-checked.json", name: "the checked engine run (MALLOC_CHECK_=3)" }
]
for (const { file, name } of runs) {
  if (existsSync(file)) {
    const r = read(file)
    passed += r.passed
    failed += r.failed
    skipped += r.skipped
    if (file !== runs[0].file) console.log(`${name}: ${r.passed} passed, ${r.failed} failed`)
  } else if (file === runs[0].file || failed === 0) {
    failed += 1
    console.log(`${name} left no JSON report (${file})`)
  } else {
    console.log(`${name} did not run (npm test stops at the main run's failures)`)
  }
}
if (typecheckFailed) {
  console.log("type-check, lint, format check or build failed (counted as one failure)")
  failed += 1
}
if (testRc !== 0 && failed === 0) failed = 1
// skipped tests (the GPU-only test on a machine without one) on their own line: the last line keeps its fixed shape
if (skipped > 0) console.log(`skipped: ${skipped} (not run here: see their describe lines for why)`)
console.log(`tests: ${passed} passed, ${failed} failed`)
process.exit(failed > 0 ? 1 : 0)
