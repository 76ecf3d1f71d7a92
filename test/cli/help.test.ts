// `--help` and a mistyped command line (P11 in specs/BEHAVIOR_GUARANTEES.md), through the real program
// (`node dist/main.js`, as the package's bin runs it, stdout a pipe: 100 columns): each command's help is the snapshot
// in __snapshots__/help/ (flags under headings, one entry each with its value and default, examples last), no help
// line is wider than 100 columns, and a mistyped flag or command is refused in one line naming the nearest one, with
// the exit code of every refused flag (1). The layout at other widths and the nearest-name rule run in-process.
import { describe, expect, it } from "vitest"
import { execFile } from "node:child_process"
import { join } from "node:path"
import { nearest } from "../../src/cli/CommandLine.js"
import { commandHelp, helpWidth, maxHelpWidth } from "../../src/cli/Help.js"
import { inviteDoc } from "../../src/cli/InviteCommand.js"
import { nodeDoc } from "../../src/cli/NodeCommand.js"
import { planDoc } from "../../src/cli/PlanCommand.js"
import { runDoc } from "../../src/cli/RunCommand.js"
import { serveDoc } from "../../src/cli/ServeCommand.js"
import { synthDoc } from "../../src/cli/SynthCommand.js"
import { swactorMain } from "../../src/layers/agent/AgentProcesses.js"
import { repoRoot } from "../support/models.js"

interface Ran {
  readonly code: number | null
  readonly stdout: string
  readonly stderr: string
}

const swactor = (args: ReadonlyArray<string>) =>
  new Promise<Ran>((resolve) => {
    execFile(
      process.execPath,
      [swactorMain(), ...args],
      { cwd: repoRoot, env: { ...process.env, SWACTOR_CLUSTER_TOKEN: undefined }, timeout: 60_000 },
      (error, stdout, stderr) =>
        resolve({ code: error ? (typeof error.code === "number" ? error.code : 1) : 0, stdout, stderr })
    )
  })

const widest = (text: string) => Math.max(...text.split("\n").map((line) => line.length))

/** Refused in one line on stderr, nothing on stdout, exit 1 (as every refused flag: P2). */
const expectRefused = (ran: Ran, line: string) => {
  expect(ran.stderr).toBe(line + "\n")
  expect(ran.stdout).toBe("")
  expect(ran.code).toBe(1)
}

const docs = [runDoc, serveDoc, nodeDoc, inviteDoc, planDoc, synthDoc]
const nameWidth = Math.max(...docs.map((doc) => doc.name.length))

describe("swactor --help", () => {
  it.each(["", ...docs.map((doc) => doc.name)])(
    "swactor %s --help: the snapshot, at most 100 columns, exit 0",
    async (name) => {
      const command = name === "" ? [] : [name]
      const ran = await swactor([...command, "--help"])
      expect(ran.code, ran.stderr).toBe(0)
      expect(ran.stderr).toBe("")
      expect(widest(ran.stdout)).toBeLessThanOrEqual(maxHelpWidth)
      await expect(ran.stdout).toMatchFileSnapshot(
        join(import.meta.dirname, "__snapshots__", "help", `${command[0] ?? "swactor"}.txt`)
      )
    }
  )

  it("the top-level help lists each command in one line and none of @effect/cli's own options but --version", async () => {
    const ran = await swactor(["--help"])
    for (const doc of docs) {
      expect(ran.stdout.split("\n")).toContain(`  ${doc.name.padEnd(nameWidth)}  ${doc.summary}`)
    }
    expect(ran.stdout).not.toMatch(/--wizard|--completions|--log-level|A true or false value|This setting is optional/)
    expect(ran.stdout).toContain("--version")
    // No arguments at all: the same help.
    expect((await swactor([])).stdout).toBe(ran.stdout)
  })

  it("a flag's default is the parser's: without the flag the command gets what the help says", async () => {
    const help = (await swactor(["plan", "--help"])).stdout
    expect(help).toMatch(/--max-tokens N +tokens to generate at most \[default: 16\]/)
    // `plan` prints its max tokens: the default the help shows is the one it ran with.
    const ran = await swactor(["plan", "--layers", "4", "--stages", "2", "--nodes", "1,2"])
    expect(ran.stdout).toContain("max tokens 16,")
  })

  it("wraps to a narrower width, lines up the text column, and stacks entries when too narrow", () => {
    for (const width of [100, 80, 60, 40]) {
      for (const doc of docs) {
        expect(widest(commandHelp(doc, width)), `${doc.name} at ${width}`).toBeLessThanOrEqual(width)
      }
    }
    const at80 = commandHelp(runDoc, 80).split("\n")
    // Where the text starts on each line that has a flag and its text side by side.
    const textColumns = at80.flatMap((line) => /^( {2}-.*? {2,})\S/.exec(line)?.[1]?.length ?? [])
    expect(textColumns.length).toBeGreaterThan(20)
    expect(new Set(textColumns)).toEqual(new Set([textColumns[0]]))
    // At 40 columns every text goes under its flag.
    const at40 = commandHelp(runDoc, 40).split("\n")
    expect(at40[at40.indexOf("  --max-tokens N") + 1]).toMatch(/^ {8}tokens to generate/)
  })

  it("takes the terminal's width, at most 100; 100 when not a terminal", () => {
    expect(helpWidth({ isTTY: true, columns: 72 })).toBe(72)
    expect(helpWidth({ isTTY: true, columns: 240 })).toBe(100)
    expect(helpWidth({ isTTY: false, columns: 72 })).toBe(100)
    expect(helpWidth({})).toBe(100)
  })
})

describe("a mistyped command line", () => {
  it("run --modle x: unknown flag, did you mean --model, exit 1", async () => {
    expectRefused(await swactor(["run", "--modle", "x"]), "swactor run: unknown flag --modle (did you mean --model?)")
  })

  it("serv: unknown command, did you mean serve", async () => {
    expectRefused(await swactor(["serv"]), "swactor: unknown command serv (did you mean serve?)")
  })

  it("a flag of another command, far from every flag: named, with where the flags are listed", async () => {
    expectRefused(
      await swactor(["node", "--prompt", "x"]),
      "swactor node: unknown flag --prompt (swactor node --help lists the flags)"
    )
  })

  it("after other flags, with =, with one dash, and an alias's slip", async () => {
    expectRefused(
      await swactor(["run", "--max-tokens=4", "--quiet", "--temprature", "1"]),
      "swactor run: unknown flag --temprature (did you mean --temperature?)"
    )
    expectRefused(await swactor(["run", "--sed=3"]), "swactor run: unknown flag --sed (did you mean --seed?)")
    expectRefused(await swactor(["run", "-model", "x"]), "swactor run: unknown flag -model (did you mean --model?)")
    expectRefused(
      await swactor(["serve", "--node", "a:1"]),
      "swactor serve: unknown flag --node (did you mean --nodes?)"
    )
  })

  it("what @effect/cli refuses names the flag in one line: a bad number or choice, a missing value or flag", async () => {
    expectRefused(await swactor(["run", "--stages", "abc"]), 'swactor run: --stages: "abc" is not a whole number')
    expectRefused(await swactor(["run", "--temperature=hot"]), 'swactor run: --temperature: "hot" is not a number')
    expectRefused(await swactor(["run", "--tls", "yes"]), 'swactor run: --tls: "yes" is not one of auto, always, off')
    expectRefused(await swactor(["run", "--stages"]), "swactor run: --stages needs a value (N)")
    expectRefused(await swactor(["serve"]), "swactor serve: --model PATH is required")
    expectRefused(await swactor(["run", "--quiet", "--quiet"]), "swactor run: --quiet is given more than once")
    expectRefused(
      await swactor(["run", "stray"]),
      'swactor run: unexpected argument "stray": run takes flags only (swactor run --help lists them)'
    )
  })

  it("the nearest name: a swap of neighbours is one slip; nothing when every name is far", () => {
    const names = ["--model", "--max-tokens", "--temperature", "--top-k", "--top-p", "--seed", "--help"]
    expect(nearest("--modle", names)).toBe("--model")
    // Four letters allow one slip: a swap is one, not two.
    expect(nearest("--esed", names)).toBe("--seed")
    expect(nearest("--tmeperature", names)).toBe("--temperature")
    expect(nearest("--top_k", names)).toBe("--top-k")
    expect(nearest("--MODEL", names)).toBe("--model")
    expect(nearest("--colour", names)).toBeUndefined()
    expect(nearest("--x", names)).toBeUndefined()
  })
})
