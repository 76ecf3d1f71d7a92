// The built command (scripts/build.mjs, run by the tests' global setup): dist/main.js runs the bundle dist/swactor.cjs
// with the V8 code cache made at build time, and V8 takes it (a process then compiles almost nothing at start).
import { describe, expect, it } from "vitest"
import { execFile } from "node:child_process"
import { readdirSync } from "node:fs"
import { join } from "node:path"
import { repoRoot } from "../support/models.js"

const swactor = (args: ReadonlyArray<string>, env: Record<string, string>) =>
  new Promise<{ code: number; stdout: string; stderr: string }>((resolve) =>
    execFile(
      process.execPath,
      [join(repoRoot, "dist", "main.js"), ...args],
      { env: { ...process.env, ...env }, timeout: 60_000 },
      (error, stdout, stderr) =>
        resolve({ code: error ? (typeof error.code === "number" ? error.code : 1) : 0, stdout, stderr })
    )
  )

describe("the build", () => {
  it("dist/main.js runs the bundle with its code cache, which V8 accepts", async () => {
    const dist = readdirSync(join(repoRoot, "dist"))
    expect(dist).toContain("swactor.cjs")
    expect(dist.filter((f) => f.endsWith(".v8cache"))).toHaveLength(1)
    const ran = await swactor(["plan", "--layers", "8", "--stages", "2", "--nodes", "1,2"], {
      SWACTOR_CODE_CACHE: "check"
    })
    expect(ran.code, ran.stderr).toBe(0)
    expect(ran.stderr).toContain("swactor: code cache used")
    expect(ran.stdout).toMatch(/stage/i)
  })
})
