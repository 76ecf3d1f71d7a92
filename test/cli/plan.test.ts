// `swactor plan` (G24 in specs/BEHAVIOR_GUARANTEES.md): the plan as a table, or the typed rejection in words with a
// non-zero exit. In-process through @effect/cli for the cases, plus the real program (dist/main.js under plain node, as
// the package's bin runs it) once each way for the exit status.
import * as Command from "@effect/cli/Command"
import * as NodeContext from "@effect/platform-node/NodeContext"
import { afterEach, assert, describe, it, vi } from "@effect/vitest"
import { Effect, Exit } from "effect"
import { execFile } from "node:child_process"
import { planCommand } from "../../src/cli/PlanCommand.js"
import { swactorMain } from "../../src/layers/agent/AgentProcesses.js"
import { repoRoot, requireModel } from "../support/models.js"

/** Runs `swactor plan <args>` in-process; returns its exit and what it printed. */
const runPlan = (...args: Array<string>) =>
  Effect.gen(function* () {
    const out: Array<string> = []
    const err: Array<string> = []
    vi.spyOn(console, "log").mockImplementation((...xs: Array<unknown>) => void out.push(xs.join(" ")))
    vi.spyOn(console, "error").mockImplementation((...xs: Array<unknown>) => void err.push(xs.join(" ")))
    const cli = Command.run(planCommand, { name: "swactor plan", version: "test" })
    const exit = yield* Effect.exit(cli(["node", "swactor-plan", ...args]).pipe(Effect.provide(NodeContext.layer)))
    vi.restoreAllMocks()
    return { exit, stdout: out.join("\n"), stderr: err.join("\n") }
  })

const runBin = (args: ReadonlyArray<string>) =>
  new Promise<{ code: number | null; stdout: string; stderr: string }>((resolve) => {
    execFile(process.execPath, [swactorMain(), ...args], { cwd: repoRoot }, (error, stdout, stderr) =>
      resolve({ code: error ? (typeof error.code === "number" ? error.code : 1) : 0, stdout, stderr })
    )
  })

describe("swactor plan", () => {
  afterEach(() => {
    vi.restoreAllMocks()
  })

  it.live("prints the stages, nodes, block ranges and edges as a table", () =>
    Effect.gen(function* () {
      const { exit, stdout } = yield* runPlan("--layers", "36", "--stages", "3", "--nodes", "10,11,12")
      assert.isTrue(Exit.isSuccess(exit))
      const lines = stdout.split("\n")
      assert.include(lines[0], "36 layers over 3 stages")
      const row = (prefix: string) => lines.find((l) => l.startsWith(prefix))?.split(/\s{2,}/)
      assert.deepStrictEqual(row("0 "), ["0", "10", "[0, 12)", "12", "#0 TokenIn", "#1 Activation"])
      assert.deepStrictEqual(row("1 "), ["1", "11", "[12, 24)", "12", "#1 Activation", "#2 Activation"])
      assert.deepStrictEqual(row("2 "), ["2", "12", "[24, 36)", "12", "#2 Activation", "#3 TokenOut"])
      assert.deepStrictEqual(row("#0 "), [
        "#0",
        "TokenIn",
        "orchestrator (node 0)",
        "stage 0 (node 10)",
        "4096 B, align 64"
      ])
      assert.deepStrictEqual(row("#3 ")?.slice(0, 4), ["#3", "TokenOut", "stage 2 (node 12)", "orchestrator (node 0)"])
    })
  )

  it.live("prints each typed rejection in words and fails", () =>
    Effect.gen(function* () {
      const base = ["--layers", "36", "--stages", "2", "--nodes", "1,2"]
      const cases: ReadonlyArray<readonly [string, string]> = [
        ["--layers 2 --stages 3 --nodes 10,11,12", "plan rejected (ModelStageLayoutMismatch): a model with 2 layers"],
        ["--layers 36 --stages 3 --nodes 10,11,12 --pool 10,11", "(UnknownNode): stage 2 is placed on node 12"],
        ["--layers 36 --stages 3 --nodes 10,11", "(MissingStage): stage 2 of 3"],
        ["--layers 36 --stages 0 --nodes 10", "(InvalidStageCount): stage count 0"],
        [[...base, "--max-tokens", "5000"].join(" "), "(InvalidMaxTokens): max tokens 5000"],
        [[...base, "--ring-alignment", "48"].join(" "), "(InvalidRingSpec)"],
        [[...base, "--activation-ring-bytes", "100"].join(" "), "(ActivationRingTooSmall)"],
        ["--layers 36 --stages 2 --nodes 1,x", '--nodes: "x" is not a node id'],
        ["--stages 2 --nodes 1,2", "give the layer count with --layers N or a GGUF file with --model PATH"]
      ]
      for (const [line, expected] of cases) {
        const args = line.split(" ")
        const { exit, stderr, stdout } = yield* runPlan(...args)
        assert.isTrue(Exit.isFailure(exit), args.join(" "))
        assert.include(stderr, expected)
        assert.strictEqual(stdout, "")
      }
    })
  )

  it.live("reads the layer count and hidden size from a GGUF with --model", () =>
    Effect.gen(function* () {
      const model = requireModel("stories260K.gguf")
      const { exit, stdout } = yield* runPlan("--model", model, "--stages", "2", "--nodes", "1,2")
      assert.isTrue(Exit.isSuccess(exit))
      assert.include(stdout, "stories260K.gguf, 5 layers over 2 stages, hidden 64 x 4 B")
      assert.match(stdout, /^0\s+1\s+\[0, 3\)/m)
      assert.match(stdout, /^1\s+2\s+\[3, 5\)/m)

      const missing = yield* runPlan("--model", "/nonexistent/model.gguf", "--stages", "2", "--nodes", "1,2")
      assert.isTrue(Exit.isFailure(missing.exit))
      assert.include(missing.stderr, "cannot read the model")
    })
  )

  it("the swactor program exits 0 with the table, and non-zero with the rejection in words", async () => {
    const [ok, bad] = await Promise.all([
      runBin(["plan", "--layers", "36", "--stages", "3", "--nodes", "10,11,12"]),
      runBin(["plan", "--layers", "36", "--stages", "3", "--nodes", "10,11,12", "--pool", "10,11,13"])
    ])
    assert.strictEqual(ok.code, 0, ok.stderr)
    assert.match(ok.stdout, /^2\s+12\s+\[24, 36\)/m)
    assert.notStrictEqual(bad.code, 0)
    assert.include(
      bad.stderr,
      "plan rejected (UnknownNode): stage 2 is placed on node 12, which is not in the candidate pool"
    )
    assert.strictEqual(bad.stdout, "")
  })
})
