import { defineConfig } from "vitest/config"

export default defineConfig({
  test: {
    include: ["test/**/*.test.ts"],
    testTimeout: 120_000,
    hookTimeout: 120_000,
    globalSetup: ["test/support/globalSetup.ts"],
    pool: "forks",
    reporters: ["default", "json"],
    outputFile: { json: ".vitest-results.json" }
  }
})
