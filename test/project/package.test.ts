// The package as a user gets it (P6 in specs/BEHAVIOR_GUARANTEES.md): `npm pack`, installed into an empty folder, then
// a plain Node ESM program imports the library and generates 8 tokens on stories260K, the "swactor/testing" entry
// holds the harnesses the main entry leaves out, a TypeScript consumer type-checks against the shipped .d.ts of both,
// and `npx swactor plan` runs the shipped bin.
//
// Installing: this machine has no registry access and npm's offline cache holds the dependencies' tarballs but not
// their registry metadata, so `npm install --offline <tarball>` cannot resolve them (ENOTCACHED). The test does what
// npm would do with the tarball itself (unpack it to node_modules/swactor, link its bin into node_modules/.bin with
// the executable bit) and links only the package's declared `dependencies` next to it from this checkout's
// node_modules: an import of anything else (a dev dependency, a file left out of `files`) fails here as it would
// for a user.
import { describe, expect, it } from "vitest"
import { execFile, execFileSync } from "node:child_process"
import {
  chmodSync,
  existsSync,
  mkdirSync,
  mkdtempSync,
  readdirSync,
  readFileSync,
  rmSync,
  symlinkSync,
  writeFileSync
} from "node:fs"
import { createRequire } from "node:module"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { repoRoot, requireModel } from "../support/models.js"

const run = (command: string, args: ReadonlyArray<string>, cwd: string) =>
  new Promise<{ code: number; stdout: string; stderr: string }>((resolve) =>
    execFile(command, args, { cwd, timeout: 60_000 }, (error, stdout, stderr) =>
      resolve({ code: error ? (typeof error.code === "number" ? error.code : 1) : 0, stdout, stderr })
    )
  )

describe("the npm package", () => {
  it("npm pack → install in an empty folder → plain Node imports it and generates; types check; npx swactor plan", async () => {
    const model = requireModel("stories260K.gguf")
    const dir = mkdtempSync(join(tmpdir(), "swactor-pack-test-"))
    try {
      // dist/ is already built (the tests' global setup); --ignore-scripts: no second build under the other tests.
      const packed = execFileSync("npm", ["pack", "--ignore-scripts", "--json", "--pack-destination", dir], {
        cwd: repoRoot,
        encoding: "utf8"
      })
      const [info] = JSON.parse(packed) as Array<{ filename: string; files: Array<{ path: string }> }>
      const shipped = info!.files.map((f) => f.path)
      expect(shipped).toContain("dist/index.js")
      expect(shipped).toContain("dist/index.d.ts")
      expect(shipped).toContain("dist/main.js")
      expect(shipped).toContain("dist/testing.js")
      expect(shipped).toContain("dist/testing.d.ts")
      expect(
        shipped.filter((p) => p.startsWith("test/") || p.startsWith("src/") || p.endsWith(".tsbuildinfo"))
      ).toEqual([])

      const consumer = join(dir, "consumer")
      const pkgDir = join(consumer, "node_modules", "swactor")
      mkdirSync(pkgDir, { recursive: true })
      writeFileSync(join(consumer, "package.json"), JSON.stringify({ name: "consumer", private: true, type: "module" }))
      execFileSync("tar", ["xzf", join(dir, info!.filename), "-C", pkgDir, "--strip-components=1"])
      const manifest = JSON.parse(readFileSync(join(pkgDir, "package.json"), "utf8")) as {
        bin: Record<string, string>
        dependencies: Record<string, string>
        exports: Record<string, unknown>
      }
      // Two entries: the library ("swactor") and its test doubles and harnesses ("swactor/testing").
      expect(Object.keys(manifest.exports).sort()).toEqual([".", "./package.json", "./testing"])
      expect(manifest.exports["./testing"]).toEqual({
        types: "./dist/testing.d.ts",
        import: "./dist/testing.js",
        default: "./dist/testing.js"
      })
      mkdirSync(join(pkgDir, "node_modules", "@effect"), { recursive: true })
      for (const dep of Object.keys(manifest.dependencies)) {
        symlinkSync(join(repoRoot, "node_modules", dep), join(pkgDir, "node_modules", dep))
      }
      // As npm hoists the package's own dependency: the consumer's `import "effect"` finds it.
      symlinkSync(join(repoRoot, "node_modules", "effect"), join(consumer, "node_modules", "effect"))
      mkdirSync(join(consumer, "node_modules", ".bin"))
      chmodSync(join(pkgDir, manifest.bin["swactor"]!), 0o755)
      symlinkSync(join("..", "swactor", manifest.bin["swactor"]!), join(consumer, "node_modules", ".bin", "swactor"))

      // A plain .mjs: no loader, no TypeScript.
      writeFileSync(
        join(consumer, "generate.mjs"),
        `import { createClient } from "swactor"
const client = createClient({ threads: 1 })
const tokens = []
for await (const token of client.stream({ model: ${JSON.stringify(model)}, prompt: "Once upon a time", stages: 1, maxTokens: 8 })) tokens.push(token.text)
await client.close()
console.log(JSON.stringify(tokens))
`
      )
      // The main entry leaves the harnesses and wire internals to "swactor/testing" or to itself.
      writeFileSync(
        join(consumer, "entries.mjs"),
        `import * as swactor from "swactor"
import * as testing from "swactor/testing"
const internals = ["OrchestratorHarness", "StageExecutorTest", "TokenizerTest", "Framing", "ShmRing"]
console.log(JSON.stringify({
  main: internals.filter((name) => name in swactor),
  testing: internals.filter((name) => name in testing),
  harness: typeof testing.OrchestratorHarness.make,
  namespaces: ["Plan", "RunFsm", "Gguf", "Engine", "Transport"].filter((name) => typeof swactor[name] === "object")
}))
`
      )
      const entries = await run(process.execPath, ["entries.mjs"], consumer)
      expect(entries.code, entries.stderr).toBe(0)
      expect(JSON.parse(entries.stdout)).toEqual({
        main: [],
        testing: ["OrchestratorHarness", "StageExecutorTest", "TokenizerTest"],
        harness: "function",
        namespaces: ["Plan", "RunFsm", "Gguf", "Engine", "Transport"]
      })

      const generated = await run(process.execPath, ["generate.mjs"], consumer)
      expect(generated.code, generated.stderr).toBe(0)
      const tokens = JSON.parse(generated.stdout) as Array<string>
      expect(tokens).toHaveLength(8)
      expect(tokens.join("")).toMatch(/^, there was/)

      // The README's Effect example type-checks against the shipped declarations.
      writeFileSync(
        join(consumer, "check.ts"),
        `import { Effect, Stream } from "effect"
import { generate, layerLocal, type GenerateError } from "swactor"
import { StageExecutorTest } from "swactor/testing"
const testModel: StageExecutorTest.TestModel = StageExecutorTest.defaultTestModel
void testModel
const program: Effect.Effect<void, GenerateError> = generate({ model: "m.gguf", prompt: "x", stages: 2, maxTokens: 4 }).pipe(
  Stream.runForEach((token) => Effect.sync(() => process.stdout.write(token.text))),
  Effect.provide(layerLocal({ threads: 1 }))
)
void program
`
      )
      writeFileSync(
        join(consumer, "tsconfig.json"),
        JSON.stringify({
          compilerOptions: {
            module: "NodeNext",
            moduleResolution: "NodeNext",
            target: "ES2022",
            strict: true,
            noEmit: true,
            skipLibCheck: true,
            types: [],
            typeRoots: [join(repoRoot, "node_modules", "@types")]
          },
          files: ["check.ts"]
        })
      )
      symlinkSync(join(repoRoot, "node_modules", "@types"), join(consumer, "node_modules", "@types"))
      const tsc = createRequire(import.meta.url).resolve("typescript/bin/tsc")
      const checked = await run(process.execPath, [tsc, "-p", "tsconfig.json", "--types", "node"], consumer)
      expect(checked.code, checked.stdout + checked.stderr).toBe(0)

      // The bin from the consumer's folder, as a user runs it.
      const planned = await run(
        "npx",
        ["--offline", "swactor", "plan", "--layers", "36", "--stages", "3", "--nodes", "10,11,12"],
        consumer
      )
      expect(planned.code, planned.stderr).toBe(0)
      expect(planned.stdout).toContain("36 layers over 3 stages")
      expect(existsSync(join(consumer, "node_modules", "swactor", "test"))).toBe(false)
      expect(readdirSync(pkgDir).sort()).toEqual(["README.md", "dist", "node_modules", "package.json"])
    } finally {
      rmSync(dir, { recursive: true, force: true })
    }
  }, 120_000)
})
