// `swactor run --json` and the prompt sources (P5 in specs/BEHAVIOR_GUARANTEES.md), through the real program.
import { describe, expect, it } from "vitest"
import { execFile } from "node:child_process"
import { mkdtempSync, rmSync, writeFileSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { swactorMain } from "../../src/layers/agent/AgentProcesses.js"
import { repoRoot, requireModel } from "../support/models.js"

const swactor = (args: ReadonlyArray<string>, input?: string) =>
  new Promise<{ code: number; stdout: string; stderr: string }>((resolve) => {
    const child = execFile(
      process.execPath,
      [swactorMain(), ...args],
      { cwd: repoRoot, timeout: 60_000 },
      (error, stdout, stderr) =>
        resolve({ code: error ? (typeof error.code === "number" ? error.code : 1) : 0, stdout, stderr })
    )
    child.stdin?.end(input ?? "")
  })

interface Report {
  ok: boolean
  text: string
  tokens: Array<{ id: number; text: string }>
  summary?: {
    generatedTokens: number
    promptTokens: number
    text: string
    outcome: string
    stages: Array<{ medianTokenMillis: number }>
    stageStragglers: Array<{ stageIndex: number }>
  }
  fault?: { _tag: string; message: string }
}

const base = ["run", "--stages", "1", "--threads", "1", "--max-tokens", "8", "--json"]

describe("swactor run --json", () => {
  it("one JSON document on stdout: tokens, text, summary; the prompt from stdin (--prompt -) or --prompt-file", async () => {
    const model = requireModel("stories260K.gguf")
    const fromStdin = await swactor([...base, "--model", model, "--prompt", "-"], "Once upon a time\n")
    expect(fromStdin.code, fromStdin.stderr).toBe(0)
    const report = JSON.parse(fromStdin.stdout) as Report
    expect(report.ok).toBe(true)
    expect(report.tokens).toHaveLength(8)
    expect(report.text).toBe(report.tokens.map((t) => t.text).join(""))
    expect(report.summary?.generatedTokens).toBe(8)
    expect(report.summary?.promptTokens).toBe(5)
    // The stage agent reported its decode steps' times over the control link (per-stage straggler detection).
    expect(report.summary?.stages[0]?.medianTokenMillis).toBeGreaterThan(0)
    expect(Array.isArray(report.summary?.stageStragglers)).toBe(true)
    expect(fromStdin.stderr).toBe("")
    const dir = mkdtempSync(join(tmpdir(), "swactor-json-test-"))
    try {
      writeFileSync(join(dir, "prompt.txt"), "Once upon a time\n")
      const fromFile = await swactor([...base, "--model", model, "--prompt-file", join(dir, "prompt.txt")])
      expect((JSON.parse(fromFile.stdout) as Report).tokens).toEqual(report.tokens)
    } finally {
      rmSync(dir, { recursive: true, force: true })
    }
  })

  it("a run that ends inside a multi-byte character: the flushed U+FFFD is the last token's text, not a token of id -1", async () => {
    // Synthetic vocabularies hold byte tokens; seed 3's 8th greedy token leaves a character incomplete (checked below).
    const dir = mkdtempSync(join(tmpdir(), "swactor-json-flush-"))
    try {
      const model = join(dir, "tiny.gguf")
      const synth = await swactor([
        "synth",
        "--layers",
        "2",
        "--hidden",
        "64",
        "--ffn",
        "128",
        "--heads",
        "2",
        "--vocab",
        "300",
        "--seed",
        "3",
        "-o",
        model
      ])
      expect(synth.code, synth.stderr).toBe(0)
      const ran = await swactor([...base, "--model", model, "--prompt", "Hi"])
      expect(ran.code, ran.stderr).toBe(0)
      const report = JSON.parse(ran.stdout) as Report
      expect(report.text.endsWith("\uFFFD"), "the run ends inside a character (else this case proves nothing)").toBe(
        true
      )
      expect(report.tokens).toHaveLength(8)
      expect(report.tokens.every((t) => Number.isInteger(t.id) && t.id >= 0)).toBe(true)
      expect(report.text).toBe(report.tokens.map((t) => t.text).join(""))
      expect(report.summary?.generatedTokens).toBe(8)
    } finally {
      rmSync(dir, { recursive: true, force: true })
    }
  })

  it("a fault is a JSON document too, with its tag and message, and a non-zero exit", async () => {
    const ran = await swactor([...base, "--model", "/no/such/model.gguf"])
    expect(ran.code).toBe(1)
    const report = JSON.parse(ran.stdout) as Report
    expect(report.ok).toBe(false)
    expect(report.fault?._tag).toBe("ModelLoadError")
    expect(report.fault?.message).toContain("/no/such/model.gguf")
  })
})
