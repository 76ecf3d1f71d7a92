import { defineConfig } from "vitest/config"
import { mallocCheckEnv } from "./test/support/mallocChecks.js"

/**
 * The few-row route's row limit for every stage agent a test starts (agents inherit the test's environment): fixed, so
 * that no test lets the machine's timing choose the kernel its "batched = alone" assertions depend on (8 rows: the
 * one-row kernel, exact by design). In-process engine tests force each choice through LiveOptions.smallBatchRows.
 */
const forcedPaths = { SWACTOR_GEMV_MAX_ROWS: "8" }

/** Test files that drive ggml through koffi: run again by the checked run. */
const engineTests = ["test/engine/*.test.ts"]

/** Files in test/engine/ that the checked run leaves out: it runs the engine files it ran before they moved. */
const engineTestsUnchecked = [
  "test/engine/speedProbe.test.ts",
  "test/engine/stageExecutorSlowed.test.ts",
  "test/engine/stageExecutorTest.test.ts"
]

export default defineConfig(({ mode }) =>
  mode === "engine-checked"
    ? {
        // `vitest run --mode engine-checked` (npm test's posttest): the engine's tests once more, each worker process
        // started with glibc's heap checks (test/support/mallocChecks.ts), so a heap corruption aborts at the free of
        // the corrupted block; the setup file fails every file whose worker is not really checked. Its own report,
        // which .ci/summary.mjs adds to the main run's.
        test: {
          include: engineTests,
          exclude: engineTestsUnchecked,
          testTimeout: 240_000,
          hookTimeout: 240_000,
          globalSetup: ["test/support/globalSetup.ts"],
          setupFiles: ["test/support/mallocChecks.setup.ts"],
          pool: "forks",
          env: { ...forcedPaths, ...mallocCheckEnv() },
          reporters: ["default", "json"],
          outputFile: { json: ".cache/vitest-results.engine-checked.json" }
        }
      }
    : {
        test: {
          include: ["test/**/*.test.ts"],
          testTimeout: 120_000,
          hookTimeout: 120_000,
          globalSetup: ["test/support/globalSetup.ts"],
          pool: "forks",
          env: forcedPaths,
          reporters: ["default", "json"],
          outputFile: { json: ".vitest-results.json" }
        }
      }
)
